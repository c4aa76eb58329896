#include "fsdp/wrap.hpp"

#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/nn/modules/batchnorm.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/layer.hpp"

namespace tessera::core::fsdp {

bool is_ignored_module(const std::string& path, const torch::nn::Module& module,
                       const std::vector<std::string>& ignored_modules) {
  return std::find(ignored_modules.begin(), ignored_modules.end(), path) != ignored_modules.end() ||
         std::find(ignored_modules.begin(), ignored_modules.end(), module.name()) != ignored_modules.end();
}

bool is_batch_norm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) || dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) || dynamic_cast<const sdk::BatchNormLayer*>(&m);
}

namespace {

void add_replicated(UnitPlan& plan, const std::string& name, const at::Tensor& p) {
  plan.replicated_impls.insert(p.unsafeGetTensorImpl());
  plan.replicated.push_back(UnitParam{{name}, p});
}

void find_ignored(torch::nn::Module& network, const std::vector<std::string>& ignored, UnitPlan& plan) {
  if (ignored.empty()) return;
  std::set<std::string> matched;
  std::set<const void*> impls;
  std::vector<std::string> paths;
  for (const auto& item : network.named_modules("", /*include_self=*/false)) {
    paths.push_back(item.key());
    for (const std::string& key : {item.key(), item.value()->name()})
      if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) {
        matched.insert(key);
        for (const auto& p : item.value()->parameters()) impls.insert(p.unsafeGetTensorImpl());
      }
  }
  for (const auto& name : ignored)
    TESSERA_CHECK(matched.count(name), "[strategy] ignored_modules names '", name,
                  "', which is neither a module path nor a module class of this model", sdk::did_you_mean(name, paths),
                  "; module paths: [", sdk::join(paths), "]");
  std::unordered_map<const void*, std::size_t> index;  // tied: one entry, every name
  for (const auto& item : network.named_parameters()) {
    const void* impl = item.value().unsafeGetTensorImpl();
    if (!impls.count(impl)) continue;
    auto it = index.find(impl);
    if (it != index.end()) {
      plan.replicated[it->second].names.push_back(item.key());
      continue;
    }
    index[impl] = plan.replicated.size();
    add_replicated(plan, item.key(), item.value());
  }
}

// PyTorch keeps BatchNorm out of FSDP's mixed precision (MixedPrecision's
// _module_classes_to_ignore): running statistics in half precision drift. Their buffers are
// never cast to buffer_dtype, and where param_dtype would lower their parameters those stay
// out of the units, replicated in their own dtype with all-reduced gradients (as ignored
// modules are): a few numbers per channel.
void exempt_norm_layers(torch::nn::Module& network, const sdk::MixedPrecisionPolicy& policy, UnitPlan& plan) {
  for (const auto& item : network.named_modules("", /*include_self=*/false)) {
    if (!is_batch_norm(*item.value())) continue;
    plan.norm_layers.push_back(item.value());
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (!policy.param_dtype || *policy.param_dtype == p.value().scalar_type()) continue;
      if (plan.replicated_impls.count(p.value().unsafeGetTensorImpl())) continue;  // ignored already
      add_replicated(plan, item.key() + "." + p.key(), p.value());
    }
  }
}

bool wraps(const std::string& path, const torch::nn::Module& module, const FSDPOptions& options) {
  if (options.auto_wrap_policy == "custom") return options.custom_wrap_policy && options.custom_wrap_policy(path, module);
  const auto& classes = options.unit_classes;
  if (std::find(classes.begin(), classes.end(), module.name()) == classes.end()) return false;
  if (options.auto_wrap_policy != "size") return true;
  std::int64_t count = 0;
  for (const auto& p : module.parameters()) count += p.numel();
  return count >= options.min_num_params;
}

/// The distinct classes of `chosen`'s modules, for messages.
std::string unit_class_names(const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& chosen) {
  std::vector<std::string> names;
  for (const auto& c : chosen)
    if (std::find(names.begin(), names.end(), c.second->name()) == names.end()) names.push_back(c.second->name());
  return sdk::join(names);
}

}  // namespace

