// The shipped model plugins (gpt, mlp, cnn; llama in llama_test.cpp), created through the real plugin loader: one
// step's loss and gradients against hand-written LibTorch references with the same weights,
// tied embeddings, FSDP units run through sdk::invoke, sampling and bf16 autocast.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/nn/module.h>

#include "tessera/sdk/autocast.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/unit.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

using tessera::core::PluginLoader;
namespace sdk = tessera::sdk;
using Params = std::map<std::string, at::Tensor>;

PluginLoader& loader() {
  static PluginLoader instance({PLUGIN_DIR});
  return instance;
}

std::shared_ptr<sdk::Module> make_model(const std::string& name, const std::string& toml_text) {
  sdk::Options options = sdk::make_options("model", "test.toml", toml::parse(toml_text));
  auto model = loader().create_as<sdk::Module>(sdk::PluginKind::model, name, options);
  options.check_all_used();
  model->configure_model();
  return model;
}

const char* const kSmallGpt = "n_layer = 2\nn_head = 2\nn_embd = 16\nblock_size = 8\n";

/// Detached copies of the network's parameters that require grad: the reference's weights.
Params copy_parameters(torch::nn::Module& net) {
  Params out;
  for (const auto& item : net.named_parameters()) out[item.key()] = item.value().detach().clone().requires_grad_(true);
  return out;
}

const at::Tensor& param(const Params& p, const std::string& name) {
  auto it = p.find(name);
  TESSERA_CHECK(it != p.end(), "the network has no parameter ", name);
  return it->second;
}

at::Tensor linear(const at::Tensor& x, const Params& p, const std::string& prefix, bool bias = true) {
  at::Tensor y = at::matmul(x, param(p, prefix + ".weight").t());
  return bias ? y + param(p, prefix + ".bias") : y;
}

at::Tensor nll(const at::Tensor& logits, const at::Tensor& target) {
  at::Tensor logp = at::log_softmax(logits.reshape({-1, logits.size(-1)}), -1);
  return -logp.gather(1, target.reshape({-1, 1})).mean();
}

/// nanoGPT written out by hand: pre-LN blocks, per-head causal attention, 4x GELU MLP, the
/// token embedding reused as the output head unless `lm_head.weight` exists.
at::Tensor reference_gpt_logits(const Params& p, const at::Tensor& idx, int n_layer, int n_head) {
  const std::int64_t B = idx.size(0), T = idx.size(1);
  const at::Tensor& wte = param(p, "wte.weight");
  const std::int64_t C = wte.size(1), D = C / n_head;
  at::Tensor x = wte.index_select(0, idx.reshape({-1})).view({B, T, C}) + param(p, "wpe.weight").narrow(0, 0, T);
  const at::Tensor allowed = at::ones({T, T}, at::kBool).tril();
  auto ln = [&](const at::Tensor& h, const std::string& name) {
    return at::layer_norm(h, {C}, param(p, name + ".weight"), param(p, name + ".bias"), 1e-5);
  };
  for (int l = 0; l < n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    at::Tensor qkv = linear(ln(x, b + "ln_1"), p, b + "attn");
    std::vector<at::Tensor> heads;
    for (int h = 0; h < n_head; ++h) {
      at::Tensor q = qkv.narrow(2, h * D, D), k = qkv.narrow(2, C + h * D, D), v = qkv.narrow(2, 2 * C + h * D, D);
      at::Tensor scores = at::bmm(q, k.transpose(1, 2)) / std::sqrt(static_cast<double>(D));
      scores = at::where(allowed, scores, at::full({}, -1e30, scores.options()));
      heads.push_back(at::bmm(at::softmax(scores, -1), v));
    }
    x = x + linear(at::cat(heads, 2), p, b + "proj");
    x = x + linear(at::gelu(linear(ln(x, b + "ln_2"), p, b + "fc")), p, b + "fc_proj");
  }
  x = ln(x, "ln_f");
  return p.count("lm_head.weight") ? linear(x, p, "lm_head", false) : at::matmul(x, wte.t());
}

