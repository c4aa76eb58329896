// State dicts and optimizer state of a ShardedModule (PyTorch's _state_dict_utils and
// _optim_utils), written against each layout's "piece of each parameter this rank owns".
#include "tessera/core/fsdp.hpp"

#include <set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "../checkpoint/loaded_weights.hpp"  // the engine's own, beside its sources
#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "sharded_module_state.hpp"

namespace tessera::core::fsdp {

namespace {

const char* const kStateKeys[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};

std::string flat_param_key(const FSDPUnit& u) { return u.is_root ? "flat_param" : u.name + ".flat_param"; }

at::Tensor cpu_copy(const at::Tensor& t) { return t.is_cpu() ? t.clone() : t.cpu(); }

}  // namespace

sdk::StateDict ShardedModule::full_state_dict() {
  std::map<std::string, at::Tensor> by_name;
  const bool keep = !d_->options.rank0_only || d_->shard_group->rank() == 0;
  for (auto& u : d_->units) {
    std::vector<at::Tensor> full =
        u->layout->gather_full_params(*d_->shard_group, d_->device, "state_dict all-gather of " + u->name);
    if (!keep) continue;
    const auto& params = u->layout->params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      at::Tensor value = cpu_copy(full[i]);  // checkpoints hold CPU tensors
      for (const auto& name : params[i].names) by_name[name] = value;
    }
  }
  sdk::StateDict state;
  if (!keep) return state;
  for (const auto& p : d_->replicated)
    for (const auto& name : p.names) by_name[name] = p.tensor.detach().to(at::kCPU, at::kFloat).clone();
  for (const auto& item : d_->network->named_parameters()) state.insert(item.key(), by_name.at(item.key()));
  for (const auto& item : d_->network->named_buffers()) state.insert(item.key(), buffer_for_state(item.key(), item.value()));
  return state;
}

void ShardedModule::load_full_state_dict(const sdk::StateDict& state, bool strict) {
  std::vector<std::string> missing, unexpected;
  std::set<std::string> known;
  auto check = [&](const UnitParam& p) {
    for (const auto& name : p.names) {
      known.insert(name);
      const at::Tensor* value = state.find(name);
      if (value == nullptr) {
        missing.push_back(name);
        continue;
      }
      TESSERA_CHECK(value->sizes() == p.tensor.sizes(), "checkpoint state_dict['", name, "'] has shape ", value->sizes(),
                    " but the model's parameter has shape ", p.tensor.sizes(),
                    ": the checkpoint was written for a different model configuration");
      check_weight_dtype(name, *value, p.tensor);
    }
  };
  for (const auto& u : d_->units)
    for (const auto& p : u->layout->params()) check(p);
  for (const auto& p : d_->replicated) check(p);
  for (const auto& item : d_->network->named_buffers()) known.insert(item.key());
  for (const auto& item : state)
    if (!known.count(item.key())) unexpected.push_back(item.key());
  TESSERA_CHECK(!strict || (missing.empty() && unexpected.empty()), "checkpoint state_dict does not match the model: ",
                missing.size(), " missing key(s) [", sdk::join(missing), "], ", unexpected.size(),
                " unexpected key(s) [", sdk::join(unexpected), "]");
  torch::NoGradGuard no_grad;
  // Each rank checks the piece it copied (reading only its shard of a mapped file) and the ranks
  // agree on the first parameter holding a NaN or an infinity, in one collective.
  std::vector<const UnitParam*> order;  // every parameter, the same order on every rank
  std::int64_t first_bad = -1;
  for (auto& u : d_->units) {
    std::vector<const at::Tensor*> values;
    for (const auto& p : u->layout->params()) values.push_back(state.find(p.names[0]));
    u->layout->load_full_params(values);
    for (std::size_t i = 0; i < values.size(); ++i) {
      order.push_back(&u->layout->params()[i]);
      if (first_bad < 0 && values[i] != nullptr && !first_non_finite(u->layout->optimizer_tensors()[i]).empty())
        first_bad = static_cast<std::int64_t>(order.size()) - 1;
    }
  }
  for (const auto& p : d_->replicated) {
    order.push_back(&p);
    if (const at::Tensor* value = state.find(p.names[0])) {
      p.tensor.detach().copy_(*value);
      if (first_bad < 0 && !first_non_finite(p.tensor).empty()) first_bad = static_cast<std::int64_t>(order.size()) - 1;
    }
  }
  // The first such index over the ranks (order.size(): none), exact as a float below 2^24.
  const std::int64_t mine = first_bad < 0 ? static_cast<std::int64_t>(order.size()) : first_bad;
  at::Tensor bad = at::full({1}, static_cast<double>(mine), fp32());
  d_->shard_group->all_reduce(bad, sdk::ReduceOp::min, "non-finite weight check")->wait();
  const auto k = static_cast<std::size_t>(bad.item<double>());
  if (k < order.size()) check_finite_weight(order[k]->names[0], *state.find(order[k]->names[0]));  // throws
  for (auto& item : d_->network->named_buffers())
    if (const at::Tensor* value = state.find(item.key())) item.value().copy_(*value);
}

