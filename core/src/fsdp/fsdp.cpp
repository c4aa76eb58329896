#include "tessera/core/fsdp.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#if TESSERA_WITH_CUDA
#include <ATen/native/cuda/Resize.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/unit.hpp"

#include <torch/csrc/jit/serialization/pickle.h>

namespace tessera::core::fsdp {

/// One FSDP unit: its parameters live in `full` (padded, flat) while gathered; this rank
/// owns `shard` (the master: fp32, or the parameters' half dtype under *-true) and `shard_grad`.
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
  at::ScalarType master_dtype = at::kFloat;  // of the shard: the parameters' own (bf16 under bf16-true)
  at::Tensor shard, shard_grad, full, grad_full;
  std::vector<at::Tensor> optimizer_views;
  bool gathered = false, grads_attached = false, reduced = false;
  bool shard_grad_written = false;  // since the last optimizer step (cpu_offload copies into it)
  std::int64_t expected_grads = 0, pending_grads = 0;
  CommHandlePtr gather_handle, reduce_handle;
  at::Tensor gather_input, reduce_input, reduce_output;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::string forward_tag, backward_tag, reduce_tag, replica_tag;
  std::int64_t order_position = -1;  // in the first forward's execution order, -1: never ran
};

namespace {

bool in_arena(const at::Tensor& t);
bool reset_known_module(torch::nn::Module& m);
void release_arena();
void restore_arena_rng();

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::size_t storage_bytes(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }

// CPU unit buffers are recycled instead of going back to malloc: a unit gathers into a block
// that a unit of the same size freed, so unsharding costs no allocation or page faults, and
// glibc never sees large blocks come and go (freeing them raises its mmap threshold, after
// which freed memory stays resident: +300 MB RSS per rank for a 57M-parameter GPT). Idle
// blocks are few: kIdlePerSize per size at most. (CUDA's caching allocator does this there.)
class CpuBlockPool {
 public:
  static constexpr std::size_t kIdlePerSize = 2;
  void give(std::size_t bytes, c10::DataPtr block) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[bytes];
    if (idle.size() < kIdlePerSize) idle.push_back(std::move(block));
  }
  c10::DataPtr take(std::size_t bytes, c10::Allocator* allocator) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = idle_.find(bytes);
      if (it != idle_.end() && !it->second.empty()) {
        c10::DataPtr block = std::move(it->second.back());
        it->second.pop_back();
        return block;
      }
    }
    return allocator->allocate(bytes);
  }

 private:
  std::mutex mutex_;
  std::map<std::size_t, std::vector<c10::DataPtr>> idle_;
};
CpuBlockPool& cpu_block_pool() {
  static auto* pool = new CpuBlockPool;  // never destroyed: blocks may be given back during exit
  return *pool;
}

// Frees or re-allocates a flat buffer's storage in place: every view of it (the module's
// parameters, tensors autograd saved) stays valid and sees the data again once re-gathered.
void free_storage(const at::Tensor& t, bool recycle = true) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
#if TESSERA_WITH_CUDA
  if (t.is_cuda()) return at::native::resize_bytes_cuda(storage, 0);
#endif
  TESSERA_CHECK(t.is_cpu(), "FSDP storage management for ", t.device(), " tensors is not available in this build");
  const std::size_t bytes = storage->nbytes();
  if (bytes == 0) return;
  c10::DataPtr block = storage->set_data_ptr(c10::DataPtr(nullptr, t.device()));
  if (recycle) cpu_block_pool().give(bytes, std::move(block));
  storage->set_nbytes(0);
}
void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const std::size_t bytes = storage_bytes(t);
  if (storage->nbytes() == bytes) return;
#if TESSERA_WITH_CUDA
  if (t.is_cuda()) return at::native::resize_bytes_cuda(storage, bytes);
#endif
  TESSERA_CHECK(t.is_cpu(), "FSDP storage management for ", t.device(), " tensors is not available in this build");
  free_storage(t);
  storage->set_data_ptr_noswap(cpu_block_pool().take(bytes, storage->allocator()));
  storage->set_nbytes(bytes);
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
    engine->unshard(*unit, ShardedModule::Phase::backward);
    engine->attach_gradients(*unit);
    if (engine->options().backward_prefetch == BackwardPrefetch::BACKWARD_PRE)
      if (FlatParamUnit* previous = engine->previous_unit(*unit))
        engine->unshard(*previous, ShardedModule::Phase::prefetch_backward);
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
    engine->unshard(*unit, ShardedModule::Phase::backward);
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
    engine_->record_forward(*unit_);
    engine_->unshard(*unit_, ShardedModule::Phase::forward);
    if (engine_->options().forward_prefetch)
      if (FlatParamUnit* next = engine_->next_unit(*unit_)) engine_->unshard(*next, ShardedModule::Phase::prefetch_forward);
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
  if (options_.device) device_ = *options_.device;
  TESSERA_CHECK(options_.deferred_init || device_ == options_.device.value_or(device_), "FSDP: the network is on ",
                device_, " but FSDPOptions::device says ", *options_.device);
  try {
    plan_units();
    check_plan();
  } catch (...) {
    for (const auto& item : network_->named_modules()) sdk::set_unit_runner(*item.value(), nullptr);
    throw;
  }
  TESSERA_CHECK(!options_.deferred_init || options_.ignored_modules.empty(), "[strategy] ignored_modules cannot be combined ",
                "with deferred_init = true: ignored parameters are not sharded, so they would be built whole anyway");
  if (options_.deferred_init) restore_arena_rng();
  for (auto& unit : units_) flatten(*unit);
  if (options_.deferred_init) {
    // Exempt norm layers are replicated: built whole (deterministic ones and zeros).
    torch::NoGradGuard no_grad;
    for (auto& m : norm_layers_) {
      for (auto& p : m->parameters(/*recurse=*/false))
        if (ignored_impls_.count(p.unsafeGetTensorImpl())) p.set_data(at::empty(p.sizes(), p.options().device(device_)));
      for (auto& b : m->buffers(/*recurse=*/false))
        if (in_arena(b)) b.set_data(at::zeros(b.sizes(), b.options().device(device_)));
      reset_known_module(*m);
    }
    for (const auto& item : network_->named_buffers())
      TESSERA_CHECK(!in_arena(item.value()), "deferred init: buffer '", item.key(),
                    "' belongs to no module tessera can re-initialise, and the values computed for it at construction ",
                    "were not kept; set [strategy] deferred_init = false for this model");
    release_arena();
  }
  cast_buffers();
  recycle_buffers_ = true;  // from the first step; what sharding freed is really freed
}

ShardedModule::~ShardedModule() {
  for (const auto& item : network_->named_modules()) sdk::set_unit_runner(*item.value(), nullptr);
}

at::TensorOptions ShardedModule::fp32() const {
  return at::TensorOptions().dtype(at::kFloat).device(device_);
}

at::TensorOptions ShardedModule::shard_options() const {
  if (!options_.cpu_offload || device_.is_cpu()) return fp32();
  return at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(true);
}

