#pragma once
/// An optional interface a Strategy may also implement, so that `tessera plan` (and `fit`,
/// before any work) can predict what each rank holds and sends without running a step: how
/// the strategy, as configured, would lay a model's parameters, gradients and collective
/// buffers out over a job of a given size. Queried with dynamic_cast, like StrategyChecks: a
/// strategy without it gets a plan that says its layout is unknown, never a made-up figure.
#include <cstdint>
#include <string>
#include <vector>

#include <memory>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "tessera/sdk/export.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

class Module;

/// One kind of collective a rank takes part in during one optimizer step (one micro-batch).
struct PlannedCollective {
  std::string kind;             ///< "all_gather", "reduce_scatter" or "all_reduce"
  std::string what;             ///< e.g. "forward all-gather of the units (bf16)"
  double bytes = 0;             ///< the full (unsharded) size of the data moved, summed over the step's calls
  std::int64_t group_size = 1;  ///< ranks of the group it runs in (1: nothing is sent)
};

/// The largest rank's memory, in bytes, by what it is for. Persistent figures are held from
/// setup to the end of training; transient ones at the peak of a step (backward).
struct MemoryLayout {
  std::string description;  ///< e.g. "fsdp FULL_SHARD: 8 units + root sharded over 4 ranks"
  // Persistent.
  double param_bytes = 0;      ///< parameters as the optimizer steps on them (shards under FSDP)
  double grad_bytes = 0;       ///< their gradients
  std::int64_t optimizer_numel = 0;  ///< elements the optimizer keeps one moment per
  c10::ScalarType optimizer_dtype = c10::ScalarType::Float;  ///< dtype of those moments
  double persistent_buffer_bytes = 0;  ///< e.g. DDP's gradient buckets
  /// Building and sharding the model (before training): the whole model where it is built
  /// whole, about one unit under deferred init. The plan's peak is the larger of the two phases.
  double setup_bytes = 0;
  // At the peak of a step.
  double gathered_bytes = 0;        ///< unsharded parameters alive at once (current + prefetched units, the root)
  double unsharded_grad_bytes = 0;  ///< unsharded gradients alive at once in backward
  double collective_buffer_bytes = 0;  ///< all-gather outputs / reduce-scatter inputs and outputs alive at once
  std::string largest_unit;          ///< name and size of the largest unit, for the report
  std::int64_t units = 0;            ///< units (or buckets) the parameters are grouped in
  std::vector<PlannedCollective> collectives;  ///< per optimizer step
  std::string notes;                 ///< what is approximate about this layout
  /// The layout counts what accumulating micro-batches keeps between them (otherwise the plan
  /// notes that it laid out one micro-batch).
  bool counts_micro_batches = false;
};

class TESSERA_SDK_API StrategyMemoryLayout {
 public:
  virtual ~StrategyMemoryLayout();
  /// The layout of `module`'s network (built by configure_model(), possibly under deferred
  /// init: parameters have their shapes, not their values) under this strategy, connected to
  /// its precision, on a job described by `cluster` (world size, local ranks). Called on one
  /// process before any rank starts, instead of setup_environment/setup; must not communicate
  /// nor allocate the model. Throws sdk::Error for a configuration that cannot run.
  /// `micro_batches`: micro-batches per optimizer step ([trainer] accumulate_grad_batches).
  virtual MemoryLayout memory_layout(Module& module, const ClusterInfo& cluster, std::int64_t micro_batches) = 0;
  /// Whether the job keeps parameters, gradients and optimizer state in host memory while it
  /// computes on a device (CPU offload): where the plan puts them. Default: no.
  virtual bool offloads_state_to_cpu() const;
  /// Whether the gradients are freed after each optimizer step (and come back in backward), so
  /// that they are no persistent row. Default: no.
  virtual bool frees_gradients_after_step() const;
  /// The modules of `module`'s network whose activations this strategy recomputes in backward
  /// (activation checkpointing): the plan traces them as such. Default: none.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> checkpointed_units(Module& module);
};

}  // namespace tessera::sdk
