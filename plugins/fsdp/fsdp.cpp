// The `fsdp` strategy: Lightning's FSDPStrategy over core::fsdp::ShardedModule (flat
// parameters, PyTorch FSDP1 semantics). TOML keys use PyTorch's/Lightning's names.
#include <filesystem>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/core/fsdp/wrap.hpp"
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::plugins {

namespace {

namespace fsdp = core::fsdp;

class FSDPStrategy : public core::StrategyBase {
 public:
  explicit FSDPStrategy(const sdk::Options& o, bool cpu_offload_default = false)
      : StrategyBase(o),
        sharding_strategy_(o.get_choice("sharding_strategy", "FULL_SHARD",
                                        {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})),
        hybrid_group_size_(o.get_int("hybrid_shard_group_size", 0, 0)),
        unit_classes_(o.get_string_list("transformer_layer_cls", {})),
        sync_module_states_(o.get_bool("sync_module_states", false)),
        cpu_offload_(o.get_bool("cpu_offload", cpu_offload_default)),
        deferred_init_(o.get_bool("deferred_init", false)),
        state_dict_type_(normalise_state_dict_type(o.get_choice(
            "state_dict_type", "full",
            {"full", "sharded", "local", "FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"}))),
        options_key_(o.locate("transformer_layer_cls")) {
    options_.auto_wrap_policy =
        o.get_choice("auto_wrap_policy", "transformer", {"transformer", "size", "custom", "none"});
    options_.min_num_params = o.get_int("min_num_params", 100000000, 0);
    options_.backward_prefetch = fsdp::parse_backward_prefetch(
        o.get_choice("backward_prefetch", "BACKWARD_PRE", {"BACKWARD_PRE", "BACKWARD_POST", "none"}));
    options_.forward_prefetch = o.get_bool("forward_prefetch", false);
    // The engine never has more than the unit in use plus one prefetched unit gathered, so
    // the limit of PyTorch's limit_all_gathers (two in flight) always holds; false changes nothing.
    o.get_bool("limit_all_gathers", true);
    options_.activation_checkpointing = o.get_string_list("activation_checkpointing", {});
    options_.reduce_every_micro_batch = o.get_bool("reduce_every_micro_batch", false);
    options_.rank0_only = o.get_bool("rank0_only", true);
    options_.ignored_modules = o.get_string_list("ignored_modules", {});
    TESSERA_CHECK(sharding_strategy_ == "HYBRID_SHARD" || hybrid_group_size_ == 0, o.locate("hybrid_shard_group_size"),
                  " applies to sharding_strategy = \"HYBRID_SHARD\" only");
    TESSERA_CHECK(!(deferred_init_ && sync_module_states_), o.locate("sync_module_states"),
                  ": sync_module_states = true with deferred_init = true: under deferred init every rank initialises ",
                  "the same values from the trainer seed, unit by unit; set one of them to false");
    TESSERA_CHECK(!(deferred_init_ && !options_.ignored_modules.empty()), o.locate("deferred_init"),
                  ": deferred_init = true cannot be combined with ignored_modules (ignored parameters are built whole)");
  }

  /// Under deferred_init the model is built on the meta device and materialised one unit
  /// at a time when the strategy shards it (Lightning's init_module(empty_init=True)).
  sdk::GuardPtr model_sharded_context() override {
    return deferred_init_ ? core::fsdp::deferred_init_guard() : nullptr;
  }

  /// The sharding engine (summon_full_params, apply, fsdp_modules, state dicts, ...).
  fsdp::ShardedModule& engine() {
    TESSERA_CHECK(engine_, "the fsdp strategy is used before setup()");
    return *engine_;
  }

  sdk::StepOutput training_step(const sdk::Batch& batch, std::int64_t batch_idx) override {
    engine_->begin_forward(/*training=*/true);
    return StrategyBase::training_step(batch, batch_idx);
  }
  sdk::StepOutput validation_step(const sdk::Batch& batch, std::int64_t batch_idx) override {
    engine_->begin_forward(false);
    sdk::StepOutput out = StrategyBase::validation_step(batch, batch_idx);
    engine_->end_forward();
    return out;
  }
  sdk::StepOutput test_step(const sdk::Batch& batch, std::int64_t batch_idx) override {
    engine_->begin_forward(false);
    sdk::StepOutput out = StrategyBase::test_step(batch, batch_idx);
    engine_->end_forward();
    return out;
  }
  at::Tensor predict_step(const sdk::Batch& batch, std::int64_t batch_idx) override {
    engine_->begin_forward(false);
    at::Tensor out = StrategyBase::predict_step(batch, batch_idx);
    engine_->end_forward();
    return out;
  }

  void backward(const at::Tensor& loss, bool sync_gradients) override {
    engine_->begin_backward(sync_gradients || options_.reduce_every_micro_batch);
    StrategyBase::backward(loss, sync_gradients);
    engine_->finish_backward();
  }

  double clip_grad_norm(double max_norm, double norm_type) override {
    return engine_->clip_grad_norm(max_norm, norm_type);
  }

  /// FULL (default): the whole model with original names (rank 0 only unless rank0_only =
  /// false); SHARDED: this rank's 1-D piece of every parameter; LOCAL: each unit's flat shard.
  sdk::StateDict lightning_module_state_dict() override {
    if (state_dict_type_ == "sharded") return engine().sharded_state_dict();
    if (state_dict_type_ == "local") return engine().local_state_dict();
    return engine().full_state_dict();
  }
  void load_model_state_dict(const sdk::StateDict& state, bool strict) override {
    if (loaded_ == "sharded") return engine().load_sharded_state_dict(state);
    if (loaded_ == "local") return engine().load_local_state_dict(state);
    engine().load_full_state_dict(state, strict);
  }
  /// FULL: PyTorch's full_optim_state_dict (full shapes, original names); SHARDED/LOCAL:
  /// this rank's optimizer state on its pieces, named after the original parameters.
  sdk::Checkpoint optimizer_state() override {
    if (state_dict_type_ != "full") return core::optimizer_state_dict(optimizer(), engine().optimizer_parameter_names());
    return engine().full_optim_state_dict(optimizer());
  }
  void load_optimizer_state(const sdk::Checkpoint& state) override {
    if (loaded_ != "full") return core::load_optimizer_state_dict(optimizer(), state, engine().optimizer_parameter_names());
    engine().load_full_optim_state_dict(optimizer(), state);
  }

  /// FULL: one file from rank 0. SHARDED/LOCAL: every rank writes its shard through the
  /// CheckpointIO (the "distributed" one), rank 0 publishes it once all are written.
  void save_checkpoint(const sdk::Checkpoint& checkpoint, const std::string& path) override {
    if (state_dict_type_ == "full") return StrategyBase::save_checkpoint(checkpoint, path);
    sdk::Checkpoint mine = checkpoint.copy();
    if (state_dict_type_ == "sharded") mine.insert(fsdp::kShardMetadataKey, engine().shard_metadata());
    mine.insert("fsdp_state_dict_type", state_dict_type_);
    sdk::ShardInfo shard{global_rank(), world_size(), true};
    checkpoint_io().save_checkpoint(mine, path, shard);
    barrier("sharded save_checkpoint");
    if (is_global_zero()) checkpoint_io().finalize_checkpoint(path, shard);
    barrier("sharded checkpoint published");
  }

  /// A full checkpoint loads as usual; a SHARDED one from any world size is re-cut to this
  /// rank's pieces (reading one shard file at a time); a LOCAL one needs the same world size.
  sdk::Checkpoint load_checkpoint(const std::string& path) override {
    loaded_ = "full";
    std::error_code ec;
    if (!std::filesystem::is_directory(path, ec)) return StrategyBase::load_checkpoint(path);
    sdk::CheckpointMetadata meta = checkpoint_io().read_metadata(path);
    if (!meta.sharded) return StrategyBase::load_checkpoint(path);
    if (state_dict_type_ == "local") {
      TESSERA_CHECK(meta.world_size == world_size(), "LOCAL checkpoint ", path, " was written by ", meta.world_size,
                    " ranks and loads only into as many (this job has ", world_size(),
                    "); save with [strategy] state_dict_type = \"sharded\" to reshard");
      loaded_ = "local";
      return checkpoint_io().load_checkpoint(path, sdk::ShardInfo{global_rank(), world_size(), true});
    }
    // This rank's flat range of each tensor; the module's own tensors keep their full shapes.
    std::map<std::string, std::vector<std::int64_t>> shapes;
    for (const auto& item : network_->named_parameters()) shapes.emplace(item.key(), item.value().sizes().vec());
    for (const auto& item : network_->named_buffers()) shapes.emplace(item.key(), item.value().sizes().vec());
    std::map<std::string, core::TensorPiece> wanted;
    for (const auto& [name, range] : engine().owned_ranges())
      wanted.emplace(name, core::TensorPiece::flat_range(shapes.at(name), range.first, range.second));
    sdk::Checkpoint out = core::read_resharded_checkpoint(checkpoint_io(), path, meta.world_size, wanted);
    loaded_ = "sharded";
    return out;
  }
  void teardown() override {
    engine_.reset();
    StrategyBase::teardown();
  }

 protected:
  void setup_module() override {
    const std::int64_t world = world_size();  // ranks in the job
    if (sync_module_states_) {
      torch::NoGradGuard no_grad;
      for (auto& p : network_->parameters()) broadcast(p, 0);
      for (auto& b : network_->buffers()) broadcast(b, 0);
    }
    options_.sharding_strategy = fsdp::parse_sharding_strategy(sharding_strategy_);
    options_.deferred_init = deferred_init_;
    options_.cpu_offload = cpu_offload_;
    options_.device = device_;
    options_.param_init_fn = [module = module_](const std::string& path, torch::nn::Module& m) {
      return module->init_parameters(path, m);
    };
    options_.mixed_precision = precision().mixed_precision_policy();
    options_.unit_classes = unit_classes_.empty() ? module_->fsdp_unit_classes() : unit_classes_;
    options_.custom_wrap_policy = [module = module_](const std::string& path, const torch::nn::Module& m) {
      return module->fsdp_wrap_policy(path, m);
    };
    check_unit_classes();

    std::int64_t shard_size = world;  // FULL_SHARD, SHARD_GRAD_OP
    if (options_.sharding_strategy == fsdp::ShardingStrategy::NO_SHARD) shard_size = 1;
    if (options_.sharding_strategy == fsdp::ShardingStrategy::HYBRID_SHARD) {
      shard_size = hybrid_group_size_ > 0 ? hybrid_group_size_ : cluster_.local_world_size;
      TESSERA_CHECK(world % shard_size == 0, "[strategy] hybrid_shard_group_size = ", shard_size,
                    " does not divide the world size ", world, "; choose a divisor of ", world);
    }
    std::vector<std::vector<std::int64_t>> shard_groups(world / shard_size), replicate_groups(shard_size);
    for (std::int64_t r = 0; r < world; ++r) {
      shard_groups[r / shard_size].push_back(r);
      replicate_groups[r % shard_size].push_back(r);
    }
    core::CommunicatorPtr shard = world == 1 ? world_ : world_->split(shard_groups);
    core::CommunicatorPtr replicate = world == 1 ? world_ : world_->split(replicate_groups);
    engine_ = std::make_unique<fsdp::ShardedModule>(network_, options_, shard, replicate);
  }

  std::vector<sdk::NamedParameter> optimizer_parameters() override { return engine_->optimizer_parameters(); }
  // The optimizer's gradients are views of the flat sharded gradient: zero that in place.
  void zero_grad() override { engine_->after_optimizer_step(); }

 private:
  void check_unit_classes() const {
    if (options_.auto_wrap_policy == "transformer" || options_.auto_wrap_policy == "size") {
      const std::string problem = fsdp::unit_class_problem(*network_, options_.unit_classes);
      TESSERA_CHECK(problem.empty(), options_key_, ": ", problem);
    }
    for (const auto& cls : options_.activation_checkpointing)
      TESSERA_CHECK(options_.auto_wrap_policy == "custom" ||std::find(options_.unit_classes.begin(), options_.unit_classes.end(), cls) !=
                        options_.unit_classes.end(),
                    "[strategy] activation_checkpointing names '", cls,
                    "', which is not an FSDP unit class; valid: ", sdk::join(options_.unit_classes));
  }

  static std::string normalise_state_dict_type(const std::string& name) {
    if (name == "FULL_STATE_DICT") return "full";
    if (name == "SHARDED_STATE_DICT") return "sharded";
    if (name == "LOCAL_STATE_DICT") return "local";
    return name;
  }

  fsdp::FSDPOptions options_;
  std::string sharding_strategy_;
  std::int64_t hybrid_group_size_;
  std::vector<std::string> unit_classes_;
  bool sync_module_states_;
  bool cpu_offload_;
  bool deferred_init_;
  std::string state_dict_type_;  // full | sharded | local
  std::string loaded_ = "full";  // the form of the state the last load_checkpoint returned
  std::string options_key_;
  std::unique_ptr<fsdp::ShardedModule> engine_;
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
