#include "plan/plan_job.hpp"

#include <algorithm>
#include <numeric>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <cstdlib>
#include <functional>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/version.h>

#include "callbacks/callbacks.hpp"
#include "compose/plugin_set.hpp"
#include "launch/launcher.hpp"
#include "tessera/core/deferred_init.hpp"
#include "plugin_loader.hpp"
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/autograd_graph.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/memory_layout.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/strategy.hpp"
#include "tessera/sdk/strategy_checks.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/unit.hpp"
#include "tessera/toolkit/fused.hpp"
#include "tessera/toolkit/tensor_parallel.hpp"
#include "train/trainer.hpp"

#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below
#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <torch/cuda.h>
#endif

namespace tessera::host {

namespace {

/// Counts the CPU bytes allocated through it that are still alive, and their peak: what one
/// forward leaves for backward (every tensor autograd saved, the outputs) and its temporaries.
class CountingAllocator final : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)  // non-const, copy_data
  c10::DataPtr allocate(std::size_t n) override { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(std::size_t n) const override { return counted(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void start() {
    std::lock_guard<std::mutex> lock(mutex_);
    live_ = 0;
    previous_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, /*priority=*/255);
  }
  void stop() { c10::SetCPUAllocator(previous_, /*priority=*/255); }
  std::int64_t live() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }

 private:
  // LibTorch requires data == context of a CPU DataPtr (resize and storage sharing move it), so
  // each block's size and the inner allocation are found again by address.
  static void release(void* data) {
    CountingAllocator& self = instance();
    c10::DataPtr inner;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.blocks_.find(data);
      if (it == self.blocks_.end()) return;
      self.live_ -= it->second.first;
      inner = std::move(it->second.second);
      self.blocks_.erase(it);
    }
  }
  c10::DataPtr counted(std::size_t n) const {
    c10::DataPtr inner = previous_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    std::lock_guard<std::mutex> lock(mutex_);
    live_ += static_cast<std::int64_t>(n);
    if (data != nullptr) blocks_.emplace(data, std::make_pair(static_cast<std::int64_t>(n), std::move(inner)));
    return {data, data, &release, device};
  }

 public:
  static CountingAllocator& instance() {
    static auto* counter = new CountingAllocator();  // never destroyed: traced tensors may outlive main
    return *counter;
  }

 private:
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, std::pair<std::int64_t, c10::DataPtr>> blocks_;
  mutable std::int64_t live_ = 0;
  c10::Allocator* previous_ = nullptr;
};

CountingAllocator& counting_allocator() { return CountingAllocator::instance(); }

// A rank forked by tessera's launcher (host/launch/launcher.cpp) maps the launcher's anonymous
// memory at once but none of its file pages: it faults in only the code it runs, not what
// loading LibTorch and the plugins touched once (~108 MB of the ~190 MB of this process here).
// Training touches ~35 MB of them: on 2 cores, 5 multi-rank configurations of PlanVsMeasured's
// 43M GPT measured 70-77 MB under a plan of this process's whole RSS.
constexpr double kForkedRankCodeBytes = 35.0 * 1048576.0;

/// What CUDA's autocast keeps beyond a CPU trace (cuda_autocast_extra()).
struct CudaAutocastExtra {
  double bytes = 0;
  std::int64_t outputs = 0;  ///< the softmax and log_softmax outputs counted
};

