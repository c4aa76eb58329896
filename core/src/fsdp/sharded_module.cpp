#include "tessera/core/fsdp.hpp"

#include <set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "tessera/core/clip_grad.hpp"
#include "fsdp/flat_param.hpp"
#include "fsdp/param_group.hpp"
#include "fsdp/wrap.hpp"
#include "sharded_module_state.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/sharded.hpp"

namespace tessera::core::fsdp {

namespace {
// What model plugins and callbacks reach through sdk::summon_full_params and friends.
class SdkView final : public sdk::ShardedModel {
 public:
  explicit SdkView(ShardedModule& engine) : engine_(engine) {}
  sdk::GuardPtr summon_full_params(const sdk::SummonOptions& o) override {
    return engine_.summon_full_params(o.writeback, o.rank0_only, o.offload_to_cpu, o.with_grads);
  }
  void apply(const std::function<void(torch::nn::Module&)>& fn) override { engine_.apply(fn); }
  std::vector<std::string> fsdp_modules(bool root_only) const override { return engine_.fsdp_modules(root_only); }

 private:
  ShardedModule& engine_;
};
}  // namespace

ShardingStrategy parse_sharding_strategy(const std::string& name) {
  if (name == "FULL_SHARD") return ShardingStrategy::FULL_SHARD;
  if (name == "SHARD_GRAD_OP") return ShardingStrategy::SHARD_GRAD_OP;
  if (name == "NO_SHARD") return ShardingStrategy::NO_SHARD;
  if (name == "HYBRID_SHARD") return ShardingStrategy::HYBRID_SHARD;
  TESSERA_FAIL("unknown sharding_strategy '", name, "'");
}

BackwardPrefetch read_backward_prefetch(const sdk::Options& options) {
  static const std::vector<std::string> choices{"BACKWARD_PRE", "BACKWARD_POST", "none"};
  const sdk::Key key{"backward_prefetch",
                     "which unit's gather backward issues early: the previous unit's before (BACKWARD_PRE) or after "
                     "(BACKWARD_POST) this unit's gradient computation; true = BACKWARD_PRE, false = none"};
  if (const sdk::Value value = options.value(key.name); value.is<bool>()) {
    options.mark_used(key.name);
    options.note_key(key, "BACKWARD_PRE", &choices);  // tessera config lists it with its doc
    return value.as<bool>() ? BackwardPrefetch::BACKWARD_PRE : BackwardPrefetch::NONE;
  }
  const std::string name = options.get_choice(key, "BACKWARD_PRE", choices);
  if (name == "BACKWARD_POST") return BackwardPrefetch::BACKWARD_POST;
  return name == "none" ? BackwardPrefetch::NONE : BackwardPrefetch::BACKWARD_PRE;
}

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> network, const FSDPOptions& options,
                             CommunicatorPtr shard_group, CommunicatorPtr replicate_group)
    : d_(std::make_unique<State>()) {
  d_->network = std::move(network);
  d_->options = options;
  d_->shard_group = std::move(shard_group);
  d_->replicate_group = std::move(replicate_group);
  for (const auto& p : d_->network->parameters()) d_->device = p.device();
  if (d_->options.device) d_->device = *d_->options.device;
  TESSERA_CHECK(!d_->options.deferred_init || d_->options.ignored_modules.empty(),
                "[strategy] ignored_modules cannot be combined ",
                "with deferred_init = true: ignored parameters are not sharded, so they would be built whole anyway");
  if (const auto& group = d_->options.post_forward_group)
    TESSERA_CHECK(d_->options.sharding_strategy == ShardingStrategy::FULL_SHARD && d_->shard_group->size() % group->size() == 0,
                  "a post-forward group of ", group->size(), " ranks needs FULL_SHARD and a size dividing the shard ",
                  "group's ", d_->shard_group->size());
  build_units();
  cast_buffers();
  std::vector<at::Tensor> replicated;  // the ones whose gradients are all-reduced
  for (const auto& p : d_->replicated)
    if (p.tensor.requires_grad()) replicated.push_back(p.tensor);
  d_->scheduler = std::make_unique<Scheduler>(d_->units, std::move(replicated), d_->options, d_->shard_group,
                                              d_->replicate_group, d_->device);
  d_->scheduler->install();
  sdk::set_sharded_model(*d_->network, std::make_shared<SdkView>(*this));
}

ShardedModule::~ShardedModule() { sdk::set_sharded_model(*d_->network, nullptr); }

