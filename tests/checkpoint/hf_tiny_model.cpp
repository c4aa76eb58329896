// `hf_tiny`: a test model whose tensor names and config.json follow Hugging Face's conventions
// (model.embed_tokens, model.layers.N.*, model.norm, lm_head), so the Hugging Face import and
// export are tested without depending on a real architecture: an embedding, layers of
// RMSNorm + a GELU MLP with a residual (each layer an FSDP unit), a final norm and an untied head.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/unit.hpp"

namespace {

using tessera::sdk::Batch;
using tessera::sdk::StepOutput;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) {
  return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * weight;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t hidden, std::int64_t intermediate)
      : up_proj(register_module("up_proj", torch::nn::Linear(torch::nn::LinearOptions(hidden, intermediate).bias(false)))),
        down_proj(register_module("down_proj", torch::nn::Linear(torch::nn::LinearOptions(intermediate, hidden).bias(false)))) {}
  torch::nn::Linear up_proj, down_proj;
};
TORCH_MODULE(Mlp);

struct LayerImpl : torch::nn::Module {
  LayerImpl(std::int64_t hidden, std::int64_t intermediate)
      : torch::nn::Module("HfTinyLayer"),
        input_layernorm(register_module("input_layernorm", std::make_shared<torch::nn::Module>())),
        mlp(register_module("mlp", Mlp(hidden, intermediate))) {
    norm_weight = input_layernorm->register_parameter("weight", at::ones({hidden}));
  }
  at::Tensor forward(const at::Tensor& x) {
    return x + mlp->down_proj(at::gelu(mlp->up_proj(rms_norm(x, norm_weight))));
  }
  std::shared_ptr<torch::nn::Module> input_layernorm;
  Mlp mlp;
  at::Tensor norm_weight;
};
TORCH_MODULE(Layer);

class HfTiny final : public tessera::sdk::Module, public tessera::sdk::HuggingFaceModel {
 public:
  explicit HfTiny(const tessera::sdk::Options& options)
      : hidden_(options.get_int("hidden_size", 32, 1)),
        intermediate_(options.get_int("intermediate_size", 64, 1)),
        layers_(options.get_int("num_hidden_layers", 2, 1)),
        vocab_(options.get_int("vocab_size", 256, 1)) {}

  void configure_model() override {
    layer_list_.clear();
    network_ = std::make_shared<torch::nn::Module>("HfTinyForCausalLM");
    auto model = network_->register_module("model", std::make_shared<torch::nn::Module>("HfTinyModel"));
    embed_ = model->register_module("embed_tokens", torch::nn::Embedding(vocab_, hidden_));
    list_ = model->register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < layers_; ++i) {
      layer_list_.push_back(Layer(hidden_, intermediate_));
      list_->push_back(layer_list_.back());
    }
    auto norm = model->register_module("norm", std::make_shared<torch::nn::Module>());
    norm_ = norm->register_parameter("weight", at::ones({hidden_}));
    head_ = network_->register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(hidden_, vocab_).bias(false)));
  }
  std::shared_ptr<torch::nn::Module> network() override { return network_; }
  std::vector<std::string> fsdp_unit_classes() const override { return {"HfTinyLayer"}; }

  StepOutput training_step(const Batch& batch, std::int64_t) override { return loss(batch); }
  StepOutput validation_step(const Batch& batch, std::int64_t) override { return loss(batch); }
  StepOutput test_step(const Batch& batch, std::int64_t) override { return loss(batch); }
  at::Tensor predict_step(const Batch& batch, std::int64_t) override { return logits(batch.input).argmax(-1); }

  tessera::sdk::Checkpoint hyper_parameters() const override {
    tessera::sdk::Checkpoint h = tessera::sdk::make_checkpoint();
    h.insert("hidden_size", hidden_);
    h.insert("intermediate_size", intermediate_);
    h.insert("num_hidden_layers", layers_);
    h.insert("vocab_size", vocab_);
    return h;
  }

  std::string hf_config_json() const override {
    return nlohmann::ordered_json{{"architectures", nlohmann::ordered_json::array({"HfTinyForCausalLM"})},
                                  {"model_type", "tessera_hf_tiny"},
                                  {"hidden_size", hidden_},
                                  {"intermediate_size", intermediate_},
                                  {"num_hidden_layers", layers_},
                                  {"vocab_size", vocab_},
                                  {"rms_norm_eps", 1e-6},
                                  {"tie_word_embeddings", false},
                                  {"bos_token_id", 1},
                                  {"eos_token_id", 2}}
        .dump();
  }

 private:
  at::Tensor logits(const at::Tensor& input) {
    at::Tensor x = embed_(input.to(at::kLong));
    for (auto& layer : layer_list_) x = tessera::sdk::invoke(layer, x);
    return head_(rms_norm(x, norm_));
  }
  StepOutput loss(const Batch& batch) {
    at::Tensor l = torch::nn::functional::cross_entropy(logits(batch.input).reshape({-1, vocab_}).to(at::kFloat),
                                                        batch.target.reshape({-1}));
    return StepOutput{l, {{"loss", l.detach()}}, batch.input.numel()};
  }

  std::int64_t hidden_, intermediate_, layers_, vocab_;
  std::shared_ptr<torch::nn::Module> network_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList list_{nullptr};
  std::vector<Layer> layer_list_;
  at::Tensor norm_;
  torch::nn::Linear head_{nullptr};
};

}  // namespace

TESSERA_PLUGIN(model, "1.0.0",
               tessera::sdk::plugin_entry<HfTiny>("hf_tiny", "test model with Hugging Face's names and config.json"));
