// toolkit::rms_norm, add_rms_norm, rotary_embedding and swiglu against the unfused LibTorch
// math llama.cpp runs with their keys off (Hugging Face's modeling code, op for op): values and
// gradients. Tolerances: fp32 1e-5 relative to the largest magnitude (the same sums in another
// order); bf16 3e-2 (the fused kernels round once where the chain of ops rounds at every op, a
// few of bf16's 2^-8 steps apart).
#include <limits>

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "tessera/toolkit/fused.hpp"

namespace {

namespace tk = tessera::toolkit;
using Tensors = std::vector<at::Tensor>;
using Fn = std::function<Tensors(const Tensors&)>;

at::Tensor randn(at::IntArrayRef sizes, std::uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, g, at::TensorOptions().dtype(at::kFloat));
}

/// Outputs and input gradients of fn(inputs) under the upstream gradients `upstream` (one per output).
std::pair<Tensors, Tensors> run(const Fn& fn, const Tensors& inputs, const Tensors& upstream) {
  Tensors leaves;
  for (const at::Tensor& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(t.is_floating_point()));
  Tensors outputs = fn(leaves);
  Tensors roots, grads;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    roots.push_back(outputs[i]);
    grads.push_back(upstream[i].to(outputs[i].scalar_type()));
  }
  torch::autograd::backward(roots, grads);
  Tensors input_grads;
  for (const at::Tensor& l : leaves) input_grads.push_back(l.grad());
  Tensors values;
  for (const at::Tensor& o : outputs) values.push_back(o.detach());
  return {values, input_grads};
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << what;
  const double err = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  const double ref = want.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(err, rtol * std::max(ref, 1e-30)) << what << ": max |difference| " << err << ", max |reference| " << ref;
}

/// fused and unfused on the same inputs: outputs, then every floating input's gradient.
void expect_same(const Fn& fused, const Fn& unfused, const Tensors& inputs, double rtol, std::uint64_t seed = 99) {
  Tensors probe = unfused(inputs);
  Tensors upstream;
  for (std::size_t i = 0; i < probe.size(); ++i) upstream.push_back(randn(probe[i].sizes(), seed + i));
  auto [want, want_grads] = run(unfused, inputs, upstream);
  auto [got, got_grads] = run(fused, inputs, upstream);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) expect_close(got[i], want[i], rtol, "output " + std::to_string(i));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].is_floating_point())
      // A bf16 input's gradient is rounded to bf16 whatever the math's dtype: one rounding apart.
      expect_close(got_grads[i], want_grads[i], inputs[i].scalar_type() == at::kBFloat16 ? std::max(rtol, 1e-2) : rtol,
                   "gradient of input " + std::to_string(i));
}

double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-5 : 3e-2; }

// --- the unfused math (plugins/models/llama.cpp with the keys off) ------------------------------

at::Tensor rms_norm_math(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}
at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

TEST(FusedRmsNorm, EqualsTheUnfusedMath) {
  const double eps = 1e-6;
  for (at::ScalarType x_type : {at::kFloat, at::kBFloat16})
    for (at::ScalarType w_type : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << "x " << x_type << ", weight " << w_type);
      at::Tensor w = (1 + 0.1 * randn({37}, 2)).to(w_type);
      // [2, 5, 37] contiguous, and [6, 37] with rows 2 apart and odd width.
      for (const at::Tensor& x : {randn({2, 5, 37}, 1).to(x_type), randn({12, 37}, 3).to(x_type).slice(0, 0, 12, 2)}) {
        expect_same([&](const Tensors& in) { return Tensors{tk::rms_norm(in[0], in[1], eps)}; },
                    [&](const Tensors& in) { return Tensors{rms_norm_math(in[0], in[1], eps)}; }, {x, w},
                    x_type == at::kFloat && w_type == at::kFloat ? 1e-5 : 3e-2);
      }
    }
}

TEST(FusedRmsNorm, AddRmsNormEqualsTheAddThenTheNorm) {
  const double eps = 1e-5;
  const Fn fused = [&](const Tensors& in) {
    auto [h, y] = tk::add_rms_norm(in[0], in[1], in[2], eps);
    return Tensors{h, y};
  };
  const Fn unfused = [&](const Tensors& in) {
    at::Tensor h = in[0] + in[1];
    return Tensors{h, rms_norm_math(h, in[2], eps)};
  };
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << dtype);
    at::Tensor x = randn({3, 7, 64}, 4).to(dtype), delta = randn({3, 7, 64}, 5).to(dtype);
    at::Tensor w = (1 + 0.1 * randn({64}, 6)).to(dtype);
    expect_same(fused, unfused, {x, delta, w}, tolerance(dtype));
  }
  // Under bf16 autocast the residual is fp32 and the attention's output bf16: h in fp32.
  at::Tensor x = randn({5, 33}, 7), delta = randn({5, 33}, 8).to(at::kBFloat16), w = at::ones({33});
  expect_same(fused, unfused, {x, delta, w}, 1e-5);
}

