#include "tessera/core/fsdp/sharded_strategy.hpp"

#include <algorithm>
#include <filesystem>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "checkpoint/dcp.hpp"
#include "fsdp/memory_plan.hpp"
#include "fsdp/wrap.hpp"
#include "tessera/sdk/checkpoint_io_features.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core::fsdp {

namespace {
std::string normalise_state_dict_type(const std::string& name) {
  if (name == "FULL_STATE_DICT") return "full";
  if (name == "SHARDED_STATE_DICT") return "sharded";
  if (name == "LOCAL_STATE_DICT") return "local";
  return name;
}
}  // namespace

ShardedStrategy::ShardedStrategy(const sdk::Options& o)
    : StrategyBase(o),
      deferred_init_(
          o.get_bool({"deferred_init",
                      "build the model unit by unit on each rank's device, never whole (PyTorch's meta-device init)"},
                     false)),
      state_dict_type_(normalise_state_dict_type(o.get_choice(
          {"state_dict_type",
           "what checkpoints hold: the full state dict, each rank's shards (sharded, DCP-like) or local flat shards; "
           "sharded and local need [checkpoint_io] plugin = \"distributed\""},
          "full", {"full", "sharded", "local", "FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"}))),
      state_dict_type_key_(o.locate("state_dict_type")) {}

void ShardedStrategy::connect(std::shared_ptr<sdk::Precision> precision,
                              std::shared_ptr<sdk::CheckpointIO> checkpoint_io) {
  const auto* features = dynamic_cast<const sdk::CheckpointIOFeatures*>(checkpoint_io.get());
  TESSERA_CHECK(state_dict_type_ == "full" || features == nullptr || features->saves_sharded(), state_dict_type_key_,
                " = \"", state_dict_type_, "\" makes every rank save its own shard, but the [checkpoint_io] plugin "
                "writes full checkpoints only (one file): set [checkpoint_io] plugin = \"distributed\" (sharded "
                "folders), or state_dict_type = \"full\"");
  StrategyBase::connect(std::move(precision), std::move(checkpoint_io));
}

sdk::GuardPtr ShardedStrategy::model_sharded_context() { return deferred_init_ ? deferred_init_guard() : nullptr; }

ShardedModule& ShardedStrategy::engine() {
  TESSERA_CHECK(engine_, "the sharded strategy is used before setup()");
  return *engine_;
}

sdk::StepOutput ShardedStrategy::training_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  engine().begin_forward(/*training=*/true);
  return StrategyBase::training_step(batch, batch_idx);
}

sdk::StepOutput ShardedStrategy::validation_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  engine().begin_forward(false);
  sdk::StepOutput out = StrategyBase::validation_step(batch, batch_idx);
  engine_->end_forward();
  return out;
}

sdk::StepOutput ShardedStrategy::test_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  engine().begin_forward(false);
  sdk::StepOutput out = StrategyBase::test_step(batch, batch_idx);
  engine_->end_forward();
  return out;
}

at::Tensor ShardedStrategy::predict_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  engine().begin_forward(false);
  at::Tensor out = StrategyBase::predict_step(batch, batch_idx);
  engine_->end_forward();
  return out;
}

void ShardedStrategy::backward(const at::Tensor& loss, bool sync_gradients) {
  engine().begin_backward(sync_gradients || reduce_every_micro_batch_);
  StrategyBase::backward(loss, sync_gradients);
  engine_->finish_backward();
}

double ShardedStrategy::clip_grad_norm(double max_norm, double norm_type) {
  return engine().clip_grad_norm(max_norm, norm_type);
}

sdk::StateDict ShardedStrategy::lightning_module_state_dict() {
  if (state_dict_type_ == "sharded") return engine().sharded_state_dict();
  if (state_dict_type_ == "local") return engine().local_state_dict();
  return engine().full_state_dict();
}

void ShardedStrategy::load_model_state_dict(const sdk::StateDict& state, bool strict) {
  if (loaded_ == "sharded") return engine().load_sharded_state_dict(state);
  if (loaded_ == "local") return engine().load_local_state_dict(state);
  engine().load_full_state_dict(state, strict);
}

sdk::Checkpoint ShardedStrategy::optimizer_state() {
  restore_deferred_optimizer_state();  // a save before the first step keeps what was loaded
  if (state_dict_type_ != "full") return optimizer_state_dict(optimizer(), optimizer_param_names_);
  return engine().full_optim_state_dict(optimizer());
}

void ShardedStrategy::load_optimizer_state(const sdk::Checkpoint& state) {
  const sdk::Checkpoint mine = loaded_ == "sharded" ? shaped_pieces(state)
                               : loaded_ == "full"  ? engine().shard_full_optim_state_dict(state)
                                                    : state;
  // Checked now, before any step; installed now or at the first optimizer step.
  deferred_optimizer_state_ = stage_optimizer_state_dict(optimizer(), mine, optimizer_param_names_);
  if (!defer_optimizer_restore_) restore_deferred_optimizer_state();
}

