#include "tessera/core/strategy_base.hpp"

#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "../checkpoint/dcp.hpp"
#include "../checkpoint/loaded_weights.hpp"  // the engine's own, beside its sources
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "cluster/cluster.hpp"
#include "tessera/core/clip_grad.hpp"
#include "tessera/core/deferred_init.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

StrategyBase::StrategyBase(const sdk::Options& options)
    : accelerator_(options.get_choice(
          {"accelerator", "where ranks compute; auto: CUDA when LibTorch and a GPU are there, else the CPU"}, "auto",
          {"auto", "cpu", "cuda"})),
      device_id_(options.get_int({"device_id",
                                  "local rank 0's GPU; rank r uses device_id + r (round robin when "
                                  "process_group_backend = \"gloo\" shares GPUs)"},
                                 0, 0)),
      device_id_key_(options.locate("device_id")) {
  // Lightning's process_group_backend. c10d's backend follows the tensors' device (Gloo for host
  // tensors, with shared memory between the ranks of a host; NCCL for CUDA ones); "gloo" on CUDA
  // stages the CUDA tensors through host memory (several ranks may then share a GPU). NCCL
  // cannot carry host tensors: refused before work rather than ignored.
  const std::string backend = options.get_choice(
      {"process_group_backend",
       "auto: gloo on the CPU, nccl on CUDA; gloo on CUDA carries CUDA tensors through host memory (slow)"},
      "auto", {"auto", "gloo", "nccl"});
  const bool cuda = trains_on_cuda();
  TESSERA_CHECK(cuda || backend != "nccl", options.locate("process_group_backend"),
                " = \"nccl\" cannot carry this job's host tensors ([strategy] accelerator = \"", accelerator_, "\"",
                (accelerator_ == "auto" ? std::string(" is cpu here") : ""),
                "): NCCL moves CUDA tensors only; valid: \"auto\", \"gloo\"");
  cuda_over_gloo_ = cuda && backend == "gloo";
}
StrategyBase::~StrategyBase() = default;

void StrategyBase::connect(std::shared_ptr<sdk::Precision> precision, std::shared_ptr<sdk::CheckpointIO> checkpoint_io) {
  TESSERA_CHECK(precision && checkpoint_io, "a strategy needs both a precision and a checkpoint_io plugin");
  precision_ = std::move(precision);
  checkpoint_io_ = std::move(checkpoint_io);
}

sdk::Precision& StrategyBase::precision() {
  TESSERA_CHECK(precision_, "strategy used before connect(): no precision plugin");
  return *precision_;
}

sdk::CheckpointIO& StrategyBase::checkpoint_io() {
  TESSERA_CHECK(checkpoint_io_, "strategy used before connect(): no checkpoint_io plugin");
  return *checkpoint_io_;
}

bool accelerator_is_cuda(const std::string& accelerator) {
  return accelerator == "cuda" || (accelerator == "auto" && at::hasCUDA());
}

bool StrategyBase::trains_on_cuda() const { return accelerator_is_cuda(accelerator_); }

void StrategyBase::setup_environment(const sdk::ClusterInfo& cluster) {
  cluster_ = cluster;
  const bool cuda = trains_on_cuda();
  TESSERA_CHECK(!cuda || at::hasCUDA(), "[strategy] accelerator = \"cuda\" but this tessera ",
                (TESSERA_WITH_CUDA ? "sees no CUDA device" : "was built without CUDA"), "; valid here: \"cpu\", \"auto\"");
  // device_id (PyTorch FSDP's name) is local rank 0's GPU; the others follow it, so two jobs
  // can share a node: device_id = 4 puts a 4-rank job on cuda:4-7.
  TESSERA_CHECK(cuda || device_id_ == 0, device_id_key_, " = ", device_id_, " names a CUDA device, but this run is on the CPU");
  if (cuda) {
    const std::int64_t count = static_cast<std::int64_t>(torch::cuda::device_count());
    std::int64_t index = device_id_ + cluster.local_rank;
    if (cuda_over_gloo_) {  // ranks beyond the GPUs share them, round robin from device_id
      TESSERA_CHECK(device_id_ < count, device_id_key_, " = ", device_id_, " but this node has ", count,
                    " CUDA device(s); valid device_id: 0 to ", count - 1);
      index = device_id_ + (cluster.local_rank % (count - device_id_));
    }
    TESSERA_CHECK(index < count, "local rank ", cluster.local_rank, " would use cuda:", index, " (", device_id_key_, " = ",
                  device_id_, " + local rank) but this node has ", count, " CUDA device(s); valid device_id: 0 to ",
                  std::max<std::int64_t>(0, count - cluster.local_world_size),
                  " (NCCL takes one GPU per rank; [strategy] process_group_backend = \"gloo\" lets ranks share GPUs, ",
                  "slowly)");
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  } else {
    device_ = c10::Device(c10::kCPU);
  }
  // One CPU rank needs no process group; on CUDA even one rank goes through NCCL, so the
  // GPU path is the one used at scale.
  if (cluster.world_size > 1 || device_.is_cuda()) {
    sdk::ClusterInfo rendezvous = cluster;
    std::optional<ReservedPort> reserved;  // until the store listens on it
    if (rendezvous.master_port == 0) rendezvous.master_port = reserved.emplace().port();
    world_ = make_communicator(rendezvous, device_, cuda_over_gloo_);
  } else {
    world_ = make_local_communicator();
  }
}

