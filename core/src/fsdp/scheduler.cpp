#include "fsdp/scheduler.hpp"

#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/csrc/autograd/grad_mode.h>

#include "tessera/sdk/error.hpp"

namespace tessera::core::fsdp {

namespace {

class Runner final : public sdk::UnitRunner {
 public:
  Runner(Scheduler& scheduler, FSDPUnit& unit) : scheduler_(scheduler), unit_(unit) {}
  std::vector<at::Tensor> run(torch::nn::Module&, sdk::UnitFunction forward,
                              const std::vector<at::Tensor>& inputs) override {
    return scheduler_.run_forward(unit_, std::move(forward), inputs);
  }

 private:
  Scheduler& scheduler_;
  FSDPUnit& unit_;
};

bool any_requires_grad(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

/// Floating tensors of `tensors` in `dtype` (differentiably); the others as they are.
std::vector<at::Tensor> cast_floating(const std::vector<at::Tensor>& tensors, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors)
    out.push_back(t.defined() && t.is_floating_point() && t.scalar_type() != dtype ? t.to(dtype) : t);
  return out;
}

}  // namespace

Scheduler::Scheduler(std::vector<std::unique_ptr<FSDPUnit>>& units, std::vector<at::Tensor> replicated,
                     const FSDPOptions& options, CommunicatorPtr shard_group, CommunicatorPtr replicate_group,
                     c10::Device device)
    : units_(units), replicated_(std::move(replicated)), options_(options), shard_group_(std::move(shard_group)),
      replicate_group_(std::move(replicate_group)), device_(device) {}

Scheduler::~Scheduler() {
  for (auto& u : units_)
    if (u->module) sdk::set_unit_runner(*u->module, nullptr);
}

void Scheduler::install() {
  for (auto& u : units_) {
    install_post_backward_hooks(*this, *u);
    if (u->module) sdk::set_unit_runner(*u->module, std::make_shared<Runner>(*this, *u));
  }
}

std::vector<at::Tensor> Scheduler::run_forward(FSDPUnit& unit, sdk::UnitFunction forward,
                                               const std::vector<at::Tensor>& inputs) {
  record_forward(unit);
  unshard(unit, Phase::forward);
  if (!unit.forward_prefetch.empty()) {
    for (FSDPUnit* next : unit.forward_prefetch) unshard(*next, Phase::prefetch_forward);
  } else if (options_.forward_prefetch) {
    if (FSDPUnit* next = next_unit(unit)) unshard(*next, Phase::prefetch_forward);
  }
  const bool grad = at::GradMode::is_enabled();
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> cast_inputs =
      options_.cast_forward_inputs ? cast_floating(inputs, unit.layout->compute_dtype()) : inputs;
  if (grad && (unit.expected_grads == 0 || unit.has_frozen)) {
    if (unit.has_frozen && any_requires_grad(cast_inputs)) ++unit.input_hooks;
    cast_inputs = attach_post_backward(*this, unit, cast_inputs);
  }
  if (grad && unit.checkpointed && any_requires_grad(cast_inputs)) {
    outputs = checkpointed_forward(*this, unit, std::move(forward), cast_inputs);
  } else {
    outputs = forward(cast_inputs);
    if (grad) outputs = attach_pre_backward(*this, unit, outputs);
  }
  if (options_.output_dtype) outputs = cast_floating(outputs, *options_.output_dtype);
  // FULL_SHARD frees after forward (keeping 1/k of it with a post-forward group);
  // SHARD_GRAD_OP keeps the parameters until backward. The unit that ran last stays gathered
  // (as torchtitan leaves its last block): backward starts with it and would gather it again.
  const bool backward_runs_it_next = grad && order_frozen_ && !order_.empty() && order_.back() == &unit;
  if (!backward_runs_it_next && (!grad || options_.sharding_strategy != ShardingStrategy::SHARD_GRAD_OP)) {
    if (grad && options_.post_forward_group) keep_post_forward_shard(unit);
    reshard(unit);
  }
  return outputs;
}

// Prefetch follows the order the units ran in the first forward (as PyTorch records it),
// not the order they were registered in; until then, registration order.
FSDPUnit* Scheduler::previous_unit(const FSDPUnit& unit) const {
  if (order_frozen_) return unit.order_position > 0 ? order_[unit.order_position - 1] : nullptr;
  return unit.index > 0 && !unit.is_root ? units_[unit.index - 1].get() : nullptr;
}

FSDPUnit* Scheduler::next_unit(const FSDPUnit& unit) const {
  if (order_frozen_)
    return unit.order_position >= 0 && unit.order_position + 1 < static_cast<std::int64_t>(order_.size())
               ? order_[unit.order_position + 1]
               : nullptr;
  return unit.index + 2 < units_.size() ? units_[unit.index + 1].get() : nullptr;  // never the root
}

void Scheduler::record_forward(FSDPUnit& unit) {
  if (order_frozen_ || unit.order_position >= 0) return;
  unit.order_position = static_cast<std::int64_t>(order_.size());
  order_.push_back(&unit);
}

void Scheduler::freeze_order() {
  if (!order_.empty()) order_frozen_ = true;
}

void Scheduler::keep_post_forward_shard(FSDPUnit& u) {
  if (!u.gathered || u.layout->unsharded_is_shard()) return;
  const Communicator& group = *options_.post_forward_group;
  const std::int64_t rows = shard_group_->size() / group.size();
  u.post_forward_shard = u.layout->gathered_rows(group.rank() * rows, rows);
}

std::int64_t Scheduler::units_gathered() const {
  std::int64_t n = 0;
  for (const auto& u : units_)
    if (!u->is_root && (u->gathered || u->gather_handle)) ++n;
  return n;
}

void Scheduler::unshard(FSDPUnit& u, Phase phase) {
  if (u.gathered) return;
  if (u.layout->unsharded_is_shard()) {
    u.gathered = true;
    return;
  }
  const bool prefetch = phase == Phase::prefetch_forward || phase == Phase::prefetch_backward;
  if (prefetch && !u.gather_handle && options_.max_gathered_units > 0 &&
      options_.sharding_strategy != ShardingStrategy::SHARD_GRAD_OP &&
      options_.sharding_strategy != ShardingStrategy::NO_SHARD && units_gathered() >= options_.max_gathered_units)
    return;  // limit_all_gathers: the unit gathers when it runs
  if (!u.gather_handle) {
    auto [output, input] = u.layout->all_gather_buffers(device_);
    const bool backward = phase == Phase::backward || phase == Phase::prefetch_backward;
    if (backward && u.post_forward_shard.defined()) {
      // The k ranks of the post-forward group hold the gathered rows in order between them.
      u.gather_input = std::exchange(u.post_forward_shard, at::Tensor());
      u.gather_handle = options_.post_forward_group->all_gather(output, u.gather_input, u.backward_tag);
    } else {
      u.post_forward_shard.reset();
      u.gather_input = input;
      u.gather_handle = shard_group_->all_gather(output, input, backward ? u.backward_tag : u.forward_tag);
    }
  }
  if (!u.is_root) peak_units_gathered_ = std::max(peak_units_gathered_, units_gathered());
  // A prefetch is waited for by the unshard that needs it.
  if (prefetch) return;
  finish_gather(u);
}

void Scheduler::finish_gather(FSDPUnit& u) {
  u.gather_handle->wait();
  u.gather_handle.reset();
  u.gather_input.reset();
  u.layout->after_all_gather();
  u.gathered = true;
}

void Scheduler::reshard(FSDPUnit& u) {
  if (u.gather_handle) finish_gather(u);  // a prefetch nobody used (the unit did not run): finish it, then drop it
  if (!u.gathered) return;
  u.layout->free_unsharded(/*recycle=*/true);
  u.gathered = false;
}

void Scheduler::attach_gradients(FSDPUnit& u) {
  // A frozen unit (no parameter requires grad) gets no gradient buffers and no reduce-scatter.
  if (u.grads_attached || u.expected_grads == 0 || !at::GradMode::is_enabled() && !training_step_active()) return;
  u.layout->attach_unsharded_grads();
  u.grads_attached = true;
}

void Scheduler::pre_backward(FSDPUnit& unit) {
  unshard(unit, Phase::backward);
  attach_gradients(unit);
  if (!unit.backward_prefetch.empty()) {
    for (FSDPUnit* previous : unit.backward_prefetch) unshard(*previous, Phase::prefetch_backward);
  } else if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE) {
    if (FSDPUnit* previous = previous_unit(unit)) unshard(*previous, Phase::prefetch_backward);
  }
}

