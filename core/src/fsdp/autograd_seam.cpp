#include "fsdp/autograd_seam.hpp"

#include "tessera/sdk/autocast.hpp"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace tessera::core::fsdp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The typed state an autograd node keeps for its unit (held through an IValue capsule:
/// what torch::autograd::Function lets a node own).
struct UnitRef : torch::CustomClassHolder {
  UnitRef(UnitHooks& h, FSDPUnit& u) : hooks(&h), unit(&u) {}
  UnitHooks* hooks;
  FSDPUnit* unit;
};

/// What a recomputation needs to redo the forward exactly.
struct RecomputeState : UnitRef {
  RecomputeState(UnitHooks& h, FSDPUnit& u, sdk::UnitFunction f) : UnitRef(h, u), forward(std::move(f)) {}
  sdk::UnitFunction forward;
  std::vector<bool> input_requires_grad;
  c10::Device device{c10::kCPU};
  at::Tensor cpu_rng, device_rng;  // generator states at the first run
  bool autocast_cpu = false, autocast_gpu = false;
  at::ScalarType autocast_cpu_dtype = at::kBFloat16, autocast_gpu_dtype = at::kHalf;
};

template <typename T>
c10::intrusive_ptr<T> state_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<T>(ctx->saved_data["unit"].toCapsule());
}

/// The identity on a unit's outputs (pre-backward: its backward runs before any gradient flows
/// into the unit) or on a frozen unit's inputs (post-backward: its backward runs once the unit's
/// backward has produced their gradients, the post-backward that a unit whose parameters all
/// require no gradient never gets from their accumulators).
struct BackwardHook : public torch::autograd::Function<BackwardHook> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, c10::intrusive_ptr<UnitRef> ref,
                               bool post) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(std::move(ref));
    ctx->saved_data["post"] = post;
    return tensors.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto ref = state_of<UnitRef>(ctx);
    FSDPUnit& unit = *ref->unit;
    if (!ctx->saved_data["post"].toBool()) ref->hooks->pre_backward(unit);
    else if (unit.expected_grads == 0 || --unit.pending_grads == 0) ref->hooks->post_backward(unit);  // see has_frozen
    grads.resize(grads.size() + 2);  // for the state and flag arguments
    return grads;
  }
};

/// `tensors` through BackwardHook; those that need no gradient pass unchanged.
std::vector<at::Tensor> through_backward_hook(UnitHooks& hooks, FSDPUnit& unit, const std::vector<at::Tensor>& tensors,
                                              bool post) {
  std::vector<std::size_t> through;  // tensors that take part in backward
  variable_list differentiable;
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].defined() && tensors[i].requires_grad()) {
      through.push_back(i);
      differentiable.push_back(tensors[i]);
    }
  if (through.empty()) return tensors;
  // A TensorList, not a std::vector: Function::apply counts only those as tensor inputs.
  variable_list wrapped =
      BackwardHook::apply(at::TensorList(differentiable), c10::make_intrusive<UnitRef>(hooks, unit), post);
  std::vector<at::Tensor> result = tensors;
  for (std::size_t k = 0; k < through.size(); ++k) result[through[k]] = wrapped[k];
  return result;
}

at::Generator default_generator(c10::Device device) { return at::globalContext().defaultGenerator(device); }

/// Autocast's cast cache off for one scope. LibTorch (before PyTorch 2.10) caches the
/// low-precision copy of a leaf parameter whatever the grad mode: the no-grad first run of a
/// checkpointed unit would cache casts without history (the recomputation then reuses them and
/// the parameter gets no gradient), and the recomputation's casts would outlive the optimizer
/// step (stale weights in the next forward). Casting again costs little next to that.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : enabled_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastCacheOff() { at::autocast::set_autocast_cache_enabled(enabled_); }

 private:
  bool enabled_;
};

/// Sets the generators and autocast to a recorded state for one scope, then restores them
/// (PyTorch's checkpoint preserve_rng_state), so the recomputation draws the same dropout masks.
class ReplayScope {
 public:
  explicit ReplayScope(const RecomputeState& s)
      : state_(s), cpu_rng_(default_generator(c10::kCPU).get_state()),
        autocast_cpu_(sdk::autocast_enabled(/*cuda=*/false)), autocast_gpu_(sdk::autocast_enabled(/*cuda=*/true)),
        cpu_dtype_(sdk::autocast_dtype(/*cuda=*/false)), gpu_dtype_(sdk::autocast_dtype(/*cuda=*/true)) {
    if (!s.device.is_cpu()) device_rng_ = default_generator(s.device).get_state();
    default_generator(c10::kCPU).set_state(s.cpu_rng);
    if (!s.device.is_cpu()) default_generator(s.device).set_state(s.device_rng);
    sdk::set_autocast(/*cuda=*/false, s.autocast_cpu, s.autocast_cpu_dtype);
    sdk::set_autocast(/*cuda=*/true, s.autocast_gpu, s.autocast_gpu_dtype);
  }
  ~ReplayScope() {
    default_generator(c10::kCPU).set_state(cpu_rng_);
    if (!state_.device.is_cpu()) default_generator(state_.device).set_state(device_rng_);
    sdk::set_autocast(/*cuda=*/false, autocast_cpu_, cpu_dtype_);
    sdk::set_autocast(/*cuda=*/true, autocast_gpu_, gpu_dtype_);
  }