TEST(FusedRotary, EqualsRotateHalfOnGroupedQueryShapes) {
  const std::int64_t B = 2, Hq = 6, Hkv = 2, T = 9, D = 10;
  at::Tensor positions = at::arange(T, at::kFloat).unsqueeze(1);
  at::Tensor inv_freq = at::pow(10000.0, at::arange(0, D, 2, at::kFloat) / D).reciprocal();
  at::Tensor freqs = positions * inv_freq.unsqueeze(0);
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (at::ScalarType cos_type : {at::kFloat, dtype}) {
      SCOPED_TRACE(::testing::Message() << "q, k " << dtype << ", cos " << cos_type);
      at::Tensor cos = emb.cos().to(cos_type), sin = emb.sin().to(cos_type);
      // As llama's attention makes them: [B, T, H, D] projections seen as [B, H, T, D].
      at::Tensor q = randn({B, T, Hq, D}, 10).to(dtype).transpose(1, 2);
      at::Tensor k = randn({B, T, Hkv, D}, 11).to(dtype).transpose(1, 2);
      ASSERT_FALSE(q.is_contiguous());
      expect_same(
          [&](const Tensors& in) {
            auto [qr, kr] = tk::rotary_embedding(in[0], in[1], cos, sin);
            return Tensors{qr, kr};
          },
          [&](const Tensors& in) {
            return Tensors{in[0] * cos + rotate_half(in[0]) * sin, in[1] * cos + rotate_half(in[1]) * sin};
          },
          {q, k}, tolerance(at::promote_types(dtype, cos_type)));
    }
}

TEST(FusedSwiGLU, EqualsSiluTimesUp) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << dtype);
    // Odd sizes past one block of the kernel; large gates saturate the sigmoid.
    at::Tensor gate = (4 * randn({3, 7, 131}, 12)).to(dtype), up = randn({3, 7, 131}, 13).to(dtype);
    expect_same([&](const Tensors& in) { return Tensors{tk::swiglu(in[0], in[1])}; },
                [&](const Tensors& in) { return Tensors{at::silu(in[0]) * in[1]}; }, {gate, up}, tolerance(dtype));
    at::Tensor strided = (4 * randn({131, 21}, 14)).to(dtype).t();  // [21, 131], transposed storage
    expect_same([&](const Tensors& in) { return Tensors{tk::swiglu(in[0], in[1])}; },
                [&](const Tensors& in) { return Tensors{at::silu(in[0]) * in[1]}; },
                {strided, randn({21, 131}, 15).to(dtype)}, tolerance(dtype));
  }
  // Saturated gates, on both sides of where the kernel's sigmoid takes its exact 0 and 1 (below
  // -87, above 88), repeated past a vector's lanes; values and gradients; NaN stays NaN.
  at::Tensor extreme = at::tensor({-1e30f, -200.0f, -90.0f, -87.5f, -86.5f, -20.0f, 0.0f, 20.0f, 87.5f, 88.5f, 90.0f,
                                   200.0f, 1e30f})
                           .repeat({3});
  expect_close(tk::swiglu(extreme, at::ones_like(extreme)), at::silu(extreme), 1e-6, "saturated gates");
  expect_same([&](const Tensors& in) { return Tensors{tk::swiglu(in[0], in[1])}; },
              [&](const Tensors& in) { return Tensors{at::silu(in[0]) * in[1]}; },
              {extreme.clamp(-200, 200), randn({39}, 16)}, tolerance(at::kFloat));
  const at::Tensor nan = tk::swiglu(at::full({16}, std::numeric_limits<float>::quiet_NaN()), at::ones({16}));
  EXPECT_TRUE(nan.isnan().all().item<bool>()) << nan;
}

// Other dtypes run the unfused math itself.
TEST(FusedKernels, OtherDtypesRunTheUnfusedMath) {
  at::Tensor x = randn({4, 8}, 16).to(at::kDouble), w = at::ones({8}, at::kDouble);
  EXPECT_TRUE(tk::rms_norm(x, w, 1e-6).equal(rms_norm_math(x, w, 1e-6)));
  EXPECT_TRUE(tk::swiglu(x, x).equal(at::silu(x) * x));
}

}  // namespace
