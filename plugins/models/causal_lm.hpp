#pragma once
// What the decoder-only language models (gpt, llama) share: the network is built at
// configure_model() from the host's seed, every step is the next-token loss, predict takes token
// prompts, and parallelize() splits the network once over a tensor-parallel group.
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/tensor_parallel.hpp"

namespace tessera::models {

/// `Net` is a LibTorch module holder whose forward(ids [B, T]) gives logits [B, T, vocab] and
/// whose parallelize(tp) splits it over a tensor-parallel group.
template <typename Net>
class CausalLM : public sdk::Module {
 public:
  void configure_model() final {
    // The seed the host set (trainer.seed), not a draw: a deferred build initialises later.
    init_seed_ = at::detail::getDefaultCPUGenerator().current_seed();
    net_ = make_network(init_seed_);
    tp_ = nullptr;
  }
  std::shared_ptr<torch::nn::Module> network() final { return net_.ptr(); }

  sdk::StepOutput training_step(const sdk::Batch& batch, std::int64_t) final { return lm_loss(batch); }
  sdk::StepOutput validation_step(const sdk::Batch& batch, std::int64_t) final { return lm_loss(batch); }
  sdk::StepOutput test_step(const sdk::Batch& batch, std::int64_t) final { return lm_loss(batch); }

  void parallelize(const sdk::ParallelContext& context) final {
    TESSERA_CHECK(context.tp != nullptr, name_, ": parallelize needs a tensor-parallel group (null)");
    const std::int64_t tp = context.tp->size();
    if (tp == 1 || context.tp == tp_) return;  // applied once
    TESSERA_CHECK(net_, name_, ": parallelize before configure_model()");
    TESSERA_CHECK(!tp_, name_, ": the network is already split over a tensor-parallel group of ", tp_ ? tp_->size() : 0,
                  "; configure_model() again before parallelizing over another group");
    check_splits(tp);
    net_->parallelize(context.tp);
    tp_ = context.tp;
  }

  /// Deferred init: the eager build's values (each parameter's draws depend on its name only).
  bool init_parameters(const std::string& path, torch::nn::Module& module) final {
    bool handled = true;
    for (auto& item : module.named_parameters(/*recurse=*/false))
      handled = init_parameter(path + "." + item.key(), item.value()) && handled;
    return handled;
  }

 protected:
  explicit CausalLM(std::string name) : name_(std::move(name)) {}

  /// The network, its parameters drawn from `seed`.
  virtual Net make_network(std::uint64_t seed) const = 0;
  /// Throws, naming the keys and the sizes that would do, when the network cannot split over tp ranks.
  virtual void check_splits(std::int64_t tp) const = 0;
  /// One parameter of a deferred build, drawn as the eager build draws it; false if unknown.
  virtual bool init_parameter(const std::string& name, at::Tensor& parameter) const = 0;

  /// predict's batch as token prompts [B, T], T >= 1.
  at::Tensor prompts(const sdk::Batch& batch) const {
    TESSERA_CHECK(batch.input.defined() && batch.input.dim() == 2 && batch.input.size(1) > 0, name_,
                  ": predict needs a batch of token prompts [B, T] with T >= 1, found ",
                  batch.input.defined() ? batch.input.sizes() : at::IntArrayRef{});
    return batch.input.to(at::kLong);
  }

  Net net_{nullptr};
  std::uint64_t init_seed_ = 0;                   // trainer.seed at configure_model(), for init_parameters()
  std::shared_ptr<sdk::TensorParallelGroup> tp_;  // set once the network is split

 private:
  /// fp32 logits for the loss (Hugging Face's ForCausalLMLoss); -100 targets are ignored.
  sdk::StepOutput lm_loss(const sdk::Batch& batch) {
    at::Tensor logits = net_->forward(batch.input);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                                           batch.target.reshape({-1}));
    return sdk::StepOutput{loss, {{"loss", loss.detach()}}, batch.input.numel()};
  }

  std::string name_;  // the plugin's name, for messages
};

}  // namespace tessera::models
