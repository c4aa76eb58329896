#include "tessera/toolkit/sync_batch_norm.hpp"

#include <ostream>
#include <string>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "tessera/sdk/error.hpp"

// Declared in the header: LibTorch 1.13 defines none for a BatchNorm class of ours.
template <>
void torch::nn::BatchNormImplBase<2, tessera::toolkit::SyncBatchNorm2dImpl>::pretty_print(std::ostream& stream) const {
  stream << "tessera::toolkit::SyncBatchNorm2d(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=" << (options.momentum().has_value() ? std::to_string(*options.momentum()) : "None")
         << ", affine=" << (options.affine() ? "true" : "false")
         << ", track_running_stats=" << (options.track_running_stats() ? "true" : "false") << ")";
}

namespace tessera::toolkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AllReduceRef : torch::CustomClassHolder {
  explicit AllReduceRef(AllReduceSum f) : fn(std::move(f)) {}
  AllReduceSum fn;
};

/// Every rank's sum, in forward and (every rank's loss depends on every rank's input) backward.
struct AllReduceSumFunction : public torch::autograd::Function<AllReduceSumFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<AllReduceRef> ref) {
    at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
    ref->fn(out);
    ctx->saved_data["all_reduce"] = c10::IValue::make_capsule(std::move(ref));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].clone(at::MemoryFormat::Contiguous);
    c10::static_intrusive_pointer_cast<AllReduceRef>(ctx->saved_data["all_reduce"].toCapsule())->fn(grad);
    return {grad, at::Tensor()};
  }
};

}  // namespace

void SyncBatchNorm2dImpl::_check_input_dim(const at::Tensor& input) {
  TESSERA_CHECK(input.dim() == 4, "SyncBatchNorm2d expects a 4-D input [N, C, H, W], got ", input.sizes());
}

at::Tensor SyncBatchNorm2dImpl::forward(const at::Tensor& input) {
  if (!all_reduce_ || !is_training()) return BatchNormImplBase::forward(input);
  _check_input_dim(input);
  const std::int64_t channels = input.size(1);
  TESSERA_CHECK(channels == options.num_features(), "SyncBatchNorm2d of ", options.num_features(),
                " features got an input with ", channels, " channels");
  auto ref = c10::make_intrusive<AllReduceRef>(all_reduce_);
  const std::vector<std::int64_t> reduced = {0, 2, 3};
  const std::vector<std::int64_t> per_channel = {1, channels, 1, 1};
  // Two passes (the mean, then the squared deviations from it) in double, as LibTorch's CPU
  // batch_norm accumulates: E[x^2] - E[x]^2, or fp32 sums, would drift from the one-rank run.
  const at::Tensor x = input.to(at::kDouble);
  const at::Tensor local_count = at::full({1}, static_cast<double>(x.numel() / channels), x.options());
  const at::Tensor sums = AllReduceSumFunction::apply(at::cat({x.sum(reduced), local_count}), ref);
  const at::Tensor count = sums.narrow(0, channels, 1);
  const at::Tensor mean = sums.narrow(0, 0, channels) / count;
  const at::Tensor centered = x - mean.view(per_channel);
  const at::Tensor var = AllReduceSumFunction::apply((centered * centered).sum(reduced), ref) / count;
  at::Tensor out = centered * at::rsqrt(var + options.eps()).view(per_channel);
  if (options.affine()) out = out * weight.to(at::kDouble).view(per_channel) + bias.to(at::kDouble).view(per_channel);
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
    const double momentum = options.momentum().has_value()
                                ? *options.momentum()
                                : 1.0 / static_cast<double>(num_batches_tracked.item<std::int64_t>());
    const double n = count.item<double>();
    running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.scalar_type()), momentum);
    // The running variance is unbiased, as at::batch_norm keeps it.
    running_var.mul_(1 - momentum).add_((var.detach() * (n / std::max(n - 1, 1.0))).to(running_var.scalar_type()),
                                        momentum);
  }
  return out.to(input.scalar_type());
}

}  // namespace tessera::toolkit
