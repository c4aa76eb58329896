#include "tessera/core/deferred_init.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/version.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/layer.hpp"

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
  void start(bool resume) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!resume) rng_state_ = at::detail::getDefaultCPUGenerator().get_state();
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
  explicit DeferredInitGuard(bool resume) { arena().start(resume); }
  ~DeferredInitGuard() override { arena().stop(); }
};

}  // namespace

sdk::GuardPtr deferred_init_guard() { return std::make_unique<DeferredInitGuard>(/*resume=*/false); }
sdk::GuardPtr resume_deferred_init_guard() { return std::make_unique<DeferredInitGuard>(/*resume=*/true); }

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
  if (auto* x = dynamic_cast<sdk::ResettableLayer*>(&m)) return x->reset_parameters(), true;
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

namespace {

// A split parameter pointed at a transient full-size tensor while its module is initialised.
struct FullShapeParameter {
  at::Tensor parameter, local;  // local: the memory the engine gave the piece
  sdk::TensorParallelPlacement placement;
};

// Points `m`'s own split parameters at zeroed full-size tensors (CPU, where an eager build
// draws), so that initialisers see the full layer's shapes and fan-in and draw its values.
std::vector<FullShapeParameter> widen_to_full_shapes(torch::nn::Module& m, std::int64_t tp_size) {
  std::vector<FullShapeParameter> widened;
  const auto* tp = dynamic_cast<const sdk::TensorParallelModule*>(&m);
  if (tp == nullptr || tp_size == 1) return widened;
  const std::map<std::string, sdk::TensorParallelPlacement> placements = tp->tensor_parallel_placements();
  for (auto& item : m.named_parameters(/*recurse=*/false)) {
    auto it = placements.find(item.key());
    if (it == placements.end() || it->second.dim < 0) continue;
    at::Tensor& p = item.value();
    std::vector<std::int64_t> full_shape = p.sizes().vec();
    full_shape.at(it->second.dim) *= tp_size;
    widened.push_back({p, p.data(), it->second});
    p.set_data(at::zeros(full_shape, p.options()));
  }
  return widened;
}

// Copies this rank's piece of each full value drawn into the engine's memory, which the
// parameter points at again; the full tensors are freed.
void keep_pieces(std::vector<FullShapeParameter>& widened, std::int64_t tp_rank, std::int64_t tp_size,
                 const std::string& path) {
  for (auto& w : widened) {
    at::Tensor full = w.parameter.data();
    TESSERA_CHECK(full.dim() == w.local.dim() && full.size(w.placement.dim) == w.local.size(w.placement.dim) * tp_size,
                  "deferred init: the initialiser of module '", path, "' changed the shape of a tensor-parallel ",
                  "parameter (", w.local.sizes(), " on this rank, initialised at full shape) to ", full.sizes());
    w.parameter.set_data(w.local);
    w.local.copy_(sdk::tensor_parallel_shard(full, w.placement, tp_rank, tp_size));
  }
}

}  // namespace

void initialize_modules(torch::nn::Module& network, const std::set<const void*>& params, c10::Device device,
                        const ParamInitFn& init, std::int64_t tp_rank, std::int64_t tp_size) {
  torch::NoGradGuard no_grad;
  for (const auto& item : network.named_modules()) {
    torch::nn::Module& m = *item.value();
    bool here = false, elsewhere = false;
    for (const auto& p : m.parameters(/*recurse=*/false)) (params.count(p.unsafeGetTensorImpl()) ? here : elsewhere) = true;
    if (!here) continue;
    TESSERA_CHECK(!elsewhere, "deferred init: the parameters of module '", item.key(), "' (", m.name(),
                  ") sit in different FSDP units (a tied weight?); build this model with [strategy] deferred_init = false");
    for (auto& b : m.buffers(/*recurse=*/false)) b.set_data(at::zeros(b.sizes(), b.options().device(device)));
    std::vector<FullShapeParameter> widened = widen_to_full_shapes(m, tp_size);
    const bool initialised = (init && init(item.key(), m)) || reset_known_module(m);
    keep_pieces(widened, tp_rank, tp_size, item.key());
    if (initialised) continue;
    TESSERA_FAIL("deferred init: module '", item.key(), "' of class '", m.name(),
                 "' has parameters but no known initialiser (tessera re-initialises LibTorch's Linear, Embedding, ",
                 "LayerNorm, Conv1d-3d, BatchNorm1d-3d and layers implementing tessera::sdk::ResettableLayer, such as ",
                 "SyncBatchNorm2d, ColumnParallelLinear and RowParallelLinear); ",
                 "initialise it in the model's init_parameters(), give its parameters to such modules or set ",
                 "[strategy] deferred_init = false");
  }
}

}  // namespace tessera::core
