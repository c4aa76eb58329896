// Bad input: clear errors naming the file, key and what is valid, before any work.
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

TEST(BadInput, WrongShapesInACheckpointAreRefusedAndTheCheckpointKept) {
  std::string dir = tessera::testing::fresh_dir("shapes");
  ASSERT_EQ(run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=4").exit_code, 0);
  std::string before = file_bytes(dir + "/version_0/checkpoints/last.ckpt");
  auto r = run_tessera("fit --config " + dir + "/run.toml --ckpt-path last --set model.n_embd=48");
  EXPECT_NE(r.exit_code, 0);
  // The recorded hyper-parameters say it before any shape is compared (issue 46).
  EXPECT_NE(r.output.find("[model] n_embd = 48, the checkpoint's model has 32"), std::string::npos) << r.output;
  EXPECT_EQ(file_bytes(dir + "/version_0/checkpoints/last.ckpt"), before) << "the existing checkpoint was modified";
  // The attempt's folder holds its logs only (they explain the failure): no records, no checkpoints.
  EXPECT_FALSE(fs::exists(dir + "/version_1/checkpoints")) << "a run that failed to restore saved";
  EXPECT_FALSE(fs::exists(dir + "/version_1/config.toml")) << "a run that failed to restore wrote its records";
  // Shapes that differ without a recorded hyper-parameter saying so: the message names the file.
  auto weights = run_tessera("validate --config " + dir + "/run.toml --ckpt-path " + dir +
                             "/version_0/checkpoints/last.ckpt --set model.n_embd=48");
  EXPECT_NE(weights.exit_code, 0);
  EXPECT_NE(weights.output.find("has shape [256, 32]"), std::string::npos) << weights.output;
  EXPECT_NE(weights.output.find("different model configuration"), std::string::npos) << weights.output;
}

TEST(BadInput, MissingCheckpointNamesThePath) {
  std::string dir = tessera::testing::fresh_dir("nockpt");
  auto r = run_tessera("fit --config " + write_config(dir) + " --ckpt-path " + dir + "/nope.ckpt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(dir + "/nope.ckpt does not exist"), std::string::npos) << r.output;
}

TEST(BadInput, ConfigErrorsNameFileLineKeyAndChoices) {
  std::string dir = tessera::testing::fresh_dir("config");
  struct Case {
    std::string extra, expected;
  };
  const std::vector<Case> cases = {
      {"[trainer2]\n", "unknown section [trainer2] (did you mean 'trainer'?)"},
      {"[strategy]\nplugin = \"fsdp\"\nsharding_strategy = \"FULL_SHRAD\"\n",
       "[strategy] sharding_strategy = \"FULL_SHRAD\" is not valid (did you mean 'FULL_SHARD'?)"},
      {"[strategy]\nplugin = \"fsdp\"\ncpu_ofload = true\n",
       "[strategy] cpu_ofload is not a known key (did you mean 'cpu_offload'?)"},
      {"[strategy]\nplugin = \"fsdpp\"\n", "no strategy plugin named 'fsdpp' (did you mean 'fsdp'?)"},
      {"[launch]\ndevices = \"two\"\n", "[launch] devices must be an integer, found string"},
      {"[precision]\nprecision = \"16-mixed\"\n", "precision \"16-mixed\" needs a CUDA device"},
      {"[precision]\nprecision = \"bf16\"\n", "valid: 32-true, 16-true, bf16-true, 16-mixed, bf16-mixed"},
  };
  for (const auto& c : cases) {
    std::string config = write_config(dir, c.extra);
    auto r = run_tessera("fit --config " + config);
    EXPECT_NE(r.exit_code, 0) << c.extra;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << "config:\n" << c.extra << "\noutput:\n" << r.output;
  }
  // A duplicated section (invalid TOML) names file, line and column.
  std::string config = write_config(dir, "[model]\nn_layer = 1\n");
  auto r = run_tessera("fit --config " + config);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(config + ":"), std::string::npos) << r.output;
}

TEST(BadInput, SwitchingTheStrategyWithSetNamesThePluginsOfTheLeftoverKeys) {
  // Issue 12 item 3: --set strategy.plugin=ddp on a config written for fsdp says whose keys
  // are left and how to go on, before any work (no run folder).
  std::string dir = tessera::testing::fresh_dir("switch-strategy");
  std::string config = write_config(dir, "[strategy]\nplugin = \"fsdp\"\nsharding_strategy = \"FULL_SHARD\"\n"
                                         "auto_wrap_policy = \"transformer\"\nbackward_prefetch = \"BACKWARD_PRE\"\n");
  const std::string shipped = std::string(TESSERA_TEST_SOURCE_DIR) + "/../../configs/gpt-fortunes.toml";
  struct Case {
    std::string arguments;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"--config " + config + " --set strategy.plugin=ddp",
       {"--set strategy.plugin=ddp: [strategy] plugin = \"ddp\", but [strategy] also holds keys of other strategy "
        "plugins, which ddp does not read:",
        "auto_wrap_policy (" + config + ":28): a key of fsdp, fsdp_cpu_offload\n",
        "backward_prefetch (" + config + ":29): a key of fsdp, fsdp_cpu_offload, fsdp2\n",
        "sharding_strategy (" + config + ":27): a key of fsdp, fsdp_cpu_offload\n",
        "Remove them from [strategy] to use ddp, or go back to the plugin they were written for: [strategy] plugin = "
        "\"fsdp\""}},
      {"--config " + config + " --set strategy.plugin=single_device",
       {"which single_device does not read:", "Remove them from [strategy] to use single_device"}},
      // backward_prefetch is one vocabulary in fsdp and fsdp2: only fsdp's own keys are left over.
      {"--config " + config + " --set strategy.plugin=fsdp2",
       {"which fsdp2 does not read:", "sharding_strategy (" + config + ":27): a key of fsdp, fsdp_cpu_offload\n",
        "Remove them from [strategy] to use fsdp2"}},
      // A typo that no plugin reads is named as such beside the other plugin's keys.
      {"--config " + config + " --set strategy.plugin=ddp --set strategy.sharding_strategyy=FULL_SHARD",
       {"(sharding_strategyy: not a key of any strategy plugin found)"}},
      // As a user would: the shipped config.
      {"--config " + shipped + " --set trainer.default_root_dir=" + dir + " --set strategy.plugin=ddp",
       {"parallelize_fn (" + shipped + ":31): a key of fsdp2", "[strategy] plugin = \"fsdp2\""}},
  };
  for (const auto& c : cases) {
    auto r = run_tessera("fit " + c.arguments);
    EXPECT_NE(r.exit_code, 0) << c.arguments;
    for (const auto& part : c.expected) EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
    EXPECT_FALSE(fs::exists(dir + "/version_0")) << "work started: " << r.output;
  }
}

