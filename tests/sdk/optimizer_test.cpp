// sdk::make_optimizer's Adam and AdamW step through LibTorch's fused kernel where it has one
// and compute what LibTorch's own loop computes. LibTorch gained a CPU kernel in 2.4; below that
// (Debian's bookworm 1.13) the toolkit registers its own (toolkit/src/fused_adam_cpu.cpp), which these
// tests then run: the kernel and the optimizer's side (state, step counts, buckets, decoupled
// weight decay, the fallbacks) are tested on every machine; on CUDA the real kernel runs in the
// OneDevice tests. Kernel calls are counted by the dispatcher's RecordFunction observer.
#include <gtest/gtest.h>
#include <ATen/record_function.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_fused_adam.h>
#include <torch/version.h>

#include <cmath>

#include "tessera/sdk/optimizer.hpp"

namespace {

/// Below LibTorch 2.4 the CPU kernel is Tessera's own (toolkit/src/fused_adam_cpu.cpp).
constexpr bool kTesserasCpuKernel = TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4);

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
      p.mutable_grad() = (step == 2 && p.dim() == 1) ? at::Tensor() : at::empty_strided(p.sizes(), p.strides(), p.options()).copy_(g);
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

// A tensor the kernel splits over threads, and half-precision parameters (computed in fp32):
// the same as LibTorch's loop, and (Tessera's kernel, which promises it) bitwise the same on one
// thread as on several.
TEST(FusedAdam, LargeAndBFloat16ParametersStepAsTheLoopOnAnyNumberOfThreads) {
  const int threads = at::get_num_threads();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    auto make = [&] {
      torch::manual_seed(3);
      return std::vector<at::Tensor>{torch::randn({3001, 100}).to(dtype).requires_grad_(),
                                     torch::randn({129, 7}).to(dtype).requires_grad_()};
    };
    auto looped = make(), one_thread = make(), threaded = make();
    const auto options = torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1);
    torch::optim::AdamW loop(looped, options);
    tessera::sdk::OptimizerSettings settings;
    settings.lr = 1e-2;
    settings.beta2 = 0.95;
    settings.weight_decay = 0.1;
    std::vector<tessera::sdk::NamedParameter> a{{"v", one_thread[0]}, {"m", one_thread[1]}},
        b{{"v", threaded[0]}, {"m", threaded[1]}};
    auto single = tessera::sdk::make_optimizer(a, settings), several = tessera::sdk::make_optimizer(b, settings);
    KernelCalls calls;
    at::set_num_threads(1);
    train(loop, looped, 3);
    train(*single, one_thread, 3);
    at::set_num_threads(4);
    train(*several, threaded, 3);
    at::set_num_threads(threads);
    EXPECT_EQ(calls.adamw, 2 * 3) << dtype;
    for (std::size_t i = 0; i < looped.size(); ++i) {
      if (kTesserasCpuKernel) EXPECT_TRUE(torch::equal(one_thread[i], threaded[i])) << dtype << " parameter " << i;
      // bf16: within an ulp (at most 2^-7 relative) per step and one more. The loop rounds each
      // pass to bf16, so its decay by 1 - lr x weight_decay, under half an ulp, rounds away; the
      // kernel, as LibTorch 2.4's, computes in fp32 and rounds once.
      const double rtol = dtype == at::kFloat ? 1e-5 : (3 + 1) / 128.0, atol = dtype == at::kFloat ? 1e-6 : 1e-3;
      const at::Tensor reference = looped[i].to(at::kFloat);
      for (const at::Tensor& stepped : {one_thread[i], threaded[i]}) {
        const at::Tensor fused = stepped.to(at::kFloat);
        EXPECT_TRUE(torch::allclose(fused, reference, rtol, atol))
            << dtype << " parameter " << i << ": largest difference " << (fused - reference).abs().max().item<float>();
      }
    }
  }
}

// Tessera's own CPU kernel refuses what it does not implement, saying so, rather than ignore it.
TEST(FusedAdam, TesserasCpuKernelRefusesAmsgrad) {
  if (!kTesserasCpuKernel) GTEST_SKIP() << "LibTorch >= 2.4 has its own CPU kernel, which takes amsgrad";
  auto p = torch::randn({4}), g = torch::randn({4}), m = torch::zeros({4}), v = torch::zeros({4});
  const auto step = torch::ones({});
  try {
    at::_fused_adam_({p}, {g}, {m}, {v}, {torch::zeros({4})}, {step}, 1e-3, 0.9, 0.999, 0, 1e-8, /*amsgrad=*/true,
                     /*maximize=*/false);
    FAIL() << "amsgrad accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("takes no amsgrad"), std::string::npos) << e.what();
  }
}

}  // namespace
