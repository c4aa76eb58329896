#pragma once
/// What a sharding strategy asks of the sharding core (PyTorch FSDP's constructor arguments).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>

#include "tessera/core/comm.hpp"
#include "tessera/sdk/options.hpp"
#include "tessera/sdk/precision.hpp"

namespace tessera::core::fsdp {

enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD };
enum class BackwardPrefetch { NONE, BACKWARD_PRE, BACKWARD_POST };

ShardingStrategy parse_sharding_strategy(const std::string& name);
/// [strategy] backward_prefetch, one vocabulary for fsdp and fsdp2: "BACKWARD_PRE" (default),
/// "BACKWARD_POST" or "none", or a boolean (true = BACKWARD_PRE, false = none), so a config
/// written for either strategy runs under the other.
BackwardPrefetch read_backward_prefetch(const sdk::Options& options);
/// Other [strategy] keys fsdp and fsdp2 share, documented once.
inline const sdk::Key kActivationCheckpointingKey{
    "activation_checkpointing", "unit classes whose activations are recomputed in backward instead of kept"};
inline const sdk::Key kRank0OnlyKey{"rank0_only", "full state dicts are gathered on rank 0 only (the others hold none)"};

/// Decides, per module path, whether a module becomes an FSDP unit (PyTorch's lambda /
/// CustomPolicy): the "custom" auto_wrap_policy.
using WrapPolicyFn = std::function<bool(const std::string& path, const torch::nn::Module& module)>;

/// How a unit's parameters are sharded: FSDP1's flat parameter (equal pieces of one flat
/// buffer) or FSDP2's per-parameter dim-0 shards (see flat_param.hpp, param_group.hpp).
enum class ParamLayout { flat, per_parameter };

struct FSDPOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  ParamLayout layout = ParamLayout::flat;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  bool forward_prefetch = false;
  /// PyTorch's limit_all_gathers (when > 0): at most this many units (the root aside) are
  /// gathered or gathering at once under a strategy that reshards after forward; a prefetch
  /// beyond it is dropped (the unit gathers when it runs). 2 = the running unit + one ahead.
  std::int64_t max_gathered_units = 0;
  /// "transformer": modules whose class name() is in unit_classes; "size": those of them with
  /// at least min_num_params parameters; "custom": modules for which custom_wrap_policy
  /// returns true; "none": the root is the only unit. Units are run through sdk::invoke.
  std::string auto_wrap_policy = "transformer";
  std::vector<std::string> unit_classes;
  std::int64_t min_num_params = 0;
  WrapPolicyFn custom_wrap_policy;
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
  /// Under deferred init with tensor parallelism: this rank's place in the tensor-parallel
  /// group, so that modules holding tensor-parallel pieces are initialised at full shape and
  /// cut as the eager plan cuts them (initialize_modules).
  std::int64_t tp_rank = 0, tp_size = 1;
  /// Where the network runs. Default: where its parameters are; under deferred init they are
  /// nowhere yet (the strategy sets it, and each unit is materialised there).
  c10::optional<c10::Device> device;
  /// The master shards, their gradients and so the optimizer state live in pinned CPU
  /// memory; units are copied to the device to be gathered and gradients copied back after
  /// their reduce-scatter. Nothing changes for CPU networks.
  bool cpu_offload = false;
  /// Free the sharded gradients after each optimizer step; the next step's first reduction
  /// allocates them again (torch's zero_grad(set_to_none=True)), so that forward, where
  /// activations peak, runs without them. Default (unset): on CUDA, whose caching allocator
  /// makes it free; on the CPU every step would page-fault its gradients in again.
  c10::optional<bool> free_sharded_grads;
  /// param_dtype: gather and compute; reduce_dtype: gradient reduction (and the optimizer's
  /// gradients with keep_low_precision_grads); buffer_dtype: floating buffers. BatchNorm
  /// modules stay out of it, as in PyTorch.
  sdk::MixedPrecisionPolicy mixed_precision;
  /// FSDP2's MixedPrecisionPolicy beside it: each unit's floating inputs cast to the dtype
  /// it computes in, and its floating outputs to output_dtype (when set).
  bool cast_forward_inputs = false;
  c10::optional<at::ScalarType> output_dtype;
  /// FSDP2's reshard_after_forward = k (under FULL_SHARD): after a training forward each rank
  /// keeps 1/k of a unit's gathered data (not its 1/N shard), and backward re-gathers it
  /// within this group: k consecutive ranks of the shard group (one node's, say), in order.
  /// Null: backward gathers over the whole shard group.
  CommunicatorPtr post_forward_group;
};

}  // namespace tessera::core::fsdp