void Scheduler::begin_forward(bool training) {
  FSDPUnit& root = *units_.back();
  for (auto& u : units_) u->input_hooks = 0;  // a forward no backward followed (validation) counts no more
  unshard(root, Phase::forward);
  if (training) {
    accumulating_ = true;
    attach_gradients(root);
  }
}

void Scheduler::end_forward() {
  freeze_order();
  reshard_all();
}

void Scheduler::reshard_all() {
  for (auto& u : units_) {
    reshard(*u);
    u->post_forward_shard.reset();  // also of a unit backward did not reach
  }
}

void Scheduler::begin_backward(bool sync) {
  freeze_order();
  sync_ = sync;
  for (auto& u : units_) {
    u->pending_grads = u->expected_grads + u->input_hooks;
    u->input_hooks = 0;
    u->reduced = false;
  }
}

void Scheduler::post_backward(FSDPUnit& u) {
  // Gradients of a unit whose pre-backward never ran would land outside the unsharded gradient.
  TESSERA_CHECK(u.grads_attached || u.expected_grads == 0, "FSDP unit '", u.name, "' received gradients but was not run through ",
                "sdk::invoke in this forward: every module of an FSDP unit class must be called through sdk::invoke ",
                "(or leave its class out of [strategy] transformer_layer_cls)");
  if (sync_) reduce_gradients(u);
  if (!u.is_root) reshard(u);
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST)
    if (FSDPUnit* previous = previous_unit(u)) unshard(*previous, Phase::prefetch_backward);
}

