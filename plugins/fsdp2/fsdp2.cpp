// The `fsdp2` strategy: NeMo's FSDP2Strategy over core::fsdp::ShardedModule with the
// per-parameter layout (PyTorch's fully_shard): every parameter sharded on dim 0 over the
// "shard" dimension of a (replicate, shard, tp) device mesh. TOML keys use NeMo's names.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/clip_grad.hpp"
#include "tessera/core/deferred_init.hpp"
#include "tessera/core/device_mesh.hpp"
#include "tessera/core/precision_base.hpp"
#include "tessera/core/tensor_piece.hpp"
#include "tessera/core/fsdp/sharded_strategy.hpp"
#include "tessera/core/tp_group.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/strategy_checks.hpp"
#include "tessera/sdk/tensor_parallel.hpp"

namespace tessera::plugins {

namespace {

namespace fsdp = core::fsdp;

/// An integer key that may also be the string "auto" (or absent): -1 for auto.
std::int64_t int_or_auto(const sdk::Options& o, const sdk::Key& key) {
  o.mark_used(key.name);
  o.note_key(key, "auto");
  const sdk::Value value = o.value(key.name);
  if (value.absent() || (value.is<std::string>() && value.as<std::string>() == "auto")) return -1;
  TESSERA_CHECK(value.is<std::int64_t>() && value.as<std::int64_t>() >= 1, o.locate(key.name),
                " must be \"auto\" or a positive integer");
  return value.as<std::int64_t>();
}

class FSDP2Strategy final : public fsdp::ShardedStrategy, public sdk::StrategyChecks {
 public:
  explicit FSDP2Strategy(const sdk::Options& o)
      : ShardedStrategy(o),
        dp_size_(int_or_auto(
            o, {"data_parallel_size", "ranks each parameter is sharded over; auto: world / (tp x replicate)"})),
        tp_size_(int_or_auto(o, {"tensor_parallel_size",
                                 "ranks each tensor-parallel layer is split over (the model's parallelize); auto: 1"})),
        replicate_size_(
            o.get_int({"data_parallel_replicate_size",
                       "HSDP: replicas of the sharded model (each shards over world / (replicate x tp) ranks)"},
                      1, 1)),
        sizes_key_(o.locate("data_parallel_size")),
        unit_key_(o.locate("transformer_layer_cls")) {
    options_.layout = fsdp::ParamLayout::per_parameter;
    defer_optimizer_restore_ = true;  // NeMo: the optimizer state is restored at the first step
    options_.unit_classes =
        o.get_string_list({"transformer_layer_cls", "module class names that become fully_shard units"}, {});
    options_.auto_wrap_policy = o.get_choice({"parallelize_fn",
                                              "which modules are fully_shard units: the transformer_layer_cls classes, "
                                              "the model's own policy, or the root only"},
                                             "transformer", {"transformer", "custom", "none"});
    options_.activation_checkpointing = o.get_string_list(fsdp::kActivationCheckpointingKey, {});
    options_.rank0_only = o.get_bool(fsdp::kRank0OnlyKey, true);
    options_.cpu_offload = o.get_choice({"offload_policy",
                                         "cpu: FSDP2's CPUOffloadPolicy (shards, gradients and optimizer state in "
                                         "pinned host memory; refused on the CPU)"},
                                        "none", {"none", "cpu"}) == "cpu";
    if (options_.cpu_offload) refuse_offload_on_cpu(o.locate("offload_policy") + " = \"cpu\"");
    // FSDP2 prefetches the next unit's all-gather in forward and the previous one in backward
    // (backward_prefetch: the same vocabulary as fsdp's).
    options_.forward_prefetch =
        o.get_bool({"forward_prefetch", "gather the next unit during this unit's forward"}, true);
    options_.backward_prefetch = fsdp::read_backward_prefetch(o);
    reshard_after_forward(o);
    mixed_precision(o.sub_table("mp_policy"));
    prefetch_lists(o,
                   {"modules_to_forward_prefetch",
                    "a table: unit path = [unit paths] whose parameters that unit's forward gathers ahead "
                    "(FSDP2's set_modules_to_forward_prefetch), instead of forward_prefetch's next unit"},
                   forward_prefetch_);
    prefetch_lists(o,
                   {"modules_to_backward_prefetch",
                    "a table: unit path = [unit paths] whose parameters that unit's backward gathers ahead "
                    "(set_modules_to_backward_prefetch), instead of backward_prefetch's choice"},
                   backward_prefetch_);
  }

  /// The mesh sizes must multiply to the world size (checked before any rank starts too).
  void check_world_size(std::int64_t world_size, const std::string& /*environment*/) const override {
    shard_size(world_size);
  }