/// CUDA's autocast runs softmax and log_softmax in fp32 where the CPU's runs them in the
/// input's low precision, and backward keeps their outputs: a CUDA job keeps the fp32 output
/// (4 bytes an element) of each one this CPU trace kept in bf16 or fp16, beside the
/// low-precision copy the attention's matmul then takes of a softmax's (+4 bytes an element
/// in all), and a log_softmax's in place of its low-precision one (+2: the loss takes fp32).
/// Counted on the autograd graph that `output` ends. On the 1.3B bench GPT (26 layers, 16
/// heads, 4 x 512 tokens) that is 1,665 MiB.
CudaAutocastExtra cuda_autocast_extra(const at::Tensor& output) {
  CudaAutocastExtra extra;
  sdk::for_each_autograd_node(output, [&](torch::autograd::Node& node) {
    // The output each kept (one of the forward's outputs: unpacked with its node).
    const torch::autograd::SavedVariable* result = nullptr;
    double extra_per_byte = 0;
    if (auto* softmax = dynamic_cast<torch::autograd::generated::SoftmaxBackward0*>(&node)) {
      result = &softmax->result_;
      extra_per_byte = 2;  // + 4 bytes per 2-byte element
    } else if (auto* log_softmax = dynamic_cast<torch::autograd::generated::LogSoftmaxBackward0*>(&node)) {
      result = &log_softmax->result_;
      extra_per_byte = 1;  // + 2 bytes per 2-byte element
    }
    if (result == nullptr) return;
    const at::Tensor kept = result->unpack(node.shared_from_this());
    if (kept.defined() && (kept.scalar_type() == at::kBFloat16 || kept.scalar_type() == at::kHalf)) {
      extra.bytes += extra_per_byte * static_cast<double>(kept.nbytes());
      ++extra.outputs;
    }
  });
  return extra;
}

/// A scalar whose autograd graph joins those of `tensors` (the ones with history), so that one
/// walk of it counts what they share once; undefined when none has history.
at::Tensor joined(const std::vector<at::Tensor>& tensors) {
  at::Tensor out;
  for (const at::Tensor& t : tensors)
    if (t.defined() && t.grad_fn()) out = out.defined() ? out + t.sum() : t.sum();
  return out;
}

/// Runs a unit the strategy checkpoints as any other, and records what its forward left
/// alive besides its outputs: what checkpointing frees after the forward and recomputes in
/// backward, one unit at a time; and the tensor-parallel all-reduces of its forward, which the
/// recomputation makes again. Units never nest (the wrap policy picks outermost modules).
class RecomputedUnitProbe final : public sdk::UnitRunner {
 public:
  /// `count_cuda_autocast`: also record each unit's cuda_autocast_extra() (a CUDA job's plan).
  explicit RecomputedUnitProbe(bool count_cuda_autocast) : count_cuda_autocast_(count_cuda_autocast) {}

  std::vector<at::Tensor> run(torch::nn::Module&, sdk::UnitFunction forward,
                              const std::vector<at::Tensor>& inputs) override {
    const std::int64_t before = counting_allocator().live();
    std::vector<at::Tensor> outputs = forward(inputs);
    double internals = static_cast<double>(counting_allocator().live() - before);
    std::unordered_set<const void*> kept;  // the inputs' and outputs' storages stay alive
    for (const at::Tensor& t : inputs)
      if (t.defined() && t.has_storage()) kept.insert(t.storage().data());
    for (const at::Tensor& t : outputs)
      if (t.defined() && t.has_storage() && kept.insert(t.storage().data()).second)
        internals -= static_cast<double>(t.storage().nbytes());
    internals_.push_back(std::max(0.0, internals));
    // The graph from the outputs is the unit's own plus the one from its inputs.
    const toolkit::TensorParallelTraffic through = toolkit::tensor_parallel_traffic(joined(outputs));
    const toolkit::TensorParallelTraffic before_unit = toolkit::tensor_parallel_traffic(joined(inputs));
    recomputed_.group_size = std::max(recomputed_.group_size, through.group_size);
    recomputed_.forward_all_reduces += through.forward_all_reduces - before_unit.forward_all_reduces;
    recomputed_.forward_all_reduce_bytes += through.forward_all_reduce_bytes - before_unit.forward_all_reduce_bytes;
    // Under autocast, the unit's fp32 softmax outputs on CUDA are internals too.
    if (count_cuda_autocast_ && sdk::autocast_enabled(/*cuda=*/false))
      cuda_autocast_.push_back(cuda_autocast_extra(joined(outputs)).bytes - cuda_autocast_extra(joined(inputs)).bytes);
    return outputs;
  }
  const std::vector<double>& internals() const { return internals_; }
  /// cuda_autocast_extra() of each recorded unit, under autocast.
  const std::vector<double>& cuda_autocast() const { return cuda_autocast_; }
  /// The forward all-reduces inside the recorded units.
  const toolkit::TensorParallelTraffic& recomputed() const { return recomputed_; }

 private:
  bool count_cuda_autocast_;
  std::vector<double> internals_, cuda_autocast_;
  toolkit::TensorParallelTraffic recomputed_;
};

