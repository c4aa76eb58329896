// Optimizer state in PyTorch's format: LibTorch's optimizers to and from Python's
// optimizer.state_dict() layout (with parameter names), re-keyed and re-ordered for the
// checkpoints of every strategy.
#include <algorithm>
#include <map>
#include <set>


#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/optimizer.hpp"

namespace tessera::core {

using c10::IValue;

namespace {

using sdk::optimizer_state_key;


}  // namespace

const torch::optim::OptimizerParamState* optimizer_param_state(const torch::optim::Optimizer& optimizer,
                                                              const at::Tensor& param) {
  auto it = optimizer.state().find(optimizer_state_key(param));
  return it == optimizer.state().end() ? nullptr : it->second.get();
}

std::vector<std::string> optimizer_order_names(const torch::optim::Optimizer& optimizer,
                                               const std::vector<sdk::NamedParameter>& params) {
  std::unordered_map<const c10::TensorImpl*, const std::string*> name_of;
  for (const auto& p : params) name_of.emplace(p.tensor.unsafeGetTensorImpl(), &p.name);
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g)
    for (const auto& t : optimizer.param_groups()[g].params()) {
      auto it = name_of.find(t.unsafeGetTensorImpl());
      TESSERA_CHECK(it != name_of.end(), "the optimizer from configure_optimizers() steps on a tensor of shape ",
                    t.sizes(), " (param group ", g, ") that is not one of the parameters it was given: build it ",
                    "from its `params` argument (under FSDP, the shards)");
      TESSERA_CHECK(seen.insert(*it->second).second, "the optimizer from configure_optimizers() steps on parameter '",
                    *it->second, "' twice (param group ", g, " and an earlier one)");
      names.push_back(*it->second);
    }
  std::vector<std::string> missing;
  for (const auto& p : params)
    if (!seen.count(p.name)) missing.push_back(p.name);
  TESSERA_CHECK(missing.empty(), "the optimizer from configure_optimizers() leaves out ", missing.size(),
                " of the parameters it was given (", sdk::join(missing), "): put every one in a param group ",
                "(with lr 0 to keep it fixed), so that checkpoints hold its state");
  return names;
}

sdk::Checkpoint optimizer_state_dict(const torch::optim::Optimizer& optimizer,
                                     const std::vector<std::string>& param_names) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    sdk::Checkpoint saved_group = sdk::hyper_parameters(group.options());
    c10::List<std::int64_t> indices;
    for (const auto& p : group.params()) {
      auto it = optimizer.state().find(optimizer_state_key(p));
      if (it != optimizer.state().end()) state.insert(index, sdk::parameter_state(*it->second));
      indices.push_back(index++);
    }
    saved_group.insert("params", indices);
    groups.push_back(saved_group);
  }
  TESSERA_CHECK(param_names.empty() || static_cast<std::int64_t>(param_names.size()) == index,
                "optimizer has ", index, " parameters but ", param_names.size(), " names were given");
  sdk::Checkpoint out = sdk::make_checkpoint();
  out.insert("state", state);
  out.insert("param_groups", groups);
  out.insert("param_names", c10::List<std::string>(param_names));
  return out;
}

namespace {

std::vector<std::string> saved_param_names(const sdk::Checkpoint& saved) {
  std::vector<std::string> names;
  if (!saved.contains("param_names")) return names;
  const IValue& value = saved.at("param_names");
  TESSERA_CHECK(value.isList(), "optimizer state 'param_names' is not a list of strings");
  for (const IValue& name : value.toListRef()) {
    TESSERA_CHECK(name.isString(), "optimizer state 'param_names' holds a non-string entry");
    names.push_back(name.toStringRef());
  }
  return names;
}

bool keyed_by_name(const sdk::Checkpoint& saved) {
  auto state = checkpoint_dict(checkpoint_get(saved, "state"), "optimizer state 'state'");
  if (state.size() > 0) return state.begin()->key().isString();
  for (const IValue& group : checkpoint_get(saved, "param_groups").toListRef()) {
    sdk::Checkpoint g = checkpoint_dict(group, "optimizer param group");
    auto params = checkpoint_get(g, "params").toListRef();
    if (!params.empty()) return params[0].isString();
  }
  return false;
}

/// The saved state as PARAM_ID plus the name of each index (empty if unnamed).
std::pair<c10::impl::GenericDict, std::vector<std::string>> state_by_index(const sdk::Checkpoint& saved) {
  sdk::Checkpoint by_id = keyed_by_name(saved) ? rekey_optim_state_dict(saved, OptimStateKeyType::PARAM_ID) : saved;
  auto state = checkpoint_dict(checkpoint_get(by_id, "state"), "optimizer state 'state'");
  for (const auto& item : state)
    TESSERA_CHECK(item.key().isInt() && item.value().isGenericDict(),
                  "optimizer state 'state' must map parameter indices to dictionaries; found key ",
                  item.key().tagKind());
  return {state, saved_param_names(by_id)};
}


}  // namespace

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& saved,
                               const std::vector<std::string>& param_names) {
  stage_optimizer_state_dict(optimizer, saved, param_names)();
}

