// toolkit::linear_cross_entropy against the unfused math (the logits, upcast to fp32, and
// cross_entropy with ignore_index -100, as causal_lm.hpp computed the loss before it).
#include <gtest/gtest.h>

#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/autograd.h>

#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/fused.hpp"

namespace {

using tessera::toolkit::linear_cross_entropy;
using tessera::toolkit::LinearCrossEntropyOptions;

struct LossAndGrads {
  at::Tensor loss, grad_hidden, grad_weight;
};

/// loss, d loss / d hidden and d loss / d weight, with the loss's gradient `scale`.
template <typename Loss>
LossAndGrads run(const at::Tensor& hidden, const at::Tensor& weight, Loss loss_of, double scale = 1.0) {
  // clone() keeps the strides of a dense tensor: a transposed input stays transposed.
  at::Tensor h = hidden.detach().clone().requires_grad_(true), w = weight.detach().clone().requires_grad_(true);
  at::Tensor loss = loss_of(h, w);
  (loss * scale).backward();
  return {loss.detach(), h.grad(), w.grad()};
}

at::Tensor unfused(const at::Tensor& h, const at::Tensor& w, const at::Tensor& target) {
  at::Tensor logits = at::mm(h, w.t()).to(at::kFloat);
  return at::cross_entropy_loss(logits, target, {}, at::Reduction::Mean, -100, 0.0);
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol, const char* what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double err = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  const double ref = b.to(at::kDouble).abs().max().item<double>();
  EXPECT_LE(err, atol + rtol * ref) << what << ": max |difference| " << err << " (max |reference| " << ref << ")";
}

at::Tensor targets(std::int64_t rows, std::int64_t vocab, std::int64_t ignored_every, std::uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  at::Tensor t = at::randint(vocab, {rows}, g, at::kLong);
  if (ignored_every > 0) t.index_put_({at::arange(0, rows, ignored_every)}, -100);
  return t;
}

at::Tensor randn(at::IntArrayRef sizes, std::uint64_t seed, double std = 1.0) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, g, at::TensorOptions().dtype(at::kFloat)).mul_(std);
}

// fp32: the same sums in another order (chunks): 1e-5 relative.
TEST(LinearCrossEntropy, EqualsTheUnfusedLossAndGradientsInFp32) {
  struct Case {
    std::int64_t rows, hidden, vocab, chunk, ignored_every;
  };
  for (const Case c : {Case{37, 19, 101, 5, 3}, Case{64, 32, 1000, 0, 0}, Case{7, 8, 13, 100, 2}, Case{33, 16, 257, 1, 4}}) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden << " vocab " << c.vocab
                                      << " chunk " << c.chunk);
    at::Tensor h = randn({c.rows, c.hidden}, 1), w = randn({c.vocab, c.hidden}, 2, 0.3);
    at::Tensor t = targets(c.rows, c.vocab, c.ignored_every, 3);
    LossAndGrads ref = run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return unfused(x, y, t); }, 0.7);
    LossAndGrads got = run(
        h, w, [&](const at::Tensor& x, const at::Tensor& y) { return linear_cross_entropy(x, y, t, {-100, c.chunk}); },
        0.7);
    EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
    expect_close(got.loss, ref.loss, 1e-5, 0, "loss");
    expect_close(got.grad_hidden, ref.grad_hidden, 1e-5, 1e-7, "d hidden");
    expect_close(got.grad_weight, ref.grad_weight, 1e-5, 1e-7, "d weight");
  }
}

TEST(LinearCrossEntropy, NonContiguousHiddenAndTargets) {
  at::Tensor h = randn({24, 40}, 4).t();  // [40, 24], transposed storage
  at::Tensor w = randn({77, 24}, 5, 0.3);
  at::Tensor t = targets(80, 77, 5, 6).slice(0, 0, 80, 2);  // a strided view of 40
  ASSERT_FALSE(h.is_contiguous());
  ASSERT_FALSE(t.is_contiguous());
  LossAndGrads ref = run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return unfused(x, y, t); });
  LossAndGrads got =
      run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return linear_cross_entropy(x, y, t, {-100, 6}); });
  expect_close(got.loss, ref.loss, 1e-5, 0, "loss");
  expect_close(got.grad_hidden, ref.grad_hidden, 1e-5, 1e-7, "d hidden");
  expect_close(got.grad_weight, ref.grad_weight, 1e-5, 1e-7, "d weight");
}

