#pragma once
// The learning-rate schedule the trainer applies before each optimizer step: linear warmup
// from lr/warmup_steps to lr, then half a cosine from lr towards min_lr, a straight line to
// min_lr (Hugging Face's linear schedule with warmup), or constant.
// Its state goes into checkpoints as Lightning's "lr_schedulers" entry (a LambdaLR-like dict).
#include <cstdint>

#include "config/config.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::host {

class LRSchedule {
 public:
  /// `total_steps`: the optimizer steps of the whole run (max_steps or epochs x steps/epoch).
  LRSchedule(const ScheduleSettings& settings, double base_lr, std::int64_t total_steps);

  /// The learning rate for optimizer step `step` (0-based); cosine and linear reach min_lr at step total_steps.
  double lr(std::int64_t step) const;

  /// {"base_lrs", "last_epoch", "_last_lr", "schedule", "warmup_steps", "min_lr", "total_steps"}
  /// after `steps_done` optimizer steps (PyTorch's LambdaLR counts steps in last_epoch).
  sdk::Checkpoint state_dict(std::int64_t steps_done) const;

  /// Checks a saved state against this schedule and `steps_done` (the checkpoint's
  /// global_step). Returns "" when they agree, else a sentence saying what changed (the
  /// configured schedule is the one applied; a change is allowed, e.g. a longer run).
  std::string compare(const sdk::Checkpoint& state, std::int64_t steps_done, const std::string& where) const;

 private:
  ScheduleSettings settings_;
  double base_lr_;
  std::int64_t total_steps_;
};

}  // namespace tessera::host
