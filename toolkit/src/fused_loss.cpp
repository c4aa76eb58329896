// Chunked linear + cross-entropy (Liger-Kernel's fused linear cross-entropy, llm.c's fused
// classifier): the forward computes each chunk's logits, loss and gradients and keeps only the
// gradients with respect to the hidden states and the weight. On CUDA (where the toolkit is
// built with it) one kernel turns a chunk's logits into their loss and, in place, their gradient.
#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/autograd_graph.hpp"
#include "tessera/sdk/build_config.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/fused.hpp"
#if TESSERA_WITH_CUDA
#include "cuda/fused_ops_cuda.hpp"
#endif

namespace tessera::toolkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The products' dtype: autocast's for fp32 inputs where autocast is on for their device (the
/// dtype lm_head's product would take), else the inputs' own.
at::ScalarType compute_dtype(const at::Tensor& hidden, const at::Tensor& weight) {
  const bool cuda = weight.is_cuda();
  const bool fp32 = hidden.scalar_type() == at::kFloat || weight.scalar_type() == at::kFloat;
  if (fp32 && sdk::autocast_enabled(cuda)) return sdk::autocast_dtype(cuda);
  TESSERA_CHECK(hidden.scalar_type() == weight.scalar_type(), "linear_cross_entropy: hidden is ", hidden.scalar_type(),
                " and weight ", weight.scalar_type(), "; without autocast they must have one dtype");
  return weight.scalar_type();
}

struct Result {
  at::Tensor loss, grad_hidden, grad_weight;
  double workspace_bytes = 0;  // the largest transient beyond the inputs and the results
};

/// The chunk loop; the gradients only where asked for (scaled for the mean: d loss / d input).
Result chunked(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
               const LinearCrossEntropyOptions& options, bool grad_hidden, bool grad_weight) {
  const std::int64_t rows = hidden.size(0), hidden_size = hidden.size(1), vocab = weight.size(0);
  const std::int64_t chunk = linear_cross_entropy_chunk_rows(rows, vocab, options.chunk_rows);
  const at::ScalarType dtype = compute_dtype(hidden, weight);
  // Under autocast these are the casts lm_head's product would make; otherwise no copies.
  const at::Tensor h = hidden.to(dtype), w = weight.to(dtype);
  const at::Tensor t = target.to(at::kLong).reshape({-1});
  const at::Tensor valid = t.ne(options.ignore_index);
  const at::Tensor count = valid.sum().to(at::kFloat);  // a tensor: no host sync on a device
  const bool want_grad = grad_hidden || grad_weight;
#if TESSERA_WITH_CUDA
  // The kernel reads the logits in the products' dtype and writes their gradient over them.
  const bool device_kernel = w.is_cuda() && (dtype == at::kFloat || dtype == at::kBFloat16);
#else
  constexpr bool device_kernel = false;
#endif
  // The kernel's: each row's loss (0 where ignored), and d loss / d row loss of a valid row.
  at::Tensor row_loss, inv_count;
  // ATen's: each valid row's share of the mean, ignored rows 0 (all ignored: zero gradients,
  // NaN loss); the targets with ignored ones replaced by a valid class; -1 for each valid row.
  at::Tensor row_scale, safe_target, minus_valid;
  if (device_kernel) {
    row_loss = at::empty({rows}, hidden.options().dtype(at::kFloat));
    inv_count = count.reciprocal();
  } else {
    row_scale = at::where(valid, count.reciprocal(), at::zeros({}, count.options())).unsqueeze(1);
    safe_target = t.masked_fill(valid.logical_not(), 0).unsqueeze(1);
    minus_valid = valid.to(at::kFloat).neg_().unsqueeze(1);
  }
  at::Tensor loss_sum = device_kernel ? at::Tensor() : at::zeros({}, hidden.options().dtype(at::kFloat));
  Result out;
  if (grad_hidden) out.grad_hidden = at::empty({rows, hidden_size}, hidden.options());
  at::Tensor grad_w32;  // fp32 whatever the weight's dtype: the chunks' sum rounds once
  if (grad_weight) grad_w32 = at::zeros({vocab, hidden_size}, weight.options().dtype(at::kFloat));
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t n = std::min(chunk, rows - r0);
    const at::Tensor hc = h.narrow(0, r0, n);
    at::Tensor gc;  // d loss / d logits [n, vocab] in `dtype`
#if TESSERA_WITH_CUDA
    if (device_kernel) {
      gc = at::mm(hc, w.t());
      cuda::cross_entropy_rows(gc, t.narrow(0, r0, n), options.ignore_index, want_grad ? inv_count : at::Tensor(),
                               row_loss.narrow(0, r0, n));
    }
#endif
    if (!device_kernel) {
      const at::Tensor tc = safe_target.narrow(0, r0, n);
      at::Tensor logp;
      {
        at::Tensor logits = at::mm(hc, w.t());
        if (logits.scalar_type() != at::kFloat) logits = logits.to(at::kFloat);
        logp = at::log_softmax(logits, 1);
      }
      loss_sum.add_((logp.gather(1, tc) * minus_valid.narrow(0, r0, n)).sum());
      if (!want_grad) continue;
      // d loss / d logits = (softmax - one_hot(target)) / count, in place of the log-probabilities.
      at::Tensor g = logp.exp_();
      g.scatter_add_(1, tc, minus_valid.narrow(0, r0, n));
      g.mul_(row_scale.narrow(0, r0, n));
      gc = g.to(dtype);
    }
    if (!want_grad) continue;
    if (grad_hidden) {
      at::Tensor slice = out.grad_hidden.narrow(0, r0, n);
      if (slice.scalar_type() == dtype) at::mm_out(slice, gc, w);
      else slice.copy_(at::mm(gc, w));
    }
    if (grad_weight) {
      if (dtype == at::kFloat) grad_w32.addmm_(gc.t(), hc);
      else grad_w32.add_(at::mm(gc.t(), hc));
    }
  }
  if (device_kernel) loss_sum = row_loss.sum();
  out.loss = loss_sum.div_(count);
  if (grad_weight) out.grad_weight = grad_w32.to(weight.scalar_type());
  // A chunk: its fp32 logits and log-probabilities (or the product in `dtype` and its upcast),
  // then the low-precision copy of its gradient (the CUDA kernel: the product in `dtype` alone);
  // the weight's cast, the fp32 accumulator when the weight is not fp32, and each chunk's
  // low-precision weight gradient before it is added.
  const double logits = static_cast<double>(std::min(chunk, rows)) * static_cast<double>(vocab);
  const double low = static_cast<double>(c10::elementSize(dtype));
  const double matrix = static_cast<double>(vocab) * static_cast<double>(hidden_size);
  double workspace = device_kernel ? low * logits : 8.0 * logits + (dtype != at::kFloat ? low * logits : 0.0);
  if (dtype != weight.scalar_type()) workspace += low * matrix;
  if (grad_weight && weight.scalar_type() != at::kFloat) workspace += 4.0 * matrix;
  if (grad_weight && dtype != at::kFloat) workspace += low * matrix;
  out.workspace_bytes = workspace;
  return out;
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, std::int64_t ignore_index, std::int64_t chunk_rows) {
    LinearCrossEntropyOptions options{ignore_index, chunk_rows};
    Result r = chunked(hidden, weight, target, options, hidden.requires_grad(), weight.requires_grad());
    ctx->saved_data["grad_hidden"] = r.grad_hidden;
    ctx->saved_data["grad_weight"] = r.grad_weight;
    ctx->saved_data["workspace_bytes"] = r.workspace_bytes;
    ctx->saved_data["kept_weight_gradient_bytes"] =
        r.grad_weight.defined() ? static_cast<double>(r.grad_weight.nbytes()) : 0.0;
    return r.loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto take = [&](const char* key) {
      auto it = ctx->saved_data.find(key);
      TESSERA_CHECK(it != ctx->saved_data.end(), "linear_cross_entropy: backward ran twice through one forward; ",
                    "its kept gradients are scaled in place, so retain_graph is not supported");
      at::Tensor t = it->second.isTensor() ? it->second.toTensor() : at::Tensor();
      ctx->saved_data.erase(it);
      return t;
    };
    at::Tensor grad_hidden = take("grad_hidden"), grad_weight = take("grad_weight");
    const at::Tensor& scale = grads[0];
    if (scale.defined()) {
      if (grad_hidden.defined()) grad_hidden.mul_(scale);
      if (grad_weight.defined()) grad_weight.mul_(scale);
    }
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, std::int64_t ignore_index) {
  TESSERA_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
                "linear_cross_entropy: hidden [rows, H] and weight [vocab, H] expected, found ", hidden.sizes(), " and ",
                weight.sizes());
  TESSERA_CHECK(target.numel() == hidden.size(0) && !target.is_floating_point(), "linear_cross_entropy: target must hold ",
                hidden.size(0), " integer class indices, found ", target.sizes(), " ", target.scalar_type());
  if (target.is_cpu() && target.numel() > 0) {  // a device's kernels assert instead (no host sync here)
    const at::Tensor t = target.to(at::kLong);
    const at::Tensor bad = t.lt(0).logical_and(t.ne(ignore_index)).logical_or(t.ge(weight.size(0)));
    TESSERA_CHECK(!bad.any().item<bool>(), "linear_cross_entropy: a target is outside [0, vocab = ", weight.size(0),
                  ") and not the ignore index");
  }
}

}  // namespace