/// Installs `probe` on `units` for the life of the guard.
class ProbeGuard {
 public:
  ProbeGuard(std::vector<std::shared_ptr<torch::nn::Module>> units, std::shared_ptr<RecomputedUnitProbe> probe)
      : units_(std::move(units)) {
    for (const auto& unit : units_) sdk::set_unit_runner(*unit, probe);
  }
  ~ProbeGuard() {
    for (const auto& unit : units_) sdk::set_unit_runner(*unit, nullptr);
  }
  ProbeGuard(const ProbeGuard&) = delete;
  ProbeGuard& operator=(const ProbeGuard&) = delete;

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> units_;
};

struct Trace {
  double saved = 0;
  std::int64_t samples = 0;  ///< traced: the batch size, or every sample of a smaller dataset
  CudaAutocastExtra cuda_autocast;  ///< counted for a CUDA job whose forward ran under autocast
  std::string method;
  toolkit::TensorParallelTraffic tensor_parallel;  ///< the traced graph's activation all-reduces
  toolkit::TensorParallelTraffic recomputed;       ///< those the checkpointed units' recomputation makes again
  toolkit::LossPathMemory loss;                    ///< the loss path beyond `saved` (scaled as it)
};

/// One training forward on the configured batch (real shapes, the parameters' values garbage
/// from deferred init), under the precision's forward context, counting what it allocates.
/// The `recomputed` units (activation checkpointing) keep their inputs and outputs only, and
/// the largest one's internals count once more: backward recomputes one unit at a time.
/// `count_cuda_autocast` (a CUDA job's plan): also count what CUDA's autocast would keep more.
Trace trace_forward(sdk::Module& model, sdk::Precision& precision, sdk::DataModule& data, std::int64_t batch_size,
                    std::vector<std::shared_ptr<torch::nn::Module>> recomputed, bool count_cuda_autocast) {
  Trace trace;
  std::shared_ptr<sdk::Dataset> dataset = data.train_dataset();
  TESSERA_CHECK(dataset && dataset->size() > 0, "the data plugin has no training data to trace a forward with");
  // A huge batch is traced on kMaxTracedSamples and scaled (what autograd keeps is per sample, as
  // largest_batch_size assumes): tracing [data] batch_size = 100000 would itself outgrow the machine.
  constexpr std::int64_t kMaxTracedSamples = 256;
  trace.samples = std::min<std::int64_t>(batch_size, dataset->size());
  const std::int64_t n = std::min(trace.samples, kMaxTracedSamples);
  std::vector<std::int64_t> indices;
  for (std::int64_t i = 0; i < n; ++i) indices.push_back(i);
  sdk::Batch batch = dataset->get_batch(indices);
  if (batch.input.defined() && batch.input.is_floating_point()) batch.input = precision.convert_input(batch.input);
  if (batch.target.defined() && batch.target.is_floating_point()) batch.target = precision.convert_input(batch.target);
  torch::AutoGradMode grad(true);
  auto probe = std::make_shared<RecomputedUnitProbe>(count_cuda_autocast);
  ProbeGuard probing(std::move(recomputed), probe);
  CountingAllocator& counter = counting_allocator();
  counter.start();
  try {
    {
      sdk::GuardPtr guard = precision.forward_context();
      sdk::StepOutput out = model.training_step(batch, 0);
      trace.saved = static_cast<double>(counter.live());
      trace.tensor_parallel = toolkit::tensor_parallel_traffic(out.loss);
      trace.loss = toolkit::loss_path_memory(out.loss);
      trace.saved -= trace.loss.kept_weight_gradient_bytes;  // per step, not per sample: a loss row
      if (count_cuda_autocast && sdk::autocast_enabled(/*cuda=*/false)) trace.cuda_autocast = cuda_autocast_extra(out.loss);
    }
  } catch (...) {
    counter.stop();
    throw;
  }
  counter.stop();
  trace.method = "autograd's saved tensors after one traced forward of " + std::to_string(n) + " sample(s)" +
                 (trace.samples < batch_size ? " (the whole training set)" : "") +
                 (n < trace.samples ? ", scaled to " + std::to_string(trace.samples) : "");
  trace.recomputed = probe->recomputed();
  const std::vector<double>& internals = probe->internals();
  if (!internals.empty()) {
    const double dropped = std::accumulate(internals.begin(), internals.end(), 0.0);
    const double largest = *std::max_element(internals.begin(), internals.end());
    trace.saved += largest - dropped;
    trace.method += "; " + std::to_string(internals.size()) + " checkpointed unit call(s) keep their inputs and " +
                    "outputs only (" + mb(dropped) + " less), one recomputed at a time (the largest, +" +
                    mb(largest) + ")";
  }
  const std::vector<double>& unit_extras = probe->cuda_autocast();
  if (!unit_extras.empty())  // as their internals: one recomputed unit's at a time
    trace.cuda_autocast.bytes += *std::max_element(unit_extras.begin(), unit_extras.end()) -
                                 std::accumulate(unit_extras.begin(), unit_extras.end(), 0.0);
  if (n < trace.samples) {
    const double scale = static_cast<double>(trace.samples) / static_cast<double>(n);
    trace.saved *= scale;
    trace.cuda_autocast.bytes *= scale;
    if (trace.loss.unfused > 0) {
      trace.loss.workspace_bytes *= scale;
      trace.loss.logits = static_cast<std::int64_t>(static_cast<double>(trace.loss.logits) * scale);
    }
    for (toolkit::TensorParallelTraffic* traffic : {&trace.tensor_parallel, &trace.recomputed}) {
      traffic->forward_all_reduce_bytes *= scale;
      traffic->backward_all_reduce_bytes *= scale;
    }
  }
  return trace;
}

