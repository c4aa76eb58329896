#pragma once
/// Tensor parallelism's contract: the group a model's parallelize function (sdk::Module::parallelize)
/// receives, and how a module says which of its parameters are pieces (the strategies and the
/// checkpoint code find them through it). The layers that hold the pieces and run the group's
/// collectives (ColumnParallelLinear, RowParallelLinear) are the toolkit's
/// (tessera/toolkit/tensor_parallel.hpp). The tp ranks see the same batch; the parameters
/// that are not listed by tensor_parallel_placements() are replicated on them, with identical
/// gradients.
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// The tensor-parallel group (the device mesh's "tp" dimension) a model shards its layers
/// over. Every collective is blocking and must be called by every rank of the group in the
/// same order. A strategy builds it (core::make_tensor_parallel_group).
class TESSERA_SDK_API TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup();
  /// This rank's index in the group, in [0, size()).
  virtual std::int64_t rank() const = 0;
  virtual std::int64_t size() const = 0;
  /// Sum over the group's ranks, in place (any layout; bf16 reduced in fp32).
  virtual void all_reduce_sum(at::Tensor& tensor) = 0;
  /// Every rank's `tensor` (same shape on all) concatenated along `dim` in rank order.
  virtual at::Tensor all_gather(const at::Tensor& tensor, std::int64_t dim) = 0;
};

/// How a parameter is split over tp ranks. dim < 0: replicated. stride > 1: the dimension is
/// `stride` equal parts (a fused q/k/v weight: 3), each cut into size() pieces; rank r holds
/// piece r of every part, concatenated (Megatron's partition_stride).
struct TensorParallelPlacement {
  std::int64_t dim = -1;
  std::int64_t stride = 1;
};

/// This rank's piece of `full` (a new contiguous tensor; `full` itself when replicated).
/// Throws sdk::Error when the dimension does not split into stride x size equal pieces.
TESSERA_SDK_API at::Tensor tensor_parallel_shard(const at::Tensor& full, TensorParallelPlacement placement,
                                                 std::int64_t rank, std::int64_t size);
/// The full tensor from every rank's `local` piece (collective over `group`; `local` itself
/// when replicated).
TESSERA_SDK_API at::Tensor tensor_parallel_unshard(const at::Tensor& local, TensorParallelPlacement placement,
                                                   TensorParallelGroup& group);

/// Implemented by modules that hold tensor-parallel pieces of parameters: the placements of
/// the parameters the module registers itself (names as named_parameters(false) gives them).
/// Parameters not listed are replicated.
class TESSERA_SDK_API TensorParallelModule {
 public:
  virtual ~TensorParallelModule();
  virtual std::map<std::string, TensorParallelPlacement> tensor_parallel_placements() const = 0;
};

/// Every tensor-parallel parameter under `module` (itself included): its name as
/// module.named_parameters() gives it, and its placement.
TESSERA_SDK_API std::map<std::string, TensorParallelPlacement> tensor_parallel_placements(
    const torch::nn::Module& module);

/// What a model's parallelize function receives (the strategy builds it from its device mesh).
struct ParallelContext {
  std::shared_ptr<TensorParallelGroup> tp;  ///< the tensor-parallel group (size 1: no TP)
  std::int64_t dp_rank = 0, dp_size = 1;    ///< this rank's place on the data-parallel dimension
};

}  // namespace tessera::sdk
