// Anchors StrategyMemoryLayout's vtable and type info in the SDK library (see strategy_checks.cpp).
#include "tessera/sdk/memory_layout.hpp"

namespace tessera::sdk {

StrategyMemoryLayout::~StrategyMemoryLayout() = default;
bool StrategyMemoryLayout::offloads_state_to_cpu() const { return false; }
bool StrategyMemoryLayout::frees_gradients_after_step() const { return false; }
std::vector<std::shared_ptr<torch::nn::Module>> StrategyMemoryLayout::checkpointed_units(Module&) { return {}; }

}  // namespace tessera::sdk
