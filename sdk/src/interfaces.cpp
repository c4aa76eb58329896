// Out-of-line destructors and defaults: they anchor the interfaces' vtables and type info
// in the SDK library, shared by the host and every plugin.
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/guard.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/layer.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/precision.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/strategy.hpp"
#include "tessera/sdk/tensor_parallel.hpp"

namespace tessera::sdk {

PluginObject::~PluginObject() = default;
Guard::~Guard() = default;
Dataset::~Dataset() = default;
DataModule::~DataModule() = default;
Module::~Module() = default;
Precision::~Precision() = default;
CheckpointIO::~CheckpointIO() = default;
Strategy::~Strategy() = default;
HuggingFaceModel::~HuggingFaceModel() = default;
ResettableLayer::~ResettableLayer() = default;
BatchNormLayer::~BatchNormLayer() = default;

std::unique_ptr<torch::optim::Optimizer> Module::configure_optimizers(const std::vector<NamedParameter>& params,
                                                                      const OptimizerSettings& settings) {
  return make_optimizer(params, settings);
}

std::vector<std::string> Module::fsdp_unit_classes() const { return {}; }
bool Module::fsdp_wrap_policy(const std::string&, const torch::nn::Module&) const { return false; }
bool Module::init_parameters(const std::string&, torch::nn::Module&) { return false; }

void Module::parallelize(const ParallelContext& context) {
  if (!context.tp || context.tp->size() == 1) return;
  auto net = network();
  TESSERA_FAIL("model ", net ? net->name() : std::string("(not configured)"),
               " has no tensor-parallel plan (sdk::Module::parallelize), so it cannot run with tensor_parallel_size = ",
               context.tp->size(), "; use tensor_parallel_size = 1");
}

Checkpoint make_checkpoint() { return Checkpoint(c10::StringType::get(), c10::AnyType::get()); }

const char* to_string(PluginKind kind) {
  switch (kind) {
    case PluginKind::strategy: return "strategy";
    case PluginKind::precision: return "precision";
    case PluginKind::checkpoint_io: return "checkpoint_io";
    case PluginKind::model: return "model";
    case PluginKind::data: return "data";
    case PluginKind::callback: return "callback";
  }
  return "unknown";
}

}  // namespace tessera::sdk