sdk::Checkpoint ShardedModule::full_optim_state_dict(const torch::optim::Optimizer& optimizer) {
  // Numbered as the optimizer numbers its parameters (group by group), so the saved
  // param_groups stay valid; the units gather their moments in layout order.
  const std::vector<std::string> names = optimizer_order_names(optimizer, optimizer_parameters());
  sdk::Checkpoint local = optimizer_state_dict(optimizer, names);
  auto local_state = local.at("state").toGenericDict();
  std::map<std::string, std::int64_t> index_of;
  for (std::size_t k = 0; k < names.size(); ++k) index_of[names[k]] = static_cast<std::int64_t>(k);
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  const bool keep = !d_->options.rank0_only || d_->shard_group->rank() == 0;
  for (auto& u : d_->units) {
    const auto& params = u->layout->params();
    const auto& tensors = u->layout->optimizer_tensors();
    std::vector<std::int64_t> index;  // -1: a frozen parameter, which the optimizer does not hold
    for (const auto& p : params) index.push_back(index_of.count(p.names[0]) ? index_of.at(p.names[0]) : -1);
    const auto trainable = std::find_if(index.begin(), index.end(), [](std::int64_t k) { return k >= 0; });
    std::vector<sdk::Checkpoint> full_states;
    for (std::size_t i = 0; i < params.size(); ++i) full_states.push_back(sdk::make_checkpoint());
    for (const char* key : kStateKeys) {
      // Present for one parameter means present for all (same optimizer, same settings).
      bool present = trainable != index.end() && local_state.contains(*trainable) &&
                     local_state.at(*trainable).toGenericDict().contains(key);
      std::vector<at::Tensor> pieces;  // the unit gathers every parameter's: zeros for a frozen one
      for (std::size_t i = 0; i < params.size(); ++i)
        pieces.push_back(!present    ? at::Tensor()
                         : index[i] < 0 ? at::zeros_like(tensors[i])
                                        : local_state.at(index[i]).toGenericDict().at(key).toTensor());
      at::Tensor flag = at::full({1}, present ? 1.0 : 0.0, fp32());
      d_->shard_group->all_reduce(flag, sdk::ReduceOp::max, "optimizer state check")->wait();
      if (flag.item<double>() == 0) continue;
      for (auto& piece : pieces)
        if (!piece.defined()) piece = at::empty({0}, fp32());
      std::vector<at::Tensor> full =
          u->layout->gather_full_state(pieces, *d_->shard_group, d_->device, "optimizer state all-gather of " + u->name);
      for (std::size_t i = 0; i < params.size(); ++i) full_states[i].insert(key, full[i]);
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (index[i] < 0) continue;
      if (local_state.contains(index[i]) && local_state.at(index[i]).toGenericDict().contains("step"))
        full_states[i].insert("step", local_state.at(index[i]).toGenericDict().at("step"));
      if (full_states[i].size() > 0) state.insert(index[i], full_states[i]);
    }
  }
  for (const auto& p : d_->replicated) {
    if (!index_of.count(p.names[0])) continue;  // frozen
    const std::int64_t k = index_of.at(p.names[0]);
    if (!local_state.contains(k)) continue;
    sdk::Checkpoint copy = sdk::make_checkpoint();
    for (const auto& entry : local_state.at(k).toGenericDict())
      copy.insert(entry.key(), entry.value().isTensor() ? c10::IValue(entry.value().toTensor().cpu()) : entry.value());
    state.insert(k, copy);
  }
  sdk::Checkpoint out = sdk::make_checkpoint();
  if (!keep) return out;
  out.insert("state", state);
  out.insert("param_groups", local.at("param_groups"));
  out.insert("param_names", c10::List<std::string>(names));
  return out;
}

