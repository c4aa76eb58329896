// Rotary embedding of q and k in one launch: a thread per (row, i) pair of a head's row, which
// reads x[i] and x[i + D/2] before it writes both (so that in place is safe), from any strides.
#include "common.cuh"

namespace tessera::toolkit::cuda {

namespace {

using namespace detail;

template <typename X, typename C, typename O>
__global__ void rotary_kernel(RotaryOperand q, RotaryOperand k, std::int64_t q_pairs, std::int64_t pairs,
                              std::int64_t T, std::int64_t half, const C* cos, const C* sin, std::int64_t cs_row_stride,
                              bool backward) {
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const bool is_q = p < q_pairs;
    const RotaryOperand& side = is_q ? q : k;
    const std::int64_t local = is_q ? p : p - q_pairs;
    const std::int64_t i = local % half, row = local / half;
    const std::int64_t t = row % T, head = (row / T) % side.heads, b = row / (T * side.heads);
    const X* x = static_cast<const X*>(side.x) + b * side.x_strides[0] + head * side.x_strides[1] + t * side.x_strides[2];
    O* out = static_cast<O*>(side.out) + b * side.out_strides[0] + head * side.out_strides[1] + t * side.out_strides[2];
    const C *ct = cos + t * cs_row_stride, *st = sin + t * cs_row_stride;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float c1 = to_float(ct[i]), c2 = to_float(ct[i + half]), s1 = to_float(st[i]), s2 = to_float(st[i + half]);
    float o1, o2;
    if (!backward) {  // rotate_half(x) = [-x2, x1]
      o1 = x1 * c1 - x2 * s1;
      o2 = x2 * c2 + x1 * s2;
    } else {  // its transpose applied to x sin: [x2 s2, -x1 s1]
      o1 = x1 * c1 + x2 * s2;
      o2 = x2 * c2 - x1 * s1;
    }
    out[i] = from_float<O>(o1);
    out[i + half] = from_float<O>(o2);
  }
}

/// One launch for q and k (k.heads may be 0), which share their dtypes.
cudaError_t launch(const Rotary& a, const RotaryOperand& q, const RotaryOperand& k, cudaStream_t stream) {
  const std::int64_t half = a.D / 2, q_pairs = a.B * q.heads * a.T * half;
  const std::int64_t pairs = q_pairs + a.B * k.heads * a.T * half;
  if (pairs == 0) return cudaSuccess;
  return with_type(q.x_dtype, [&](auto x_type) {
    return with_type(a.cs_dtype, [&](auto c_type) {
      return with_type(q.out_dtype, [&](auto o_type) {
        using X = decltype(x_type);
        using C = decltype(c_type);
        using O = decltype(o_type);
        rotary_kernel<X, C, O><<<elementwise_blocks(pairs), kElementwiseThreads, 0, stream>>>(
            q, k, q_pairs, pairs, a.T, half, static_cast<const C*>(a.cos), static_cast<const C*>(a.sin),
            a.cs_row_stride, a.backward);
        return cudaGetLastError();
      });
    });
  });
}

bool valid(const RotaryOperand& side) {
  return side.heads >= 0 && (side.heads == 0 || (side.x != nullptr && side.out != nullptr));
}

}  // namespace

cudaError_t rotary_embedding(const Rotary& a, cudaStream_t stream) {
  if (a.B < 0 || a.T < 0 || a.D < 0 || a.D % 2 != 0 || !valid(a.q) || !valid(a.k) ||
      (a.B * a.T * a.D > 0 && (a.cos == nullptr || a.sin == nullptr)))
    return cudaErrorInvalidValue;
  if (a.B == 0 || a.T == 0 || a.D == 0) return cudaSuccess;
  RotaryOperand none = a.k;
  none.heads = 0;
  if (a.q.heads == 0 || a.k.heads == 0 || (a.q.x_dtype == a.k.x_dtype && a.q.out_dtype == a.k.out_dtype))
    return a.q.heads == 0 ? launch(a, a.k, none, stream) : launch(a, a.q, a.k, stream);
  if (cudaError_t e = launch(a, a.q, none, stream); e != cudaSuccess) return e;
  return launch(a, a.k, none, stream);
}

}  // namespace tessera::toolkit::cuda