void ShardedStrategy::restore_deferred_optimizer_state() {
  if (!deferred_optimizer_state_) return;
  deferred_optimizer_state_();
  deferred_optimizer_state_ = nullptr;
}

sdk::StepResult ShardedStrategy::optimizer_step(double gradient_clip_val, double norm_type) {
  restore_deferred_optimizer_state();
  return StrategyBase::optimizer_step(gradient_clip_val, norm_type);
}

void ShardedStrategy::save_checkpoint(const sdk::Checkpoint& checkpoint, const std::string& path) {
  if (state_dict_type_ == "full") return StrategyBase::save_checkpoint(checkpoint, path);
  sdk::Checkpoint mine = checkpoint.copy();
  if (state_dict_type_ == "sharded") mine.insert(kTensorPiecesKey, pieces_to_ivalue(owned_pieces()));
  mine.insert("fsdp_state_dict_type", state_dict_type_);
  sdk::ShardInfo shard{global_rank(), world_size(), true};
  checkpoint_io().save_checkpoint(mine, path, shard);
  barrier("sharded save_checkpoint");
  if (is_global_zero()) checkpoint_io().finalize_checkpoint(path, shard);
  barrier("sharded checkpoint published");
}

sdk::Checkpoint ShardedStrategy::load_checkpoint(const std::string& path) {
  loaded_ = "full";
  if (is_dcp_checkpoint(path)) {  // each rank reads the chunks that overlap its own pieces
    sdk::Checkpoint out = load_dcp(path, owned_pieces(), dcp_model_shape(*module_), global_rank());
    loaded_ = "sharded";
    return out;
  }
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
  sdk::Checkpoint out = read_resharded_checkpoint(checkpoint_io(), path, meta.world_size, owned_pieces());
  loaded_ = "sharded";
  return out;
}

std::map<std::string, StackedPieces> ShardedStrategy::owned_pieces() {
  // This rank's flat range of each tensor; the module's own tensors keep their full shapes.
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& item : network_->named_parameters()) shapes.emplace(item.key(), item.value().sizes().vec());
  for (const auto& item : network_->named_buffers()) shapes.emplace(item.key(), item.value().sizes().vec());
  std::map<std::string, StackedPieces> pieces;
  for (const auto& [name, range] : engine().owned_ranges())
    pieces[name].push_back(TensorPiece::flat_range(shapes.at(name), range.first, range.second));
  return pieces;
}

// A sharded checkpoint holds every piece as a 1-D range; the per-parameter layout's pieces
// are N-D dim-0 slices: each moment takes the shape of the piece it belongs to.
sdk::Checkpoint ShardedStrategy::shaped_pieces(const sdk::Checkpoint& saved) {
  std::map<std::string, at::Tensor> pieces;
  for (const auto& p : engine().optimizer_parameters()) pieces.emplace(p.name, p.tensor);
  return map_optimizer_moments(saved, [&](const std::string& name, const at::Tensor& moment) {
    auto it = pieces.find(name);
    const bool flat_piece = it != pieces.end() && moment.dim() == 1 && moment.numel() == it->second.numel();
    return flat_piece ? moment.view(it->second.sizes()) : moment;
  });
}

void ShardedStrategy::teardown() {
  engine_.reset();
  StrategyBase::teardown();
}

std::vector<sdk::NamedParameter> ShardedStrategy::optimizer_parameters() { return engine().optimizer_parameters(); }

void ShardedStrategy::zero_grad() { engine().after_optimizer_step(); }

void ShardedStrategy::fill_common_options(FSDPOptions& options) const {
  options.deferred_init = deferred_init_;
  options.device = device_;
  options.param_init_fn = [module = module_](const std::string& path, torch::nn::Module& m) {
    return module->init_parameters(path, m);
  };
  options.mixed_precision = precision_->mixed_precision_policy();
  if (options.unit_classes.empty()) options.unit_classes = module_->fsdp_unit_classes();
  options.custom_wrap_policy = [module = module_](const std::string& path, const torch::nn::Module& m) {
    return module->fsdp_wrap_policy(path, m);
  };
}

void ShardedStrategy::check_unit_classes(const FSDPOptions& options, const std::string& key) const {
  check_unit_classes(*network_, options, key);
}

void ShardedStrategy::check_unit_classes(const torch::nn::Module& network, const FSDPOptions& options,
                                         const std::string& key) const {
  if (options.auto_wrap_policy == "transformer" || options.auto_wrap_policy == "size") {
    const std::string problem = unit_class_problem(network, options.unit_classes);
    TESSERA_CHECK(problem.empty(), key, ": ", problem);
  }
  for (const auto& cls : options.activation_checkpointing)
    TESSERA_CHECK(options.auto_wrap_policy == "custom" ||
                      std::find(options.unit_classes.begin(), options.unit_classes.end(), cls) !=
                          options.unit_classes.end(),
                  "[strategy] activation_checkpointing names '", cls, "', which is not an FSDP unit class; valid: ",
                  sdk::join(options.unit_classes));
}

