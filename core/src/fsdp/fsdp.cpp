#include "tessera/core/fsdp.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#if TESSERA_WITH_CUDA
#include <ATen/native/cuda/Resize.h>
#endif
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/unit.hpp"

namespace tessera::core::fsdp {

/// One FSDP unit: its parameters live in `full` (padded, flat) while gathered; this rank
/// owns `shard` (fp32 master) and `shard_grad`.
struct FlatParamUnit {
  std::string name;  // "blocks.3", or "" for the root
  std::size_t index = 0;
  bool is_root = false;
  bool checkpointed = false;  // activation checkpointing
  std::vector<std::vector<std::string>> names;  // per parameter: every name it has (tied)
  std::vector<at::Tensor> params;
  std::vector<std::int64_t> offsets, numels;
  std::int64_t numel = 0, padded = 0, shard_numel = 0, shard_offset = 0;
  at::ScalarType compute_dtype = at::kFloat;
  at::Tensor shard, shard_grad, full, grad_full;
  std::vector<at::Tensor> optimizer_views;
  bool gathered = false, grads_attached = false, reduced = false;
  std::int64_t expected_grads = 0, pending_grads = 0;
  CommHandlePtr gather_handle, reduce_handle;
  at::Tensor gather_input, reduce_input, reduce_output;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::string forward_tag, backward_tag, reduce_tag;
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::size_t storage_bytes(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }

// Frees or re-allocates a flat buffer's storage in place: every view of it (the module's
// parameters, tensors autograd saved) stays valid and sees the data again once re-gathered.
void resize_storage(const at::Tensor& t, std::size_t bytes) {
#if TESSERA_WITH_CUDA
  if (t.is_cuda()) return at::native::resize_bytes_cuda(t.storage().unsafeGetStorageImpl(), bytes);
#endif
  TESSERA_CHECK(t.is_cpu(), "FSDP storage management for ", t.device(), " tensors is not available in this build");
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), bytes);
}
void free_storage(const at::Tensor& t) { resize_storage(t, 0); }
void alloc_storage(const at::Tensor& t) {
  if (t.storage().nbytes() != storage_bytes(t)) resize_storage(t, storage_bytes(t));
}

/// Identity on a unit's output whose backward re-gathers the unit before its own backward.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, std::int64_t engine, std::int64_t unit) {
    ctx->saved_data["engine"] = engine;
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* engine = reinterpret_cast<ShardedModule*>(ctx->saved_data["engine"].toInt());
    auto* unit = reinterpret_cast<FlatParamUnit*>(ctx->saved_data["unit"].toInt());
    engine->unshard(*unit, "backward");
    engine->attach_gradients(*unit);
    if (engine->options().backward_prefetch == BackwardPrefetch::BACKWARD_PRE)
      if (FlatParamUnit* previous = engine->previous_unit(*unit)) engine->unshard(*previous, "prefetch");
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

