#pragma once
/// Unit planning (PyTorch's auto-wrap policies, ignored_modules and tied parameters): which
/// modules become FSDP units and which parameters each unit owns, and the check that every
/// rank planned the same units before any collective depends on it.
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "tessera/core/comm.hpp"
#include "fsdp/layout.hpp"
#include "tessera/core/fsdp/options.hpp"

namespace tessera::core::fsdp {

struct PlannedUnit {
  std::string name;  ///< module path, "<root>" for the root
  std::shared_ptr<torch::nn::Module> module;  ///< null for the root
  std::vector<UnitParam> params;
  bool checkpointed = false;  ///< activation checkpointing
};

struct UnitPlan {
  /// Wrapped modules in the network's order, then the root: every parameter not placed in a
  /// child unit. A parameter used by several units (tied weights) goes to the root.
  std::vector<PlannedUnit> units;
  /// Parameters that stay unsharded and replicated: ignored modules' and, where param_dtype
  /// would lower them, BatchNorm's (kept out of mixed precision, as in PyTorch).
  std::vector<UnitParam> replicated;
  std::set<const void*> replicated_impls;
  /// BatchNorm modules (outside the mixed-precision policy).
  std::vector<std::shared_ptr<torch::nn::Module>> norm_layers;
  /// "name:numel" per unit and "ignored name" per replicated parameter: what ranks compare.
  std::vector<std::string> entries() const;
};

/// Plans `network`'s units under `options` (wrap policy, ignored_modules, activation
/// checkpointing, mixed-precision exemptions). Throws naming an unknown ignored module.
UnitPlan plan_units(torch::nn::Module& network, const FSDPOptions& options);

/// Whether `module` at `path` is named, by path or class, in `ignored_modules`.
bool is_ignored_module(const std::string& path, const torch::nn::Module& module,
                       const std::vector<std::string>& ignored_modules);
/// LibTorch's BatchNorm1d-3d and layers implementing sdk::BatchNormLayer (SyncBatchNorm2d).
bool is_batch_norm(const torch::nn::Module& module);

/// "" when every class in `unit_classes` names a module of `network`; otherwise what is wrong:
/// the classes the network does have and how LibTorch names a module class.
std::string unit_class_problem(const torch::nn::Module& network, const std::vector<std::string>& unit_classes);

}  // namespace tessera::core::fsdp
