#pragma once
/// Model plugins (Lightning's LightningModule): a torch::nn::Module tree plus the steps.
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

struct ParallelContext;  // tensor_parallel.hpp

class TESSERA_SDK_API Module : public PluginObject {
 public:
  ~Module() override;

  /// Build the network (Lightning's configure_model). The host calls it once, on every
  /// rank, inside the strategy's model_sharded_context() and the precision's
  /// module_init_context(), so a strategy may defer or shard initialisation.
  virtual void configure_model() = 0;
  /// The root of the network built by configure_model().
  virtual std::shared_ptr<torch::nn::Module> network() = 0;

  /// Forward plus loss for one batch. Runs under the precision's forward_context().
  virtual StepOutput training_step(const Batch& batch, std::int64_t batch_idx) = 0;
  virtual StepOutput validation_step(const Batch& batch, std::int64_t batch_idx) = 0;
  virtual StepOutput test_step(const Batch& batch, std::int64_t batch_idx) = 0;
  /// Inference output for one batch (e.g. generated tokens); no gradients. [trainer]
  /// predict_output writes it, so there it must have one row per sample, of one shape and dtype.
  virtual at::Tensor predict_step(const Batch& batch, std::int64_t batch_idx) = 0;

  /// The optimizer over `params` (the strategy's view: shards under FSDP). The default,
  /// in the SDK library, is make_optimizer(params, settings).
  virtual std::unique_ptr<torch::optim::Optimizer> configure_optimizers(const std::vector<NamedParameter>& params,
                                                                        const OptimizerSettings& settings);

  /// Names (torch::nn::Module::name()) of the classes that are FSDP units and are run
  /// through sdk::invoke(): what the "transformer" auto-wrap policy wraps. Default: none.
  virtual std::vector<std::string> fsdp_unit_classes() const;

  /// The "custom" auto-wrap policy (PyTorch's lambda_auto_wrap_policy / CustomPolicy):
  /// whether the module at `path` (e.g. "blocks.3") becomes an FSDP unit; the module must then
  /// be run through sdk::invoke. Called once per module, outermost first; the modules inside a
  /// unit are not asked. Default: false (the root is the only unit).
  virtual bool fsdp_wrap_policy(const std::string& path, const torch::nn::Module& module) const;

  /// Deferred init (PyTorch FSDP's param_init_fn): initialise, in place, the parameters and
  /// buffers that `module` (at `path` in the network) owns directly, as configure_model()
  /// does. FSDP strategies call it unit by unit under [strategy] deferred_init, after giving
  /// the module real memory. Return false to let the module's own reset_parameters() do it
  /// (LibTorch's Linear, Embedding, LayerNorm, Conv, BatchNorm; the toolkit's tensor-parallel
  /// Linear layers as a Linear of the full size). Under tensor parallelism a module holding
  /// tensor-parallel pieces comes with its split parameters at their full shape (the same
  /// values on every tp rank), and the strategy keeps this rank's piece after. Default: false
  /// everywhere, right for models that keep LibTorch's default initialisation.
  virtual bool init_parameters(const std::string& path, torch::nn::Module& module);

  /// Saved as "hyper_parameters" in checkpoints.
  virtual Checkpoint hyper_parameters() const = 0;

  /// Tensor parallelism (NeMo's parallelize_fn): replace the network's layers by the
  /// tensor-parallel layers of tessera/toolkit/tensor_parallel.hpp, each holding this rank's
  /// piece of the current (full, identical on every rank) parameters, so a run starts from the
  /// single-device weights. Called by a DP x TP strategy once, after configure_model() and
  /// before the strategy shards anything. Check sizes before changing anything (an sdk::Error
  /// naming the config key and the valid tp sizes). Default: nothing when the tp group has
  /// one rank, else an sdk::Error ("model X has no tensor-parallel plan"). Under deferred
  /// init the parameters are deferred (no memory): cut them, never compute with their values;
  /// the pieces stay deferred and are initialised through init_parameters().
  virtual void parallelize(const ParallelContext& context);
};

}  // namespace tessera::sdk
