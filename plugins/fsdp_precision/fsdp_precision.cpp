// The `fsdp-precision` plugin: Lightning's FSDPPrecision. Same casts and autocast as
// `precision`, plus the mixed-precision policy (param/reduce/buffer dtypes) FSDP applies,
// and a sharded grad scaler (found-inf agreed across ranks over the gradient shards).
#include "tessera/core/precision_base.hpp"
#include "tessera/sdk/plugin.hpp"

namespace {
class FSDPPrecision final : public tessera::core::PrecisionBase {
 public:
  explicit FSDPPrecision(const tessera::sdk::Options& options) : PrecisionBase(options, /*fsdp_policy=*/true) {}
};
}  // namespace

TESSERA_PLUGIN(precision, TESSERA_VERSION,
               tessera::sdk::plugin_entry<FSDPPrecision>("fsdp-precision",
                                                         "FSDPPrecision: mixed-precision policy + sharded grad scaler"));
