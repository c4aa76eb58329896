// Multinomial logistic regression for 28x28 images: the smallest useful Tessera model
// plugin, written only against the public SDK.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include <tessera/sdk/module.hpp>
#include <tessera/sdk/plugin.hpp>

namespace {

using tessera::sdk::Batch;
using tessera::sdk::StepOutput;

class SoftmaxRegression final : public tessera::sdk::Module {
 public:
  explicit SoftmaxRegression(const tessera::sdk::Options& options)
      : num_classes_(options.get_int({"num_classes", "output classes"}, 10, 2)),
        in_features_(options.get_int({"in_features", "input features per sample (784: a 28x28 image)"}, 784, 1)) {}

  void configure_model() override {
    network_ = std::make_shared<torch::nn::Module>("SoftmaxRegression");
    linear_ = network_->register_module("linear", torch::nn::Linear(in_features_, num_classes_));
  }
  std::shared_ptr<torch::nn::Module> network() override { return network_; }

  StepOutput training_step(const Batch& batch, std::int64_t) override { return evaluate(batch); }
  StepOutput validation_step(const Batch& batch, std::int64_t) override { return evaluate(batch); }
  StepOutput test_step(const Batch& batch, std::int64_t) override { return evaluate(batch); }
  at::Tensor predict_step(const Batch& batch, std::int64_t) override { return logits(batch).argmax(1); }

  tessera::sdk::Checkpoint hyper_parameters() const override {
    tessera::sdk::Checkpoint h = tessera::sdk::make_checkpoint();
    h.insert("num_classes", num_classes_);
    h.insert("in_features", in_features_);
    return h;
  }

 private:
  at::Tensor logits(const Batch& batch) { return linear_->forward(batch.input.flatten(1)); }

  StepOutput evaluate(const Batch& batch) {
    at::Tensor out = logits(batch);
    at::Tensor loss = torch::nn::functional::cross_entropy(out, batch.target);
    at::Tensor accuracy = out.argmax(1).eq(batch.target).to(at::kFloat).mean();
    return StepOutput{loss, {{"loss", loss.detach()}, {"acc", accuracy}}, batch.size()};
  }

  std::int64_t num_classes_;
  std::int64_t in_features_;
  std::shared_ptr<torch::nn::Module> network_;
  torch::nn::Linear linear_{nullptr};
};

}  // namespace

TESSERA_PLUGIN(model, "1.0.0",
               tessera::sdk::plugin_entry<SoftmaxRegression>("softmax_regression",
                                                             "an out-of-tree example: logistic regression on images"));