std::int64_t linear_cross_entropy_chunk_rows(std::int64_t rows, std::int64_t vocab, std::int64_t chunk_rows) {
  std::int64_t chunk = chunk_rows > 0 ? chunk_rows : kLinearCrossEntropyChunkLogits / std::max<std::int64_t>(vocab, 1);
  return std::max<std::int64_t>(1, std::min(chunk, std::max<std::int64_t>(rows, 1)));
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                const LinearCrossEntropyOptions& options) {
  check_inputs(hidden, weight, target, options.ignore_index);
  TESSERA_CHECK(options.chunk_rows >= 0, "linear_cross_entropy: chunk_rows must be >= 0 (0: automatic), found ",
                options.chunk_rows);
  const bool grad = at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  if (!grad) return chunked(hidden, weight, target, options, false, false).loss;
  return LinearCrossEntropyFunction::apply(hidden, weight, target, options.ignore_index, options.chunk_rows);
}

LossPathMemory loss_path_memory(const at::Tensor& loss) {
  LossPathMemory memory;
  sdk::for_each_autograd_node(loss, [&](torch::autograd::Node& node) {
    if (auto* fused = dynamic_cast<torch::autograd::CppNode<LinearCrossEntropyFunction>*>(&node)) {
      auto& saved = fused->ctx_.saved_data;
      if (saved.count("workspace_bytes") > 0)
        memory.workspace_bytes = std::max(memory.workspace_bytes, saved.at("workspace_bytes").toDouble());
      if (saved.count("kept_weight_gradient_bytes") > 0)
        memory.kept_weight_gradient_bytes += saved.at("kept_weight_gradient_bytes").toDouble();
      ++memory.fused;
    } else if (auto* log_softmax = dynamic_cast<torch::autograd::generated::LogSoftmaxBackward0*>(&node)) {
      // Backward holds the log-probabilities' gradient and the logits' beside the kept
      // log-probabilities (3 arrays live), and in a training process the forward's logits,
      // freed, stay resident in part while those take new blocks. Fit's peak RSS on the 128,256
      // vocabulary measures 3.7-3.9 logits arrays at T 2048 and 2.9-3.4 at 512 (an AVX2 and an
      // AVX-512 machine): 3.5 with the kept one, within 15% of both.
      const at::Tensor kept = log_softmax->result_.unpack(node.shared_from_this());
      if (!kept.defined()) return;
      memory.workspace_bytes = std::max(memory.workspace_bytes, 2.5 * static_cast<double>(kept.nbytes()));
      memory.logits += kept.numel();
      ++memory.unfused;
    }
  });
  return memory;
}

}  // namespace tessera::toolkit
