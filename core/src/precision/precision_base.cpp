#include "tessera/core/precision_base.hpp"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>

#include <cmath>
#include <map>

#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::core {

namespace {

const std::vector<std::string> kPrecisions = {"32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"};


/// Autocast on the device type for the scope's lifetime, restoring the previous state.
class AutocastGuard final : public sdk::Guard {
 public:
  AutocastGuard(bool cuda, at::ScalarType dtype)
      : cuda_(cuda), was_enabled_(sdk::autocast_enabled(cuda)), previous_dtype_(sdk::autocast_dtype(cuda)) {
    sdk::set_autocast(cuda_, true, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() override {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    sdk::set_autocast(cuda_, was_enabled_, previous_dtype_);
  }

 private:
  bool cuda_;
  bool was_enabled_;
  at::ScalarType previous_dtype_;
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

const std::vector<std::string>& PrecisionBase::precisions() { return kPrecisions; }

namespace {

/// Lightning's FSDPPrecision.mixed_precision_config for each precision string.
sdk::MixedPrecisionPolicy lightning_policy(const std::string& precision) {
  sdk::MixedPrecisionPolicy policy;
  at::ScalarType half = precision.rfind("bf16", 0) == 0 ? at::kBFloat16
                        : precision.rfind("16", 0) == 0 ? at::kHalf
                                                        : at::kFloat;
  const bool mixed = precision.find("mixed") != std::string::npos;
  // Mixed: the parameters stay fp32 (autocast computes in half); gradients and buffers in half.
  policy.param_dtype = mixed ? at::kFloat : half;
  policy.reduce_dtype = half;
  policy.buffer_dtype = half;
  return policy;
}

}  // namespace

c10::optional<at::ScalarType> read_policy_dtype(const sdk::Options& options, const sdk::Key& key) {
  const std::string name = options.get_choice(key, "", {"", "float32", "bfloat16", "float16"});
  if (name.empty()) return c10::nullopt;
  return name == "bfloat16" ? at::kBFloat16 : name == "float16" ? at::kHalf : at::kFloat;
}

PrecisionBase::PrecisionBase(const sdk::Options& options, bool fsdp_policy)
    : precision_(options.get_choice(
          {"precision",
           "Lightning's precision: fp32, fp16 or bf16 weights (-true), or fp32 weights with autocast (-mixed)"},
          "32-true", kPrecisions)),
      fsdp_policy_(fsdp_policy),
      scaler_enabled_(
          options.get_bool({"scaler", "a (sharded) gradient scaler against fp16 underflow; default true for 16-mixed"},
                           precision_ == "16-mixed")),
      scale_(options.get_double({"init_scale", "the grad scaler's initial scale"}, 65536.0, 1e-30)),
      growth_factor_(options.get_double(
          {"growth_factor", "the grad scaler's scale multiplier after growth_interval steps without inf/NaN"}, 2.0,
          1.0)),
      backoff_factor_(options.get_double(
          {"backoff_factor", "the grad scaler's scale multiplier after a step with inf/NaN gradients (skipped)"}, 0.5,
          1e-30, 1.0)),
      growth_interval_(
          options.get_int({"growth_interval", "steps without inf/NaN before the grad scaler's scale grows"}, 2000, 1)) {
  TESSERA_CHECK(!(scaler_enabled_ && is_true_precision()), options.locate("scaler"),
                ": a grad scaler needs fp32 master weights; precision \"", precision_,
                "\" has none. Use \"16-mixed\" or \"bf16-mixed\" with a scaler, or scaler = false.");
  if (!fsdp_policy_) return;
  policy_ = lightning_policy(precision_);
  auto override_dtype = [&](const sdk::Key& key, c10::optional<at::ScalarType>& slot) {
    if (const auto dtype = read_policy_dtype(options, key)) slot = dtype;
  };
  override_dtype({"param_dtype",
                  "PyTorch FSDP's MixedPrecision param_dtype: gather and compute in it; \"\": Lightning's "
                  "policy for the precision"},
                 policy_.param_dtype);
  override_dtype({"reduce_dtype", "MixedPrecision's reduce_dtype: gradients reduced in it; \"\": the policy's"},
                 policy_.reduce_dtype);
  override_dtype({"buffer_dtype", "MixedPrecision's buffer_dtype: floating buffers in it; \"\": the policy's"},
                 policy_.buffer_dtype);
  policy_.keep_low_precision_grads =
      options.get_bool({"keep_low_precision_grads",
                        "PyTorch FSDP's keep_low_precision_grads: the optimizer steps on reduce_dtype gradients"},
                       false);
}

bool PrecisionBase::is_true_precision() const { return precision_ == "16-true" || precision_ == "bf16-true"; }
bool PrecisionBase::is_mixed_precision() const { return precision_ == "16-mixed" || precision_ == "bf16-mixed"; }

at::ScalarType PrecisionBase::half_dtype() const {
  if (precision_.rfind("bf16", 0) == 0) return at::kBFloat16;
  if (precision_.rfind("16", 0) == 0) return at::kHalf;
  return at::kFloat;
}

std::string PrecisionBase::precision() const { return precision_; }

void PrecisionBase::check_device(const c10::Device& device) const {
  cuda_ = device.is_cuda();
  if (!device.is_cpu()) return;
  // fp16 is CUDA's half precision; on CPUs it is bf16 (LibTorch 1.13 has no CPU fp16 matmul at
  // all; later ones have one, but not the fp16 grad scaler's path that Tessera tests).
  TESSERA_CHECK(half_dtype() != at::kHalf, "precision \"", precision_, "\" needs a CUDA device, but this run's device is ",
                device.str(), ": Tessera runs fp16 on CUDA only. On CPU use \"bf16-mixed\", \"bf16-true\" or \"32-true\".");
  TESSERA_CHECK(policy_.param_dtype != at::kHalf, "[precision] param_dtype = \"float16\" needs a CUDA device, but this ",
                "run's device is ", device.str(), ": Tessera runs fp16 on CUDA only. On CPU use param_dtype = ",
                "\"bfloat16\" or \"float32\".");
}

sdk::MixedPrecisionPolicy PrecisionBase::mixed_precision_policy() const { return policy_; }

void PrecisionBase::convert_module(torch::nn::Module& module) {
  if (is_true_precision()) module.to(half_dtype());
}

at::Tensor PrecisionBase::convert_input(const at::Tensor& data) {
  if (!data.defined() || !data.is_floating_point()) return data;
  at::ScalarType dtype = is_true_precision() ? half_dtype() : at::kFloat;
  return data.scalar_type() == dtype ? data : data.to(dtype);
}

at::Tensor PrecisionBase::convert_output(const at::Tensor& data) {
  return data.defined() && data.is_floating_point() && data.scalar_type() != at::kFloat ? data.to(at::kFloat) : data;
}

sdk::GuardPtr PrecisionBase::forward_context() {
  if (is_mixed_precision()) return std::make_unique<AutocastGuard>(cuda_, half_dtype());
  // *-true: tensors a forward creates (masks, positions, zeros) come out in the model's dtype.
  if (is_true_precision()) return std::make_unique<DefaultDtypeGuard>(half_dtype());
  return nullptr;
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
  torch::NoGradGuard no_grad;
  const c10::Device root = strategy.root_device();
  at::Tensor found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(root));
  // CUDA gradients of one dtype go through PyTorch's fused kernel (GradScaler's); the rest
  // (CPU: no such kernel in LibTorch 1.13) one flag each, without a host sync per tensor.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> fused;
  std::vector<at::Tensor> non_finite;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      if (!p.grad().defined() || p.grad().numel() == 0) continue;
      const at::Tensor& g = p.grad();
      if (g.is_cuda() && (g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf)) {
        fused[{g.device().str(), g.scalar_type()}].push_back(g);
        continue;
      }
      p.mutable_grad().mul_(1.0 / scale_);
      non_finite.push_back(at::isfinite(g).all().logical_not().to(root).to(at::kFloat).reshape({1}));
    }
  for (auto& [key, grads] : fused) {
    const c10::Device device = grads.front().device();
    at::Tensor found_here = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    at::Tensor inv_scale = at::full({1}, 1.0 / scale_, at::TensorOptions().dtype(at::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_here, inv_scale);
    non_finite.push_back(found_here.to(root));
  }
  if (!non_finite.empty()) found = at::stack(non_finite).max().reshape({1});
  // Each rank sees only its gradient shards: every rank must skip the same step, so the flag
  // is agreed with one all-reduce (max).
  found_inf_ = strategy.reduce(found, sdk::ReduceOp::max).item<double>() > 0;
}

namespace {

/// Adam's eps is added to a square root in the parameter's dtype: below half float16's
/// smallest subnormal it rounds to 0 and the first zero second moment divides by zero.
void check_eps_representable(const torch::optim::Optimizer& optimizer) {
  if (sdk::optimizer_kind(optimizer).name.empty()) return;  // another class: nothing is known of it
  for (const auto& group : optimizer.param_groups()) {
    const sdk::Checkpoint hyper = sdk::hyper_parameters(group.options());
    if (!hyper.contains("eps")) continue;  // SGD
    const double eps = hyper.at("eps").toDouble();
    for (const auto& p : group.params())
      TESSERA_CHECK(p.scalar_type() != at::kHalf || eps >= 6e-8, "[optimizer] eps = ", eps,
                    " is 0 in float16, the dtype of the optimizer's parameters under this precision: every step would ",
                    "divide by zero and turn the weights into NaN. Set [optimizer] eps = 1e-4 (or larger), or use ",
                    "precision \"16-mixed\" (fp32 master weights).");
  }
}

}  // namespace

bool PrecisionBase::optimizer_step(torch::optim::Optimizer& optimizer, sdk::Strategy& strategy) {
  if (!eps_checked_) {
    if (half_dtype() == at::kHalf) check_eps_representable(optimizer);
    eps_checked_ = true;
  }
  if (!scaler_enabled_) {
    optimizer.step();
    return true;
  }
  unscale_gradients(optimizer, strategy);
  const bool step = !found_inf_;
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
  if (!scaler_enabled_) return state;
  state.insert("scale", scale_);
  state.insert("growth_factor", growth_factor_);
  state.insert("backoff_factor", backoff_factor_);
  state.insert("growth_interval", growth_interval_);
  state.insert("_growth_tracker", growth_tracker_);
  return state;
}

void PrecisionBase::load_state_dict(const sdk::Checkpoint& state) {
  if (!scaler_enabled_) return;
  TESSERA_CHECK(state.contains("scale"), "the checkpoint's precision_plugin state has no grad scaler 'scale' (it was ",
                "written by a run without a scaler), but precision \"", precision_,
                "\" uses one here; set [precision] scaler = false or resume from a checkpoint written with a scaler");
  auto number = [&](const char* key, double fallback) {
    if (!state.contains(key)) return fallback;
    const c10::IValue& v = state.at(key);
    if (v.isTensor()) return v.toTensor().item<double>();
    TESSERA_CHECK(v.isDouble() || v.isInt(), "precision_plugin state '", key, "' is not a number");
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  };
  const double scale = number("scale", scale_);
  TESSERA_CHECK(scale > 0 && std::isfinite(scale), "precision_plugin state 'scale' is ", scale,
                "; a loss scale must be positive and finite");
  scale_ = scale;
  growth_factor_ = number("growth_factor", growth_factor_);
  backoff_factor_ = number("backoff_factor", backoff_factor_);
  growth_interval_ = static_cast<std::int64_t>(number("growth_interval", static_cast<double>(growth_interval_)));
  growth_tracker_ = static_cast<std::int64_t>(
      number("_growth_tracker", number("growth_tracker", static_cast<double>(growth_tracker_))));
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace tessera::core
