// RMSNorm (with the residual add), rotary embedding and SwiGLU as single autograd nodes whose
// CPU kernels make one pass over each row in fp32 (at::parallel_for over rows; the inner loops
// are written for the compiler's vectoriser: -O3 -fopenmp-simd, see toolkit/CMakeLists.txt).
// On CUDA tensors, where the toolkit is built with CUDA, the nodes launch toolkit/cuda's
// kernels instead. Elsewhere (other dtypes, devices) each runs the unfused ATen math it replaces.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/autograd/custom_function.h>

#include "tessera/sdk/build_config.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/fused.hpp"
#if TESSERA_WITH_CUDA
#include "cuda/fused_ops_cuda.hpp"
#endif

namespace tessera::toolkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using bf16 = c10::BFloat16;

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

/// A device with kernels for these ops: the CPU, and CUDA where the toolkit is built with it.
bool kernel_device(const at::Tensor& t) {
#if TESSERA_WITH_CUDA
  if (t.is_cuda()) return true;
#endif
  return t.is_cpu();
}

/// Calls f(T{}) with T the C++ type of `t` (fp32 or bf16).
template <typename F>
void with_type(at::ScalarType t, F&& f) {
  if (t == at::kFloat) f(float{});
  else f(bf16{});
}

template <typename T>
inline __attribute__((always_inline)) float rounded(float v) {  // v as T would hold it
  return static_cast<float>(static_cast<T>(v));
}
/// bf16's round to nearest even (c10::BFloat16's, NaN kept) in float bits, without the 16-bit
/// round trip GCC does not vectorise inside the backward's reduction loop.
template <>
inline __attribute__((always_inline)) float rounded<bf16>(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return v != v ? v : r;
}

template <typename T>
inline __attribute__((always_inline)) void load(const T* src, float* dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <typename T>
inline __attribute__((always_inline)) void store(const float* src, T* dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}
/// c10::BFloat16's round to nearest even (NaN to its quiet NaN) on the bits, branch-free: its own
/// conversion's NaN branch kept the stores scalar.
template <>
inline __attribute__((always_inline)) void store<bf16>(const float* src, bf16* dst, std::int64_t n) {
  auto* out = reinterpret_cast<std::uint16_t*>(dst);
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, &src[i], sizeof u);
    const std::uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = static_cast<std::uint16_t>(src[i] != src[i] ? 0x7FC0u : r);
  }
}

/// Rows per task: about 32K elements.
std::int64_t grain(std::int64_t width) { return std::max<std::int64_t>(1, 32768 / std::max<std::int64_t>(width, 1)); }

// Each kernel's loops are compiled twice, chosen at run time: for the baseline's SSE2 (the
// toolkit's target) and for AVX2 + FMA where the CPU has them, as ATen dispatches its own
// kernels. The loop bodies are always_inline lambdas, inlined into (and so compiled for) each
// target; SSE2 alone left SwiGLU below ATen's silu (its exp's dependent chain) and bf16 rows at par.
bool has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
template <typename Body>
__attribute__((target("avx2,fma"))) void run_avx2(const Body& body, std::int64_t begin, std::int64_t end) {
  body(begin, end);
}
template <typename Body>
void run_baseline(const Body& body, std::int64_t begin, std::int64_t end) {
  body(begin, end);
}
/// at::parallel_for over [0, n) of `body` (an always_inline lambda) in the CPU's best build.
template <typename Body>
void parallel_kernel(std::int64_t n, std::int64_t grain_size, const Body& body) {
  const bool avx2 = has_avx2_fma();
  at::parallel_for(0, n, grain_size, [&](std::int64_t begin, std::int64_t end) {
    if (avx2) run_avx2(body, begin, end);
    else run_baseline(body, begin, end);
  });
}

// --- RMSNorm ------------------------------------------------------------------------------------

/// The unfused math (LlamaRMSNorm).
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