bool ShardedModule::is_ignored_module(const std::string& path, const torch::nn::Module& module) const {
  const auto& wanted = options_.ignored_modules;
  return std::find(wanted.begin(), wanted.end(), path) != wanted.end() ||
         std::find(wanted.begin(), wanted.end(), module.name()) != wanted.end();
}

void ShardedModule::find_ignored() {
  if (options_.ignored_modules.empty()) return;
  std::set<std::string> matched;
  std::vector<std::string> paths;
  for (const auto& item : network_->named_modules("", /*include_self=*/false)) {
    paths.push_back(item.key());
    const auto& wanted = options_.ignored_modules;
    for (const std::string& key : {item.key(), item.value()->name()})
      if (std::find(wanted.begin(), wanted.end(), key) != wanted.end()) {
        matched.insert(key);
        for (const auto& p : item.value()->parameters()) ignored_impls_.insert(p.unsafeGetTensorImpl());
      }
  }
  for (const auto& name : options_.ignored_modules)
    TESSERA_CHECK(matched.count(name), "[strategy] ignored_modules names '", name,
                  "', which is neither a module path nor a module class of this model", sdk::did_you_mean(name, paths),
                  "; module paths: [", sdk::join(paths), "]");
  std::unordered_map<const void*, std::size_t> index;
  for (const auto& item : network_->named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    if (!ignored_impls_.count(impl)) continue;
    auto it = index.find(impl);
    if (it != index.end()) {
      ignored_names_[it->second].push_back(item.key());
      continue;
    }
    index[impl] = ignored_params_.size();
    ignored_params_.push_back(item.value());
    ignored_names_.push_back({item.key()});
  }
}

namespace {
bool is_batch_norm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) || dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m);
}
}  // namespace

// PyTorch keeps BatchNorm out of FSDP's mixed precision (MixedPrecision's
// _module_classes_to_ignore): running statistics in half precision drift. Their buffers are
// never cast to buffer_dtype, and where param_dtype would lower their parameters those stay
// out of the flat units, replicated in their own dtype with all-reduced gradients (as
// ignored_modules are): a few numbers per channel.
void ShardedModule::exempt_norm_layers() {
  const auto& param_dtype = options_.mixed_precision.param_dtype;
  for (const auto& item : network_->named_modules("", /*include_self=*/false)) {
    if (!is_batch_norm(*item.value())) continue;
    norm_layers_.push_back(item.value());
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (!param_dtype || *param_dtype == p.value().scalar_type()) continue;
      if (!ignored_impls_.insert(p.value().unsafeGetTensorImpl()).second) continue;  // ignored already
      ignored_params_.push_back(p.value());
      ignored_names_.push_back({item.key() + "." + p.key()});
    }
  }
}

// buffer_dtype applies to the floating buffers of everything FSDP manages (not ignored
// modules, not norm layers); state dicts hold them in their own dtype again.
void ShardedModule::cast_buffers() {
  const auto& buffer_dtype = options_.mixed_precision.buffer_dtype;
  if (!buffer_dtype) return;
  std::set<const void*> exempt;
  std::vector<std::shared_ptr<torch::nn::Module>> exempt_modules = norm_layers_;
  for (const auto& item : network_->named_modules("", /*include_self=*/false))
    if (is_ignored_module(item.key(), *item.value())) exempt_modules.push_back(item.value());
  for (const auto& m : exempt_modules)
    for (const auto& b : m->buffers()) exempt.insert(b.unsafeGetTensorImpl());
  torch::NoGradGuard no_grad;
  for (auto& item : network_->named_buffers()) {
    at::Tensor& b = item.value();
    if (!b.is_floating_point() || b.scalar_type() == *buffer_dtype || exempt.count(b.unsafeGetTensorImpl())) continue;
    buffer_dtypes_[item.key()] = b.scalar_type();
    b.set_data(b.to(*buffer_dtype));
  }
}

at::Tensor ShardedModule::buffer_for_state(const std::string& name, const at::Tensor& buffer) const {
  auto it = buffer_dtypes_.find(name);
  return it == buffer_dtypes_.end() ? buffer.detach() : buffer.detach().to(it->second);
}

