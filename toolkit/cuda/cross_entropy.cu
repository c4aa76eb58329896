// The cross-entropy of a block of logits, one block of threads per row: an online max and sum
// of exponentials in one read (a running maximum rescales the sum), then, for the gradient, a
// second read that writes softmax - one_hot over the logits in place (Liger-Kernel's fused
// linear cross-entropy keeps no other [rows, vocab] buffer either).
#include <cmath>

#include "common.cuh"

namespace tessera::toolkit::cuda {

namespace {

using namespace detail;

/// sum = sum of exp(x - max) over the elements seen.
struct MaxSum {
  float max, sum;
};

__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
}

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (isnan(a.max) || isnan(b.max)) return {NAN, NAN};  // a NaN logit makes the loss NaN
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return {m, a.sum + b.sum};  // nothing seen yet, or only -inf
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

template <typename T>
__global__ void cross_entropy_kernel(T* logits, std::int64_t row_stride, const std::int64_t* target,
                                     std::int64_t ignore_index, const float* grad_scale, float* row_loss,
                                     std::int64_t vocab) {
  __shared__ MaxSum scratch[32];
  const std::int64_t r = blockIdx.x;
  T* row = logits + r * row_stride;
  const std::int64_t t = target[r];
  const bool ignored = t == ignore_index, in_range = t >= 0 && t < vocab;
  // Read before the reduction's barriers: after them, the row is overwritten by its gradient.
  const float target_logit = threadIdx.x == 0 && !ignored && in_range ? to_float(row[t]) : 0.f;
  MaxSum acc{-INFINITY, 0.f};
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) acc = combine(acc, MaxSum{to_float(row[j]), 1.f});
  acc = block_reduce(acc, [](MaxSum a, MaxSum b) { return combine(a, b); }, MaxSum{-INFINITY, 0.f}, scratch);
  const float lse = acc.max + logf(acc.sum);
  if (threadIdx.x == 0) row_loss[r] = ignored ? 0.f : in_range ? lse - target_logit : NAN;
  if (grad_scale == nullptr) return;
  const float scale = *grad_scale;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float softmax = expf(to_float(row[j]) - lse);
    row[j] = from_float<T>(ignored ? 0.f : (softmax - (j == t ? 1.f : 0.f)) * scale);
  }
}

}  // namespace

cudaError_t cross_entropy_rows(const CrossEntropyRows& a, cudaStream_t stream) {
  if (a.rows < 0 || a.vocab < 0) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  if (a.vocab == 0 || a.logits == nullptr || a.target == nullptr || a.row_loss == nullptr) return cudaErrorInvalidValue;
  return with_type(a.dtype, [&](auto type) {
    using T = decltype(type);
    cross_entropy_kernel<T><<<static_cast<unsigned>(a.rows), row_threads(a.vocab, 16), 0, stream>>>(
        static_cast<T*>(a.logits), a.row_stride, a.target, a.ignore_index, a.grad_scale, a.row_loss, a.vocab);
    return cudaGetLastError();
  });
}

}  // namespace tessera::toolkit::cuda
