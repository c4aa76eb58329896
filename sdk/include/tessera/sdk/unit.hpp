#pragma once
/// The FSDP seam. LibTorch modules have no forward hooks, so a model runs each FSDP unit
/// (e.g. a transformer block) through tessera::sdk::invoke(). Without a strategy hook this
/// is exactly `unit->forward(x)`; under FSDP the strategy's UnitRunner gathers the unit's
/// parameters before, frees them after, and arranges the backward-pass work.
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

using UnitForward = std::function<at::Tensor(const at::Tensor&)>;

/// Installed by a strategy on each unit module it manages.
class TESSERA_SDK_API UnitRunner {
 public:
  virtual ~UnitRunner();
  /// Runs `forward(input)` for `unit` with the strategy's pre/post-forward work around it
  /// (and may re-run it in backward for activation checkpointing).
  virtual at::Tensor run(torch::nn::Module& unit, const UnitForward& forward, const at::Tensor& input) = 0;
};

/// Install (or, with null, remove) the runner for `unit`. Called by strategies on setup.
TESSERA_SDK_API void set_unit_runner(const torch::nn::Module& unit, std::shared_ptr<UnitRunner> runner);
/// The runner installed for `unit`, or null.
TESSERA_SDK_API UnitRunner* unit_runner(const torch::nn::Module& unit);

/// Run one FSDP unit: `holder` is a torch::nn::ModuleHolder (e.g. a TORCH_MODULE type)
/// whose forward takes and returns one tensor.
template <typename ModuleHolder>
at::Tensor invoke(ModuleHolder& holder, const at::Tensor& input) {
  UnitRunner* runner = unit_runner(*holder);
  if (runner == nullptr) return holder->forward(input);
  return runner->run(*holder, [&holder](const at::Tensor& x) { return holder->forward(x); }, input);
}

}  // namespace tessera::sdk