  /// Builds the (replicate, shard, tp) mesh, before the model exists.
  void setup_environment(const sdk::ClusterInfo& cluster) override {
    ShardedStrategy::setup_environment(cluster);
    const std::int64_t dp = shard_size(world_size());
    if (reshard_size_ == 1) options_.sharding_strategy = fsdp::ShardingStrategy::SHARD_GRAD_OP;
    mesh_ = std::make_unique<core::DeviceMesh>(world_, std::vector<std::int64_t>{replicate_size_, dp, tp_size()},
                                               std::vector<std::string>{"replicate", "shard", "tp"});
  }

  /// Sampling over the data-parallel ranks only: tp ranks of one (replicate, shard)
  /// coordinate see the same batch.
  sdk::DataLoaderSpec process_dataloader(sdk::DataLoaderSpec spec) override {
    spec.num_replicas = mesh().size("replicate") * mesh().size("shard");
    spec.rank = mesh().rank("replicate") * mesh().size("shard") + mesh().rank("shard");
    return spec;
  }

  const core::DeviceMesh& mesh() const {
    TESSERA_CHECK(mesh_, "the fsdp2 strategy is used before setup_environment()");
    return *mesh_;
  }

 protected:
  /// What one tp rank holds: the model's tensor-parallel plan applied over a group that
  /// communicates nothing, so that the plan lays out, and traces, a rank's pieces.
  sdk::MemoryLayout planned_layout(sdk::Module& module, const sdk::ClusterInfo& cluster,
                                   std::int64_t micro_batches) override {
    const PlannedMesh mesh = planned_mesh(cluster);
    if (mesh.tp == 1) return ShardedStrategy::planned_layout(module, cluster, micro_batches);
    // An eager build holds the whole unsplit model before the plan cuts it.
    std::shared_ptr<torch::nn::Module> network = module.network();
    double unsplit = 0;
    if (network && !core::has_deferred_tensors(*network))
      for (const auto& p : network->parameters()) unsplit += static_cast<double>(p.numel() * p.element_size());
    parallelize(module, core::make_planning_tensor_parallel_group(mesh.tp), 0, mesh.replicate * mesh.shard);
    sdk::MemoryLayout layout = ShardedStrategy::planned_layout(module, cluster, micro_batches);
    layout.setup_bytes = std::max(layout.setup_bytes, unsplit);
    return layout;
  }

  PlannedMesh planned_mesh(const sdk::ClusterInfo& cluster) const override {
    PlannedMesh mesh;
    mesh.shard = shard_size(cluster.world_size);
    mesh.replicate = replicate_size_;
    mesh.tp = tp_size();
    if (reshard_size_ > 1 && reshard_size_ < mesh.shard) mesh.reshard_group = reshard_size_;
    return mesh;
  }
  fsdp::FSDPOptions planned_options(const sdk::MixedPrecisionPolicy& policy) const override {
    fsdp::FSDPOptions options = options_;
    options.mixed_precision = policy;
    if (param_dtype_) options.mixed_precision.param_dtype = param_dtype_;
    if (reduce_dtype_) options.mixed_precision.reduce_dtype = reduce_dtype_;
    if (reshard_size_ == 1) options.sharding_strategy = fsdp::ShardingStrategy::SHARD_GRAD_OP;
    return options;
  }
  std::string strategy_name() const override { return "fsdp2"; }

  /// NeMo's parallelize(): the model's tensor-parallel plan on the "tp" dimension, then
  /// fully_shard of its units and the root on "shard" (and "replicate"). Applied once, in setup.
  void setup_module() override {
    if (mesh().size("tp") > 1) {
      tp_ = core::make_tensor_parallel_group(mesh().group("tp"));
      parallelize(*module_, tp_, mesh().rank("replicate") * mesh().size("shard") + mesh().rank("shard"),
                  mesh().size("replicate") * mesh().size("shard"));
      options_.tp_rank = tp_->rank();
      options_.tp_size = tp_->size();
      placements_ = sdk::tensor_parallel_placements(*network_);
      // Full state dicts are gathered on every rank, then unsharded over tp (collective).
      rank0_only_ = options_.rank0_only;
      options_.rank0_only = false;
    }
    if (reshard_size_ > 1 && reshard_size_ < mesh().size("shard")) options_.post_forward_group = post_forward_group();
    fill_common_options(options_);
    if (param_dtype_) options_.mixed_precision.param_dtype = param_dtype_;
    if (reduce_dtype_) options_.mixed_precision.reduce_dtype = reduce_dtype_;
    check_unit_classes(options_, unit_key_);
    engine_ = std::make_unique<fsdp::ShardedModule>(network_, options_, mesh().group("shard"), mesh().group("replicate"));
    for (const auto& [unit, targets] : forward_prefetch_) engine_->set_modules_to_forward_prefetch(unit, targets);
    for (const auto& [unit, targets] : backward_prefetch_) engine_->set_modules_to_backward_prefetch(unit, targets);
  }

