// End-to-end tests of tools/q4tok (built into Q4_BIN_DIR): encode, decode and chat on the golden
// fixtures through stdin/stdout, and exit code 2 with a line-numbered message on bad input. Three
// suites by subcommand (Q4tok: encode/decode, Q4tokChat, Q4tokData), so that ctest -j spreads the
// tool's process starts, which dominate the ASan run (scripts/sanitize.sh).
// The tool must be built first (`cmake --build <dir> --target q4tok`); a missing binary fails.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"

namespace q4::data {
namespace {

using json = nlohmann::json;

struct ToolRun {
  int exit_code;
  std::string out;
};

// Runs `q4tok <args>` with `input` on stdin; stdout (and stderr when merge_err) captured.
ToolRun run_q4tok(const std::string& args, const std::string& input, bool merge_err = false) {
  const std::string bin = std::string(Q4_BIN_DIR) + "/q4tok";
  if (!test::file_exists(bin)) {
    ADD_FAILURE() << bin << " not found: build the q4tok target first";
    return {-1, ""};
  }
  const test::TempFile in(".in", input);
  const std::string cmd = bin + " " + args + " --tokenizer " + test::kQwen3TokenizerPath + " < " +
                          in.path() + (merge_err ? " 2>&1" : "");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    ADD_FAILURE() << "popen failed: " << cmd;
    return {-1, ""};
  }
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

TEST(Q4tok, EncodeDecodeGolden) {
  test::qwen3_tokenizer();  // fails loudly when the tokenizer file is missing
  const json gold = test::read_json(Q4_FIXTURES_DIR "/tokenizer_golden.json");
  std::string enc_in, dec_in;
  for (const auto& c : gold) {
    enc_in += c["text"].dump() + "\n";
    dec_in += c["ids"].dump() + "\n";
  }
  const ToolRun e = run_q4tok("encode", enc_in);
  ASSERT_EQ(e.exit_code, 0);
  const auto enc = lines_of(e.out);
  ASSERT_EQ(enc.size(), gold.size());
  for (size_t k = 0; k < gold.size(); ++k) EXPECT_EQ(json::parse(enc[k]), gold[k]["ids"]) << k;
  const ToolRun d = run_q4tok("decode", dec_in);
  ASSERT_EQ(d.exit_code, 0);
  const auto dec = lines_of(d.out);
  ASSERT_EQ(dec.size(), gold.size());
  const Tokenizer& tok = test::qwen3_tokenizer();
  for (size_t k = 0; k < gold.size(); ++k) {
    EXPECT_EQ(json::parse(dec[k]).get<std::string>(),
              tok.decode(gold[k]["ids"].get<std::vector<TokenId>>()));
  }
}

TEST(Q4tokChat, ChatGolden) {
  test::qwen3_tokenizer();
  const json gold = test::read_json(Q4_FIXTURES_DIR "/chat_template_golden.json");
  std::string in;
  for (const auto& c : gold) in += json({{"messages", c["messages"]}}).dump() + "\n";
  const ToolRun r = run_q4tok("chat", in);
  ASSERT_EQ(r.exit_code, 0);
  const auto out = lines_of(r.out);
  ASSERT_EQ(out.size(), gold.size());
  for (size_t k = 0; k < gold.size(); ++k) {
    const json j = json::parse(out[k]);
    EXPECT_EQ(j["rendered"], gold[k]["rendered"]);
    EXPECT_EQ(j["ids"], gold[k]["ids"]);
    // Mask: 1 exactly on the answer tokens and <|im_end|> of each assistant turn.
    const auto ids = j["ids"].get<std::vector<int64_t>>();
    const auto mask = j["mask"].get<std::vector<int>>();
    ASSERT_EQ(mask.size(), ids.size());
    EXPECT_EQ(mask.back(), 0);
    EXPECT_EQ(mask[mask.size() - 2], 1);
    EXPECT_EQ(ids[mask.size() - 2], 151645);
  }
}

TEST(Q4tok, BadInputExitsWithCode2AndLine) {
  test::qwen3_tokenizer();
  const ToolRun r = run_q4tok("encode", "\"ok\"\n[1, 2]\n", /*merge_err=*/true);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("stdin:2"), std::string::npos) << r.out;
}

// Ids that are not int32 token ids were converted silently (1.5, true and
// 4294967297 to 1; 1e23 to INT32_MIN).
TEST(Q4tok, DecodeRejectsIdsThatAreNotTokenIds) {
  test::qwen3_tokenizer();
  for (const char* bad :
       {"[4294967297]", "[1.5]", "[true]", "[1e23]"}) {  // one tokenizer load each
    const ToolRun r = run_q4tok("decode", std::string("[9707]\n") + bad + "\n", true);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.out;
    EXPECT_NE(r.out.find("stdin:2"), std::string::npos) << bad << ": " << r.out;
  }
  const ToolRun ok = run_q4tok("decode", "[9707, 11]\n");
  EXPECT_EQ(ok.exit_code, 0);
  EXPECT_EQ(ok.out, "\"Hello,\"\n");
}

// `q4tok data --show N`: the first N examples of every format as the model sees them: the
// rendered chat template (or the raw text) with the trained tokens between the marks.
TEST(Q4tokData, DataShowMarksTrainedTokensInEveryFormat) {
  test::qwen3_tokenizer();
  struct Case {
    std::string suffix, content, expect;
  };
  const std::vector<Case> cases = {
      {".tsv", "Who are you?\tA test.\nSecond\tTwo\n",
       "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n\u27e6A test.<|im_end|>"
       "\u27e7\n"},
      {".jsonl",
       R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})"
       "\n",
       "<|im_start|>assistant\n\u27e6Hello<|im_end|>\u27e7\n"},
      {".json", R"([{"instruction": "Say hi", "input": "", "output": "Hi!"}])",
       "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n\u27e6Hi!<|im_end|>\u27e7"},
      // Text: every token trained but the first (nothing predicts it), <|endoftext|> included.
      {".txt", "Hello world\n", "Hello\u27e6 world<|endoftext|>\u27e7"},
  };
  for (const auto& c : cases) {
    const test::TempFile f(c.suffix, c.content);
    const ToolRun r = run_q4tok("data --show 1 --data " + f.path(), "", /*merge_err=*/true);
    EXPECT_EQ(r.exit_code, 0) << c.suffix << ": " << r.out;
    EXPECT_NE(r.out.find("--- example 1 ("), std::string::npos) << c.suffix << ": " << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.suffix << ": " << r.out;
    EXPECT_EQ(r.out.find("--- example 2"), std::string::npos) << c.suffix << ": " << r.out;
  }
}