/// Activation checkpointing: forward without saving activations; backward re-gathers the
/// unit, recomputes its forward with grad enabled and back-propagates through it.
struct Recompute : public torch::autograd::Function<Recompute> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, std::int64_t engine, std::int64_t unit,
                            std::int64_t forward_fn) {
    ctx->saved_data["engine"] = engine;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["forward"] = forward_fn;
    ctx->save_for_backward({x});
    at::AutoGradMode no_grad(false);
    return (*reinterpret_cast<sdk::UnitForward*>(forward_fn))(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* engine = reinterpret_cast<ShardedModule*>(ctx->saved_data["engine"].toInt());
    auto* unit = reinterpret_cast<FlatParamUnit*>(ctx->saved_data["unit"].toInt());
    auto* forward = reinterpret_cast<sdk::UnitForward*>(ctx->saved_data["forward"].toInt());
    engine->unshard(*unit, "backward");
    engine->attach_gradients(*unit);
    at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor output;
    {
      at::AutoGradMode grad(true);
      output = (*forward)(input);
    }
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

/// Counts a unit's parameters whose gradient has been accumulated.
class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(ShardedModule* engine, FlatParamUnit* unit) : engine_(engine), unit_(unit) {}
  variable_list operator()(const variable_list& outputs, const variable_list&) override {
    if (--unit_->pending_grads == 0) engine_->on_gradient_ready(*unit_);
    return outputs;
  }

 private:
  ShardedModule* engine_;
  FlatParamUnit* unit_;
};

class UnitRunnerImpl final : public sdk::UnitRunner {
 public:
  UnitRunnerImpl(ShardedModule* engine, FlatParamUnit* unit) : engine_(engine), unit_(unit) {}
  // The forward callable must outlive the autograd graph when the unit recomputes.
  at::Tensor run(torch::nn::Module&, const sdk::UnitForward& forward, const at::Tensor& input) override {
    engine_->unshard(*unit_, "forward");
    if (engine_->options().forward_prefetch)
      if (FlatParamUnit* next = engine_->next_unit(*unit_)) engine_->unshard(*next, "prefetch");
    const bool grad = at::GradMode::is_enabled();
    at::Tensor output;
    if (grad && unit_->checkpointed && input.requires_grad()) {
      forward_ = forward;
      output = Recompute::apply(input, reinterpret_cast<std::int64_t>(engine_), reinterpret_cast<std::int64_t>(unit_),
                                reinterpret_cast<std::int64_t>(&forward_));
    } else {
      output = forward(input);
      if (grad && output.requires_grad())
        output = PreBackward::apply(output, reinterpret_cast<std::int64_t>(engine_),
                                    reinterpret_cast<std::int64_t>(unit_));
    }
    // FULL_SHARD frees after forward; SHARD_GRAD_OP keeps the parameters until backward.
    if (!grad || engine_->options().sharding_strategy != ShardingStrategy::SHARD_GRAD_OP) engine_->reshard(*unit_);
    return output;
  }

 private:
  ShardedModule* engine_;
  FlatParamUnit* unit_;
  sdk::UnitForward forward_;
};

}  // namespace

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  if (name == "FULL_SHARD") return ShardingStrategy::FULL_SHARD;
  if (name == "SHARD_GRAD_OP") return ShardingStrategy::SHARD_GRAD_OP;
  if (name == "NO_SHARD") return ShardingStrategy::NO_SHARD;
  if (name == "HYBRID_SHARD") return ShardingStrategy::HYBRID_SHARD;
  TESSERA_FAIL("unknown sharding_strategy '", name, "'");
}

BackwardPrefetch parse_backward_prefetch(const std::string& name) {
  if (name == "BACKWARD_PRE") return BackwardPrefetch::BACKWARD_PRE;
  if (name == "BACKWARD_POST") return BackwardPrefetch::BACKWARD_POST;
  if (name == "none" || name == "NONE") return BackwardPrefetch::NONE;
  TESSERA_FAIL("unknown backward_prefetch '", name, "'");
}

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> network, const FSDPOptions& options,
                             CommunicatorPtr shard_group, CommunicatorPtr replicate_group)
    : network_(std::move(network)), options_(options), shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)) {
  for (const auto& p : network_->parameters()) device_ = p.device();
  plan_units();
  check_plan();
  for (auto& unit : units_) flatten(*unit);
}

ShardedModule::~ShardedModule() {
  for (const auto& item : network_->named_modules()) sdk::set_unit_runner(*item.value(), nullptr);
}

at::TensorOptions ShardedModule::fp32() const {
  return at::TensorOptions().dtype(at::kFloat).device(device_);
}