 public:
  // With tensor parallelism the pieces of a TP-split parameter differ across tp ranks: full
  // state dicts and optimizer state are unsharded over tp after the engine gathered them over
  // dp, and cut again on load; gradient norms are summed over tp for those pieces only.
  // A SHARDED state dict keeps each rank's pieces: owned_pieces() says where they sit in the
  // full tensors.
  sdk::StateDict lightning_module_state_dict() override {
    sdk::StateDict state = ShardedStrategy::lightning_module_state_dict();
    if (!tp_ || state_dict_type_ != "full") return state;
    for (const auto& [name, placement] : placements_)
      if (at::Tensor* t = state.find(name)) *t = sdk::tensor_parallel_unshard(*t, placement, *tp_);
    return rank0_only_ && !is_global_zero() ? sdk::StateDict() : state;
  }
  void load_model_state_dict(const sdk::StateDict& state, bool strict) override {
    if (!tp_ || loaded_sharded()) return ShardedStrategy::load_model_state_dict(state, strict);
    sdk::StateDict local = state;
    for (const auto& [name, placement] : placements_)
      if (at::Tensor* t = local.find(name)) *t = sdk::tensor_parallel_shard(*t, placement, tp_->rank(), tp_->size());
    ShardedStrategy::load_model_state_dict(local, strict);
  }
  sdk::Checkpoint optimizer_state() override {
    sdk::Checkpoint state = ShardedStrategy::optimizer_state();
    return tp_ && state_dict_type_ == "full" ? map_tp_moments(state, /*unshard=*/true) : state;
  }
  void load_optimizer_state(const sdk::Checkpoint& state) override {
    ShardedStrategy::load_optimizer_state(tp_ && !loaded_sharded() ? map_tp_moments(state, /*unshard=*/false) : state);
  }
  /// Under tensor parallelism a rank's flat range of its piece of a split parameter is, in the
  /// full parameter, one box per run of rows within one of the placement's `stride` parts (a
  /// fused q/k/v weight: up to three), stacked along dim 0 as the range holds them.
  std::map<std::string, core::StackedPieces> owned_pieces() override {
    std::map<std::string, core::StackedPieces> pieces = ShardedStrategy::owned_pieces();
    if (!tp_) return pieces;
    for (auto& [name, stack] : pieces)
      if (auto it = placements_.find(name); it != placements_.end()) stack = full_tensor_boxes(name, stack.at(0), it->second);
    return pieces;
  }
  double clip_grad_norm(double max_norm, double norm_type) override {
    if (!tp_) return ShardedStrategy::clip_grad_norm(max_norm, norm_type);
    const std::vector<std::string> names = engine().replicated_parameter_names();
    const std::set<std::string> replicated(names.begin(), names.end());
    std::vector<at::Tensor> sharded, split, whole;
    for (const auto& p : engine().optimizer_parameters())
      (replicated.count(p.name) ? whole : placements_.count(p.name) ? split : sharded).push_back(p.tensor.grad());
    core::Communicator& tp_group = *mesh().group("tp");
    return core::clip_grad_norm(sharded, split, whole, max_norm, norm_type, mesh().group("shard").get(), &tp_group,
                                device_);
  }

 private:
  /// The model's tensor-parallel plan over `tp` (NeMo's parallelize_fn, its first half).
  static void parallelize(sdk::Module& module, std::shared_ptr<sdk::TensorParallelGroup> tp, std::int64_t dp_rank,
                          std::int64_t dp_size) {
    sdk::ParallelContext context;
    context.tp = std::move(tp);
    context.dp_rank = dp_rank;
    context.dp_size = dp_size;
    // Under deferred init the plan cuts deferred full weights: its pieces stay deferred (no
    // rank holds the model), and each unit draws its full values when it is sharded.
    std::shared_ptr<torch::nn::Module> network = module.network();
    sdk::GuardPtr deferred =
        network && core::has_deferred_tensors(*network) ? core::resume_deferred_init_guard() : nullptr;
    module.parallelize(context);
  }