Communicator& StrategyBase::world() {
  TESSERA_CHECK(world_, "strategy used before setup_environment()");
  return *world_;
}

sdk::GuardPtr StrategyBase::model_sharded_context() { return nullptr; }

void StrategyBase::setup(std::shared_ptr<sdk::Module> module, const sdk::OptimizerSettings& optimizer) {
  TESSERA_CHECK(module, "setup() needs a model");
  module_ = std::move(module);
  network_ = module_->network();
  TESSERA_CHECK(network_, "the model plugin returned no network: configure_model() must build it");
  // A network built under deferred init is not anywhere yet: the strategy materialises it on
  // the device unit by unit (moving it whole would allocate the whole model there).
  if (!has_deferred_tensors(*network_)) network_->to(device_);
  precision().convert_module(*network_);
  setup_module();
  std::vector<sdk::NamedParameter> params = optimizer_parameters();
  optimizer_ = module_->configure_optimizers(params, optimizer);
  TESSERA_CHECK(optimizer_, "configure_optimizers() returned no optimizer");
  optimizer_param_names_ = optimizer_order_names(*optimizer_, params);
}

void StrategyBase::setup_module() {}

std::vector<sdk::NamedParameter> StrategyBase::optimizer_parameters() {
  std::vector<sdk::NamedParameter> params;
  for (const auto& item : network_->named_parameters(/*recurse=*/true))
    if (item.value().requires_grad()) params.push_back({item.key(), item.value()});
  return params;
}

torch::optim::Optimizer& StrategyBase::optimizer() {
  TESSERA_CHECK(optimizer_, "optimizer() called before setup()");
  return *optimizer_;
}

sdk::Batch StrategyBase::prepare_batch(const sdk::Batch& batch) {
  auto move = [&](const at::Tensor& t) -> at::Tensor {
    if (!t.defined()) return t;
    at::Tensor on_device = t.to(device_, /*non_blocking=*/true);
    return on_device.is_floating_point() ? precision().convert_input(on_device) : on_device;
  };
  return sdk::Batch{move(batch.input), move(batch.target), move(batch.position_ids)};
}

sdk::StepOutput StrategyBase::training_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  sdk::Batch prepared = prepare_batch(batch);
  sdk::GuardPtr guard = precision().forward_context();
  sdk::StepOutput out = module_->training_step(prepared, batch_idx);
  out.loss = precision().convert_output(out.loss);
  return out;
}

sdk::StepOutput StrategyBase::validation_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  torch::NoGradGuard no_grad;
  sdk::Batch prepared = prepare_batch(batch);
  sdk::GuardPtr guard = precision().forward_context();
  return module_->validation_step(prepared, batch_idx);
}

sdk::StepOutput StrategyBase::test_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  torch::NoGradGuard no_grad;
  sdk::Batch prepared = prepare_batch(batch);
  sdk::GuardPtr guard = precision().forward_context();
  return module_->test_step(prepared, batch_idx);
}

at::Tensor StrategyBase::predict_step(const sdk::Batch& batch, std::int64_t batch_idx) {
  torch::NoGradGuard no_grad;
  sdk::Batch prepared = prepare_batch(batch);
  sdk::GuardPtr guard = precision().forward_context();
  return module_->predict_step(prepared, batch_idx);
}

void StrategyBase::backward(const at::Tensor& loss, bool /*sync_gradients*/) {
  precision().pre_backward(loss).backward();
}

sdk::StepResult StrategyBase::optimizer_step(double gradient_clip_val, double norm_type) {
  sdk::StepResult result;
  precision().unscale_gradients(optimizer(), *this);
  if (gradient_clip_val > 0) result.grad_norm = clip_grad_norm(gradient_clip_val, norm_type);
  result.stepped = precision().optimizer_step(optimizer(), *this);
  zero_grad();
  return result;
}

void StrategyBase::zero_grad() { optimizer().zero_grad(); }

double StrategyBase::clip_grad_norm(double max_norm, double norm_type) {
  std::vector<at::Tensor> gradients;
  for (const auto& group : optimizer().param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined()) gradients.push_back(p.grad());
  return core::clip_grad_norm({}, gradients, max_norm, norm_type, nullptr, device_);
}

at::Tensor StrategyBase::reduce(const at::Tensor& tensor, sdk::ReduceOp op) {
  at::Tensor out = tensor.detach().clone();
  if (world().size() > 1) world().all_reduce(out, op, "reduce")->wait();
  return out;
}

void StrategyBase::barrier(const std::string& name) {
  if (world().size() > 1) world().barrier(name);
}

