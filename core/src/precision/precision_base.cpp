#include "tessera/core/precision_base.hpp"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::core {

namespace {

const std::vector<std::string> kPrecisions = {"32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"};

/// Autocast on the device type for the scope's lifetime, restoring the previous state.
class AutocastGuard final : public sdk::Guard {
 public:
  AutocastGuard(bool cuda, at::ScalarType dtype) : cuda_(cuda) {
    if (cuda_) {
      was_enabled_ = at::autocast::is_enabled();
      previous_dtype_ = at::autocast::get_autocast_gpu_dtype();
      at::autocast::set_enabled(true);
      at::autocast::set_autocast_gpu_dtype(dtype);
    } else {
      was_enabled_ = at::autocast::is_cpu_enabled();
      previous_dtype_ = at::autocast::get_autocast_cpu_dtype();
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(dtype);
    }
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() override {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    if (cuda_) {
      at::autocast::set_enabled(was_enabled_);
      at::autocast::set_autocast_gpu_dtype(previous_dtype_);
    } else {
      at::autocast::set_cpu_enabled(was_enabled_);
      at::autocast::set_autocast_cpu_dtype(previous_dtype_);
    }
  }

 private:
  bool cuda_;
  bool was_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kFloat;
};

/// Default dtype for new parameters for the scope's lifetime.
class DefaultDtypeGuard final : public sdk::Guard {
 public:
  explicit DefaultDtypeGuard(at::ScalarType dtype) : previous_(c10::get_default_dtype()) {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  }
  ~DefaultDtypeGuard() override { c10::set_default_dtype(previous_); }

 private:
  caffe2::TypeMeta previous_;
};

}  // namespace

PrecisionBase::PrecisionBase(const sdk::Options& options, bool fsdp_policy)
    : precision_(options.get_choice("precision", "32-true", kPrecisions)),
      fsdp_policy_(fsdp_policy),
      scaler_enabled_(options.get_bool("scaler", precision_ == "16-mixed")),
      scale_(options.get_double("init_scale", 65536.0, 1e-30)),
      growth_factor_(options.get_double("growth_factor", 2.0, 1.0)),
      backoff_factor_(options.get_double("backoff_factor", 0.5, 1e-30, 1.0)),
      growth_interval_(options.get_int("growth_interval", 2000, 1)) {
  TESSERA_CHECK(!(scaler_enabled_ && is_true_precision()), options.locate("scaler"),
                ": a grad scaler needs fp32 master weights; precision \"", precision_,
                "\" has none. Use \"16-mixed\" or \"bf16-mixed\" with a scaler.");
}

bool PrecisionBase::is_true_precision() const { return precision_ == "16-true" || precision_ == "bf16-true"; }

at::ScalarType PrecisionBase::half_dtype() const {
  if (precision_.rfind("bf16", 0) == 0) return at::kBFloat16;
  if (precision_.rfind("16", 0) == 0) return at::kHalf;
  return at::kFloat;
}

std::string PrecisionBase::precision() const { return precision_; }

void PrecisionBase::check_device(const c10::Device& device) const {
  cuda_ = device.is_cuda();
  TESSERA_CHECK(!(half_dtype() == at::kHalf && device.is_cpu()), "precision \"", precision_,
                "\" needs a CUDA device: fp16 compute (addmm for Half) is not implemented on CPU in LibTorch ",
                TORCH_VERSION, ". On CPU use \"bf16-mixed\", \"bf16-true\" or \"32-true\".");
}

sdk::MixedPrecisionPolicy PrecisionBase::mixed_precision_policy() const {
  sdk::MixedPrecisionPolicy policy;
  if (!fsdp_policy_) return policy;
  // Lightning's FSDPPrecision: every FSDP dtype follows the precision's half type.
  at::ScalarType dtype = half_dtype();
  policy.param_dtype = dtype;
  policy.reduce_dtype = dtype;
  policy.buffer_dtype = dtype;
  return policy;
}

void PrecisionBase::convert_module(torch::nn::Module& module) {
  if (is_true_precision()) module.to(half_dtype());
}

at::Tensor PrecisionBase::convert_input(const at::Tensor& data) {
  return is_true_precision() && data.is_floating_point() ? data.to(half_dtype()) : data;
}

at::Tensor PrecisionBase::convert_output(const at::Tensor& data) {
  return data.defined() && data.is_floating_point() && data.scalar_type() != at::kFloat ? data.to(at::kFloat) : data;
}

sdk::GuardPtr PrecisionBase::forward_context() {
  if (precision_ != "16-mixed" && precision_ != "bf16-mixed") return nullptr;
  return std::make_unique<AutocastGuard>(cuda_, half_dtype());
}

sdk::GuardPtr PrecisionBase::module_init_context() {
  return is_true_precision() ? std::make_unique<DefaultDtypeGuard>(half_dtype()) : nullptr;
}

at::Tensor PrecisionBase::pre_backward(const at::Tensor& loss) {
  return scaler_enabled_ ? loss * scale_ : loss;
}

void PrecisionBase::unscale_gradients(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) {
  if (!scaler_enabled_ || unscaled_) return;
  unscaled_ = true;
  at::Tensor found = at::zeros({}, at::kFloat);
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      p.mutable_grad().mul_(1.0 / scale_);
      if (p.grad().numel() > 0 && !at::isfinite(p.grad()).all().item<bool>()) found.fill_(1.0);
    }
  // Every rank must skip the same step: one all-reduce of the found-inf flag.
  found_inf_ = strategy.reduce(found.to(strategy.root_device()), sdk::ReduceOp::max).item<double>() > 0;
}

bool PrecisionBase::optimizer_step(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) {
  if (!scaler_enabled_) {
    optimizer.step();
    return true;
  }
  unscale_gradients(optimizer, strategy);
  bool step = !found_inf_;
  if (step) optimizer.step();
  if (found_inf_) {
    scale_ *= backoff_factor_;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == growth_interval_) {
    scale_ *= growth_factor_;
    growth_tracker_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
  return step;
}

sdk::Checkpoint PrecisionBase::state_dict() const {
  sdk::Checkpoint state = sdk::make_checkpoint();
  state.insert("precision", precision_);
  if (scaler_enabled_) {
    state.insert("scale", scale_);
    state.insert("growth_tracker", growth_tracker_);
  }
  return state;
}

void PrecisionBase::load_state_dict(const sdk::Checkpoint& state) {
  if (!scaler_enabled_ || !state.contains("scale")) return;
  scale_ = state.at("scale").toDouble();
  growth_tracker_ = state.at("growth_tracker").toInt();
}

}  // namespace tessera::core
