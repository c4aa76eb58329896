#pragma once
/// An optional interface a Strategy may also implement, so that the host can check before any
/// rank starts that the strategy can run a job of that many ranks (fsdp2's mesh sizes,
/// single_device's one process). Queried with dynamic_cast, like CheckpointIOFeatures: a
/// strategy without it finds out in setup_environment, after the ranks have started. Adding it
/// changed no existing vtable (no ABI change).
#include <cstdint>
#include <string>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

class TESSERA_SDK_API StrategyChecks {
 public:
  virtual ~StrategyChecks();
  /// Throws sdk::Error, naming the key and what would be valid, when this strategy as
  /// configured cannot run on `world_size` ranks launched by `environment` ("local", "torchrun",
  /// "slurm", ...). Called on the launching process before any rank starts, and by the
  /// strategy itself in setup_environment; must not communicate.
  virtual void check_world_size(std::int64_t world_size, const std::string& environment) const = 0;
};

}  // namespace tessera::sdk