// Issue 43 item 3: from every shipped config, --set strategy.plugin=X reaches every strategy:
// the configuration is accepted, or the keys left over from the config's own strategy are named
// with the way on; never a type error of a key two strategies read differently.
TEST(BadInput, EveryShippedConfigSwitchesToEveryStrategy) {
  const fs::path configs = fs::path(TESSERA_TEST_SOURCE_DIR) / "../../configs";
  int checked = 0, refused_for_ddp = 0;
  for (const auto& entry : fs::directory_iterator(configs)) {
    if (entry.path().extension() != ".toml") continue;
    for (const std::string strategy : {"single_device", "ddp", "fsdp", "fsdp2"}) {
      const std::string devices = strategy == "single_device" ? " --set launch.devices=1" : "";
      auto r = run_tessera("config --config " + entry.path().string() + " --set strategy.plugin=" + strategy + devices);
      const std::string what = entry.path().filename().string() + " -> " + strategy + "\n" + r.output;
      if (r.exit_code == 0) {
        EXPECT_NE(r.output.find("plugin = \"" + strategy + "\""), std::string::npos) << what;
      } else if (r.output.find("[strategy]") != std::string::npos) {
        // A config that stops for a reason of its own (a template's placeholder path) is not
        // this test's business; one that stops at [strategy] must name the leftover keys, and
        // the way on (UnsetSwitchesStrategy.EveryShippedConfigToEveryStrategy takes it).
        EXPECT_NE(r.output.find("Remove them from [strategy] to use " + strategy), std::string::npos) << what;
        EXPECT_NE(r.output.find("On the command line: --unset strategy."), std::string::npos) << what;
        EXPECT_EQ(r.output.find("must be"), std::string::npos) << what;
        refused_for_ddp += strategy == "ddp";
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 12);
  // ddp reads the fewest keys: the fsdp and fsdp2 configs' own make the switch impossible
  // without --unset (cnn-fashion-mnist's ddp reads all of its own).
  EXPECT_GE(refused_for_ddp, 4);
}

TEST(BadInput, DataLongerThanTheModelsContextFailsBeforeTheFirstStep) {
  // Issue 12 item 3: the gpt's block_size is its context; [data] block_size (explicit, checked
  // before any rank starts, or the data plugin's default, checked on the first batch) may not be
  // longer, and a shorter one is said in the log.
  std::string dir = tessera::testing::fresh_dir("block-size");
  std::string config = write_config(dir);
  std::string text = file_bytes(config);
  const std::string data_block = "[data]\nplugin = \"text\"\nblock_size = 32\n";
  ASSERT_NE(text.find(data_block), std::string::npos);
  text.replace(text.find(data_block), data_block.size(), "[data]\nplugin = \"text\"\n");  // the default, 128
  std::ofstream(config) << text;
  auto r = run_tessera("fit --config " + config + " --set launch.devices=2 --set strategy.plugin=ddp");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the [data] plugin's fit batches: sequences of 128 tokens are longer than the model's "
                          "context, " + config + ":17: [model] block_size = 32: set [data] block_size to at most 32"),
            std::string::npos) << r.output;
  EXPECT_TRUE(metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss").empty()) << "a step ran";

  std::string shorter = tessera::testing::fresh_dir("block-size-shorter");
  auto ok = run_tessera("fit --config " + write_config(shorter) + " --set data.block_size=16 --set trainer.max_steps=1");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("note: --set data.block_size=16: [data] block_size = 16: sequences of 16 tokens, shorter "
                           "than the model's context"),
            std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("positions 16..31 are never trained"), std::string::npos) << ok.output;
}

