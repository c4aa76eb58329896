#pragma once
/// Fused kernels for the decoder models' hot path (gpt, llama): each is one autograd function
/// whose CPU implementation the tests check against the plain LibTorch math it replaces
/// (tests/kernels), and which a model turns off by a [model] key to get that math back.
#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>

namespace tessera::toolkit {

// --- linear + cross-entropy ------------------------------------------------------------------

struct LinearCrossEntropyOptions {
  /// Targets equal to it are left out of the loss and of the mean (Hugging Face's -100).
  std::int64_t ignore_index = -100;
  /// Rows (tokens) per chunk; 0: automatic (linear_cross_entropy_chunk_rows).
  std::int64_t chunk_rows = 0;
};

/// The mean cross-entropy of the logits hidden @ weight^T [rows, vocab] against `target` over
/// the targets that are not ignore_index (Hugging Face's ForCausalLMLoss: cross_entropy of the
/// fp32 logits, reduction mean; all targets ignored gives NaN, as it does), without ever holding
/// the [rows, vocab] logits: the rows go in chunks, and each chunk's logits (upcast to fp32), its
/// log-sum-exp, its loss and at once its gradients with respect to `hidden` and `weight` are
/// computed in the forward (Liger-Kernel's fused linear cross-entropy); backward only scales the
/// kept gradients by the loss's gradient. The loss and the softmax are fp32 whatever the inputs'
/// dtype; under autocast the products run in autocast's dtype, as lm_head's would.
///
/// hidden [rows, H], weight [vocab, H], target [rows] (integers); returns a 0-dim fp32 tensor,
/// differentiable in hidden and weight (a gradient is computed only for those that require one,
/// and none at all without grad mode: validation costs one chunk of logits). The backward may
/// run once (no retain_graph): it scales the kept gradients in place.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                const LinearCrossEntropyOptions& options = {});

/// The rows of one chunk: `chunk_rows` if positive, else as many rows as keep a chunk's fp32
/// logits within kLinearCrossEntropyChunkLogits elements (at least one row); never more than `rows`.
std::int64_t linear_cross_entropy_chunk_rows(std::int64_t rows, std::int64_t vocab, std::int64_t chunk_rows = 0);
/// 2^23 logits (32 MiB in fp32) a chunk by default: ~65 rows of a 128,256-token vocabulary.
inline constexpr std::int64_t kLinearCrossEntropyChunkLogits = std::int64_t{1} << 23;

/// What a loss path holds beyond the tensors autograd keeps after the forward, read off the
/// graph of `loss` (for `tessera plan`, whose trace counts only what is alive after the forward).
struct LossPathMemory {
  /// The largest transient of the loss's forward or backward, in bytes: a chunk's logits and
  /// softmax (and casts) for linear_cross_entropy; for a plain log_softmax over logits, its
  /// gradient and the logits' gradient beside the kept log-probabilities, and the forward's
  /// logits, resident in part in a training process (10 bytes an fp32 logit, as measured).
  double workspace_bytes = 0;
  /// What linear_cross_entropy keeps for backward that does not grow with the tokens: its
  /// weight gradient [vocab, H] (among the saved tensors a trace counts, but per step, not per sample).
  double kept_weight_gradient_bytes = 0;
  std::int64_t fused = 0;    ///< linear_cross_entropy calls found
  std::int64_t unfused = 0;  ///< log_softmax nodes found
  std::int64_t logits = 0;   ///< elements of the unfused logits
};
LossPathMemory loss_path_memory(const at::Tensor& loss);

}  // namespace tessera::toolkit

namespace tessera::toolkit {

// --- RMSNorm, rotary embedding, SwiGLU --------------------------------------------------------
// On the CPU each runs one pass per row (at::parallel_for over rows) for fp32 and bf16 tensors
// and keeps less for backward than the unfused chain of ATen ops; other dtypes and devices run
// the unfused math itself (a CUDA kernel takes its place where the toolkit is built with CUDA).

/// LlamaRMSNorm: weight * (x * rsqrt(mean(x^2, -1) + eps)), the normalisation in fp32 and cast
/// to x's dtype before the weight multiplies it; the result in the promotion of x's and weight's
/// dtypes. x [..., D] (any strides), weight [D]; differentiable in both.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

/// The residual add fused in: h = x + delta (their promoted dtype), returns {h, rms_norm(h)}.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps);

/// Rotary embedding of queries and keys (Hugging Face's apply_rotary_pos_emb): x * cos +
/// rotate_half(x) * sin for q [B, Hq, T, D] and k [B, Hkv, T, D] (grouped-query: Hkv divides
/// Hq; any strides), cos and sin [T, D] (no gradient); returns new contiguous [B, H, T, D]
/// tensors in the promotion of q's (k's) and cos's dtypes, differentiable in q and k.
std::pair<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin);

/// SwiGLU's gate: silu(gate) * up, same shapes (any strides), their promoted dtype; backward
/// recomputes silu from the kept gate (the unfused chain keeps silu(gate) as well).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

}  // namespace tessera::toolkit