 private:
  const RecomputeState& state_;
  at::Tensor cpu_rng_, device_rng_;
  bool autocast_cpu_, autocast_gpu_;
  at::ScalarType cpu_dtype_, gpu_dtype_;
};

struct Recompute : public torch::autograd::Function<Recompute> {
  static variable_list forward(AutogradContext* ctx, at::TensorList input_list, c10::intrusive_ptr<RecomputeState> state) {
    variable_list inputs = input_list.vec();
    for (const auto& x : inputs) {
      state->input_requires_grad.push_back(x.requires_grad());
      if (x.defined() && !x.is_cpu()) state->device = x.device();
    }
    state->cpu_rng = default_generator(c10::kCPU).get_state();
    if (!state->device.is_cpu()) state->device_rng = default_generator(state->device).get_state();
    state->autocast_cpu = sdk::autocast_enabled(/*cuda=*/false);
    state->autocast_gpu = sdk::autocast_enabled(/*cuda=*/true);
    state->autocast_cpu_dtype = sdk::autocast_dtype(/*cuda=*/false);
    state->autocast_gpu_dtype = sdk::autocast_dtype(/*cuda=*/true);
    ctx->save_for_backward(inputs);
    variable_list outputs;
    {
      at::AutoGradMode no_grad(false);
      AutocastCacheOff no_cache;
      outputs = state->forward(inputs);
    }
    for (const auto& y : outputs)
      if (y.defined() && !y.is_floating_point() && !y.is_complex()) ctx->mark_non_differentiable({y});
    ctx->saved_data["unit"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto state = state_of<RecomputeState>(ctx);
    state->hooks->pre_backward(*state->unit);
    variable_list inputs = ctx->get_saved_variables();
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined()) inputs[i] = inputs[i].detach().requires_grad_(state->input_requires_grad[i]);
    variable_list outputs;
    {
      ReplayScope replay(*state);
      AutocastCacheOff no_cache;
      at::AutoGradMode grad(true);
      outputs = state->forward(inputs);
    }
    variable_list roots, root_grads;
    for (std::size_t i = 0; i < outputs.size() && i < grads.size(); ++i)
      if (grads[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    variable_list input_grads;
    for (std::size_t i = 0; i < inputs.size(); ++i)
      input_grads.push_back(state->input_requires_grad[i] ? inputs[i].grad() : at::Tensor());
    input_grads.emplace_back();  // for the state argument
    return input_grads;
  }
};

/// Counts down a unit's parameters whose gradient has been accumulated.
class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(UnitHooks& hooks, FSDPUnit& unit) : hooks_(hooks), unit_(unit) {}
  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    if (--unit_.pending_grads == 0) hooks_.post_backward(unit_);
    return outputs;
  }

 private:
  UnitHooks& hooks_;
  FSDPUnit& unit_;
};

}  // namespace

std::vector<at::Tensor> attach_pre_backward(UnitHooks& hooks, FSDPUnit& unit, const std::vector<at::Tensor>& outputs) {
  return through_backward_hook(hooks, unit, outputs, /*post=*/false);
}

std::vector<at::Tensor> attach_post_backward(UnitHooks& hooks, FSDPUnit& unit, const std::vector<at::Tensor>& inputs) {
  return through_backward_hook(hooks, unit, inputs, /*post=*/true);
}

std::vector<at::Tensor> checkpointed_forward(UnitHooks& hooks, FSDPUnit& unit, sdk::UnitFunction forward,
                                             const std::vector<at::Tensor>& inputs) {
  return Recompute::apply(at::TensorList(inputs), c10::make_intrusive<RecomputeState>(hooks, unit, std::move(forward)));
}

void install_post_backward_hooks(UnitHooks& hooks, FSDPUnit& unit) {
  unit.accumulators.clear();
  unit.expected_grads = 0;
  unit.has_frozen = false;
  for (const auto& p : unit.layout->params()) {
    if (!p.tensor.requires_grad()) {
      unit.has_frozen = true;
      continue;
    }
    auto accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    accumulator->add_post_hook(std::make_unique<GradientReadyHook>(hooks, unit));
    unit.accumulators.push_back(std::move(accumulator));
    ++unit.expected_grads;
  }
  unit.has_frozen = unit.has_frozen && unit.expected_grads > 0;
}

}  // namespace tessera::core::fsdp
