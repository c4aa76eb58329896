// Reading a sharded checkpoint written by any world size (kept here until the checkpoint
// module's resharding reader replaces it).
#include "tessera/core/fsdp.hpp"

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core::fsdp {

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