std::function<void()> stage_optimizer_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& saved,
                                                 const std::vector<std::string>& param_names) {
  auto [state, saved_names] = state_by_index(saved);
  std::map<std::string, std::int64_t> saved_index;
  for (std::size_t i = 0; i < saved_names.size(); ++i) saved_index[saved_names[i]] = static_cast<std::int64_t>(i);
  const bool by_name = !saved_names.empty() && !param_names.empty();

  std::int64_t count = 0;
  for (const auto& group : optimizer.param_groups()) count += static_cast<std::int64_t>(group.params().size());
  TESSERA_CHECK(by_name || saved_names.empty() || static_cast<std::int64_t>(saved_names.size()) == count,
                "optimizer state in the checkpoint is for ", saved_names.size(), " parameters but the optimizer has ",
                count);

  // Plan first, then apply: a mismatch must leave the optimizer untouched.
  std::vector<std::pair<at::Tensor, sdk::Checkpoint>> plan;
  std::set<std::int64_t> consumed;  // saved entries that went to a parameter
  const sdk::OptimizerKind kind = sdk::optimizer_kind(optimizer);
  const std::set<std::string> kept(kind.state.begin(), kind.state.end());
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const std::int64_t i = index++;
      const std::string name = i < static_cast<std::int64_t>(param_names.size()) ? param_names[i] : std::to_string(i);
      std::int64_t source = i;
      if (by_name) {
        auto it = saved_index.find(name);
        TESSERA_CHECK(it != saved_index.end(), "optimizer state in the checkpoint has no entry for parameter '", name,
                      "'", sdk::did_you_mean(name, saved_names));
        source = it->second;
      }
      if (!state.contains(source)) continue;  // the parameter had no state yet (never stepped)
      consumed.insert(source);
      sdk::Checkpoint entry = state.at(source).toGenericDict();
      for (const std::string& key : kind.required_state)
        TESSERA_CHECK(entry.contains(key), "optimizer state of parameter '", name, "' has no '", key,
                      "': the checkpoint was written by a different optimizer than this ", kind.name);
      for (const auto& item : entry)
        TESSERA_CHECK(kept.empty() || kept.count(item.key().toStringRef()), "optimizer state '",
                      item.key().toStringRef(), "' of parameter '", name,
                      "' in the checkpoint is not one this optimizer keeps (it would be dropped): written by "
                      "another optimizer?");
      sdk::Checkpoint moved = sdk::make_checkpoint();
      for (const auto& item : entry) {
        const std::string key = item.key().toStringRef();
        if (key == "step") {
          moved.insert(key, item.value());
          continue;
        }
        TESSERA_CHECK(item.value().isTensor(), "optimizer state '", key, "' of parameter '", name,
                      "' is not a tensor");
        at::Tensor t = item.value().toTensor();
        TESSERA_CHECK(t.sizes() == p.sizes(), "optimizer state '", key, "' of parameter '", name, "' has shape ",
                      t.sizes(), " in the checkpoint but the parameter has shape ", p.sizes());
        moved.insert(key, t.is_floating_point() ? t.to(p.device(), p.scalar_type()) : t.to(p.device()));
      }
      plan.emplace_back(p, moved);
    }
  }
  // Every saved entry was consumed: state for a parameter this optimizer does not have would
  // otherwise be dropped silently.
  for (const auto& item : state)
    if (!consumed.count(item.key().toInt())) {
      const std::int64_t i = item.key().toInt();
      const std::string name = i >= 0 && i < static_cast<std::int64_t>(saved_names.size())
                                   ? saved_names[static_cast<std::size_t>(i)]
                                   : std::to_string(i);
      TESSERA_FAIL("optimizer state in the checkpoint has an entry for parameter '", name,
                   "', which this optimizer does not step on: it would be dropped (a different model?)");
    }
  auto groups = checkpoint_get(saved, "param_groups").toListRef();
  const bool same_groups = groups.size() == optimizer.param_groups().size();
  if (same_groups) {
    for (std::size_t g = 0; g < groups.size(); ++g)
      sdk::set_hyper_parameters(optimizer.param_groups()[g].options(), checkpoint_dict(groups[g], "optimizer param group"));
  } else if (!groups.empty() && !optimizer.param_groups().empty()) {
    // Regrouped optimizer (e.g. different no-decay split): keep its own settings but the saved lr.
    sdk::set_hyper_parameters(optimizer.param_groups()[0].options(), checkpoint_dict(groups[0], "optimizer param group"));
  }
  return [&optimizer, plan = std::move(plan)] {
    for (const auto& [p, entry] : plan) optimizer.state()[optimizer_state_key(p)] = sdk::make_parameter_state(optimizer, entry);
  };
}

