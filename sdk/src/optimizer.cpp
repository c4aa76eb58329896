#include "tessera/sdk/optimizer.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_fused_adam.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <map>
#include <optional>
#include <tuple>

#include "tessera/sdk/error.hpp"

namespace tessera::sdk {

namespace {

std::optional<c10::DispatchKey> backend_of(const c10::Device& device) {
  if (device.is_cuda()) return c10::DispatchKey::CUDA;
  if (device.is_cpu()) return c10::DispatchKey::CPU;
  return std::nullopt;
}

// aten::_fused_adam_'s and aten::_fused_adamw_'s C++ signature.
using FusedAdamKernel = void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                             at::TensorList, double, double, double, double, double, bool, bool,
                             const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&);

/// aten::_fused_adamw_ (LibTorch 2.0 on: the decoupled weight decay inside the kernel, one
/// pass fewer), found by name since older headers do not declare it; none where this LibTorch
/// has no such kernel for `device`.
std::optional<c10::TypedOperatorHandle<FusedAdamKernel>> fused_adamw(const c10::Device& device) {
  static const auto op = []() -> std::optional<c10::TypedOperatorHandle<FusedAdamKernel>> {
    const auto handle = c10::Dispatcher::singleton().findSchema({"aten::_fused_adamw_", ""});
    if (!handle) return std::nullopt;
    try {
      return handle->typed<FusedAdamKernel>();
    } catch (const c10::Error&) {  // another signature than this one's
      return std::nullopt;
    }
  }();
  const auto key = backend_of(device);
  if (!op || !key || !op->hasKernelForDispatchKey(*key)) return std::nullopt;
  return op;
}

}  // namespace

bool has_fused_adam(const c10::Device& device) {
  static const auto op = c10::Dispatcher::singleton().findSchema({"aten::_fused_adam_", ""});
  const auto key = backend_of(device);
  return op && key && op->hasKernelForDispatchKey(*key);
}

namespace {

/// LibTorch's Adam or AdamW (the same options, state and checkpoints: code that casts to
/// torch::optim::AdamW still sees one) whose step runs the fused kernel where the parameters'
/// device has one (LibTorch's, or on the CPU below LibTorch 2.4 the toolkit's
/// fused_adam_cpu.cpp): one pass reading parameter, gradient and both moments and writing
/// three, where LibTorch's C++ loop makes nine elementwise passes with temporaries (~23 reads
/// and writes of the model per step: at 1.3B parameters on an H100 ~40 ms against ~12).
/// Anything the kernel does not take (amsgrad, a gradient of another dtype or layout than its
/// parameter, a device without the kernel) steps through LibTorch's loop, as before.
template <class Base, class Options, class State, bool Decoupled>
class FusedAdam final : public Base {
 public:
  using Base::Base;

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    if (!fusable()) return Base::step(std::move(closure));
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : this->param_groups()) {
      auto& o = static_cast<Options&>(group.options());
      // The kernel takes lists of one device and dtype; the step count is a tensor it reads.
      struct Lists {
        std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
      };
      std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, at::ScalarType, std::int64_t>, Lists> buckets;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = this->state()[optimizer_state_key(p)];
        if (!slot) {
          auto fresh = std::make_unique<State>();
          fresh->step(0);
          fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(fresh);
        }
        auto& state = static_cast<State&>(*slot);
        state.step(state.step() + 1);
        Lists& lists = buckets[{p.device().type(), p.device().index(), p.scalar_type(), state.step()}];
        lists.params.push_back(p);
        lists.grads.push_back(p.grad());
        lists.exp_avgs.push_back(state.exp_avg());
        lists.exp_avg_sqs.push_back(state.exp_avg_sq());
      }
      for (auto& [key, lists] : buckets) {
        const at::Tensor step =
            at::full({}, static_cast<double>(std::get<3>(key)), lists.params.front().options().dtype(at::kFloat));
        const std::vector<at::Tensor> steps(lists.params.size(), step);
        const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
        const auto adamw = Decoupled ? fused_adamw(lists.params.front().device()) : std::nullopt;
        if (adamw) {
          adamw->call(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, at::TensorList(), steps, o.lr(), beta1,
                      beta2, o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false, c10::nullopt, c10::nullopt);
          continue;
        }
        // Adam's L2 decay is the kernel's; AdamW's decoupled one comes first, as in LibTorch's loop.
        if (Decoupled && o.weight_decay() != 0) at::_foreach_mul_(lists.params, 1 - o.lr() * o.weight_decay());
        at::_fused_adam_(lists.params, lists.grads, lists.exp_avgs, lists.exp_avg_sqs, at::TensorList(), steps, o.lr(),
                         beta1, beta2, Decoupled ? 0.0 : o.weight_decay(), o.eps(), /*amsgrad=*/false,
                         /*maximize=*/false);
      }
    }
    return loss;
  }

 private:
  bool fusable() {
    for (auto& group : this->param_groups()) {
      if (static_cast<Options&>(group.options()).amsgrad()) return false;
      for (auto& p : group.params()) {
        const at::Tensor& g = p.grad();
        if (!g.defined()) continue;
        if (!like(g, p) || !p.is_non_overlapping_and_dense() || !has_fused_adam(p.device())) return false;
        const auto it = this->state().find(optimizer_state_key(p));  // moments loaded from a checkpoint too
        if (it != this->state().end()) {
          const auto& state = static_cast<const State&>(*it->second);
          if (!like(state.exp_avg(), p) || !like(state.exp_avg_sq(), p)) return false;
        }
      }
    }
    return true;
  }

  /// The kernel takes tensors laid out as their parameter: dense, same dtype, device and strides.
  static bool like(const at::Tensor& t, const at::Tensor& p) {
    return t.defined() && !t.is_sparse() && t.scalar_type() == p.scalar_type() && t.device() == p.device() &&
           t.strides() == p.strides();
  }
};

