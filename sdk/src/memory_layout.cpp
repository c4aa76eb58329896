// Anchors StrategyMemoryLayout's vtable and type info in the SDK library (see strategy_checks.cpp).
#include "tessera/sdk/memory_layout.hpp"

namespace tessera::sdk {

StrategyMemoryLayout::~StrategyMemoryLayout() = default;

}  // namespace tessera::sdk
