#include "tessera/sdk/optimizer.hpp"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "tessera/sdk/error.hpp"

namespace tessera::sdk {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::vector<NamedParameter>& params,
                                                        const OptimizerSettings& s) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(params.size());
  for (const auto& p : params) tensors.push_back(p.tensor);
  if (s.name == "adamw")
    return std::make_unique<torch::optim::AdamW>(
        tensors, torch::optim::AdamWOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay));
  if (s.name == "adam")
    return std::make_unique<torch::optim::Adam>(
        tensors, torch::optim::AdamOptions(s.lr).betas({s.beta1, s.beta2}).eps(s.eps).weight_decay(s.weight_decay));
  if (s.name == "sgd")
    return std::make_unique<torch::optim::SGD>(
        tensors, torch::optim::SGDOptions(s.lr).momentum(s.momentum).weight_decay(s.weight_decay));
  TESSERA_FAIL("unknown optimizer '", s.name, "'", did_you_mean(s.name, {"adamw", "adam", "sgd"}), "; valid: adamw, adam, sgd");
}

}  // namespace tessera::sdk
