// The toolkit's fused kernels (toolkit/include/tessera/toolkit/fused.hpp) against the unfused
// LibTorch math they replace, forward + backward, on the shapes of the bench models. Fused and
// unfused alternate round by round, so a slow spell of the host hits both; each row prints the
// median of its rounds' time ratios fused / unfused (below 1: the fused kernel is faster).
//   build/bin/fused_kernels_bench [rounds] [threads] [name filter]  (run with GOMP_SPINCOUNT=10000
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

/// Forward and backward of `outputs` with fixed upstream gradients (what a step does with them).
void backward(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& grads) {
  torch::autograd::backward(outputs, grads);
}

/// LlamaRMSNorm as the llama computes it unfused (fused_rms_norm = false), with the residual add
/// before it when `residual`.
Row rms_norm_row(const std::string& name, std::int64_t rows, std::int64_t hidden, at::ScalarType dtype, bool residual,
                 int repeats) {
  auto x = leaf({rows, hidden}, dtype), delta = leaf({rows, hidden}, dtype), w = leaf({hidden}, dtype);
  auto dy = at::randn({rows, hidden}).to(dtype), dh = at::randn({rows, hidden}).to(dtype);
  const double eps = 1e-6;
  Step fused = [=] {
    if (!residual) return backward({tessera::toolkit::rms_norm(x, w, eps)}, {dy});
    auto [h, y] = tessera::toolkit::add_rms_norm(x, delta, w, eps);
    backward({h, y}, {dh, dy});
  };
  Step unfused = [=] {
    const at::Tensor h = residual ? x + delta : x;
    at::Tensor f = h.to(at::kFloat);
    f = f * at::rsqrt(f.pow(2).mean(-1, /*keepdim=*/true) + eps);
    const at::Tensor y = w * f.to(dtype);
    if (residual) backward({h, y}, {dh, dy});
    else backward({y}, {dy});
  };
  return {name, fused, unfused, repeats};
}

at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

/// Hugging Face's apply_rotary_pos_emb on q [B, Hq, T, D] and k [B, Hkv, T, D].
Row rotary_row(const std::string& name, std::int64_t B, std::int64_t Hq, std::int64_t Hkv, std::int64_t T,
               std::int64_t D, at::ScalarType dtype, int repeats) {
  auto q = leaf({B, Hq, T, D}, dtype), k = leaf({B, Hkv, T, D}, dtype);
  const at::Tensor angles = at::arange(T, at::kFloat).unsqueeze(1) * at::rand({D / 2});
  const at::Tensor emb = at::cat({angles, angles}, -1);
  const at::Tensor c = emb.cos().to(dtype), sn = emb.sin().to(dtype);
  auto gq = at::randn({B, Hq, T, D}).to(dtype), gk = at::randn({B, Hkv, T, D}).to(dtype);
  Step fused = [=] {
    auto [oq, ok] = tessera::toolkit::rotary_embedding(q, k, c, sn);
    backward({oq, ok}, {gq, gk});
  };
  Step unfused = [=] { backward({q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn}, {gq, gk}); };
  return {name, fused, unfused, repeats};
}

/// The llama's MLP gate, silu(gate) * up.
Row swiglu_row(const std::string& name, std::int64_t rows, std::int64_t width, at::ScalarType dtype, int repeats) {
  auto gate = leaf({rows, width}, dtype), up = leaf({rows, width}, dtype);
  auto dy = at::randn({rows, width}).to(dtype);
  Step fused = [=] { backward({tessera::toolkit::swiglu(gate, up)}, {dy}); };
  Step unfused = [=] { backward({at::silu(gate) * up}, {dy}); };
  return {name, fused, unfused, repeats};
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  if (argc > 2) at::set_num_threads(std::atoi(argv[2]));
  // [filter]: only the rows whose name contains it.
  const std::string filter = argc > 3 ? argv[3] : "";
  at::manual_seed(0);
  std::vector<Row> rows;
  // The shapes of configs/llama-fortunes.toml's steps (16 x 128 tokens, 256 wide, 4 heads of 64,
  // 2 KV heads, MLP 688) and of a 1B Llama's per-rank slice (4 x 512 tokens, 2048 wide, 32 heads of
  // 64, 8 KV heads, MLP 5632).
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const std::string t = dtype == at::kFloat ? "fp32" : "bf16";
    rows.push_back(rms_norm_row("RMSNorm 2048 x 256, " + t, 2048, 256, dtype, false, 20));
    rows.push_back(rms_norm_row("add+RMSNorm 2048 x 256, " + t, 2048, 256, dtype, true, 20));
    rows.push_back(rms_norm_row("add+RMSNorm 2048 x 2048, " + t, 2048, 2048, dtype, true, 4));
    rows.push_back(rotary_row("rotary q 16x4x128x64, k 16x2x128x64, " + t, 16, 4, 2, 128, 64, dtype, 20));
    rows.push_back(rotary_row("rotary q 4x32x512x64, k 4x8x512x64, " + t, 4, 32, 8, 512, 64, dtype, 2));
    rows.push_back(swiglu_row("SwiGLU 2048 x 688, " + t, 2048, 688, dtype, 10));
    rows.push_back(swiglu_row("SwiGLU 2048 x 5632, " + t, 2048, 5632, dtype, 2));
  }
  rows.push_back(linear_cross_entropy_row("linear+CE llama vocab 128256, 2048 x 64, fp32", 2048, 64, 128256, at::kFloat, 1));
  rows.push_back(linear_cross_entropy_row("linear+CE llama vocab 128256, 2048 x 64, bf16", 2048, 64, 128256, at::kBFloat16, 1));
  rows.push_back(linear_cross_entropy_row("linear+CE gpt vocab 256, 4096 x 384, fp32", 4096, 384, 256, at::kFloat, 10));
  rows.push_back(linear_cross_entropy_row("linear+CE vocab 32000, 1024 x 512, fp32", 1024, 512, 32000, at::kFloat, 1));
  std::printf("%-56s %8s %8s %8s   (median of %d rounds; threads %d)\n", "kernel, shape", "fused s", "unfused", "ratio",
              rounds, at::get_num_threads());
  for (const Row& row : rows) {
    if (row.name.find(filter) == std::string::npos) continue;
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