/// y = w * round_In(h * rstd) per row of h [rows, D]; rstd [rows] out.
template <typename In, typename Out>
void rms_forward_kernel(const In* h, const float* w, Out* y, float* rstd, std::int64_t rows, std::int64_t D, float eps) {
  parallel_kernel(rows, grain(D), [&](std::int64_t begin, std::int64_t end) __attribute__((always_inline)) {
    std::vector<float> row(static_cast<std::size_t>(D));
    float* b = row.data();
    for (std::int64_t r = begin; r < end; ++r) {
      load(h + r * D, b, D);
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (std::int64_t j = 0; j < D; ++j) squares += b[j] * b[j];
      const float rs = 1.f / std::sqrt(squares / static_cast<float>(D) + eps);
      rstd[r] = rs;
#pragma omp simd
      for (std::int64_t j = 0; j < D; ++j) b[j] = w[j] * rounded<In>(b[j] * rs);
      store(b, y + r * D, D);
    }
  });
}

/// dh = rstd (g - n mean(g n)) [+ dh_extra] with g = round_In(dy w), n = h rstd; dw summed per thread.
template <typename In, typename Out>
void rms_backward_kernel(const Out* dy, const In* h, const float* weight, const float* rstd, const In* dh_extra, In* dh,
                         float* dw_partial, std::int64_t rows, std::int64_t width) {
  parallel_kernel(rows, grain(width), [&](std::int64_t begin, std::int64_t end) __attribute__((always_inline)) {
    // The captures as locals: read through the closure, the stores to dw might alias them, and
    // GCC kept the reduction loop scalar (bf16 rows 1.1-1.2x ATen's unfused chain).
    const std::int64_t D = width;
    const float* __restrict__ w = weight;
    std::vector<float> buffers(static_cast<std::size_t>(3 * D));
    float *hb = buffers.data(), *gb = hb + D, *eb = gb + D;
    float* __restrict__ dw = dw_partial + static_cast<std::int64_t>(at::get_thread_num()) * D;
    for (std::int64_t r = begin; r < end; ++r) {
      const float rs = rstd[r];
      load(h + r * D, hb, D);
      load(dy + r * D, gb, D);
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t j = 0; j < D; ++j) {
        const float n = hb[j] * rs;
        dw[j] += gb[j] * rounded<In>(n);
        gb[j] = rounded<In>(gb[j] * w[j]);
        dot += gb[j] * n;
      }
      const float mean = dot / static_cast<float>(D);
      if (dh_extra != nullptr) load(dh_extra + r * D, eb, D);
      else std::fill(eb, eb + D, 0.f);
#pragma omp simd
      for (std::int64_t j = 0; j < D; ++j) hb[j] = rs * (gb[j] - hb[j] * rs * mean) + eb[j];
      store(hb, dh + r * D, D);
    }
  });
}

struct RmsForward {
  at::Tensor h, y, rstd;  // h: the normalised input, as rms_backward reads it
};

/// x [..., D] (fp32/bf16), weight [D] -> h = x (+ delta, if defined), y in promote(h, weight),
/// rstd fp32 [rows].
RmsForward rms_forward(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
#if TESSERA_WITH_CUDA
  if (x.is_cuda()) {  // one kernel for the add and the norm
    cuda::RmsNormTensors r = cuda::rms_norm_forward(x, delta, weight, eps);
    return {r.h, r.y, r.rstd};
  }
#endif
  const at::Tensor h = (delta.defined() ? at::add(x, delta) : x).contiguous();
  const std::int64_t D = h.size(-1), rows = h.numel() / std::max<std::int64_t>(D, 1);
  const at::ScalarType out_type = at::promote_types(h.scalar_type(), weight.scalar_type());
  at::Tensor w = weight.to(at::kFloat).contiguous();
  RmsForward out{h, at::empty(h.sizes(), h.options().dtype(out_type)), at::empty({rows}, h.options().dtype(at::kFloat))};
  with_type(h.scalar_type(), [&](auto in) {
    using In = decltype(in);
    with_type(out_type, [&](auto o) {
      using Out = decltype(o);
      rms_forward_kernel<In, Out>(h.data_ptr<In>(), w.data_ptr<float>(), out.y.data_ptr<Out>(),
                                  out.rstd.data_ptr<float>(), rows, D, static_cast<float>(eps));
    });
  });
  return out;
}

