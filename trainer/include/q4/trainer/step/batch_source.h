// What a step draws its micro-batches from (docs/design.md#trainer-components, "One step"): the
// training data's packing batcher, or any other source of batches (generated rollouts, a test's
// fixed list) with the same shape.
#pragma once

#include "q4/data/dataset.h"

namespace q4::trainer {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // The next micro-batch (a data-parallel step draws every rank's, in the order one process
  // would take them).
  virtual data::Batch next() = 0;
  // Whether next() yields only this rank's micro-batches (GRPO's rollouts, sampled per rank):
  // a data-parallel step then draws grad_accum of them and sums the counts over the ranks.
  virtual bool per_rank() const { return false; }
};

// The run's batcher as a batch source.
class BatcherSource final : public BatchSource {
 public:
  explicit BatcherSource(data::Batcher& batcher) : batcher_(batcher) {}
  data::Batch next() override { return batcher_.next(); }

 private:
  data::Batcher& batcher_;
};

}  // namespace q4::trainer
