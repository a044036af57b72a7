// GRPO's advantages, loss and logs as TRL computes them (see grpo.h; docs/trainer.md#grpo).
#include "q4/trainer/objectives/grpo.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ostream>

#include "q4/data/prompt_dataset.h"
#include "q4/trainer/rewards/rewards.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/plan/setup.h"

namespace q4::trainer {

GroupAdvantages group_advantages(const at::Tensor& rewards, int64_t group_size,
                                 ScaleRewards scale) {
  TORCH_CHECK(group_size >= 2, "grpo.num_generations: expected >= 2 (a group), got ", group_size);
  TORCH_CHECK(rewards.dim() == 1 && rewards.size(0) % group_size == 0,
              "group_advantages: expected (groups x ", group_size, ") rewards, got ",
              rewards.sizes());
  const at::Tensor r = rewards.to(at::kFloat);
  const at::Tensor grouped = r.view({-1, group_size});                  // (P, G)
  const at::Tensor group_mean = grouped.mean(1, /*keepdim=*/true);      // (P, 1)
  const at::Tensor mean = group_mean.expand_as(grouped).reshape({-1});  // (N)
  // Unbiased (n - 1), as torch.std in TRL.
  at::Tensor std = ((grouped - group_mean).pow(2).sum(1, /*keepdim=*/true) / (group_size - 1))
                       .sqrt()
                       .expand_as(grouped)
                       .reshape({-1});  // (N)
  if (scale == ScaleRewards::kBatch) {
    const int64_t n = r.size(0);
    std = ((r - r.mean()).pow(2).sum() / (n - 1)).sqrt().expand_as(r).contiguous();
  }
  GroupAdvantages out;
  out.advantages = r - mean;
  if (scale != ScaleRewards::kNone) out.advantages = out.advantages / (std + kGrpoStdEpsilon);
  out.std = std;
  return out;
}

void GrpoLossOptions::validate() const {
  TORCH_CHECK(epsilon_low >= 0 && epsilon_low <= 1, "grpo.epsilon: expected [0, 1], got ",
              epsilon_low);
  TORCH_CHECK(epsilon_high >= 0 && std::isfinite(epsilon_high),
              "grpo.epsilon_high: expected >= 0, got ", epsilon_high);
  TORCH_CHECK(beta >= 0 && std::isfinite(beta), "grpo.beta: expected >= 0, got ", beta);
  TORCH_CHECK(max_completion_length >= 1, "grpo.max_completion_length: expected >= 1, got ",
              max_completion_length);
}

GrpoLossOptions grpo_loss_options(const GrpoConfig& c) {
  GrpoLossOptions o;
  o.loss_type = c.loss_type;
  o.epsilon_low = c.epsilon;
  o.epsilon_high = c.epsilon_high > 0 ? c.epsilon_high : c.epsilon;
  o.beta = c.beta;
  o.max_completion_length = c.max_completion_length;
  return o;
}

namespace {

// sum(x * mask) / max(sum(mask), 1), detached.
at::Tensor grpo_masked_mean(const at::Tensor& x, const at::Tensor& mask) {
  return ((x.to(at::kFloat) * mask).sum() / mask.sum().clamp_min(1)).detach();
}

}  // namespace

GrpoLossOutput grpo_loss(const GrpoTokens& t, const GrpoLossOptions& o) {
  o.validate();
  TORCH_CHECK(t.logps.dim() == 2, "grpo_loss: expected (B, L) logps, got ", t.logps.sizes());
  const int64_t B = t.logps.size(0);
  TORCH_CHECK(t.mask.sizes() == t.logps.sizes(), "grpo_loss: mask ", t.mask.sizes(), " and logps ",
              t.logps.sizes(), " differ");
  TORCH_CHECK(t.advantages.dim() == 1 && t.advantages.size(0) == B, "grpo_loss: expected (", B,
              ") advantages, got ", t.advantages.sizes());
  TORCH_CHECK(o.beta == 0 || t.ref_logps.defined(), "grpo_loss: grpo.beta ", o.beta,
              " needs the reference's log-probabilities");
  const at::Tensor mask = t.mask.to(at::kFloat);
  const at::Tensor logp = t.logps.to(at::kFloat);
  const at::Tensor old = t.old_logps.defined() ? t.old_logps.to(at::kFloat) : logp.detach();
  const at::Tensor adv = t.advantages.to(at::kFloat).unsqueeze(1);  // (B, 1)
  const at::Tensor ratio = (logp - old).exp();
  const at::Tensor clipped = ratio.clamp(1 - o.epsilon_low, 1 + o.epsilon_high);
  at::Tensor per_token = -at::min(ratio * adv, clipped * adv);  // (B, L)
  GrpoLossOutput out;
  if (o.beta != 0) {
    const at::Tensor d = t.ref_logps.to(at::kFloat) - logp;
    const at::Tensor kl = d.exp() - d - 1;  // k3: unbiased, >= 0
    per_token = per_token + o.beta * kl;
    out.logged.emplace_back("kl", grpo_masked_mean(kl, mask));
  }
  const at::Tensor summed = per_token * mask;
  switch (o.loss_type) {
    case GrpoLossType::kGrpo:
      out.loss_sum = (summed.sum(1) / mask.sum(1).clamp_min(1)).sum();
      out.units = at::scalar_tensor(static_cast<double>(B), mask.options());
      break;
    case GrpoLossType::kDapo:
      out.loss_sum = summed.sum();
      out.units = mask.sum();
      break;
    case GrpoLossType::kDrGrpo:
      out.loss_sum = summed.sum();
      out.units =
          at::scalar_tensor(static_cast<double>(B * o.max_completion_length), mask.options());
      break;
  }
  const at::Tensor r = ratio.detach();
  const at::Tensor a = adv.detach();
  const at::Tensor low = (r < 1 - o.epsilon_low).logical_and(a < 0);
  const at::Tensor high = (r > 1 + o.epsilon_high).logical_and(a > 0);
  out.logged.emplace_back("clip_ratio", grpo_masked_mean(low.logical_or(high), mask));
  out.logged.emplace_back("clip_ratio/low_mean", grpo_masked_mean(low, mask));
  out.logged.emplace_back("clip_ratio/high_mean", grpo_masked_mean(high, mask));
  if (t.entropy.defined()) out.logged.emplace_back("entropy", grpo_masked_mean(t.entropy, mask));
  out.logged.emplace_back("tokens", mask.sum().detach());
  return out;
}

at::Tensor completion_mask(const std::vector<int64_t>& lengths, const std::vector<bool>& truncated,
                           int64_t max_len, bool mask_truncated) {
  TORCH_CHECK(truncated.size() == lengths.size(), "completion_mask: ", lengths.size(),
              " lengths but ", truncated.size(), " truncation flags");
  const int64_t B = static_cast<int64_t>(lengths.size());
  at::Tensor m = at::zeros({B, max_len}, at::kFloat);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lengths[b] >= 0 && lengths[b] <= max_len, "completion_mask: length ", lengths[b],
                " of completion ", b, " is outside [0, ", max_len, "]");
    if (mask_truncated && truncated[b]) continue;
    m[b].narrow(0, 0, lengths[b]).fill_(1);
  }
  return m;
}

