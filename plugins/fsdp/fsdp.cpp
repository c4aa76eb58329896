// The `fsdp` strategy: Lightning's FSDPStrategy over core::fsdp::ShardedModule (flat
// parameters, PyTorch FSDP1 semantics). TOML keys use PyTorch's/Lightning's names.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "tessera/core/device_mesh.hpp"
#include "tessera/core/fsdp/sharded_strategy.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::plugins {

namespace {

namespace fsdp = core::fsdp;

class FSDPStrategy : public fsdp::ShardedStrategy {
 public:
  explicit FSDPStrategy(const sdk::Options& o, bool cpu_offload_default = false)
      : ShardedStrategy(o),
        sharding_strategy_(o.get_choice(
            {"sharding_strategy",
             "what is sharded: parameters, gradients and optimizer state (FULL_SHARD), gradients and state only "
             "(SHARD_GRAD_OP), nothing (NO_SHARD), or full within groups, replicated across (HYBRID_SHARD)"},
            "FULL_SHARD", {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})),
        hybrid_group_size_(
            o.get_int({"hybrid_shard_group_size",
                       "HYBRID_SHARD's shard group size (ranks per replica); 0: the local ranks of one host"},
                      0, 0)),
        sync_module_states_(
            o.get_bool({"sync_module_states", "broadcast rank 0's parameters and buffers before sharding"}, false)),
        options_key_(o.locate("transformer_layer_cls")) {
    options_.unit_classes = o.get_string_list(
        {"transformer_layer_cls", "module class names that become FSDP units (the transformer policy's layer classes)"},
        {});
    options_.cpu_offload = o.get_bool({"cpu_offload",
                                       "pinned CPU master shards, gradients and optimizer state on CUDA (refused on "
                                       "the CPU, where it would do nothing)"},
                                      cpu_offload_default);
    options_.auto_wrap_policy = o.get_choice({"auto_wrap_policy",
                                              "which modules become units: the transformer_layer_cls classes, those of "
                                              "them above min_num_params, the model's own policy, or the root only"},
                                             "transformer", {"transformer", "size", "custom", "none"});
    options_.min_num_params = o.get_int(
        {"min_num_params", "the size policy's threshold: a module with at least this many parameters becomes a unit"},
        100000000, 0);
    options_.backward_prefetch = fsdp::read_backward_prefetch(o);
    options_.forward_prefetch = o.get_bool(
        {"forward_prefetch", "PyTorch FSDP's forward_prefetch: gather the next unit during this unit's forward"},
        false);
    // PyTorch's rate limiter: the running unit and one prefetched unit at most (counted by
    // the scheduler; a prefetch beyond it waits until its unit runs).
    options_.max_gathered_units = o.get_bool({"limit_all_gathers",
                                              "a prefetch waits while two units are gathered already (the running one "
                                              "and one ahead); false never holds one back"},
                                             true)
                                      ? 2
                                      : 0;
    options_.activation_checkpointing = o.get_string_list(fsdp::kActivationCheckpointingKey, {});
    reduce_every_micro_batch_ =
        o.get_bool({"reduce_every_micro_batch",
                    "reduce-scatter gradients after every micro-batch instead of once per optimizer step"},
                   false);
    options_.rank0_only = o.get_bool(fsdp::kRank0OnlyKey, true);
    options_.ignored_modules = o.get_string_list(
        {"ignored_modules",
         "module paths or class names whose parameters stay unsharded and replicated (gradients all-reduced)"},
        {});
    options_.sharding_strategy = fsdp::parse_sharding_strategy(sharding_strategy_);
    if (options_.cpu_offload)
      refuse_offload_on_cpu(o.has("cpu_offload") ? o.locate("cpu_offload") + " = true"
                                                 : std::string("[strategy] plugin = \"fsdp_cpu_offload\" (use \"fsdp\")"));
    TESSERA_CHECK(sharding_strategy_ == "HYBRID_SHARD" || hybrid_group_size_ == 0, o.locate("hybrid_shard_group_size"),
                  " applies to sharding_strategy = \"HYBRID_SHARD\" only");
    TESSERA_CHECK(!(deferred_init_ && sync_module_states_), o.locate("sync_module_states"),
                  ": sync_module_states = true with deferred_init = true: under deferred init every rank initialises ",
                  "the same values from the trainer seed, unit by unit; set one of them to false");
    TESSERA_CHECK(!(deferred_init_ && !options_.ignored_modules.empty()), o.locate("deferred_init"),
                  ": deferred_init = true cannot be combined with ignored_modules (ignored parameters are built whole)");
  }

