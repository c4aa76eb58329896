#pragma once
// Shared by the checkpoint tests: a small model with distinct values everywhere, its pieces in
// flat and box layouts, and shards as a strategy writes them (optimizer moments included).
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "errors.hpp"

namespace tessera::testing {

namespace core = tessera::core;
namespace sdk = tessera::sdk;
using core::TensorPiece;

using tessera::testing::error_of;

/// The model's full tensors and AdamW-like moments (distinct values everywhere).
struct Model {
  std::map<std::string, at::Tensor> params{{"w", at::arange(24, at::kFloat).view({4, 6})},
                                           {"b", at::arange(5, at::kFloat) * 0.5},
                                           {"count", at::scalar_tensor(7, at::kLong)}};  // a 0-d buffer
  std::vector<std::string> optimized{"w", "b"};
  at::Tensor moment(const std::string& name, int k) const { return params.at(name) * 10.0 + k; }
  std::map<std::string, TensorPiece> whole() const {
    std::map<std::string, TensorPiece> out;
    for (const auto& [name, t] : params) out.emplace(name, TensorPiece::whole(t.sizes()));
    return out;
  }
};

inline at::Tensor cut(const at::Tensor& global, const TensorPiece& piece) {
  if (piece.kind == TensorPiece::Kind::flat) return global.reshape({-1}).narrow(0, piece.offsets[0], piece.lengths[0]).clone();
  at::Tensor t = global;
  for (std::size_t d = 0; d < piece.offsets.size(); ++d)
    t = t.narrow(static_cast<std::int64_t>(d), piece.offsets[d], piece.lengths[d]);
  return t.clone();
}

/// One shard as a strategy writes it: its pieces of every tensor and of the optimizer moments.
/// `legacy`: flat pieces described as fsdp_shard_metadata {name: [start, ndim, dims...]}.
inline sdk::Checkpoint make_shard(const Model& model, const std::map<std::string, TensorPiece>& pieces, bool legacy,
                           std::int64_t step) {
  sdk::StateDict state;
  for (const auto& [name, piece] : pieces) state.insert(name, cut(model.params.at(name), piece));
  sdk::Checkpoint shard = sdk::make_checkpoint();
  shard.insert("state_dict", core::to_ivalue(state));
  shard.insert("global_step", step);
  if (legacy) {
    c10::impl::GenericDict meta(c10::StringType::get(), c10::ListType::ofInts());
    for (const auto& [name, piece] : pieces) {
      c10::List<std::int64_t> m({piece.offsets[0], static_cast<std::int64_t>(piece.global_shape.size())});
      for (auto d : piece.global_shape) m.push_back(d);
      meta.insert(name, m);
    }
    shard.insert(core::kLegacyShardMetadataKey, meta);
  } else {
    shard.insert(core::kTensorPiecesKey, core::pieces_to_ivalue(pieces));
  }
  c10::impl::GenericDict opt_state(c10::IntType::get(), c10::AnyType::get());
  for (std::size_t i = 0; i < model.optimized.size(); ++i) {
    const std::string& name = model.optimized[i];
    sdk::Checkpoint entry = sdk::make_checkpoint();
    entry.insert("step", at::scalar_tensor(3.0));
    entry.insert("exp_avg", cut(model.moment(name, 1), pieces.at(name)));
    entry.insert("exp_avg_sq", cut(model.moment(name, 2), pieces.at(name)));
    opt_state.insert(static_cast<std::int64_t>(i), entry);
  }
  c10::impl::GenericDict group(c10::StringType::get(), c10::AnyType::get());
  group.insert("lr", 0.1);
  group.insert("params", c10::List<std::int64_t>({0, 1}));
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  sdk::Checkpoint opt = sdk::make_checkpoint();
  opt.insert("state", opt_state);
  opt.insert("param_groups", groups);
  opt.insert("param_names", c10::List<std::string>(model.optimized));
  c10::impl::GenericList states(c10::AnyType::get());
  states.push_back(opt);
  shard.insert("optimizer_states", states);
  return shard;
}

/// Rank r of n's flat range of each tensor, as the flat-parameter layout cuts it (ceil-div,
/// so the last rank may get less or nothing); 0-d tensors whole on every rank.
inline std::map<std::string, TensorPiece> flat_layout(const Model& model, std::int64_t r, std::int64_t n) {
  std::map<std::string, TensorPiece> out;
  for (const auto& [name, t] : model.params) {
    const std::int64_t per = (t.numel() + n - 1) / n, start = std::min(t.numel(), r * per);
    out.emplace(name, t.dim() == 0 ? TensorPiece::flat_range({}, 0, 1)
                                   : TensorPiece::flat_range(t.sizes(), start, std::min(per, t.numel() - start)));
  }
  return out;
}

/// Rank r of n's dim-0 box of each tensor (FSDP2's Shard(0)), or column slices for "w" (a
/// tensor-parallel layout); 0-d tensors whole.
inline std::map<std::string, TensorPiece> box_layout(const Model& model, std::int64_t r, std::int64_t n, bool columns) {
  std::map<std::string, TensorPiece> out;
  for (const auto& [name, t] : model.params) {
    if (t.dim() == 0) {
      out.emplace(name, TensorPiece::whole({}));
      continue;
    }
    const std::int64_t dim = columns && name == "w" ? 1 : 0, size = t.size(dim);
    const std::int64_t per = (size + n - 1) / n, start = std::min(size, r * per);
    std::vector<std::int64_t> offsets(t.dim(), 0), lengths = t.sizes().vec();
    offsets[dim] = start;
    lengths[dim] = std::min(per, size - start);
    out.emplace(name, TensorPiece::box(t.sizes(), offsets, lengths));
  }
  return out;
}

}  // namespace tessera::testing
