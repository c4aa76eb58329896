// The `precision` plugin: Lightning's Precision / MixedPrecision for single_device and ddp.
#include "tessera/core/precision_base.hpp"
#include "tessera/sdk/plugin.hpp"

namespace {
class Precision final : public tessera::core::PrecisionBase {
 public:
  explicit Precision(const tessera::sdk::Options& options) : PrecisionBase(options, /*fsdp_policy=*/false) {}
};
}  // namespace

TESSERA_PLUGIN(precision, TESSERA_VERSION,
               tessera::sdk::plugin_entry<Precision>("precision",
                                                     "32-true, 16-true, bf16-true, 16-mixed, bf16-mixed (autocast)"));
