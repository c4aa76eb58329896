#pragma once
/// Lightning's precision strings over one implementation: casts for the *-true precisions,
/// autocast for the mixed ones, a gradient scaler whose found-inf flag is agreed across
/// ranks (PyTorch's ShardedGradScaler: correct for sharded and replicated gradients alike),
/// and the mixed-precision policy FSDP strategies read. The `precision` and
/// `fsdp-precision` plugins differ only in the policy they report (see `fsdp_policy`).
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/sdk/options.hpp"
#include "tessera/sdk/precision.hpp"

namespace tessera::core {

/// A dtype key of a mixed-precision policy (fsdp-precision's param_dtype, fsdp2's
/// [strategy.mp_policy] ...): "float32", "bfloat16" or "float16"; "" (the default) leaves it unset.
c10::optional<at::ScalarType> read_policy_dtype(const sdk::Options& options, const sdk::Key& key);

class PrecisionBase : public sdk::Precision {
 public:
  /// The five precision strings Lightning accepts.
  static const std::vector<std::string>& precisions();

  /// Reads [precision] precision, scaler, init_scale, growth_factor, backoff_factor,
  /// growth_interval. With `fsdp_policy`, mixed_precision_policy() is Lightning's
  /// FSDPPrecision policy, and the keys param_dtype, reduce_dtype, buffer_dtype
  /// ("float32", "bfloat16", "float16") and keep_low_precision_grads override it;
  /// without, the policy is empty (FSDP keeps every dtype as it is).
  PrecisionBase(const sdk::Options& options, bool fsdp_policy);

  std::string precision() const override;
  /// Refuses fp16 compute (16-true, 16-mixed, or param_dtype float16) on a CPU device.
  /// Also records the device type autocast uses.
  void check_device(const c10::Device& device) const override;
  /// Lightning's FSDPPrecision.mixed_precision_config: 32-true all fp32; 16-mixed/bf16-mixed
  /// param fp32 (autocast computes in half), reduce and buffers in half; *-true all half.
  sdk::MixedPrecisionPolicy mixed_precision_policy() const override;
  /// *-true: every parameter and buffer to the half dtype. Mixed and 32-true: no-op.
  void convert_module(torch::nn::Module& module) override;
  /// Floating tensors to the compute input dtype (half for *-true, fp32 otherwise).
  at::Tensor convert_input(const at::Tensor& data) override;
  /// Floating tensors back to fp32 (the default dtype).
  at::Tensor convert_output(const at::Tensor& data) override;
  /// Mixed: autocast (CPU or CUDA, as check_device saw) in the half dtype, restoring the
  /// previous autocast state on exit. *-true: the half dtype as default dtype. 32-true: none.
  sdk::GuardPtr forward_context() override;
  /// *-true: the half dtype as default dtype, so parameters are created in it directly.
  sdk::GuardPtr module_init_context() override;
  /// The loss times the current scale (unchanged without a scaler).
  at::Tensor pre_backward(const at::Tensor& loss) override;
  void unscale_gradients(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) override;
  /// Steps unless the scaler found inf/NaN on any rank; updates the scale. On the first
  /// call, refuses an Adam/AdamW eps that is 0 in float16 when parameters are float16.
  bool optimizer_step(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) override;
  /// PyTorch GradScaler.state_dict(): scale, growth_factor, backoff_factor, growth_interval,
  /// _growth_tracker. Empty without a scaler.
  sdk::Checkpoint state_dict() const override;
  /// Restores a state_dict(); with a scaler, a state without "scale" is an error naming what
  /// is missing (the checkpoint was written without a scaler).
  void load_state_dict(const sdk::Checkpoint& state) override;

  /// Whether a grad scaler is active.
  bool scaler_enabled() const { return scaler_enabled_; }
  /// The current loss scale (1 without a scaler).
  double scale() const { return scaler_enabled_ ? scale_ : 1.0; }
  /// Steps since the scale last changed.
  std::int64_t growth_tracker() const { return growth_tracker_; }

 private:
  bool is_true_precision() const;
  bool is_mixed_precision() const;
  at::ScalarType half_dtype() const;  ///< bf16 or fp16 (fp32 for 32-true)

  std::string precision_;
  bool fsdp_policy_;
  sdk::MixedPrecisionPolicy policy_;
  bool scaler_enabled_;
  double scale_;
  double growth_factor_;
  double backoff_factor_;
  std::int64_t growth_interval_;
  std::int64_t growth_tracker_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
  bool eps_checked_ = false;
  mutable bool cuda_ = false;  ///< the device check_device() was asked about (autocast device type)
};

}  // namespace tessera::core