  /// The optimizer state's moments of TP-split parameters, unsharded over tp (collective, in
  /// the same name order on every rank) or cut to this rank's piece.
  sdk::Checkpoint map_tp_moments(const sdk::Checkpoint& saved, bool unshard) {
    return core::map_optimizer_moments(saved, [&](const std::string& name, const at::Tensor& moment) {
      auto it = placements_.find(name);
      if (it == placements_.end() || moment.dim() == 0) return moment;
      return unshard ? sdk::tensor_parallel_unshard(moment, it->second, *tp_)
                     : sdk::tensor_parallel_shard(moment, it->second, tp_->rank(), tp_->size());
    });
  }

  /// `owned` (a flat range of whole dim-0 rows of this rank's tp piece, as fully_shard shards
  /// it) as boxes of the full parameter.
  core::StackedPieces full_tensor_boxes(const std::string& name, const core::TensorPiece& owned,
                                        sdk::TensorParallelPlacement placement) const {
    const std::vector<std::int64_t>& piece = owned.global_shape;  // this rank's tp piece
    std::vector<std::int64_t> full = piece;
    full.at(placement.dim) *= tp_->size();
    std::int64_t row = 1;
    for (std::size_t d = 1; d < piece.size(); ++d) row *= piece[d];
    if (owned.numel() == 0 || row == 0) return {core::TensorPiece::flat_range(full, 0, 0)};
    TESSERA_CHECK(owned.offsets[0] % row == 0 && owned.lengths[0] % row == 0, "parameter '", name,
                  "': its shard is not whole rows of its tensor-parallel piece");
    const std::int64_t a = owned.offsets[0] / row, b = a + owned.lengths[0] / row;
    std::vector<std::int64_t> offsets(piece.size(), 0), lengths = piece;
    if (placement.dim != 0) {
      TESSERA_CHECK(placement.stride == 1, "parameter '", name, "': a strided tensor-parallel split on dim ",
                    placement.dim, " cannot be saved sharded");
      offsets[0] = a;
      lengths[0] = b - a;
      offsets[placement.dim] = tp_->rank() * piece[placement.dim];
      return {core::TensorPiece::box(full, offsets, lengths)};
    }
    const std::int64_t part = piece[0] / placement.stride;  // rows of one stride part in the piece
    core::StackedPieces boxes;
    for (std::int64_t p = a / part; p * part < b; ++p) {
      const std::int64_t lo = std::max(a, p * part), hi = std::min(b, (p + 1) * part);
      offsets[0] = p * part * tp_->size() + tp_->rank() * part + (lo - p * part);
      lengths[0] = hi - lo;
      boxes.push_back(core::TensorPiece::box(full, offsets, lengths));
    }
    return boxes;
  }

  /// true, false or an int k (checked against the mesh in setup_environment).
  void reshard_after_forward(const sdk::Options& o) {
    const std::string key = "reshard_after_forward";
    o.mark_used(key);
    reshard_key_ = o.locate(key);
    const sdk::Value value = o.value(key);
    o.note_key({key,
                "true: free gathered parameters after forward; false: keep them for backward; k: keep 1/k (an int "
                "dividing the shard size), backward gathers within k ranks"},
               true);
    TESSERA_CHECK(value.absent() || value.is<bool>() || value.is<std::int64_t>(), reshard_key_,
                  " must be true (free the gathered parameters after forward), false (keep them until backward) ",
                  "or an integer k (keep 1/k of them, gathered within k ranks in backward)");
    if (value.is<std::int64_t>()) {
      reshard_size_ = value.as<std::int64_t>();
      TESSERA_CHECK(reshard_size_ >= 1, reshard_key_, " = ", reshard_size_, " must be a positive group size, ",
                    "true or false");
    }
    const bool reshard = !value.is<bool>() || value.as<bool>();
    options_.sharding_strategy = reshard ? fsdp::ShardingStrategy::FULL_SHARD : fsdp::ShardingStrategy::SHARD_GRAD_OP;
  }

  std::int64_t tp_size() const { return tp_size_ > 0 ? tp_size_ : 1; }

