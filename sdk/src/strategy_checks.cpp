// Anchors StrategyChecks' vtable and type info in the SDK library (see checkpoint_io_features.cpp).
#include "tessera/sdk/strategy_checks.hpp"

namespace tessera::sdk {

StrategyChecks::~StrategyChecks() = default;

}  // namespace tessera::sdk