void ShardedModule::begin_forward(bool training) { d_->scheduler->begin_forward(training); }
void ShardedModule::end_forward() { d_->scheduler->end_forward(); }
void ShardedModule::begin_backward(bool sync) { d_->scheduler->begin_backward(sync); }
void ShardedModule::finish_backward() { d_->scheduler->finish_backward(); }
void ShardedModule::after_optimizer_step() { d_->scheduler->zero_grad(); }
std::int64_t ShardedModule::peak_units_gathered() const { return d_->scheduler->peak_units_gathered(); }
std::size_t ShardedModule::num_units() const { return d_->units.size(); }
bool ShardedModule::is_global_rank0() const { return d_->shard_group->rank() == 0 && d_->replicate_group->rank() == 0; }
at::TensorOptions ShardedModule::fp32() const { return at::TensorOptions().dtype(at::kFloat).device(d_->device); }
const FSDPOptions& ShardedModule::options() const { return d_->options; }

void ShardedModule::build_units() {
  UnitPlan plan = plan_units(*d_->network, d_->options);
  // Ranks that planned different units would deadlock in mismatched collectives: compare
  // first. Shard groups x replicate groups cover the world, so equal in both = equal everywhere.
  const std::vector<std::string> entries = plan.entries();
  check_plan_agreement(*d_->shard_group, entries, d_->device, "FSDP", "unit");
  check_plan_agreement(*d_->replicate_group, entries, d_->device, "FSDP", "unit");
  d_->replicated = plan.replicated;
  d_->norm_layers = plan.norm_layers;

  FlatParamHandle::Config config;
  config.rank = d_->shard_group->rank();
  config.world = d_->shard_group->size();
  config.device = d_->device;
  config.shard_options = fp32();
  if (d_->options.cpu_offload && !d_->device.is_cpu())
    config.shard_options = at::TensorOptions().dtype(at::kFloat).device(at::kCPU).pinned_memory(true);
  config.mixed_precision = d_->options.mixed_precision;

  if (d_->options.deferred_init) replay_deferred_init_rng();
  for (std::size_t i = 0; i < plan.units.size(); ++i) {
    PlannedUnit& planned = plan.units[i];
    auto unit = std::make_unique<FSDPUnit>();
    unit->name = planned.name;
    unit->index = i;
    unit->is_root = i + 1 == plan.units.size();
    unit->checkpointed = planned.checkpointed;
    unit->module = planned.module;
    unit->forward_tag = "forward all-gather of " + unit->name;
    unit->backward_tag = "backward all-gather of " + unit->name;
    unit->reduce_tag = "reduce-scatter of " + unit->name;
    unit->replica_tag = "replica all-reduce of " + unit->name;
    if (unit->module) sdk::set_unit_runner(*unit->module, nullptr);
    std::set<const void*> impls;
    for (const auto& p : planned.params) impls.insert(p.tensor.unsafeGetTensorImpl());
    std::unique_ptr<FlatParamHandle> handle =
        d_->options.layout == ParamLayout::per_parameter
            ? std::make_unique<FSDPParamGroup>(std::move(planned.params), config)
            : std::make_unique<FlatParamHandle>(std::move(planned.params), config);
    at::Tensor flat;
    if (d_->options.deferred_init) {
      // Initialised on the CPU, where an eager build draws its values, then moved: a GPU never
      // holds more than this unit of the unsharded model.
      torch::NoGradGuard no_grad;
      flat = at::zeros({handle->padded_numel()}, handle->master_dtype());
      handle->point_params_at(flat);
      initialize_modules(*d_->network, impls, d_->device, d_->options.param_init_fn, d_->options.tp_rank,
                         d_->options.tp_size);
      flat = flat.to(d_->device);
    } else {
      flat = handle->flatten_params();
    }
    handle->shard(std::move(flat));
    unit->layout = std::move(handle);
    d_->units.push_back(std::move(unit));
  }
  if (!d_->options.deferred_init) return;
  // Norm layers kept out of the units are replicated: built whole (deterministic ones and
  // zeros). One inside a unit was initialised with it, and its unsharded memory is freed now.
  torch::NoGradGuard no_grad;
  for (auto& m : d_->norm_layers) {
    bool outside_units = false;
    for (auto& p : m->parameters(/*recurse=*/false))
      if (plan.replicated_impls.count(p.unsafeGetTensorImpl())) {
        p.set_data(at::empty(p.sizes(), p.options().device(d_->device)));
        outside_units = true;
      }
    for (auto& b : m->buffers(/*recurse=*/false))
      if (is_deferred(b)) {
        b.set_data(at::zeros(b.sizes(), b.options().device(d_->device)));
        outside_units = true;
      }
    if (outside_units) reset_known_module(*m);
  }
  for (const auto& item : d_->network->named_buffers())
    TESSERA_CHECK(!is_deferred(item.value()), "deferred init: buffer '", item.key(),
                  "' belongs to no module tessera can re-initialise, and the values computed for it at construction ",
                  "were not kept; set [strategy] deferred_init = false for this model");
  release_deferred_init_memory();
}

