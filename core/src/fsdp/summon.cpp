// Full parameters on demand (PyTorch's summon_full_params and FullyShardedDataParallel.apply).
#include "tessera/core/fsdp.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "tessera/sdk/error.hpp"
#include "sharded_module_state.hpp"

namespace tessera::core::fsdp {

namespace {

class ScopeExit final : public sdk::Guard {
 public:
  explicit ScopeExit(std::function<void()> on_exit) : on_exit_(std::move(on_exit)) {}
  ~ScopeExit() override { on_exit_(); }

 private:
  std::function<void()> on_exit_;
};

}  // namespace

sdk::GuardPtr ShardedModule::summon_full_params(bool writeback, bool rank0_only, bool offload_to_cpu, bool with_grads) {
  TESSERA_CHECK(!(writeback && rank0_only), "summon_full_params(writeback = true, rank0_only = true) is not allowed ",
                "(as in PyTorch): ranks other than 0 hold no full parameters to write back");
  TESSERA_CHECK(!d_->summoned, "summon_full_params: already inside summon_full_params (nesting is not supported)");
  TESSERA_CHECK(!d_->scheduler->accumulating(),
                "summon_full_params between a training step's forward and its backward is not allowed");
  const bool on_cpu = offload_to_cpu && !d_->device.is_cpu();
  TESSERA_CHECK(!(with_grads && on_cpu), "summon_full_params(with_grads = true) with offload_to_cpu = true on ", d_->device,
                " is not supported: summon the gradients without offload_to_cpu");
  if (on_cpu) return summon_full_params_on_cpu(writeback, rank0_only);
  torch::NoGradGuard no_grad;
  for (auto& u : d_->units) d_->scheduler->unshard(*u, Scheduler::Phase::forward);  // collective on every rank
  if (with_grads) attach_full_grads();  // collective too
  if (rank0_only && !is_global_rank0()) {
    for (auto& u : d_->units) {
      if (with_grads)
        for (auto& p : u->layout->params()) p.tensor.mutable_grad().reset();
      d_->scheduler->reshard(*u);
    }
    return nullptr;
  }
  auto snapshots = std::make_shared<std::vector<at::Tensor>>();
  if (writeback)
    for (auto& u : d_->units)
      snapshots->push_back(u->layout->compute_dtype() == u->layout->master_dtype()
                               ? at::Tensor()
                               : u->layout->owned_part(u->layout->unsharded()).clone());
  d_->summoned = true;
  return std::make_unique<ScopeExit>([this, snapshots, writeback, with_grads] {
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < d_->units.size(); ++k) {
      UnitLayout& layout = *d_->units[k]->layout;
      if (writeback) layout.write_back(layout.owned_part(layout.unsharded()), (*snapshots)[k]);
      if (with_grads)
        for (auto& p : layout.params()) p.tensor.mutable_grad().reset();
      d_->scheduler->reshard(*d_->units[k]);
    }
    d_->summoned = false;
  });
}

// with_grads: every parameter's .grad := its full (reduced, sharded) gradient, gathered.
void ShardedModule::attach_full_grads() {
  for (auto& u : d_->units) {
    UnitLayout& layout = *u->layout;
    std::vector<at::Tensor> pieces;
    for (const auto& t : layout.optimizer_tensors()) pieces.push_back(t.grad().defined() ? t.grad().to(at::kFloat) : at::zeros_like(t, fp32()));
    std::vector<at::Tensor> full =
        layout.gather_full_state(pieces, *d_->shard_group, d_->device, "summon all-gather of gradients of " + u->name);
    const auto& params = layout.params();
    for (std::size_t i = 0; i < params.size(); ++i)
      params[i].tensor.mutable_grad() = full[i].to(params[i].tensor.options());
  }
}

void ShardedModule::apply(const std::function<void(torch::nn::Module&)>& fn) {
  sdk::GuardPtr full = summon_full_params(/*writeback=*/true);
  torch::NoGradGuard no_grad;
  d_->network->apply([&](torch::nn::Module& m) { fn(m); });
}

// offload_to_cpu on a GPU: each unit is gathered, copied to the CPU and freed again, so the
// model is whole only in CPU memory; the parameters point at the CPU copies until the guard
// ends, then (with writeback) the changed elements go back into the shards.
sdk::GuardPtr ShardedModule::summon_full_params_on_cpu(bool writeback, bool rank0_only) {
  torch::NoGradGuard no_grad;
  const bool keep = !rank0_only || is_global_rank0();
  auto copies = std::make_shared<std::vector<at::Tensor>>(), originals = std::make_shared<std::vector<at::Tensor>>();
  for (auto& u : d_->units) {
    UnitLayout& layout = *u->layout;
    d_->scheduler->unshard(*u, Scheduler::Phase::forward);  // collective on every rank
    copies->push_back(keep ? layout.unsharded().to(at::kCPU) : at::Tensor());
    originals->push_back(keep && writeback && layout.compute_dtype() != layout.master_dtype()
                             ? layout.owned_part(copies->back()).clone()
                             : at::Tensor());
    if (keep) layout.point_params_at(copies->back());
    d_->scheduler->reshard(*u);
  }
  if (!keep) return nullptr;
  d_->summoned = true;
  return std::make_unique<ScopeExit>([this, copies, originals, writeback] {
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < d_->units.size(); ++k) {
      FSDPUnit& u = *d_->units[k];
      if (writeback) u.layout->write_back(u.layout->owned_part((*copies)[k]), (*originals)[k]);
      u.layout->point_params_at(u.layout->unsharded());
      install_post_backward_hooks(*d_->scheduler, u);
      u.gathered = false;  // one-rank shard groups keep the buffer: refreshed from the shard on the next use
    }
    d_->summoned = false;
  });
}

}  // namespace tessera::core::fsdp
