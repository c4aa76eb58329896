// Attention's two batched products (scores = mask + q k^T / sqrt(D), then weights @ v), forward
// and backward, through LibTorch's at::baddbmm / at::bmm and through toolkit::batched_matmul, on
// the bench GPT's shapes (batch 16, 6 heads, 128 tokens, 64 per head). The two alternate
// round by round, so a slow spell of the host hits both; prints each round's ratio and the median.
//   build/bin/attention_bench [rounds] [threads]  (run with the tessera binary's
//   GOMP_SPINCOUNT=10000 OPENBLAS_THREAD_TIMEOUT=20 to measure what a training step sees)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include "tessera/toolkit/batched_matmul.hpp"
#include "tessera/toolkit/openblas.hpp"

namespace {

constexpr std::int64_t kBatch = 16, kHeads = 6, kTokens = 128, kHeadWidth = 64;

/// Seconds of `steps` forward + backward passes of the attention core.
template <class Scores, class Weighted>
double seconds(Scores scores, Weighted weighted, int steps) {
  const std::int64_t n = kBatch * kHeads;
  at::Tensor q = at::randn({n, kTokens, kHeadWidth}).requires_grad_();
  at::Tensor k = at::randn({n, kTokens, kHeadWidth}).requires_grad_();
  at::Tensor v = at::randn({n, kTokens, kHeadWidth}).requires_grad_();
  at::Tensor mask = at::full({kTokens, kTokens}, -std::numeric_limits<float>::infinity()).triu(1);
  const double alpha = 1.0 / std::sqrt(static_cast<double>(kHeadWidth));
  at::Tensor grad = at::randn({n, kTokens, kHeadWidth});
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    at::Tensor y = weighted(at::softmax(scores(q, k.transpose(1, 2), mask, alpha), -1), v);
    torch::autograd::backward({y}, {grad});
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  if (argc > 2) {
    const int threads = std::atoi(argv[2]);
    at::set_num_threads(threads);
    tessera::toolkit::openblas::set_num_threads(threads);  // OpenBLAS's own pool, as the tessera binary sets it
  }
  auto libtorch_scores = [](const at::Tensor& q, const at::Tensor& kt, const at::Tensor& mask, double alpha) {
    return at::baddbmm(mask, q, kt, 1, alpha);
  };
  auto libtorch_weighted = [](const at::Tensor& w, const at::Tensor& v) { return at::bmm(w, v); };
  auto sdk_scores = [](const at::Tensor& q, const at::Tensor& kt, const at::Tensor& mask, double alpha) {
    return tessera::toolkit::batched_matmul(q, kt, mask, alpha);
  };
  auto sdk_weighted = [](const at::Tensor& w, const at::Tensor& v) { return tessera::toolkit::batched_matmul(w, v); };
  const int steps = 10;
  seconds(libtorch_scores, libtorch_weighted, 2);  // warm-up: the allocator's pages, BLAS's buffers
  seconds(sdk_scores, sdk_weighted, 2);
  std::printf("attention products, forward + backward, %d threads (%lld x %lld heads, %lld tokens, %lld wide):\n",
              at::get_num_threads(), static_cast<long long>(kBatch), static_cast<long long>(kHeads),
              static_cast<long long>(kTokens), static_cast<long long>(kHeadWidth));
  std::vector<double> ratios;
  for (int r = 0; r < rounds; ++r) {
    const double libtorch = seconds(libtorch_scores, libtorch_weighted, steps);
    const double sdk = seconds(sdk_scores, sdk_weighted, steps);
    ratios.push_back(libtorch / sdk);
    std::printf("  round %d: at::baddbmm/bmm %.2f ms, toolkit::batched_matmul %.2f ms a step: %.2fx\n", r + 1,
                libtorch / steps * 1e3, sdk / steps * 1e3, ratios.back());
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("median: toolkit::batched_matmul %.2fx LibTorch's speed\n", ratios[ratios.size() / 2]);
}
