#include "tessera/core/checkpoint.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>
#include <unordered_map>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <nlohmann/json.hpp>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <c10/util/strides.h>

#include "python_pickle.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/optimizer.hpp"

namespace tessera::core {

namespace fs = std::filesystem;
using c10::IValue;

c10::IValue to_ivalue(const sdk::StateDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) dict.insert(item.key(), item.value());
  return dict;
}

sdk::StateDict state_dict_from(const IValue& value, const std::string& what) {
  TESSERA_CHECK(value.isGenericDict(), what, " is not a dictionary of tensors");
  sdk::StateDict state;
  for (const auto& item : value.toGenericDict()) {
    TESSERA_CHECK(item.key().isString() && item.value().isTensor(), what, " holds a non-tensor entry");
    state.insert(item.key().toStringRef(), item.value().toTensor());
  }
  return state;
}

const IValue& checkpoint_get(const sdk::Checkpoint& checkpoint, const std::string& key) {
  auto it = checkpoint.find(key);
  if (it == checkpoint.end()) {
    std::vector<std::string> keys;
    for (const auto& item : checkpoint) keys.push_back(item.key().toStringRef());
    TESSERA_FAIL("checkpoint has no '", key, "' entry; it has: ", sdk::join(keys));
  }
  return it->value();
}

sdk::Checkpoint checkpoint_dict(const IValue& value, const std::string& what) {
  TESSERA_CHECK(value.isGenericDict(), what, " is not a dictionary");
  return value.toGenericDict();
}

namespace {

using sdk::optimizer_state_key;

/// Per-parameter state as a dict of tensors (Python's format: "step" is a tensor).
sdk::Checkpoint param_state_dict(const torch::optim::OptimizerParamState& state) {
  sdk::Checkpoint out = sdk::make_checkpoint();
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    out.insert("step", at::scalar_tensor(static_cast<double>(s->step()), at::kFloat));
    out.insert("exp_avg", s->exp_avg());
    out.insert("exp_avg_sq", s->exp_avg_sq());
    if (s->max_exp_avg_sq().defined()) out.insert("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    out.insert("step", at::scalar_tensor(static_cast<double>(s->step()), at::kFloat));
    out.insert("exp_avg", s->exp_avg());
    out.insert("exp_avg_sq", s->exp_avg_sq());
    if (s->max_exp_avg_sq().defined()) out.insert("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    if (s->momentum_buffer().defined()) out.insert("momentum_buffer", s->momentum_buffer());
  } else {
    TESSERA_FAIL("optimizer state of this optimizer type cannot be saved (supported: Adam, AdamW, SGD)");
  }
  return out;
}

sdk::Checkpoint group_options(const torch::optim::OptimizerOptions& options) {
  sdk::Checkpoint out = sdk::make_checkpoint();
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
    out.insert("lr", o->lr());
    out.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o->betas()), std::get<1>(o->betas())}));
    out.insert("eps", o->eps());
    out.insert("weight_decay", o->weight_decay());
    out.insert("amsgrad", o->amsgrad());
  } else if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
    out.insert("lr", o->lr());
    out.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o->betas()), std::get<1>(o->betas())}));
    out.insert("eps", o->eps());
    out.insert("weight_decay", o->weight_decay());
    out.insert("amsgrad", o->amsgrad());
  } else if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
    out.insert("lr", o->lr());
    out.insert("momentum", o->momentum());
    out.insert("dampening", o->dampening());
    out.insert("weight_decay", o->weight_decay());
    out.insert("nesterov", o->nesterov());
  } else {
    TESSERA_FAIL("optimizer options of this optimizer type cannot be saved (supported: Adam, AdamW, SGD)");
  }
  return out;
}