TEST(BadInput, MissingDataFileNamesTheKeyAndPackage) {
  std::string dir = tessera::testing::fresh_dir("nodata");
  const std::string missing = "[data] path = \"/nonexistent/corpus.txt\": no such file or directory";
  auto r = run_tessera("fit --config " + write_config(dir) + " --set data.path=/nonexistent/corpus.txt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
  // On two ranks it is found before either starts (the memory plan sets the data up), and said once.
  r = run_tessera("fit --config " + write_config(dir) + " --set data.path=/nonexistent/corpus.txt --set launch.devices=2 " +
                  "--set strategy.plugin=fsdp");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(missing), r.output.rfind(missing)) << r.output;
}

TEST(BadInput, SyncBatchNormRefusesModelsItCannotSynchronise) {
  // LibTorch's own BatchNorm layers cannot be reached (no forward hooks): named, with the fix.
  std::string dir = tessera::testing::fresh_dir("sync-bn-plain");
  std::ofstream(dir + "/run.toml") << "plugin_dirs = [\"" TEST_PLUGIN_DIR "\"]\n"
                                   << "[trainer]\nmax_steps = 2\nsync_batchnorm = true\ndefault_root_dir = \"" << dir << "\"\n"
                                   << "[model]\nplugin = \"layernorm_model\"\nbatch_norm = true\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\nbatch_size = 8\ntrain_limit = 64\n";
  auto plain = run_tessera("fit --config " + dir + "/run.toml --set launch.devices=2 --set strategy.plugin=ddp");
  EXPECT_EQ(plain.exit_code, 1) << plain.output;
  EXPECT_NE(plain.output.find("[trainer] sync_batchnorm = true, but bn is a torch::nn BatchNorm layer, which normalises "
                              "over this rank's samples only: build it as tessera::toolkit::SyncBatchNorm2d"),
            std::string::npos)
      << plain.output;
  EXPECT_EQ(plain.output.find("epoch 0 step 1/"), std::string::npos) << "refused before the first step\n" << plain.output;
  std::string gpt = tessera::testing::fresh_dir("sync-bn-none");
  auto none = run_tessera("fit --config " + write_config(gpt) + " --set trainer.sync_batchnorm=true");
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_NE(none.output.find("[trainer] sync_batchnorm = true, but model 'gpt' has no BatchNorm layer to synchronise: "
                             "remove the key"),
            std::string::npos)
      << none.output;
}

TEST(BadInput, Bf16LayerNormOnCpuIsExplainedWithoutAStackTrace) {
  std::string dir = tessera::testing::fresh_dir("bf16-layernorm");
  std::ofstream(dir + "/run.toml") << "plugin_dirs = [\"" TEST_PLUGIN_DIR "\"]\n"
                                   << "[trainer]\nmax_steps = 2\ndefault_root_dir = \"" << dir << "\"\n"
                                   << "[precision]\nprecision = \"bf16-mixed\"\n"
                                   << "[model]\nplugin = \"layernorm_model\"\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\nbatch_size = 8\ntrain_limit = 64\n";
  auto r = run_tessera("fit --config " + dir + "/run.toml");
  // Whether this LibTorch's CPU autocast feeds LayerNorm its bf16 input against the fp32
  // weight (1.13 does; 2.x autocasts layer_norm to fp32 and the model trains).
  bool libtorch_fails = false;
  try {
    tessera::sdk::set_autocast(/*cuda=*/false, true, at::kBFloat16);
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({32}));
    norm(torch::nn::Linear(8, 32)(at::randn({2, 8})));
  } catch (const c10::Error&) {
    libtorch_fails = true;
  }
  tessera::sdk::set_autocast(/*cuda=*/false, false, at::kBFloat16);
  if (!libtorch_fails) {
    EXPECT_EQ(r.exit_code, 0) << "this LibTorch runs a LayerNorm under CPU autocast:\n" << r.output;
    return;
  }
  // The sanity check's validation_step meets it before any step; without one, training_step.
  auto without_sanity_check = run_tessera("fit --config " + dir + "/run.toml --set trainer.num_sanity_val_steps=0");
  for (const auto& [run, step] : {std::pair{&r, "validation_step"}, std::pair{&without_sanity_check, "training_step"}}) {
    EXPECT_EQ(run->exit_code, 1) << run->output;
    EXPECT_NE(run->output.find(std::string(step) + " failed under precision bf16-mixed on cpu: "), std::string::npos)
        << run->output;
    EXPECT_EQ(run->output.find("epoch 0 step 1/"), std::string::npos) << "no step may complete\n" << run->output;
    EXPECT_NE(run->output.find("LayerNorm modules in the model: norm"), std::string::npos) << run->output;
    EXPECT_NE(run->output.find("bf16-true"), std::string::npos) << run->output;
    EXPECT_EQ(run->output.find("frame #"), std::string::npos) << "a LibTorch stack trace reached the user:\n"
                                                              << run->output;
  }
}

}  // namespace
