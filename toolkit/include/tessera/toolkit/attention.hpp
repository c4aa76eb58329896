#pragma once
/// Causal self-attention for decoder models: one function every model plugin calls (gpt,
/// llama), so that the fast and memory-lean kernels are chosen in one place.
///
/// Shapes: q [B, Hq, Tq, D]; k and v [B, Hkv, Tk, D] with Hq a multiple of Hkv (grouped-query
/// attention: query head h reads key/value head h / (Hq / Hkv), Hugging Face's repeat_kv) and
/// Tk >= Tq. The queries are the last Tq of the Tk positions (a KV cache holds the first
/// Tk - Tq): query i sees keys 0 .. Tk - Tq + i. Returns [B, Hq, Tq, D] in the dtype the products
/// ran in: autocast's under autocast (q, k and v may then differ), else q, k and v's promoted one.
#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace tessera::toolkit {

/// Which kernel computes the attention.
enum class AttentionKernel {
  /// LibTorch's scaled_dot_product_attention (2.x: flash / memory-efficient kernels on CUDA,
  /// fused kernels on the CPU) where the LibTorch has it; elsewhere `blocked`. Packed rows
  /// (segments) on the CPU take `blocked`, which skips the keys of earlier samples where SDPA's
  /// mask would compute them all.
  automatic,
  /// at::scaled_dot_product_attention (LibTorch 2.x only; refused on 1.13), GQA through its
  /// enable_gqa on CUDA (2.5+), else keys and values repeated (the CPU's flash kernel takes no
  /// GQA, and SDPA asked for it there falls back to the math path).
  sdpa,
  /// Query blocks of `query_block` rows; backward recomputes each block's probabilities from
  /// the saved log-sum-exp (flash attention's recomputation): no [B, H, Tq, Tk] tensor is kept
  /// for backward, and a block never materialises more than [B, H, query_block, Tk]. GQA reads
  /// the Hkv key/value heads directly (no repeated copies). Sequences of at most query_block
  /// positions take the `math` path (one block: nothing to save). With packed segments a block
  /// reads only the keys from the start of its first query's sample (varlen attention): a row
  /// of many short samples costs what the samples cost apart.
  blocked,
  /// The reference: scores, mask, softmax (fp32) and the weighted sum as Hugging Face's
  /// "eager" attention computes them, keys and values repeated for GQA; autograd keeps the
  /// [B, Hq, Tq, Tk] probabilities.
  math,
};

struct CausalAttentionOptions {
  /// Multiplies q k^T; 0 means 1 / sqrt(D).
  double scale = 0.0;
  /// Applied to the probabilities [B, Hq, Tq, Tk] before the weighted sum (attention dropout);
  /// its presence selects the `math` path, the only one that materialises them.
  std::function<at::Tensor(const at::Tensor&)> dropout;
  AttentionKernel kernel = AttentionKernel::automatic;
  /// Query rows per block of the `blocked` path.
  std::int64_t query_block = 128;
};

/// softmax(scale q k^T + causal mask) v; differentiable in q, k and v. The blocked and SDPA
/// paths equal the math path within float rounding (1e-5 in fp32; tests/models).
/// `segments` [B, T] (packed rows: which sample each position belongs to, non-decreasing along
/// T; needs Tq == Tk) also masks keys of other samples: the mask is block-diagonal causal, and
/// each sample attends as if it were alone in its row. Undefined or empty: one sample per row.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const CausalAttentionOptions& options = {}, const at::Tensor& segments = {});

/// The segments of packed rows from their position ids [B, T] (restarting at 0 where a sample
/// starts): segment s of a row is its s-th sample.
at::Tensor segments_from_positions(const at::Tensor& position_ids);

/// The kernel `causal_attention` runs for these options and shapes (automatic resolved).
AttentionKernel causal_attention_kernel(const at::Tensor& q, const at::Tensor& k, const CausalAttentionOptions& options);

/// "automatic", "sdpa", "blocked", "math" -> the kernel; an sdk::Error naming `what` and the choices otherwise.
AttentionKernel parse_attention_kernel(const std::string& name, const std::string& what);
std::string to_string(AttentionKernel kernel);

}  // namespace tessera::toolkit