void Scheduler::reduce_gradients(FSDPUnit& u) {
  if (u.reduced || !u.grads_attached) return;
  u.reduced = true;
  at::ScalarType reduce_dtype = options_.mixed_precision.reduce_dtype.value_or(u.layout->compute_dtype());
  u.reduce_input = u.layout->reduce_scatter_input(reduce_dtype);
  if (shard_group_->size() > 1) {
    u.reduce_output = at::empty({u.layout->reduce_numel()}, u.reduce_input.options());
    u.reduce_handle = shard_group_->reduce_scatter(u.reduce_output, u.reduce_input, sdk::ReduceOp::mean, u.reduce_tag);
  } else {
    u.reduce_output = u.reduce_input;
  }
  // At most two reductions in flight: unit i's overlaps the backward of unit i-1, and the
  // unsharded gradients (plus the collective's buffers) of older units are freed instead of
  // piling up to a whole unsharded model by the end of backward.
  reducing_.push_back(&u);
  while (reducing_.size() > 2) {
    FSDPUnit* oldest = reducing_.front();
    reducing_.pop_front();
    finish_reduction(*oldest);
  }
}

void Scheduler::finish_reduction(FSDPUnit& u) {
  torch::NoGradGuard no_grad;
  if (u.reduce_handle) u.reduce_handle->wait();
  u.reduce_handle.reset();
  if (replicate_group_->size() > 1) replicate_group_->all_reduce(u.reduce_output, sdk::ReduceOp::mean, u.replica_tag)->wait();
  if (u.layout->accumulate_sharded_grad(u.reduce_output)) offload_copies_pending_ = true;
  u.reduce_input.reset();
  u.reduce_output.reset();
  u.layout->free_unsharded_grads();
  u.grads_attached = false;
}

void Scheduler::finish_backward() {
  if (sync_) {
    // Units whose hooks did not all fire (parameters unused this step) reduce now, in the
    // same unit order on every rank; then every reduction finishes in launch order.
    for (auto& u : units_) reduce_gradients(*u);
    while (!reducing_.empty()) {
      FSDPUnit* oldest = reducing_.front();
      reducing_.pop_front();
      finish_reduction(*oldest);
    }
    reduce_replicated_gradients();
    for (auto& u : units_) u->layout->materialize_sharded_grads();
    accumulating_ = false;
  }
#if TESSERA_WITH_CUDA
  if (offload_copies_pending_) c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();
#endif
  offload_copies_pending_ = false;
  reshard_all();
}

void Scheduler::reduce_replicated_gradients() {
  if (replicated_.empty()) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& p : replicated_) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // unused here, maybe used elsewhere
    grads.push_back(p.grad().reshape({-1}).to(at::kFloat));
  }
  at::Tensor flat = at::cat(grads);
  // Mean over shard group then replicate group = mean over the world.
  if (shard_group_->size() > 1) shard_group_->all_reduce(flat, sdk::ReduceOp::mean, "all-reduce of ignored parameters")->wait();
  if (replicate_group_->size() > 1)
    replicate_group_->all_reduce(flat, sdk::ReduceOp::mean, "replica all-reduce of ignored parameters")->wait();
  std::int64_t offset = 0;
  for (auto& p : replicated_) {
    p.mutable_grad().copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

void Scheduler::zero_grad() {
  for (auto& p : replicated_)
    if (p.grad().defined()) p.mutable_grad().zero_();
  const bool release = options_.free_sharded_grads.value_or(device_.is_cuda());
  for (auto& u : units_) u->layout->zero_sharded_grads(release);
}

}  // namespace tessera::core::fsdp
