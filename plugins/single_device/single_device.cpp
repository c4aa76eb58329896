// The `single_device` strategy: one process, one device (CPU, or CUDA when built with it).
// The reference every parallel strategy is tested against.
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::plugins {

class SingleDeviceStrategy final : public core::StrategyBase {
 public:
  explicit SingleDeviceStrategy(const sdk::Options& options) : StrategyBase(options) {}

  void setup_environment(const sdk::ClusterInfo& cluster) override {
    TESSERA_CHECK(cluster.world_size == 1, "[strategy] plugin = \"single_device\" runs one process, but this job has ",
                  cluster.world_size, " ranks (", cluster.environment,
                  "): use plugin = \"ddp\" or \"fsdp\", or [launch] devices = 1");
    StrategyBase::setup_environment(cluster);
  }
};

}  // namespace tessera::plugins

TESSERA_PLUGIN(strategy, TESSERA_VERSION,
               tessera::sdk::plugin_entry<tessera::plugins::SingleDeviceStrategy>(
                   "single_device", "one process on one device (CPU or CUDA): the parity baseline"));
