#include "tessera/sdk/unit.hpp"

#include "module_registry.hpp"

namespace tessera::sdk {

UnitRunner::~UnitRunner() = default;

namespace {
detail::ModuleRegistry<UnitRunner>& runners() {
  static detail::ModuleRegistry<UnitRunner> instance;
  return instance;
}
}  // namespace

void set_unit_runner(const torch::nn::Module& unit, std::shared_ptr<UnitRunner> runner) {
  runners().set(unit, std::move(runner));
}

UnitRunner* unit_runner(const torch::nn::Module& unit) { return runners().find(unit); }

}  // namespace tessera::sdk
