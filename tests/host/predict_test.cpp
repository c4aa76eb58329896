// tessera predict: every prediction in dataset order on any world size, and generated text.
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "multiprocess.hpp"
#include "tessera/sdk/autocast.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/safetensors.hpp"
#include "host_fixtures.hpp"

namespace {

using namespace tessera::testing::host;

// [trainer] predict_output: every prediction, in dataset order, each sample once: the same
// file from one device and from 3 ranks (10 images: the sampler pads the third rank with a
// repeat), and from a tensor-parallel pair (both ranks predict the same prompt); torch.load
// reads it.
TEST(Predict, OutputHoldsEveryPredictionInDatasetOrderOnAnyWorldSize) {
  const std::string dir = tessera::testing::fresh_dir("predict-output");
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 3\nseed = 1\ndefault_root_dir = \"" << dir << "\"\n"
                                   << "[model]\nplugin = \"mlp\"\nhidden_sizes = [32]\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\nbatch_size = 4\ntrain_limit = 48\n"
                                   << "predict_limit = 10\n";
  const std::string config = dir + "/run.toml";
  ASSERT_EQ(run_tessera("fit --config " + config).exit_code, 0);
  std::map<std::string, at::Tensor> written;
  for (const auto& [name, sets] : std::vector<std::pair<std::string, std::string>>{
           {"one", ""},
           {"fsdp-3", " --set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=2"},
           {"ddp-3", " --set launch.devices=3 --set strategy.plugin=ddp"},
           {"fsdp2-2", " --set launch.devices=2 --set strategy.plugin=fsdp2"}}) {
    const std::string path = dir + "/out/" + name + ".pt";
    auto r = run_tessera("predict --config " + config + " --ckpt-path last --set trainer.predict_output=" + path + sets);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("predictions of 10 samples written to " + path), std::string::npos) << r.output;
    auto file = tessera::core::checkpoint_dict(tessera::core::load_pickle(path), path);
    EXPECT_TRUE(at::equal(tessera::core::checkpoint_get(file, "indices").toTensor(), at::arange(10, at::kLong))) << name;
    written[name] = tessera::core::checkpoint_get(file, "predictions").toTensor();
    EXPECT_EQ(written[name].sizes(), at::IntArrayRef({10})) << name;
    EXPECT_TRUE(at::equal(written[name], written["one"])) << name << ": " << written[name] << " vs " << written["one"];
  }
  // A limit keeps its meaning: 2 batches of 4 on one device.
  auto r = run_tessera("predict --config " + config + " --ckpt-path last --set trainer.limit_predict_batches=2 " +
                       "--set trainer.predict_output=" + dir + "/out/two.pt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("predictions of 8 samples written"), std::string::npos) << r.output;
  r = run_tessera("predict --config " + config + " --ckpt-path last --set trainer.predict_output=" + dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("is a directory: give the file to write"), std::string::npos) << r.output;
  // The GPT's one prompt, generated on both ranks of a tensor-parallel pair, is written once, as
  // one device generates it.
  const std::string gpt = tessera::testing::fresh_dir("predict-output-gpt");
  ASSERT_EQ(run_tessera("fit --config " + write_config(gpt) + " --set trainer.max_steps=2").exit_code, 0);
  for (const auto& [name, sets] : std::vector<std::pair<std::string, std::string>>{
           {"one", ""}, {"tp2", " --set launch.devices=2 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2"}}) {
    const std::string path = gpt + "/" + name + ".pt";
    r = run_tessera("predict --config " + gpt + "/run.toml --ckpt-path last --set trainer.predict_output=" + path + sets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("predictions of 1 sample written to " + path), std::string::npos) << r.output;
  }
  auto generated = [&](const std::string& name) {
    const std::string path = gpt + "/" + name + ".pt";
    return tessera::core::checkpoint_get(tessera::core::checkpoint_dict(tessera::core::load_pickle(path), path),
                                         "predictions").toTensor();
  };
  EXPECT_EQ(generated("one").size(0), 1);
  EXPECT_TRUE(at::equal(generated("tp2"), generated("one"))) << generated("tp2") << " vs " << generated("one");
  if (!fs::exists("/usr/bin/python3") || std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed: torch.load of the predictions not checked";
  const std::string command = "/usr/bin/python3 -c \"import torch; d = torch.load('" + dir + "/out/fsdp-3.pt'); "
                              "assert d['indices'].tolist() == list(range(10)) and d['predictions'].shape == (10,); "
                              "assert all(0 <= c < 10 for c in d['predictions'].tolist()); print('ok')\"";
  EXPECT_EQ(std::system(command.c_str()), 0);
}

TEST(Predict, PrintsGeneratedTextFromThePrompt) {
  std::string dir = tessera::testing::fresh_dir("predict");
  ASSERT_EQ(run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=2").exit_code, 0);
  auto r = run_tessera("predict --config " + dir + "/run.toml --ckpt-path last");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto at = r.output.find("Q: ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_GE(r.output.size() - at, 3u + 20u) << "expected the prompt and 20 generated bytes:\n" << r.output;
}

}  // namespace
