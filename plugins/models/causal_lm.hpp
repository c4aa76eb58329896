#pragma once
// What the decoder-only language models (gpt, llama) share: the network is built at
// configure_model() from the host's seed, every step is the next-token loss, predict takes token
// prompts, and parallelize() splits the network once over a tensor-parallel group.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/toolkit/fused.hpp"
#include "tessera/toolkit/lora.hpp"

namespace tessera::models {

/// `Net` is a LibTorch module holder whose forward(ids [B, T], position_ids) gives logits
/// [B, T, vocab], hidden_states(ids, position_ids) the final hidden states [B, T, H] those are
/// computed from (position_ids: sdk::Batch's, undefined unless the rows are packed),
/// output_weight() lm_head's weight [vocab, H] (the token embedding's, tied), and
/// parallelize(tp) splits it over a tensor-parallel group (lm_head stays whole on every rank).
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
    TESSERA_CHECK(!lora_, "[model.lora] with tensor_parallel_size = ", tp,
                  ": LoRA adapters are not split over a tensor-parallel group yet; train them with "
                  "tensor_parallel_size = 1 (fsdp2 shards the frozen base over the data-parallel ranks)");
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

  /// The loss's [model] keys, read by each plugin's constructor.
  void read_loss_options(const sdk::Options& o) {
    fused_loss_ = o.get_bool({"fused_loss",
                              "the loss as toolkit::linear_cross_entropy: lm_head and the cross-entropy chunk by chunk "
                              "of tokens, never the whole [tokens, vocab] logits; false: the fp32 logits, then "
                              "cross_entropy"},
                             true);
    loss_chunk_tokens_ = o.get_int(
        {"loss_chunk_tokens", "tokens per chunk of the fused loss; 0: automatic (2^23 logits, 32 MiB in fp32, a chunk)"},
        0, 0);
    TESSERA_CHECK(fused_loss_ || loss_chunk_tokens_ == 0, o.locate("loss_chunk_tokens"), " = ", loss_chunk_tokens_,
                  " sizes the fused loss's chunks, but ", o.locate("fused_loss"),
                  " = false computes the whole logits: set fused_loss = true or leave loss_chunk_tokens out");
  }

  /// The [model.lora] table (LoRA on when present), read by each plugin's constructor:
  /// `valid` are the Linear names it may adapt, `defaults` PEFT's target_modules for the model.
  void read_lora(const sdk::Options& o, const std::vector<std::string>& valid, const std::vector<std::string>& defaults) {
    lora_ = toolkit::read_lora_options(o, valid, defaults);
  }
  /// The LoRA configuration in hyper_parameters (PEFT's adapter_config.json keys, for export and
  /// the checks of a resumed run); nothing without LoRA.
  void insert_lora_hyper_parameters(sdk::Checkpoint& h) const {
    if (!lora_) return;
    h.insert("lora_r", lora_->r);
    h.insert("lora_alpha", lora_->alpha);
    h.insert("lora_dropout", lora_->dropout);
    h.insert("lora_target_modules", sdk::join(lora_->target_modules, ","));
  }

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
  std::optional<toolkit::LoraOptions> lora_;  // [model.lora]; none: full fine-tuning
  std::uint64_t init_seed_ = 0;                   // trainer.seed at configure_model(), for init_parameters()
  std::shared_ptr<sdk::TensorParallelGroup> tp_;  // set once the network is split

 private:
  /// Hugging Face's ForCausalLMLoss (the fp32 logits' cross-entropy, -100 targets ignored):
  /// chunked through toolkit::linear_cross_entropy, or (fused_loss = false) from the whole logits.
  /// Both run in the root FSDP unit, gathered from the start of the step's forward to its
  /// backward, so lm_head's (or the tied embedding's) weight is whole here and its gradient
  /// reaches the root's reduce-scatter through autograd.
  sdk::StepOutput lm_loss(const sdk::Batch& batch) {
    at::Tensor loss;
    if (fused_loss_) {
      at::Tensor hidden = net_->hidden_states(batch.input, batch.position_ids);
      loss = toolkit::linear_cross_entropy(hidden.reshape({-1, hidden.size(-1)}), net_->output_weight(),
                                           batch.target.reshape({-1}), {-100, loss_chunk_tokens_});
    } else {
      at::Tensor logits = net_->forward(batch.input, batch.position_ids);
      loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                                  batch.target.reshape({-1}));
    }
    return sdk::StepOutput{loss, {{"loss", loss.detach()}}, batch.input.numel()};
  }

  bool fused_loss_ = true;
  std::int64_t loss_chunk_tokens_ = 0;  // 0: automatic
  std::string name_;  // the plugin's name, for messages
};

}  // namespace tessera::models
