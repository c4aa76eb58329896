// The toolkit's CUDA kernels (toolkit/cuda) on the device against its CPU kernels (which
// fused_ops_test and fused_loss_test check against the unfused math): each fused op on CUDA
// copies of the inputs against the same op on the CPU, values and gradients, and the launchers'
// in-place rotary. Built only where the toolkit is built with CUDA; skipped without a GPU. Named
// CUDA.* as the other GPU tests, so that bench/gpu/build_and_bench.sh's `test` runs them.
// Tolerances, relative to the largest magnitude: fp32 2e-5 (sums in another order); bf16 1e-2
// (both round once from fp32, and may land one bf16 step, 2^-8, apart).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include "cuda/fused_kernels.h"
#include "tessera/toolkit/fused.hpp"

namespace {

namespace tk = tessera::toolkit;
using Tensors = std::vector<at::Tensor>;
using Fn = std::function<Tensors(const Tensors&)>;

#define SKIP_WITHOUT_GPU() \
  if (!at::hasCUDA()) GTEST_SKIP() << "SKIPPED: no CUDA device visible; these tests run the CUDA kernels on a GPU"

at::Tensor randn(at::IntArrayRef sizes, std::uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, g, at::TensorOptions().dtype(at::kFloat));
}

/// `t` on `device` with its strides (a strided CPU input stays strided on the device).
at::Tensor on(const at::Tensor& t, const at::Device& device) {
  at::Tensor copy = at::empty_strided(t.sizes(), t.strides(), t.options().device(device));
  return copy.copy_(t);
}

double tolerance(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 1e-2 : 2e-5; }

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined() && want.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << what;
  const at::Tensor g = got.cpu().to(at::kDouble), w = want.cpu().to(at::kDouble);
  const double err = (g - w).abs().max().item<double>(), ref = w.abs().max().item<double>();
  EXPECT_LE(err, tolerance(want.scalar_type()) * std::max(ref, 1e-30))
      << what << ": max |difference| " << err << ", max |reference| " << ref;
}

struct Run {
  Tensors values, grads;
  std::string node;  // the first output's autograd node
};

/// fn on `inputs` copied to `device`, then backward under `upstream` (one per output).
Run run(const Fn& fn, const Tensors& inputs, const Tensors& upstream, const at::Device& device) {
  Tensors leaves;
  for (const at::Tensor& t : inputs) leaves.push_back(on(t, device).requires_grad_(t.is_floating_point()));
  Tensors outputs = fn(leaves);
  Run r;
  r.node = outputs[0].grad_fn() ? outputs[0].grad_fn()->name() : "";
  Tensors grads;
  for (std::size_t i = 0; i < outputs.size(); ++i) grads.push_back(on(upstream[i].to(outputs[i].scalar_type()), device));
  torch::autograd::backward(outputs, grads);
  for (const at::Tensor& o : outputs) r.values.push_back(o.detach().cpu());
  for (const at::Tensor& l : leaves) r.grads.push_back(l.grad().defined() ? l.grad().cpu() : at::Tensor());
  return r;
}

/// fn on CUDA (its node named `node`: the fused kernel ran, not the unfused math) against fn on the CPU.
void expect_cuda_matches_cpu(const Fn& fn, const Tensors& inputs, const std::string& node) {
  Tensors probe = fn(inputs);
  Tensors upstream;
  for (std::size_t i = 0; i < probe.size(); ++i) upstream.push_back(randn(probe[i].sizes(), 77 + i));
  Run want = run(fn, inputs, upstream, at::kCPU), got = run(fn, inputs, upstream, at::Device(at::kCUDA, 0));
  EXPECT_NE(got.node.find(node), std::string::npos) << "the CUDA run's node is " << got.node;
  for (std::size_t i = 0; i < want.values.size(); ++i) expect_close(got.values[i], want.values[i], "output " + std::to_string(i));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].is_floating_point()) expect_close(got.grads[i], want.grads[i], "gradient of input " + std::to_string(i));
}

TEST(CUDA, FusedRmsNormMatchesTheCpuKernel) {
  SKIP_WITHOUT_GPU();
  const Fn fn = [](const Tensors& in) { return Tensors{tk::rms_norm(in[0], in[1], 1e-6)}; };
  for (at::ScalarType x_type : {at::kFloat, at::kBFloat16})
    for (at::ScalarType w_type : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << "x " << x_type << ", weight " << w_type);
      // Odd width; rows 2 apart; more rows than the backward's blocks (each then sums several);
      // a width past 1024 threads x 4 and past the backward's shared-memory accumulator (48 KiB).
      for (const at::Tensor& x : {randn({2, 5, 37}, 1), randn({12, 37}, 2).slice(0, 0, 12, 2), randn({1000, 64}, 3),
                                  randn({3, 12301}, 4)}) {
        const std::int64_t D = x.size(-1);
        SCOPED_TRACE(::testing::Message() << x.sizes());
        at::Tensor w = (1 + 0.1 * randn({D}, 5)).to(w_type);
        expect_cuda_matches_cpu(fn, {x.to(x_type), w}, "RmsNormFunction");
      }
    }
}

