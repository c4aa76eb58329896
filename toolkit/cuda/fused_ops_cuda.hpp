#pragma once
// The ATen side of the toolkit's CUDA kernels (fused_kernels.h): tensors in, launches on the
// current stream of the tensors' device. Private to the toolkit; fused_ops.cpp and
// fused_loss.cpp call these for CUDA tensors where the toolkit is built with CUDA. Inputs are
// fp32 or bf16 on one CUDA device (the callers check); strides are taken as they come where
// the kernels read strided rows, and copied to contiguous otherwise.
#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>

namespace tessera::toolkit::cuda {

struct RmsNormTensors {
  at::Tensor h;     ///< what the backward reads: x itself, or x + delta with the residual add
  at::Tensor y;     ///< x's shape, promote(h, weight)
  at::Tensor rstd;  ///< fp32 [rows]
};
/// rms_norm of x, or with `delta` defined, of h = x + delta (their promoted dtype).
RmsNormTensors rms_norm_forward(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
/// {dh (h's dtype), dweight (weight's dtype)}; dh_extra (or undefined) is added to dh.
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& weight,
                                                    const at::Tensor& rstd, const at::Tensor& dh_extra);

/// The rotary embedding (forward) or its transpose (backward) of q [B, Hq, T, D] and k [B, Hkv,
/// T, D] in one launch, into new contiguous tensors of q_out and k_out dtypes; an undefined q
/// or k gives an undefined result. cos, sin [T, D].
std::pair<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin, at::ScalarType q_out, at::ScalarType k_out,
                                                   bool backward);

/// silu(gate) * up (promoted dtype, contiguous); gate and up of one shape.
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
/// {dgate, dup} in gate's and up's dtypes.
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up);

/// Writes each row's cross-entropy into row_loss (fp32 [rows], contiguous) and, with grad_scale
/// (a 0-dim fp32 tensor: d loss / d row loss for the valid rows) defined, replaces the logits
/// [rows, vocab] (fp32 or bf16, unit stride in vocab) by d loss / d logits in place. target: [rows] int64.
void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& target, std::int64_t ignore_index,
                        const at::Tensor& grad_scale, const at::Tensor& row_loss);

}  // namespace tessera::toolkit::cuda