/// {dh (h's dtype), dweight (weight's dtype)}; dh_extra (h's dtype, or undefined) is added to dh.
std::pair<at::Tensor, at::Tensor> rms_backward(const at::Tensor& dy_in, const at::Tensor& h, const at::Tensor& weight,
                                               const at::Tensor& rstd, const at::Tensor& dh_extra_in) {
#if TESSERA_WITH_CUDA
  if (h.is_cuda()) return cuda::rms_norm_backward(dy_in, h, weight, rstd, dh_extra_in);
#endif
  const std::int64_t D = h.size(-1), rows = h.numel() / std::max<std::int64_t>(D, 1);
  const at::ScalarType out_type = at::promote_types(h.scalar_type(), weight.scalar_type());
  at::Tensor dy = dy_in.to(out_type).contiguous();
  at::Tensor dh_extra = dh_extra_in.defined() ? dh_extra_in.to(h.scalar_type()).contiguous() : at::Tensor();
  at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor dh = at::empty(h.sizes(), h.options());
  at::Tensor dw_partial = at::zeros({at::get_num_threads(), D}, h.options().dtype(at::kFloat));
  with_type(h.scalar_type(), [&](auto in) {
    using In = decltype(in);
    with_type(out_type, [&](auto o) {
      using Out = decltype(o);
      rms_backward_kernel<In, Out>(dy.data_ptr<Out>(), h.data_ptr<In>(), w.data_ptr<float>(), rstd.data_ptr<float>(),
                                   dh_extra.defined() ? dh_extra.data_ptr<In>() : nullptr, dh.data_ptr<In>(),
                                   dw_partial.data_ptr<float>(), rows, D);
    });
  });
  return {dh, dw_partial.sum(0).to(weight.scalar_type())};
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    RmsForward f = rms_forward(x, at::Tensor(), weight, eps);
    ctx->save_for_backward({f.h, weight, f.rstd});
    return f.y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = rms_backward(grads[0], saved[0], saved[1], saved[2], at::Tensor());
    return {dx, dw, at::Tensor()};
  }
};

/// {h = x + delta, rms_norm(h)}: one node, whose backward adds h's own gradient to the norm's.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& delta,
                               const at::Tensor& weight, double eps) {
    RmsForward f = rms_forward(x, delta, weight, eps);
    ctx->save_for_backward({f.h, weight, f.rstd});
    ctx->saved_data["x_dtype"] = static_cast<std::int64_t>(x.scalar_type());
    ctx->saved_data["delta_dtype"] = static_cast<std::int64_t>(delta.scalar_type());
    return {f.h, f.y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor dy = grads[1].defined() ? grads[1] : at::zeros_like(saved[0]);
    auto [dh, dw] = rms_backward(dy, saved[0], saved[1], saved[2], grads[0]);
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const auto delta_dtype = static_cast<at::ScalarType>(ctx->saved_data["delta_dtype"].toInt());
    return {dh.to(x_dtype), dh.to(delta_dtype), dw, at::Tensor()};
  }
};

bool rms_fusable(const at::Tensor& x, const at::Tensor& weight) {
  return kernel_device(x) && weight.device() == x.device() && kernel_dtype(x.scalar_type()) && kernel_dtype(weight.scalar_type()) &&
         weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0) && x.numel() > 0;
}

// --- rotary embedding ---------------------------------------------------------------------------

at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