void ShardedModule::plan_units() {
  const auto& classes = options_.unit_classes;
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  if (options_.auto_wrap_policy != "none") {
    for (const auto& item : network_->named_modules("", /*include_self=*/false)) {
      const std::string& name = item.key();
      bool inside = std::any_of(chosen.begin(), chosen.end(),
                                [&](const auto& c) { return name.rfind(c.first + ".", 0) == 0; });
      if (inside || std::find(classes.begin(), classes.end(), item.value()->name()) == classes.end()) continue;
      std::int64_t count = 0;
      for (const auto& p : item.value()->parameters()) count += p.numel();
      if (options_.auto_wrap_policy == "size" && count < options_.min_num_params) continue;
      chosen.emplace_back(name, item.value());
    }
  }
  // A parameter used by several units (tied weights) goes to the root, which stays gathered
  // for the whole step: every user sees it (PyTorch requires tied users in one unit).
  std::unordered_map<const void*, int> owners;
  for (const auto& [name, module] : chosen) {
    std::set<const void*> seen;
    for (const auto& p : module->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) ++owners[p.unsafeGetTensorImpl()];
  }
  std::unordered_map<const void*, std::pair<FlatParamUnit*, std::size_t>> placed;
  auto add = [&](FlatParamUnit& unit, const std::string& name, const at::Tensor& p) {
    auto it = placed.find(p.unsafeGetTensorImpl());
    if (it != placed.end()) {  // another name of a parameter already placed
      it->second.first->names[it->second.second].push_back(name);
      return;
    }
    placed[p.unsafeGetTensorImpl()] = {&unit, unit.params.size()};
    unit.params.push_back(p);
    unit.names.push_back({name});
  };
  for (const auto& [name, module] : chosen) {
    auto unit = std::make_unique<FlatParamUnit>();
    unit->name = name;
    for (const auto& item : module->named_parameters())
      if (owners[item.value().unsafeGetTensorImpl()] == 1) add(*unit, name + "." + item.key(), item.value());
    bool checkpointed = std::find(options_.activation_checkpointing.begin(), options_.activation_checkpointing.end(),
                                  module->name()) != options_.activation_checkpointing.end();
    unit->checkpointed = checkpointed;
    sdk::set_unit_runner(*module, nullptr);
    units_.push_back(std::move(unit));
  }
  auto root = std::make_unique<FlatParamUnit>();
  root->is_root = true;
  root->name = "<root>";
  // Root: everything not placed yet, in the network's own order; also records every
  // additional name of the parameters placed in units.
  for (const auto& item : network_->named_parameters()) add(*root, item.key(), item.value());
  units_.push_back(std::move(root));
  for (std::size_t i = 0; i < units_.size(); ++i) {
    FlatParamUnit& u = *units_[i];
    u.index = i;
    u.forward_tag = "forward all-gather of " + u.name;
    u.backward_tag = "backward all-gather of " + u.name;
    u.reduce_tag = "reduce-scatter of " + u.name;
  }
  for (std::size_t i = 0; i < chosen.size(); ++i)
    sdk::set_unit_runner(*chosen[i].second, std::make_shared<UnitRunnerImpl>(this, units_[i].get()));
}

std::string ShardedModule::plan() const {
  std::string out;
  for (const auto& u : units_) {
    std::int64_t n = 0;
    for (const auto& p : u->params) n += p.numel();
    out += u->name + ":" + std::to_string(n) + ";";
  }
  return out;
}

void ShardedModule::check_plan() {
  // Ranks that planned different units would deadlock in mismatched collectives: compare first.
  const std::string mine = plan();
  at::Tensor hash = at::full({1}, static_cast<std::int64_t>(std::hash<std::string>{}(mine) & 0x7fffffffffff),
                             fp32().dtype(at::kLong));
  at::Tensor all = at::empty({shard_group_->size()}, fp32().dtype(at::kLong));
  shard_group_->all_gather(all, hash, "FSDP unit plan check")->wait();
  hash = hash.cpu();
  all = all.cpu();
  for (std::int64_t r = 0; r < shard_group_->size(); ++r)
    TESSERA_CHECK(all[r].item<std::int64_t>() == hash[0].item<std::int64_t>(), "FSDP: rank ", shard_group_->rank(),
                  " and rank ", r, " planned different units (this rank: ", mine,
                  "); every rank must build the same model with the same [strategy] settings");
}