sdk::Checkpoint rekey_optim_state_dict(const sdk::Checkpoint& saved, OptimStateKeyType key_type) {
  const bool by_name = keyed_by_name(saved);
  if (by_name == (key_type == OptimStateKeyType::PARAM_NAME)) return saved.copy();
  auto state = checkpoint_dict(checkpoint_get(saved, "state"), "optimizer state 'state'");
  auto groups = checkpoint_get(saved, "param_groups").toListRef();
  sdk::Checkpoint out = sdk::make_checkpoint();
  c10::impl::GenericList new_groups(c10::AnyType::get());
  std::vector<std::string> names;
  if (key_type == OptimStateKeyType::PARAM_NAME) {
    names = saved_param_names(saved);
    TESSERA_CHECK(!names.empty() || state.size() == 0,
                  "optimizer state has no 'param_names': it cannot be keyed by parameter name");
    auto name_of = [&](const IValue& id) -> const std::string& {
      TESSERA_CHECK(id.isInt() && id.toInt() >= 0 && id.toInt() < static_cast<std::int64_t>(names.size()),
                    "optimizer state refers to parameter index ", id, " but 'param_names' has ", names.size(),
                    " entries");
      return names[static_cast<std::size_t>(id.toInt())];
    };
    c10::impl::GenericDict new_state(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : state) new_state.insert(name_of(item.key()), item.value());
    for (const IValue& group : groups) {
      sdk::Checkpoint g = checkpoint_dict(group, "optimizer param group").copy();
      c10::List<std::string> params;
      for (const IValue& id : checkpoint_get(g, "params").toListRef()) params.push_back(name_of(id));
      g.insert_or_assign("params", params);
      new_groups.push_back(g);
    }
    out.insert("state", new_state);
  } else {
    std::map<std::string, std::int64_t> id_of;
    for (const IValue& group : groups)
      for (const IValue& name : checkpoint_get(checkpoint_dict(group, "optimizer param group"), "params").toListRef()) {
        id_of.emplace(name.toStringRef(), static_cast<std::int64_t>(names.size()));
        names.push_back(name.toStringRef());
      }
    c10::impl::GenericDict new_state(c10::IntType::get(), c10::AnyType::get());
    for (const auto& item : state) {
      auto it = id_of.find(item.key().toStringRef());
      TESSERA_CHECK(it != id_of.end(), "optimizer state has an entry for '", item.key().toStringRef(),
                    "', which no param group lists");
      new_state.insert(it->second, item.value());
    }
    std::int64_t next = 0;
    for (const IValue& group : groups) {
      sdk::Checkpoint g = checkpoint_dict(group, "optimizer param group").copy();
      c10::List<std::int64_t> params;
      for (std::size_t k = 0, n = checkpoint_get(g, "params").toListRef().size(); k < n; ++k) params.push_back(next++);
      g.insert_or_assign("params", params);
      new_groups.push_back(g);
    }
    out.insert("state", new_state);
  }
  out.insert("param_groups", new_groups);
  out.insert("param_names", c10::List<std::string>(names));
  return out;
}