void expect_same_gradients(torch::nn::Module& net, const Params& reference) {
  for (const auto& item : net.named_parameters()) {
    const at::Tensor& mine = item.value().grad();
    const at::Tensor& theirs = param(reference, item.key()).grad();
    ASSERT_TRUE(mine.defined()) << item.key();
    ASSERT_TRUE(theirs.defined()) << item.key();
    EXPECT_TRUE(at::allclose(mine, theirs, 1e-4, 1e-6))
        << item.key() << ": max difference " << (mine - theirs).abs().max().item<double>();
  }
}

std::pair<at::Tensor, at::Tensor> random_tokens(std::int64_t B, std::int64_t T) {
  at::Tensor tokens = at::randint(0, 256, {B, T + 1}, at::kLong);
  return {tokens.narrow(1, 0, T).contiguous(), tokens.narrow(1, 1, T).contiguous()};
}

/// Counts, per unit module, how often sdk::invoke ran it; runs the unit's own forward.
class CountingRunner final : public sdk::UnitRunner {
 public:
  std::vector<at::Tensor> run(torch::nn::Module& unit, sdk::UnitFunction forward,
                              const std::vector<at::Tensor>& inputs) override {
    ++calls[&unit];
    return forward(inputs);
  }
  std::map<const torch::nn::Module*, int> calls;
};

/// Installs `runner` on every module of the network whose name() is one of the model's unit
/// classes (what the FSDP transformer wrap policy does).
std::vector<std::shared_ptr<torch::nn::Module>> install(sdk::Module& model,
                                                        const std::shared_ptr<sdk::UnitRunner>& runner) {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  const auto classes = model.fsdp_unit_classes();
  for (const auto& m : model.network()->modules(/*include_self=*/false))
    if (std::find(classes.begin(), classes.end(), m->name()) != classes.end()) {
      sdk::set_unit_runner(*m, runner);
      units.push_back(m);
    }
  return units;
}

class AutocastBF16 {
 public:
  AutocastBF16() {
    tessera::sdk::set_autocast(/*cuda=*/false, true, at::kBFloat16);
  }
  ~AutocastBF16() {
    at::autocast::clear_cache();
    tessera::sdk::set_autocast(/*cuda=*/false, false, at::kBFloat16);
  }
};

TEST(GPT, OneStepGradientsEqualAHandWrittenReference) {
  for (const bool tied : {true, false}) {
    at::manual_seed(1);
    auto model = make_model("gpt", std::string(kSmallGpt) + "tie_embeddings = " + (tied ? "true" : "false") + "\n");
    auto net = model->network();
    Params reference = copy_parameters(*net);
    auto [input, target] = random_tokens(3, 8);

    sdk::StepOutput out = model->training_step(sdk::Batch{input, target}, 0);
    out.loss.backward();
    at::Tensor expected = nll(reference_gpt_logits(reference, input, 2, 2), target);
    expected.backward();

    EXPECT_NEAR(out.loss.item<double>(), expected.item<double>(), 1e-5) << "tied=" << tied;
    EXPECT_NEAR(out.metrics.at("loss").item<double>(), expected.item<double>(), 1e-5);
    EXPECT_EQ(out.items, 3 * 8);  // tokens
    expect_same_gradients(*net, reference);
  }
}

TEST(GPT, TiedEmbeddingIsOneParameter) {
  auto tied = make_model("gpt", kSmallGpt);
  auto untied = make_model("gpt", std::string(kSmallGpt) + "tie_embeddings = false\n");
  auto count = [](torch::nn::Module& net) {
    std::int64_t n = 0;
    for (const auto& p : net.parameters()) n += p.numel();
    return n;
  };
  EXPECT_EQ(tied->network()->named_parameters().find("lm_head.weight"), nullptr);
  EXPECT_NE(untied->network()->named_parameters().find("lm_head.weight"), nullptr);
  EXPECT_EQ(count(*untied->network()) - count(*tied->network()), 256 * 16);
  // Distinct storages: nothing registered twice.
  std::set<const void*> storages;
  for (const auto& p : tied->network()->parameters()) storages.insert(p.data_ptr());
  EXPECT_EQ(storages.size(), tied->network()->parameters().size());

  // The head reads the embedding itself: zeroing token 65's row zeroes its logit everywhere.
  at::Tensor wte = tied->network()->named_parameters()["wte.weight"];
  {
    torch::NoGradGuard no_grad;
    wte[65].zero_();
  }
  Params reference = copy_parameters(*tied->network());
  auto [input, target] = random_tokens(2, 8);
  input.masked_fill_(input.eq(65), 66);
  at::Tensor logits = reference_gpt_logits(reference, input, 2, 2);
  EXPECT_TRUE(logits.select(2, 65).eq(0).all().item<bool>());
  // ... and the head's gradient lands in the same tensor: row 65 gets one though token 65
  // never occurs in the input.
  tied->training_step(sdk::Batch{input, target}, 0).loss.backward();
  EXPECT_GT(wte.grad()[65].abs().sum().item<double>(), 0.0);
}