// bf16 weights and hidden states (bf16-true, or FSDP's param_dtype): the products in bf16 as
// the unfused path's, the softmax in fp32 for both; the fused weight gradient sums the chunks
// in fp32 where the unfused one is one bf16 product: 1e-2 relative (bf16's 8 bits).
TEST(LinearCrossEntropy, Bf16InputsMatchTheUnfusedPathWithinBf16Rounding) {
  at::Tensor h = randn({50, 24}, 7).to(at::kBFloat16), w = randn({300, 24}, 8, 0.3).to(at::kBFloat16);
  at::Tensor t = targets(50, 300, 7, 9);
  LossAndGrads ref = run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return unfused(x, y, t); });
  LossAndGrads got =
      run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return linear_cross_entropy(x, y, t, {-100, 8}); });
  EXPECT_EQ(got.grad_hidden.scalar_type(), at::kBFloat16);
  EXPECT_EQ(got.grad_weight.scalar_type(), at::kBFloat16);
  expect_close(got.loss, ref.loss, 1e-3, 0, "loss");
  expect_close(got.grad_hidden, ref.grad_hidden, 1e-2, 1e-4, "d hidden");
  expect_close(got.grad_weight, ref.grad_weight, 1e-2, 1e-4, "d weight");
}

// fp32 parameters under CPU autocast (bf16-mixed): the fused products take autocast's dtype as
// lm_head's would; gradients come back in fp32.
TEST(LinearCrossEntropy, UnderAutocastTheProductsRunInAutocastsDtype) {
  at::Tensor h = randn({45, 16}, 10), w = randn({129, 16}, 11, 0.3);
  at::Tensor t = targets(45, 129, 0, 12);
  auto under_autocast = [&](auto loss_of) {
    return run(h, w, [&](const at::Tensor& x, const at::Tensor& y) {
      tessera::sdk::set_autocast(false, true, at::kBFloat16);
      at::Tensor loss = loss_of(x, y);
      tessera::sdk::set_autocast(false, false, at::kBFloat16);
      at::autocast::clear_cache();
      return loss;
    });
  };
  LossAndGrads ref = under_autocast([&](const at::Tensor& x, const at::Tensor& y) { return unfused(x, y, t); });
  LossAndGrads got =
      under_autocast([&](const at::Tensor& x, const at::Tensor& y) { return linear_cross_entropy(x, y, t, {-100, 4}); });
  LossAndGrads fp32 = run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return unfused(x, y, t); });
  EXPECT_EQ(got.grad_weight.scalar_type(), at::kFloat);
  expect_close(got.loss, ref.loss, 1e-3, 0, "loss");
  expect_close(got.grad_hidden, ref.grad_hidden, 1e-2, 1e-4, "d hidden");
  expect_close(got.grad_weight, ref.grad_weight, 1e-2, 1e-4, "d weight");
  // ... and not the fp32 products (the check above would pass for either otherwise).
  EXPECT_GT((got.loss - fp32.loss).abs().item<double>(), 1e-6);
}

TEST(LinearCrossEntropy, IgnoredTargetsAndNoGradients) {
  at::Tensor h = randn({12, 8}, 13), w = randn({20, 8}, 14);
  // All ignored: NaN as cross_entropy's mean over no targets, and zero gradients.
  at::Tensor none = at::full({12}, -100, at::kLong);
  LossAndGrads all_ignored =
      run(h, w, [&](const at::Tensor& x, const at::Tensor& y) { return linear_cross_entropy(x, y, none, {-100, 5}); });
  EXPECT_TRUE(std::isnan(all_ignored.loss.item<double>()));
  EXPECT_TRUE(std::isnan(unfused(h, w, none).item<double>()));
  EXPECT_EQ(all_ignored.grad_hidden.abs().max().item<double>(), 0.0);
  EXPECT_EQ(all_ignored.grad_weight.abs().max().item<double>(), 0.0);
  // Without grad mode, or inputs without requires_grad: the loss alone, no graph.
  at::Tensor t = targets(12, 20, 3, 15);
  at::Tensor plain = linear_cross_entropy(h, w, t, {-100, 5});
  EXPECT_FALSE(plain.requires_grad());
  expect_close(plain, unfused(h, w, t), 1e-5, 0, "loss without gradients");
  // A frozen weight (LoRA's base lm_head): only the hidden states' gradient.
  at::Tensor hg = h.clone().requires_grad_(true);
  at::Tensor loss = linear_cross_entropy(hg, w, t, {-100, 5});
  loss.backward();
  at::Tensor hr = h.clone().requires_grad_(true);
  unfused(hr, w, t).backward();
  expect_close(hg.grad(), hr.grad(), 1e-5, 1e-7, "d hidden, frozen weight");
}

TEST(LinearCrossEntropy, BadInputsAndASecondBackwardAreRefused) {
  at::Tensor h = randn({6, 4}, 16), w = randn({10, 4}, 17).requires_grad_(true);
  EXPECT_THROW(linear_cross_entropy(h, w, at::full({6}, 10, at::kLong)), tessera::sdk::Error);  // out of the vocab
  EXPECT_THROW(linear_cross_entropy(h, w, at::full({6}, -3, at::kLong)), tessera::sdk::Error);
  EXPECT_THROW(linear_cross_entropy(h, w, at::zeros({5}, at::kLong)), tessera::sdk::Error);     // rows
  EXPECT_THROW(linear_cross_entropy(h, randn({10, 5}, 18), at::zeros({6}, at::kLong)), tessera::sdk::Error);
  at::Tensor loss = linear_cross_entropy(h, w, at::zeros({6}, at::kLong));
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_ANY_THROW(loss.backward());  // the kept gradients were scaled in place
}