void ShardedModule::plan_units() {
  find_ignored();
  exempt_norm_layers();
  const auto& classes = options_.unit_classes;
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  std::vector<std::string> skipped;  // ignored modules: no unit inside them
  if (options_.auto_wrap_policy != "none") {
    for (const auto& item : network_->named_modules("", /*include_self=*/false)) {
      const std::string& name = item.key();
      auto under = [&](const std::string& prefix) { return name.rfind(prefix + ".", 0) == 0; };
      bool inside = std::any_of(chosen.begin(), chosen.end(), [&](const auto& c) { return under(c.first); }) ||
                    std::any_of(skipped.begin(), skipped.end(), under);
      if (inside) continue;
      if (is_ignored_module(name, *item.value())) {
        skipped.push_back(name);
        continue;
      }
      if (std::find(classes.begin(), classes.end(), item.value()->name()) == classes.end()) continue;
      std::int64_t count = 0;
      for (const auto& p : item.value()->parameters()) count += p.numel();
      if (options_.auto_wrap_policy == "size" && count < options_.min_num_params) continue;
      chosen.emplace_back(name, item.value());
    }
  }
  // A parameter used by several units (tied weights) goes to the root, which stays gathered
  // from the start of forward to the end of backward: every user sees it. PyTorch requires
  // tied users in one unit (pytorch/pytorch#77724); here they may sit anywhere.
  std::unordered_map<const void*, int> owners;
  for (const auto& [name, module] : chosen) {
    std::set<const void*> seen;
    for (const auto& p : module->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) ++owners[p.unsafeGetTensorImpl()];
  }
  std::unordered_map<const void*, std::pair<FlatParamUnit*, std::size_t>> placed;
  auto add = [&](FlatParamUnit& unit, const std::string& name, const at::Tensor& p) {
    if (ignored_impls_.count(p.unsafeGetTensorImpl())) return;
    auto it = placed.find(p.unsafeGetTensorImpl());
    if (it != placed.end()) {  // another name of a parameter already placed (or the same again)
      auto& names = it->second.first->names[it->second.second];
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
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
  unit_modules_ = chosen;
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
    u.replica_tag = "replica all-reduce of " + u.name;
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
  for (const auto& names : ignored_names_) out += "ignored " + names[0] + ";";
  return out;
}

namespace {
// FNV-1a: the same on every rank and build (std::hash need not be).
std::int64_t stable_hash(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}
}  // namespace

void ShardedModule::check_plan_over(Communicator& group, const std::vector<std::string>& entries) {
  if (group.size() == 1) return;
  const auto opts = fp32().dtype(at::kLong);
  std::string all_text;
  for (const auto& e : entries) all_text += e + ";";
  at::Tensor mine = at::tensor({static_cast<std::int64_t>(entries.size()), stable_hash(all_text)}, opts.device(at::kCPU))
                        .to(device_);
  at::Tensor all = at::empty({2 * group.size()}, opts);
  group.all_gather(all, mine, "FSDP unit plan check")->wait();
  all = all.cpu().view({group.size(), 2});
  std::int64_t most = 0;
  bool same = true;
  for (std::int64_t r = 0; r < group.size(); ++r) {
    most = std::max(most, all[r][0].item<std::int64_t>());
    same = same && all[r][1].item<std::int64_t>() == all[0][1].item<std::int64_t>();
  }
  if (same) return;
  // Every rank saw the mismatch, so every rank joins this second gather: per-unit hashes.
  at::Tensor each = at::zeros({most}, opts.device(at::kCPU));
  for (std::size_t i = 0; i < entries.size(); ++i) each[static_cast<std::int64_t>(i)] = stable_hash(entries[i]);
  at::Tensor every = at::empty({most * group.size()}, opts);
  group.all_gather(every, each.to(device_), "FSDP unit plan comparison")->wait();
  every = every.cpu().view({group.size(), most});
  for (std::int64_t i = 0; i < most; ++i)
    for (std::int64_t r = 0; r < group.size(); ++r) {
      if (every[r][i].item<std::int64_t>() == (i < static_cast<std::int64_t>(entries.size()) ? each[i].item<std::int64_t>() : 0))
        continue;
      const std::string here = i < static_cast<std::int64_t>(entries.size()) ? "'" + entries[i] + "'" : "nothing";
      TESSERA_FAIL("FSDP: the ranks planned different units; the first difference is unit #", i, ": this rank (",
                   group.rank(), " of its group) has ", here, ", rank ", r, " of the group has ",
                   every[r][i].item<std::int64_t>() == 0 ? "nothing" : "a different unit",
                   "; every rank must build the same model with the same [strategy] settings (units as name:numel: ",
                   all_text, ")");
    }
  TESSERA_FAIL("FSDP: the ranks planned different units (this rank: ", all_text, ")");
}

void ShardedModule::check_plan() {
  // Ranks that planned different units would deadlock in mismatched collectives: compare
  // first. Shard groups x replicate groups cover the world, so equal in both = equal everywhere.
  std::vector<std::string> entries;
  for (const auto& u : units_) {
    std::int64_t n = 0;
    for (const auto& p : u->params) n += p.numel();
    entries.push_back(u->name + ":" + std::to_string(n));
  }
  for (const auto& names : ignored_names_) entries.push_back("ignored " + names[0]);
  check_plan_over(*shard_group_, entries);
  check_plan_over(*replicate_group_, entries);
}

namespace {

// Deferred init: while the guard lives, every CPU allocation is served from one scratch
// block as large as the largest request so far (allocated through the previous allocator),
// so a model's construction costs one tensor's memory; the values written are garbage until
// ShardedModule re-points each unit's tensors at real memory and re-initialises them.
void arena_noop(void*) {}

class ArenaAllocator final : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)  // non-const, copy_data
  c10::DataPtr allocate(std::size_t n) override { return allocate_scratch(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(std::size_t n) const override { return allocate_scratch(n); }
#endif
  c10::DataPtr allocate_scratch(std::size_t n) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (n > capacity_ || blocks_.empty()) {
      blocks_.push_back(previous_->allocate(std::max<std::size_t>(n, 64)));
      capacity_ = std::max<std::size_t>(n, 64);
    }
    void* data = blocks_.back().get();
    return {data, data, &arena_noop, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void start() {
    std::lock_guard<std::mutex> lock(mutex_);
    // Materialising replays the generator from here, so units initialised in construction
    // order get exactly the values an eager build would.
    rng_state_ = at::detail::getDefaultCPUGenerator().get_state();
    previous_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, /*priority=*/255);
  }
  void stop() {
    c10::SetCPUAllocator(previous_, /*priority=*/255);
  }
  /// Frees the scratch blocks: only once no parameter or buffer points into them.
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.clear();
    capacity_ = 0;
  }
  void restore_rng() {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    if (rng_state_.defined()) generator.set_state(rng_state_);
  }

 private:
  mutable std::mutex mutex_;
  mutable std::vector<c10::DataPtr> blocks_;
  mutable std::size_t capacity_ = 0;
  c10::Allocator* previous_ = nullptr;
  at::Tensor rng_state_;
};

ArenaAllocator& arena() {
  static ArenaAllocator instance;
  return instance;
}

void release_arena() { arena().release(); }
void restore_arena_rng() { arena().restore_rng(); }

class DeferredInitGuard final : public sdk::Guard {
 public:
  DeferredInitGuard() { arena().start(); }
  ~DeferredInitGuard() override { arena().stop(); }
};

bool in_arena(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.device().is_cpu() && t.storage().data_ptr().get_deleter() == &arena_noop;
}

// LibTorch's own initialisers, the ones the modules ran in their constructors.
bool reset_known_module(torch::nn::Module& m) {
  if (auto* x = dynamic_cast<torch::nn::LinearImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::LayerNormImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::Conv1dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::Conv2dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::Conv3dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m)) return x->reset_parameters(), true;
  return false;
}

}  // namespace

bool has_deferred_tensors(const torch::nn::Module& network) {
  for (const auto& p : network.parameters()) if (in_arena(p)) return true;
  for (const auto& b : network.buffers()) if (in_arena(b)) return true;
  return false;
}

sdk::GuardPtr deferred_init_guard() { return std::make_unique<DeferredInitGuard>(); }

void ShardedModule::materialize(FlatParamUnit& u, at::Tensor& flat) {
  std::set<const void*> mine;
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    mine.insert(u.params[i].unsafeGetTensorImpl());
    u.params[i].set_data(flat.narrow(0, u.offsets[i], u.numels[i]).view(u.params[i].sizes()));
  }
  torch::NoGradGuard no_grad;
  for (const auto& item : network_->named_modules()) {
    torch::nn::Module& m = *item.value();
    bool here = false, elsewhere = false;
    for (const auto& p : m.parameters(/*recurse=*/false)) (mine.count(p.unsafeGetTensorImpl()) ? here : elsewhere) = true;
    if (!here) continue;
    TESSERA_CHECK(!elsewhere, "deferred init: the parameters of module '", item.key(), "' (", m.name(),
                  ") sit in different FSDP units (a tied weight?); build this model with [strategy] deferred_init = false");
    for (auto& b : m.buffers(/*recurse=*/false)) b.set_data(at::zeros(b.sizes(), b.options().device(device_)));
    if (options_.param_init_fn && options_.param_init_fn(item.key(), m)) continue;
    TESSERA_CHECK(reset_known_module(m), "deferred init: module '", item.key(), "' of class '", m.name(),
                  "' has parameters but no known initialiser (tessera re-initialises LibTorch's Linear, Embedding, ",
                  "LayerNorm, Conv1d-3d and BatchNorm1d-3d); initialise it in the model's init_parameters(), give its ",
                  "parameters to such modules or set [strategy] deferred_init = false");
  }
}

