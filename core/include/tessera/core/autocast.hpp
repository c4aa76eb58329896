#pragma once
/// Autocast's per-thread state on the CPU or CUDA, whatever LibTorch version exposes it (2.4
/// replaced the per-device functions, now deprecated, by ones taking the device type; 1.13
/// has only the old ones). Used by the precisions' forward context and by recomputation.
#include <c10/core/ScalarType.h>

namespace tessera::core {

bool autocast_enabled(bool cuda);
at::ScalarType autocast_dtype(bool cuda);
void set_autocast(bool cuda, bool enabled, at::ScalarType dtype);

}  // namespace tessera::core
