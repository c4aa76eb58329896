#pragma once
// What the kernels of this folder share: fp32/bf16 loads and stores, block reductions, launch
// shapes and the dispatch from a Dtype to a C++ type.
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "fused_kernels.h"

namespace tessera::toolkit::cuda::detail {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16_rn(v); }

/// v as a T holds it (round to nearest even for bf16): where the unfused math rounds to the
/// input's dtype, the kernels do too.
template <typename T>
__device__ __forceinline__ float rounded(float v) { return to_float(from_float<T>(v)); }

/// ATen's promotion of the two: bf16 only if both are.
template <typename A, typename B>
using Promoted = std::conditional_t<std::is_same_v<A, bf16> && std::is_same_v<B, bf16>, bf16, float>;

/// Returns f(T{}) with T the C++ type of `dtype`.
template <typename F>
cudaError_t with_type(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat32: return f(float{});
    case Dtype::kBFloat16: return f(bf16{});
  }
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ float shfl_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }

/// op over the block's v, in every thread. blockDim.x is a multiple of 32; `scratch` holds 32
/// T in shared memory; T has a shfl_xor overload (found by argument-dependent lookup).
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, shfl_xor(v, offset));
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // a previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : identity;
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, shfl_xor(v, offset));
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce(v, [](float a, float b) { return a + b; }, 0.f, scratch);
}

/// Threads of a block that walks a row of `width` elements, about `per_thread` each: a multiple
/// of 32 in [32, 1024].
inline unsigned row_threads(std::int64_t width, std::int64_t per_thread) {
  const std::int64_t wanted = (width + per_thread - 1) / per_thread;
  const std::int64_t warps = (wanted + 31) / 32;
  return static_cast<unsigned>(32 * (warps < 1 ? 1 : warps > 32 ? 32 : warps));
}

/// Blocks of 256 threads for a grid-stride loop over n elements (at most 2^16: each thread
/// then takes several).
constexpr unsigned kElementwiseThreads = 256;
inline unsigned elementwise_blocks(std::int64_t n) {
  const std::int64_t blocks = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > 65536 ? 65536 : blocks);
}

}  // namespace tessera::toolkit::cuda::detail
