// SwiGLU forward and backward, elementwise over [rows, width] with row strides; the backward
// recomputes the sigmoid from the gate rather than keeping silu(gate).
#include "common.cuh"

namespace tessera::toolkit::cuda {

namespace {

using namespace detail;

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

template <typename G, typename U>
__global__ void swiglu_forward_kernel(const G* gate, std::int64_t gate_row_stride, const U* up, std::int64_t up_row_stride,
                                      Promoted<G, U>* y, std::int64_t width, std::int64_t n) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / width, c = e % width;
    const float g = to_float(gate[r * gate_row_stride + c]);
    y[e] = from_float<Promoted<G, U>>(g * sigmoid(g) * to_float(up[r * up_row_stride + c]));
  }
}

template <typename G, typename U>
__global__ void swiglu_backward_kernel(const Promoted<G, U>* dy, const G* gate, std::int64_t gate_row_stride, const U* up,
                                       std::int64_t up_row_stride, G* dgate, U* dup, std::int64_t width, std::int64_t n) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / width, c = e % width;
    const float g = to_float(gate[r * gate_row_stride + c]), u = to_float(up[r * up_row_stride + c]);
    const float d = to_float(dy[e]), s = sigmoid(g);
    dgate[e] = from_float<G>(d * u * s * (1.f + g * (1.f - s)));  // d/dg silu(g) u
    dup[e] = from_float<U>(d * g * s);                             // silu(g)
  }
}

template <typename F>
cudaError_t with_types(const SwiGLU& a, F&& f) {
  return with_type(a.gate_dtype, [&](auto g) { return with_type(a.up_dtype, [&](auto u) { return f(g, u); }); });
}

bool valid(const SwiGLU& a) { return a.rows >= 0 && a.width >= 0 && (a.rows * a.width == 0 || (a.gate && a.up)); }

}  // namespace

cudaError_t swiglu_forward(const SwiGLU& a, cudaStream_t stream) {
  const std::int64_t n = a.rows * a.width;
  if (!valid(a) || (n > 0 && a.y == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  return with_types(a, [&](auto g_type, auto u_type) {
    using G = decltype(g_type);
    using U = decltype(u_type);
    swiglu_forward_kernel<G, U><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<const G*>(a.gate), a.gate_row_stride, static_cast<const U*>(a.up), a.up_row_stride,
        static_cast<Promoted<G, U>*>(a.y), a.width, n);
    return cudaGetLastError();
  });
}

cudaError_t swiglu_backward(const SwiGLU& a, cudaStream_t stream) {
  const std::int64_t n = a.rows * a.width;
  if (!valid(a) || (n > 0 && (a.dy == nullptr || a.dgate == nullptr || a.dup == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  return with_types(a, [&](auto g_type, auto u_type) {
    using G = decltype(g_type);
    using U = decltype(u_type);
    swiglu_backward_kernel<G, U><<<elementwise_blocks(n), kElementwiseThreads, 0, stream>>>(
        static_cast<const Promoted<G, U>*>(a.dy), static_cast<const G*>(a.gate), a.gate_row_stride,
        static_cast<const U*>(a.up), a.up_row_stride, static_cast<G*>(a.dgate), static_cast<U*>(a.dup), a.width, n);
    return cudaGetLastError();
  });
}

}  // namespace tessera::toolkit::cuda
