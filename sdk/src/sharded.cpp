#include "tessera/sdk/sharded.hpp"

#include <mutex>
#include <unordered_map>

#include <torch/csrc/autograd/grad_mode.h>

namespace tessera::sdk {

ShardedModel::~ShardedModel() = default;

namespace {
struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<ShardedModel>> models;
};
Registry& registry() {
  static Registry instance;
  return instance;
}
}  // namespace

void set_sharded_model(const torch::nn::Module& network, std::shared_ptr<ShardedModel> model) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (model) r.models[&network] = std::move(model);
  else r.models.erase(&network);
}

ShardedModel* sharded_model(const torch::nn::Module& network) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.models.find(&network);
  return it == r.models.end() ? nullptr : it->second.get();
}

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
