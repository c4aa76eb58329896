// sdk::make_optimizer's Adam and AdamW step through LibTorch's fused kernel where it has one
// and compute what LibTorch's own loop computes. LibTorch gained a CPU kernel in 2.4 (which
// these tests then run); below that (Debian's bookworm 1.13) this binary registers a CPU
// reference of the kernel's documented math, so the optimizer's side (state, step counts,
// buckets, decoupled weight decay, the fallbacks) is tested on every machine; on CUDA the real
// kernel runs in the OneDevice tests. Kernel calls are counted by the dispatcher's
// RecordFunction observer, so the counts hold for the real kernels and the reference alike.
#include <gtest/gtest.h>
#include <ATen/record_function.h>
#include <torch/library.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>

#include <cmath>

#include "tessera/sdk/optimizer.hpp"

namespace {

/// Counts the fused Adam kernels the dispatcher runs on this thread while it lives.
class KernelCalls {
 public:
  KernelCalls()
      : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&KernelCalls::observe).needsInputs(false))) {
    adam = adamw = 0;
  }
  ~KernelCalls() { at::removeCallback(handle_); }
  int total() const { return adam + adamw; }
  static inline int adam = 0, adamw = 0;

 private:
  static std::unique_ptr<at::ObserverContext> observe(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    if (name == "aten::_fused_adam_") ++adam;
    if (name == "aten::_fused_adamw_") ++adamw;
    return nullptr;
  }
  at::CallbackHandle handle_;
};

#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4)
// aten::_fused_adam_'s and _fused_adamw_'s math (ATen's fused_adam_utils: the weight decay,
// as L2 into the gradient or decoupled from the parameter, the moments, bias corrections from
// the step tensor, then the update), one tensor at a time.
template <bool Decoupled>
void reference_fused_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                          double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                          const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(max_exp_avg_sqs.empty() && !amsgrad && !maximize && !grad_scale && !found_inf, "not used by Tessera");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double step = steps[i].item<double>();
    at::Tensor g = grads[i];
    if (weight_decay != 0) {
      if (Decoupled) params[i].mul_(1 - lr * weight_decay);
      else g = g.add(params[i], weight_decay);
    }
    exp_avgs[i].mul_(beta1).add_(g, 1 - beta1);
    exp_avg_sqs[i].mul_(beta2).addcmul_(g, g, 1 - beta2);
    const double bias1 = 1 - std::pow(beta1, step), bias2 = 1 - std::pow(beta2, step);
    params[i].addcdiv_(exp_avgs[i], (exp_avg_sqs[i].sqrt() / std::sqrt(bias2)).add_(eps), -lr / bias1);
  }
}

#if TORCH_VERSION_MAJOR < 2  // no _fused_adamw_ yet: declared here with LibTorch 2's schema
TORCH_LIBRARY_FRAGMENT(aten, m) {
  m.def("_fused_adamw_(Tensor(a!)[] self, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
        "Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *, float lr, float beta1, float beta2, float weight_decay, "
        "float eps, bool amsgrad, bool maximize, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()");
}
#endif

TORCH_LIBRARY_IMPL(aten, CPU, m) {
  m.impl("_fused_adam_", reference_fused_adam<false>);
  m.impl("_fused_adamw_", reference_fused_adam<true>);
}
#endif

std::vector<at::Tensor> parameters(std::uint64_t seed) {
  torch::manual_seed(static_cast<std::int64_t>(seed));
  // A matrix, a vector, a strided (transposed) one that still is dense, a scalar.
  return {torch::randn({7, 5}).requires_grad_(), torch::randn({11}).requires_grad_(),
          torch::randn({4, 6}).t().contiguous().t().requires_grad_(), torch::randn({}).requires_grad_()};
}

/// Steps `optimizer` over `params` with the same gradients each time for a given step; in
/// step 2 the vector has no gradient (it keeps its state and falls a step behind).
void train(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>& params, int steps) {
  for (int step = 1; step <= steps; ++step) {
    torch::manual_seed(100 + step);
    for (auto& p : params) {
      at::Tensor g = torch::randn(p.sizes());
      p.mutable_grad() = (step == 2 && p.dim() == 1) ? at::Tensor() : at::empty_strided(p.sizes(), p.strides()).copy_(g);
    }
    optimizer.step();
  }
}

