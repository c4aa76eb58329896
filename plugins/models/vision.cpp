// `mlp` and `cnn`: image classifiers for Fashion-MNIST-shaped data ([N,1,28,28], 10 classes).
// Their hidden layers are FSDP units ("Layer", "ConvBlock") run through sdk::invoke().
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include "models.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/sync_batch_norm.hpp"
#include "tessera/sdk/unit.hpp"

namespace tessera::models {

namespace {

using sdk::Batch;
using sdk::StepOutput;

/// Linear + ReLU: one FSDP unit of the MLP.
class LayerImpl : public torch::nn::Module {
 public:
  LayerImpl(std::int64_t in, std::int64_t out)
      : torch::nn::Module("Layer"), linear(register_module("linear", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::relu(linear(x)); }
  torch::nn::Linear linear;
};
TORCH_MODULE(Layer);

/// Conv 3x3 (+ optional BatchNorm, synchronised over the ranks under [trainer] sync_batchnorm)
/// + ReLU + 2x2 max-pool: one FSDP unit of the CNN.
class ConvBlockImpl : public torch::nn::Module {
 public:
  ConvBlockImpl(std::int64_t in, std::int64_t out, bool batch_norm)
      : torch::nn::Module("ConvBlock"),
        conv(register_module(
            "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(!batch_norm)))) {
    if (batch_norm) bn = register_module("bn", toolkit::SyncBatchNorm2d(out));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = conv(x);
    if (bn) y = bn(y);
    return at::max_pool2d(at::relu(y), {2, 2});
  }
  torch::nn::Conv2d conv;
  toolkit::SyncBatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvBlock);

/// Shared by both classifiers: steps, metrics, hyper-parameters.
class Classifier : public sdk::Module {
 public:
  std::shared_ptr<torch::nn::Module> network() override { return root_; }
  StepOutput training_step(const Batch& batch, std::int64_t) override { return evaluate(batch); }
  StepOutput validation_step(const Batch& batch, std::int64_t) override { return evaluate(batch); }
  StepOutput test_step(const Batch& batch, std::int64_t) override { return evaluate(batch); }
  at::Tensor predict_step(const Batch& batch, std::int64_t) override { return forward(batch.input).argmax(1); }

 protected:
  virtual at::Tensor forward(const at::Tensor& images) = 0;
  std::shared_ptr<torch::nn::Module> root_;

 private:
  StepOutput evaluate(const Batch& batch) {
    at::Tensor logits = forward(batch.input).to(at::kFloat);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits, batch.target);
    at::Tensor accuracy = logits.argmax(1).eq(batch.target).to(at::kFloat).mean();
    return StepOutput{loss, {{"loss", loss.detach()}, {"acc", accuracy}}, batch.size()};
  }
};

class MLP final : public Classifier {
 public:
  explicit MLP(const sdk::Options& o) {
    // The defaults give 228,823 parameters and a first unit of 201,745, neither divisible by
    // 2, 3 or 4, so FSDP pads its shards on every small world size. (No sizes make every
    // unit odd: consecutive biased Linears have counts out*(in+1), and in = previous out.)
    for (double h : o.get_double_list({"hidden_sizes", "the MLP's hidden layer widths"}, {257, 101})) {
      TESSERA_CHECK(h >= 1 && h == static_cast<double>(static_cast<std::int64_t>(h)), o.locate("hidden_sizes"),
                    " must list positive integers, found ", h);
      hidden_.push_back(static_cast<std::int64_t>(h));
    }
  }
  void configure_model() override {
    root_ = std::make_shared<torch::nn::Module>("MLP");
    auto list = root_->register_module("layers", torch::nn::ModuleList());
    std::int64_t in = 28 * 28;
    layers_.clear();
    for (std::int64_t h : hidden_) {
      layers_.emplace_back(in, h);
      list->push_back(layers_.back());
      in = h;
    }
    head_ = root_->register_module("head", torch::nn::Linear(in, 10));
  }
  std::vector<std::string> fsdp_unit_classes() const override { return {"Layer"}; }
  sdk::Checkpoint hyper_parameters() const override {
    sdk::Checkpoint h = sdk::make_checkpoint();
    h.insert("hidden_sizes", c10::List<std::int64_t>(hidden_));
    return h;
  }

 private:
  at::Tensor forward(const at::Tensor& images) override {
    at::Tensor x = images.flatten(1);
    for (auto& layer : layers_) x = sdk::invoke(layer, x);
    return head_(x);
  }
  std::vector<std::int64_t> hidden_;
  std::vector<Layer> layers_;
  torch::nn::Linear head_{nullptr};
};

class CNN final : public Classifier {
 public:
  explicit CNN(const sdk::Options& o)
      : channels1_(o.get_int({"channels1", "the first convolution's output channels"}, 32, 1)),
        channels2_(o.get_int({"channels2", "the second convolution's output channels"}, 64, 1)),
        hidden_(o.get_int({"hidden", "the fully connected layer's width"}, 128, 1)),
        batch_norm_(o.get_bool(
            {"batch_norm", "BatchNorm after each convolution (toolkit::SyncBatchNorm2d, so sync_batchnorm can apply)"},
            false)) {}
  void configure_model() override {
    root_ = std::make_shared<torch::nn::Module>("CNN");
    conv1_ = root_->register_module("conv1", ConvBlock(1, channels1_, batch_norm_));
    conv2_ = root_->register_module("conv2", ConvBlock(channels1_, channels2_, batch_norm_));
    fc_ = root_->register_module("fc", torch::nn::Linear(channels2_ * 7 * 7, hidden_));
    head_ = root_->register_module("head", torch::nn::Linear(hidden_, 10));
  }
  std::vector<std::string> fsdp_unit_classes() const override { return {"ConvBlock"}; }
  sdk::Checkpoint hyper_parameters() const override {
    sdk::Checkpoint h = sdk::make_checkpoint();
    h.insert("channels1", channels1_);
    h.insert("channels2", channels2_);
    h.insert("hidden", hidden_);
    h.insert("batch_norm", batch_norm_);
    return h;
  }

 private:
  at::Tensor forward(const at::Tensor& images) override {
    at::Tensor x = sdk::invoke(conv2_, sdk::invoke(conv1_, images));
    return head_(at::relu(fc_(x.flatten(1))));
  }
  std::int64_t channels1_, channels2_, hidden_;
  bool batch_norm_;
  ConvBlock conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear fc_{nullptr}, head_{nullptr};
};

}  // namespace

sdk::PluginEntry mlp_entry() {
  return sdk::plugin_entry<MLP>("mlp", "multi-layer perceptron for 28x28 images; hidden layers are FSDP units");
}
sdk::PluginEntry cnn_entry() {
  return sdk::plugin_entry<CNN>("cnn", "small convolutional net for 28x28 images; conv blocks are FSDP units");
}

}  // namespace tessera::models
