#include "tessera/core/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include <c10/util/string_utils.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "tessera/sdk/error.hpp"

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

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

/// Per-parameter state as a dict of tensors (Python's format: "step" is a tensor).
sdk::Checkpoint param_state_dict(const torch::optim::OptimizerParamState& state) {
  sdk::Checkpoint out = sdk::make_checkpoint();
  if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    out.insert("step", at::scalar_tensor(static_cast<double>(s->step())));
    out.insert("exp_avg", s->exp_avg());
    out.insert("exp_avg_sq", s->exp_avg_sq());
    if (s->max_exp_avg_sq().defined()) out.insert("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    out.insert("step", at::scalar_tensor(static_cast<double>(s->step())));
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
  auto step = [&] { return saved.contains("step") ? static_cast<std::int64_t>(saved.at("step").toTensor().item<double>()) : 0; };
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

sdk::Checkpoint optimizer_state_dict(const torch::optim::Optimizer& optimizer,
                                     const std::vector<std::string>& param_names) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    sdk::Checkpoint saved_group = group_options(group.options());
    c10::List<std::int64_t> indices;
    for (const auto& p : group.params()) {
      auto it = optimizer.state().find(state_key(p));
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

void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& saved,
                               const std::vector<std::string>& param_names) {
  auto state = checkpoint_get(saved, "state").toGenericDict();
  std::vector<std::string> saved_names;
  if (saved.contains("param_names"))
    for (const IValue& name : saved.at("param_names").toListRef()) saved_names.push_back(name.toStringRef());
  std::map<std::string, std::int64_t> saved_index;
  for (std::size_t i = 0; i < saved_names.size(); ++i) saved_index[saved_names[i]] = static_cast<std::int64_t>(i);
  bool by_name = !saved_names.empty() && !param_names.empty();

  // Plan first, then apply: a mismatch must leave the optimizer untouched.
  std::vector<std::pair<at::Tensor, sdk::Checkpoint>> plan;
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      std::int64_t i = index++;
      std::string name = i < static_cast<std::int64_t>(param_names.size()) ? param_names[i] : std::to_string(i);
      std::int64_t source = i;
      if (by_name) {
        auto it = saved_index.find(name);
        TESSERA_CHECK(it != saved_index.end(), "optimizer state in the checkpoint has no entry for parameter '", name,
                      "'");
        source = it->second;
      }
      if (!state.contains(source)) continue;  // parameter had no state yet (never stepped)
      sdk::Checkpoint entry = state.at(source).toGenericDict();
      for (const char* key : {"exp_avg", "exp_avg_sq", "momentum_buffer"}) {
        if (!entry.contains(key)) continue;
        at::Tensor t = entry.at(key).toTensor();
        TESSERA_CHECK(t.sizes() == p.sizes(), "optimizer state '", key, "' of parameter '", name, "' has shape ",
                      t.sizes(), " in the checkpoint but the parameter has shape ", p.sizes());
      }
      plan.emplace_back(p, entry);
    }
  }
  auto groups = checkpoint_get(saved, "param_groups").toListRef();
  for (const auto& [p, entry] : plan) {
    auto fresh = make_param_state(optimizer, entry);
    optimizer.state()[state_key(p)] = std::move(fresh);
  }
  // Hyper-parameters of the first group (the host's LR schedule overrides lr every step).
  if (!groups.empty() && !optimizer.param_groups().empty()) {
    sdk::Checkpoint g = groups[0].toGenericDict();
    optimizer.param_groups()[0].options().set_lr(g.at("lr").toDouble());
  }
}

void atomic_write(const std::string& path, const std::function<void(std::ostream&)>& write) {
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::path temp = dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()));
  try {
    {
      std::ofstream out(temp, std::ios::binary | std::ios::trunc);
      TESSERA_CHECK(out.good(), "cannot write ", temp.string(), ": ", std::strerror(errno));
      write(out);
      out.flush();
      TESSERA_CHECK(out.good(), "writing ", temp.string(), " failed (disk full?)");
    }
    int fd = ::open(temp.c_str(), O_RDONLY);
    TESSERA_CHECK(fd >= 0 && ::fsync(fd) == 0, "cannot fsync ", temp.string());
    ::close(fd);
    fs::rename(temp, target);
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

void save_pickle(const IValue& value, const std::string& path) {
  std::vector<char> bytes = torch::pickle_save(value);
  atomic_write(path, [&](std::ostream& out) { out.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); });
}

IValue load_pickle(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "cannot open checkpoint ", path, ": ", std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    return torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL(path, " is not a readable checkpoint (truncated or not written by torch.save/tessera): ",
                 reason.substr(0, reason.find('\n')));
  }
}

}  // namespace tessera::core