/// The compute capability major of the GPU local rank 0 trains on, or -1 when unknown.
int cuda_compute_major(const Config& config) {
#if TESSERA_WITH_CUDA
  const std::int64_t device = config.resolved["strategy"]["device_id"].value_or(std::int64_t{0});
  if (device < static_cast<std::int64_t>(torch::cuda::device_count()))
    return at::cuda::getDeviceProperties(static_cast<int>(device))->major;
#endif
  (void)config;
  return -1;
}

}  // namespace

double cuda_memory_bytes(const Config& config, std::int64_t local_ranks) {
  if (const char* forced = std::getenv("TESSERA_DEVICE_MEMORY_MB"))  // tests
    return std::strtod(forced, nullptr) * 1048576.0;
#if TESSERA_WITH_CUDA
  // Each local rank r trains on cuda:(device_id + r); over Gloo, ranks beyond the GPUs share them
  // round robin (core::StrategyBase), each with its part of the device. Device properties need no
  // CUDA context, so this process takes no device memory from the ranks.
  const std::int64_t first = config.resolved["strategy"]["device_id"].value_or(std::int64_t{0});
  const std::int64_t count = static_cast<std::int64_t>(torch::cuda::device_count());
  const bool shared = config.resolved["strategy"]["process_group_backend"].value_or(std::string("auto")) == "gloo";
  std::map<std::int64_t, std::int64_t> ranks_on;  // device -> local ranks on it
  for (std::int64_t r = 0; r < local_ranks && first < count; ++r) {
    const std::int64_t d = shared ? first + r % (count - first) : first + r;
    if (d < count) ++ranks_on[d];
  }
  double smallest = -1;
  for (const auto& [d, ranks] : ranks_on) {
    const double share = static_cast<double>(at::cuda::getDeviceProperties(static_cast<int>(d))->totalGlobalMem) /
                         static_cast<double>(ranks);
    smallest = smallest < 0 ? share : std::min(smallest, share);
  }
  return smallest;
#else
  (void)config, (void)local_ranks;
  return -1;
#endif
}

bool trains_on_cuda(const Config& config) {
  return core::accelerator_is_cuda(config.resolved["strategy"]["accelerator"].value_or(std::string("auto")));
}

