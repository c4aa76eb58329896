#pragma once
/// Drawing the next token of a generation from a model's logits: one function every decoder
/// model plugin calls (gpt, llama), Hugging Face's order of the logits processors.
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace tessera::toolkit {

struct SamplingOptions {
  double temperature = 1.0;  ///< 0: greedy (argmax); else the logits are divided by it
  std::int64_t top_k = 0;    ///< keep the k largest logits (0: all)
  double top_p = 1.0;        ///< keep the smallest set whose probability reaches top_p, at least one (1: all)
};

/// logits [B, V] (float) -> the next token of each row, [B] (long): greedy at temperature 0;
/// else temperature, then top_k, then top_p, then one draw from the softmax (at::multinomial,
/// so LibTorch's generator decides).
at::Tensor sample_next_token(at::Tensor logits, const SamplingOptions& options);

}  // namespace tessera::toolkit
