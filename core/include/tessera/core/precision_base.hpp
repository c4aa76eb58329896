#pragma once
/// Lightning's precision strings over one implementation: casts for the *-true precisions,
/// autocast for the mixed ones, a (sharded) gradient scaler, and the mixed-precision policy
/// FSDP strategies read. The `precision` and `fsdp-precision` plugins differ only in the
/// policy they report (see `fsdp_policy`).
#include <string>

#include "tessera/sdk/options.hpp"
#include "tessera/sdk/precision.hpp"

namespace tessera::core {

class PrecisionBase : public sdk::Precision {
 public:
  /// Reads [precision] precision, scaler, init_scale, growth_factor, backoff_factor,
  /// growth_interval. With `fsdp_policy`, mixed_precision_policy() is Lightning's
  /// FSDPPrecision policy; otherwise it is empty (parameters keep their dtype).
  PrecisionBase(const sdk::Options& options, bool fsdp_policy);

  std::string precision() const override;
  void check_device(const c10::Device& device) const override;
  sdk::MixedPrecisionPolicy mixed_precision_policy() const override;
  void convert_module(torch::nn::Module& module) override;
  at::Tensor convert_input(const at::Tensor& data) override;
  at::Tensor convert_output(const at::Tensor& data) override;
  sdk::GuardPtr forward_context() override;
  sdk::GuardPtr module_init_context() override;
  at::Tensor pre_backward(const at::Tensor& loss) override;
  void unscale_gradients(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) override;
  bool optimizer_step(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) override;
  sdk::Checkpoint state_dict() const override;
  void load_state_dict(const sdk::Checkpoint& state) override;

  /// The current loss scale (1 without a scaler).
  double scale() const { return scaler_enabled_ ? scale_ : 1.0; }

 private:
  bool is_true_precision() const;
  at::ScalarType half_dtype() const;  ///< bf16 or fp16 (fp32 for 32-true)

  std::string precision_;
  bool fsdp_policy_;
  bool scaler_enabled_;
  double scale_;
  double growth_factor_;
  double backoff_factor_;
  std::int64_t growth_interval_;
  std::int64_t growth_tracker_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
  mutable bool cuda_ = false;  ///< the device check_device() was asked about (autocast device type)
};

}  // namespace tessera::core
