#pragma once
/// Flat-parameter fully sharded data parallelism (PyTorch FSDP1 semantics) over a
/// torch::nn::Module tree, without module hooks: each FSDP unit's parameters are views into
/// one padded flat buffer whose storage is gathered before the unit runs (through the
/// sdk::invoke seam) and freed after; gradients accumulate into a flat gradient buffer and
/// are reduce-scattered into the sharded gradient once the unit's backward is complete.
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "tessera/core/comm.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/precision.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core::fsdp {

enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD };
enum class BackwardPrefetch { NONE, BACKWARD_PRE, BACKWARD_POST };

struct FSDPOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  bool forward_prefetch = false;
  /// "transformer": modules whose name() is in unit_classes; "size": those of them with at
  /// least min_num_params parameters; "none": the root is the only unit.
  std::string auto_wrap_policy = "transformer";
  std::vector<std::string> unit_classes;
  std::int64_t min_num_params = 0;
  std::vector<std::string> activation_checkpointing;  ///< unit classes recomputed in backward
  bool reduce_every_micro_batch = false;
  bool rank0_only = true;  ///< full state dicts are built on rank 0 only
  sdk::MixedPrecisionPolicy mixed_precision;
};

struct FlatParamUnit;

/// The sharded state of one network and the hooks that keep it consistent.
class ShardedModule {
 public:
  /// Plans the units, flattens and shards their parameters over `shard_group` (gradients
  /// are also averaged over `replicate_group`: HYBRID_SHARD / NO_SHARD), and installs the
  /// unit runners. Every rank must plan the same units: checked through `shard_group`.
  ShardedModule(std::shared_ptr<torch::nn::Module> network, const FSDPOptions& options, CommunicatorPtr shard_group,
                CommunicatorPtr replicate_group);
  ~ShardedModule();

  /// The optimizer's view: one tensor per original parameter, the part of it in this rank's
  /// shard (possibly empty), named after it.
  std::vector<sdk::NamedParameter> optimizer_parameters() const;

  /// Before a step's forward: gathers the root unit (and attaches gradients when training).
  void begin_forward(bool training);
  /// After a forward without backward (evaluation): frees what was gathered.
  void end_forward();
  /// Around loss.backward(): with `sync` false gradients accumulate unsharded (no_sync).
  void begin_backward(bool sync);
  void finish_backward();
  /// After optimizer.step() and zero_grad(): clears the sharded gradients.
  void after_optimizer_step();

  /// Total norm of the sharded gradients over all ranks; scales them to `max_norm`.
  double clip_grad_norm(double max_norm, double norm_type);

  /// FULL state dict (collective): original names and shapes, fp32. Empty on ranks other
  /// than 0 when options.rank0_only.
  sdk::StateDict full_state_dict();
  /// Loads a full state dict on every rank (each keeps its shard): any world size.
  void load_full_state_dict(const sdk::StateDict& state, bool strict);
  /// The optimizer state consolidated to full parameter shapes, keyed by original names
  /// (PyTorch's full_optim_state_dict): loadable by single_device and any world size.
  sdk::Checkpoint full_optim_state_dict(const torch::optim::Optimizer& optimizer);
  /// Scatters a full optimizer state dict into this rank's shards (scatter_full_optim_state_dict).
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& state);

  /// "name:numel" of every unit in order: what ranks compare before the first step.
  std::string plan() const;
  std::size_t num_units() const;
  /// Bytes of sharded state (master shards + sharded grads) on this rank.
  std::int64_t sharded_bytes() const;

  // Called by the unit runners and hooks.
  void unshard(FlatParamUnit& unit, const std::string& phase);
  void reshard(FlatParamUnit& unit);
  void attach_gradients(FlatParamUnit& unit);
  void on_gradient_ready(FlatParamUnit& unit);
  FlatParamUnit* previous_unit(const FlatParamUnit& unit) const;
  FlatParamUnit* next_unit(const FlatParamUnit& unit) const;
  const FSDPOptions& options() const { return options_; }
  bool training_step_active() const { return sync_ || accumulating_; }

 private:
  void plan_units();
  void flatten(FlatParamUnit& unit);
  void reduce_gradients(FlatParamUnit& unit);
  void check_plan();
  /// fp32 on the network's device (where collectives and shards live).
  at::TensorOptions fp32() const;

  std::shared_ptr<torch::nn::Module> network_;
  FSDPOptions options_;
  CommunicatorPtr shard_group_;
  CommunicatorPtr replicate_group_;
  std::vector<std::unique_ptr<FlatParamUnit>> units_;  // children in forward order, root last
  c10::Device device_{c10::kCPU};
  bool sync_ = true;
  bool accumulating_ = false;
};

ShardingStrategy parse_sharding_strategy(const std::string& name);
BackwardPrefetch parse_backward_prefetch(const std::string& name);

}  // namespace tessera::core::fsdp
