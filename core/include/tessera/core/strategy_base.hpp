#pragma once
/// The parts of a Strategy that every shipped strategy shares: wiring to the precision and
/// checkpoint IO, the world communicator, steps under the precision's context, the
/// optimizer step sequence, collectives, distributed sampling, state dicts and full
/// checkpoints. Subclasses (single_device, ddp, fsdp, fsdp2) override what sharding changes.
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/comm.hpp"
#include "tessera/sdk/options.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::core {

/// The one rule for "does this job train on CUDA": [strategy] accelerator = "cuda", or "auto"
/// where this LibTorch sees a GPU. The strategies and the host (plan, fit's memory warning) ask it.
bool accelerator_is_cuda(const std::string& accelerator);

class StrategyBase : public sdk::Strategy {
 public:
  /// Reads `accelerator` ("auto", "cpu", "cuda") and `device_id` (local rank 0's GPU; rank r
  /// uses device_id + r) from `options`.
  explicit StrategyBase(const sdk::Options& options);
  ~StrategyBase() override;

  void connect(std::shared_ptr<sdk::Precision> precision, std::shared_ptr<sdk::CheckpointIO> checkpoint_io) override;
  sdk::Precision& precision() override;
  sdk::CheckpointIO& checkpoint_io() override;

  /// Creates `world_` (a local communicator for one rank) and picks `device_`
  /// (cuda:local_rank for "cuda", or "auto" with a GPU present).
  void setup_environment(const sdk::ClusterInfo& cluster) override;
  sdk::GuardPtr model_sharded_context() override;
  /// Moves the network to `device_`, converts it for the precision, calls setup_module(),
  /// then builds the optimizer over optimizer_parameters().
  void setup(std::shared_ptr<sdk::Module> module, const sdk::OptimizerSettings& optimizer) override;
  torch::optim::Optimizer& optimizer() override;

  sdk::StepOutput training_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  sdk::StepOutput validation_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  sdk::StepOutput test_step(const sdk::Batch& batch, std::int64_t batch_idx) override;
  at::Tensor predict_step(const sdk::Batch& batch, std::int64_t batch_idx) override;

  void backward(const at::Tensor& loss, bool sync_gradients) override;
  sdk::StepResult optimizer_step(double gradient_clip_val, double norm_type) override;
  /// Norm over the optimizer's gradients on this rank (replicated parameters).
  double clip_grad_norm(double max_norm, double norm_type) override;

  at::Tensor reduce(const at::Tensor& tensor, sdk::ReduceOp op) override;
  void barrier(const std::string& name) override;
  void broadcast(at::Tensor& tensor, std::int64_t src) override;
  at::Tensor all_gather(const at::Tensor& tensor) override;
  sdk::DataLoaderSpec process_dataloader(sdk::DataLoaderSpec spec) override;

  sdk::StateDict lightning_module_state_dict() override;
  /// Checks every name and shape before copying anything: a bad state dict changes nothing.
  void load_model_state_dict(const sdk::StateDict& state, bool strict) override;
  sdk::Checkpoint optimizer_state() override;
  void load_optimizer_state(const sdk::Checkpoint& state) override;

  /// Full checkpoint: rank 0 saves through the CheckpointIO, then every rank barriers.
  void save_checkpoint(const sdk::Checkpoint& checkpoint, const std::string& path) override;
  void remove_checkpoint(const std::string& path) override;
  sdk::Checkpoint load_checkpoint(const std::string& path) override;
  void teardown() override;

  bool is_global_zero() const override;
  std::int64_t global_rank() const override;
  std::int64_t world_size() const override;
  c10::Device root_device() const override;

 protected:
  /// Called by setup() after the network is on its device, before the optimizer exists
  /// (DDP broadcasts parameters here; FSDP shards).
  virtual void setup_module();
  /// Clears gradients after a step (default: optimizer().zero_grad()).
  virtual void zero_grad();
  /// What the optimizer steps on, named after the original parameters.
  virtual std::vector<sdk::NamedParameter> optimizer_parameters();
  /// Whether this strategy's `accelerator` is CUDA (core::accelerator_is_cuda). The memory
  /// layouts read it too: on CUDA the collectives are NCCL's and the tensors on the GPU.
  bool trains_on_cuda() const;
  /// `batch` on `device_`, floating inputs converted by the precision.
  sdk::Batch prepare_batch(const sdk::Batch& batch);
  /// The communicator's ranks must agree: throws if setup_environment has not run.
  Communicator& world();

  std::shared_ptr<sdk::Precision> precision_;
  std::shared_ptr<sdk::CheckpointIO> checkpoint_io_;
  std::shared_ptr<sdk::Module> module_;
  std::shared_ptr<torch::nn::Module> network_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<std::string> optimizer_param_names_;
  CommunicatorPtr world_;
  sdk::ClusterInfo cluster_;
  std::string accelerator_;
  std::int64_t device_id_;
  std::string device_id_key_;
  /// process_group_backend = "gloo" on CUDA: Gloo carries the CUDA tensors through host
  /// memory, and local ranks may share a GPU (NCCL refuses two ranks on one device).
  bool cuda_over_gloo_ = false;
  c10::Device device_{c10::kCPU};
};

}  // namespace tessera::core