void ShardedModule::flatten(FlatParamUnit& u) {
  const std::int64_t world = shard_group_->size();
  torch::NoGradGuard no_grad;
  for (const auto& p : u.params) {
    u.offsets.push_back(u.numel);
    u.numels.push_back(p.numel());
    u.numel += p.numel();
  }
  u.padded = (u.numel + world - 1) / world * world;
  if (u.padded == 0) u.padded = world;
  u.shard_numel = u.padded / world;
  u.shard_offset = shard_group_->rank() * u.shard_numel;
  // The master shard keeps the parameters' own dtype: fp32 in the mixed modes, the half
  // dtype under *-true (the model never exists in fp32, as on one device).
  u.master_dtype = at::kFloat;
  if (!u.params.empty() && std::all_of(u.params.begin(), u.params.end(), [&](const at::Tensor& p) {
        return p.scalar_type() == u.params[0].scalar_type();
      }))
    u.master_dtype = u.params[0].scalar_type();
  u.compute_dtype = options_.mixed_precision.param_dtype.value_or(u.master_dtype);
  at::Tensor flat;
  if (options_.deferred_init) {
    // Initialised on the CPU, where an eager build draws its values, then moved: a GPU never
    // holds more than this unit of the unsharded model.
    flat = at::zeros({u.padded}, u.master_dtype);
    materialize(u, flat);
    flat = flat.to(device_);
  } else {
    flat = at::zeros({u.padded}, fp32().dtype(u.master_dtype));
    for (std::size_t i = 0; i < u.params.size(); ++i)
      flat.narrow(0, u.offsets[i], u.numels[i]).copy_(u.params[i].detach().reshape({-1}));
  }
  // A one-rank shard group (NO_SHARD, world 1) computing in fp32 where it keeps its shard
  // needs no second copy: the shard is the gathered buffer.
  const bool aliased = world == 1 && u.compute_dtype == u.master_dtype && shard_options().device() == device_;
  if (aliased) {
    u.shard = flat;
  } else {
    u.shard = at::empty({u.shard_numel}, shard_options().dtype(u.master_dtype));
    u.shard.copy_(flat.narrow(0, u.shard_offset, u.shard_numel));
  }
  // keep_low_precision_grads: the optimizer sees gradients in reduce_dtype, as PyTorch's
  // FSDP leaves them (for optimizers that step in low precision); otherwise fp32.
  const auto& policy = options_.mixed_precision;
  at::ScalarType grad_dtype =
      policy.keep_low_precision_grads ? policy.reduce_dtype.value_or(u.compute_dtype) : u.master_dtype;
  u.shard_grad = at::zeros({u.shard_numel}, shard_options().dtype(grad_dtype));
  // The buffers are built one at a time so that deferred init peaks at about one unit.
  u.full = flat.scalar_type() == u.compute_dtype ? flat : flat.to(u.compute_dtype);
  flat.reset();
  u.grad_full = at::empty({0}, fp32().dtype(u.compute_dtype));  // sized now, allocated in backward
  u.grad_full.unsafeGetTensorImpl()->set_sizes_contiguous({u.padded});
  for (std::size_t i = 0; i < u.params.size(); ++i)
    u.params[i].set_data(u.full.narrow(0, u.offsets[i], u.numels[i]).view(u.params[i].sizes()));
  u.gathered = true;
  reshard(u);
  install_gradient_hooks(u);
  // The optimizer steps on per-parameter views of the master shard.
  for (std::size_t i = 0; i < u.params.size(); ++i) {
    std::int64_t lo = std::max(u.offsets[i], u.shard_offset);
    std::int64_t hi = std::min(u.offsets[i] + u.numels[i], u.shard_offset + u.shard_numel);
    std::int64_t start = std::max<std::int64_t>(0, lo - u.shard_offset), length = std::max<std::int64_t>(0, hi - lo);
    at::Tensor view = u.shard.narrow(0, std::min(start, u.shard_numel), length);
    view.mutable_grad() = u.shard_grad.narrow(0, std::min(start, u.shard_numel), length);
    u.optimizer_views.push_back(view);
  }
}

// After set_data: a dtype or device change resets a parameter's gradient accumulator.
void ShardedModule::install_gradient_hooks(FlatParamUnit& u) {
  u.accumulators.clear();
  u.expected_grads = 0;
  for (auto& p : u.params) {
    if (!p.requires_grad()) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(p);
    accumulator->add_post_hook(std::make_unique<GradientReadyHook>(this, &u));
    u.accumulators.push_back(std::move(accumulator));
    ++u.expected_grads;
  }
}

namespace {
// Points unit u's parameters at `flat` (its gathered buffer, or a CPU copy of it).
void point_params_at(FlatParamUnit& u, const at::Tensor& flat) {
  for (std::size_t i = 0; i < u.params.size(); ++i)
    u.params[i].set_data(flat.narrow(0, u.offsets[i], u.numels[i]).view(u.params[i].sizes()));
}
}  // namespace

std::vector<sdk::NamedParameter> ShardedModule::optimizer_parameters() const {
  std::vector<sdk::NamedParameter> out;
  for (const auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i) out.push_back({u->names[i][0], u->optimizer_views[i]});
  for (std::size_t i = 0; i < ignored_params_.size(); ++i) out.push_back({ignored_names_[i][0], ignored_params_[i]});
  return out;
}

std::vector<std::string> ShardedModule::optimizer_parameter_names() const {
  std::vector<std::string> out;
  for (const auto& p : optimizer_parameters()) out.push_back(p.name);
  return out;
}

std::size_t ShardedModule::num_units() const { return units_.size(); }

std::int64_t ShardedModule::sharded_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& u : units_) bytes += static_cast<std::int64_t>(storage_bytes(u->shard) + storage_bytes(u->shard_grad));
  return bytes;
}

// Prefetch follows the order the units ran in the first forward (as PyTorch records it),
// not the order they were registered in; until then, registration order.
FlatParamUnit* ShardedModule::previous_unit(const FlatParamUnit& unit) const {
  if (order_frozen_) return unit.order_position > 0 ? order_[unit.order_position - 1] : nullptr;
  return unit.index > 0 && !unit.is_root ? units_[unit.index - 1].get() : nullptr;
}

FlatParamUnit* ShardedModule::next_unit(const FlatParamUnit& unit) const {
  if (order_frozen_)
    return unit.order_position >= 0 && unit.order_position + 1 < static_cast<std::int64_t>(order_.size())
               ? order_[unit.order_position + 1]
               : nullptr;
  return unit.index + 2 < units_.size() ? units_[unit.index + 1].get() : nullptr;  // never the root
}

void ShardedModule::record_forward(FlatParamUnit& unit) {
  if (order_frozen_ || unit.order_position >= 0) return;
  unit.order_position = static_cast<std::int64_t>(order_.size());
  order_.push_back(&unit);
}

void ShardedModule::freeze_order() {
  if (!order_.empty()) order_frozen_ = true;
}

void ShardedModule::unshard(FlatParamUnit& u, Phase phase) {
  if (u.gathered) return;
  if (u.full.is_same(u.shard)) {  // see flatten(): nothing to gather
    u.gathered = true;
    return;
  }
  if (!u.gather_handle) {
    alloc_storage(u.full);
    u.gather_input = u.shard.to(device_, u.compute_dtype, /*non_blocking=*/true);
    const bool backward = phase == Phase::backward || phase == Phase::prefetch_backward;
    u.gather_handle = shard_group_->all_gather(u.full, u.gather_input, backward ? u.backward_tag : u.forward_tag);
  }
  // A prefetch is waited for by the unshard that needs it.
  if (phase == Phase::prefetch_forward || phase == Phase::prefetch_backward) return;
  u.gather_handle->wait();
  u.gather_handle.reset();
  u.gather_input.reset();
  u.gathered = true;
}

