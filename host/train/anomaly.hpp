#pragma once
// [trainer] detect_anomaly: before the optimizer steps, every rank checks its loss and its
// reduced gradient shards for NaN/Inf, and the ranks agree through one small all-reduce
// (cheap enough to leave on). A non-finite value is then traced, on every rank alike, to the
// unit and parameter where it appeared first in backward, so the report names its origin
// rather than everything it spread to (Megatron-FSDP checks one global flag only).
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "tessera/sdk/module.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

struct AnomalyReport {
  bool finite = true;         ///< every rank's loss and gradients are finite
  bool scaler_skips = false;  ///< non-finite, but a grad scaler will skip this step (not a failure)
  std::string message;        ///< what was found, the same on every rank (empty when finite)
};

/// Collective; call after the step's last backward and before optimizer_step. `loss` is
/// this rank's (accumulated) loss of the step. Unscales the gradients first (idempotent per
/// step), so a grad scaler's inf/NaN is told apart from a real one.
AnomalyReport check_finite_step(sdk::Strategy& strategy, sdk::Module& module, const at::Tensor& loss,
                                std::int64_t rank, std::int64_t world);

}  // namespace tessera::host
