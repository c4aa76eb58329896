#pragma once
/// Flat-parameter fully sharded data parallelism (PyTorch FSDP1 semantics) over a
/// torch::nn::Module tree, without module hooks: each FSDP unit's parameters are views into
/// one padded flat buffer whose storage is gathered before the unit runs (through the
/// sdk::invoke seam) and freed after; gradients accumulate into a flat gradient buffer and
/// are reduce-scattered into the sharded gradient once the unit's backward is complete.
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "tessera/core/comm.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/guard.hpp"
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
  /// Modules (by path, e.g. "lm_head", or by class name) whose parameters stay unsharded and
  /// replicated on every rank; their gradients are all-reduced over the world.
  std::vector<std::string> ignored_modules;
  /// The network was built under deferred_init_guard(): initialise each unit when sharding it.
  bool deferred_init = false;
  /// Under deferred init: initialises one module's own tensors in place (sdk::Module::
  /// init_parameters); returning false (or unset) falls back to its reset_parameters().
  std::function<bool(const std::string& path, torch::nn::Module& module)> param_init_fn;
  /// Where the network runs. Default: where its parameters are; under deferred init they are
  /// nowhere yet (the strategy sets it, and each unit is materialised there).
  c10::optional<c10::Device> device;
  /// The master shards, their gradients and so the optimizer state live in pinned CPU
  /// memory; units are copied to the device to be gathered and gradients copied back after
  /// their reduce-scatter. Nothing changes for CPU networks.
  bool cpu_offload = false;
  /// param_dtype: gather and compute; reduce_dtype: gradient reduction (and the optimizer's
  /// gradients with keep_low_precision_grads); buffer_dtype: floating buffers. BatchNorm
  /// modules stay out of it, as in PyTorch.
  sdk::MixedPrecisionPolicy mixed_precision;
};

