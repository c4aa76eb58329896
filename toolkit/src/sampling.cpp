#include "tessera/toolkit/sampling.hpp"

#include <limits>
#include <tuple>

#include <ATen/ATen.h>

namespace tessera::toolkit {

at::Tensor sample_next_token(at::Tensor logits, const SamplingOptions& options) {
  if (options.temperature == 0.0) return logits.argmax(-1);
  logits = logits / options.temperature;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (options.top_k > 0 && options.top_k < logits.size(-1)) {
    at::Tensor kth = std::get<0>(logits.topk(options.top_k, -1)).narrow(-1, options.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, neg_inf);
  }
  if (options.top_p < 1.0) {
    auto [sorted, order] = logits.sort(-1, /*descending=*/false);
    at::Tensor remove = at::softmax(sorted, -1).cumsum(-1) <= (1.0 - options.top_p);
    remove.select(-1, remove.size(-1) - 1).fill_(false);  // the most likely token stays
    logits = logits.masked_fill(remove.scatter(-1, order, remove), neg_inf);
  }
  return at::multinomial(at::softmax(logits, -1), 1).squeeze(1);
}

}  // namespace tessera::toolkit