/// Counts the live CPU bytes allocated through it and their peak.
class PeakAllocator final : public c10::Allocator {
 public:
  PeakAllocator() : previous_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, /*priority=*/255); }
  ~PeakAllocator() override { c10::SetCPUAllocator(previous_, /*priority=*/255); }
  c10::DataPtr allocate(std::size_t n) const override {
    c10::DataPtr inner = previous_->allocate(n);
    void* data = inner.get();
    std::lock_guard<std::mutex> lock(mutex_);
    live_ += static_cast<std::int64_t>(n);
    peak_ = std::max(peak_, live_);
    blocks_.emplace(data, std::make_pair(static_cast<std::int64_t>(n), std::move(inner)));
    current() = this;
    return {data, data, &release, inner.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  std::int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_; }

 private:
  static const PeakAllocator*& current() {
    static const PeakAllocator* instance = nullptr;
    return instance;
  }
  static void release(void* data) {
    const PeakAllocator* self = current();
    c10::DataPtr inner;
    std::lock_guard<std::mutex> lock(self->mutex_);
    auto it = self->blocks_.find(data);
    if (it == self->blocks_.end()) return;
    self->live_ -= it->second.first;
    inner = std::move(it->second.second);
    self->blocks_.erase(it);
  }
  c10::Allocator* previous_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, std::pair<std::int64_t, c10::DataPtr>> blocks_;
  mutable std::int64_t live_ = 0, peak_ = 0;
};

// The goal in small: the unfused loss holds [rows, vocab] fp32 logits several times
// over (forward and backward); the chunked one a chunk's, so its peak is a fraction of it and
// within what loss_path_memory reports (the plan's figure).
TEST(LinearCrossEntropy, PeakMemoryIsAChunkNotTheLogits) {
  const std::int64_t rows = 512, hidden = 16, vocab = 8192, chunk = 32;
  at::Tensor h = randn({rows, hidden}, 19), w = randn({vocab, hidden}, 20, 0.3);
  at::Tensor t = targets(rows, vocab, 9, 21);
  const double logits_bytes = 4.0 * rows * vocab;  // 16 MiB
  auto peak_of = [&](auto loss_of, tessera::toolkit::LossPathMemory* memory) {
    at::Tensor hh = h.clone().requires_grad_(true), ww = w.clone().requires_grad_(true);
    std::int64_t peak = 0;
    {
      // The leaves and their gradients are allocated before: the peak is the loss path's own.
      hh.mutable_grad() = at::zeros_like(hh);
      ww.mutable_grad() = at::zeros_like(ww);
      PeakAllocator counter;
      at::Tensor loss = loss_of(hh, ww);
      if (memory != nullptr) *memory = tessera::toolkit::loss_path_memory(loss);
      loss.backward();
      peak = counter.peak();
    }
    return static_cast<double>(peak);
  };
  tessera::toolkit::LossPathMemory fused_memory, unfused_memory;
  const double unfused_peak = peak_of([&](const at::Tensor& x, const at::Tensor& y) { return unfused(x, y, t); },
                                      &unfused_memory);
  const double fused_peak = peak_of(
      [&](const at::Tensor& x, const at::Tensor& y) { return linear_cross_entropy(x, y, t, {-100, chunk}); },
      &fused_memory);
  EXPECT_GE(unfused_peak, 2.0 * logits_bytes);
  EXPECT_LT(fused_peak, 0.25 * logits_bytes) << "fused " << fused_peak << " B, unfused " << unfused_peak << " B";
  // The plan's figures: the chunk's workspace (8 bytes a logit of 32 rows) plus the kept gradients.
  EXPECT_EQ(fused_memory.fused, 1);
  EXPECT_EQ(unfused_memory.unfused, 1);
  EXPECT_EQ(unfused_memory.logits, rows * vocab);
  EXPECT_DOUBLE_EQ(fused_memory.workspace_bytes, 8.0 * chunk * vocab);
  const double kept = 4.0 * (rows * hidden + vocab * hidden);
  EXPECT_NEAR(fused_peak, fused_memory.workspace_bytes + kept, 0.25 * (fused_memory.workspace_bytes + kept));
  // Unfused: live tensors peak at the start of backward (the kept log-probabilities and two
  // gradients); the plan's workspace counts half of the freed forward logits too, what stays
  // resident in a rank as measured (3.5 arrays with the kept one).
  EXPECT_NEAR(unfused_peak, 3.0 * logits_bytes, 0.15 * unfused_peak);
  EXPECT_DOUBLE_EQ(unfused_memory.workspace_bytes, 2.5 * logits_bytes);
}

TEST(LinearCrossEntropy, ChunkRows) {
  using tessera::toolkit::linear_cross_entropy_chunk_rows;
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 128256), (1 << 23) / 128256);  // 65
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 256), 2048);                   // all rows
  EXPECT_EQ(linear_cross_entropy_chunk_rows(10, 1 << 30), 1);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(10, 100, 3), 3);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(10, 100, 30), 10);
}

}  // namespace
