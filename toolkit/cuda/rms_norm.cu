// RMSNorm forward (optionally with the residual add fused in) and backward: one block per row,
// fp32 sums. The backward walks rows with a fixed grid so that each block sums its rows' weight
// gradient privately; a second kernel adds the blocks' partial sums up in a fixed order
// (deterministic, no atomics).
#include "common.cuh"

namespace tessera::toolkit::cuda {

namespace {

using namespace detail;

template <typename X, typename W>
__global__ void rms_forward_kernel(const X* x, std::int64_t x_row_stride, const X* delta, std::int64_t delta_row_stride,
                                   X* h_out, const W* weight, Promoted<X, W>* y, float* rstd, std::int64_t D, float eps) {
  __shared__ float scratch[32];
  const std::int64_t r = blockIdx.x;
  const X* xr = x + r * x_row_stride;
  X* hr = delta != nullptr ? h_out + r * D : nullptr;
  float squares = 0.f;
  for (std::int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    float h = to_float(xr[j]);
    if (hr != nullptr) {  // h as the add rounds it, normalised as stored
      const X sum = from_float<X>(h + to_float(delta[r * delta_row_stride + j]));
      hr[j] = sum;
      h = to_float(sum);
    }
    squares += h * h;
  }
  const float rs = 1.f / sqrtf(block_sum(squares, scratch) / static_cast<float>(D) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  const X* hin = hr != nullptr ? hr : xr;  // each thread reads back only what it wrote
  Promoted<X, W>* yr = y + r * D;
  for (std::int64_t j = threadIdx.x; j < D; j += blockDim.x)
    yr[j] = from_float<Promoted<X, W>>(to_float(weight[j]) * rounded<X>(to_float(hin[j]) * rs));
}

/// dh = rstd (g - n mean(g n)) + dh_extra with n = h rstd, g = round_h(dy w); each block adds
/// dy round_h(n) of its rows into its own row of `partial` [gridDim.x, D] (through shared
/// memory where D fits).
template <typename H, typename W>
__global__ void rms_backward_kernel(const Promoted<H, W>* dy, const H* h, std::int64_t h_row_stride, const W* weight,
                                    const float* rstd,
                                    const H* dh_extra, H* dh, float* partial, std::int64_t rows, std::int64_t D,
                                    bool shared_accumulator) {
  extern __shared__ float shared_dw[];
  __shared__ float scratch[32];
  float* block_partial = partial + blockIdx.x * D;
  float* dw = shared_accumulator ? shared_dw : block_partial;  // column j: thread j % blockDim.x's only
  for (std::int64_t j = threadIdx.x; j < D; j += blockDim.x) dw[j] = 0.f;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float rs = rstd[r];
    const H* hr = h + r * h_row_stride;
    const Promoted<H, W>* dyr = dy + r * D;
    float dot = 0.f;
    for (std::int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float n = to_float(hr[j]) * rs, g = to_float(dyr[j]);
      dw[j] += g * rounded<H>(n);
      dot += rounded<H>(g * to_float(weight[j])) * n;
    }
    const float mean = block_sum(dot, scratch) / static_cast<float>(D);
    H* dhr = dh + r * D;
    for (std::int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float hj = to_float(hr[j]), g = rounded<H>(to_float(dyr[j]) * to_float(weight[j]));
      float v = rs * (g - hj * rs * mean);
      if (dh_extra != nullptr) v += to_float(dh_extra[r * D + j]);
      dhr[j] = from_float<H>(v);
    }
  }
  if (shared_accumulator)
    for (std::int64_t j = threadIdx.x; j < D; j += blockDim.x) block_partial[j] = dw[j];
}

template <typename W>
__global__ void sum_partials_kernel(const float* partial, std::int64_t blocks, std::int64_t D, W* dweight) {
  for (std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; j < D;
       j += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (std::int64_t b = 0; b < blocks; ++b) sum += partial[b * D + j];
    dweight[j] = from_float<W>(sum);
  }
}

/// Blocks of the backward: two per multiprocessor (enough to fill the device; each keeps a
/// partial weight gradient), at most one per row; 0 on error.
std::int64_t backward_blocks(std::int64_t rows) {
  int device = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  const std::int64_t blocks = 2 * static_cast<std::int64_t>(multiprocessors);
  return rows < blocks ? rows : blocks;
}

// The default limit of shared memory a block may take without opting in.
constexpr std::size_t kSharedBytes = 48 * 1024;

}  // namespace

cudaError_t rms_norm_forward(const RmsNormForward& a, cudaStream_t stream) {
  if (a.rows < 0 || a.D < 0 || a.eps < 0.f) return cudaErrorInvalidValue;
  if (a.rows == 0 || a.D == 0) return cudaSuccess;
  if (a.x == nullptr || a.weight == nullptr || a.y == nullptr || a.rstd == nullptr ||
      (a.delta != nullptr && a.h_out == nullptr))
    return cudaErrorInvalidValue;
  return with_type(a.x_dtype, [&](auto x_type) {
    return with_type(a.weight_dtype, [&](auto w_type) {
      using X = decltype(x_type);
      using W = decltype(w_type);
      rms_forward_kernel<X, W><<<static_cast<unsigned>(a.rows), row_threads(a.D, 4), 0, stream>>>(
          static_cast<const X*>(a.x), a.x_row_stride, static_cast<const X*>(a.delta), a.delta_row_stride,
          static_cast<X*>(a.h_out), static_cast<const W*>(a.weight), static_cast<Promoted<X, W>*>(a.y), a.rstd, a.D,
          a.eps);
      return cudaGetLastError();
    });
  });
}

std::size_t rms_norm_backward_workspace_bytes(std::int64_t rows, std::int64_t D) {
  if (rows <= 0 || D <= 0) return 0;
  return static_cast<std::size_t>(backward_blocks(rows)) * static_cast<std::size_t>(D) * sizeof(float);
}

cudaError_t rms_norm_backward(const RmsNormBackward& a, cudaStream_t stream) {
  if (a.rows < 0 || a.D < 0) return cudaErrorInvalidValue;
  if (a.rows == 0 || a.D == 0) return cudaSuccess;
  const std::int64_t blocks = backward_blocks(a.rows);
  if (blocks == 0 || a.dy == nullptr || a.h == nullptr || a.weight == nullptr || a.rstd == nullptr || a.dh == nullptr ||
      a.dweight == nullptr || a.workspace == nullptr)
    return cudaErrorInvalidValue;
  const std::size_t accumulator_bytes = static_cast<std::size_t>(a.D) * sizeof(float);
  const bool shared_accumulator = accumulator_bytes <= kSharedBytes - 32 * sizeof(float);
  return with_type(a.h_dtype, [&](auto h_type) {
    return with_type(a.weight_dtype, [&](auto w_type) {
      using H = decltype(h_type);
      using W = decltype(w_type);
      float* partial = static_cast<float*>(a.workspace);
      rms_backward_kernel<H, W><<<static_cast<unsigned>(blocks), row_threads(a.D, 4),
                                  shared_accumulator ? accumulator_bytes : 0, stream>>>(
          static_cast<const Promoted<H, W>*>(a.dy), static_cast<const H*>(a.h), a.h_row_stride,
          static_cast<const W*>(a.weight), a.rstd,
          static_cast<const H*>(a.dh_extra), static_cast<H*>(a.dh), partial, a.rows, a.D, shared_accumulator);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      sum_partials_kernel<W><<<elementwise_blocks(a.D), kElementwiseThreads, 0, stream>>>(
          partial, blocks, a.D, static_cast<W*>(a.dweight));
      return cudaGetLastError();
    });
  });
}

}  // namespace tessera::toolkit::cuda
