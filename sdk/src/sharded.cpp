#include "tessera/sdk/sharded.hpp"

#include <torch/csrc/autograd/grad_mode.h>

#include "module_registry.hpp"

namespace tessera::sdk {

ShardedModel::~ShardedModel() = default;

namespace {
detail::ModuleRegistry<ShardedModel>& models() {
  static detail::ModuleRegistry<ShardedModel> instance;
  return instance;
}
}  // namespace

void set_sharded_model(const torch::nn::Module& network, std::shared_ptr<ShardedModel> model) {
  models().set(network, std::move(model));
}

ShardedModel* sharded_model(const torch::nn::Module& network) { return models().find(network); }

GuardPtr summon_full_params(const torch::nn::Module& network, const SummonOptions& options) {
  ShardedModel* model = sharded_model(network);
  return model ? model->summon_full_params(options) : nullptr;
}

void apply(torch::nn::Module& network, const std::function<void(torch::nn::Module&)>& fn) {
  if (ShardedModel* model = sharded_model(network)) return model->apply(fn);
  torch::NoGradGuard no_grad;
  network.apply([&](torch::nn::Module& m) { fn(m); });
}

std::vector<std::string> fsdp_modules(const torch::nn::Module& network, bool root_only) {
  ShardedModel* model = sharded_model(network);
  return model ? model->fsdp_modules(root_only) : std::vector<std::string>{""};
}

}  // namespace tessera::sdk
