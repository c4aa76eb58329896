#pragma once
/// What the fsdp and fsdp2 strategies share (Lightning's FSDPStrategy and NeMo's
/// FSDP2Strategy differ in how they build their groups and layouts, not in how they step or
/// checkpoint): a StrategyBase over a ShardedModule, with the steps bracketed by the
/// engine's forward/backward seams, the sharded gradient norm, and FULL / SHARDED / LOCAL
/// state dicts and checkpoints. A subclass builds `engine_` in setup_module().
#include <functional>
#include <memory>
#include <string>

#include "tessera/core/fsdp.hpp"
#include "tessera/core/strategy_base.hpp"
#include "tessera/core/tensor_piece.hpp"
#include "tessera/sdk/memory_layout.hpp"

namespace tessera::core::fsdp {

struct UnitPlan;

class ShardedStrategy : public StrategyBase, public sdk::StrategyMemoryLayout {
 public:
  /// Reads `deferred_init` and `state_dict_type` ("full" | "sharded" | "local", or
  /// PyTorch's FULL_STATE_DICT / SHARDED_STATE_DICT / LOCAL_STATE_DICT).
  explicit ShardedStrategy(const sdk::Options& options);

  /// Refuses, before any work, a SHARDED/LOCAL state_dict_type with a checkpoint IO that says
  /// (sdk::CheckpointIOFeatures) it writes full checkpoints only.
  void connect(std::shared_ptr<sdk::Precision> precision, std::shared_ptr<sdk::CheckpointIO> checkpoint_io) override;

  /// Under deferred_init the model is built on the meta device and materialised one unit
  /// at a time when it is sharded (Lightning's init_module(empty_init=True)).
  sdk::GuardPtr model_sharded_context() override;

  /// The sharding engine (summon_full_params, apply, fsdp_modules, state dicts, ...).
  ShardedModule& engine();

  sdk::StepOutput training_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  sdk::StepOutput validation_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  sdk::StepOutput test_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  at::Tensor predict_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  void backward(const at::Tensor& loss, bool sync_gradients) override;
  double clip_grad_norm(double max_norm, double norm_type) override;

  /// FULL (default): the whole model with original names (rank 0 only unless rank0_only =
  /// false); SHARDED: this rank's 1-D piece of every parameter; LOCAL: each unit's shard.
  sdk::StateDict lightning_module_state_dict() override;
  void load_model_state_dict(const sdk::StateDict& state, bool strict) override;
  /// FULL: PyTorch's full_optim_state_dict (full shapes, original names); SHARDED/LOCAL:
  /// this rank's optimizer state on its pieces, named after the original parameters.
  sdk::Checkpoint optimizer_state() override;
  /// Checks the state at once; installs it at once, or under `defer_optimizer_restore_` at the
  /// first optimizer step (NeMo's FSDP2Strategy) or the first optimizer_state(), whichever
  /// comes first (the groups' hyper-parameters are restored at once either way).
  void load_optimizer_state(const sdk::Checkpoint& state) override;
  sdk::StepResult optimizer_step(double gradient_clip_val, double norm_type) override;
  /// FULL: one file from rank 0. SHARDED/LOCAL: every rank writes its shard through the
  /// CheckpointIO (the "distributed" one), rank 0 publishes it once all are written.
  void save_checkpoint(const sdk::Checkpoint& checkpoint, const std::string& path) override;
  /// A full checkpoint loads as usual; a SHARDED one from any world size and either layout
  /// is re-cut to this rank's pieces (reading one shard file at a time); a LOCAL one needs
  /// the same world size.
  sdk::Checkpoint load_checkpoint(const std::string& path) override;
  void teardown() override;

