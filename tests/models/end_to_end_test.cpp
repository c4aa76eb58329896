// The shipped models and data end to end: through the loader and through the `tessera` binary
// with the shipped configs (Fashion-MNIST accuracy after `fit` + `test`, fortunes validation loss).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include "multiprocess.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/unit.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

using tessera::sdk::Options;
using tessera::sdk::PluginKind;

Options parse(const std::string& section, const std::string& text) {
  return tessera::sdk::make_options(section, "test.toml", toml::parse(text));
}

tessera::core::PluginLoader& loader() {
  static tessera::core::PluginLoader instance({tessera::testing::plugin_dir()});
  return instance;
}

TEST(Models, MLPGradientsEqualAHandWrittenReference) {
  auto model = loader().create_as<tessera::sdk::Module>(PluginKind::model, "mlp", parse("model", "hidden_sizes = [7, 5]"));
  model->configure_model();
  auto net = model->network();
  at::manual_seed(0);
  tessera::sdk::Batch batch{at::randn({4, 1, 28, 28}), at::randint(0, 10, {4}, at::kLong)};
  model->training_step(batch, 0).loss.backward();

  // The same computation by hand, on copies of the weights.
  auto p = net->named_parameters();
  std::vector<at::Tensor> w;
  for (const char* name : {"layers.0.linear.weight", "layers.0.linear.bias", "layers.1.linear.weight",
                           "layers.1.linear.bias", "head.weight", "head.bias"})
    w.push_back(p[name].detach().clone().requires_grad_(true));
  at::Tensor h = at::relu(at::addmm(w[1], batch.input.flatten(1), w[0].t()));
  h = at::relu(at::addmm(w[3], h, w[2].t()));
  at::Tensor logits = at::addmm(w[5], h, w[4].t());
  at::Tensor loss = -at::log_softmax(logits, 1).gather(1, batch.target.unsqueeze(1)).mean();
  loss.backward();
  EXPECT_NEAR(loss.item<double>(), model->training_step(batch, 0).loss.item<double>(), 1e-6);
  int i = 0;
  for (const char* name : {"layers.0.linear.weight", "layers.0.linear.bias", "layers.1.linear.weight",
                           "layers.1.linear.bias", "head.weight", "head.bias"})
    EXPECT_TRUE(at::allclose(p[name].grad(), w[i++].grad(), 1e-5, 1e-6)) << name;
}

/// Counts the units run through sdk::invoke.
class CountingRunner final : public tessera::sdk::UnitRunner {
 public:
  std::vector<at::Tensor> run(torch::nn::Module&, tessera::sdk::UnitFunction forward,
                              const std::vector<at::Tensor>& inputs) override {
    ++calls;
    return forward(inputs);
  }
  int calls = 0;
};

TEST(Models, GPTRunsEveryBlockThroughTheSeamAndTiesItsEmbedding) {
  auto model = loader().create_as<tessera::sdk::Module>(
      PluginKind::model, "gpt", parse("model", "n_layer = 3\nn_head = 2\nn_embd = 16\nblock_size = 8"));
  model->configure_model();
  auto net = model->network();
  auto runner = std::make_shared<CountingRunner>();
  int blocks = 0;
  for (const auto& item : net->named_modules())
    if (item.value()->name() == "Block") {
      tessera::sdk::set_unit_runner(*item.value(), runner);
      ++blocks;
    }
  EXPECT_EQ(blocks, 3);
  EXPECT_EQ(model->fsdp_unit_classes(), std::vector<std::string>{"Block"});
  at::Tensor tokens = at::randint(0, 256, {2, 9}, at::kLong);
  auto out = model->training_step({tokens.narrow(1, 0, 8), tokens.narrow(1, 1, 8)}, 0);
  EXPECT_EQ(runner->calls, 3);
  EXPECT_EQ(out.items, 16);
  out.loss.backward();
  // Tied: no separate output head; the embedding's gradient has both contributions (rows of
  // bytes never seen as input still get gradient from the output projection).
  EXPECT_FALSE(net->named_parameters().contains("lm_head.weight"));
  at::Tensor grad = net->named_parameters()["wte.weight"].grad();
  EXPECT_GT(grad.abs().sum(1).gt(0).sum().item<std::int64_t>(), 200);
  for (const auto& item : net->named_modules()) tessera::sdk::set_unit_runner(*item.value(), nullptr);
}