UnitPlan plan_units(torch::nn::Module& network, const FSDPOptions& options) {
  UnitPlan plan;
  find_ignored(network, options.ignored_modules, plan);
  exempt_norm_layers(network, options.mixed_precision, plan);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  std::vector<std::string> skipped;  // ignored modules: no unit inside them
  if (options.auto_wrap_policy != "none") {
    for (const auto& item : network.named_modules("", /*include_self=*/false)) {
      const std::string& name = item.key();
      auto under = [&](const std::string& prefix) { return name.rfind(prefix + ".", 0) == 0; };
      bool inside = std::any_of(chosen.begin(), chosen.end(), [&](const auto& c) { return under(c.first); }) ||
                    std::any_of(skipped.begin(), skipped.end(), under);
      if (inside) continue;
      if (is_ignored_module(name, *item.value(), options.ignored_modules)) {
        skipped.push_back(name);
        continue;
      }
      if (wraps(name, *item.value(), options)) chosen.emplace_back(name, item.value());
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
  plan.units.resize(chosen.size() + 1);
  std::unordered_map<const void*, std::pair<std::size_t, std::size_t>> placed;  // -> unit, param
  auto add = [&](std::size_t unit, const std::string& name, const at::Tensor& p) {
    if (plan.replicated_impls.count(p.unsafeGetTensorImpl())) return;
    auto it = placed.find(p.unsafeGetTensorImpl());
    if (it != placed.end()) {  // another name of a parameter already placed (or the same again)
      auto& names = plan.units[it->second.first].params[it->second.second].names;
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
      return;
    }
    placed[p.unsafeGetTensorImpl()] = {unit, plan.units[unit].params.size()};
    plan.units[unit].params.push_back(UnitParam{{name}, p});
  };
  const auto& recomputed = options.activation_checkpointing;
  for (std::size_t i = 0; i < chosen.size(); ++i) {
    const auto& [name, module] = chosen[i];
    PlannedUnit& unit = plan.units[i];
    unit.name = name;
    unit.module = module;
    unit.checkpointed = std::find(recomputed.begin(), recomputed.end(), module->name()) != recomputed.end();
    for (const auto& item : module->named_parameters())
      if (owners[item.value().unsafeGetTensorImpl()] == 1) add(i, name + "." + item.key(), item.value());
  }
  // Only units are recomputed: a class no unit has would be accepted and never checkpointed.
  for (const std::string& cls : recomputed) {
    const bool is_a_unit = std::any_of(chosen.begin(), chosen.end(), [&](const auto& c) { return c.second->name() == cls; });
    TESSERA_CHECK(is_a_unit, "[strategy] activation_checkpointing names '", cls, "', but no FSDP unit is one: ",
                  chosen.empty() ? "auto_wrap_policy (fsdp2: parallelize_fn) \"" + options.auto_wrap_policy + "\" makes no units"
                                 : "the " + std::to_string(chosen.size()) + " unit(s) are " + unit_class_names(chosen),
                  "; only units are recomputed in backward");
  }
  // Root: everything not placed yet, in the network's own order; also records every
  // additional name of the parameters placed in units.
  plan.units.back().name = "<root>";
  for (const auto& item : network.named_parameters()) add(chosen.size(), item.key(), item.value());
  return plan;
}

std::vector<std::string> UnitPlan::entries() const {
  std::vector<std::string> out;
  for (const auto& u : units) {
    std::int64_t n = 0;
    for (const auto& p : u.params) n += p.tensor.numel();
    out.push_back(u.name + ":" + std::to_string(n));
  }
  for (const auto& p : replicated) out.push_back("ignored " + p.names[0]);
  return out;
}

std::string unit_class_problem(const torch::nn::Module& network, const std::vector<std::string>& unit_classes) {
  std::vector<std::string> present;
  for (const auto& item : network.named_modules())
    if (std::find(present.begin(), present.end(), item.value()->name()) == present.end())
      present.push_back(item.value()->name());
  for (const auto& cls : unit_classes)
    if (std::find(present.begin(), present.end(), cls) == present.end())
      return "the model has no module class '" + cls + "'" + sdk::did_you_mean(cls, present) +
             "; the module classes in this network are [" + sdk::join(present) +
             "] (LibTorch names a module class by the name its constructor passes to torch::nn::Module(\"Name\"), "
             "otherwise by its demangled C++ type)";
  return "";
}

}  // namespace tessera::core::fsdp
