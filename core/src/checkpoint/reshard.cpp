// Resharding reader: a sharded checkpoint written by any world size and layout, re-cut to the
// pieces this rank wants (or to whole tensors: a full checkpoint).
#include <sstream>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

/// Which piece of each stored tensor a shard holds (today's format, or the fsdp one before it).
std::map<std::string, TensorPiece> stored_pieces(const sdk::Checkpoint& shard, const sdk::StateDict& state,
                                                 const std::string& where) {
  if (shard.contains(kTensorPiecesKey))
    return pieces_from_ivalue(shard.at(kTensorPiecesKey), where + " [" + kTensorPiecesKey + "]");
  TESSERA_CHECK(shard.contains(kLegacyShardMetadataKey), where, " has no '", kTensorPiecesKey, "' entry (nor the older '",
                kLegacyShardMetadataKey, "'): it does not say which piece of each tensor it holds");
  return pieces_from_ivalue(shard.at(kLegacyShardMetadataKey), where + " [" + kLegacyShardMetadataKey + "]", &state);
}

/// Names and global shapes of the checkpoint against the wanted ones, before any tensor is
/// copied: a checkpoint of another model configuration must not load.
void check_stored_against_wanted(const std::map<std::string, TensorPiece>& stored, const sdk::StateDict& state,
                                 const std::map<std::string, TensorPiece>& wanted, const std::string& where) {
  std::map<std::string, std::vector<std::int64_t>> saved;
  for (const auto& item : state) {
    auto piece = stored.find(item.key());
    TESSERA_CHECK(piece != stored.end(), where, ": tensor '", item.key(), "' has no piece description");
    TESSERA_CHECK(item.value().numel() == piece->second.numel(), where, ": tensor '", item.key(), "' holds ",
                  item.value().numel(), " elements but its piece ", piece->second.to_string(), " has ",
                  piece->second.numel());
    saved.emplace(item.key(), piece->second.global_shape);
  }
  check_against_wanted(saved, wanted, where);
}

/// One wanted tensor being assembled from the shards' pieces, with which elements arrived.
struct Assembled {
  at::Tensor value, covered;
  void place(const TensorPiece& from, const at::Tensor& piece, const TensorPiece& want) {
    if (!value.defined()) {
      value = at::empty(want.local_shape(), piece.options().device(at::kCPU));
      covered = at::zeros(want.local_shape(), at::kBool);
    }
    if (copy_overlap(from, piece, want, value) > 0)
      copy_overlap(from, at::ones(from.local_shape(), at::kBool), want, covered);
  }
  std::int64_t have() const { return covered.sum().item<std::int64_t>(); }
};

}  // namespace

