#pragma once
/// Precision plugins (Lightning's Precision / FSDPPrecision), selected by Lightning's
/// strings: "32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed".
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "tessera/sdk/guard.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

class Strategy;

/// What FSDP strategies cast to (PyTorch's MixedPrecision / FSDP2's MixedPrecisionPolicy).
/// Unset means "keep the parameter's own dtype".
struct MixedPrecisionPolicy {
  c10::optional<c10::ScalarType> param_dtype;   ///< compute and all-gather dtype
  c10::optional<c10::ScalarType> reduce_dtype;  ///< gradient reduce-scatter / all-reduce dtype
  c10::optional<c10::ScalarType> buffer_dtype;
  bool keep_low_precision_grads = false;
};

class TESSERA_SDK_API Precision : public PluginObject {
 public:
  ~Precision() override;

  /// The precision string, e.g. "bf16-mixed".
  virtual std::string precision() const = 0;
  /// Throws sdk::Error naming the precision, the device and what would work, if `device`
  /// cannot compute in this precision. Called by the host before any training.
  virtual void check_device(const c10::Device& device) const = 0;
  virtual MixedPrecisionPolicy mixed_precision_policy() const = 0;

  /// Casts parameters/buffers for the *-true precisions; no-op for mixed.
  virtual void convert_module(torch::nn::Module& module) = 0;
  virtual at::Tensor convert_input(const at::Tensor& data) = 0;
  virtual at::Tensor convert_output(const at::Tensor& data) = 0;
  /// Scope of forward/*_step (autocast for the mixed precisions).
  virtual GuardPtr forward_context() = 0;
  /// Scope of Module::configure_model (default dtype for the *-true precisions).
  virtual GuardPtr module_init_context() = 0;

  /// The loss actually back-propagated (scaled by the grad scaler, if any).
  virtual at::Tensor pre_backward(const at::Tensor& loss) = 0;
  /// Divides the optimizer's gradients by the loss scale once per step, and records
  /// whether any rank saw inf/NaN (agreed through `strategy.reduce`). Idempotent per step.
  virtual void unscale_gradients(torch::optim::Optimizer& optimizer, Strategy& strategy) = 0;
  /// Steps the optimizer unless inf/NaN gradients were found on any rank; updates the
  /// scale. Returns whether the step was taken (the same on every rank).
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, Strategy& strategy) = 0;

  /// Scaler state for checkpoints ("scale", "growth_tracker", ...); empty if stateless.
  virtual Checkpoint state_dict() const = 0;
  virtual void load_state_dict(const Checkpoint& state) = 0;
};

}  // namespace tessera::sdk
