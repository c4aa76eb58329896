#pragma once
/// Fully sharded data parallelism over a torch::nn::Module tree, without module hooks: the
/// sharding core's front object. It plans the units (fsdp/wrap.hpp), lays out each unit's
/// parameters (fsdp/layout.hpp: fsdp's flat layout, fsdp/flat_param.hpp, PyTorch FSDP1; or fsdp2's
/// per-parameter one, fsdp/param_group.hpp, PyTorch's fully_shard),
/// schedules gathers and reductions (fsdp/scheduler.hpp) through the autograd seam
/// (fsdp/autograd_seam.hpp), and converts state dicts and optimizer state against "the piece
/// of each tensor this rank owns" (UnitLayout::owned_range).
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "tessera/core/comm.hpp"
#include "tessera/core/deferred_init.hpp"
#include "tessera/core/fsdp/options.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/guard.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core::fsdp {

/// Where each tensor of a sharded state dict sits in its full tensor: name -> the flat
/// start of this rank's piece and the full shape (pieces are 1-D slices of the flattened
/// tensor). Saved in sharded checkpoints as kShardMetadataKey: {name: [start, ndim, dims...]}.
constexpr const char* kShardMetadataKey = "fsdp_shard_metadata";

struct FSDPUnit;

using core::deferred_init_guard;
using core::has_deferred_tensors;

/// The sharded state of one network and the hooks that keep it consistent.
class ShardedModule {
 public:
  /// Plans the units, flattens and shards their parameters over `shard_group` (gradients
  /// are also averaged over `replicate_group`: HYBRID_SHARD / NO_SHARD), and installs the
  /// unit runners. Every rank must plan the same units: checked through both groups.
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
  /// After optimizer.step(): clears the sharded gradients.
  void after_optimizer_step();
  /// The most units (the root aside) gathered or gathering at once so far (limit_all_gathers).
  std::int64_t peak_units_gathered() const;

  /// Total norm of the sharded gradients over all ranks; scales them to `max_norm`.
  double clip_grad_norm(double max_norm, double norm_type);

  /// FULL state dict (collective): original names and shapes, the master dtype. Empty on ranks other
  /// than 0 when options.rank0_only.
  sdk::StateDict full_state_dict();
  /// Loads a full state dict on every rank (each keeps its shard): any world size.
  void load_full_state_dict(const sdk::StateDict& state, bool strict);
  /// The optimizer state consolidated to full parameter shapes, keyed by original names
  /// (PyTorch's full_optim_state_dict): loadable by single_device and any world size.
  sdk::Checkpoint full_optim_state_dict(const torch::optim::Optimizer& optimizer);
  /// This rank's part of a full optimizer state dict (PyTorch's shard_full_optim_state_dict):
  /// keyed by index over optimizer_parameters(), with their names; the full dict may be keyed
  /// by PARAM_ID (with "param_names") or by PARAM_NAME, from any world size or single_device.
  sdk::Checkpoint shard_full_optim_state_dict(const sdk::Checkpoint& full) const;
  /// Loads a full optimizer state dict present on every rank into this rank's shards.
  void load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& state);
  /// Full optimizer state on rank 0 only -> every rank's shard (scatter_full_optim_state_dict):
  /// rank 0 broadcasts it over the shard and replicate groups. Collective.
  void scatter_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full_on_rank0);

  /// Gathers every unit so that the module's parameters hold their full values (PyTorch's
  /// summon_full_params) until the guard is destroyed. Collective. With `writeback`, changes
  /// made to the parameters are written back into the shards (only changed elements, so a
  /// param_dtype below fp32 does not round the master weights); `rank0_only` keeps the full
  /// values on rank 0 only (incompatible with writeback, as in PyTorch); `offload_to_cpu`
  /// (a no-op for CPU networks) keeps the full values in CPU memory, gathering one unit at a
  /// time on the GPU; `with_grads` also gives every parameter its full gradient (.grad).
  sdk::GuardPtr summon_full_params(bool writeback = true, bool rank0_only = false, bool offload_to_cpu = false,
                                   bool with_grads = false);
  /// Applies `fn` to every module of the network with full parameters, writing changes back
  /// into the shards (PyTorch's FullyShardedDataParallel.apply). Collective.
  void apply(const std::function<void(torch::nn::Module&)>& fn);
  /// The FSDP units' module paths in forward order, the root ("") last; `root_only`: the root.
  std::vector<std::string> fsdp_modules(bool root_only = false) const;
  /// The parameters kept whole on every rank (ignored modules, exempt norm layers).
  std::vector<std::string> replicated_parameter_names() const;
  /// FSDP2's explicit prefetch: when unit `unit` (a module path from fsdp_modules()) runs
  /// forward / backward, gather `targets` too, in place of the implicit next / previous unit.
  void set_modules_to_forward_prefetch(const std::string& unit, const std::vector<std::string>& targets);
  void set_modules_to_backward_prefetch(const std::string& unit, const std::vector<std::string>& targets);

  /// SHARDED state dict: every original name -> this rank's 1-D piece of it (a flat slice
  /// of the flattened parameter, possibly empty), with owned_ranges() saying where.
  sdk::StateDict sharded_state_dict() const;
  /// The flat range [start, start + length) of each original parameter this rank owns.
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> owned_ranges() const;
  /// Loads pieces shaped like sharded_state_dict() for this rank's ranges (as produced by
  /// core::read_resharded_checkpoint from any world size).
  void load_sharded_state_dict(const sdk::StateDict& state);
  /// LOCAL state dict: each unit's flat fp32 shard, "<unit>.flat_param" ("flat_param" for the
  /// root), plus ignored parameters under their names. Loads only into the same world size
  /// and unit plan.
  sdk::StateDict local_state_dict() const;
  void load_local_state_dict(const sdk::StateDict& state);

  /// "name:numel" of every unit in order: what ranks compare before the first step.
  std::string plan() const;
  std::size_t num_units() const;
  /// Bytes of sharded state (master shards + sharded grads) on this rank.
  std::int64_t sharded_bytes() const;
  const FSDPOptions& options() const;

 private:
  /// The engine's state (the units, their layouts, the scheduler), private to the engine
  /// (core/src/fsdp/sharded_module_state.hpp): what a strategy compiles against stays this header.
  struct State;

  void build_units();
  FSDPUnit& unit_named(const std::string& name);
  void cast_buffers();
  /// A buffer as state dicts hold it: in its dtype from before buffer_dtype cast it.
  at::Tensor buffer_for_state(const std::string& name, const at::Tensor& buffer) const;
  sdk::GuardPtr summon_full_params_on_cpu(bool writeback, bool rank0_only);
  void attach_full_grads();
  bool is_global_rank0() const;
  at::TensorOptions fp32() const;

  std::unique_ptr<State> d_;
};

}  // namespace tessera::core::fsdp