PlannedJob plan_job(const Config& config, bool trace_activations) {
  PlannedJob job;
  const sdk::ClusterInfo planned = planned_cluster(config.launch);
  sdk::ClusterInfo cluster = planned;
  job.world_size = cluster.world_size;
  job.local_ranks = cluster.environment == "single" || cluster.environment == "local" ? config.launch.devices
                                                                                     : cluster.local_world_size;
  cluster.local_world_size = job.local_ranks;

  core::PluginLoader loader(core::PluginLoader::search_path(config.plugin_dirs));
  PluginSet plugins = compose_plugins(loader, config);
  const auto& strategy = plugins.strategy;
  const auto& precision = plugins.precision;
  const auto& checkpoint_io = plugins.checkpoint_io;
  auto& model = plugins.model;  // reset once traced
  const auto& data = plugins.data;
  if (auto* checks = dynamic_cast<sdk::StrategyChecks*>(strategy.get()))
    checks->check_world_size(cluster.world_size, cluster.environment);
  // fit's ranks meet these first: their errors are the job's, not the plan's.
  auto job_setup = [](const std::function<void()>& step) {
    try {
      step();
    } catch (const sdk::Error& e) {
      throw JobSetupError(e.what(), e.where());
    }
  };
  job_setup([&] { data->setup("fit"); });
  PlanInputs in;
  const bool forked_ranks = cluster.environment == "local" && job.local_ranks > 1;
  in.baseline_bytes = forked_ranks ? 1024.0 * (proc_status_kb("RssAnon") + proc_status_kb("RssShmem")) + kForkedRankCodeBytes
                                   : 1024.0 * proc_status_kb("VmRSS");
  in.strategy = config.plugin_names.at("strategy");
  in.optimizer = config.optimizer.name;
  in.momentum = config.optimizer.momentum;
  in.world_size = job.world_size;
  in.local_ranks = job.local_ranks;
  in.accumulate_grad_batches = config.trainer.accumulate_grad_batches;
  in.cuda = trains_on_cuda(config);
  in.two_level_collectives = config.launch.shared_memory_collectives;
  if (in.cuda) in.cublas_workspace_bytes = cublas_workspace_bytes(std::getenv("CUBLAS_WORKSPACE_CONFIG"), cuda_compute_major(config));
  // What the strategy says of its layout (sdk::StrategyMemoryLayout); a strategy without it
  // gets a plan that says its layout is unknown.
  auto* layout = dynamic_cast<sdk::StrategyMemoryLayout*>(strategy.get());
  if (layout) {
    in.cpu_offload = layout->offloads_state_to_cpu();
    in.gradients_freed_after_step = layout->frees_gradients_after_step();
  }
  job_setup([&] {
    sdk::GuardPtr deferred = core::deferred_init_guard();
    sdk::GuardPtr dtype = precision->module_init_context();
    model->configure_model();
  });
  // A training rank holds more than this process does here: the trainer's loop, loggers and data
  // loader, c10d's store and process groups, and what jemalloc's arenas keep of setup's and each
  // step's freed temporaries, which grows with the model. Fitted on the 2-core CI machine
  // (PlanVsMeasured): 40 MB above a plan without it on the 43M GPT (163 MB of fp32
  // parameters) under every strategy, 14-16 MB on the shipped gpt-fortunes and the main job's
  // Llama (3-4 MB of parameters), where a constant 40 MB put the plan 11-14% over.
  double parameter_bytes = 0;
  for (const at::Tensor& p : model->network()->parameters())
    parameter_bytes += static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
  in.runtime_bytes = 15.0 * 1048576.0 + 0.15 * parameter_bytes;
  job_setup([&] { Trainer::freeze_parameters(config, *model->network()); });  // no gradient, no moments
  for (const auto& [name, callback] : make_callbacks(config, loader)) {
    const auto* copy = dynamic_cast<const KeepsWeightCopy*>(callback.get());
    if (copy == nullptr) continue;
    in.weight_averaging = true;
    if (copy->copies_buffers())
      for (const auto& b : model->network()->buffers())
        in.averaged_buffer_bytes += static_cast<double>(b.numel()) * static_cast<double>(b.element_size());
  }
  std::string trace_problem;
  std::int64_t traced_samples = 0;
  try {
    if (layout) {
      // The layout may apply the model's tensor-parallel plan, whose refusals (a tp size that
      // does not split the heads) every rank would meet in setup: the job's errors, before it starts.
      job_setup([&] { in.layout = layout->memory_layout(*model, cluster, in.accumulate_grad_batches); });
      in.layout_of_micro_batches = in.layout->counts_micro_batches;
    }
    Trace trace;
    if (trace_activations) {
      std::vector<std::shared_ptr<torch::nn::Module>> recomputed;
      if (layout) recomputed = layout->checkpointed_units(*model);
      trace = trace_forward(*model, *precision, *data, config.data.batch_size, std::move(recomputed), in.cuda);
    } else {
      trace.method = "not traced";
    }
    in.activation_bytes = trace.saved;
    traced_samples = trace.samples;
    in.activation_method = trace.method;
    const toolkit::LossPathMemory& loss = trace.loss;
    in.loss_bytes = loss.workspace_bytes + loss.kept_weight_gradient_bytes;
    in.loss_bytes_per_sample = loss.fused == 0;
    if (loss.fused > 0)
      in.loss_method = "the fused loss's chunk (logits, softmax, casts) and its kept weight gradient (" +
                       mb(loss.kept_weight_gradient_bytes) + ")";
    else if (loss.unfused > 0)
      in.loss_method = "the logits (freed, still resident) and backward's gradients of them and of the "
                       "log-probabilities, beside the kept log-probabilities (" + std::to_string(loss.logits) +
                       " logits; [model] fused_loss = true holds a chunk instead)";
    if (trace.cuda_autocast.bytes > 0) {
      in.activation_bytes += trace.cuda_autocast.bytes;
      in.activation_method += "; +" + mb(trace.cuda_autocast.bytes) + " for the " +
                              std::to_string(trace.cuda_autocast.outputs) +
                              " softmax / log_softmax output(s) CUDA's autocast computes in fp32";
    }
    const toolkit::TensorParallelTraffic& tp = trace.tensor_parallel;
    if (in.layout && tp.group_size > 1) {
      in.layout->collectives.push_back({"all_reduce", "tensor-parallel forward all-reduces of activations (" +
                                                         std::to_string(tp.forward_all_reduces) + ")",
                                        tp.forward_all_reduce_bytes, tp.group_size});
      in.layout->collectives.push_back({"all_reduce", "tensor-parallel backward all-reduces of activation gradients (" +
                                                         std::to_string(tp.backward_all_reduces) + ")",
                                        tp.backward_all_reduce_bytes, tp.group_size});
      if (trace.recomputed.forward_all_reduces > 0)
        in.layout->collectives.push_back(
            {"all_reduce", "tensor-parallel all-reduces of the checkpointed units' recomputed forwards (" +
                               std::to_string(trace.recomputed.forward_all_reduces) + ")",
             trace.recomputed.forward_all_reduce_bytes, trace.recomputed.group_size});
    }
  } catch (const c10::Error& e) {  // e.g. fp16 compute, which the CPU has not
    trace_problem = e.what_without_backtrace();
    trace_problem = trace_problem.substr(0, trace_problem.find('\n'));
  }
  model.reset();
  core::release_deferred_init_memory();
  job.plan = make_plan(in);
  if (job.plan.known && traced_samples > 0) {
    const double available = memory_available_bytes();
    const double device = in.cuda ? cuda_memory_bytes(config, job.local_ranks) : -1;
    if (available > 0 || device > 0) {
      job.plan.largest_batch_size = largest_batch_size(in, traced_samples, available, device);
      job.plan.batch_size_bound =
          (available > 0 ? "the " + mb(available) + " available to " + std::to_string(job.local_ranks) + " local rank(s)" : "") +
          (available > 0 && device > 0 ? " and " : "") + (device > 0 ? "the GPU's " + mb(device) : "") +
          " (activations scaled from the " + std::to_string(traced_samples) + " traced)";
    }
  }
  if (!trace_activations)
    job.plan.notes.push_back("activations not traced (fit's check before a CUDA job: `tessera plan` traces them)");
  if (!trace_problem.empty())
    job.plan.notes.push_back("activations not traced (one forward on this machine's CPU failed: " + trace_problem +
                             "): counted as 0");
  if (in.cuda)
    job.plan.notes.push_back(
        "[strategy] accelerator = \"" + config.resolved["strategy"]["accelerator"].value_or(std::string("auto")) +
        "\": the device rows are CUDA tensors (activations traced on the CPU, with the same shapes); the CUDA context "
        "and the caching allocator's reserve are not counted, so nvidia-smi shows more");
  return job;
}

}  // namespace tessera::host
