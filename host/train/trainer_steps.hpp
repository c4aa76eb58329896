#pragma once
// What the trainer's own source files share (trainer.cpp: setup and the fit loop;
// evaluation.cpp; lr_range_test.cpp; predictions.cpp; trainer_checkpoint.cpp): not an interface.
#include <signal.h>

#include <map>
#include <string>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "train/trainer.hpp"

namespace tessera::host {

/// A log line: `head`, then "  name value" for each metric.
std::string metrics_line(const std::string& head, const std::map<std::string, double>& metrics, int precision = 4);

/// A batch's labels, what [trainer] loss_average = "labels" averages over: its integer targets
/// that are not -100 (Hugging Face's num_items_in_batch), else its rows. A float scalar tensor.
at::Tensor label_count(const sdk::Batch& batch);

/// LibTorch's dtype errors inside a step under autocast, explained: the classic is LibTorch
/// 1.13's CPU autocast leaving LayerNorm out of its cast lists, so a LayerNorm fed by a bf16
/// Linear output meets its fp32 weight. Other errors are rethrown unchanged (call it from a
/// catch block).
void explain_step_failure(const c10::Error& error, const std::string& step, const std::string& precision,
                          const c10::Device& device, torch::nn::Module& network);

template <typename Step>
auto Trainer::run_step(const char* name, Step&& step) {
  try {
    return step();
  } catch (const c10::Error& error) {
    explain_step_failure(error, name, precision_->precision(), strategy_->root_device(), *model_->network());
    throw;
  }
}

/// SIGINT and SIGTERM handlers for one fit (or range test), the previous ones restored after:
/// the first signal asks the loop to stop at the end of the step, a second ends the process.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  /// The signal received (SIGINT, SIGTERM), 0 if none.
  static int received();

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

}  // namespace tessera::host
