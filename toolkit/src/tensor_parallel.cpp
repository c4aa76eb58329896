#include "tessera/toolkit/tensor_parallel.hpp"

#include <cmath>
#include <ostream>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/init.h>

#include "tessera/sdk/autograd_graph.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::toolkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The group an autograd node uses in backward (held through an IValue capsule: what
/// torch::autograd::Function lets a node own).
struct GroupRef : torch::CustomClassHolder {
  explicit GroupRef(std::shared_ptr<TensorParallelGroup> g) : group(std::move(g)) {}
  std::shared_ptr<TensorParallelGroup> group;
};

TensorParallelGroup& group_of(AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<GroupRef>(ctx->saved_data["group"].toCapsule())->group;
}

/// A contiguous copy of `t` summed over the group (the caller's tensor is never written).
at::Tensor all_reduced(const at::Tensor& t, TensorParallelGroup& group) {
  at::Tensor out = t.clone(at::MemoryFormat::Contiguous);
  group.all_reduce_sum(out);
  return out;
}

/// Each region's node records what its all-reduce moves, for tensor_parallel_traffic().
void note_traffic(AutogradContext* ctx, const at::Tensor& x, const GroupRef& ref) {
  ctx->saved_data["bytes"] = static_cast<std::int64_t>(x.numel()) * static_cast<std::int64_t>(x.element_size());
  ctx->saved_data["group_size"] = ref.group->size();
}

struct CopyToRegion : public torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<GroupRef> ref) {
    note_traffic(ctx, x, *ref);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(ref));
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].defined() ? all_reduced(grads[0], group_of(ctx)) : grads[0];
    return {grad, at::Tensor()};
  }
};

struct ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<GroupRef> ref) {
    note_traffic(ctx, x, *ref);
    return all_reduced(x, *ref->group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

void check_group(const std::shared_ptr<TensorParallelGroup>& group, const char* what) {
  TESSERA_CHECK(group != nullptr, what, ": no tensor-parallel group (null)");
}

}  // namespace

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, std::shared_ptr<TensorParallelGroup> group) {
  check_group(group, "copy_to_tensor_parallel_region");
  if (group->size() == 1) return x;
  return CopyToRegion::apply(x, c10::make_intrusive<GroupRef>(std::move(group)));
}

at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, std::shared_ptr<TensorParallelGroup> group) {
  check_group(group, "reduce_from_tensor_parallel_region");
  if (group->size() == 1) return x;
  return ReduceFromRegion::apply(x, c10::make_intrusive<GroupRef>(std::move(group)));
}

TensorParallelTraffic tensor_parallel_traffic(const at::Tensor& output) {
  TensorParallelTraffic traffic;
  auto add = [&](AutogradContext& ctx, double& bytes, std::int64_t& calls) {
    traffic.group_size = ctx.saved_data["group_size"].toInt();
    bytes += static_cast<double>(ctx.saved_data["bytes"].toInt());
    ++calls;
  };
  sdk::for_each_autograd_node(output, [&](torch::autograd::Node& node) {
    if (auto* copy = dynamic_cast<torch::autograd::CppNode<CopyToRegion>*>(&node))
      add(copy->ctx_, traffic.backward_all_reduce_bytes, traffic.backward_all_reduces);
    else if (auto* reduce = dynamic_cast<torch::autograd::CppNode<ReduceFromRegion>*>(&node))
      add(reduce->ctx_, traffic.forward_all_reduce_bytes, traffic.forward_all_reduces);
  });
  return traffic;
}

