// The `single_device` strategy: one process, one device (CPU, or CUDA when built with it).
// The reference every parallel strategy is tested against.
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/memory_layout.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/strategy_checks.hpp"

namespace tessera::plugins {

class SingleDeviceStrategy final : public core::StrategyBase,
                                   public sdk::StrategyChecks,
                                   public sdk::StrategyMemoryLayout {
 public:
  explicit SingleDeviceStrategy(const sdk::Options& options) : StrategyBase(options) {}

  void check_world_size(std::int64_t world_size, const std::string& environment) const override {
    TESSERA_CHECK(world_size == 1, "[strategy] plugin = \"single_device\" runs one process, but this job has ",
                  world_size, " ranks (", environment, "): use plugin = \"ddp\" or \"fsdp\", or [launch] devices = 1");
  }

  /// LibTorch 2's Optimizer::zero_grad sets the gradients to none (StrategyBase::zero_grad);
  /// 1.13's zeroes them.
  bool frees_gradients_after_step() const override { return TORCH_VERSION_MAJOR >= 2; }

  /// The whole model, its gradients and the optimizer's moments on it; nothing sent.
  sdk::MemoryLayout memory_layout(sdk::Module& module, const sdk::ClusterInfo& cluster, std::int64_t) override {
    check_world_size(cluster.world_size, cluster.environment);
    sdk::MemoryLayout out;
    for (const auto& p : module.network()->parameters()) {
      const double bytes = static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
      out.param_bytes += bytes;
      if (!p.requires_grad()) continue;
      out.grad_bytes += bytes;
      out.optimizer_numel += p.numel();
      out.optimizer_dtype = p.scalar_type();
    }
    out.description = "single_device: the whole model on one process";
    out.setup_bytes = out.param_bytes;
    return out;
  }

  void setup_environment(const sdk::ClusterInfo& cluster) override {
    check_world_size(cluster.world_size, cluster.environment);
    StrategyBase::setup_environment(cluster);
  }
};

}  // namespace tessera::plugins

TESSERA_PLUGIN(strategy, TESSERA_VERSION,
               tessera::sdk::plugin_entry<tessera::plugins::SingleDeviceStrategy>(
                   "single_device", "one process on one device (CPU or CUDA): the parity baseline"));
