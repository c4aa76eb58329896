#include "tessera/core/deferred_init.hpp"

#include <algorithm>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/version.h>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

// While the guard lives, every CPU allocation is served from one scratch block as large as
// the largest request so far (allocated through the previous allocator), so a model's
// construction costs one tensor's memory; the values written are garbage until the strategy
// re-points each unit's tensors at real memory and initialises them.
void arena_noop(void*) {}

class ArenaAllocator final : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)  // non-const, copy_data
  c10::DataPtr allocate(std::size_t n) override { return allocate_scratch(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(std::size_t n) const override { return allocate_scratch(n); }
#endif
  c10::DataPtr allocate_scratch(std::size_t n) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (n > capacity_ || blocks_.empty()) {
      blocks_.push_back(previous_->allocate(std::max<std::size_t>(n, 64)));
      capacity_ = std::max<std::size_t>(n, 64);
    }
    void* data = blocks_.back().get();
    return {data, data, &arena_noop, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void start() {
    std::lock_guard<std::mutex> lock(mutex_);
    rng_state_ = at::detail::getDefaultCPUGenerator().get_state();
    previous_ = c10::GetCPUAllocator();
    c10::SetCPUAllocator(this, /*priority=*/255);
  }
  void stop() { c10::SetCPUAllocator(previous_, /*priority=*/255); }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.clear();
    capacity_ = 0;
  }
  void restore_rng() {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    if (rng_state_.defined()) generator.set_state(rng_state_);
  }

 private:
  mutable std::mutex mutex_;
  mutable std::vector<c10::DataPtr> blocks_;
  mutable std::size_t capacity_ = 0;
  c10::Allocator* previous_ = nullptr;
  at::Tensor rng_state_;
};

ArenaAllocator& arena() {
  static ArenaAllocator instance;
  return instance;
}

class DeferredInitGuard final : public sdk::Guard {
 public:
  DeferredInitGuard() { arena().start(); }
  ~DeferredInitGuard() override { arena().stop(); }
};

}  // namespace

sdk::GuardPtr deferred_init_guard() { return std::make_unique<DeferredInitGuard>(); }

bool is_deferred(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.device().is_cpu() && t.storage().data_ptr().get_deleter() == &arena_noop;
}

bool has_deferred_tensors(const torch::nn::Module& network) {
  for (const auto& p : network.parameters())
    if (is_deferred(p)) return true;
  for (const auto& b : network.buffers())
    if (is_deferred(b)) return true;
  return false;
}

void replay_deferred_init_rng() { arena().restore_rng(); }
void release_deferred_init_memory() { arena().release(); }

bool reset_known_module(torch::nn::Module& m) {
  if (auto* x = dynamic_cast<torch::nn::LinearImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::LayerNormImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::Conv1dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::Conv2dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::Conv3dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::BatchNorm1dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::BatchNorm2dImpl*>(&m)) return x->reset_parameters(), true;
  if (auto* x = dynamic_cast<torch::nn::BatchNorm3dImpl*>(&m)) return x->reset_parameters(), true;
  return false;
}

void initialize_modules(torch::nn::Module& network, const std::set<const void*>& params, c10::Device device,
                        const ParamInitFn& init) {
  torch::NoGradGuard no_grad;
  for (const auto& item : network.named_modules()) {
    torch::nn::Module& m = *item.value();
    bool here = false, elsewhere = false;
    for (const auto& p : m.parameters(/*recurse=*/false)) (params.count(p.unsafeGetTensorImpl()) ? here : elsewhere) = true;
    if (!here) continue;
    TESSERA_CHECK(!elsewhere, "deferred init: the parameters of module '", item.key(), "' (", m.name(),
                  ") sit in different FSDP units (a tied weight?); build this model with [strategy] deferred_init = false");
    for (auto& b : m.buffers(/*recurse=*/false)) b.set_data(at::zeros(b.sizes(), b.options().device(device)));
    if (init && init(item.key(), m)) continue;
    TESSERA_CHECK(reset_known_module(m), "deferred init: module '", item.key(), "' of class '", m.name(),
                  "' has parameters but no known initialiser (tessera re-initialises LibTorch's Linear, Embedding, ",
                  "LayerNorm, Conv1d-3d and BatchNorm1d-3d); initialise it in the model's init_parameters(), give its ",
                  "parameters to such modules or set [strategy] deferred_init = false");
  }
}

}  // namespace tessera::core
