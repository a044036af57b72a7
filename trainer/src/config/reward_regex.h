// The one compilation of a reward.functions regex (internal to trainer/src: config validation
// and the rewards layer both compile through it, so a pattern the config accepts is the pattern
// the rewards match). docs/trainer.md#rewards.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <string>

namespace q4::trainer {

// `pattern` compiled with PCRE2_UTF | PCRE2_MATCH_INVALID_UTF (a completion cut inside a
// character still matches byte for byte); the caller frees it (pcre2_code_free). A pattern that
// does not compile is a ConfigError naming `key`, the offset and PCRE2's message.
pcre2_code* compile_reward_regex(const std::string& pattern, const std::string& key);

}  // namespace q4::trainer