  /// The data-parallel shard size on `world` ranks; throws, naming the keys and what would be
  /// valid, when the sizes do not fit the world or each other. reshard_after_forward = k must
  /// divide the shard size; k = dp is `true` and k = 1 is `false` (every rank keeps all of it);
  /// otherwise backward gathers within groups of k consecutive shard ranks (PyTorch's
  /// post-forward mesh).
  std::int64_t shard_size(std::int64_t world) const {
    const std::int64_t tp = tp_size();
    TESSERA_CHECK(world % (tp * replicate_size_) == 0, sizes_key_, ": tensor_parallel_size ", tp,
                  " x data_parallel_replicate_size ", replicate_size_, " does not divide the world size ", world);
    const std::int64_t dp = dp_size_ > 0 ? dp_size_ : world / (tp * replicate_size_);
    TESSERA_CHECK(replicate_size_ * dp * tp == world, sizes_key_, ": data_parallel_replicate_size ", replicate_size_,
                  " x data_parallel_size ", dp, " x tensor_parallel_size ", tp, " = ", replicate_size_ * dp * tp,
                  " ranks, but the job has ", world, "; valid: sizes whose product is ", world,
                  " (\"auto\" derives one from the others)");
    TESSERA_CHECK(reshard_size_ == 0 || dp % reshard_size_ == 0, reshard_key_, " = ", reshard_size_,
                  " must divide the data-parallel shard size ", dp, "; valid: ", divisors(dp),
                  dp > 1 ? " (" + std::to_string(dp) + " is the same as true, 1 the same as false)"
                         : std::string(" (one shard rank: nothing to reshard)"));
    TESSERA_CHECK(tp == 1 || state_dict_type_ != "local", sizes_key_, ": tensor_parallel_size = ", tp,
                  " saves full or sharded checkpoints; set state_dict_type = \"full\" or \"sharded\"");
    return dp;
  }

  static std::string divisors(std::int64_t n) {
    std::string out;
    for (std::int64_t d = 1; d <= n; ++d)
      if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
    return out;
  }

  /// The groups of k consecutive shard ranks at each (replicate, tp) coordinate.
  core::CommunicatorPtr post_forward_group() {
    const std::int64_t k = reshard_size_;
    std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, std::vector<std::int64_t>> groups;
    for (std::int64_t r = 0; r < mesh().size("replicate"); ++r)
      for (std::int64_t s = 0; s < mesh().size("shard"); ++s)
        for (std::int64_t t = 0; t < mesh().size("tp"); ++t) groups[{r, s / k, t}].push_back(mesh().world_rank_at({r, s, t}));
    std::vector<std::vector<std::int64_t>> partition;
    for (auto& [coordinate, ranks] : groups) partition.push_back(std::move(ranks));
    return mesh().world()->split(partition);
  }

  /// mp_policy: param_dtype, reduce_dtype, output_dtype, cast_forward_inputs; the
  /// precision plugin's policy where a key is absent.
  void mixed_precision(const sdk::Options& mp) {
    param_dtype_ = core::read_policy_dtype(mp, {"param_dtype",
                                                "FSDP2's MixedPrecisionPolicy: the dtype parameters are gathered "
                                                "and computed in; \"\": the precision plugin's"});
    reduce_dtype_ = core::read_policy_dtype(
        mp, {"reduce_dtype", "the dtype gradients are reduced in; \"\": the precision plugin's"});
    options_.output_dtype = core::read_policy_dtype(
        mp, {"output_dtype", "each unit's floating outputs cast to it; \"\": left as computed"});
    options_.cast_forward_inputs =
        mp.get_bool({"cast_forward_inputs", "cast each unit's floating inputs to the dtype it computes in"}, true);
    mp.check_all_used();
  }

  /// A [strategy.<key>] table of unit path = [unit paths]; listed by tessera config as the table
  /// it is (its keys are the model's unit paths).
  void prefetch_lists(const sdk::Options& o, const sdk::Key& key,
                      std::map<std::string, std::vector<std::string>>& out) {
    const sdk::Options table = o.sub_table(key.name);
    o.note_key(key, std::map<std::string, sdk::Value>{});
    for (const std::string& unit : table.keys()) out[unit] = table.get_string_list(unit, {});
  }

  fsdp::FSDPOptions options_;
  std::int64_t dp_size_, tp_size_, replicate_size_;
  std::string sizes_key_, unit_key_, reshard_key_;
  std::int64_t reshard_size_ = 0;  // reshard_after_forward = k; 0: a bool
  c10::optional<at::ScalarType> param_dtype_, reduce_dtype_;
  std::map<std::string, std::vector<std::string>> forward_prefetch_, backward_prefetch_;
  std::unique_ptr<core::DeviceMesh> mesh_;
  std::shared_ptr<sdk::TensorParallelGroup> tp_;  // null without tensor parallelism
  std::map<std::string, sdk::TensorParallelPlacement> placements_;
  bool rank0_only_ = true;
};

}  // namespace

}  // namespace tessera::plugins

TESSERA_PLUGIN(strategy, TESSERA_VERSION,
               tessera::sdk::plugin_entry<tessera::plugins::FSDP2Strategy>(
                   "fsdp2", "fully_shard: per-parameter sharding on a (replicate, shard, tp) device mesh (NeMo's "
                            "FSDP2Strategy)"));