void ShardedModule::flatten(FlatParamUnit& u) {
  const std::int64_t world = shard_group_->size();
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> pieces;
  for (const auto& p : u.params) {
    u.offsets.push_back(u.numel);
    u.numels.push_back(p.numel());
    u.numel += p.numel();
    pieces.push_back(p.detach().reshape({-1}).to(at::kFloat));
  }
  u.padded = (u.numel + world - 1) / world * world;
  if (u.padded == 0) u.padded = world;
  u.shard_numel = u.padded / world;
  u.shard_offset = shard_group_->rank() * u.shard_numel;
  pieces.push_back(at::zeros({u.padded - u.numel}, fp32()));
  at::Tensor flat = at::cat(pieces);
  u.shard = flat.narrow(0, u.shard_offset, u.shard_numel).clone();
  u.shard_grad = at::zeros({u.shard_numel}, fp32());
  u.compute_dtype = options_.mixed_precision.param_dtype.value_or(u.params.empty() ? at::kFloat
                                                                                     : u.params[0].scalar_type());
  u.full = flat.to(u.compute_dtype).clone();
  u.grad_full = at::zeros({u.padded}, fp32().dtype(u.compute_dtype));
  free_storage(u.grad_full);
  for (std::size_t i = 0; i < u.params.size(); ++i)
    u.params[i].set_data(u.full.narrow(0, u.offsets[i], u.numels[i]).view(u.params[i].sizes()));
  u.gathered = true;
  reshard(u);
  // Hooks after set_data: a dtype change resets a parameter's gradient accumulator.
  for (auto& p : u.params) {
    if (!p.requires_grad()) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(p);
    accumulator->add_post_hook(std::make_unique<GradientReadyHook>(this, &u));
    u.accumulators.push_back(std::move(accumulator));
    ++u.expected_grads;
  }
  // The optimizer steps on per-parameter views of the fp32 master shard.
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    std::int64_t lo = std::max(u.offsets[i], u.shard_offset);
    std::int64_t hi = std::min(u.offsets[i] + u.numels[i], u.shard_offset + u.shard_numel);
    std::int64_t start = std::max<std::int64_t>(0, lo - u.shard_offset), length = std::max<std::int64_t>(0, hi - lo);
    at::Tensor view = u.shard.narrow(0, std::min(start, u.shard_numel), length);
    view.mutable_grad() = u.shard_grad.narrow(0, std::min(start, u.shard_numel), length);
    u.optimizer_views.push_back(view);
  }
}

std::vector<sdk::NamedParameter> ShardedModule::optimizer_parameters() const {
  std::vector<sdk::NamedParameter> out;
  for (const auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i) out.push_back({u->names[i][0], u->optimizer_views[i]});
  return out;
}

std::size_t ShardedModule::num_units() const { return units_.size(); }

std::int64_t ShardedModule::sharded_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& u : units_) bytes += static_cast<std::int64_t>(storage_bytes(u->shard) + storage_bytes(u->shard_grad));
  return bytes;
}

FlatParamUnit* ShardedModule::previous_unit(const FlatParamUnit& unit) const {
  return unit.index > 0 && !unit.is_root ? units_[unit.index - 1].get() : nullptr;
}

FlatParamUnit* ShardedModule::next_unit(const FlatParamUnit& unit) const {
  return unit.index + 2 < units_.size() ? units_[unit.index + 1].get() : nullptr;  // never the root
}

void ShardedModule::unshard(FlatParamUnit& u, const std::string& phase) {
  if (u.gathered) return;
  if (!u.gather_handle) {
    alloc_storage(u.full);
    u.gather_input = u.shard.to(u.compute_dtype);
    u.gather_handle = shard_group_->all_gather(u.full, u.gather_input, phase == "backward" ? u.backward_tag
                                                                                           : u.forward_tag);
  }
  if (phase == "prefetch") return;  // waited for by the unshard that needs it
  u.gather_handle->wait();
  u.gather_handle.reset();
  u.gather_input.reset();
  u.gathered = true;
}

void ShardedModule::reshard(FlatParamUnit& u) {
  if (!u.gathered) return;
  // One-rank shard groups (NO_SHARD, world 1) keep the storage; the next unshard refreshes
  // it from the (stepped) shard.
  if (shard_group_->size() > 1) free_storage(u.full);
  u.gathered = false;
}

