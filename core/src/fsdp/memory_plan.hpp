#pragma once
/// The memory and traffic of a sharded layout, from unit sizes alone (no tensor, no rank):
/// what `tessera plan` reports for the fsdp and fsdp2 strategies (sdk::StrategyMemoryLayout).
/// It follows what the engine allocates: the flat layout's padded shards (flat_param.cpp),
/// the per-parameter layout's dim-0 chunks and its separate all-gather buffer (param_group.cpp),
/// the scheduler's units gathered at once and its two reductions in flight (scheduler.cpp),
/// and the communicator's collectives: over Gloo a reduce-scatter is an all-to-all into a
/// receive buffer of the input's size; shared memory and NCCL move the tensors themselves.
#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "tessera/core/fsdp/options.hpp"
#include "tessera/sdk/memory_layout.hpp"

namespace tessera::core::fsdp {

/// One parameter as the layouts see it: dim-0 rows of row_numel elements each.
struct PlannedParam {
  std::int64_t rows = 1;
  std::int64_t row_numel = 0;
  bool trainable = true;  ///< requires_grad: frozen parameters have no optimizer state
};

struct PlannedUnitSizes {
  std::string name;  ///< module path, "<root>" for the root (last)
  std::vector<PlannedParam> params;
};

/// How the communicator moves a collective's data (c10d_communicator.cpp).
enum class PlannedTransport {
  gloo,           ///< reduce-scatter: all-to-all into a receive buffer + local sum; list all-gather staged in one tensor
  shared_memory,  ///< Gloo's ranks on one host: through a segment per group (core::shared_memory_collectives)
  nccl,           ///< CUDA: NCCL's own reduce-scatter and all-gather, straight from and into the tensors
};

struct ShardedPlanInput {
  std::string strategy = "fsdp";  ///< for the description
  std::vector<PlannedUnitSizes> units;  ///< forward order, the root last
  std::int64_t replicated_numel = 0;    ///< ignored modules' (and exempt norms') parameters, whole on every rank
  std::int64_t replicated_trainable_numel = 0;  ///< of which the optimizer steps on (requires_grad)
  std::int64_t shard_size = 1;          ///< ranks a unit is sharded over
  std::int64_t replicate_size = 1;      ///< copies of each shard (HSDP replicas; NO_SHARD: the world)
  std::int64_t tp_size = 1;             ///< tensor-parallel ranks (units hold one tp rank's pieces already)
  std::int64_t reshard_group = 0;       ///< fsdp2 reshard_after_forward = k (0: the whole shard group)
  ParamLayout layout = ParamLayout::flat;
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  bool forward_prefetch = false;
  std::int64_t max_gathered_units = 0;  ///< limit_all_gathers (0: none)
  PlannedTransport transport = PlannedTransport::gloo;
  bool offloaded = false;  ///< cpu_offload on a CUDA job: shards in host memory, so one rank too copies its units over
  c10::ScalarType master_dtype = c10::ScalarType::Float;
  c10::ScalarType compute_dtype = c10::ScalarType::Float;
  c10::ScalarType reduce_dtype = c10::ScalarType::Float;
  c10::ScalarType grad_dtype = c10::ScalarType::Float;
  /// Micro-batches per optimizer step (accumulate_grad_batches). Unless gradients are reduced
  /// every micro-batch, every unit keeps its unsharded gradient until the last one reduces.
  std::int64_t micro_batches = 1;
  bool reduce_every_micro_batch = false;
};

/// Elements a rank holds of `unit` sharded over `shard_size` ranks (the largest rank; the
/// flat layout pads every rank to the same size) and the gathered buffer's elements.
struct UnitShard {
  std::int64_t numel = 0;     ///< unsharded
  std::int64_t shard = 0;     ///< per rank
  std::int64_t gathered = 0;  ///< the all-gather's output: shard_size x shard
  std::int64_t trainable_shard = 0;  ///< per rank, of parameters that require grad (the optimizer's)
};
UnitShard shard_unit(const PlannedUnitSizes& unit, ParamLayout layout, std::int64_t shard_size);

/// The layout's memory (largest rank) and its collectives per optimizer step: the reductions
/// of all its micro-batches, the all-gathers of one (the caller multiplies those).
sdk::MemoryLayout plan_sharded_memory(const ShardedPlanInput& input);

}  // namespace tessera::core::fsdp
