#pragma once
/// Batched matrix products for a model's forward, e.g. attention's scores and its weighted sum.
#include <ATen/core/Tensor.h>

namespace tessera::toolkit {

/// bias + alpha * (a @ b) for each of the batch's matrices: a [n, p, q], b [n, q, r], bias
/// undefined (none) or broadcastable to [n, p, r]; differentiable in all three. The values of
/// at::baddbmm(bias, a, b, 1, alpha) (at::bmm without a bias), bit for bit: each matrix goes
/// through the same BLAS call.
///
/// Why not at::bmm: where LibTorch's CPU BLAS is OpenBLAS (Debian's LibTorch, any build without
/// MKL), at::bmm calls the BLAS once per matrix, in order, each call split over all threads;
/// attention's matrices are small (the bench GPT's: 96 of 128 x 64 per layer), and its bmm took
/// longer on 2 threads than on one. Here each thread multiplies its own matrices, one BLAS
/// thread each: attention's products, forward and backward, 1.24x as fast at 2 threads
/// (bench/training/attention.cpp). Elsewhere (CUDA, one thread, a parallel region already,
/// autocast on, dtypes other than float and double, another BLAS) it is at::baddbmm / at::bmm.
at::Tensor batched_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias = {}, double alpha = 1.0);

}  // namespace tessera::toolkit