/// out [B, H, T, D] contiguous = x c + rotate_half(x) s (forward, sign +1), or the transpose,
/// g c + rotate_half^T(g s) (backward, sign -1); x [B, H, T, D] with unit stride in D.
template <typename In, typename Out>
void rotary_kernel(const In* x, at::IntArrayRef sizes, at::IntArrayRef strides, const float* cos_table,
                   const float* sin_table, Out* out, bool backward) {
  const std::int64_t B = sizes[0];
  const std::int64_t stride_b = strides[0], stride_h = strides[1], stride_t = strides[2];
  parallel_kernel(B * sizes[1] * sizes[2], grain(sizes[3]), [&](std::int64_t begin, std::int64_t end) __attribute__((always_inline)) {
    // The captures as locals (see rms_backward_kernel).
    const std::int64_t D = sizes[3], half = D / 2, T = sizes[2], H = sizes[1];
    const float* __restrict__ c = cos_table;
    const float* __restrict__ s = sin_table;
    std::vector<float> row(static_cast<std::size_t>(2 * D));
    float *xb = row.data(), *ob = xb + D;
    for (std::int64_t r = begin; r < end; ++r) {
      const std::int64_t t = r % T, h = (r / T) % H, b = r / (T * H);
      load(x + b * stride_b + h * stride_h + t * stride_t, xb, D);
      const float *ct = c + t * D, *st = s + t * D;
      if (!backward) {
#pragma omp simd
        for (std::int64_t i = 0; i < half; ++i) {
          ob[i] = xb[i] * ct[i] - xb[i + half] * st[i];
          ob[i + half] = xb[i + half] * ct[i + half] + xb[i] * st[i + half];
        }
      } else {
#pragma omp simd
        for (std::int64_t i = 0; i < half; ++i) {
          ob[i] = xb[i] * ct[i] + xb[i + half] * st[i + half];
          ob[i + half] = xb[i + half] * ct[i + half] - xb[i] * st[i];
        }
      }
      store(ob, out + r * D, D);
    }
  });
}

at::Tensor rotary(const at::Tensor& x_in, const at::Tensor& c, const at::Tensor& s, at::ScalarType out_type,
                  bool backward) {
  at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  with_type(x.scalar_type(), [&](auto in) {
    using In = decltype(in);
    with_type(out_type, [&](auto o) {
      using Out = decltype(o);
      rotary_kernel<In, Out>(x.data_ptr<In>(), x.sizes(), x.strides(), c.data_ptr<float>(), s.data_ptr<float>(),
                             out.data_ptr<Out>(), backward);
    });
  });
  return out;
}

/// q's and k's rotary (or its transpose) into new contiguous tensors; undefined stays undefined.
/// c and s: fp32 contiguous on the CPU, as given on CUDA (whose kernel reads fp32 or bf16).
std::pair<at::Tensor, at::Tensor> rotary_pair(const at::Tensor& q, const at::Tensor& k, const at::Tensor& c,
                                              const at::Tensor& s, at::ScalarType q_out, at::ScalarType k_out,
                                              bool backward) {
#if TESSERA_WITH_CUDA
  if (c.is_cuda()) return cuda::rotary_embedding(q, k, c, s, q_out, k_out, backward);  // one launch for both
#endif
  return {q.defined() ? rotary(q, c, s, q_out, backward) : at::Tensor(),
          k.defined() ? rotary(k, c, s, k_out, backward) : at::Tensor()};
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin) {
    const bool cpu = cos.is_cpu();
    at::Tensor c = cpu ? cos.to(at::kFloat).contiguous() : cos, s = cpu ? sin.to(at::kFloat).contiguous() : sin;
    ctx->save_for_backward({c, s});
    ctx->saved_data["q_dtype"] = static_cast<std::int64_t>(q.scalar_type());
    ctx->saved_data["k_dtype"] = static_cast<std::int64_t>(k.scalar_type());
    auto [qr, kr] = rotary_pair(q, k, c, s, at::promote_types(q.scalar_type(), cos.scalar_type()),
                                at::promote_types(k.scalar_type(), cos.scalar_type()), false);
    return {qr, kr};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto q_dtype = static_cast<at::ScalarType>(ctx->saved_data["q_dtype"].toInt());
    const auto k_dtype = static_cast<at::ScalarType>(ctx->saved_data["k_dtype"].toInt());
    auto kernel_input = [](const at::Tensor& g) {
      return !g.defined() || kernel_dtype(g.scalar_type()) ? g : g.to(at::kFloat);
    };
    auto [dq, dk] = rotary_pair(kernel_input(grads[0]), kernel_input(grads[1]), saved[0], saved[1], q_dtype, k_dtype, true);
    return {dq, dk, at::Tensor(), at::Tensor()};
  }
};