using FusedAdamW = FusedAdam<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>;
using FusedAdamL2 = FusedAdam<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState, false>;

}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<NamedParameter>& params,
                                                        const OptimizerSettings& s) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(params.size());
  for (const auto& p : params) tensors.push_back(p.tensor);
  if (s.name == "adamw")
    return std::make_unique<FusedAdamW>(
        tensors, torch::optim::AdamWOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay));
  if (s.name == "adam")
    return std::make_unique<FusedAdamL2>(
        tensors, torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay));
  if (s.name == "sgd")
    return std::make_unique<torch::optim::SGD>(
        tensors, torch::optim::SGDOptions(s.lr).momentum(s.momentum).weight_decay(s.weight_decay));
  TESSERA_FAIL("unknown optimizer '", s.name, "'", did_you_mean(s.name, {"adamw", "adam", "sgd"}), "; valid: adamw, adam, sgd");
}

// [Note: one description of an optimizer] LibTorch's optimizers share no interface for their
// hyper-parameters and state (AdamOptions and AdamWOptions have the same fields and no common
// base): the casts that tell Adam, AdamW and SGD apart are here, once.

OptimizerKind optimizer_kind(const torch::optim::Optimizer& optimizer) {
  const std::vector<std::string> adam_state{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return {"AdamW", adam_state, {"exp_avg", "exp_avg_sq"}};
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return {"Adam", adam_state, {"exp_avg", "exp_avg_sq"}};
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return {"SGD", {"step", "momentum_buffer"}, {}};
  return {};
}

namespace {

/// Adam's and AdamW's options: the same fields in two classes with no common base.
template <class AdamOptions>
void insert_adam_options(Checkpoint& out, const AdamOptions& o) {
  out.insert("lr", o.lr());
  out.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  out.insert("eps", o.eps());
  out.insert("weight_decay", o.weight_decay());
  out.insert("amsgrad", o.amsgrad());
}

}  // namespace

Checkpoint hyper_parameters(const torch::optim::OptimizerOptions& options) {
  Checkpoint out = make_checkpoint();
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    insert_adam_options(out, *o);
  } else if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    insert_adam_options(out, *o);
  } else if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    out.insert("lr", o->lr());
    out.insert("momentum", o->momentum());
    out.insert("dampening", o->dampening());
    out.insert("weight_decay", o->weight_decay());
    out.insert("nesterov", o->nesterov());
  } else {
    TESSERA_FAIL("optimizer options of this optimizer type cannot be saved (supported: Adam, AdamW, SGD)");
  }
  return out;
}

