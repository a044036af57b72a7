// Validation loss and prompt answers; see evaluator.h.
#include "q4/trainer/output/evaluator.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "q4/data/chat.h"
#include "q4/model/sampling.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/nvtx.h"
#include "q4/trainer/runtime/signals.h"

namespace q4::trainer {

std::vector<EvalAnswer> generate_answers(model::Qwen3Model& model, const data::Tokenizer& tok,
                                         const EvalPlan& plan) {
  // Greedy, every prompt in one batch (docs/model.md#generation).
  model::SamplingParams gen;
  gen.temperature = 0;
  gen.max_new_tokens = plan.max_new_tokens;
  gen.stop_ids = {tok.im_end_id(), tok.endoftext_id()};
  std::vector<std::vector<int64_t>> prompts;
  for (const auto& prompt : plan.prompts) {
    std::vector<data::Message> msgs;
    if (!plan.chat.system_prompt.empty()) msgs.push_back({"system", plan.chat.system_prompt});
    msgs.push_back({"user", prompt});
    const auto ids =
        data::tokenize_chat(tok, msgs, /*add_generation_prompt=*/true, chat_options(plan.chat))
            .input_ids;
    prompts.emplace_back(ids.begin(), ids.end());
  }
  std::vector<EvalAnswer> out;
  if (prompts.empty()) return out;
  at::NoGradGuard no_grad;
  const std::vector<model::GenerationResult> results = model::generate(model, prompts, gen);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EvalAnswer a;
    a.prompt = plan.prompts[i];
    a.tokens = results[i].tokens;
    // The embedding may be larger than the tokenizer (151936 vs 151669 ids): an untrained model
    // can emit ids without text, shown as <id:N>.
    std::vector<data::TokenId> run;
    auto flush = [&] {
      a.answer += tok.decode_lossy(run, /*skip_special=*/true);
      run.clear();
    };
    for (int64_t id : a.tokens) {
      if (id == tok.im_end_id() || id == tok.endoftext_id()) {
        a.stopped = true;
        break;
      }
      if (id >= tok.vocab_size()) {
        flush();
        a.answer += "<id:" + std::to_string(id) + ">";
        continue;
      }
      run.push_back(static_cast<data::TokenId>(id));
    }
    flush();
    out.push_back(std::move(a));
  }
  return out;
}

std::string Validation::values_line() const {
  std::string s;
  for (const auto& [name, value] : values) {
    s += fmt::format("{}{} {:.4f}", s.empty() ? "" : ", ", name, value);
  }
  return s;
}

Evaluator::Evaluator(EvalPlan plan, bool leader) : plan_(std::move(plan)), leader_(leader) {}

void Evaluator::attach(model::Qwen3Model& model, const data::Tokenizer* tok, Objective& objective,
                       std::unique_ptr<data::Batcher> validation) {
  model_ = &model;
  tok_ = tok;
  objective_ = &objective;
  val_batcher_ = std::move(validation);
  if (val_batcher_) val_start_ = val_batcher_->state();
}

std::optional<Validation> Evaluator::validation_loss(int64_t step) {
  if (!val_batcher_ || !leader_) return std::nullopt;
  NvtxRange r("validation");
  const auto t0 = std::chrono::steady_clock::now();
  at::NoGradGuard no_grad;
  val_batcher_->restore(val_start_);
  const int64_t batches = val_batcher_->batches_per_epoch();
  at::Tensor sum;
  std::vector<std::pair<std::string, at::Tensor>> sums;  // the logged values, by name
  Validation v;
  for (int64_t i = 0; i < batches; ++i) {
    if (stop_requested()) return std::nullopt;
    const data::Batch b = val_batcher_->next();
    TORCH_INTERNAL_ASSERT(b.epoch == 0, "validation: batches ran past one pass");
    MicroBatch mb;
    mb.inputs = to_inputs(b, *model_, plan_.device);
    mb.batch = &b;
    const ObjectiveOutput o = objective_->evaluate(*model_, mb);
    const at::Tensor s = o.loss_sum.to(at::kDouble);
    sum = sum.defined() ? sum + s : s;
    for (const auto& [name, value] : o.logged) {
      const at::Tensor x = value.detach().to(at::kDouble);
      auto it =
          std::find_if(sums.begin(), sums.end(), [&name = name](const auto& e) { return e.first == name; });
      if (it == sums.end()) {
        sums.emplace_back(name, x);
      } else {
        it->second = it->second + x;
      }
    }
    v.tokens += objective_->units(b);
  }
  const auto mean = [&](const at::Tensor& t) {
    return t.defined() && v.tokens > 0 ? t.item<double>() / static_cast<double>(v.tokens)
                                       : std::numeric_limits<double>::quiet_NaN();
  };
  v.loss = mean(sum);
  for (const auto& [name, t] : sums) v.values.emplace_back(name, mean(t));
  v.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  note_validation(v.loss, step);
  return v;
}

void Evaluator::note_validation(double loss, int64_t step) {
  last_val_ = loss;
  if (std::isfinite(loss) && !(loss >= best_val_)) {
    best_val_ = loss;
    best_val_step_ = step;
  }
}

std::vector<EvalAnswer> Evaluator::answer_prompts() {
  if (plan_.prompts.empty() || !leader_) return {};
  return generate_answers(*model_, *tok_, plan_);
}

}  // namespace q4::trainer