// --- SwiGLU -------------------------------------------------------------------------------------

/// e^x for x in [-87, 88] (Cephes' expf: range reduction by ln 2, degree-5 polynomial, within
/// 2 ulp), branch-free so that the loops around it vectorise: n = round(x / ln 2) by adding and
/// taking away 1.5 x 2^23, and only the exponent n clamped (to the normal floats'). Clamping x
/// itself made GCC split the loop on the clamped cases, a second division per element: 3x slower.
inline __attribute__((always_inline)) float exp_approx(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 x 2^23: a float there has no fraction bits
  const float fn = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  std::int32_t n = static_cast<std::int32_t>(fn);
  n = n < -126 ? -126 : n;
  n = n > 127 ? 127 : n;
  const std::int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/// 1 / (1 + e^-g): exact 1 above 88 and 0 below -87 (where e^-g leaves exp_approx's range), NaN
/// for NaN.
inline __attribute__((always_inline)) float sigmoid(float g) {
  float s = 1.f / (1.f + exp_approx(-g));
  s = g > 88.f ? 1.f : s;
  return g < -87.f ? 0.f : s;
}

template <typename G, typename U, typename Out>
void swiglu_forward_kernel(const G* gate, const U* up, Out* y, std::int64_t n) {
  parallel_kernel(n, 16384, [&](std::int64_t begin, std::int64_t end) __attribute__((always_inline)) {
    constexpr std::int64_t kBlock = 1024;
    float gb[kBlock], ub[kBlock];
    for (std::int64_t i0 = begin; i0 < end; i0 += kBlock) {
      const std::int64_t m = std::min(kBlock, end - i0);
      load(gate + i0, gb, m);
      load(up + i0, ub, m);
#pragma omp simd
      for (std::int64_t i = 0; i < m; ++i) gb[i] = gb[i] * sigmoid(gb[i]) * ub[i];
      store(gb, y + i0, m);
    }
  });
}

template <typename G, typename U, typename D>
void swiglu_backward_kernel(const D* dy, const G* gate, const U* up, G* dgate, U* dup, std::int64_t n) {
  parallel_kernel(n, 16384, [&](std::int64_t begin, std::int64_t end) __attribute__((always_inline)) {
    constexpr std::int64_t kBlock = 1024;
    float db[kBlock], gb[kBlock], ub[kBlock];
    for (std::int64_t i0 = begin; i0 < end; i0 += kBlock) {
      const std::int64_t m = std::min(kBlock, end - i0);
      load(dy + i0, db, m);
      load(gate + i0, gb, m);
      load(up + i0, ub, m);
#pragma omp simd
      for (std::int64_t i = 0; i < m; ++i) {
        const float g = gb[i], s = sigmoid(g), d = db[i];
        gb[i] = d * ub[i] * s * (1.f + g * (1.f - s));  // d/dg silu(g) u
        ub[i] = d * g * s;                              // silu(g)
      }
      store(gb, dgate + i0, m);
      store(ub, dup + i0, m);
    }
  });
}

/// silu(gate) * up; gate and up contiguous on the CPU (CUDA's kernels take row strides).
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
#if TESSERA_WITH_CUDA
  if (gate.is_cuda()) return cuda::swiglu_forward(gate, up);
#endif
  const at::ScalarType out_type = at::promote_types(gate.scalar_type(), up.scalar_type());
  at::Tensor y = at::empty(gate.sizes(), gate.options().dtype(out_type));
  with_type(gate.scalar_type(), [&](auto g) {
    with_type(up.scalar_type(), [&](auto u) {
      with_type(out_type, [&](auto o) {
        swiglu_forward_kernel(gate.data_ptr<decltype(g)>(), up.data_ptr<decltype(u)>(), y.data_ptr<decltype(o)>(),
                              gate.numel());
      });
    });
  });
  return y;
}