void ShardedModule::load_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full) {
  load_optimizer_state_dict(optimizer, shard_full_optim_state_dict(full),
                            optimizer_order_names(optimizer, optimizer_parameters()));
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
  auto entry_of = [&](const std::string& name) {
    auto it = index_of.find(name);
    TESSERA_CHECK(it != index_of.end(), "optimizer state in the checkpoint has no entry for parameter '", name, "'");
    return it->second;
  };
  for (auto& u : d_->units) {
    const auto& params = u->layout->params();
    const auto& tensors = u->layout->optimizer_tensors();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!params[i].tensor.requires_grad()) continue;  // frozen: not the optimizer's (optimizer_parameters)
      const std::string& name = params[i].names[0];
      const std::int64_t this_view = view++;
      view_names.push_back(name);
      const std::int64_t index = entry_of(name);
      if (!full_state.contains(index)) continue;
      sdk::Checkpoint saved = full_state.at(index).toGenericDict();
      sdk::Checkpoint mine = sdk::make_checkpoint();
      const OwnedRange owned = u->layout->owned_range(i);
      for (const auto& entry : saved) {
        const std::string key = entry.key().toStringRef();
        if (key == "step") {
          mine.insert(key, entry.value());
          continue;
        }
        at::Tensor value = entry.value().toTensor();
        TESSERA_CHECK(value.sizes() == params[i].tensor.sizes(), "optimizer state '", key, "' of parameter '", name,
                      "' has shape ", value.sizes(), " in the checkpoint but the parameter has shape ",
                      params[i].tensor.sizes());
        mine.insert(key, value.reshape({-1})
                             .narrow(0, owned.start, owned.length)
                             .view(tensors[i].sizes())
                             .to(tensors[i].device())
                             .clone());
      }
      state.insert(this_view, mine);
    }
  }
  for (const UnitParam& p : d_->replicated) {
    if (!p.tensor.requires_grad()) continue;
    const std::string& name = p.names[0];
    const std::int64_t this_view = view++;
    view_names.push_back(name);
    const std::int64_t index = entry_of(name);
    if (full_state.contains(index)) state.insert(this_view, full_state.at(index));
  }
  // Nothing in the checkpoint is left behind: state for a parameter the model does not have
  // would otherwise be dropped silently.
  const std::set<std::string> taken(view_names.begin(), view_names.end());
  for (const auto& item : full_state) {
    const std::int64_t i = item.key().toInt();
    TESSERA_CHECK(i >= 0 && i < static_cast<std::int64_t>(names.size()), "optimizer state in the checkpoint refers to ",
                  "parameter index ", i, " but its 'param_names' has ", names.size(), " entries");
    TESSERA_CHECK(taken.count(names[static_cast<std::size_t>(i)].toStringRef()),
                  "optimizer state in the checkpoint has an entry for parameter '",
                  names[static_cast<std::size_t>(i)].toStringRef(),
                  "', which the model does not have: it would be dropped (a different model?)");
  }
  sdk::Checkpoint local = sdk::make_checkpoint();
  local.insert("state", state);
  local.insert("param_groups", checkpoint_get(full, "param_groups"));
  local.insert("param_names", c10::List<std::string>(view_names));
  return local;
}

void ShardedModule::scatter_full_optim_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& full) {
  // Rank 0 pickles the whole dict once; every rank unpickles and keeps its shards.
  const bool rank0 = is_global_rank0();
  std::vector<char> bytes;
  if (rank0) bytes = torch::jit::pickle_save(full);
  at::Tensor size = at::tensor({static_cast<std::int64_t>(bytes.size())}, at::kLong).to(d_->device);
  auto spread = [&](at::Tensor& t, const std::string& tag) {
    // World rank 0 -> the first rank of every shard group -> every rank of each shard group.
    if (d_->shard_group->rank() == 0 && d_->replicate_group->size() > 1)
      d_->replicate_group->broadcast(t, 0, tag)->wait();
    if (d_->shard_group->size() > 1) d_->shard_group->broadcast(t, 0, tag)->wait();
  };
  spread(size, "scatter_full_optim_state_dict size");
  at::Tensor blob = rank0 ? at::from_blob(bytes.data(), {static_cast<std::int64_t>(bytes.size())}, at::kByte).to(d_->device).clone()
                          : at::empty({size.cpu().item<std::int64_t>()}, at::TensorOptions(at::kByte).device(d_->device));
  spread(blob, "scatter_full_optim_state_dict");
  blob = blob.cpu();
  std::vector<char> received(static_cast<const char*>(blob.data_ptr()),
                             static_cast<const char*>(blob.data_ptr()) + blob.numel());
  load_full_optim_state_dict(optimizer, torch::jit::pickle_load(received).toGenericDict());
}

