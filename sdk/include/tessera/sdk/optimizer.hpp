#pragma once
/// The [optimizer] section, and the default optimizer a Module builds from it.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

struct OptimizerSettings {
  std::string name = "adamw";  ///< "adamw", "adam" or "sgd"
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  ///< sgd only
};

/// A parameter as the optimizer will see it: under FSDP this is the local shard, named
/// after the original parameter.
struct NamedParameter {
  std::string name;
  at::Tensor tensor;
};

/// AdamW/Adam/SGD over `params` (one param group), from `settings`.
TESSERA_SDK_API std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<NamedParameter>& params,
                                                                        const OptimizerSettings& settings);

}  // namespace tessera::sdk
