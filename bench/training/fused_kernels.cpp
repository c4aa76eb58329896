// The toolkit's fused kernels (toolkit/include/tessera/toolkit/fused.hpp) against the unfused
// LibTorch math they replace, forward + backward, on the shapes of the bench models. Fused and
// unfused alternate round by round, so a slow spell of the host hits both; each row prints the
// median of its rounds' time ratios fused / unfused (below 1: the fused kernel is faster).
//   build/bin/fused_kernels_bench [rounds] [threads]  (run with GOMP_SPINCOUNT=10000
//   OPENBLAS_THREAD_TIMEOUT=20, as the tessera binary runs, to measure what a step sees)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include "tessera/toolkit/fused.hpp"

namespace {

using Step = std::function<void()>;

struct Row {
  std::string name;
  Step fused, unfused;
  int repeats;  // calls per timed sample
};

double seconds(const Step& step, int repeats) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) step();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

at::Tensor leaf(at::IntArrayRef sizes, at::ScalarType dtype, double scale = 1.0) {
  return at::randn(sizes).mul_(scale).to(dtype).requires_grad_(true);
}

/// The loss as causal_lm.hpp computed it before the fused one: fp32 logits, then cross_entropy.
Row linear_cross_entropy_row(const std::string& name, std::int64_t rows, std::int64_t hidden, std::int64_t vocab,
                             at::ScalarType dtype, int repeats) {
  auto h = leaf({rows, hidden}, dtype), w = leaf({vocab, hidden}, dtype, 0.05);
  auto t = at::randint(vocab, {rows}, at::kLong);
  Step fused = [=] { tessera::toolkit::linear_cross_entropy(h, w, t).backward(); };
  Step unfused = [=] {
    at::Tensor logits = at::mm(h, w.t()).to(at::kFloat);
    at::cross_entropy_loss(logits, t, {}, at::Reduction::Mean, -100, 0.0).backward();
  };
  return {name, fused, unfused, repeats};
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  if (argc > 2) at::set_num_threads(std::atoi(argv[2]));
  at::manual_seed(0);
  std::vector<Row> rows;
  rows.push_back(linear_cross_entropy_row("linear+CE llama vocab 128256, 2048 x 64, fp32", 2048, 64, 128256, at::kFloat, 1));
  rows.push_back(linear_cross_entropy_row("linear+CE llama vocab 128256, 2048 x 64, bf16", 2048, 64, 128256, at::kBFloat16, 1));
  rows.push_back(linear_cross_entropy_row("linear+CE gpt vocab 256, 4096 x 384, fp32", 4096, 384, 256, at::kFloat, 10));
  rows.push_back(linear_cross_entropy_row("linear+CE vocab 32000, 1024 x 512, fp32", 1024, 512, 32000, at::kFloat, 1));
  std::printf("%-56s %8s %8s %8s   (median of %d rounds; threads %d)\n", "kernel, shape", "fused s", "unfused", "ratio",
              rounds, at::get_num_threads());
  for (const Row& row : rows) {
    row.fused();  // warm-up: allocator, BLAS pools
    row.unfused();
    std::vector<double> ratios, fused, unfused;
    for (int r = 0; r < rounds; ++r) {
      const bool fused_first = r % 2 == 0;
      const double a = seconds(fused_first ? row.fused : row.unfused, row.repeats);
      const double b = seconds(fused_first ? row.unfused : row.fused, row.repeats);
      fused.push_back(fused_first ? a : b);
      unfused.push_back(fused_first ? b : a);
      ratios.push_back(fused.back() / unfused.back());
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("%-56s %8.4f %8.4f %8.3f\n", row.name.c_str(), median(fused) / row.repeats,
                median(unfused) / row.repeats, median(ratios));
    std::fflush(stdout);
  }
  return 0;
}
