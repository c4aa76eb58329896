// A model the way a newcomer writes one: Linear -> LayerNorm -> Linear on 28x28 images. Under
// bf16-mixed on CPU, LibTorch 1.13's autocast hands the LayerNorm the Linear's bf16 output
// while its weight stays fp32: the host must explain that, not print a C++ stack trace.
// With batch_norm = true a plain torch::nn::BatchNorm1d follows fc1, which [trainer]
// sync_batchnorm must refuse (it cannot synchronise LibTorch's own layer). freeze_fc1 builds
// fc1 frozen; unfreeze_fc1_at_batch = N sets it trainable in training_step N (as a fine-tuning
// callback would), which the trainer must refuse.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "tessera/sdk/module.hpp"
#include "tessera/sdk/plugin.hpp"

namespace {

using tessera::sdk::Batch;
using tessera::sdk::StepOutput;

class LayerNormModel final : public tessera::sdk::Module {
 public:
  explicit LayerNormModel(const tessera::sdk::Options& o)
      : batch_norm_(o.get_bool("batch_norm", false)),
        freeze_fc1_(o.get_bool("freeze_fc1", false)),
        unfreeze_fc1_at_batch_(o.get_int("unfreeze_fc1_at_batch", -1, -1)) {}
  void configure_model() override {
    network_ = std::make_shared<torch::nn::Module>("LayerNormModel");
    fc1_ = network_->register_module("fc1", torch::nn::Linear(784, 32));
    if (batch_norm_) bn_ = network_->register_module("bn", torch::nn::BatchNorm1d(32));
    norm_ = network_->register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    fc2_ = network_->register_module("fc2", torch::nn::Linear(32, 10));
    if (freeze_fc1_)
      for (auto& p : fc1_->parameters()) p.requires_grad_(false);
  }
  std::shared_ptr<torch::nn::Module> network() override { return network_; }
  StepOutput training_step(const Batch& b, std::int64_t batch_idx) override {
    if (batch_idx == unfreeze_fc1_at_batch_)
      for (auto& p : fc1_->parameters()) p.requires_grad_(true);
    return step(b);
  }
  StepOutput validation_step(const Batch& b, std::int64_t) override { return step(b); }
  StepOutput test_step(const Batch& b, std::int64_t) override { return step(b); }
  at::Tensor predict_step(const Batch& b, std::int64_t) override { return logits(b).argmax(1); }
  tessera::sdk::Checkpoint hyper_parameters() const override { return tessera::sdk::make_checkpoint(); }

 private:
  at::Tensor logits(const Batch& b) {
    at::Tensor h = fc1_(b.input.flatten(1));
    return fc2_(norm_(bn_ ? bn_(h) : h));
  }
  StepOutput step(const Batch& b) {
    at::Tensor loss = torch::nn::functional::cross_entropy(logits(b).to(at::kFloat), b.target);
    return StepOutput{loss, {{"loss", loss.detach()}}, b.size()};
  }
  std::shared_ptr<torch::nn::Module> network_;
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::BatchNorm1d bn_{nullptr};
  bool batch_norm_, freeze_fc1_;
  std::int64_t unfreeze_fc1_at_batch_;
};

}  // namespace

TESSERA_PLUGIN(model, "1.0.0", tessera::sdk::plugin_entry<LayerNormModel>("layernorm_model", "test: bf16 LayerNorm"));