void StrategyBase::broadcast(at::Tensor& tensor, std::int64_t src) {
  if (world().size() > 1) world().broadcast(tensor, src, "broadcast")->wait();
}

at::Tensor StrategyBase::all_gather(const at::Tensor& tensor) {
  at::Tensor input = tensor.detach().contiguous();
  std::vector<std::int64_t> shape{world().size()};
  shape.insert(shape.end(), input.sizes().begin(), input.sizes().end());
  at::Tensor output = at::empty(shape, input.options());
  if (world().size() > 1) world().all_gather(output.view({-1}), input.view({-1}), "all_gather")->wait();
  else output[0].copy_(input);
  return output;
}

sdk::DataLoaderSpec StrategyBase::process_dataloader(sdk::DataLoaderSpec spec) {
  spec.num_replicas = cluster_.world_size;
  spec.rank = cluster_.global_rank;
  return spec;
}

sdk::StateDict StrategyBase::lightning_module_state_dict() {
  sdk::StateDict state;
  for (const auto& item : network_->named_parameters(true)) state.insert(item.key(), item.value().detach());
  for (const auto& item : network_->named_buffers(true)) state.insert(item.key(), item.value().detach());
  return state;
}

void StrategyBase::load_model_state_dict(const sdk::StateDict& state, bool strict) {
  sdk::StateDict own = lightning_module_state_dict();
  const auto parameters = network_->named_parameters(true);
  std::vector<std::string> missing, unexpected;
  for (const auto& item : own)
    if (!state.contains(item.key())) missing.push_back(item.key());
  for (const auto& item : state) {
    const at::Tensor* target = own.find(item.key());
    if (target == nullptr) {
      unexpected.push_back(item.key());
      continue;
    }
    TESSERA_CHECK(target->sizes() == item.value().sizes(), "checkpoint state_dict['", item.key(), "'] has shape ",
                  item.value().sizes(), " but the model's parameter has shape ", target->sizes(),
                  ": the checkpoint was written for a different model configuration");
    check_weight_dtype(item.key(), item.value(), *target);
    // A parameter only: a buffer may hold infinities on purpose (an attention mask).
    if (parameters.contains(item.key())) check_finite_weight(item.key(), item.value());
  }
  TESSERA_CHECK(!strict || (missing.empty() && unexpected.empty()), "checkpoint state_dict does not match the model: ",
                missing.size(), " missing key(s) [", sdk::join(missing), "], ", unexpected.size(),
                " unexpected key(s) [", sdk::join(unexpected), "]");
  torch::NoGradGuard no_grad;
  for (const auto& item : state)
    if (at::Tensor* target = own.find(item.key())) target->copy_(item.value());
}

sdk::Checkpoint StrategyBase::optimizer_state() { return optimizer_state_dict(optimizer(), optimizer_param_names_); }

void StrategyBase::load_optimizer_state(const sdk::Checkpoint& state) {
  load_optimizer_state_dict(optimizer(), state, optimizer_param_names_);
}

void StrategyBase::save_checkpoint(const sdk::Checkpoint& checkpoint, const std::string& path) {
  if (is_global_zero()) {
    sdk::ShardInfo full{0, 1, false};
    checkpoint_io().save_checkpoint(checkpoint, path, full);
    checkpoint_io().finalize_checkpoint(path, full);
  }
  barrier("save_checkpoint");
}

void StrategyBase::remove_checkpoint(const std::string& path) {
  if (is_global_zero()) checkpoint_io().remove_checkpoint(path);
  barrier("remove_checkpoint");
}

sdk::Checkpoint StrategyBase::load_checkpoint(const std::string& path) {
  // A PyTorch DCP folder or a sharded checkpoint (fsdp state_dict_type = "sharded") is
  // consolidated to full tensors.
  if (is_dcp_checkpoint(path)) {
    std::map<std::string, StackedPieces> wanted;
    for (const auto& item : StrategyBase::lightning_module_state_dict())
      wanted.emplace(item.key(), StackedPieces{TensorPiece::whole(item.value().sizes())});
    return load_dcp(path, wanted, dcp_model_shape(*module_), global_rank());
  }
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    sdk::CheckpointMetadata meta = checkpoint_io().read_metadata(path);
    if (meta.sharded) {
      std::map<std::string, TensorPiece> wanted;
      for (const auto& item : StrategyBase::lightning_module_state_dict())
        wanted.emplace(item.key(), TensorPiece::whole(item.value().sizes()));
      return read_resharded_checkpoint(checkpoint_io(), path, meta.world_size, wanted);
    }
  }
  return checkpoint_io().load_checkpoint(path, sdk::ShardInfo{0, 1, false});
}

void StrategyBase::teardown() {
  optimizer_.reset();
}

bool StrategyBase::is_global_zero() const { return cluster_.global_rank == 0; }
std::int64_t StrategyBase::global_rank() const { return cluster_.global_rank; }
std::int64_t StrategyBase::world_size() const { return cluster_.world_size; }
c10::Device StrategyBase::root_device() const { return device_; }

}  // namespace tessera::core