void ShardedModule::attach_gradients(FlatParamUnit& u) {
  if (u.grads_attached || !at::GradMode::is_enabled() && !training_step_active()) return;
  alloc_storage(u.grad_full);
  u.grad_full.zero_();
  for (std::size_t i = 0; i < u.params.size(); ++i)
    u.params[i].mutable_grad() = u.grad_full.narrow(0, u.offsets[i], u.numels[i]).view(u.params[i].sizes());
  u.grads_attached = true;
}

void ShardedModule::begin_forward(bool training) {
  FlatParamUnit& root = *units_.back();
  unshard(root, "forward");
  if (training) {
    accumulating_ = true;
    attach_gradients(root);
  }
}

void ShardedModule::end_forward() {
  for (auto& u : units_) reshard(*u);
}

void ShardedModule::begin_backward(bool sync) {
  sync_ = sync;
  for (auto& u : units_) {
    u->pending_grads = u->expected_grads;
    u->reduced = false;
  }
}

void ShardedModule::on_gradient_ready(FlatParamUnit& u) {
  if (sync_) reduce_gradients(u);
  if (!u.is_root) reshard(u);
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST)
    if (FlatParamUnit* previous = previous_unit(u)) unshard(*previous, "prefetch");
}

void ShardedModule::reduce_gradients(FlatParamUnit& u) {
  if (u.reduced || !u.grads_attached) return;
  u.reduced = true;
  at::ScalarType reduce_dtype = options_.mixed_precision.reduce_dtype.value_or(u.grad_full.scalar_type());
  u.reduce_input = u.grad_full.scalar_type() == reduce_dtype ? u.grad_full : u.grad_full.to(reduce_dtype);
  if (shard_group_->size() > 1) {
    u.reduce_output = at::empty({u.shard_numel}, u.reduce_input.options());
    u.reduce_handle = shard_group_->reduce_scatter(u.reduce_output, u.reduce_input, sdk::ReduceOp::mean, u.reduce_tag);
  } else {
    u.reduce_output = u.reduce_input;
  }
}

void ShardedModule::finish_backward() {
  if (sync_) {
    // Units whose hooks did not all fire (parameters unused this step) reduce now, in the
    // same unit order on every rank.
    for (auto& u : units_) reduce_gradients(*u);
    torch::NoGradGuard no_grad;
    for (auto& u : units_) {
      if (!u->reduced) continue;
      if (u->reduce_handle) u->reduce_handle->wait();
      u->reduce_handle.reset();
      if (replicate_group_->size() > 1)
        replicate_group_->all_reduce(u->reduce_output, sdk::ReduceOp::mean, "replica all-reduce of " + u->name)->wait();
      u->shard_grad.add_(u->reduce_output.to(at::kFloat));
      u->reduce_input.reset();
      u->reduce_output.reset();
      for (auto& p : u->params) p.mutable_grad().reset();
      free_storage(u->grad_full);
      u->grads_attached = false;
    }
    accumulating_ = false;
  }
  for (auto& u : units_) reshard(*u);
}

void ShardedModule::after_optimizer_step() {
  for (auto& u : units_) {
    u->shard_grad.zero_();
    for (std::size_t i = 0; i < u->optimizer_views.size(); ++i)
      if (!u->optimizer_views[i].grad().defined()) {  // zero_grad(set_to_none) in LibTorch 2.x
        std::int64_t lo = std::max(u->offsets[i], u->shard_offset);
        std::int64_t start = std::min(std::max<std::int64_t>(0, lo - u->shard_offset), u->shard_numel);
        u->optimizer_views[i].mutable_grad() = u->shard_grad.narrow(0, start, u->optimizer_views[i].numel());
      }
  }
}

double ShardedModule::clip_grad_norm(double max_norm, double norm_type) {
  const bool inf_norm = std::isinf(norm_type);
  at::Tensor local = at::zeros({1}, fp32());
  for (const auto& u : units_) {
    if (inf_norm) local = at::maximum(local, u->shard_grad.abs().max().reshape({1}));
    else local += u->shard_grad.abs().pow(norm_type).sum();
  }
  // Replicas hold identical shards: the norm is over the shard group only.
  shard_group_->all_reduce(local, inf_norm ? sdk::ReduceOp::max : sdk::ReduceOp::sum, "clip_grad_norm")->wait();
  double total = inf_norm ? local.item<double>() : std::pow(local.item<double>(), 1.0 / norm_type);
  double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1.0)
    for (auto& u : units_) u->shard_grad.mul_(coefficient);
  return total;
}

