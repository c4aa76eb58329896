#pragma once
/// Sharded-model operations for model plugins and callbacks (PyTorch FSDP's
/// summon_full_params, apply and fsdp_modules): predict/generation, EMA and weight surgery
/// need the full parameters of a network that a strategy has sharded. A sharding strategy
/// installs a ShardedModel on the network it shards; without one the free functions below
/// act on the plain network, so a model calls them the same way under every strategy.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "tessera/sdk/export.hpp"
#include "tessera/sdk/guard.hpp"

namespace tessera::sdk {

struct SummonOptions {
  bool writeback = true;        ///< changes made to the full parameters go back into the shards
  bool rank0_only = false;      ///< only global rank 0 holds the full parameters (no writeback)
  bool offload_to_cpu = false;  ///< full parameters in CPU memory (one unit at a time on the GPU)
  bool with_grads = false;      ///< parameters' .grad hold their full (reduced) gradients too
};

/// Implemented by sharding strategies. Every method is collective over the job.
class TESSERA_SDK_API ShardedModel {
 public:
  virtual ~ShardedModel();
  /// The network's parameters hold their full values until the guard is destroyed.
  virtual GuardPtr summon_full_params(const SummonOptions& options) = 0;
  /// Runs `fn` on every module with full parameters, writing changes back.
  virtual void apply(const std::function<void(torch::nn::Module&)>& fn) = 0;
  /// The sharding units' module paths in forward order, the root ("") last.
  virtual std::vector<std::string> fsdp_modules(bool root_only) const = 0;
};

/// Install (or, with null, remove) the ShardedModel of `network`. Called by strategies.
TESSERA_SDK_API void set_sharded_model(const torch::nn::Module& network, std::shared_ptr<ShardedModel> model);
/// The ShardedModel installed on `network`, or null.
TESSERA_SDK_API ShardedModel* sharded_model(const torch::nn::Module& network);

/// Full parameters of `network` while the guard lives (collective when sharded); null guard
/// when nothing is sharded (the parameters are full already).
TESSERA_SDK_API GuardPtr summon_full_params(const torch::nn::Module& network, const SummonOptions& options = {});
/// `fn` on every module of `network` with full parameters (collective when sharded).
TESSERA_SDK_API void apply(torch::nn::Module& network, const std::function<void(torch::nn::Module&)>& fn);
/// The sharding units of `network` ({""}, the root alone, when nothing is sharded).
TESSERA_SDK_API std::vector<std::string> fsdp_modules(const torch::nn::Module& network, bool root_only = false);

}  // namespace tessera::sdk