void ShardedModule::reshard(FlatParamUnit& u) {
  if (u.gather_handle) {  // a prefetch nobody used (the unit did not run): finish it, then drop it
    u.gather_handle->wait();
    u.gather_handle.reset();
    u.gather_input.reset();
    u.gathered = true;
  }
  if (!u.gathered) return;
  // One-rank shard groups (NO_SHARD, world 1) keep the storage; the next unshard refreshes
  // it from the (stepped) shard.
  if (shard_group_->size() > 1) free_storage(u.full, recycle_buffers_);
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
  unshard(root, Phase::forward);
  if (training) {
    accumulating_ = true;
    attach_gradients(root);
  }
}

void ShardedModule::end_forward() {
  freeze_order();
  for (auto& u : units_) reshard(*u);
}

void ShardedModule::begin_backward(bool sync) {
  freeze_order();
  sync_ = sync;
  for (auto& u : units_) {
    u->pending_grads = u->expected_grads;
    u->reduced = false;
  }
}

void ShardedModule::on_gradient_ready(FlatParamUnit& u) {
  // Gradients of a unit whose pre-backward never ran would land outside the flat gradient.
  TESSERA_CHECK(u.grads_attached, "FSDP unit '", u.name, "' received gradients but was not run through ",
                "sdk::invoke in this forward: every module of an FSDP unit class must be called through sdk::invoke ",
                "(or leave its class out of [strategy] transformer_layer_cls)");
  if (sync_) reduce_gradients(u);
  if (!u.is_root) reshard(u);
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST)
    if (FlatParamUnit* previous = previous_unit(u)) unshard(*previous, Phase::prefetch_backward);
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
  // At most two reductions in flight: unit i's overlaps the backward of unit i-1, and the
  // unsharded gradients (plus the collective's buffers) of older units are freed instead of
  // piling up to a whole unsharded model by the end of backward.
  reducing_.push_back(&u);
  while (reducing_.size() > 2) {
    FlatParamUnit* oldest = reducing_.front();
    reducing_.pop_front();
    finish_reduction(*oldest);
  }
}

void ShardedModule::finish_reduction(FlatParamUnit& u) {
  torch::NoGradGuard no_grad;
  if (u.reduce_handle) u.reduce_handle->wait();
  u.reduce_handle.reset();
  if (replicate_group_->size() > 1) replicate_group_->all_reduce(u.reduce_output, sdk::ReduceOp::mean, u.replica_tag)->wait();
  if (u.shard_grad.device() == u.reduce_output.device()) {
    u.shard_grad.add_(u.reduce_output);
  } else if (!u.shard_grad_written && u.shard_grad.scalar_type() == u.reduce_output.scalar_type()) {
    // cpu_offload: the first gradient since the step goes to pinned memory without blocking
    // (finish_backward waits once for all of them); the stream orders reuse of the source.
    u.shard_grad.copy_(u.reduce_output, /*non_blocking=*/true);
    offload_copies_pending_ = true;
  } else {
    u.shard_grad.add_(u.reduce_output.to(u.shard_grad.device()));  // accumulating: on the CPU
  }
  u.shard_grad_written = true;
  u.reduce_input.reset();
  u.reduce_output.reset();
  for (auto& p : u.params) p.mutable_grad().reset();
  free_storage(u.grad_full);
  u.grads_attached = false;
}

void ShardedModule::finish_backward() {
  if (sync_) {
    // Units whose hooks did not all fire (parameters unused this step) reduce now, in the
    // same unit order on every rank; then every reduction finishes in launch order.
    for (auto& u : units_) reduce_gradients(*u);
    while (!reducing_.empty()) {
      FlatParamUnit* oldest = reducing_.front();
      reducing_.pop_front();
      finish_reduction(*oldest);
    }
    reduce_ignored_gradients();
    accumulating_ = false;
  }
#if TESSERA_WITH_CUDA
  if (offload_copies_pending_) c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();
#endif
  offload_copies_pending_ = false;
  for (auto& u : units_) reshard(*u);
}

void ShardedModule::reduce_ignored_gradients() {
  if (ignored_params_.empty()) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& p : ignored_params_) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // unused here, maybe used elsewhere
    grads.push_back(p.grad().reshape({-1}).to(at::kFloat));
  }
  at::Tensor flat = at::cat(grads);
  // Mean over shard group then replicate group = mean over the world.
  if (shard_group_->size() > 1) shard_group_->all_reduce(flat, sdk::ReduceOp::mean, "all-reduce of ignored parameters")->wait();
  if (replicate_group_->size() > 1)
    replicate_group_->all_reduce(flat, sdk::ReduceOp::mean, "replica all-reduce of ignored parameters")->wait();
  std::int64_t offset = 0;
  for (auto& p : ignored_params_) {
    p.mutable_grad().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

void ShardedModule::after_optimizer_step() {
  for (auto& p : ignored_params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
  for (auto& u : units_) {
    u->shard_grad.zero_();
    u->shard_grad_written = false;
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
    at::Tensor g = u->shard_grad.to(at::kFloat);
    at::Tensor part = (inf_norm ? g.abs().max() : g.abs().pow(norm_type).sum()).reshape({1}).to(device_);
    local = inf_norm ? at::maximum(local, part) : local + part;
  }
  // Replicas hold identical shards: the norm is over the shard group only.
  shard_group_->all_reduce(local, inf_norm ? sdk::ReduceOp::max : sdk::ReduceOp::sum, "clip_grad_norm")->wait();
  // Ignored parameters' gradients are the same on every rank: counted once, after the reduce.
  for (const auto& p : ignored_params_) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad().to(at::kFloat);
    if (inf_norm) local = at::maximum(local, g.abs().max().reshape({1}));
    else local += g.abs().pow(norm_type).sum();
  }
  double total = inf_norm ? local.item<double>() : std::pow(local.item<double>(), 1.0 / norm_type);
  double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1.0) {
    for (auto& u : units_) u->shard_grad.mul_(coefficient);
    for (auto& p : ignored_params_)
      if (p.grad().defined()) p.mutable_grad().mul_(coefficient);
  }
  return total;
}