sdk::StateDict ShardedModule::full_state_dict() {
  std::map<std::string, at::Tensor> by_name;
  const bool keep = !options_.rank0_only || shard_group_->rank() == 0;
  for (auto& u : units_) {
    at::Tensor full = at::empty({u->padded}, fp32());
    shard_group_->all_gather(full, u->shard, "state_dict all-gather of " + u->name)->wait();
    if (!keep) continue;
    full = full.cpu();  // checkpoints hold CPU tensors
    for (std::size_t i = 0; i < u->params.size(); ++i) {
      at::Tensor value = full.narrow(0, u->offsets[i], u->numels[i]).view(u->params[i].sizes()).clone();
      for (const auto& name : u->names[i]) by_name[name] = value;
    }
  }
  sdk::StateDict state;
  if (!keep) return state;
  for (const auto& item : network_->named_parameters()) state.insert(item.key(), by_name.at(item.key()));
  for (const auto& item : network_->named_buffers()) state.insert(item.key(), item.value().detach());
  return state;
}

void ShardedModule::load_full_state_dict(const sdk::StateDict& state, bool strict) {
  std::vector<std::string> missing, unexpected;
  std::set<std::string> known;
  for (const auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i)
      for (const auto& name : u->names[i]) {
        known.insert(name);
        const at::Tensor* value = state.find(name);
        if (value == nullptr) {
          missing.push_back(name);
          continue;
        }
        TESSERA_CHECK(value->sizes() == u->params[i].sizes(), "checkpoint state_dict['", name, "'] has shape ",
                      value->sizes(), " but the model's parameter has shape ", u->params[i].sizes(),
                      ": the checkpoint was written for a different model configuration");
      }
  for (const auto& item : network_->named_buffers()) known.insert(item.key());
  for (const auto& item : state)
    if (!known.count(item.key())) unexpected.push_back(item.key());
  TESSERA_CHECK(!strict || (missing.empty() && unexpected.empty()), "checkpoint state_dict does not match the model: ",
                missing.size(), " missing key(s) [", sdk::join(missing), "], ", unexpected.size(),
                " unexpected key(s) [", sdk::join(unexpected), "]");
  torch::NoGradGuard no_grad;
  for (auto& u : units_) {
    at::Tensor flat = at::zeros({u->padded}, fp32());
    for (std::size_t i = 0; i < u->params.size(); ++i)
      if (const at::Tensor* value = state.find(u->names[i][0]))
        flat.narrow(0, u->offsets[i], u->numels[i]).copy_(value->reshape({-1}));
    u->shard.copy_(flat.narrow(0, u->shard_offset, u->shard_numel));
  }
  for (auto& item : network_->named_buffers())
    if (const at::Tensor* value = state.find(item.key())) item.value().copy_(*value);
}

namespace {
const char* const kStateKeys[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};
}

