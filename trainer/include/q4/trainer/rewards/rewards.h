// Verifiable rewards for completions (docs/trainer.md#rewards): the built-in verifiers of
// reward.functions (exact / normalised match to a field, the last number, a regex, valid JSON,
// a length penalty) and reward.command, a long-lived external verifier (reward_command.h). Each
// completion gets one reward per function and their weighted sum. A reward that cannot be
// computed (a verifier timing out, crashing, answering garbage or NaN) is a RewardError, never a
// silent zero; a record missing a field a verifier reads is a ConfigError naming its line.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "q4/trainer/config/config.h"

namespace q4::trainer {

// A reward that could not be computed: the run stops (with a checkpoint) on this one line.
class RewardError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One completion to score.
struct RewardInput {
  std::string prompt;      // the prompt as the data gives it (the command's "prompt")
  std::string completion;  // the generated text (special tokens stripped by the caller)
  // The example's record, a JSON object (its fields reach the verifiers); nullptr: none.
  const nlohmann::json* fields = nullptr;
  int64_t completion_tokens = -1;  // the completion's length in tokens; kind length needs it
  std::string where;               // the example's origin for messages: "train.jsonl:12"
};

// The rewards of a batch of N completions.
struct RewardScores {
  std::vector<std::string> names;  // [F] reward.functions' names, then "command" if set
  std::vector<double> weights;     // [F]
  std::vector<std::vector<double>> per_function;  // [F][N]
  std::vector<double> total;                      // [N] sum over f of weights[f] x per_function[f]
};

class RewardCommand;

class Rewards {
 public:
  Rewards(Rewards&&) noexcept;
  Rewards& operator=(Rewards&&) noexcept;
  ~Rewards();  // stops the command (closes its stdin, waits, kills after a grace)

  // Scores every completion with every function, the command's requests pipelined in one
  // batch. ConfigError: a record lacks a field a verifier needs (check_example); RewardError:
  // the command failed (the Rewards is then unusable).
  RewardScores score(const std::vector<RewardInput>& batch);
  // check_reward_example with this run's config.
  void check_example(const nlohmann::json& fields, const std::string& where) const;
  const std::vector<std::string>& names() const { return names_; }
  bool has_command() const { return command_ != nullptr; }

 private:
  struct Verifier;
  friend Rewards make_rewards(const RewardConfig& config);
  Rewards();

  RewardConfig config_;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<Verifier>> verifiers_;  // one per reward.functions entry
  std::unique_ptr<RewardCommand> command_;            // null without reward.command
};

// Compiles the functions' regexes and starts reward.command (in reward.command_dir). ConfigError:
// a bad regex (a config that skipped validate_config), a command that cannot be started.
Rewards make_rewards(const RewardConfig& config);

// Whether one example's record holds what each function reads: a JSON object with
// `field` (a string or a number; for last_number a number or a string holding one). ConfigError
// "<where>: reward.functions[i] ('name', kind) needs the field 'answer', ..." otherwise. Starts
// nothing: --dry-run and the data loader call it on every record.
void check_reward_example(const RewardConfig& config, const nlohmann::json& fields,
                          const std::string& where);

// The logged values (TRL's names): "reward" (the mean total), "reward_std" (the mean over groups
// of `group_size` consecutive completions of their total's standard deviation, n - 1 in the
// denominator; 0 for groups of one), and per function "rewards/<name>/mean" and
// "rewards/<name>/std" (over the batch).
std::vector<std::pair<std::string, double>> reward_metrics(const RewardScores& scores,
                                                           int64_t group_size);

// The text's last number as a GSM8K answer reads ("1,234.5" -> 1234.5, "-3"); false when none.
bool last_number(const std::string& text, double* value);
// exact_match's normal form: whitespace runs as one space, trimmed, ASCII lower case.
std::string normalize_answer(const std::string& text);

}  // namespace q4::trainer