/// Where each tensor of a sharded state dict sits in its full tensor: name -> the flat
/// start of this rank's piece and the full shape (pieces are 1-D slices of the flattened
/// tensor). Saved in sharded checkpoints as kShardMetadataKey: {name: [start, ndim, dims...]}.
constexpr const char* kShardMetadataKey = "fsdp_shard_metadata";


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

  /// Gathers every unit so that the module's parameters hold their full values (PyTorch's
  /// summon_full_params) until the guard is destroyed. Collective. With `writeback`, changes
  /// made to the parameters are written back into the shards (only changed elements, so a
  /// param_dtype below fp32 does not round the master weights); `rank0_only` keeps the full
  /// values on rank 0 only (incompatible with writeback, as in PyTorch); `offload_to_cpu`
  /// (a no-op for CPU networks) keeps the full values in CPU memory, gathering one unit at a
  /// time on the GPU.
  sdk::GuardPtr summon_full_params(bool writeback = true, bool rank0_only = false, bool offload_to_cpu = false);
  /// Applies `fn` to every module of the network with full parameters, writing changes back
  /// into the shards (PyTorch's FullyShardedDataParallel.apply). Collective.
  void apply(const std::function<void(torch::nn::Module&)>& fn);
  /// The FSDP units' module paths in forward order, the root ("") last; `root_only`: the root.
  std::vector<std::string> fsdp_modules(bool root_only = false) const;

  /// SHARDED state dict: every original name -> this rank's 1-D piece of it (a flat slice
  /// of the flattened parameter, possibly empty), with shard_metadata() saying where.
  sdk::StateDict sharded_state_dict() const;
  /// {name: [start, ndim, dims...]} for the tensors of sharded_state_dict().
  c10::IValue shard_metadata() const;
  /// The flat range [start, start + length) of each original parameter this rank owns.
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> owned_ranges() const;
  /// Loads pieces shaped like sharded_state_dict() for this rank's ranges (as produced by
  /// read_resharded_checkpoint from any world size).
  void load_sharded_state_dict(const sdk::StateDict& state);
  /// LOCAL state dict: each unit's flat fp32 shard, "<unit>.flat_param" ("flat_param" for the
  /// root), plus ignored parameters under their names. Loads only into the same world size
  /// and unit plan.
  sdk::StateDict local_state_dict() const;
  void load_local_state_dict(const sdk::StateDict& state);

  /// Full optimizer state on rank 0 only -> every rank's shard (scatter_full_optim_state_dict):
  /// rank 0 broadcasts each tensor over the shard and replicate groups. Collective.
  void scatter_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full_on_rank0);
  /// Names of optimizer_parameters(), in order (what local optimizer state dicts are keyed by).
  std::vector<std::string> optimizer_parameter_names() const;

  /// "name:numel" of every unit in order: what ranks compare before the first step.
  std::string plan() const;
  std::size_t num_units() const;
  /// Bytes of sharded state (master shards + sharded grads) on this rank.
  std::int64_t sharded_bytes() const;

  // Called by the unit runners and hooks.
  enum class Phase { forward, backward, prefetch_forward, prefetch_backward };
  void unshard(FlatParamUnit& unit, Phase phase);
  void reshard(FlatParamUnit& unit);
  void attach_gradients(FlatParamUnit& unit);
  void on_gradient_ready(FlatParamUnit& unit);
  FlatParamUnit* previous_unit(const FlatParamUnit& unit) const;
  FlatParamUnit* next_unit(const FlatParamUnit& unit) const;
  void record_forward(FlatParamUnit& unit);
  const FSDPOptions& options() const { return options_; }
  bool training_step_active() const { return sync_ || accumulating_; }

 private:
  void plan_units();
  void flatten(FlatParamUnit& unit);
  void reduce_gradients(FlatParamUnit& unit);
  void finish_reduction(FlatParamUnit& unit);
  void check_plan();
  void check_plan_over(Communicator& group, const std::vector<std::string>& entries);
  void find_ignored();
  /// Whether `module` (at `path`) is named, by path or class, in options.ignored_modules.
  bool is_ignored_module(const std::string& path, const torch::nn::Module& module) const;
  void exempt_norm_layers();
  void cast_buffers();
  /// A buffer as state dicts hold it: in its dtype from before buffer_dtype cast it.
  at::Tensor buffer_for_state(const std::string& name, const at::Tensor& buffer) const;
  void materialize(FlatParamUnit& unit, at::Tensor& flat);
  void reduce_ignored_gradients();
  void install_gradient_hooks(FlatParamUnit& unit);
  sdk::GuardPtr summon_full_params_on_cpu(bool writeback, bool rank0_only);
  /// fp32 on the network's device (where collectives run).
  at::TensorOptions fp32() const;
  /// fp32 where the shards live: the network's device, or pinned CPU memory under cpu_offload.
  at::TensorOptions shard_options() const;

  std::shared_ptr<torch::nn::Module> network_;
  FSDPOptions options_;
  CommunicatorPtr shard_group_;
  CommunicatorPtr replicate_group_;
  std::vector<std::unique_ptr<FlatParamUnit>> units_;  // children in forward order, root last
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> unit_modules_;  // children only
  // Ignored (replicated) parameters: every name each has, and the tensor.
  std::vector<std::vector<std::string>> ignored_names_;
  std::vector<at::Tensor> ignored_params_;
  std::set<const void*> ignored_impls_;
  // BatchNorm modules, kept out of the mixed-precision policy (see exempt_norm_layers).
  std::vector<std::shared_ptr<torch::nn::Module>> norm_layers_;
  std::map<std::string, at::ScalarType> buffer_dtypes_;  // buffers cast to buffer_dtype: their own dtype
  bool summoned_ = false;
  bool recycle_buffers_ = false;
  bool offload_copies_pending_ = false;  // cpu_offload gradient copies launched, not waited for  // freed unit buffers go to the block pool (not while sharding)
  std::deque<FlatParamUnit*> reducing_;  // reductions launched and not finished, oldest first
  std::vector<FlatParamUnit*> order_;  // units in the first forward's execution order
  bool order_frozen_ = false;
  void freeze_order();
  c10::Device device_{c10::kCPU};
  bool sync_ = true;
  bool accumulating_ = false;
};

ShardingStrategy parse_sharding_strategy(const std::string& name);
BackwardPrefetch parse_backward_prefetch(const std::string& name);

/// Whether any parameter or buffer of `network` was created under deferred_init_guard()
/// and not materialised yet.
bool has_deferred_tensors(const torch::nn::Module& network);
/// model_sharded_context() under deferred init: while the guard lives, CPU allocations all
/// share one scratch block (the size of the largest tensor), so building a model costs about
/// one tensor. ShardedModule (with FSDPOptions::deferred_init) then gives each unit real
/// memory, re-initialises it with its LibTorch modules' reset_parameters() (Linear,
/// Embedding, LayerNorm, Conv1d-3d, BatchNorm1d-3d: the same values as an eager build with
/// the same seed when units come in construction order) and shards it before the next unit.
/// Other tensors made under the guard hold garbage; models whose parameters belong to other
/// module classes, or with buffers computed at construction, are refused with an error.
sdk::GuardPtr deferred_init_guard();

/// Reads a sharded checkpoint written by any world size (`shards` files through `io`) and
/// returns shard 0's entries with "state_dict" and "optimizer_states"[0] re-cut: with
/// `wanted` (name -> flat [start, length)), each tensor is that 1-D piece; without, each is
/// the whole tensor in its full shape (a full checkpoint, loadable by any strategy).
/// Reads one shard file at a time.
sdk::Checkpoint read_resharded_checkpoint(sdk::CheckpointIO& io, const std::string& path, std::int64_t shards,
                                          const std::map<std::string, std::pair<std::int64_t, std::int64_t>>* wanted);

}  // namespace tessera::core::fsdp
