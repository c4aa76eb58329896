#pragma once
/// Tensor-parallel layers for model plugins (Megatron-LM's tensor-model-parallel layers,
/// PyTorch's ColwiseParallel / RowwiseParallel): a model's parallelize function
/// (sdk::Module::parallelize) replaces its Linear layers by these, which hold this rank's piece
/// of each weight (sdk::TensorParallelModule says which) and run the collectives of the
/// tensor-parallel group (sdk::TensorParallelGroup) around their matmuls.
#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "tessera/sdk/layer.hpp"
#include "tessera/sdk/tensor_parallel.hpp"

namespace tessera::toolkit {

using sdk::TensorParallelGroup;
using sdk::TensorParallelModule;
using sdk::TensorParallelPlacement;

/// Megatron's copy_to_tensor_model_parallel_region: forward identity, backward all-reduce of
/// the gradient (the input of a column-parallel layer: each rank's gradient is partial).
at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, std::shared_ptr<TensorParallelGroup> group);
/// Megatron's reduce_from_tensor_model_parallel_region: forward all-reduce (the partial sums
/// of a row-parallel layer), backward identity.
at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x,
                                                              std::shared_ptr<TensorParallelGroup> group);

/// The activation traffic of the tensor-parallel regions an output was computed through, read
/// from its autograd graph: what the forward that made it all-reduced (reduce_from regions) and
/// what its backward will all-reduce (copy_to regions' gradients, each its input's size).
/// Bytes are the tensors' own, as the group receives them; all zero without tensor parallelism.
struct TensorParallelTraffic {
  std::int64_t group_size = 1;
  std::int64_t forward_all_reduces = 0, backward_all_reduces = 0;
  double forward_all_reduce_bytes = 0, backward_all_reduce_bytes = 0;
};
TensorParallelTraffic tensor_parallel_traffic(const at::Tensor& output);

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// The full layer's sizes (out_features is split over the group).
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// The output is `stride` equal parts split separately (a fused q/k/v projection: 3).
  TORCH_ARG(std::int64_t, stride) = 1;
};

/// y = x W^T + b with W [out, in] split on dim 0: this rank holds rows [out/tp, in] (of each
/// of the `stride` parts) and b's matching piece. The input is replicated (its gradient is
/// all-reduced in backward); the output is this rank's piece of the last dimension (Megatron's
/// gather_output = false), the input of a RowParallelLinear or of per-head attention.
/// Parameters "weight" and "bias", as torch::nn::Linear's, so state-dict names do not change.
class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelModule, public sdk::ResettableLayer {
 public:
  /// A new layer initialised as torch::nn::Linear(in, out) would be with the same generator
  /// state (the full weight is drawn, then cut), so it equals a sharded single-device layer.
  ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options, std::shared_ptr<TensorParallelGroup> group);
  /// This rank's piece of an existing layer `full` (its dtype, device and requires_grad).
  ColumnParallelLinearImpl(const torch::nn::LinearImpl& full, std::shared_ptr<TensorParallelGroup> group,
                           std::int64_t stride = 1);

  at::Tensor forward(const at::Tensor& input);
  std::map<std::string, TensorParallelPlacement> tensor_parallel_placements() const override;
  void pretty_print(std::ostream& stream) const override;
  /// torch::nn::Linear's initialisation of weight and bias as they are shaped now (deferred
  /// init calls it on the full layer's shapes).
  void reset_parameters() override;

  ColumnParallelLinearOptions options;
  std::shared_ptr<TensorParallelGroup> group;
  at::Tensor weight;  ///< [out / tp, in]
  at::Tensor bias;    ///< [out / tp], undefined without bias

 private:
  void register_pieces(const at::Tensor& full_weight, const at::Tensor& full_bias);
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// The full layer's sizes (in_features is split over the group).
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
};

/// y = x W^T + b with W [out, in] split on dim 1: this rank holds columns [out, in/tp]. The
/// input is this rank's piece of the last dimension (a ColumnParallelLinear's output); the
/// partial products are all-reduced, then the bias (replicated) is added once.
class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelModule, public sdk::ResettableLayer {
 public:
  /// A new layer initialised as torch::nn::Linear(in, out) would be (see ColumnParallelLinear).
  RowParallelLinearImpl(const RowParallelLinearOptions& options, std::shared_ptr<TensorParallelGroup> group);
  /// This rank's piece of an existing layer `full`.
  RowParallelLinearImpl(const torch::nn::LinearImpl& full, std::shared_ptr<TensorParallelGroup> group);

  at::Tensor forward(const at::Tensor& input);
  std::map<std::string, TensorParallelPlacement> tensor_parallel_placements() const override;
  void pretty_print(std::ostream& stream) const override;
  /// torch::nn::Linear's initialisation of weight and bias as they are shaped now (deferred
  /// init calls it on the full layer's shapes).
  void reset_parameters() override;

  RowParallelLinearOptions options;
  std::shared_ptr<TensorParallelGroup> group;
  at::Tensor weight;  ///< [out, in / tp]
  at::Tensor bias;    ///< [out], replicated; undefined without bias

 private:
  void register_pieces(const at::Tensor& full_weight, const at::Tensor& full_bias);
};
TORCH_MODULE(RowParallelLinear);

}  // namespace tessera::toolkit