void ShardedStrategy::refuse_offload_on_cpu(const std::string& setting) const {
  TESSERA_CHECK(trains_on_cuda(), setting, " offloads a CUDA device's shards, gradients and optimizer state to pinned host ",
                "memory, but this run is on the CPU, where they are host memory already: nothing would be offloaded. ",
                "Remove it (or train on a GPU with [strategy] accelerator = \"cuda\")");
}

bool ShardedStrategy::offloads_state_to_cpu() const {
  return trains_on_cuda() && planned_options(sdk::MixedPrecisionPolicy{}).cpu_offload;
}

UnitPlan ShardedStrategy::planned_units(sdk::Module& module, FSDPOptions& options) {
  options = planned_options(precision().mixed_precision_policy());
  if (options.unit_classes.empty()) options.unit_classes = module.fsdp_unit_classes();
  options.custom_wrap_policy = [&module](const std::string& path, const torch::nn::Module& m) {
    return module.fsdp_wrap_policy(path, m);
  };
  std::shared_ptr<torch::nn::Module> network = module.network();
  TESSERA_CHECK(network != nullptr, "the model plugin built no network");
  check_unit_classes(*network, options, "[strategy] transformer_layer_cls");
  return plan_units(*network, options);
}

std::vector<std::shared_ptr<torch::nn::Module>> ShardedStrategy::checkpointed_units(sdk::Module& module) {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  FSDPOptions options;
  for (const PlannedUnit& unit : planned_units(module, options).units)
    if (unit.checkpointed) out.push_back(unit.module);
  return out;
}

sdk::MemoryLayout ShardedStrategy::memory_layout(sdk::Module& module, const sdk::ClusterInfo& cluster,
                                                 std::int64_t micro_batches) {
  sdk::MemoryLayout layout = planned_layout(module, cluster, micro_batches);
  layout.counts_micro_batches = true;
  return layout;
}

sdk::MemoryLayout ShardedStrategy::planned_layout(sdk::Module& module, const sdk::ClusterInfo& cluster,
                                                  std::int64_t micro_batches) {
  const PlannedMesh mesh = planned_mesh(cluster);
  FSDPOptions options;
  const UnitPlan plan = planned_units(module, options);

  ShardedPlanInput in;
  in.strategy = strategy_name();
  for (const auto& unit : plan.units) {
    PlannedUnitSizes sizes{unit.name, {}};
    for (const auto& p : unit.params) {
      const std::int64_t rows = p.tensor.dim() == 0 ? 1 : p.tensor.size(0);
      sizes.params.push_back({rows, rows == 0 ? 0 : p.tensor.numel() / rows, p.tensor.requires_grad()});
    }
    in.units.push_back(std::move(sizes));
  }
  for (const auto& p : plan.replicated) {
    in.replicated_numel += p.tensor.numel();
    if (p.tensor.requires_grad()) in.replicated_trainable_numel += p.tensor.numel();
  }
  in.shard_size = mesh.shard;
  in.replicate_size = mesh.replicate;
  in.tp_size = mesh.tp;
  in.reshard_group = mesh.reshard_group;
  in.layout = options.layout;
  in.sharding_strategy = options.sharding_strategy;
  in.backward_prefetch = options.backward_prefetch;
  in.forward_prefetch = options.forward_prefetch;
  in.max_gathered_units = options.max_gathered_units;
  in.micro_batches = micro_batches;
  in.reduce_every_micro_batch = reduce_every_micro_batch_;
  in.offloaded = offloads_state_to_cpu();
  in.transport = trains_on_cuda()                            ? PlannedTransport::nccl
                 : core::shared_memory_collectives(cluster) ? PlannedTransport::shared_memory
                                                            : PlannedTransport::gloo;
  // The dtypes the layouts pick (flat_param.cpp): the master shard keeps the parameters' own.
  at::ScalarType master = at::kFloat;
  for (const auto& unit : plan.units)
    if (!unit.params.empty()) {
      master = unit.params.front().tensor.scalar_type();
      break;
    }
  const sdk::MixedPrecisionPolicy& policy = options.mixed_precision;
  in.master_dtype = master;
  in.compute_dtype = policy.param_dtype.value_or(master);
  in.reduce_dtype = policy.reduce_dtype.value_or(in.compute_dtype);
  in.grad_dtype = policy.keep_low_precision_grads ? in.compute_dtype : master;
  sdk::MemoryLayout layout = plan_sharded_memory(in);
  // Setup: an eager build holds the whole model while each unit's flat copy is sharded; a
  // deferred one about one unit (its parameters, flat copy and shard).
  double whole = 0, largest = 0;
  for (const auto& unit : plan.units) {
    double bytes = 0;
    for (const auto& p : unit.params) bytes += static_cast<double>(p.tensor.numel() * p.tensor.element_size());
    whole += bytes;
    largest = std::max(largest, bytes);
  }
  layout.setup_bytes = deferred_init_ ? 2 * largest : whole + largest;
  if (options.cpu_offload)
    layout.notes += std::string(layout.notes.empty() ? "" : "; ") +
                    "cpu_offload: on a CUDA device the shards, gradients and optimizer state are host memory";
  return layout;
}

}  // namespace tessera::core::fsdp