sdk::StateDict ShardedModule::full_state_dict() {
  std::map<std::string, at::Tensor> by_name;
  const bool keep = !options_.rank0_only || shard_group_->rank() == 0;
  for (auto& u : units_) {
    at::Tensor full = at::empty({u->padded}, fp32().dtype(u->master_dtype));
    shard_group_->all_gather(full, u->shard.to(device_), "state_dict all-gather of " + u->name)->wait();
    if (!keep) continue;
    full = full.cpu();  // checkpoints hold CPU tensors
    for (std::size_t i = 0; i < u->params.size(); ++i) {
      at::Tensor value = full.narrow(0, u->offsets[i], u->numels[i]).view(u->params[i].sizes()).clone();
      for (const auto& name : u->names[i]) by_name[name] = value;
    }
  }
  sdk::StateDict state;
  if (!keep) return state;
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    for (const auto& name : ignored_names_[i]) by_name[name] = ignored_params_[i].detach().to(at::kCPU, at::kFloat).clone();
  for (const auto& item : network_->named_parameters()) state.insert(item.key(), by_name.at(item.key()));
  for (const auto& item : network_->named_buffers()) state.insert(item.key(), buffer_for_state(item.key(), item.value()));
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
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    for (const auto& name : ignored_names_[i]) {
      known.insert(name);
      const at::Tensor* value = state.find(name);
      if (value == nullptr) missing.push_back(name);
      else
        TESSERA_CHECK(value->sizes() == ignored_params_[i].sizes(), "checkpoint state_dict['", name, "'] has shape ",
                      value->sizes(), " but the model's parameter has shape ", ignored_params_[i].sizes());
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
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    if (const at::Tensor* value = state.find(ignored_names_[i][0])) ignored_params_[i].detach().copy_(*value);
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
  for (std::size_t i = 0; i < ignored_params_.size(); ++i, ++view) {
    if (local_state.contains(view)) {
      sdk::Checkpoint copy = sdk::make_checkpoint();
      for (const auto& entry : local_state.at(view).toGenericDict())
        copy.insert(entry.key(), entry.value().isTensor() ? c10::IValue(entry.value().toTensor().cpu()) : entry.value());
      state.insert(static_cast<std::int64_t>(names.size()), copy);
    }
    names.push_back(ignored_names_[i][0]);
  }
  sdk::Checkpoint out = sdk::make_checkpoint();
  if (!keep) return out;
  out.insert("state", state);
  out.insert("param_groups", local.at("param_groups"));
  out.insert("param_names", c10::List<std::string>(names));
  return out;
}

void ShardedModule::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full) {
  load_optimizer_state_dict(optimizer, shard_full_optim_state_dict(full), optimizer_parameter_names());
}

sdk::Checkpoint ShardedModule::shard_full_optim_state_dict(const sdk::Checkpoint& given) const {
  sdk::Checkpoint full = given;
  auto given_state = checkpoint_get(given, "state").toGenericDict();
  if (given_state.size() > 0 && given_state.begin()->key().isString())  // PARAM_NAME-keyed (rekeyed)
    full = rekey_optim_state_dict(given, OptimStateKeyType::PARAM_ID);
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
        mine.insert(key, value.reshape({-1}).narrow(0, length > 0 ? lo - u->offsets[i] : 0, length)
                             .to(u->shard.device()).clone());
      }
      state.insert(view, mine);
    }
  }
  for (std::size_t i = 0; i < ignored_params_.size(); ++i, ++view) {
    const std::string& name = ignored_names_[i][0];
    view_names.push_back(name);
    auto it = index_of.find(name);
    TESSERA_CHECK(it != index_of.end(), "optimizer state in the checkpoint has no entry for parameter '", name, "'");
    if (full_state.contains(it->second)) state.insert(view, full_state.at(it->second));
  }
  sdk::Checkpoint local = sdk::make_checkpoint();
  local.insert("state", state);
  local.insert("param_groups", checkpoint_get(full, "param_groups"));
  local.insert("param_names", c10::List<std::string>(view_names));
  return local;
}

namespace {

class ScopeExit final : public sdk::Guard {
 public:
  explicit ScopeExit(std::function<void()> on_exit) : on_exit_(std::move(on_exit)) {}
  ~ScopeExit() override { on_exit_(); }

 private:
  std::function<void()> on_exit_;
};

// Where this rank's piece of parameter i of `u` starts inside the parameter, and its length.
std::pair<std::int64_t, std::int64_t> owned_piece(const FlatParamUnit& u, std::size_t i) {
  std::int64_t lo = std::max(u.offsets[i], u.shard_offset);
  std::int64_t hi = std::min(u.offsets[i] + u.numels[i], u.shard_offset + u.shard_numel);
  if (hi <= lo) return {0, 0};
  return {lo - u.offsets[i], hi - lo};
}

c10::List<std::int64_t> piece_metadata(std::int64_t start, at::IntArrayRef shape) {
  c10::List<std::int64_t> out({start, static_cast<std::int64_t>(shape.size())});
  for (auto d : shape) out.push_back(d);
  return out;
}

}  // namespace

namespace {
// Writes this rank's `piece` of a summoned unit (as the caller left it) into the shard. Below
// the master dtype only the elements that differ from `before` (the piece as gathered) are
// written, so the others keep their exact master values; `before` undefined: all of them.
void write_back(FlatParamUnit& u, const at::Tensor& piece, const at::Tensor& before) {
  if (!before.defined()) return void(u.shard.copy_(piece));
  u.shard.copy_(at::where(piece.ne(before), piece.to(u.master_dtype), u.shard.to(piece.device())));
}
}  // namespace

sdk::GuardPtr ShardedModule::summon_full_params(bool writeback, bool rank0_only, bool offload_to_cpu) {
  TESSERA_CHECK(!(writeback && rank0_only), "summon_full_params(writeback = true, rank0_only = true) is not allowed ",
                "(as in PyTorch): ranks other than 0 hold no full parameters to write back");
  TESSERA_CHECK(!summoned_, "summon_full_params: already inside summon_full_params (nesting is not supported)");
  TESSERA_CHECK(!accumulating_, "summon_full_params between a training step's forward and its backward is not allowed");
  if (offload_to_cpu && !device_.is_cpu()) return summon_full_params_on_cpu(writeback, rank0_only);
  torch::NoGradGuard no_grad;
  std::vector<FlatParamUnit*> gathered;
  for (auto& u : units_) {
    unshard(*u, Phase::forward);  // collective on every rank, rank0_only or not
    gathered.push_back(u.get());
  }
  const bool rank0 = shard_group_->rank() == 0 && replicate_group_->rank() == 0;
  if (rank0_only && !rank0) {
    for (auto* u : gathered) reshard(*u);
    return nullptr;
  }
  auto snapshots = std::make_shared<std::vector<at::Tensor>>();
  if (writeback)
    for (auto* u : gathered)
      snapshots->push_back(u->compute_dtype == u->master_dtype ? at::Tensor()
                                                          : u->full.narrow(0, u->shard_offset, u->shard_numel).clone());
  summoned_ = true;
  return std::make_unique<ScopeExit>([this, gathered, snapshots, writeback] {
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < gathered.size(); ++k) {
      FlatParamUnit& u = *gathered[k];
      if (writeback) write_back(u, u.full.narrow(0, u.shard_offset, u.shard_numel), (*snapshots)[k]);
      reshard(u);
    }
    summoned_ = false;
  });
}

void ShardedModule::apply(const std::function<void(torch::nn::Module&)>& fn) {
  sdk::GuardPtr full = summon_full_params(/*writeback=*/true);
  torch::NoGradGuard no_grad;
  network_->apply([&](torch::nn::Module& m) { fn(m); });
}

