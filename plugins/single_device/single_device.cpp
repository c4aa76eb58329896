// The `single_device` strategy: one process, one device (CPU, or CUDA when built with it).
// The reference every parallel strategy is tested against.
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/strategy_checks.hpp"

namespace tessera::plugins {

class SingleDeviceStrategy final : public core::StrategyBase, public sdk::StrategyChecks {
 public:
  explicit SingleDeviceStrategy(const sdk::Options& options) : StrategyBase(options) {}

  void check_world_size(std::int64_t world_size, const std::string& environment) const override {
    TESSERA_CHECK(world_size == 1, "[strategy] plugin = \"single_device\" runs one process, but this job has ",
                  world_size, " ranks (", environment, "): use plugin = \"ddp\" or \"fsdp\", or [launch] devices = 1");
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