std::map<std::string, std::pair<std::int64_t, std::int64_t>> ShardedModule::owned_ranges() const {
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> out;
  for (const auto& u : d_->units) {
    const auto& params = u->layout->params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const OwnedRange owned = u->layout->owned_range(i);
      for (const auto& name : params[i].names) out[name] = {owned.start, owned.length};
    }
  }
  for (const auto& p : d_->replicated)
    for (const auto& name : p.names) out[name] = {0, p.tensor.numel()};
  for (const auto& item : d_->network->named_buffers()) out[item.key()] = {0, item.value().numel()};
  return out;
}

sdk::StateDict ShardedModule::sharded_state_dict() const {
  sdk::StateDict state;
  for (const auto& u : d_->units) {
    const auto& params = u->layout->params();
    const auto& tensors = u->layout->optimizer_tensors();
    for (std::size_t i = 0; i < params.size(); ++i) {
      // Stored as a 1-D range of the flattened tensor under either layout (see shard_metadata).
      at::Tensor piece = tensors[i].detach().reshape({-1}).to(at::kCPU).clone();
      for (const auto& name : params[i].names) state.insert(name, piece);
    }
  }
  for (const auto& p : d_->replicated)
    for (const auto& name : p.names) state.insert(name, p.tensor.detach().reshape({-1}).to(at::kCPU, at::kFloat).clone());
  for (const auto& item : d_->network->named_buffers())
    state.insert(item.key(), buffer_for_state(item.key(), item.value()).reshape({-1}).to(at::kCPU).clone());
  return state;
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
  for (auto& u : d_->units) {
    const auto& params = u->layout->params();
    const auto& tensors = u->layout->optimizer_tensors();
    for (std::size_t i = 0; i < params.size(); ++i)
      tensors[i].detach().copy_(piece_for(params[i].names, tensors[i].numel()).view(tensors[i].sizes()));
  }
  for (const auto& p : d_->replicated)
    p.tensor.detach().copy_(piece_for(p.names, p.tensor.numel()).view(p.tensor.sizes()));
  for (auto& item : d_->network->named_buffers())
    item.value().copy_(piece_for({item.key()}, item.value().numel()).view(item.value().sizes()));
  // One-rank shard groups keep the gathered storage: refresh it from the loaded shards.
  for (auto& u : d_->units) u->gathered = false;
}

sdk::StateDict ShardedModule::local_state_dict() const {
  sdk::StateDict state;
  for (const auto& u : d_->units) state.insert(flat_param_key(*u), u->layout->local_shard().detach().to(at::kCPU).clone());
  for (const auto& p : d_->replicated) state.insert(p.names[0], p.tensor.detach().to(at::kCPU, at::kFloat).clone());
  for (const auto& item : d_->network->named_buffers())
    state.insert(item.key(), buffer_for_state(item.key(), item.value()).to(at::kCPU).clone());
  return state;
}

void ShardedModule::load_local_state_dict(const sdk::StateDict& state) {
  torch::NoGradGuard no_grad;
  for (auto& u : d_->units) {
    const at::Tensor* value = state.find(flat_param_key(*u));
    const std::int64_t expected = u->layout->local_shard().numel();
    TESSERA_CHECK(value != nullptr && value->numel() == expected, "LOCAL state dict: '", flat_param_key(*u), "' ",
                  value == nullptr ? std::string("is missing") : "has " + std::to_string(value->numel()) + " elements",
                  " but this rank's shard has ", expected,
                  ": LOCAL checkpoints load only into the same world size, sharding strategy and model");
    u->layout->load_local_shard(*value);
    u->gathered = false;
  }
  for (const auto& p : d_->replicated) {
    const at::Tensor* value = state.find(p.names[0]);
    TESSERA_CHECK(value != nullptr, "LOCAL state dict: no entry for ignored parameter '", p.names[0], "'");
    p.tensor.detach().copy_(*value);
  }
  for (auto& item : d_->network->named_buffers())
    if (const at::Tensor* value = state.find(item.key())) item.value().copy_(*value);
}

}  // namespace tessera::core::fsdp