// buffer_dtype applies to the floating buffers of everything FSDP manages (not ignored
// modules, not norm layers); state dicts hold them in their own dtype again.
void ShardedModule::cast_buffers() {
  const auto& buffer_dtype = d_->options.mixed_precision.buffer_dtype;
  if (!buffer_dtype) return;
  std::set<const void*> exempt;
  std::vector<std::shared_ptr<torch::nn::Module>> exempt_modules = d_->norm_layers;
  for (const auto& item : d_->network->named_modules("", /*include_self=*/false))
    if (is_ignored_module(item.key(), *item.value(), d_->options.ignored_modules))
      exempt_modules.push_back(item.value());
  for (const auto& m : exempt_modules)
    for (const auto& b : m->buffers()) exempt.insert(b.unsafeGetTensorImpl());
  torch::NoGradGuard no_grad;
  for (auto& item : d_->network->named_buffers()) {
    at::Tensor& b = item.value();
    if (!b.is_floating_point() || b.scalar_type() == *buffer_dtype || exempt.count(b.unsafeGetTensorImpl())) continue;
    d_->buffer_dtypes[item.key()] = b.scalar_type();
    b.set_data(b.to(*buffer_dtype));
  }
}

at::Tensor ShardedModule::buffer_for_state(const std::string& name, const at::Tensor& buffer) const {
  auto it = d_->buffer_dtypes.find(name);
  return it == d_->buffer_dtypes.end() ? buffer.detach() : buffer.detach().to(it->second);
}

std::vector<sdk::NamedParameter> ShardedModule::optimizer_parameters() const {
  // A frozen parameter (requires_grad false, e.g. a fine-tuned model's backbone) is left out, as
  // by single device and DDP: its piece of the shard gets no gradient, and an optimizer holding
  // it would still move it (AdamW's weight decay) and keep moments for it.
  std::vector<sdk::NamedParameter> out;
  for (const auto& u : d_->units) {
    const auto& params = u->layout->params();
    const auto& tensors = u->layout->optimizer_tensors();
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].tensor.requires_grad()) out.push_back({params[i].names[0], tensors[i]});
  }
  for (const auto& p : d_->replicated)
    if (p.tensor.requires_grad()) out.push_back({p.names[0], p.tensor});
  return out;
}


double ShardedModule::clip_grad_norm(double max_norm, double norm_type) {
  // Replicas hold identical shards: the norm is reduced over the shard group only.
  std::vector<at::Tensor> sharded, replicated;
  for (const auto& u : d_->units)
    for (const auto& g : u->layout->sharded_grads()) sharded.push_back(g);
  for (const auto& p : d_->replicated) replicated.push_back(p.tensor.grad());
  return core::clip_grad_norm(sharded, replicated, max_norm, norm_type, d_->shard_group.get(), d_->device);
}

std::string ShardedModule::plan() const {
  std::string out;
  for (const auto& u : d_->units) {
    std::int64_t n = 0;
    for (const auto& p : u->layout->params()) n += p.tensor.numel();
    out += u->name + ":" + std::to_string(n) + ";";
  }
  for (const auto& p : d_->replicated) out += "ignored " + p.names[0] + ";";
  return out;
}

std::vector<std::string> ShardedModule::fsdp_modules(bool root_only) const {
  std::vector<std::string> out;
  if (!root_only)
    for (const auto& u : d_->units)
      if (!u->is_root) out.push_back(u->name);
  out.push_back("");
  return out;
}

std::vector<std::string> ShardedModule::replicated_parameter_names() const {
  std::vector<std::string> out;
  for (const auto& p : d_->replicated) out.push_back(p.names[0]);
  return out;
}

std::int64_t ShardedModule::sharded_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& u : d_->units) bytes += u->layout->sharded_bytes();
  return bytes;
}

FSDPUnit& ShardedModule::unit_named(const std::string& name) {
  for (auto& u : d_->units)
    if (!u->is_root && u->name == name) return *u;
  TESSERA_FAIL("'", name, "' is not an FSDP unit; the units are ", sdk::join(fsdp_modules(/*root_only=*/false)));
}

void ShardedModule::set_modules_to_forward_prefetch(const std::string& unit, const std::vector<std::string>& targets) {
  std::vector<FSDPUnit*> units;
  for (const auto& t : targets) units.push_back(&unit_named(t));
  unit_named(unit).forward_prefetch = std::move(units);
}

void ShardedModule::set_modules_to_backward_prefetch(const std::string& unit, const std::vector<std::string>& targets) {
  std::vector<FSDPUnit*> units;
  for (const auto& t : targets) units.push_back(&unit_named(t));
  unit_named(unit).backward_prefetch = std::move(units);
}

}  // namespace tessera::core::fsdp