sdk::Checkpoint ShardedModule::full_optim_state_dict(const torch::optim::Optimizer& optimizer) {
  std::vector<std::string> view_names;
  for (const auto& p : optimizer_parameters()) view_names.push_back(p.name);
  sdk::Checkpoint local = optimizer_state_dict(optimizer, view_names);
  auto local_state = local.at("state").toGenericDict();
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  std::vector<std::string> names;
  std::int64_t view = 0;
  const bool keep = !options_.rank0_only || shard_group_->rank() == 0;
  for (auto& u : units_) {
    const std::int64_t first_view = view;
    std::vector<sdk::Checkpoint> full_states;
    for (std::size_t i = 0; i < u->params.size(); ++i) full_states.push_back(sdk::make_checkpoint());
    for (const char* key : kStateKeys) {
      // Present for one parameter means present for all (same optimizer, same settings).
      bool present = local_state.contains(first_view) &&
                     local_state.at(first_view).toGenericDict().contains(key) && !u->params.empty();
      at::Tensor flat_shard = at::zeros({u->shard_numel}, fp32());
      if (present)
        for (std::size_t i = 0; i < u->params.size(); ++i) {
          at::Tensor piece = local_state.at(first_view + static_cast<std::int64_t>(i)).toGenericDict().at(key).toTensor();
          std::int64_t start = std::max<std::int64_t>(0, std::max(u->offsets[i], u->shard_offset) - u->shard_offset);
          if (piece.numel() > 0) flat_shard.narrow(0, start, piece.numel()).copy_(piece.reshape({-1}));
        }
      at::Tensor flag = at::full({1}, present ? 1.0 : 0.0, fp32());
      shard_group_->all_reduce(flag, sdk::ReduceOp::max, "optimizer state check")->wait();
      if (flag.item<double>() == 0) continue;
      at::Tensor full = at::empty({u->padded}, fp32());
      shard_group_->all_gather(full, flat_shard, "optimizer state all-gather of " + u->name)->wait();
      full = full.cpu();
      for (std::size_t i = 0; i < u->params.size(); ++i)
        full_states[i].insert(key, full.narrow(0, u->offsets[i], u->numels[i]).view(u->params[i].sizes()).clone());
    }
    for (std::size_t i = 0; i < u->params.size(); ++i, ++view) {
      if (local_state.contains(view) && local_state.at(view).toGenericDict().contains("step"))
        full_states[i].insert("step", local_state.at(view).toGenericDict().at("step"));
      if (full_states[i].size() > 0) state.insert(static_cast<std::int64_t>(names.size()), full_states[i]);
      names.push_back(u->names[i][0]);
    }
  }
  sdk::Checkpoint out = sdk::make_checkpoint();
  if (!keep) return out;
  out.insert("state", state);
  out.insert("param_groups", local.at("param_groups"));
  out.insert("param_names", c10::List<std::string>(names));
  return out;
}

void ShardedModule::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full) {
  auto full_state = checkpoint_get(full, "state").toGenericDict();
  std::map<std::string, std::int64_t> index_of;
  auto names = checkpoint_get(full, "param_names").toListRef();
  for (std::size_t i = 0; i < names.size(); ++i) index_of[names[i].toStringRef()] = static_cast<std::int64_t>(i);
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  std::vector<std::string> view_names;
  std::int64_t view = 0;
  for (auto& u : units_) {
    for (std::size_t i = 0; i < u->params.size(); ++i, ++view) {
      const std::string& name = u->names[i][0];
      view_names.push_back(name);
      auto it = index_of.find(name);
      TESSERA_CHECK(it != index_of.end(), "optimizer state in the checkpoint has no entry for parameter '", name, "'");
      if (!full_state.contains(it->second)) continue;
      sdk::Checkpoint saved = full_state.at(it->second).toGenericDict();
      sdk::Checkpoint mine = sdk::make_checkpoint();
      std::int64_t lo = std::max(u->offsets[i], u->shard_offset);
      std::int64_t length = u->optimizer_views[i].numel();
      for (const auto& entry : saved) {
        const std::string key = entry.key().toStringRef();
        if (key == "step") {
          mine.insert(key, entry.value());
          continue;
        }
        at::Tensor value = entry.value().toTensor();
        TESSERA_CHECK(value.sizes() == u->params[i].sizes(), "optimizer state '", key, "' of parameter '", name,
                      "' has shape ", value.sizes(), " in the checkpoint but the parameter has shape ",
                      u->params[i].sizes());
        mine.insert(key, value.reshape({-1}).narrow(0, length > 0 ? lo - u->offsets[i] : 0, length).to(device_).clone());
      }
      state.insert(view, mine);
    }
  }
  sdk::Checkpoint local = sdk::make_checkpoint();
  local.insert("state", state);
  local.insert("param_groups", checkpoint_get(full, "param_groups"));
  local.insert("param_names", c10::List<std::string>(view_names));
  load_optimizer_state_dict(optimizer, local, view_names);
}

}  // namespace tessera::core::fsdp