/// A fresh param state of the optimizer's type, filled from a saved dict.
std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(const torch::optim::Optimizer& optimizer,
                                                                    const sdk::Checkpoint& saved) {
  auto tensor = [&](const char* key) { return saved.contains(key) ? saved.at(key).toTensor().clone() : at::Tensor(); };
  auto step = [&]() -> std::int64_t {
    if (!saved.contains("step")) return 0;
    const IValue& v = saved.at("step");
    if (v.isTensor()) return static_cast<std::int64_t>(std::llround(v.toTensor().item<double>()));
    if (v.isInt()) return v.toInt();
    TESSERA_CHECK(v.isDouble(), "optimizer state 'step' is neither a tensor nor a number");
    return static_cast<std::int64_t>(std::llround(v.toDouble()));
  };
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step()).exp_avg(tensor("exp_avg")).exp_avg_sq(tensor("exp_avg_sq")).max_exp_avg_sq(tensor("max_exp_avg_sq"));
    return s;
  }
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step()).exp_avg(tensor("exp_avg")).exp_avg_sq(tensor("exp_avg_sq")).max_exp_avg_sq(tensor("max_exp_avg_sq"));
    return s;
  }
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(tensor("momentum_buffer"));
    return s;
  }
  TESSERA_FAIL("optimizer state cannot be loaded into this optimizer type (supported: Adam, AdamW, SGD)");
}

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
    sdk::Checkpoint saved_group = group_options(group.options());
    c10::List<std::int64_t> indices;
    for (const auto& p : group.params()) {
      auto it = optimizer.state().find(optimizer_state_key(p));
      if (it != optimizer.state().end()) state.insert(index, param_state_dict(*it->second));
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

void set_group_options(torch::optim::OptimizerOptions& options, const sdk::Checkpoint& saved) {
  auto number = [&](const char* key, double fallback) {
    if (!saved.contains(key)) return fallback;
    const IValue& v = saved.at(key);
    TESSERA_CHECK(v.isDouble() || v.isInt(), "optimizer param group '", key, "' is not a number");
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  };
  auto flag = [&](const char* key, bool fallback) {
    return saved.contains(key) && saved.at(key).isBool() ? saved.at(key).toBool() : fallback;
  };
  auto betas = [&](std::tuple<double, double> fallback) {
    if (!saved.contains("betas") || !saved.at("betas").isTuple()) return fallback;
    const auto& items = saved.at("betas").toTupleRef().elements();
    TESSERA_CHECK(items.size() == 2, "optimizer param group 'betas' must have two entries");
    return std::make_tuple(items[0].toDouble(), items[1].toDouble());
  };
  options.set_lr(number("lr", options.get_lr()));
  if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
    o->betas(betas(o->betas())).eps(number("eps", o->eps())).weight_decay(number("weight_decay", o->weight_decay()));
    o->amsgrad(flag("amsgrad", o->amsgrad()));
  } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
    o->betas(betas(o->betas())).eps(number("eps", o->eps())).weight_decay(number("weight_decay", o->weight_decay()));
    o->amsgrad(flag("amsgrad", o->amsgrad()));
  } else if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
    o->momentum(number("momentum", o->momentum())).dampening(number("dampening", o->dampening()));
    o->weight_decay(number("weight_decay", o->weight_decay())).nesterov(flag("nesterov", o->nesterov()));
  }
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
  const bool adam = dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
                    dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr;

  std::int64_t count = 0;
  for (const auto& group : optimizer.param_groups()) count += static_cast<std::int64_t>(group.params().size());
  TESSERA_CHECK(by_name || saved_names.empty() || static_cast<std::int64_t>(saved_names.size()) == count,
                "optimizer state in the checkpoint is for ", saved_names.size(), " parameters but the optimizer has ",
                count);

  // Plan first, then apply: a mismatch must leave the optimizer untouched.
  std::vector<std::pair<at::Tensor, sdk::Checkpoint>> plan;
  std::set<std::int64_t> consumed;  // saved entries that went to a parameter
  const bool sgd = dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr;
  const std::set<std::string> kept = adam  ? std::set<std::string>{"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
                                     : sgd ? std::set<std::string>{"step", "momentum_buffer"}
                                           : std::set<std::string>{};
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
      if (adam)
        for (const char* key : {"exp_avg", "exp_avg_sq"})
          TESSERA_CHECK(entry.contains(key), "optimizer state of parameter '", name, "' has no '", key,
                        "': the checkpoint was written by a different optimizer than this Adam/AdamW");
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
      set_group_options(optimizer.param_groups()[g].options(), checkpoint_dict(groups[g], "optimizer param group"));
  } else if (!groups.empty() && !optimizer.param_groups().empty()) {
    // Regrouped optimizer (e.g. different no-decay split): keep its own settings but the saved lr.
    set_group_options(optimizer.param_groups()[0].options(), checkpoint_dict(groups[0], "optimizer param group"));
  }
  return [&optimizer, plan = std::move(plan)] {
    for (const auto& [p, entry] : plan) optimizer.state()[optimizer_state_key(p)] = make_param_state(optimizer, entry);
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

namespace {

[[noreturn]] void fail_io(const std::string& what, const fs::path& path, int error) {
  TESSERA_FAIL("cannot ", what, " ", path.string(), ": ", std::strerror(error));
}

}  // namespace

void atomic_write(const std::string& path, const std::function<void(std::ostream&)>& write) {
  atomic_write_file(path, [&](const std::string& temp) {
    {
      std::ofstream out(temp, std::ios::binary | std::ios::trunc);
      if (!out.good()) fail_io("create", temp, errno);
      write(out);
      out.flush();
      TESSERA_CHECK(out.good(), "writing ", temp, " failed (disk full?)");
    }
    int fd = ::open(temp.c_str(), O_RDONLY);
    if (fd < 0) fail_io("open", temp, errno);
    const bool synced = ::fsync(fd) == 0;
    const int sync_error = errno;
    ::close(fd);
    if (!synced) fail_io("fsync", temp, sync_error);
  });
}

namespace {

// PyTorch 2.6 made torch.load weights-only by default, and its safe unpickler refuses the
// type tags and typed-list constructors LibTorch's pickle_save writes (torch.jit._pickle's
// restore_type_tag, build_intlist...). So Tessera pickles plain containers, as Python's
// torch.save does, and gives lists their element type back on load.

/// `v` with every list (typed or not) a generic one, recursively; tensors shared.
IValue plain_containers(const IValue& v) {
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(v.toGenericDict().keyType(), c10::AnyType::get());
    for (const auto& item : v.toGenericDict()) out.insert(item.key(), plain_containers(item.value()));
    return out;
  }
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const IValue& item : v.toListRef()) out.push_back(plain_containers(item));
    return out;
  }
  if (v.isTuple()) {
    std::vector<IValue> items;
    for (const IValue& item : v.toTupleRef().elements()) items.push_back(plain_containers(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return v;
}

/// A list of ints, floats, bools, strings or tensors (all one kind) as LibTorch's typed list;
/// other lists and every dict and tuple likewise inside. Loaded pickles carry no types.
IValue typed_containers(const IValue& v) {
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(v.toGenericDict().keyType(), v.toGenericDict().valueType());
    for (const auto& item : v.toGenericDict())
      if (!(item.key().isString() && item.key().toStringRef() == detail::kOrderedDictAttributes))
        out.insert(item.key(), typed_containers(item.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<IValue> items;
    for (const IValue& item : v.toTupleRef().elements()) items.push_back(typed_containers(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (!v.isList()) return v;
  std::vector<IValue> items;
  for (const IValue& item : v.toListRef()) items.push_back(typed_containers(item));
  auto all = [&](bool (IValue::*is)() const) {
    return !items.empty() && std::all_of(items.begin(), items.end(), [&](const IValue& x) { return (x.*is)(); });
  };
  auto typed = [&](auto element, auto get) {
    c10::List<decltype(element)> out;
    for (const IValue& x : items) out.push_back(get(x));
    return IValue(out);
  };
  if (all(&IValue::isInt)) return typed(std::int64_t{}, [](const IValue& x) { return x.toInt(); });
  if (all(&IValue::isDouble)) return typed(double{}, [](const IValue& x) { return x.toDouble(); });
  if (all(&IValue::isBool)) return typed(bool{}, [](const IValue& x) { return x.toBool(); });
  if (all(&IValue::isString)) return typed(std::string{}, [](const IValue& x) { return x.toStringRef(); });
  if (all(&IValue::isTensor)) return typed(at::Tensor{}, [](const IValue& x) { return x.toTensor(); });
  c10::impl::GenericList out(c10::AnyType::get());
  for (IValue& x : items) out.push_back(std::move(x));
  return out;
}

}  // namespace

void save_pickle(const IValue& value, const std::string& path) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* data, std::size_t n) { pickle.insert(pickle.end(), data, data + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain_containers(value));
  pickler.stop();
  // torch.save's container: data.pkl, then each storage as data/<index> (pickle_save's own),
  // streamed into the file: pickle_save built the whole file in memory first (a second copy
  // of the checkpoint, tens of GB for a large model's full state on rank 0).
  atomic_write(path, [&](std::ostream& out) {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) {
      out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  });
}

namespace {

/// A checkpoint file mapped privately (copy-on-write): tensors loaded from it point into the
/// mapping, so a rank that needs a piece of each tensor reads and keeps resident only the pages
/// it touches (torch.load(mmap=True)). Unmapped when the last tensor pointing into it goes.
struct MappedFile {
  char* base = nullptr;
  std::size_t size = 0;
  MappedFile(char* b, std::size_t n) : base(b), size(n) {}
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() { ::munmap(base, size); }
};

void release_mapping(void* context) { delete static_cast<std::shared_ptr<MappedFile>*>(context); }

bool points_into_mapping(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &release_mapping;
}

/// The zip reader's view of the mapping (the archive's directory and the pickle are copied out).
class MappedAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MappedAdapter(std::shared_ptr<MappedFile> file) : file_(std::move(file)) {}
  std::size_t size() const override { return file_->size; }
  std::size_t read(std::uint64_t pos, void* buf, std::size_t n, const char*) const override {
    if (pos >= file_->size) return 0;
    n = std::min<std::size_t>(n, file_->size - pos);
    std::memcpy(buf, file_->base + pos, n);
    return n;
  }

 private:
  std::shared_ptr<MappedFile> file_;
};

void for_each_tensor(const IValue& v, const std::string& path,
                     const std::function<void(const std::string&, const at::Tensor&)>& fn);

}  // namespace

namespace {

/// `path` mapped privately; a missing, empty or unreadable file throws naming it.
std::shared_ptr<MappedFile> map_file(const std::string& path) {
  std::error_code ec;
  TESSERA_CHECK(fs::exists(path, ec), "checkpoint ", path, " does not exist");
  TESSERA_CHECK(fs::is_regular_file(path, ec), "checkpoint ", path, " is not a regular file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "cannot open checkpoint ", path, ": ", std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  const int stat_errno = errno;
  if (!stat_ok || st.st_size == 0) ::close(fd);
  TESSERA_CHECK(stat_ok, "cannot stat checkpoint ", path, ": ", std::strerror(stat_errno));
  TESSERA_CHECK(st.st_size > 0, "checkpoint ", path, " is empty (an interrupted copy?)");
  const auto size = static_cast<std::size_t>(st.st_size);
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TESSERA_CHECK(base != MAP_FAILED, "cannot map checkpoint ", path, ": ", std::strerror(map_errno));
  return std::make_shared<MappedFile>(static_cast<char*>(base), size);
}

/// Storage for `bytes` at `offset` of the mapping, which it keeps alive.
at::DataPtr mapped_bytes(const std::shared_ptr<MappedFile>& file, std::size_t offset) {
  return at::DataPtr(file->base + offset, new std::shared_ptr<MappedFile>(file), &release_mapping, at::kCPU);
}

/// A safetensors file starts with its header's length and the header's opening brace.
bool looks_like_safetensors(const MappedFile& file) {
  if (file.size < 10 || file.base[8] != '{') return false;
  std::uint64_t length = 0;
  std::memcpy(&length, file.base, 8);
  return length <= file.size - 8;
}

/// A safetensors file's tensors, pointing into the mapping (copied out where a tensor's offset
/// is not aligned to its element size, which from_blob-style storage needs).
sdk::StateDict map_safetensors(const std::string& path, const std::shared_ptr<MappedFile>& file) {
  SafetensorsReader reader(path);
  sdk::StateDict state;
  for (const auto& [name, e] : reader.tensors()) {
    const at::ScalarType dtype = e.dtype;
    const std::size_t element = c10::elementSize(dtype);
    const auto offset = static_cast<std::size_t>(e.begin);
    at::Tensor t;
    if (reinterpret_cast<std::uintptr_t>(file->base + offset) % element == 0) {
      const auto bytes = static_cast<std::size_t>(e.end - e.begin);
      c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, mapped_bytes(file, offset), nullptr, false);
      t = at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, e.shape, c10::contiguous_strides(e.shape));
    } else {
      t = reader.read(name);
    }
    state.insert(name, t);
  }
  return state;
}

/// load_pickle of a file mapped already.
IValue unpickle(const std::string& path, const std::shared_ptr<MappedFile>& file) {
  const std::size_t size = file->size;
  // torch.save's format is a zip archive: anything else is not a checkpoint at all.
  TESSERA_CHECK(size >= 4 && std::memcmp(file->base, "PK\x03\x04", 4) == 0, path,
                " is not a checkpoint: it is not in torch.save's zip format");
  IValue value;
  try {
    // pickle_load's reading (torch/csrc/jit/serialization/import_read.cpp), except that each
    // storage points at its record in the mapped file instead of being copied out of it:
    // torch.save and pickle_save store records uncompressed, 64-byte aligned.
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MappedAdapter>(file));
    auto [record, record_size] = reader.getRecord("data.pkl");
    const std::string pickle =
        detail::readable_by_libtorch(std::string_view(static_cast<const char*>(record.get()), record_size));
    std::size_t consumed = 0;
    auto read = [&, n = pickle.size()](char* out, std::size_t len) {
      len = std::min(len, n - std::min(consumed, n));
      std::memcpy(out, pickle.data() + consumed, len);
      consumed += len;
      return len;
    };
    auto read_record = [&](const std::string& key) {
      const std::size_t offset = reader.getRecordOffset("data/" + key);
      TESSERA_CHECK(offset <= size, path, ": tensor record ", key, " starts past the end of the file (truncated)");
      return mapped_bytes(file, offset);
    };
    torch::jit::Unpickler unpickler(read, nullptr, nullptr, read_record, c10::nullopt);
    unpickler.set_version(reader.version());
    value = unpickler.parse_ivalue();
  } catch (const sdk::Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL(path, " is not a readable checkpoint (truncated or damaged; ", size,
                 " bytes): ", reason.substr(0, reason.find('\n')));
  }
  value = typed_containers(value);
  // Before any tensor is touched: every storage lies inside the file.
  for_each_tensor(value, "", [&](const std::string& name, const at::Tensor& t) {
    if (!points_into_mapping(t)) return;
    const char* begin = static_cast<const char*>(t.storage().data());
    TESSERA_CHECK(begin + t.storage().nbytes() <= file->base + file->size, path, ": tensor ", name,
                  " extends past the end of the file (truncated or damaged)");
  });
  return value;
}

}  // namespace

IValue load_pickle(const std::string& path) { return unpickle(path, map_file(path)); }

namespace {

constexpr const char kSafetensorsIndex[] = ".safetensors.index.json";

/// A model saved as several safetensors files (Hugging Face's save_pretrained of a large model):
/// the index's {"weight_map": {tensor: file}} names each tensor's file, beside the index. Every
/// file is mapped, as one safetensors file is.
sdk::StateDict map_safetensors_index(const std::string& path) {
  std::ifstream in(path);
  TESSERA_CHECK(in.good(), "checkpoint ", path, " does not exist or cannot be read");
  const auto index = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  TESSERA_CHECK(!index.is_discarded() && index.is_object() && index.contains("weight_map") &&
                    index.at("weight_map").is_object(),
                "checkpoint ", path, " is not a safetensors index: it needs {\"weight_map\": {tensor name: file}}");
  const fs::path folder = fs::path(path).parent_path();
  std::map<std::string, sdk::StateDict> files;
  sdk::StateDict state;
  for (const auto& [name, file] : index.at("weight_map").items()) {
    TESSERA_CHECK(file.is_string(), path, ": weight_map[\"", name, "\"] is not a file name");
    auto it = files.find(file.get<std::string>());
    if (it == files.end()) {
      const std::string full = (folder / file.get<std::string>()).string();
      it = files.emplace(file.get<std::string>(), map_safetensors(full, map_file(full))).first;
    }
    const at::Tensor* tensor = it->second.find(name);
    TESSERA_CHECK(tensor != nullptr, path, " puts '", name, "' in ", it->first, ", which has no tensor of that name");
    state.insert(name, *tensor);
  }
  return state;
}

}  // namespace

sdk::Checkpoint load_checkpoint_file(const std::string& path) {
  auto weights_only = [](const sdk::StateDict& state) {
    sdk::Checkpoint c = sdk::make_checkpoint();
    c.insert("state_dict", to_ivalue(state));
    c.insert(kWeightsOnlyKey, true);
    return c;
  };
  const std::size_t n = sizeof(kSafetensorsIndex) - 1;
  if (path.size() > n && path.compare(path.size() - n, n, kSafetensorsIndex) == 0)
    return weights_only(map_safetensors_index(path));
  const auto file = map_file(path);
  if (looks_like_safetensors(*file)) return weights_only(map_safetensors(path, file));
  sdk::Checkpoint c = checkpoint_dict(unpickle(path, file), "checkpoint " + path);
  if (c.contains("state_dict") || c.empty()) return c;
  for (const auto& item : c)
    if (!item.value().isTensor()) return c;  // not a bare state dict: the caller names what it lacks
  return weights_only(state_dict_from(c, "checkpoint " + path));
}

namespace {

/// Drops the resident pages that lie wholly inside `bytes` bytes at `data` of a mapping.
void drop_pages(const char* data, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(data) + page - 1) / page * page;
  const std::uintptr_t hi = reinterpret_cast<std::uintptr_t>(data + bytes) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

/// The xxh64 of a tensor's bytes. `release`: a tensor loaded by load_pickle and not modified
/// since is hashed in blocks whose pages are dropped after (read again from the file if touched
/// later), so checking a whole checkpoint keeps about one block resident, not the file.
std::string xxh64_of(const at::Tensor& t, bool release = false) {
  const at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
  const char* data = static_cast<const char*>(cpu.data_ptr());
  const std::size_t bytes = static_cast<std::size_t>(cpu.numel()) * cpu.element_size();
  XXH64_hash_t digest = 0;
  if (release && points_into_mapping(cpu)) {
    constexpr std::size_t kBlock = std::size_t{8} << 20;
    XXH64_state_t* state = XXH64_createState();
    XXH64_reset(state, 0);
    for (std::size_t done = 0; done < bytes; done += kBlock) {
      const std::size_t n = std::min(kBlock, bytes - done);
      XXH64_update(state, data + done, n);
      drop_pages(data + done, n);  // whole pages only: one shared with another tensor stays
    }
    digest = XXH64_digest(state);
    XXH64_freeState(state);
  } else {
    digest = XXH64(data, bytes, 0);
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(digest));
  return text;
}

/// Every tensor in a checkpoint value, with its path ("state_dict/w", "optimizer_states/0/state/3/exp_avg").
void for_each_tensor(const IValue& v, const std::string& path,
                     const std::function<void(const std::string&, const at::Tensor&)>& fn) {
  auto child = [&](const std::string& key) { return path.empty() ? key : path + "/" + key; };
  if (v.isTensor()) return fn(path, v.toTensor());
  if (v.isGenericDict())
    for (const auto& item : v.toGenericDict())
      for_each_tensor(item.value(), child(item.key().isString() ? item.key().toStringRef()
                                                                : std::to_string(item.key().toInt())), fn);
  if (v.isList() || v.isTuple()) {
    auto items = v.isList() ? v.toListRef() : v.toTupleRef().elements();
    for (std::size_t i = 0; i < items.size(); ++i) for_each_tensor(items[i], child(std::to_string(i)), fn);
  }
}

}  // namespace

sdk::Checkpoint with_tensor_checksums(const sdk::Checkpoint& checkpoint) {
  sdk::Checkpoint out = checkpoint.copy();
  (void)out.erase(kTensorChecksumsKey);  // a re-save recomputes them
  c10::Dict<std::string, std::string> sums;
  for_each_tensor(out, "", [&](const std::string& path, const at::Tensor& t) { sums.insert(path, xxh64_of(t)); });
  out.insert(kTensorChecksumsKey, sums);
  return out;
}

void release_loaded_pages(const at::Tensor& t) {
  if (!points_into_mapping(t) || !t.is_contiguous()) return;
  drop_pages(static_cast<const char*>(t.data_ptr()), static_cast<std::size_t>(t.numel()) * t.element_size());
}

void check_tensor_checksums(const sdk::Checkpoint& checkpoint, const std::string& path) {
  if (!checkpoint.contains(kTensorChecksumsKey)) return;
  const IValue& sums = checkpoint.at(kTensorChecksumsKey);
  TESSERA_CHECK(sums.isGenericDict(), path, " [", kTensorChecksumsKey, "] is not a dictionary");
  std::map<std::string, std::string> expected;
  for (const auto& item : sums.toGenericDict()) expected[item.key().toStringRef()] = item.value().toStringRef();
  std::size_t seen = 0;
  for_each_tensor(checkpoint, "", [&](const std::string& name, const at::Tensor& t) {
    auto it = expected.find(name);
    if (it == expected.end()) return;
    ++seen;
    TESSERA_CHECK(xxh64_of(t, /*release=*/true) == it->second, path, ": tensor ", name,
                  " does not match its checksum: the file is damaged");
  });
  TESSERA_CHECK(seen == expected.size(), path, ": ", expected.size() - seen,
                " tensor(s) listed in its checksums are missing");
}

void atomic_write_file(const std::string& path, const std::function<void(const std::string& temp)>& write) {
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TESSERA_CHECK(!ec, "cannot create directory ", dir.string(), " for ", path, ": ", ec.message());
  static std::atomic<std::uint64_t> counter{0};
  fs::path temp = dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                         std::to_string(counter++));
  try {
    write(temp.string());
    fs::rename(temp, target, ec);
    TESSERA_CHECK(!ec, "cannot rename ", temp.string(), " to ", path, ": ", ec.message());
    int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (dir_fd >= 0) {
      ::fsync(dir_fd);
      ::close(dir_fd);
    }
  } catch (...) {
    fs::remove(temp, ec);
    throw;
  }
}

namespace {
IValue snapshot_value(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.is_cuda()) return t.detach().clone();
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    host.copy_(t.detach());
    return host;
  }
  if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& item : dict) out.insert(item.key(), snapshot_value(item.value()));
    return out;
  }
  if (v.isList()) {
    auto list = v.toList();
    c10::impl::GenericList out(list.elementType());
    for (const IValue& item : list) out.push_back(snapshot_value(item));
    return out;
  }
  if (v.isTuple()) {
    std::vector<IValue> items;
    for (const IValue& item : v.toTupleRef().elements()) items.push_back(snapshot_value(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return v;  // immutable plain values
}
}  // namespace

sdk::Checkpoint snapshot_to_host(const sdk::Checkpoint& checkpoint) {
  return snapshot_value(checkpoint).toGenericDict();
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