std::vector<std::pair<std::string, double>> grpo_rollout_stats(
    const std::vector<int64_t>& lengths, const std::vector<bool>& truncated,
    const at::Tensor& rewards, const GroupAdvantages& advantages, int64_t group_size,
    const at::Tensor& per_function, const std::vector<std::string>& names) {
  TORCH_CHECK(!lengths.empty() && truncated.size() == lengths.size(),
              "grpo_rollout_stats: expected one truncation flag per completion");
  std::vector<std::pair<std::string, double>> s;
  double sum = 0, terminated_sum = 0, clipped = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    sum += static_cast<double>(lengths[i]);
    clipped += truncated[i] ? 1 : 0;
    terminated_sum += truncated[i] ? 0 : static_cast<double>(lengths[i]);
  }
  const double n = static_cast<double>(lengths.size());
  s.emplace_back("completions/mean_length", sum / n);
  s.emplace_back("completions/min_length",
                 static_cast<double>(*std::min_element(lengths.begin(), lengths.end())));
  s.emplace_back("completions/max_length",
                 static_cast<double>(*std::max_element(lengths.begin(), lengths.end())));
  s.emplace_back("completions/clipped_ratio", clipped / n);
  s.emplace_back("completions/mean_terminated_length",
                 clipped == n ? 0.0 : terminated_sum / (n - clipped));
  const at::Tensor r = rewards.to(at::kDouble).cpu();
  s.emplace_back("reward", r.mean().item<double>());
  s.emplace_back("reward_std", advantages.std.to(at::kDouble).mean().item<double>());
  const at::Tensor g = r.view({-1, group_size});
  const at::Tensor zero_std = (g.amax(1) == g.amin(1)).to(at::kDouble);
  s.emplace_back("frac_reward_zero_std", zero_std.mean().item<double>());
  if (per_function.defined()) {
    TORCH_CHECK(
        per_function.dim() == 2 && per_function.size(1) == static_cast<int64_t>(names.size()),
        "grpo_rollout_stats: expected (N, ", names.size(), ") rewards per function, got ",
        per_function.sizes());
    const at::Tensor f = per_function.to(at::kDouble).cpu();
    for (size_t k = 0; k < names.size(); ++k) {
      const at::Tensor col = f.select(1, static_cast<int64_t>(k));
      s.emplace_back("rewards/" + names[k] + "/mean", col.mean().item<double>());
      const double var = (col - col.mean()).pow(2).sum().item<double>() /
                         std::max<double>(1.0, static_cast<double>(col.size(0) - 1));
      s.emplace_back("rewards/" + names[k] + "/std", std::sqrt(var));
    }
  }
  return s;
}