/// {dgate, dup} of swiglu_forward(gate, up) under dy.
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy_in, const at::Tensor& gate, const at::Tensor& up) {
#if TESSERA_WITH_CUDA
  if (gate.is_cuda()) return cuda::swiglu_backward(dy_in, gate, up);
#endif
  const at::ScalarType out_type = at::promote_types(gate.scalar_type(), up.scalar_type());
  at::Tensor dy = dy_in.to(out_type).contiguous();
  at::Tensor dgate = at::empty_like(gate), dup = at::empty_like(up);
  with_type(gate.scalar_type(), [&](auto g) {
    with_type(up.scalar_type(), [&](auto u) {
      with_type(out_type, [&](auto o) {
        using G = decltype(g);
        using U = decltype(u);
        swiglu_backward_kernel(dy.data_ptr<decltype(o)>(), gate.data_ptr<G>(), up.data_ptr<U>(), dgate.data_ptr<G>(),
                               dup.data_ptr<U>(), gate.numel());
      });
    });
  });
  return {dgate, dup};
}

class SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_in, const at::Tensor& up_in) {
    const bool cpu = gate_in.is_cpu();
    at::Tensor gate = cpu ? gate_in.contiguous() : gate_in, up = cpu ? up_in.contiguous() : up_in;
    ctx->save_for_backward({gate, up});
    return swiglu_forward(gate, up);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dgate, dup] = swiglu_backward(grads[0], saved[0], saved[1]);
    return {dgate, dup};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!rms_fusable(x, weight)) return rms_norm_reference(x, weight, eps);
  return RmsNormFunction::apply(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps) {
  const bool fusable = rms_fusable(x, weight) && delta.device() == x.device() && kernel_dtype(delta.scalar_type()) &&
                       kernel_dtype(at::promote_types(x.scalar_type(), delta.scalar_type()));
  if (!fusable) {
    at::Tensor h = x + delta;
    return {h, rms_norm_reference(h, weight, eps)};
  }
  variable_list out = AddRmsNormFunction::apply(x, delta, weight, eps);
  return {out[0], out[1]};
}

std::pair<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin) {
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                    q.size(3) == k.size(3) && q.size(3) % 2 == 0,
                "rotary_embedding: q [B, Hq, T, D] and k [B, Hkv, T, D] with an even D expected, found ", q.sizes(),
                " and ", k.sizes());
  const bool fusable = kernel_device(q) && k.device() == q.device() && cos.device() == q.device() &&
                       sin.device() == q.device() && kernel_dtype(q.scalar_type()) &&
                       kernel_dtype(k.scalar_type()) && kernel_dtype(cos.scalar_type()) &&
                       cos.scalar_type() == sin.scalar_type() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                       cos.size(0) == q.size(2) && cos.size(1) == q.size(3) && !cos.requires_grad() &&
                       !sin.requires_grad();
  if (!fusable) return {q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin};
  variable_list out = RotaryFunction::apply(q, k, cos, sin);
  return {out[0], out[1]};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  const bool fusable = kernel_device(gate) && up.device() == gate.device() && gate.sizes() == up.sizes() && kernel_dtype(gate.scalar_type()) &&
                       kernel_dtype(up.scalar_type());
  if (!fusable) return at::silu(gate) * up;
  return SwiGLUFunction::apply(gate, up);
}

}  // namespace tessera::toolkit
