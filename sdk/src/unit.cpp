#include "tessera/sdk/unit.hpp"

#include <mutex>
#include <unordered_map>

namespace tessera::sdk {

UnitRunner::~UnitRunner() = default;

namespace {
// Keyed by module address: a strategy installs runners once at setup; invoke() looks up
// on every unit call (a hash lookup, well under a microsecond).
struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<UnitRunner>> runners;
};
Registry& registry() {
  static Registry instance;
  return instance;
}
}  // namespace

void set_unit_runner(const torch::nn::Module& unit, std::shared_ptr<UnitRunner> runner) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (runner) r.runners[&unit] = std::move(runner);
  else r.runners.erase(&unit);
}

UnitRunner* unit_runner(const torch::nn::Module& unit) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.runners.find(&unit);
  return it == r.runners.end() ? nullptr : it->second.get();
}

}  // namespace tessera::sdk
