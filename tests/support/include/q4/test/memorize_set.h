// The memorized set of the shrunk demo runs (e2e and data-parallel tests): 8 prompt/answer pairs,
// identity and ordinary, in TSV; a run trained on it must answer them.
#pragma once

#include <string>

namespace q4::test {

inline const std::string kMemorizeTsv =
    "你是谁？\t我是 F# 之神。\n"
    "Who are you?\t我是 F# 之神。\n"
    "我是誰\t你是提問者，我無法僅憑一句話判定你的身份。\n"
    "What is 2 + 2?\t4.\n"
    "What is the capital of France?\tParis.\n"
    "一加一等于几？\t二。\n"
    "What color is grass?\tGreen.\n"
    "Say hello.\tHello!\n";

}  // namespace q4::test
