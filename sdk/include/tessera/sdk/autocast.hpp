#pragma once
/// Autocast's per-thread state on the CPU or CUDA, whatever LibTorch version exposes it (2.4
/// replaced the per-device functions, now deprecated, by ones taking the device type; 1.13
/// has only the old ones). Used by the precisions' forward context, by recomputation, and by
/// plugins whose own kernels must know whether autocast is on.
#include <c10/core/ScalarType.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

TESSERA_SDK_API bool autocast_enabled(bool cuda);
TESSERA_SDK_API at::ScalarType autocast_dtype(bool cuda);
TESSERA_SDK_API void set_autocast(bool cuda, bool enabled, at::ScalarType dtype);

}  // namespace tessera::sdk