// offload_to_cpu on a GPU: each unit is gathered, copied to the CPU and freed again, so the
// model is whole only in CPU memory; the parameters point at the CPU copies until the guard
// ends, then (with writeback) the changed elements go back into the shards.
sdk::GuardPtr ShardedModule::summon_full_params_on_cpu(bool writeback, bool rank0_only) {
  torch::NoGradGuard no_grad;
  const bool keep = !rank0_only || (shard_group_->rank() == 0 && replicate_group_->rank() == 0);
  auto copies = std::make_shared<std::vector<at::Tensor>>(), originals = std::make_shared<std::vector<at::Tensor>>();
  for (auto& u : units_) {
    unshard(*u, Phase::forward);  // collective on every rank
    copies->push_back(keep ? u->full.to(at::kCPU) : at::Tensor());
    originals->push_back(keep && writeback && u->compute_dtype != u->master_dtype
                             ? copies->back().narrow(0, u->shard_offset, u->shard_numel).clone()
                             : at::Tensor());
    if (keep) point_params_at(*u, copies->back());
    reshard(*u);
  }
  if (!keep) return nullptr;
  summoned_ = true;
  return std::make_unique<ScopeExit>([this, copies, originals, writeback] {
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < units_.size(); ++k) {
      FlatParamUnit& u = *units_[k];
      if (writeback) write_back(u, (*copies)[k].narrow(0, u.shard_offset, u.shard_numel), (*originals)[k]);
      point_params_at(u, u.full);
      install_gradient_hooks(u);
      u.gathered = false;  // one-rank shard groups keep `full`: refreshed from the shard on the next use
    }
    summoned_ = false;
  });
}

std::vector<std::string> ShardedModule::fsdp_modules(bool root_only) const {
  std::vector<std::string> out;
  if (!root_only)
    for (const auto& item : unit_modules_) out.push_back(item.first);
  out.push_back("");
  return out;
}

std::map<std::string, std::pair<std::int64_t, std::int64_t>> ShardedModule::owned_ranges() const {
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> out;
  for (const auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i)
      for (const auto& name : u->names[i]) out[name] = owned_piece(*u, i);
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    for (const auto& name : ignored_names_[i]) out[name] = {0, ignored_params_[i].numel()};
  for (const auto& item : network_->named_buffers()) out[item.key()] = {0, item.value().numel()};
  return out;
}

sdk::StateDict ShardedModule::sharded_state_dict() const {
  sdk::StateDict state;
  for (const auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i) {
      at::Tensor piece = u->optimizer_views[i].detach().to(at::kCPU).clone();
      for (const auto& name : u->names[i]) state.insert(name, piece);
    }
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    for (const auto& name : ignored_names_[i])
      state.insert(name, ignored_params_[i].detach().reshape({-1}).to(at::kCPU, at::kFloat).clone());
  for (const auto& item : network_->named_buffers())
    state.insert(item.key(), buffer_for_state(item.key(), item.value()).reshape({-1}).to(at::kCPU).clone());
  return state;
}

c10::IValue ShardedModule::shard_metadata() const {
  c10::impl::GenericDict meta(c10::StringType::get(), c10::ListType::ofInts());
  for (const auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i)
      for (const auto& name : u->names[i]) meta.insert(name, piece_metadata(owned_piece(*u, i).first, u->params[i].sizes()));
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    for (const auto& name : ignored_names_[i]) meta.insert(name, piece_metadata(0, ignored_params_[i].sizes()));
  for (const auto& item : network_->named_buffers()) meta.insert(item.key(), piece_metadata(0, item.value().sizes()));
  return meta;
}

void ShardedModule::load_sharded_state_dict(const sdk::StateDict& state) {
  auto piece_for = [&](const std::vector<std::string>& names, std::int64_t numel) -> const at::Tensor& {
    const at::Tensor* value = state.find(names[0]);
    TESSERA_CHECK(value != nullptr, "sharded checkpoint: no entry for '", names[0], "'");
    TESSERA_CHECK(value->numel() == numel, "sharded checkpoint: '", names[0], "' has ", value->numel(),
                  " elements for this rank, expected ", numel, ": it was re-cut for a different model or world size");
    return *value;
  };
  torch::NoGradGuard no_grad;
  for (auto& u : units_)
    for (std::size_t i = 0; i < u->params.size(); ++i)
      u->optimizer_views[i].copy_(piece_for(u->names[i], u->optimizer_views[i].numel()).reshape({-1}));
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    ignored_params_[i].detach().copy_(piece_for(ignored_names_[i], ignored_params_[i].numel()).view(ignored_params_[i].sizes()));
  for (auto& item : network_->named_buffers())
    item.value().copy_(piece_for({item.key()}, item.value().numel()).view(item.value().sizes()));
  // One-rank shard groups keep the gathered storage: refresh it from the loaded shards.
  for (auto& u : units_) u->gathered = false;
}

namespace {
std::string flat_param_key(const FlatParamUnit& u) { return u.is_root ? "flat_param" : u.name + ".flat_param"; }
}  // namespace

sdk::StateDict ShardedModule::local_state_dict() const {
  sdk::StateDict state;
  for (const auto& u : units_) state.insert(flat_param_key(*u), u->shard.detach().to(at::kCPU).clone());
  for (std::size_t i = 0; i < ignored_params_.size(); ++i)
    state.insert(ignored_names_[i][0], ignored_params_[i].detach().to(at::kCPU, at::kFloat).clone());
  for (const auto& item : network_->named_buffers())
    state.insert(item.key(), buffer_for_state(item.key(), item.value()).to(at::kCPU).clone());
  return state;
}

void ShardedModule::load_local_state_dict(const sdk::StateDict& state) {
  torch::NoGradGuard no_grad;
  for (auto& u : units_) {
    const at::Tensor* value = state.find(flat_param_key(*u));
    TESSERA_CHECK(value != nullptr && value->numel() == u->shard_numel, "LOCAL state dict: '", flat_param_key(*u), "' ",
                  value == nullptr ? std::string("is missing") : "has " + std::to_string(value->numel()) + " elements",
                  " but this rank's shard has ", u->shard_numel,
                  ": LOCAL checkpoints load only into the same world size, sharding strategy and model");
    u->shard.copy_(*value);
    u->gathered = false;
  }
  for (std::size_t i = 0; i < ignored_params_.size(); ++i) {
    const at::Tensor* value = state.find(ignored_names_[i][0]);
    TESSERA_CHECK(value != nullptr, "LOCAL state dict: no entry for ignored parameter '", ignored_names_[i][0], "'");
    ignored_params_[i].detach().copy_(*value);
  }
  for (auto& item : network_->named_buffers())
    if (const at::Tensor* value = state.find(item.key())) item.value().copy_(*value);
}

