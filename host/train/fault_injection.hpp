#pragma once
// Test-only faults, read once from TESSERA_FAULT_INJECT="rank=R,step=S,kind=K[,seconds=N]
// [,param=NAME][,attempt=N]": the failure tests' way to make rank R exit, be killed, hang, get
// Ctrl-C, throw, save slowly or get a NaN gradient at step S (attempt=N: only under torchrun's
// N-th attempt, TORCHELASTIC_RESTART_COUNT). Unset, every call does nothing.
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <torch/nn/module.h>

#include "loggers/run_log.hpp"

namespace tessera::host {

class FaultInjection {
 public:
  FaultInjection(std::int64_t rank, RunLog& log);

  /// At the end of optimizer step `step`, or while saving it (`saving`: kind=slow_save): kinds
  /// exit, kill, hang, sigint, error and slow_save.
  void at_step(std::int64_t step, bool saving = false) const;
  /// kind=nan_grad: a NaN in this rank's gradient of parameter `param` before it is reduced,
  /// during the backward of step `step` (`global_step()` says where training stands).
  void poison_gradient(torch::nn::Module& network, std::function<std::int64_t()> global_step) const;

 private:
  bool mine(const char* kind) const;
  std::map<std::string, std::string> fields_;
  std::int64_t rank_;
  RunLog& log_;
};

}  // namespace tessera::host