TEST(CUDA, FusedAddRmsNormMatchesTheCpuKernel) {
  SKIP_WITHOUT_GPU();
  const Fn fn = [](const Tensors& in) {
    auto [h, y] = tk::add_rms_norm(in[0], in[1], in[2], 1e-5);
    return Tensors{h, y};
  };
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << dtype);
    expect_cuda_matches_cpu(fn, {randn({3, 7, 64}, 6).to(dtype), randn({3, 7, 64}, 7).to(dtype), (1 + 0.1 * randn({64}, 8)).to(dtype)},
                            "AddRmsNormFunction");
  }
  // bf16 autocast's residual stream: fp32 x, bf16 delta, h in fp32.
  expect_cuda_matches_cpu(fn, {randn({5, 33}, 9), randn({5, 33}, 10).to(at::kBFloat16), at::ones({33})},
                          "AddRmsNormFunction");
}

at::Tensor rotary_angles(std::int64_t T, std::int64_t D) {
  at::Tensor positions = at::arange(T, at::kFloat).unsqueeze(1);
  at::Tensor inv_freq = at::pow(10000.0, at::arange(0, D, 2, at::kFloat) / D).reciprocal();
  at::Tensor freqs = positions * inv_freq.unsqueeze(0);
  return at::cat({freqs, freqs}, -1);
}

TEST(CUDA, FusedRotaryMatchesTheCpuKernelOnGroupedQueryShapes) {
  SKIP_WITHOUT_GPU();
  const std::int64_t B = 2, Hq = 6, Hkv = 2, T = 9, D = 10;
  const at::Tensor emb = rotary_angles(T, D);
  for (at::ScalarType q_type : {at::kFloat, at::kBFloat16})
    for (at::ScalarType k_type : {at::kFloat, at::kBFloat16})
      for (at::ScalarType cos_type : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE(::testing::Message() << "q " << q_type << ", k " << k_type << ", cos " << cos_type);
        const at::Tensor cos = emb.cos().to(cos_type), sin = emb.sin().to(cos_type);
        const Fn fn = [&](const Tensors& in) {
          auto [qr, kr] = tk::rotary_embedding(in[0], in[1], on(cos, in[0].device()), on(sin, in[0].device()));
          return Tensors{qr, kr};
        };
        // As llama's attention makes them: [B, T, H, D] projections seen as [B, H, T, D].
        expect_cuda_matches_cpu(fn, {randn({B, T, Hq, D}, 11).to(q_type).transpose(1, 2),
                                     randn({B, T, Hkv, D}, 12).to(k_type).transpose(1, 2)},
                                "RotaryFunction");
      }
}

/// The launcher with out == x: forward and backward overwrite q and k where they lie.
TEST(CUDA, FusedRotaryLauncherRotatesInPlace) {
  SKIP_WITHOUT_GPU();
  namespace kc = tessera::toolkit::cuda;
  const std::int64_t B = 2, Hq = 4, Hkv = 1, T = 5, D = 8;
  const at::Tensor emb = rotary_angles(T, D), cos = emb.cos(), sin = emb.sin();
  const at::Tensor q = randn({B, T, Hq, D}, 13).transpose(1, 2), k = randn({B, T, Hkv, D}, 14).transpose(1, 2);
  const at::Tensor gq = randn({B, Hq, T, D}, 15), gk = randn({B, Hkv, T, D}, 16);
  // The CPU kernel's values and gradients.
  at::Tensor q_leaf = q.clone().requires_grad_(true), k_leaf = k.clone().requires_grad_(true);
  auto [qr, kr] = tk::rotary_embedding(q_leaf, k_leaf, cos, sin);
  torch::autograd::backward({qr, kr}, {gq, gk});
  const at::Device cuda(at::kCUDA, 0);
  const at::Tensor dcos = on(cos, cuda), dsin = on(sin, cuda);
  auto rotate_in_place = [&](const at::Tensor& x, const at::Tensor& y, bool backward) {
    kc::Rotary a;
    a.B = B;
    a.T = T;
    a.D = D;
    a.cos = dcos.data_ptr();
    a.sin = dsin.data_ptr();
    a.cs_row_stride = D;
    a.backward = backward;
    auto describe = [](const at::Tensor& t, kc::RotaryOperand& side) {
      side.x = side.out = t.data_ptr();
      for (int d = 0; d < 3; ++d) side.x_strides[d] = side.out_strides[d] = t.stride(d);
      side.heads = t.size(1);
    };
    describe(x, a.q);
    describe(y, a.k);
    ASSERT_EQ(kc::rotary_embedding(a, c10::cuda::getCurrentCUDAStream().stream()), cudaSuccess);
  };
  const at::Tensor dq = on(q, cuda), dk = on(k, cuda);  // strided, as the projections lie
  rotate_in_place(dq, dk, false);
  expect_close(dq, qr.detach(), "q rotated in place");
  expect_close(dk, kr.detach(), "k rotated in place");
  const at::Tensor dgq = on(gq, cuda), dgk = on(gk, cuda);
  rotate_in_place(dgq, dgk, true);
  expect_close(dgq, q_leaf.grad(), "q's gradient in place");
  expect_close(dgk, k_leaf.grad(), "k's gradient in place");
}