sdk::Checkpoint optimizer_states_in_model_order(const sdk::Checkpoint& checkpoint) {
  if (!checkpoint.contains("optimizer_states") || !checkpoint.contains("state_dict")) return checkpoint;
  std::map<std::string, std::size_t> rank_of;  // position of each name in the model
  for (const auto& item : state_dict_from(checkpoint.at("state_dict"), "checkpoint [state_dict]"))
    rank_of.emplace(item.key(), rank_of.size());
  c10::impl::GenericList states(c10::AnyType::get());
  for (const IValue& value : checkpoint.at("optimizer_states").toListRef()) {
    sdk::Checkpoint opt = checkpoint_dict(value, "checkpoint [optimizer_states]");
    const std::vector<std::string> names = saved_param_names(opt);
    if (names.empty() || keyed_by_name(opt)) {
      states.push_back(opt);
      continue;
    }
    auto position = [&](std::int64_t i) {
      auto it = rank_of.find(names.at(static_cast<std::size_t>(i)));
      return it == rank_of.end() ? rank_of.size() + static_cast<std::size_t>(i) : it->second;
    };
    // New indices: group after group, each group's parameters in model order.
    std::map<std::int64_t, std::int64_t> new_index;
    std::vector<std::string> new_names;
    c10::impl::GenericList groups(c10::AnyType::get());
    for (const IValue& g : checkpoint_get(opt, "param_groups").toListRef()) {
      sdk::Checkpoint group = checkpoint_dict(g, "optimizer param group").copy();
      std::vector<std::int64_t> ids;
      for (const IValue& id : checkpoint_get(group, "params").toListRef()) ids.push_back(id.toInt());
      std::stable_sort(ids.begin(), ids.end(), [&](std::int64_t a, std::int64_t b) { return position(a) < position(b); });
      c10::List<std::int64_t> params;
      for (std::int64_t id : ids) {
        new_index[id] = static_cast<std::int64_t>(new_names.size());
        params.push_back(static_cast<std::int64_t>(new_names.size()));
        new_names.push_back(names.at(static_cast<std::size_t>(id)));
      }
      group.insert_or_assign("params", params);
      groups.push_back(group);
    }
    c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
    std::vector<std::pair<std::int64_t, IValue>> entries;
    for (const auto& item : checkpoint_dict(checkpoint_get(opt, "state"), "optimizer state 'state'"))
      entries.emplace_back(new_index.at(item.key().toInt()), item.value());
    std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [index, entry] : entries) state.insert(index, entry);
    sdk::Checkpoint out = opt.copy();
    out.insert_or_assign("state", state);
    out.insert_or_assign("param_groups", groups);
    out.insert_or_assign("param_names", c10::List<std::string>(new_names));
    states.push_back(out);
  }
  sdk::Checkpoint out = checkpoint.copy();
  out.insert_or_assign("optimizer_states", states);
  return out;
}

sdk::Checkpoint map_optimizer_moments(const sdk::Checkpoint& saved,
                                      const std::function<at::Tensor(const std::string&, const at::Tensor&)>& fn) {
  if (!saved.contains("state")) return saved;
  const std::vector<std::string> names = saved_param_names(saved);
  const c10::impl::GenericDict saved_state = checkpoint_get(saved, "state").toGenericDict();
  c10::impl::GenericDict state(saved_state.keyType(), saved_state.valueType());
  for (const auto& entry : saved_state) {
    std::string name;
    if (entry.key().isString()) name = entry.key().toStringRef();
    else if (entry.key().isInt() && entry.key().toInt() < static_cast<std::int64_t>(names.size()))
      name = names[entry.key().toInt()];
    sdk::Checkpoint moments = entry.value().toGenericDict().copy();
    for (const auto& m : entry.value().toGenericDict())
      if (!name.empty() && m.key().toStringRef() != "step" && m.value().isTensor())
        moments.insert_or_assign(m.key(), fn(name, m.value().toTensor()));
    state.insert(entry.key(), moments);
  }
  sdk::Checkpoint out = saved.copy();
  out.insert_or_assign("state", state);
  return out;
}

}  // namespace tessera::core