TEST(Data, TextWindowsAreIndexedAndShifted) {
  std::string dir = tessera::testing::fresh_dir("text");
  std::ofstream(dir + "/corpus.txt") << std::string(1000, 'a') + "hello world";
  auto data = loader().create_as<tessera::sdk::DataModule>(
      PluginKind::data, "text", parse("data", "path = '" + dir + "/corpus.txt'\nblock_size = 4\nval_fraction = 0.1"));
  data->setup("fit");
  auto train = data->train_dataset();
  EXPECT_EQ(train->size(), (static_cast<std::int64_t>(1011 * 0.9) - 5) / 4 + 1);  // 1011 bytes, the last 10% held out
  auto batch = train->get_batch({0, 3});
  EXPECT_EQ(batch.input.sizes(), (std::vector<std::int64_t>{2, 4}));
  EXPECT_TRUE(at::equal(batch.input.narrow(1, 1, 3), batch.target.narrow(1, 0, 3)));
  auto prompt = data->predict_dataset()->get_batch({0});
  EXPECT_EQ(data->describe_prediction(prompt, prompt.input), "Q: ");
}

TEST(Data, CorruptIdxFilesGiveClearErrors) {
  std::string dir = tessera::testing::fresh_dir("idx");
  auto write_gz = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir + "/raw") << bytes;
    ASSERT_EQ(std::system(("gzip -c " + dir + "/raw > " + dir + "/" + name).c_str()), 0);
  };
  // Bad magic in the training images.
  write_gz("train-images-idx3-ubyte.gz", std::string("\x00\x00\x09\x03", 4) + std::string(12, '\0'));
  auto data = loader().create_as<tessera::sdk::DataModule>(PluginKind::data, "fashion_mnist",
                                                            parse("data", "root = '" + dir + "'\nval_size = 0"));
  try {
    data->setup("fit");
    ADD_FAILURE() << "a bad magic number was accepted";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not an IDX file of 3-D unsigned bytes"), std::string::npos) << e.what();
  }
  // A truncated file: the header announces 2 images of 28x28, one byte follows.
  write_gz("train-images-idx3-ubyte.gz", std::string("\x00\x00\x08\x03\x00\x00\x00\x02\x00\x00\x00\x1c\x00\x00\x00\x1c", 16) + "x");
  try {
    data->setup("fit");
    ADD_FAILURE() << "a truncated file was accepted";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is truncated"), std::string::npos) << e.what();
  }
}

double parse_metric(const std::string& output, const std::string& name) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(output, m, std::regex(name + " ([0-9.]+)"))) << output;
  return m.empty() ? NAN : std::stod(m[1]);
}

TEST(Learning, CNNReaches85PercentOnFashionMNIST) {
  std::string dir = tessera::testing::fresh_dir("cnn");
  std::string sets = " --set trainer.default_root_dir=" + dir + " --set trainer.enable_progress_bar=false";
  auto fit = tessera::testing::run_tessera("fit --config " TESSERA_SOURCE_DIR "/configs/cnn-fashion-mnist.toml" + sets);
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  auto test = tessera::testing::run_tessera(
      "test --config " TESSERA_SOURCE_DIR "/configs/cnn-fashion-mnist.toml --ckpt-path best" + sets);
  ASSERT_EQ(test.exit_code, 0) << test.output;
  EXPECT_NE(test.output.find("/checkpoints/step="), std::string::npos) << "best is the config's monitored save\n"
                                                                       << test.output;
  EXPECT_GE(parse_metric(test.output, "test_acc"), 0.85) << test.output;
}

TEST(Learning, GPTLowersValidationLossOnFortunes) {
  std::string dir = tessera::testing::fresh_dir("gpt-learn");
  std::string sets = " --set trainer.default_root_dir=" + dir +
                     " --set trainer.enable_progress_bar=false --set trainer.max_steps=150"
                     " --set trainer.val_check_interval=150 --set trainer.predict_after_fit=false"
                     " --set model.n_layer=2 --set data.batch_size=8";
  auto fit = tessera::testing::run_tessera("fit --config " TESSERA_SOURCE_DIR "/configs/gpt-fortunes.toml" + sets);
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  // Uniform over 256 bytes is ln 256 = 5.55; 150 steps must get well below.
  EXPECT_LT(parse_metric(fit.output, "val_loss"), 0.6 * std::log(256.0)) << fit.output;
}

