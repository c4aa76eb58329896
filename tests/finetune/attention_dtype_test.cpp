// The blocked attention kernel under mixed precision (issue 60 (a)): under the CPU's bf16
// autocast a model's rotary embedding hands the kernel fp32 queries and keys with bf16 values;
// forward and backward must then compute as the math path does under the same autocast.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/attention.hpp"

namespace {

using namespace tessera;

struct Result {
  at::Tensor out, dq, dk, dv;
};

Result run(const toolkit::CausalAttentionOptions& options, const at::Tensor& q0, const at::Tensor& k0,
           const at::Tensor& v0, const at::Tensor& dout) {
  at::Tensor q = q0.detach().requires_grad_(), k = k0.detach().requires_grad_(), v = v0.detach().requires_grad_();
  sdk::set_autocast(/*cuda=*/false, true, at::kBFloat16);
  at::Tensor out = toolkit::causal_attention(q, k, v, options);
  sdk::set_autocast(/*cuda=*/false, false, at::kBFloat16);
  out.backward(dout.to(out.scalar_type()));  // outside autocast, as the trainer's backward runs
  return {out.detach().to(at::kFloat), q.grad(), k.grad(), v.grad()};
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

// T = 300 queries in blocks of 128 (three blocks, the last one short), GQA 4 over 2.
TEST(BlockedAttention, MixedDtypesUnderAutocastEqualTheMathPath) {
  at::manual_seed(7);
  const at::Tensor q = at::randn({2, 4, 300, 16}), k = at::randn({2, 2, 300, 16});
  const at::Tensor v = at::randn({2, 2, 300, 16}).to(at::kBFloat16), dout = at::randn({2, 4, 300, 16});
  toolkit::CausalAttentionOptions blocked, math;
  blocked.kernel = toolkit::AttentionKernel::blocked;
  math.kernel = toolkit::AttentionKernel::math;
  ASSERT_EQ(toolkit::causal_attention_kernel(q, k, blocked), toolkit::AttentionKernel::blocked);
  const Result a = run(blocked, q, k, v, dout), b = run(math, q, k, v, dout);
  // The gradients come back in each input's own dtype, as autograd requires.
  EXPECT_EQ(a.dq.scalar_type(), at::kFloat);
  EXPECT_EQ(a.dk.scalar_type(), at::kFloat);
  EXPECT_EQ(a.dv.scalar_type(), at::kBFloat16);
  // Both compute their products in bf16 (autocast's dtype): bf16 rounding apart.
  const double scale = b.out.abs().max().item<double>();
  EXPECT_LE(max_diff(a.out, b.out), 0.02 * scale);
  // Each gradient as close to the exact one (fp64, no autocast) as the math path's: how far bf16
  // products land from it depends on the CPU (oneDNN's bf16 kernels differ between AVX2 and
  // AVX-512 machines: 3% of the largest dk apart on one, 5% on the other), the kernel must not.
  at::Tensor qd = q.to(at::kDouble).requires_grad_(), kd = k.to(at::kDouble).requires_grad_(),
             vd = v.to(at::kDouble).requires_grad_();
  toolkit::causal_attention(qd, kd, vd, math).backward(dout.to(at::kDouble));
  for (auto [x, y, exact, name] : {std::tuple{a.dq, b.dq, qd.grad(), "dq"}, std::tuple{a.dk, b.dk, kd.grad(), "dk"},
                                   std::tuple{a.dv, b.dv, vd.grad(), "dv"}}) {
    const double math_error = max_diff(y, exact), largest = exact.abs().max().item<double>();
    EXPECT_LE(math_error, 0.08 * largest) << name << ": the math path is not bf16-close to the exact gradient";
    EXPECT_LE(max_diff(x, exact), 1.25 * math_error + 0.005 * largest) << name;
  }
}

// Without autocast, mixed inputs meet in their promoted type (fp32 here), and the kernel equals
// the math path to fp32 rounding after the bf16 values are widened.
TEST(BlockedAttention, MixedDtypesWithoutAutocastComputeInThePromotedType) {
  at::manual_seed(8);
  const at::Tensor q = at::randn({1, 2, 200, 8}), k = at::randn({1, 2, 200, 8});
  const at::Tensor v = at::randn({1, 2, 200, 8}).to(at::kBFloat16);
  toolkit::CausalAttentionOptions blocked, math;
  blocked.kernel = toolkit::AttentionKernel::blocked;
  math.kernel = toolkit::AttentionKernel::math;
  at::Tensor qa = q.clone().requires_grad_(), va = v.clone().requires_grad_();
  at::Tensor out = toolkit::causal_attention(qa, k, va, blocked);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  out.sum().backward();
  at::Tensor qb = q.clone().requires_grad_(), vb = v.to(at::kFloat).requires_grad_();
  at::Tensor want = toolkit::causal_attention(qb, k, vb, math);
  want.sum().backward();
  EXPECT_LE(max_diff(out.detach(), want.detach()), 1e-5);
  EXPECT_LE(max_diff(qa.grad(), qb.grad()), 1e-4);
  EXPECT_EQ(va.grad().scalar_type(), at::kBFloat16);
  EXPECT_LE(max_diff(va.grad(), vb.grad()), 0.02 * vb.grad().abs().max().item<double>());
}

}  // namespace
