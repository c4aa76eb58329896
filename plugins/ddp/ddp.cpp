// The `ddp` strategy: replicated parameters (broadcast from rank 0 at setup), gradients
// averaged in buckets whose all-reduce starts from gradient-accumulator hooks while the rest
// of backward still runs (PyTorch DDP's overlap), and no reduction on non-final
// micro-batches (no_sync). The baseline FSDP is measured against.
#include <algorithm>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "tessera/core/comm.hpp"
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/memory_layout.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::plugins {

namespace {

class DDPStrategy;

/// Runs after a parameter's gradient has been accumulated into .grad.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(DDPStrategy* owner, std::size_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;

 private:
  DDPStrategy* owner_;
  std::size_t index_;
};

class DDPStrategy final : public core::StrategyBase, public sdk::StrategyMemoryLayout {
 public:
  explicit DDPStrategy(const sdk::Options& options)
      : StrategyBase(options),
        bucket_bytes_(
            static_cast<std::int64_t>(options.get_double({"bucket_cap_mb",
                                                          "PyTorch DDP's bucket_cap_mb: gradients are all-reduced in "
                                                          "buckets of this many MiB, overlapped with backward"},
                                                         25.0, 0.001) *
                                      1024 * 1024)) {}

  void backward(const at::Tensor& loss, bool sync_gradients) override {
    sync_ = sync_gradients && world().size() > 1;
    for (auto& bucket : buckets_) {
      bucket.pending = static_cast<std::int64_t>(bucket.params.size());
      bucket.handle.reset();
    }
    precision().pre_backward(loss).backward();
    if (!sync_) return;
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (!buckets_[b].handle) launch(b);  // parameters that got no gradient this step
    torch::NoGradGuard no_grad;
    for (auto& bucket : buckets_) {
      bucket.handle->wait();
      std::int64_t offset = 0;
      for (auto& p : bucket.params) {
        at::Tensor reduced = bucket.flat.narrow(0, offset, p.numel()).view(p.sizes());
        if (p.grad().defined()) p.mutable_grad().copy_(reduced);
        else p.mutable_grad() = reduced.clone();
        offset += p.numel();
      }
    }
  }

  /// LibTorch 2's Optimizer::zero_grad sets the gradients to none (StrategyBase::zero_grad);
  /// 1.13's zeroes them.
  bool frees_gradients_after_step() const override { return TORCH_VERSION_MAJOR >= 2; }

  /// The whole model and its gradients on every rank, plus the gradient buckets (a second copy
  /// of the gradients, allocated at setup); one ring all-reduce of every bucket per step.
  sdk::MemoryLayout memory_layout(sdk::Module& module, const sdk::ClusterInfo& cluster, std::int64_t) override {
    sdk::MemoryLayout out;
    std::vector<at::Tensor> params;
    for (const auto& p : module.network()->parameters()) {
      out.param_bytes += static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
      if (p.requires_grad()) params.push_back(p);
    }
    std::reverse(params.begin(), params.end());  // as setup_module buckets them
    std::int64_t bucket_bytes = 0, bucket_numel = 0, largest = 0, low_precision_numel = 0;
    c10::optional<at::ScalarType> dtype;
    for (const auto& p : params) {
      const std::int64_t bytes = p.numel() * static_cast<std::int64_t>(p.element_size());
      if (out.units == 0 || bucket_bytes + bytes > bucket_bytes_ || dtype != p.scalar_type()) {
        ++out.units;
        bucket_bytes = 0;
        bucket_numel = 0;
        dtype = p.scalar_type();
      }
      bucket_bytes += bytes;
      bucket_numel += p.numel();
      largest = std::max(largest, bucket_numel);
      out.grad_bytes += static_cast<double>(bytes);
      out.optimizer_numel += p.numel();
      out.optimizer_dtype = p.scalar_type();
      if (p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf) low_precision_numel += p.numel();
    }
    out.persistent_buffer_bytes = out.grad_bytes;
    out.setup_bytes = out.param_bytes;
    // Gloo all-reduces 16-bit buckets through fp32 copies, all of them in flight at the end of
    // backward; shared memory reduces them where they are, through its segment, and NCCL in place.
    if (trains_on_cuda()) out.collective_buffer_bytes = 0;
    else if (core::shared_memory_collectives(cluster)) out.collective_buffer_bytes = core::shared_memory_segment_bytes(cluster.world_size);
    else if (cluster.world_size > 1) out.collective_buffer_bytes = 4.0 * static_cast<double>(low_precision_numel);
    out.largest_unit = "bucket of " + std::to_string(largest) + " elements";
    if (cluster.world_size > 1)
      out.collectives.push_back({"all_reduce", "gradient all-reduce of every bucket", out.grad_bytes, cluster.world_size});
    out.description = "ddp: the whole model on each of " + std::to_string(cluster.world_size) + " rank(s), " +
                      std::to_string(out.units) + " gradient bucket(s) of at most " +
                      std::to_string(bucket_bytes_ / (1024 * 1024)) + " MiB";
    return out;
  }

  void grad_ready(std::size_t param_index) {
    if (!sync_) return;
    std::size_t b = bucket_of_[param_index];
    if (--buckets_[b].pending == 0) launch(b);
  }

 protected:
  void setup_module() override {
    torch::NoGradGuard no_grad;
    // Buckets in reverse registration order: roughly the order gradients become ready.
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (auto& item : network_->named_parameters())
      if (item.value().requires_grad()) params.push_back(item.value()), names.push_back(item.key());
    std::reverse(params.begin(), params.end());
    std::reverse(names.begin(), names.end());
    std::vector<std::string> plan;  // one entry per bucket: its parameters, elements and dtype
    for (std::size_t i = 0; i < params.size(); ++i) {
      at::Tensor& p = params[i];
      std::int64_t bytes = p.numel() * static_cast<std::int64_t>(p.element_size());
      if (buckets_.empty() || buckets_.back().bytes + bytes > bucket_bytes_ ||
          buckets_.back().flat_dtype != p.scalar_type()) {
        buckets_.push_back(Bucket{{}, {}, 0, 0, {}, p.scalar_type()});
        plan.emplace_back(std::string(c10::toString(p.scalar_type())) + ":");
      }
      Bucket& bucket = buckets_.back();
      bucket.params.push_back(p);
      bucket.bytes += bytes;
      bucket_of_[i] = buckets_.size() - 1;
      plan.back() += " " + names[i] + "[" + std::to_string(p.numel()) + "]";
    }
    // Ranks that bucket differently would all-reduce mismatched buffers: compare before the
    // first collective that depends on the model (the broadcasts below).
    core::check_plan_agreement(world(), plan, device_, "DDP", "gradient bucket");
    for (auto& p : network_->parameters()) broadcast(p, 0);
    for (auto& b : network_->buffers()) broadcast(b, 0);
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
      accumulator->add_post_hook(std::make_unique<GradReadyHook>(this, i));
      accumulators_.push_back(std::move(accumulator));  // the variable holds it only weakly
    }
    for (auto& bucket : buckets_) {
      std::int64_t numel = 0;
      for (auto& p : bucket.params) numel += p.numel();
      bucket.flat = at::empty({numel}, bucket.params.front().options());
    }
  }

 private:
  struct Bucket {
    std::vector<at::Tensor> params;
    at::Tensor flat;
    std::int64_t bytes;
    std::int64_t pending;
    core::CommHandlePtr handle;
    at::ScalarType flat_dtype;
  };

  void launch(std::size_t b) {
    Bucket& bucket = buckets_[b];
    torch::NoGradGuard no_grad;
    std::int64_t offset = 0;
    for (auto& p : bucket.params) {
      at::Tensor slot = bucket.flat.narrow(0, offset, p.numel());
      if (p.grad().defined()) slot.copy_(p.grad().reshape({-1}));
      else slot.zero_();
      offset += p.numel();
    }
    bucket.handle = world().all_reduce(bucket.flat, sdk::ReduceOp::mean, "gradient all-reduce of bucket " +
                                                                             std::to_string(b));
  }

  std::int64_t bucket_bytes_;
  bool sync_ = false;
  std::vector<Bucket> buckets_;
  std::unordered_map<std::size_t, std::size_t> bucket_of_;
  // grad_accumulator()'s pointer: shared_ptr before LibTorch 2.14, intrusive_ptr since.
  std::vector<decltype(torch::autograd::impl::grad_accumulator(at::Tensor()))> accumulators_;
};

torch::autograd::variable_list GradReadyHook::operator()(const torch::autograd::variable_list& outputs,
                                                         const torch::autograd::variable_list&) {
  owner_->grad_ready(index_);
  return outputs;
}

}  // namespace

}  // namespace tessera::plugins

TESSERA_PLUGIN(strategy, TESSERA_VERSION,
               tessera::sdk::plugin_entry<tessera::plugins::DDPStrategy>(
                   "ddp", "DistributedDataParallel: replicated model, bucketed gradient all-reduce overlapped with "
                          "backward"));