// The README's main job as a new user runs it (configs/llama-tokens.sh: tokenizer, prepare, fit
// with fsdp2 on 2 ranks, a sample), shortened, from a copy of the two config files so that it
// writes into the test's folder.
TEST(MainJob, TheReadmePipelineTrainsTheLlamaOnTokensAndSamples) {
  namespace fs = std::filesystem;
  const fs::path root = tessera::testing::fresh_dir("main-job");
  fs::create_directories(root / "configs");
  for (const char* file : {"llama-tokens.sh", "llama-tokens.toml"})
    fs::copy_file(fs::path(TESSERA_SOURCE_DIR) / "configs" / file, root / "configs" / file);
  auto job = tessera::testing::run_command(
      "cd " + root.string() + " && timeout 300 env TESSERA=" + tessera::testing::tessera_binary() +
      " bash configs/llama-tokens.sh --set trainer.max_steps=60 --set trainer.val_check_interval=60"
      " --set trainer.checkpoint_every_n_steps=60 --set trainer.enable_progress_bar=false 2>&1");
  ASSERT_EQ(job.exit_code, 0) << job.output;
  EXPECT_TRUE(fs::exists(root / "runs/llama-tokens/tokenizer/tokenizer.model")) << job.output;
  EXPECT_TRUE(fs::exists(root / "runs/llama-tokens/data/manifest.json")) << job.output;
  EXPECT_NE(job.output.find(" binary file(s) skipped; SentencePiece"), std::string::npos)
      << "the strfile indexes beside the fortunes are not text\n" << job.output;
  EXPECT_NE(job.output.find("model llama"), std::string::npos) << job.output;
  EXPECT_NE(job.output.find("2 rank(s)"), std::string::npos) << job.output;
  // Uniform over the 2,000 ids is ln 2000 = 7.6; 60 steps must get below 90% of it.
  EXPECT_LT(parse_metric(job.output, "val_loss"), 0.9 * std::log(2000.0)) << job.output;
  EXPECT_NE(job.output.find("sample from the trained model:\nQ: What is the meaning of life?"), std::string::npos)
      << job.output;
  EXPECT_NE(job.output.find("llama-tokens: tokenizer, prepare, fit and sample in"), std::string::npos) << job.output;
}

// The shipped SFT example as a new user runs it (configs/llama-sft.sh, shortened): a tokenizer
// folder with a chat template and the riddles as conversations, a base pre-trained and exported,
// the chat data prepared with the answers' mask, LoRA fine-tuning with packing on 2 ranks, a chat
// reply, the PEFT adapter and the merged Hugging Face folder.
TEST(SftExample, LoraOnTheRiddlesGivesAReplyAnAdapterAndAMergedFolder) {
  namespace fs = std::filesystem;
  const fs::path root = tessera::testing::fresh_dir("sft-example");
  fs::create_directories(root / "configs" / "sft");
  for (const char* file : {"llama-sft.sh", "llama-sft.toml", "llama-sft-base.toml", "sft/chat_folder.py"})
    fs::copy_file(fs::path(TESSERA_SOURCE_DIR) / "configs" / file, root / "configs" / file);
  auto job = tessera::testing::run_command(
      "cd " + root.string() + " && timeout 300 env SFT_BASE_STEPS=20 TESSERA=" + tessera::testing::tessera_binary() +
      " bash configs/llama-sft.sh --set trainer.max_steps=10 --set trainer.enable_progress_bar=false 2>&1");
  ASSERT_EQ(job.exit_code, 0) << job.output;
  EXPECT_NE(job.output.find("riddles.jsonl (125 conversations)"), std::string::npos) << job.output;
  EXPECT_NE(job.output.find("0 dropped with no token to train on"), std::string::npos) << job.output;
  EXPECT_NE(job.output.find("trainable (the model froze the rest: LoRA's base)"), std::string::npos) << job.output;
  for (const char* file : {"base/config.json", "base/tokenizer.json", "chat/shard_00000.mask",
                           "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "merged/config.json",
                           "merged/tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(root / "runs/llama-sft" / file)) << file << "\n" << job.output;
  EXPECT_NE(job.output.find("llama-sft: tokenizer, base, chat data, LoRA fit, reply, adapter and merged folder in"),
            std::string::npos) << job.output;
}

}  // namespace