TEST(GPT, InitialisesLikeNanoGPT) {
  at::manual_seed(0);
  auto model = make_model("gpt", "n_layer = 8\nn_head = 4\nn_embd = 64\nblock_size = 16\n");
  auto params = model->network()->named_parameters();
  const double residual = 0.02 / std::sqrt(2.0 * 8);
  EXPECT_NEAR(params["wte.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["blocks.3.attn.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["blocks.3.fc.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["blocks.3.proj.weight"].std().item<double>(), residual, residual * 0.1);
  EXPECT_NEAR(params["blocks.3.fc_proj.weight"].std().item<double>(), residual, residual * 0.1);
  EXPECT_EQ(params["blocks.3.fc.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(params["blocks.3.ln_1.weight"].eq(1).all().item<bool>());
  EXPECT_TRUE(params["ln_f.bias"].eq(0).all().item<bool>());
}

TEST(GPT, BlocksRunThroughInvokeOncePerForward) {
  auto model = make_model("gpt", "n_layer = 3\nn_head = 2\nn_embd = 16\nblock_size = 8\nmax_new_tokens = 4\n");
  EXPECT_EQ(model->fsdp_unit_classes(), std::vector<std::string>{"Block"});
  auto [input, target] = random_tokens(2, 8);
  const double plain = model->training_step(sdk::Batch{input, target}, 0).loss.item<double>();

  auto runner = std::make_shared<CountingRunner>();
  auto units = install(*model, runner);
  ASSERT_EQ(units.size(), 3u);
  const double counted = model->training_step(sdk::Batch{input, target}, 0).loss.item<double>();
  EXPECT_EQ(plain, counted);
  for (const auto& unit : units) EXPECT_EQ(runner->calls[unit.get()], 1);

  model->network()->train(false);
  model->predict_step(sdk::Batch{input.narrow(0, 0, 1), {}}, 0);
  for (const auto& unit : units) EXPECT_EQ(runner->calls[unit.get()], 1 + 4);  // one forward per new token
  for (const auto& unit : units) sdk::set_unit_runner(*unit, nullptr);
}

TEST(GPT, SamplingIsDeterministicGivenTheSeedAndRespectsTopK) {
  auto model = make_model("gpt", std::string(kSmallGpt) + "max_new_tokens = 12\n");
  model->network()->train(false);
  at::Tensor prompt = at::tensor({72, 105, 32}, at::kLong).view({1, 3});  // "Hi "
  at::manual_seed(7);
  at::Tensor a = model->predict_step(sdk::Batch{prompt, {}}, 0);
  at::manual_seed(7);
  at::Tensor b = model->predict_step(sdk::Batch{prompt, {}}, 0);
  ASSERT_EQ(a.sizes(), (std::vector<std::int64_t>{1, 15}));
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_TRUE(at::equal(a.narrow(1, 0, 3), prompt));
  EXPECT_GE(a.min().item<std::int64_t>(), 0);
  EXPECT_LT(a.max().item<std::int64_t>(), 256);
  EXPECT_FALSE(a.requires_grad());

  // top_k = 1 is greedy decoding: whatever the seed, every new token is the reference's
  // argmax given the context, cropped to block_size.
  auto greedy = make_model("gpt", std::string(kSmallGpt) + "max_new_tokens = 12\ntop_k = 1\n");
  greedy->network()->train(false);
  at::manual_seed(8);
  at::Tensor g = greedy->predict_step(sdk::Batch{prompt, {}}, 0);
  at::manual_seed(9);
  EXPECT_TRUE(at::equal(g, greedy->predict_step(sdk::Batch{prompt, {}}, 0)));
  Params reference = copy_parameters(*greedy->network());
  torch::NoGradGuard no_grad;
  for (std::int64_t t = 3; t < g.size(1); ++t) {
    const std::int64_t start = std::max<std::int64_t>(0, t - 8);
    at::Tensor logits = reference_gpt_logits(reference, g.narrow(1, start, t - start), 2, 2);
    EXPECT_EQ(logits[0][t - start - 1].argmax().item<std::int64_t>(), g[0][t].item<std::int64_t>()) << "position " << t;
  }
}

TEST(GPT, HyperParametersNameEveryOption) {
  auto model = make_model("gpt", kSmallGpt);
  sdk::Checkpoint h = model->hyper_parameters();
  for (const char* key : {"n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "tie_embeddings",
                          "max_new_tokens", "temperature", "top_k"})
    EXPECT_TRUE(h.contains(key)) << key;
  EXPECT_EQ(h.at("n_embd").toInt(), 16);
}

TEST(GPT, RejectsBadOptions) {
  try {
    make_model("gpt", "n_embd = 30\nn_head = 4\n");
    FAIL() << "expected an error";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_embd"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("n_head"), std::string::npos) << e.what();
  }
  auto model = make_model("gpt", kSmallGpt);
  auto [input, target] = random_tokens(1, 9);
  try {
    model->training_step(sdk::Batch{input, target}, 0);
    FAIL() << "a sequence longer than block_size was accepted";
  } catch (const sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[data] block_size"), std::string::npos) << e.what();
  }
}

TEST(GPT, DropoutOnlyWhileTraining) {
  auto model = make_model("gpt", std::string(kSmallGpt) + "dropout = 0.5\n");
  auto [input, target] = random_tokens(2, 8);
  model->network()->train(false);
  const double a = model->validation_step(sdk::Batch{input, target}, 0).loss.item<double>();
  const double b = model->validation_step(sdk::Batch{input, target}, 0).loss.item<double>();
  EXPECT_EQ(a, b);
  model->network()->train(true);
  const double c = model->training_step(sdk::Batch{input, target}, 0).loss.item<double>();
  EXPECT_NE(a, c);
}

at::Tensor reference_mlp_logits(const Params& p, const at::Tensor& images, int hidden_layers) {
  at::Tensor x = images.reshape({images.size(0), -1});
  for (int l = 0; l < hidden_layers; ++l) x = at::relu(linear(x, p, "layers." + std::to_string(l) + ".linear"));
  return linear(x, p, "head");
}

TEST(MLP, OneStepGradientsEqualAHandWrittenReference) {
  at::manual_seed(2);
  auto model = make_model("mlp", "hidden_sizes = [37, 19, 11]\n");
  auto net = model->network();
  Params reference = copy_parameters(*net);
  at::Tensor images = at::randn({5, 1, 28, 28});
  at::Tensor labels = at::randint(0, 10, {5}, at::kLong);

  sdk::StepOutput out = model->training_step(sdk::Batch{images, labels}, 0);
  out.loss.backward();
  at::Tensor logits = reference_mlp_logits(reference, images, 3);
  at::Tensor expected = nll(logits, labels);
  expected.backward();

  EXPECT_NEAR(out.loss.item<double>(), expected.item<double>(), 1e-5);
  EXPECT_NEAR(out.metrics.at("acc").item<double>(), logits.argmax(1).eq(labels).to(at::kFloat).mean().item<double>(),
              1e-7);
  EXPECT_EQ(out.items, 5);  // samples
  expect_same_gradients(*net, reference);
}

TEST(MLP, DefaultSizesPadUnderFSDP) {
  auto model = make_model("mlp", "");
  std::int64_t total = 0;
  for (const auto& p : model->network()->parameters()) total += p.numel();
  auto first = model->network()->named_parameters();
  const std::int64_t unit0 = first["layers.0.linear.weight"].numel() + first["layers.0.linear.bias"].numel();
  for (int d : {2, 3, 4}) {
    EXPECT_NE(total % d, 0) << d;
    EXPECT_NE(unit0 % d, 0) << d;
  }
}

TEST(MLP, RejectsNonIntegerHiddenSizes) {
  EXPECT_THROW(make_model("mlp", "hidden_sizes = [12.5]\n"), sdk::Error);
  EXPECT_THROW(make_model("mlp", "hidden_sizes = [0]\n"), sdk::Error);
}

TEST(Vision, LayersRunThroughInvoke) {
  for (const std::string name : {"mlp", "cnn"}) {
    auto model =
        make_model(name, name == "mlp" ? "hidden_sizes = [13, 7]\n" : "channels1 = 4\nchannels2 = 6\nhidden = 8\n");
    auto runner = std::make_shared<CountingRunner>();
    auto units = install(*model, runner);
    EXPECT_EQ(units.size(), 2u) << name;
    model->training_step(sdk::Batch{at::randn({3, 1, 28, 28}), at::randint(0, 10, {3}, at::kLong)}, 0);
    for (const auto& unit : units) EXPECT_EQ(runner->calls[unit.get()], 1) << name;
    for (const auto& unit : units) sdk::set_unit_runner(*unit, nullptr);
  }
}

TEST(CNN, BatchNormIsOptional) {
  auto plain = make_model("cnn", "channels1 = 4\nchannels2 = 6\nhidden = 8\n");
  auto bn = make_model("cnn", "channels1 = 4\nchannels2 = 6\nhidden = 8\nbatch_norm = true\n");
  EXPECT_TRUE(plain->network()->named_buffers().is_empty());
  EXPECT_NE(bn->network()->named_buffers().find("conv1.bn.running_mean"), nullptr);
  sdk::StepOutput out =
      bn->training_step(sdk::Batch{at::randn({4, 1, 28, 28}), at::randint(0, 10, {4}, at::kLong)}, 0);
  EXPECT_TRUE(std::isfinite(out.loss.item<double>()));
  EXPECT_TRUE(bn->hyper_parameters().at("batch_norm").toBool());
}

TEST(Models, TrainUnderBF16Autocast) {
  struct Case {
    const char* name;
    const char* options;
  };
  for (const Case& c : {Case{"gpt", "n_layer = 2\nn_head = 2\nn_embd = 16\nblock_size = 8\ndropout = 0.1\n"},
                        Case{"mlp", ""}, Case{"cnn", "channels1 = 4\nchannels2 = 6\nhidden = 8\nbatch_norm = true\n"}}) {
    at::manual_seed(3);
    auto model = make_model(c.name, c.options);
    sdk::Batch batch;
    if (std::string(c.name) == "gpt") {
      auto [input, target] = random_tokens(2, 8);
      batch = sdk::Batch{input, target};
    } else {
      batch = sdk::Batch{at::randn({4, 1, 28, 28}), at::randint(0, 10, {4}, at::kLong)};
    }
    model->network()->train(false);
    const double fp32 = [&] {
      torch::NoGradGuard no_grad;
      return model->validation_step(batch, 0).loss.item<double>();
    }();
    double bf16;
    {
      AutocastBF16 autocast;
      sdk::StepOutput out = model->validation_step(batch, 0);
      bf16 = out.loss.item<double>();
      EXPECT_EQ(out.loss.scalar_type(), at::kFloat) << c.name;
      out.loss.backward();
    }
    EXPECT_NEAR(bf16, fp32, 0.03 * std::abs(fp32) + 0.02) << c.name;
    for (const auto& item : model->network()->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << c.name << " " << item.key();
      EXPECT_TRUE(item.value().grad().isfinite().all().item<bool>()) << c.name << " " << item.key();
    }
    if (std::string(c.name) == "gpt") {
      AutocastBF16 autocast;
      at::Tensor out = model->predict_step(sdk::Batch{batch.input.narrow(0, 0, 1), {}}, 0);
      EXPECT_EQ(out.size(1), 8 + 200);  // max_new_tokens' default
    }
  }
}

}  // namespace