sdk::Checkpoint read_resharded_checkpoint(sdk::CheckpointIO& io, const std::string& path, std::int64_t shards,
                                          const std::map<std::string, TensorPiece>& wanted) {
  // Tessera's sharded format: only the byte ranges of the wanted pieces are read.
  if (is_sharded_checkpoint(path)) return load_sharded(path, wanted, 0);
  sdk::Checkpoint out = sdk::make_checkpoint();
  std::map<std::string, std::vector<std::string>> orders;  // shard 0's order of each model-shaped dict
  std::map<std::string, std::map<std::string, Assembled>> dicts;  // "state_dict" (and "current_model_state")
  orders["state_dict"];  // always in the result, even empty
  std::map<std::string, std::map<std::string, Assembled>> optim;  // name -> key -> moment
  std::map<std::string, std::map<std::string, c10::IValue>> optim_scalars;  // name -> key -> "step", ...
  c10::IValue param_groups, param_names;
  for (std::int64_t r = 0; r < shards; ++r) {
    sdk::Checkpoint shard = io.load_checkpoint(path, sdk::ShardInfo{r, shards, true});
    const std::string where = "sharded checkpoint " + path + " shard " + std::to_string(r);
    sdk::StateDict state = state_dict_from(checkpoint_get(shard, "state_dict"), where + " [state_dict]");
    std::map<std::string, TensorPiece> pieces = stored_pieces(shard, state, where);
    check_stored_against_wanted(pieces, state, wanted, where);
    if (r == 0)
      for (const auto& entry : shard) {
        const std::string& key = entry.key().toStringRef();
        if (!is_model_shaped_key(key) && key != "optimizer_states" && key != kTensorPiecesKey &&
            key != kLegacyShardMetadataKey)
          out.insert(entry.key(), entry.value());
      }
    for (const char* dict : kModelShapedKeys) {  // each cut as the weights are
      if (!shard.contains(dict)) continue;
      for (const auto& item : state_dict_from(shard.at(dict), where + " [" + dict + "]")) {
        TESSERA_CHECK(pieces.count(item.key()), where, " [", dict, "] holds '", item.key(), "', which [state_dict] has not");
        if (r == 0) orders[dict].push_back(item.key());
        dicts[dict][item.key()].place(pieces.at(item.key()), item.value(), wanted.at(item.key()));
      }
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
    for (const auto& entry : checkpoint_dict(checkpoint_get(opt, "state"), where + " optimizer state")) {
      TESSERA_CHECK(entry.key().isInt() && entry.key().toInt() >= 0 &&
                        entry.key().toInt() < static_cast<std::int64_t>(names.size()),
                    where, ": optimizer state refers to parameter index ", entry.key(), " but 'param_names' has ",
                    names.size(), " entries");
      const std::string name = names[static_cast<std::size_t>(entry.key().toInt())].toStringRef();
      auto piece = pieces.find(name);
      TESSERA_CHECK(piece != pieces.end() && wanted.count(name), where, ": optimizer state for '", name,
                    "', which is not a tensor of the checkpoint's state_dict");
      for (const auto& kv : checkpoint_dict(entry.value(), where + " optimizer state of '" + name + "'")) {
        const std::string key = kv.key().toStringRef();
        if (key == "step" || !kv.value().isTensor()) {
          optim_scalars[name][key] = kv.value();
          continue;
        }
        const at::Tensor& moment = kv.value().toTensor();
        TESSERA_CHECK(moment.numel() == piece->second.numel(), where, ": optimizer state '", key, "' of '", name,
                      "' holds ", moment.numel(), " elements but the parameter's piece ", piece->second.to_string(),
                      " has ", piece->second.numel());
        optim[name][key].place(piece->second, moment, wanted.at(name));
      }
    }
  }
  auto check_covered = [&](const Assembled& a, const std::string& what) {
    const std::int64_t have = a.have();
    TESSERA_CHECK(have == a.value.numel(), "sharded checkpoint ", path, ": the shards cover ", have, " of ",
                  a.value.numel(), " wanted elements of ", what, "; a shard file is missing or from another save");
  };
  for (const auto& [dict, order] : orders) {
    sdk::StateDict state;
    for (const auto& name : order) {
      check_covered(dicts[dict].at(name), "'" + name + "'" + (dict == "state_dict" ? "" : " of [" + dict + "]"));
      state.insert(name, dicts[dict].at(name).value);
    }
    out.insert(dict, to_ivalue(state));
  }
  if (!param_names.isNone()) {
    c10::impl::GenericDict opt_state(c10::IntType::get(), c10::AnyType::get());
    auto names = param_names.toListRef();
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string name = names[i].toStringRef();
      sdk::Checkpoint entry = sdk::make_checkpoint();
      for (const auto& [key, moment] : optim[name]) {
        check_covered(moment, "optimizer state '" + key + "' of '" + name + "'");
        entry.insert(key, moment.value);
      }
      for (const auto& [key, value] : optim_scalars[name]) entry.insert(key, value);
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

sdk::Checkpoint read_resharded_checkpoint(sdk::CheckpointIO& io, const std::string& path, std::int64_t shards,
                                          const std::map<std::string, StackedPieces>& wanted) {
  if (is_sharded_checkpoint(path)) return load_sharded(path, wanted, 0);
  std::map<std::string, TensorPiece> single;
  for (const auto& [name, stack] : wanted) {
    TESSERA_CHECK(stack.size() == 1, "sharded checkpoint ", path, " is in the per-rank pickle format, which cannot be ",
                  "re-cut to the stacked pieces of '", name, "' (tensor parallelism): export it with `tessera ",
                  "checkpoint export PATH --to FILE.ckpt` and load that");
    single.emplace(name, stack[0]);
  }
  return read_resharded_checkpoint(io, path, shards, single);
}

}  // namespace tessera::core
