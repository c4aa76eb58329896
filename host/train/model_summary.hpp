#pragma once
// Lightning's ModelSummary, printed when fit starts: the network's top-level modules and
// their parameters, and what each rank holds (parameters, gradients, optimizer state).
#include <string>

#include "tessera/sdk/module.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

/// The table (collective: every rank calls it; the per-rank figures are the max over ranks).
std::string model_summary(sdk::Module& model, sdk::Strategy& strategy, const sdk::OptimizerSettings& optimizer);

}  // namespace tessera::host
