#pragma once
/// Strategy plugins (Lightning's Strategy): how a Module is placed, sharded, stepped and
/// checkpointed across ranks. A strategy owns its Precision and CheckpointIO.
///
/// The host drives it in this order, on every rank:
///   connect -> setup_environment -> [model_sharded_context: module.configure_model()]
///   -> setup(module) -> { training_step, backward, optimizer_step }* -> teardown.
/// Collective methods (reduce, barrier, broadcast, all_gather, optimizer_step with
/// clipping, checkpoint save/load) must be called by every rank of the job.
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/guard.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/precision.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

/// Result of one optimizer step.
struct StepResult {
  bool stepped = true;       ///< false when the grad scaler skipped the step (same on all ranks)
  double grad_norm = -1.0;   ///< total norm before clipping, or -1 when not clipped
};

class TESSERA_SDK_API Strategy : public PluginObject {
 public:
  ~Strategy() override;

  /// Hands the strategy its precision and checkpoint IO (before setup_environment).
  virtual void connect(std::shared_ptr<Precision> precision, std::shared_ptr<CheckpointIO> checkpoint_io) = 0;
  virtual Precision& precision() = 0;
  virtual CheckpointIO& checkpoint_io() = 0;

  /// Joins the process group(s) described by `cluster` and picks the root device.
  virtual void setup_environment(const ClusterInfo& cluster) = 0;
  /// Scope in which Module::configure_model runs (deferred / sharded initialisation).
  virtual GuardPtr model_sharded_context() = 0;
  /// Wraps/shards `module`'s network and builds the optimizer through
  /// module.configure_optimizers() on the strategy's view of the parameters.
  virtual void setup(std::shared_ptr<Module> module, const OptimizerSettings& optimizer) = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;

  /// Batch moved to the root device and converted by the precision; step run under the
  /// precision's forward_context.
  virtual StepOutput training_step(const Batch& batch, std::int64_t batch_idx) = 0;
  virtual StepOutput validation_step(const Batch& batch, std::int64_t batch_idx) = 0;
  virtual StepOutput test_step(const Batch& batch, std::int64_t batch_idx) = 0;
  virtual at::Tensor predict_step(const Batch& batch, std::int64_t batch_idx) = 0;

  /// Back-propagates `loss` (already divided for accumulation). With `sync_gradients`
  /// false (a non-final micro-batch) gradient reduction is skipped (PyTorch's no_sync).
  virtual void backward(const at::Tensor& loss, bool sync_gradients) = 0;
  /// Unscales, clips to `gradient_clip_val` (if > 0) under `norm_type` (inf allowed),
  /// steps through the precision, and zeroes gradients. Under gradient_clip_algorithm =
  /// "value" the host has already unscaled (Precision::unscale_gradients is idempotent per
  /// step) and clamped the gradients of optimizer()'s parameters, and passes 0 here: those
  /// gradients must be final when backward(sync_gradients = true) returns.
  virtual StepResult optimizer_step(double gradient_clip_val, double norm_type) = 0;
  /// Total gradient norm over all ranks' shards; scales gradients to `max_norm`.
  virtual double clip_grad_norm(double max_norm, double norm_type) = 0;

  /// Collectives over the whole job. reduce/all_gather return new tensors.
  virtual at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  virtual void barrier(const std::string& name) = 0;
  virtual void broadcast(at::Tensor& tensor, std::int64_t src) = 0;
  /// Stacks every rank's `tensor` on a new dim 0.
  virtual at::Tensor all_gather(const at::Tensor& tensor) = 0;

  /// Fills in this rank's part of the sampling (num_replicas, rank).
  virtual DataLoaderSpec process_dataloader(DataLoaderSpec spec) = 0;

  /// The full model state dict with original names (on every rank, unless the strategy is
  /// configured rank0_only, in which case other ranks get an empty dict).
  virtual StateDict lightning_module_state_dict() = 0;
  virtual void load_model_state_dict(const StateDict& state, bool strict) = 0;
  /// The optimizer state in this strategy's checkpoint form.
  virtual Checkpoint optimizer_state() = 0;
  virtual void load_optimizer_state(const Checkpoint& state) = 0;

  /// Save a checkpoint the host assembled (state_dict/optimizer_states from the two methods
  /// above) through the CheckpointIO: full by rank 0, or sharded by every rank.
  virtual void save_checkpoint(const Checkpoint& checkpoint, const std::string& path) = 0;
  /// The checkpoint this rank needs to restore from `path`.
  virtual Checkpoint load_checkpoint(const std::string& path) = 0;
  virtual void remove_checkpoint(const std::string& path) = 0;
  virtual void teardown() = 0;

  virtual bool is_global_zero() const = 0;
  virtual std::int64_t global_rank() const = 0;
  virtual std::int64_t world_size() const = 0;
  virtual c10::Device root_device() const = 0;
};

}  // namespace tessera::sdk