namespace {

torch::nn::Linear fresh_linear(std::int64_t in, std::int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

/// Registers `name` as this rank's piece of `full` (nothing when `full` is undefined).
at::Tensor register_piece(torch::nn::Module& module, const std::string& name, const at::Tensor& full,
                          TensorParallelPlacement placement, const TensorParallelGroup& group) {
  if (!full.defined()) return {};
  at::Tensor piece = sdk::tensor_parallel_shard(full.detach(), placement, group.rank(), group.size());
  if (placement.dim < 0) piece = piece.clone();
  return module.register_parameter(name, piece, full.requires_grad());
}

/// LibTorch's LinearImpl::reset_parameters() on tensors of any shape (the fan-in is the
/// weight's second dimension: the full layer's when deferred init calls it).
void reset_linear(at::Tensor& weight, at::Tensor& bias) {
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (!bias.defined()) return;
  const std::int64_t fan_in = std::get<0>(torch::nn::init::_calculate_fan_in_and_fan_out(weight));
  const double bound = 1 / std::sqrt(static_cast<double>(fan_in));
  torch::nn::init::uniform_(bias, -bound, bound);
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& o,
                                                   std::shared_ptr<TensorParallelGroup> g)
    : ColumnParallelLinearImpl(*fresh_linear(o.in_features(), o.out_features(), o.bias()), std::move(g), o.stride()) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::LinearImpl& full,
                                                   std::shared_ptr<TensorParallelGroup> g, std::int64_t stride)
    : torch::nn::Module("ColumnParallelLinear"),
      options(full.options.in_features(), full.options.out_features()),
      group(std::move(g)) {
  options.bias(full.bias.defined()).stride(stride);
  check_group(group, "ColumnParallelLinear");
  TESSERA_CHECK(stride >= 1 && options.out_features() % (stride * group->size()) == 0,
                "ColumnParallelLinear: out_features = ", options.out_features(), " does not split into stride ",
                stride, " x tensor-parallel size ", group->size(), " equal pieces");
  weight = register_piece(*this, "weight", full.weight, {0, stride}, *group);
  bias = register_piece(*this, "bias", full.bias, {0, stride}, *group);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  TESSERA_CHECK(input.dim() >= 1 && input.size(-1) == options.in_features(), "ColumnParallelLinear: input of shape ",
                input.sizes(), " (the last dimension must be in_features = ", options.in_features(), ")");
  return at::linear(copy_to_tensor_parallel_region(input, group), weight, bias);
}

std::map<std::string, TensorParallelPlacement> ColumnParallelLinearImpl::tensor_parallel_placements() const {
  std::map<std::string, TensorParallelPlacement> out{{"weight", {0, options.stride()}}};
  if (bias.defined()) out["bias"] = {0, options.stride()};
  return out;
}

void ColumnParallelLinearImpl::reset_parameters() { reset_linear(weight, bias); }

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "ColumnParallelLinear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << (options.bias() ? "true" : "false") << ", stride=" << options.stride()
         << ", tp=" << group->rank() << "/" << group->size() << ")";
}

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& o, std::shared_ptr<TensorParallelGroup> g)
    : RowParallelLinearImpl(*fresh_linear(o.in_features(), o.out_features(), o.bias()), std::move(g)) {}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::LinearImpl& full, std::shared_ptr<TensorParallelGroup> g)
    : torch::nn::Module("RowParallelLinear"),
      options(full.options.in_features(), full.options.out_features()),
      group(std::move(g)) {
  options.bias(full.bias.defined());
  check_group(group, "RowParallelLinear");
  TESSERA_CHECK(options.in_features() % group->size() == 0, "RowParallelLinear: in_features = ",
                options.in_features(), " does not split into tensor-parallel size ", group->size(), " equal pieces");
  weight = register_piece(*this, "weight", full.weight, {1, 1}, *group);
  bias = register_piece(*this, "bias", full.bias, {}, *group);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const std::int64_t local_in = options.in_features() / group->size();
  TESSERA_CHECK(input.dim() >= 1 && input.size(-1) == local_in, "RowParallelLinear: input of shape ", input.sizes(),
                " (the last dimension must be this rank's in_features / tp = ", local_in, ")");
  at::Tensor y = reduce_from_tensor_parallel_region(at::linear(input, weight), group);
  // In y's dtype, as Linear's fused bias is under autocast.
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

std::map<std::string, TensorParallelPlacement> RowParallelLinearImpl::tensor_parallel_placements() const {
  return {{"weight", {1, 1}}};
}

void RowParallelLinearImpl::reset_parameters() { reset_linear(weight, bias); }

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "RowParallelLinear(in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << (options.bias() ? "true" : "false") << ", tp=" << group->rank() << "/" << group->size()
         << ")";
}

}  // namespace tessera::toolkit
