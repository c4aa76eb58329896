#pragma once
/// Launchers of the toolkit's CUDA kernels for the decoder's hot path: raw device pointers,
/// sizes and strides in elements, a stream; no ATen type, so that they compile with nvcc alone
/// (.ci/cuda-kernels compiles them for sm_90 on machines without a CUDA LibTorch). The ATen
/// glue (fused_ops_cuda.cpp) calls them for the toolkit's fused ops on CUDA tensors.
///
/// Every kernel reads fp32 or bf16 and computes in fp32. A launcher returns cudaSuccess, the
/// launch's error, or cudaErrorInvalidValue for arguments it does not take (it never aborts).
/// "promote(a, b)" below is fp32 unless both are bf16 (ATen's type promotion for these two).
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace tessera::toolkit::cuda {

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1 };

// --- RMSNorm (LlamaRMSNorm) -----------------------------------------------------------------
// y = w * round_x(h * rstd), rstd = 1 / sqrt(mean(h^2) + eps) per row of h [rows, D].

struct RmsNormForward {
  const void* x = nullptr;  ///< [rows, D], x_row_stride apart, unit stride in D
  std::int64_t x_row_stride = 0;
  /// The fused residual add: h = round_x(x + delta) (delta in x's dtype, delta_row_stride apart)
  /// is written to h_out [rows, D] contiguous and normalised. nullptr: h = x.
  const void* delta = nullptr;
  std::int64_t delta_row_stride = 0;
  void* h_out = nullptr;
  Dtype x_dtype = Dtype::kFloat32;
  const void* weight = nullptr;  ///< [D]
  Dtype weight_dtype = Dtype::kFloat32;
  void* y = nullptr;        ///< [rows, D] contiguous, promote(x, weight)
  float* rstd = nullptr;    ///< [rows], kept for the backward
  std::int64_t rows = 0, D = 0;
  float eps = 1e-6f;
};
cudaError_t rms_norm_forward(const RmsNormForward& args, cudaStream_t stream);

struct RmsNormBackward {
  const void* dy = nullptr;  ///< [rows, D] contiguous, promote(h, weight)
  const void* h = nullptr;   ///< [rows, D], h_row_stride apart, unit stride in D: the normalised input
  std::int64_t h_row_stride = 0;
  Dtype h_dtype = Dtype::kFloat32;
  const void* weight = nullptr;
  Dtype weight_dtype = Dtype::kFloat32;
  const float* rstd = nullptr;
  const void* dh_extra = nullptr;  ///< [rows, D] contiguous in h's dtype, added to dh (the residual's gradient); or nullptr
  void* dh = nullptr;              ///< [rows, D] contiguous, h's dtype
  void* dweight = nullptr;         ///< [D], weight's dtype
  void* workspace = nullptr;       ///< rms_norm_backward_workspace_bytes(rows, D) bytes of device memory
  std::int64_t rows = 0, D = 0;
};
/// Bytes of scratch the backward needs (each block's partial weight gradient, fp32), on the
/// current device (the block count follows its multiprocessors); 0 on error.
std::size_t rms_norm_backward_workspace_bytes(std::int64_t rows, std::int64_t D);
cudaError_t rms_norm_backward(const RmsNormBackward& args, cudaStream_t stream);

// --- rotary embedding (Hugging Face's rotate_half layout) -----------------------------------
// forward: out = x cos + rotate_half(x) sin; backward (x is the output's gradient): out =
// x cos + rotate_half^T(x sin). q and k in one launch; each may be updated in place
// (out == x with the same strides and dtype).

struct RotaryOperand {
  const void* x = nullptr;  ///< [B, heads, T, D]: strides of B, heads, T in x_strides; unit stride in D
  std::int64_t x_strides[3] = {0, 0, 0};
  Dtype x_dtype = Dtype::kFloat32;
  void* out = nullptr;
  std::int64_t out_strides[3] = {0, 0, 0};
  Dtype out_dtype = Dtype::kFloat32;
  std::int64_t heads = 0;  ///< 0: nothing to do for this operand
};
struct Rotary {
  RotaryOperand q, k;  ///< grouped-query attention: k's heads may be fewer than q's
  std::int64_t B = 0, T = 0, D = 0;  ///< D even
  const void* cos = nullptr;  ///< [T, D], rows cs_row_stride apart, unit stride in D
  const void* sin = nullptr;  ///< the same layout as cos
  std::int64_t cs_row_stride = 0;
  Dtype cs_dtype = Dtype::kFloat32;
  bool backward = false;
};
cudaError_t rotary_embedding(const Rotary& args, cudaStream_t stream);

// --- SwiGLU: y = silu(gate) * up --------------------------------------------------------------
// On [rows, width] with row strides (gate and up may be halves of one projection's output).

struct SwiGLU {
  const void* gate = nullptr;
  std::int64_t gate_row_stride = 0;
  Dtype gate_dtype = Dtype::kFloat32;
  const void* up = nullptr;
  std::int64_t up_row_stride = 0;
  Dtype up_dtype = Dtype::kFloat32;
  std::int64_t rows = 0, width = 0;
  /// forward: y [rows, width] contiguous, promote(gate, up)
  void* y = nullptr;
  /// backward: dy (contiguous, promote(gate, up)) -> dgate, dup (contiguous, their inputs' dtypes)
  const void* dy = nullptr;
  void* dgate = nullptr;
  void* dup = nullptr;
};
cudaError_t swiglu_forward(const SwiGLU& args, cudaStream_t stream);
cudaError_t swiglu_backward(const SwiGLU& args, cudaStream_t stream);

// --- cross-entropy over a block of logits (the chunked linear + cross-entropy) --------------
// Per row r of logits [rows, vocab]: row_loss[r] = logsumexp(logits[r]) - logits[r, target[r]],
// 0 where target[r] == ignore_index, NaN where a target is outside [0, vocab) (no device
// assert, no host sync). With grad_scale, the logits are replaced in place by the loss's
// gradient, (softmax(logits[r]) - one_hot(target[r])) * *grad_scale, 0 on ignored rows.

struct CrossEntropyRows {
  void* logits = nullptr;  ///< [rows, vocab], row_stride apart, unit stride in vocab
  std::int64_t row_stride = 0;
  Dtype dtype = Dtype::kFloat32;
  const std::int64_t* target = nullptr;  ///< [rows]
  std::int64_t ignore_index = -100;
  const float* grad_scale = nullptr;  ///< device scalar (1 / the valid rows of the whole batch); nullptr: loss only
  float* row_loss = nullptr;          ///< [rows]
  std::int64_t rows = 0, vocab = 0;
};
cudaError_t cross_entropy_rows(const CrossEntropyRows& args, cudaStream_t stream);

}  // namespace tessera::toolkit::cuda