 protected:
  PlannedMesh planned_mesh(const sdk::ClusterInfo& cluster) const override {
    const std::int64_t world = cluster.world_size;
    PlannedMesh mesh;
    if (sharding_strategy_ == "NO_SHARD") {
      mesh.replicate = world;
    } else if (sharding_strategy_ == "HYBRID_SHARD") {
      mesh.shard = hybrid_group_size_ > 0 ? hybrid_group_size_ : cluster.local_world_size;
      TESSERA_CHECK(mesh.shard >= 1 && world % mesh.shard == 0, "[strategy] hybrid_shard_group_size = ", mesh.shard,
                    " does not divide the world size ", world, "; choose a divisor of ", world);
      mesh.replicate = world / mesh.shard;
    } else {
      mesh.shard = world;
    }
    return mesh;
  }
  fsdp::FSDPOptions planned_options(const sdk::MixedPrecisionPolicy& policy) const override {
    fsdp::FSDPOptions options = options_;
    options.mixed_precision = policy;
    return options;
  }
  std::string strategy_name() const override { return "fsdp"; }

  void setup_module() override {
    if (sync_module_states_) {
      torch::NoGradGuard no_grad;
      for (auto& p : network_->parameters()) broadcast(p, 0);
      for (auto& b : network_->buffers()) broadcast(b, 0);
    }
    fill_common_options(options_);
    check_unit_classes(options_, options_key_);
    std::int64_t shard_size = 0;
    if (options_.sharding_strategy == fsdp::ShardingStrategy::HYBRID_SHARD) {
      shard_size = hybrid_group_size_ > 0 ? hybrid_group_size_ : cluster_.local_world_size;
      TESSERA_CHECK(world_size() % shard_size == 0, "[strategy] hybrid_shard_group_size = ", shard_size,
                    " does not divide the world size ", world_size(), "; choose a divisor of ", world_size());
    }
    // Sharding strategies are (replicate, shard) mesh shapes.
    core::DeviceMesh mesh = core::fsdp_mesh(world_, sharding_strategy_, shard_size);
    engine_ = std::make_unique<fsdp::ShardedModule>(network_, options_, mesh.group("shard"), mesh.group("replicate"));
  }

 private:
  fsdp::FSDPOptions options_;
  std::string sharding_strategy_;
  std::int64_t hybrid_group_size_;
  bool sync_module_states_;
  std::string options_key_;
};

/// Lightning registers "fsdp_cpu_offload" beside "fsdp": the same strategy, offload on.
class FSDPCPUOffloadStrategy final : public FSDPStrategy {
 public:
  explicit FSDPCPUOffloadStrategy(const sdk::Options& o) : FSDPStrategy(o, /*cpu_offload_default=*/true) {}
};

}  // namespace

}  // namespace tessera::plugins

TESSERA_PLUGIN(strategy, TESSERA_VERSION,
               tessera::sdk::plugin_entry<tessera::plugins::FSDPStrategy>(
                   "fsdp", "FullyShardedDataParallel: flat-parameter sharding (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
                           "HYBRID_SHARD)"),
               tessera::sdk::plugin_entry<tessera::plugins::FSDPCPUOffloadStrategy>(
                   "fsdp_cpu_offload", "fsdp with parameters and gradients offloaded to the CPU"));
