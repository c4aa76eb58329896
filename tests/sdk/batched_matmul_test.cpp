// toolkit::batched_matmul: at::baddbmm's values bit for bit and its gradients, whether the matrices
// go to the threads one by one (the CPU, float or double, several threads) or to LibTorch.
#include <gtest/gtest.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/autograd.h>

#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "tessera/toolkit/batched_matmul.hpp"
#include "tessera/sdk/error.hpp"

namespace {

using tessera::toolkit::batched_matmul;

/// Sets LibTorch's threads for one test and restores them.
class Threads {
 public:
  explicit Threads(int n) : before_(at::get_num_threads()) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(before_); }

 private:
  int before_;
};

struct Operands {
  at::Tensor a, b, bias;
};

/// a [n, p, q], b given as the transpose of a contiguous [n, r, q] (as attention's k^T), a causal bias.
Operands operands(at::ScalarType dtype, bool bias_needs_grad = false) {
  torch::manual_seed(7);
  const std::int64_t n = 5, p = 9, q = 6, r = 9;
  Operands o;
  o.a = at::randn({n, p, q}).to(dtype).requires_grad_();
  o.b = at::randn({n, r, q}).to(dtype).transpose(1, 2).detach().requires_grad_();
  o.bias = bias_needs_grad ? at::randn({p, r}).to(dtype).requires_grad_()
                           : at::full({p, r}, -std::numeric_limits<double>::infinity()).to(dtype).triu(1);
  return o;
}

/// The gradients of sum(out * weights) with respect to `inputs`.
std::vector<at::Tensor> gradients(const at::Tensor& out, const std::vector<at::Tensor>& inputs) {
  at::Tensor weights = at::arange(out.numel(), out.options().requires_grad(false)).reshape(out.sizes()).cos();
  return torch::autograd::grad({(out.masked_fill(out.isinf(), 0) * weights).sum()}, inputs);
}

TEST(BatchedMatmul, ComputesBaddbmmsValuesAndGradientsOnOneThreadAndSeveral) {
  for (int threads : {1, 2, 3}) {
    Threads guard(threads);
    for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      Operands o = operands(dtype, /*bias_needs_grad=*/true);
      const double alpha = 0.125;
      const at::Tensor expected = at::baddbmm(o.bias, o.a, o.b, 1, alpha);
      const at::Tensor got = batched_matmul(o.a, o.b, o.bias, alpha);
      EXPECT_TRUE(torch::equal(got, expected)) << dtype << " on " << threads << " thread(s)";
      const auto expected_grads = gradients(expected, {o.a, o.b, o.bias});
      const auto got_grads = gradients(got, {o.a, o.b, o.bias});
      const double tolerance = dtype == at::kBFloat16 ? 1e-2 : 1e-6;
      for (std::size_t i = 0; i < got_grads.size(); ++i)
        EXPECT_TRUE(torch::allclose(got_grads[i], expected_grads[i], tolerance, tolerance))
            << dtype << " on " << threads << " thread(s), gradient " << i << ": largest difference "
            << (got_grads[i] - expected_grads[i]).abs().max().item<double>();
    }
  }
}

TEST(BatchedMatmul, WithoutABiasIsBmmTimesAlpha) {
  Threads guard(2);
  Operands o = operands(at::kFloat);
  EXPECT_TRUE(torch::equal(batched_matmul(o.a, o.b), at::bmm(o.a, o.b)));
  EXPECT_TRUE(torch::equal(batched_matmul(o.a, o.b, {}, 0.5), at::bmm(o.a, o.b) * 0.5));
  const auto expected = gradients(at::bmm(o.a, o.b) * 0.5, {o.a, o.b});
  const auto got = gradients(batched_matmul(o.a, o.b, {}, 0.5), {o.a, o.b});
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::allclose(got[i], expected[i], 1e-6, 1e-6)) << i;
  // Only the gradients autograd asks for: b alone.
  at::Tensor a = o.a.detach();
  const auto b_only = gradients(batched_matmul(a, o.b), {o.b});
  EXPECT_TRUE(torch::allclose(b_only[0], gradients(at::bmm(a, o.b), {o.b})[0], 1e-6, 1e-6));
}

// create_graph: a gradient that is itself differentiated (e.g. a gradient penalty).
TEST(BatchedMatmul, BackwardIsDifferentiableUnderCreateGraph) {
  Threads guard(2);
  auto second_order = [](auto product) {
    Operands o = operands(at::kDouble);
    at::Tensor out = product(o.a, o.b);
    at::Tensor grad_a = torch::autograd::grad({out.pow(2).sum()}, {o.a}, {}, /*retain_graph=*/true,
                                              /*create_graph=*/true)[0];
    return torch::autograd::grad({grad_a.sum()}, {o.b})[0];
  };
  EXPECT_TRUE(torch::allclose(second_order([](auto& a, auto& b) { return batched_matmul(a, b, {}, 0.5); }),
                              second_order([](auto& a, auto& b) { return at::bmm(a, b) * 0.5; })));
}

// The point of it: each matrix one BLAS call, the calls spread over the pool's threads (counted
// by the dispatcher's observer on every thread), and OpenBLAS's own thread count as it was.
TEST(BatchedMatmul, GivesEachThreadItsOwnMatrices) {
  Threads guard(2);
  static std::mutex seen_mutex;
  static std::set<std::thread::id> threads;
  static int products = 0;
  threads.clear();
  products = 0;
  auto handle = at::addGlobalCallback(at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                                                     -> std::unique_ptr<at::ObserverContext> {
                                        const std::string name = fn.name();
                                        if (name == "aten::addmm" || name == "aten::mm") {
                                          std::lock_guard<std::mutex> lock(seen_mutex);
                                          threads.insert(std::this_thread::get_id());
                                          ++products;
                                        }
                                        return nullptr;
                                      }).needsInputs(false));
  using GetThreads = int (*)();
  auto blas_threads = reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const int blas_before = blas_threads ? blas_threads() : 0;
  Operands o = operands(at::kFloat);
  batched_matmul(o.a, o.b, o.bias, 0.125);
  at::removeCallback(handle);
  if (blas_threads == nullptr) GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS: batched_matmul is at::baddbmm";
  EXPECT_EQ(products, o.a.size(0)) << "one product per matrix";
  EXPECT_EQ(threads.size(), 2u) << "the matrices went to both threads";
  EXPECT_EQ(blas_threads(), blas_before) << "OpenBLAS's thread count is restored";
}

// A plugin built against the SDK gets OpenMP: LibTorch's at::parallel_for, an inline template,
// runs its loop serially in code compiled without it.
TEST(BatchedMatmul, PluginsCompiledAgainstTheSdkRunParallelForInParallel) {
  Threads guard(2);
  std::mutex seen_mutex;
  std::set<std::thread::id> threads;
  at::parallel_for(0, 2, 1, [&](std::int64_t, std::int64_t) {
    std::lock_guard<std::mutex> lock(seen_mutex);
    threads.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(threads.size(), 2u);
}

TEST(BatchedMatmul, RefusesOperandsThatAreNotBatchesOfMatrices) {
  const at::Tensor a = at::randn({2, 3, 4});
  for (const at::Tensor& b : {at::randn({2, 5, 6}), at::randn({3, 4, 6}), at::randn({4, 6})}) {
    try {
      batched_matmul(a, b);
      ADD_FAILURE() << "no error for b " << b.sizes();
    } catch (const tessera::sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find("a [n, p, q] and b [n, q, r], got [2, 3, 4] and"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