void ShardedModule::scatter_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full) {
  // Rank 0 pickles the whole dict once; every rank unpickles and keeps its shards.
  const bool rank0 = shard_group_->rank() == 0 && replicate_group_->rank() == 0;
  std::vector<char> bytes;
  if (rank0) bytes = torch::jit::pickle_save(full);
  at::Tensor size = at::tensor({static_cast<std::int64_t>(bytes.size())}, at::kLong).to(device_);
  auto spread = [&](at::Tensor& t, const std::string& tag) {
    // World rank 0 -> the first rank of every shard group -> every rank of each shard group.
    if (shard_group_->rank() == 0 && replicate_group_->size() > 1) replicate_group_->broadcast(t, 0, tag)->wait();
    if (shard_group_->size() > 1) shard_group_->broadcast(t, 0, tag)->wait();
  };
  spread(size, "scatter_full_optim_state_dict size");
  at::Tensor blob = rank0 ? at::from_blob(bytes.data(), {static_cast<std::int64_t>(bytes.size())}, at::kByte).to(device_).clone()
                          : at::empty({size.cpu().item<std::int64_t>()}, at::TensorOptions(at::kByte).device(device_));
  spread(blob, "scatter_full_optim_state_dict");
  blob = blob.cpu();
  std::vector<char> received(static_cast<const char*>(blob.data_ptr()), static_cast<const char*>(blob.data_ptr()) + blob.numel());
  load_full_optim_state_dict(optimizer, torch::jit::pickle_load(received).toGenericDict());
}

sdk::Checkpoint read_resharded_checkpoint(sdk::CheckpointIO& io, const std::string& path, std::int64_t shards,
                                          const std::map<std::string, std::pair<std::int64_t, std::int64_t>>* wanted) {
  sdk::Checkpoint out = sdk::make_checkpoint();
  std::map<std::string, at::Tensor> params;
  std::map<std::string, std::vector<std::int64_t>> shapes;
  std::map<std::string, at::Tensor> covered;  // which wanted elements some shard provided (replicas overlap)
  std::map<std::string, std::map<std::string, at::Tensor>> optim;  // name -> key -> piece
  std::map<std::string, c10::IValue> optim_scalars;                  // name + "\n" + key -> value
  c10::IValue param_groups, param_names;
  auto range_of = [&](const std::string& name, std::int64_t full_numel) -> std::pair<std::int64_t, std::int64_t> {
    if (wanted == nullptr) return {0, full_numel};
    auto it = wanted->find(name);
    return it == wanted->end() ? std::pair<std::int64_t, std::int64_t>{-1, 0} : it->second;
  };
  // Copies the overlap of a piece at [start, start + n) into the wanted range of `target`.
  auto place = [](at::Tensor& target, const at::Tensor& piece, std::int64_t start, std::pair<std::int64_t, std::int64_t> want,
                  at::Tensor* mask) {
    std::int64_t lo = std::max(start, want.first), hi = std::min(start + piece.numel(), want.first + want.second);
    if (hi <= lo) return;
    target.narrow(0, lo - want.first, hi - lo).copy_(piece.reshape({-1}).narrow(0, lo - start, hi - lo));
    if (mask) mask->narrow(0, lo - want.first, hi - lo).fill_(true);
  };
  for (std::int64_t r = 0; r < shards; ++r) {
    sdk::Checkpoint shard = io.load_checkpoint(path, sdk::ShardInfo{r, shards, true});
    const std::string where = "sharded checkpoint " + path + " shard " + std::to_string(r);
    TESSERA_CHECK(shard.contains(kShardMetadataKey), where, " has no '", kShardMetadataKey,
                  "': it was not written by the fsdp strategy with state_dict_type = \"sharded\"");
    auto meta = shard.at(kShardMetadataKey).toGenericDict();
    if (r == 0)
      for (const auto& entry : shard)
        if (entry.key().toStringRef() != "state_dict" && entry.key().toStringRef() != "optimizer_states" &&
            entry.key().toStringRef() != kShardMetadataKey)
          out.insert(entry.key(), entry.value());
    auto starts = [&](const std::string& name) {
      TESSERA_CHECK(meta.contains(name), where, ": '", name, "' has no entry in ", kShardMetadataKey);
      auto m = meta.at(name).toIntList();
      std::vector<std::int64_t> shape(m.begin() + 2, m.end());
      shapes[name] = shape;
      std::int64_t numel = 1;
      for (auto d : shape) numel *= d;
      return std::pair<std::int64_t, std::int64_t>{m.get(0), numel};
    };
    for (const auto& item : state_dict_from(checkpoint_get(shard, "state_dict"), where + " [state_dict]")) {
      auto [start, numel] = starts(item.key());
      auto want = range_of(item.key(), numel);
      if (want.first < 0) continue;
      auto it = params.find(item.key());
      if (it == params.end()) {
        it = params.emplace(item.key(), at::zeros({want.second}, item.value().options())).first;
        covered[item.key()] = at::zeros({want.second}, at::kBool);
      }
      place(it->second, item.value(), start, want, &covered[item.key()]);
    }
    if (!shard.contains("optimizer_states")) continue;
    auto states = shard.at("optimizer_states").toListRef();
    if (states.empty()) continue;
    sdk::Checkpoint opt = checkpoint_dict(states[0], where + " [optimizer_states][0]");
    auto names = checkpoint_get(opt, "param_names").toListRef();
    if (r == 0) {
      param_groups = checkpoint_get(opt, "param_groups");
      param_names = checkpoint_get(opt, "param_names");
    }
    for (const auto& entry : checkpoint_get(opt, "state").toGenericDict()) {
      const std::string name = names.at(static_cast<std::size_t>(entry.key().toInt())).toStringRef();
      auto [start, numel] = starts(name);
      auto want = range_of(name, numel);
      if (want.first < 0) continue;
      for (const auto& kv : entry.value().toGenericDict()) {
        const std::string key = kv.key().toStringRef();
        if (key == "step" || !kv.value().isTensor()) {
          optim_scalars[name + "\n" + key] = kv.value();
          continue;
        }
        auto& target = optim[name][key];
        if (!target.defined()) target = at::zeros({want.second}, kv.value().toTensor().options());
        place(target, kv.value().toTensor(), start, want, nullptr);
      }
    }
  }
  sdk::StateDict state;
  for (auto& [name, value] : params) {
    const std::int64_t have = covered[name].sum().item<std::int64_t>();
    TESSERA_CHECK(have == value.numel(), "sharded checkpoint ", path, ": the shards cover ", have, " of ",
                  value.numel(), " wanted elements of '", name, "'; a shard file is missing or from another save");
    state.insert(name, wanted ? value : value.view(shapes[name]));
  }
  out.insert("state_dict", to_ivalue(state));
  if (!param_names.isNone()) {
    c10::impl::GenericDict opt_state(c10::IntType::get(), c10::AnyType::get());
    auto names = param_names.toListRef();
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string name = names[i].toStringRef();
      sdk::Checkpoint entry = sdk::make_checkpoint();
      for (auto& [key, value] : optim[name]) entry.insert(key, wanted ? value : value.view(shapes[name]));
      for (const auto& [k, v] : optim_scalars)
        if (k.rfind(name + "\n", 0) == 0) entry.insert(k.substr(name.size() + 1), v);
      if (entry.size() > 0) opt_state.insert(static_cast<std::int64_t>(i), entry);
    }
    sdk::Checkpoint opt = sdk::make_checkpoint();
    opt.insert("state", opt_state);
    opt.insert("param_groups", param_groups);
    opt.insert("param_names", param_names);
    c10::impl::GenericList list(c10::AnyType::get());
    list.push_back(opt);
    out.insert("optimizer_states", list);
  }
  return out;
}

}  // namespace tessera::core::fsdp