  /// `tessera plan`: the units the wrap policy makes of `module`'s network and their shards
  /// on the mesh a job of `cluster` gets (core/fsdp/memory_plan.hpp), without communicating.
  /// For optimizer steps of `micro_batches` micro-batches (accumulate_grad_batches): the
  /// unsharded gradients every unit keeps between them, or the reductions of each under
  /// reduce_every_micro_batch.
  sdk::MemoryLayout memory_layout(sdk::Module& module, const sdk::ClusterInfo& cluster,
                                  std::int64_t micro_batches) final;
  /// Whether this job keeps the shards, their gradients and the optimizer state in host memory
  /// while it computes on CUDA (fsdp's cpu_offload, fsdp2's offload_policy = "cpu"; on the CPU
  /// there is nowhere to offload to): where `tessera plan` puts them.
  bool offloads_state_to_cpu() const final;
  /// The engine frees a CUDA job's sharded gradients after each step (Scheduler::zero_grad).
  bool frees_gradients_after_step() const final { return true; }
  /// The units of `module`'s network this strategy, as configured, recomputes in backward
  /// (activation_checkpointing): `tessera plan` traces them as such.
  std::vector<std::shared_ptr<torch::nn::Module>> checkpointed_units(sdk::Module& module) final;

 protected:
  /// The mesh a job of `cluster` gets, as setup_environment/setup_module would build it.
  struct PlannedMesh {
    std::int64_t shard = 1, replicate = 1, tp = 1;
    std::int64_t reshard_group = 0;  ///< fsdp2 reshard_after_forward = k; 0: the shard group
  };
  virtual PlannedMesh planned_mesh(const sdk::ClusterInfo& cluster) const = 0;
  /// The options setup_module would pass the engine, with mixed precision from `policy` (the
  /// precision plugin's) and the strategy's own overrides; wrap callbacks are filled by the caller.
  virtual FSDPOptions planned_options(const sdk::MixedPrecisionPolicy& policy) const = 0;
  virtual std::string strategy_name() const = 0;
  /// memory_layout(): the units of `module`'s network laid out on the planned mesh. A
  /// strategy that changes the network first (tensor parallelism) does so here.
  virtual sdk::MemoryLayout planned_layout(sdk::Module& module, const sdk::ClusterInfo& cluster,
                                           std::int64_t micro_batches);

  std::vector<sdk::NamedParameter> optimizer_parameters() override;
  // The optimizer's gradients are views of the sharded gradients: zeroed in place.
  void zero_grad() override;
  /// The options every layout shares, from the model plugin and the precision: device,
  /// deferred init, init function, mixed precision, wrap policy callbacks.
  void fill_common_options(FSDPOptions& options) const;
  /// Where the tensors of this rank's SHARDED state dict sit in the global tensors (what a
  /// sharded save describes and a sharded load reads): the flat range of each parameter this
  /// rank owns, whole buffers. A strategy whose parameters are pieces themselves (tensor
  /// parallelism) maps them to the global tensors.
  virtual std::map<std::string, StackedPieces> owned_pieces();
  /// Throws (naming `key`) when a unit class of `options` is not in the network.
  void check_unit_classes(const FSDPOptions& options, const std::string& key) const;
  /// Offloading keeps a CUDA device's shards, gradients and optimizer state in pinned host
  /// memory; on the CPU they are host memory already, so `setting` (the key or plugin that asked
  /// for it) is refused rather than accepted and ignored.
  void refuse_offload_on_cpu(const std::string& setting) const;
  void check_unit_classes(const torch::nn::Module& network, const FSDPOptions& options, const std::string& key) const;

  bool loaded_sharded() const { return loaded_ == "sharded"; }

  bool deferred_init_;
  std::string state_dict_type_;  // full | sharded | local
  std::string state_dict_type_key_;  // "file:line: [strategy] state_dict_type", for messages
  bool reduce_every_micro_batch_ = false;
  bool defer_optimizer_restore_ = false;
  std::unique_ptr<ShardedModule> engine_;

 private:
  /// The units setup_module would give `module`'s network, and in `options` the options it
  /// would use (the precision's policy, the model's wrap callbacks); throws for unit classes
  /// the network has not.
  UnitPlan planned_units(sdk::Module& module, FSDPOptions& options);
  sdk::Checkpoint shaped_pieces(const sdk::Checkpoint& saved);
  void restore_deferred_optimizer_state();

  std::function<void()> deferred_optimizer_state_;  // set between a load and its restore

  std::string loaded_ = "full";  // the form of the state the last load_checkpoint returned
};

}  // namespace tessera::core::fsdp
