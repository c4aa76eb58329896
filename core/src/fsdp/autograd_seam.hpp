#pragma once
/// Where FSDP meets autograd without module hooks: the identity on a unit's outputs whose
/// backward re-gathers the unit first (pre-backward), activation checkpointing (recompute in
/// backward with the forward's RNG and autocast state), and the gradient-ready hooks on the
/// parameters' accumulators (post-backward). Written against UnitHooks, not an engine.
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/unit.hpp"
#include "tessera/sdk/unit.hpp"

namespace tessera::core::fsdp {

/// What the seam calls back (the scheduler implements it).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  /// Before `unit`'s backward runs: gather its parameters, attach unsharded gradients.
  virtual void pre_backward(FSDPUnit& unit) = 0;
  /// Every parameter gradient of `unit` has been accumulated this backward.
  virtual void post_backward(FSDPUnit& unit) = 0;
};

/// `outputs`, through an identity whose backward calls hooks.pre_backward(unit) before any
/// gradient flows into the unit. Outputs that need no gradient pass unchanged.
std::vector<at::Tensor> attach_pre_backward(UnitHooks& hooks, FSDPUnit& unit, const std::vector<at::Tensor>& outputs);

/// `inputs`, through an identity whose backward calls hooks.post_backward(unit) once the
/// unit's backward has produced their gradients: for a unit with no trainable parameter (a
/// frozen block), whose parameters' accumulators never fire, and for one with frozen and
/// trainable ones (FSDPUnit::has_frozen), where it counts down with the accumulators. Inputs
/// that need no gradient pass unchanged.
std::vector<at::Tensor> attach_post_backward(UnitHooks& hooks, FSDPUnit& unit, const std::vector<at::Tensor>& inputs);

/// Activation checkpointing: runs `forward(inputs)` keeping no activations; in backward,
/// calls hooks.pre_backward(unit), re-runs `forward` with the RNG state (CPU and the inputs'
/// device) and autocast state of the first run, and back-propagates through it. Gradients
/// reach every input that requires one. `forward` lives as long as the graph does.
std::vector<at::Tensor> checkpointed_forward(UnitHooks& hooks, FSDPUnit& unit, sdk::UnitFunction forward,
                                             const std::vector<at::Tensor>& inputs);

/// (Re-)installs hooks on the grad accumulators of `unit`'s parameters that count down to
/// hooks.post_backward(unit); call again after set_data changed a parameter's dtype or device.
void install_post_backward_hooks(UnitHooks& hooks, FSDPUnit& unit);

}  // namespace tessera::core::fsdp