void check_grpo_prompt_length(int64_t prompt_tokens, int64_t max_completion_length,
                              int64_t seq_len, const std::string& where) {
  const int64_t need = prompt_tokens + max_completion_length;
  if (need <= seq_len) return;
  throw ConfigError(where + ": the prompt's " + std::to_string(prompt_tokens) +
                    " tokens + grpo.max_completion_length " +
                    std::to_string(max_completion_length) + " = " + std::to_string(need) +
                    " exceed train.seq_len " + std::to_string(seq_len) +
                    " (raise train.seq_len, lower grpo.max_completion_length or shorten the "
                    "prompt)");
}

std::string grpo_summary(const GrpoConfig& g) {
  const GrpoLossOptions o = grpo_loss_options(g);
  std::string s = fmt::format(
      "grpo: {} completions per prompt of up to {} tokens (temperature {}, top_p {}, top_k {}); "
      "loss {}, ratio clipped to [{}, {}], scale_rewards {}, {} update{} per generation batch; ",
      g.num_generations, g.max_completion_length, g.temperature, g.top_p, g.top_k,
      to_string(g.loss_type), 1 - o.epsilon_low, 1 + o.epsilon_high, to_string(g.scale_rewards),
      g.num_iterations, g.num_iterations == 1 ? "" : "s");
  return s + (g.beta > 0 ? fmt::format("KL to the starting model x {}", g.beta)
                         : std::string("beta 0: no reference model"));
}

void check_grpo_prompts(const PromptCheckPlan& c, std::ostream& out) {
  const auto tok = as_input_error("model.tokenizer",
                                  [&] { return data::Tokenizer::from_file(c.tokenizer); });
  const data::DatasetOptions& options = c.dataset;
  int64_t prompts = 0;
  for (const auto& [key, files] :
       {std::pair<const char*, const std::vector<std::string>*>{"data.files", &c.files},
        {"data.eval_files", &c.eval_files}}) {
    for (const auto& f : *files) {
      const data::PromptDataset d =
          as_input_error(key, [&] { return data::load_prompt_dataset(f, tok, options); });
      out << d.summary.to_string() << "\n";
      for (const auto& r : d.prompts) {
        const std::string where = f + ":" + std::to_string(r.source_line);
        check_grpo_prompt_length(static_cast<int64_t>(r.prompt_ids.size()),
                                 c.max_completion_length, c.seq_len, where);
        // Every field a verifier reads, as the run checks it before its first step.
        check_reward_example(c.reward, nlohmann::json::parse(r.fields.dump()), where);
      }
      prompts += static_cast<int64_t>(d.prompts.size());
    }
  }
  if (prompts == 0) throw ConfigError("config key data.files: no prompts (train.objective grpo)");
}

}  // namespace q4::trainer