TEST(CUDA, FusedSwiGLUMatchesTheCpuKernel) {
  SKIP_WITHOUT_GPU();
  const Fn fn = [](const Tensors& in) { return Tensors{tk::swiglu(in[0], in[1])}; };
  for (at::ScalarType g_type : {at::kFloat, at::kBFloat16})
    for (at::ScalarType u_type : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << "gate " << g_type << ", up " << u_type);
      expect_cuda_matches_cpu(fn, {(4 * randn({3, 7, 131}, 17)).to(g_type), randn({3, 7, 131}, 18).to(u_type)},
                              "SwiGLUFunction");
      // The halves of one [rows, 2 width] projection: rows 2 width apart.
      at::Tensor gate_up = 4 * randn({21, 262}, 19);
      expect_cuda_matches_cpu(fn, {gate_up.narrow(1, 0, 131).to(g_type), gate_up.narrow(1, 131, 131).to(u_type)},
                              "SwiGLUFunction");
      expect_cuda_matches_cpu(fn, {(4 * randn({131, 21}, 20)).to(g_type).t(), randn({21, 131}, 21).to(u_type)},
                              "SwiGLUFunction");
    }
  at::Tensor extreme = at::tensor({-200.0f, -90.0f, -20.0f, 0.0f, 20.0f, 90.0f, 200.0f});
  expect_cuda_matches_cpu(fn, {extreme, at::ones_like(extreme)}, "SwiGLUFunction");
}

TEST(CUDA, FusedLinearCrossEntropyMatchesTheCpuPath) {
  SKIP_WITHOUT_GPU();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    // Several chunks with a short last one; one chunk of a Llama 3-sized vocabulary.
    for (auto [rows, vocab, chunk] : std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{{37, 1000, 8}, {6, 128256, 0}}) {
      SCOPED_TRACE(::testing::Message() << dtype << ", rows " << rows << ", vocab " << vocab);
      const std::int64_t H = 24;
      at::Tensor target = at::randint(vocab, {rows}, at::detail::createCPUGenerator(22), at::kLong);
      target.slice(0, 0, rows, 5).fill_(-100);  // every fifth row ignored
      const Fn fn = [&](const Tensors& in) {
        tk::LinearCrossEntropyOptions options;
        options.chunk_rows = chunk;
        return Tensors{tk::linear_cross_entropy(in[0], in[1], on(target, in[0].device()), options)};
      };
      expect_cuda_matches_cpu(fn, {randn({rows, H}, 23).to(dtype), (0.3 * randn({vocab, H}, 24)).to(dtype)},
                              "LinearCrossEntropyFunction");
    }
}

TEST(CUDA, FusedLinearCrossEntropyIgnoredAndOutOfRangeTargets) {
  SKIP_WITHOUT_GPU();
  const at::Device cuda(at::kCUDA, 0);
  const at::Tensor hidden = on(randn({4, 8}, 25), cuda).requires_grad_(true), weight = on(randn({50, 8}, 26), cuda);
  // All ignored: a NaN loss (as Hugging Face's mean over no target) and zero gradients.
  at::Tensor loss = tk::linear_cross_entropy(hidden, weight, on(at::full({4}, -100, at::kLong), cuda));
  EXPECT_TRUE(loss.isnan().item<bool>());
  loss.backward();
  EXPECT_EQ(hidden.grad().abs().max().item<float>(), 0.f);
  // A target outside the vocabulary: a NaN loss rather than a device assert (no host sync to check it).
  const at::Tensor bad = on(at::tensor({1, 2, 50, 3}, at::kLong), cuda);
  at::NoGradGuard no_grad;
  EXPECT_TRUE(tk::linear_cross_entropy(hidden, weight, bad).isnan().item<bool>());
}

}  // namespace