// `q4tok data` says what truncation to --seq-len does, with the counts and the warning the trainer
// prints: a long text file is split into windows by default (nothing lost, no warning); cut_right
// loses most of it, and past 1% of the supervised tokens the warning names the settings.
TEST(Q4tokData, DataCountsWhatTruncationLoses) {
  test::qwen3_tokenizer();
  std::string text;
  for (int i = 0; i < 40; ++i) text += "Sentence number " + std::to_string(i) + " of the text.\n";
  const test::TempFile f(".txt", text);
  const ToolRun split = run_q4tok("data --seq-len 16 --data " + f.path(), "", /*merge_err=*/true);
  EXPECT_EQ(split.exit_code, 0) << split.out;
  EXPECT_NE(split.out.find("1 examples from 40 lines"), std::string::npos) << split.out;
  EXPECT_NE(split.out.find("truncation to 16 tokens (auto: plain text split into windows"),
            std::string::npos)
      << split.out;
  EXPECT_NE(split.out.find("1 split into "), std::string::npos) << split.out;
  EXPECT_NE(split.out.find("; 0 of "), std::string::npos) << split.out;
  EXPECT_EQ(split.out.find("warning"), std::string::npos) << split.out;
  const ToolRun cut = run_q4tok("data --seq-len 16 --truncation cut_right --data " + f.path(), "",
                                /*merge_err=*/true);
  EXPECT_EQ(cut.exit_code, 0) << cut.out;
  EXPECT_NE(cut.out.find("(1 truncated)"), std::string::npos) << cut.out;
  EXPECT_NE(cut.out.find("warning: truncation to 16 tokens (cut_right) loses "), std::string::npos)
      << cut.out;
  EXPECT_NE(cut.out.find("raise --seq-len (train.seq_len), or for plain text set --truncation "
                         "(data.truncation) auto or split"),
            std::string::npos)
      << cut.out;
  // By lines: 40 short documents, none longer than the window.
  const ToolRun lines =
      run_q4tok("data --seq-len 16 --text-unit line --data " + f.path(), "", /*merge_err=*/true);
  EXPECT_EQ(lines.exit_code, 0) << lines.out;
  EXPECT_NE(lines.out.find("40 examples from 40 lines"), std::string::npos) << lines.out;
  EXPECT_NE(lines.out.find("40 examples, 40 kept (0 truncated)"), std::string::npos) << lines.out;
  EXPECT_EQ(run_q4tok("data --text-unit page --data " + f.path(), "").exit_code, 2);
}

TEST(Q4tokChat, ChatTemplateAndThinkingFlags) {
  test::qwen3_tokenizer();
  // chat: the template and enable_thinking reach the generation prompt; tools are read in order.
  const std::string conv =
      R"({"tools": [{"name": "f", "b": 1.0, "a": null}], "messages": [{"role": "user", "content": "Hi"}]})"
      "\n";
  ToolRun r =
      run_q4tok("chat --add-generation-prompt --chat-template qwen3 --enable-thinking false", conv,
                /*merge_err=*/true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const std::string rendered = json::parse(r.out)["rendered"].get<std::string>();
  EXPECT_NE(rendered.find("<tools>\n{\"name\": \"f\", \"b\": 1.0, \"a\": null}\n</tools>"),
            std::string::npos)
      << rendered;
  EXPECT_EQ(rendered.substr(rendered.size() - 41),
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  r = run_q4tok("chat --add-generation-prompt --chat-template qwen3-2507-thinking", conv);
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_NE(json::parse(r.out)["rendered"].get<std::string>().find("assistant\n<think>\n"),
            std::string::npos);
  // data --show: the hybrid template renders the answer's think block, trained.
  const test::TempFile f(
      ".jsonl",
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "reasoning_content": "R", "content": "A"}]})"
      "\n");
  r = run_q4tok("data --show 1 --chat-template qwen3 --data " + f.path(), "", true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("<|im_start|>assistant\n\u27e6<think>\nR\n</think>\n\nA<|im_end|>\u27e7"),
            std::string::npos)
      << r.out;
  // The default (auto, no template beside the tokenizer) is 2507 Instruct: reasoning dropped,
  // and the summary says so.
  r = run_q4tok("data --show 1 --data " + f.path(), "", true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("<|im_start|>assistant\n\u27e6A<|im_end|>\u27e7"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("1 assistant turns' reasoning not rendered"), std::string::npos) << r.out;
  // Bad input: an unknown template name, a tool call without a name.
  r = run_q4tok("chat --chat-template chatml", conv, true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("--chat-template"), std::string::npos) << r.out;
  r = run_q4tok(
      "chat",
      R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]})"
      "\n",
      true);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.out.find("stdin:1: messages[0].tool_calls[0].function: a tool call without a "
                       "\"name\""),
            std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace q4::data