void set_hyper_parameters(torch::optim::OptimizerOptions& options, const Checkpoint& saved) {
  auto number = [&](const char* key, double fallback) {
    if (!saved.contains(key)) return fallback;
    const c10::IValue& v = saved.at(key);
    TESSERA_CHECK(v.isDouble() || v.isInt(), "optimizer param group '", key, "' is not a number");
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  };
  auto flag = [&](const char* key, bool fallback) {
    return saved.contains(key) && saved.at(key).isBool() ? saved.at(key).toBool() : fallback;
  };
  auto betas = [&](std::tuple<double, double> fallback) {
    if (!saved.contains("betas") || !saved.at("betas").isTuple()) return fallback;
    const auto& items = saved.at("betas").toTupleRef().elements();
    TESSERA_CHECK(items.size() == 2, "optimizer param group 'betas' must have two entries");
    return std::make_tuple(items[0].toDouble(), items[1].toDouble());
  };
  options.set_lr(number("lr", options.get_lr()));
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    o->betas(betas(o->betas())).eps(number("eps", o->eps())).weight_decay(number("weight_decay", o->weight_decay()));
    o->amsgrad(flag("amsgrad", o->amsgrad()));
  } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
    o->betas(betas(o->betas())).eps(number("eps", o->eps())).weight_decay(number("weight_decay", o->weight_decay()));
    o->amsgrad(flag("amsgrad", o->amsgrad()));
  } else if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
    o->momentum(number("momentum", o->momentum())).dampening(number("dampening", o->dampening()));
    o->weight_decay(number("weight_decay", o->weight_decay())).nesterov(flag("nesterov", o->nesterov()));
  }
}

Checkpoint parameter_state(const torch::optim::OptimizerParamState& state) {
  Checkpoint out = make_checkpoint();
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    out.insert("step", at::scalar_tensor(static_cast<double>(s->step()), at::kFloat));
    out.insert("exp_avg", s->exp_avg());
    out.insert("exp_avg_sq", s->exp_avg_sq());
    if (s->max_exp_avg_sq().defined()) out.insert("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    out.insert("step", at::scalar_tensor(static_cast<double>(s->step()), at::kFloat));
    out.insert("exp_avg", s->exp_avg());
    out.insert("exp_avg_sq", s->exp_avg_sq());
    if (s->max_exp_avg_sq().defined()) out.insert("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    if (s->momentum_buffer().defined()) out.insert("momentum_buffer", s->momentum_buffer());
  } else {
    TESSERA_FAIL("optimizer state of this optimizer type cannot be saved (supported: Adam, AdamW, SGD)");
  }
  return out;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_parameter_state(const torch::optim::Optimizer& optimizer,
                                                                        const Checkpoint& saved) {
  auto tensor = [&](const char* key) { return saved.contains(key) ? saved.at(key).toTensor().clone() : at::Tensor(); };
  auto step = [&]() -> std::int64_t {
    if (!saved.contains("step")) return 0;
    const c10::IValue& v = saved.at("step");
    if (v.isTensor()) return static_cast<std::int64_t>(std::llround(v.toTensor().item<double>()));
    if (v.isInt()) return v.toInt();
    TESSERA_CHECK(v.isDouble(), "optimizer state 'step' is neither a tensor nor a number");
    return static_cast<std::int64_t>(std::llround(v.toDouble()));
  };
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step()).exp_avg(tensor("exp_avg")).exp_avg_sq(tensor("exp_avg_sq")).max_exp_avg_sq(tensor("max_exp_avg_sq"));
    return s;
  }
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step()).exp_avg(tensor("exp_avg")).exp_avg_sq(tensor("exp_avg_sq")).max_exp_avg_sq(tensor("max_exp_avg_sq"));
    return s;
  }
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(tensor("momentum_buffer"));
    return s;
  }
  TESSERA_FAIL("optimizer state cannot be loaded into this optimizer type (supported: Adam, AdamW, SGD)");
}

}  // namespace tessera::sdk