template <class Loop, class Options, class State>
void expect_same_run(const std::string& name, const Options& options) {
  auto looped = parameters(1), fused = parameters(1);
  Loop loop(looped, options);
  tessera::sdk::OptimizerSettings settings;
  settings.name = name;
  settings.lr = options.lr();
  settings.beta1 = std::get<0>(options.betas());
  settings.beta2 = std::get<1>(options.betas());
  settings.eps = options.eps();
  settings.weight_decay = options.weight_decay();
  std::vector<tessera::sdk::NamedParameter> named;
  for (std::size_t i = 0; i < fused.size(); ++i) named.push_back({"p" + std::to_string(i), fused[i]});
  auto optimizer = tessera::sdk::make_optimizer(named, settings);
  ASSERT_NE(dynamic_cast<Loop*>(optimizer.get()), nullptr) << "checkpoints and callbacks see LibTorch's class";
  train(loop, looped, 5);
  KernelCalls calls;
  train(*optimizer, fused, 5);
  // Steps 1, 3, 4, 5: one bucket; step 2: the parameters without the vector. The vector's
  // step counts then trail by one: a bucket of its own from step 3 on.
  EXPECT_EQ(calls.total(), 1 + 1 + 2 * 3) << name;
  EXPECT_EQ(calls.adamw, name == "adamw" ? 1 + 1 + 2 * 3 : 0) << name;
  for (std::size_t i = 0; i < fused.size(); ++i) {
    EXPECT_TRUE(torch::allclose(fused[i], looped[i], 1e-5, 1e-6)) << name << " parameter " << i;
    const auto& a = static_cast<const State&>(*optimizer->state().at(tessera::sdk::optimizer_state_key(fused[i])));
    const auto& b = static_cast<const State&>(*loop.state().at(tessera::sdk::optimizer_state_key(looped[i])));
    EXPECT_EQ(a.step(), b.step()) << name << " parameter " << i;
    EXPECT_EQ(a.step(), i == 1 ? 4 : 5) << name << " parameter " << i;
    EXPECT_TRUE(torch::allclose(a.exp_avg(), b.exp_avg(), 1e-5, 1e-7)) << name << " parameter " << i;
    EXPECT_TRUE(torch::allclose(a.exp_avg_sq(), b.exp_avg_sq(), 1e-5, 1e-7)) << name << " parameter " << i;
  }
}

TEST(FusedAdam, AdamWStepsAsLibTorchsLoopWithDecoupledWeightDecay) {
  if (!tessera::sdk::has_fused_adam(c10::Device(c10::kCPU))) GTEST_FAIL() << "no CPU kernel registered";
  expect_same_run<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      "adamw", torch::optim::AdamWOptions(3e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
}

TEST(FusedAdam, AdamStepsAsLibTorchsLoopWithL2WeightDecay) {
  expect_same_run<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>(
      "adam", torch::optim::AdamOptions(3e-2).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.01));
}

// What the kernel does not take steps through LibTorch's loop: amsgrad, a gradient laid out
// otherwise than its parameter, moments laid out otherwise.
TEST(FusedAdam, AmsgradAndMismatchedGradientLayoutsTakeTheLoop) {
  auto params = parameters(2);
  std::vector<tessera::sdk::NamedParameter> named;
  for (auto& p : params) named.push_back({"p", p});
  tessera::sdk::OptimizerSettings settings;
  auto amsgrad = tessera::sdk::make_optimizer(named, settings);
  static_cast<torch::optim::AdamWOptions&>(amsgrad->param_groups().at(0).options()).amsgrad(true);
  KernelCalls calls;
  train(*amsgrad, params, 2);
  EXPECT_EQ(calls.total(), 0);
  EXPECT_TRUE(static_cast<const torch::optim::AdamWParamState&>(
                  *amsgrad->state().at(tessera::sdk::optimizer_state_key(params[0])))
                  .max_exp_avg_sq()
                  .defined())
      << "LibTorch's amsgrad ran";

  auto matrix = torch::randn({3, 4}).requires_grad_();
  auto optimizer = tessera::sdk::make_optimizer({{"m", matrix}}, settings);
  matrix.mutable_grad() = torch::randn({4, 3}).t();  // same shape, transposed strides
  optimizer->step();
  EXPECT_EQ(calls.total(), 0);

  // Moments laid out otherwise than the parameter (as a checkpoint could load them).
  matrix.mutable_grad() = torch::randn({3, 4});
  auto& moments = static_cast<torch::optim::AdamWParamState&>(
      *optimizer->state().at(tessera::sdk::optimizer_state_key(matrix)));
  moments.exp_avg(moments.exp_avg().t().contiguous().t());  // column-major
  optimizer->step();
  EXPECT_EQ(calls.total(), 0);
  moments.exp_avg(moments.exp_avg().contiguous());
  optimizer->step();
  EXPECT_EQ(calls.total(), 1) << "laid out as the parameter again: the kernel";
}

}  // namespace
