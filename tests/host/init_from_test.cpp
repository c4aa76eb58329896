// [trainer] init_from: fine-tuning from weights in every format, strict and not, and what is refused.
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

/// The validation loss `validate` logs for `config` with `sets` (one rank).
double validate_loss(const std::string& root, const std::string& config, const std::string& sets) {
  auto r = run_tessera("validate --config " + config + " --set trainer.default_root_dir=" + root + " " + sets);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto losses = metric_series(run_dir(root) + "/metrics.csv", "validate", "val_loss");
  EXPECT_EQ(losses.size(), 1u) << r.output;
  return losses.empty() ? NAN : losses.begin()->second;
}

TEST(InitFrom, FineTuningStartsFromTheWeightsInEveryFormatOnEveryStrategy) {
  // Two pretraining runs of the same global batch: one writes a full .ckpt, one (fsdp, 2 ranks)
  // a sharded folder; the first is also exported to safetensors.
  const std::string pre = tessera::testing::fresh_dir("init-pre");
  const std::string config = write_config(pre);
  ASSERT_EQ(run_tessera("fit --config " + config + kNoDropout + " --set trainer.max_steps=4").exit_code, 0);
  const std::string full = run_dir(pre) + "/checkpoints/step=4.ckpt";
  const std::string pre_sharded = tessera::testing::fresh_dir("init-pre-sharded");
  auto r = run_tessera("fit --config " + config + kNoDropout + " --set trainer.max_steps=4 --set trainer.default_root_dir=" +
                       pre_sharded + " --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2 " +
                       "--set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string sharded = run_dir(pre_sharded) + "/checkpoints/step=4.ckpt";  // a folder
  ASSERT_TRUE(fs::is_directory(sharded)) << r.output;
  const std::string safetensors = pre + "/weights.safetensors";
  ASSERT_EQ(run_tessera("checkpoint export " + full + " --to " + safetensors).exit_code, 0);

  // validate evaluates init_from's weights as it evaluates --ckpt-path's.
  const std::string eval = tessera::testing::fresh_dir("init-eval");
  const double expected = validate_loss(eval, config, "--ckpt-path " + full);
  for (const std::string& from : {full, safetensors})
    EXPECT_NEAR(validate_loss(eval, config, "--set trainer.init_from=" + from), expected, 1e-6) << from;
  EXPECT_NEAR(validate_loss(eval, config, "--set trainer.init_from=" + sharded), expected, 1e-4) << sharded;
  // Hugging Face's layout of a large model: safetensors files and an index naming each tensor's.
  {
    std::vector<std::pair<std::string, at::Tensor>> shards[2];
    nlohmann::json weight_map;
    fs::create_directories(pre + "/hf");
    int k = 0;
    for (const auto& [name, value] : tessera::testing::checkpoint_state(full)) {
      const int shard = k++ % 2;
      shards[shard].emplace_back(name, value);
      weight_map[name] = "model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors";
    }
    for (int shard : {0, 1})
      tessera::core::write_safetensors(pre + "/hf/model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors",
                                       shards[shard], {{"format", "pt"}});
    std::ofstream(pre + "/hf/model.safetensors.index.json") << nlohmann::json{{"weight_map", weight_map}}.dump();
    EXPECT_NEAR(validate_loss(eval, config, "--set trainer.init_from=" + pre + "/hf/model.safetensors.index.json"),
                expected, 1e-6);
  }

  // Fine-tuning with another learning rate, global batch 6: one device from the .ckpt, fsdp on
  // 3 ranks from safetensors, fsdp2 on 2 ranks from the sharded folder train alike.
  const std::string tune = " --set optimizer.lr=0.001 --set trainer.max_steps=3" + kNoDropout;
  struct Run {
    std::string name, from, sets;
  };
  const std::vector<Run> runs = {
      {"init-single", full, "--set data.batch_size=6"},
      {"init-fsdp-3", safetensors, "--set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=2"},
      {"init-fsdp2-2", sharded, "--set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=3"}};
  std::map<std::int64_t, double> reference;
  for (const Run& run : runs) {
    const std::string dir = tessera::testing::fresh_dir(run.name);
    r = run_tessera("fit --config " + config + tune + " --set trainer.default_root_dir=" + dir +
                    " --set trainer.init_from=" + run.from + " " + run.sets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("weights initialized from " + run.from + " ([trainer] init_from)"), std::string::npos)
        << r.output;
    auto losses = metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
    // A new run: its own step count, optimizer state and schedule (lr warms up from step 1).
    auto last = tessera::core::checkpoint_dict(tessera::core::load_pickle(run_dir(dir) + "/checkpoints/last.ckpt"), "last");
    EXPECT_EQ(last.at("global_step").toInt(), 3) << run.name;
    const std::size_t first = r.output.find("step 1/3 ");
    ASSERT_NE(first, std::string::npos) << r.output;
    EXPECT_NE(r.output.substr(first, r.output.find('\n', first) - first).find(" lr 0.0005 "), std::string::npos)
        << "warmup_steps = 2 from the fine-tuning lr:\n" << r.output;
    if (reference.empty()) {
      reference = losses;
      continue;
    }
    expect_losses_equal(reference, losses, 1, 3, 1e-4);
  }
  // Its first loss is the pretrained model's on the first batch, far below a fresh model's.
  const std::string scratch = tessera::testing::fresh_dir("init-scratch");
  ASSERT_EQ(run_tessera("fit --config " + config + tune + " --set data.batch_size=6 --set trainer.default_root_dir=" +
                        scratch).exit_code, 0);
  auto fresh = metric_series(run_dir(scratch) + "/metrics.csv", "train", "train_loss");
  ASSERT_TRUE(fresh.count(1) && reference.count(1));
  EXPECT_LT(reference.at(1), fresh.at(1) - 0.1);

  // Resuming the fine-tuning run restores its own checkpoint; init_from is not applied again.
  const std::string dir = tessera::testing::fresh_dir("init-single");
  r = run_tessera("fit --config " + config + tune + " --set trainer.default_root_dir=" + dir + " --set trainer.init_from=" +
                  full + " --set data.batch_size=6");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("fit --config " + config + kNoDropout + " --set optimizer.lr=0.001 --set trainer.max_steps=5" +
                  " --set trainer.default_root_dir=" + dir + " --set trainer.init_from=" + full +
                  " --set data.batch_size=6 --ckpt-path last");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[trainer] init_from is not applied: resuming from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resuming at step 3"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("weights initialized from"), std::string::npos) << r.output;
}

TEST(InitFrom, PythonModuleStateDictsLoad) {
  // torch.save(model.state_dict()) from a PyTorch nn.Module (an OrderedDict with _metadata, which
  // LibTorch 1.13's unpickler made None) and a Lightning-style {"state_dict": ..., "epoch": ...}.
  if (!fs::exists("/usr/bin/python3") || std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed: no Python to save a module's state dict with";
  const std::string pre = tessera::testing::fresh_dir("init-python");
  const std::string config = write_config(pre);
  ASSERT_EQ(run_tessera("fit --config " + config + " --set trainer.max_steps=2").exit_code, 0);
  const std::string ckpt = run_dir(pre) + "/checkpoints/last.ckpt";
  const std::string command =
      "/usr/bin/python3 -c \"import collections, sys, torch; sys.path[:0] = ['" TESSERA_TEST_SUPPORT_DIR "', '" TESSERA_TEST_SOURCE_DIR
      "/../../bench/training']; from safe_torch_load import load; from pytorch_ddp_gpt import GPT; "
      "m = GPT(2, 2, 32, 32); m.load_state_dict(load(sys.argv[1])['state_dict']); sd = m.state_dict(); "
      "assert type(sd).__name__ == 'OrderedDict' and sd._metadata; torch.save(sd, sys.argv[2] + '/module.pt'); "
      "torch.save({'epoch': 3, 'state_dict': sd, 'hparams': {'n': [1, 2]}}, sys.argv[2] + '/lightning.ckpt'); "
      // Saved from wrappers: DDP's module.; a LightningModule holding the GPT as self.model.
      "torch.save(collections.OrderedDict(('module.' + k, v) for k, v in sd.items()), sys.argv[2] + '/ddp.pt'); "
      "torch.save({'state_dict': {'model.' + k: v for k, v in sd.items()}}, sys.argv[2] + '/wrapped.ckpt'); "
      // safetensors by another writer: a header of odd length, so the tensors are not aligned.
      "import json, struct; offsets = {}; at = 0; data = b''\n"
      "for k, v in sd.items(): b = v.numpy().tobytes(); offsets[k] = dict(dtype='F32', shape=list(v.shape), "
      "data_offsets=[at, at + len(b)]); at += len(b); data += b\n"
      "h = json.dumps(offsets).encode(); h += b' ' * (1 - len(h) % 2)\n"
      "open(sys.argv[2] + '/other.safetensors', 'wb').write(struct.pack('<Q', len(h)) + h + data)\" " +
      ckpt + " " + pre;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const std::string eval = tessera::testing::fresh_dir("init-python-eval");
  const double expected = validate_loss(eval, config, "--ckpt-path " + ckpt);
  for (const char* file : {"/module.pt", "/lightning.ckpt", "/other.safetensors", "/ddp.pt", "/wrapped.ckpt"})
    EXPECT_NEAR(validate_loss(eval, config, "--set trainer.init_from=" + pre + file), expected, 1e-6) << file;
  auto wrapped = run_tessera("validate --config " + config + " --set trainer.init_from=" + pre + "/ddp.pt");
  EXPECT_NE(wrapped.output.find("every tensor's name starts with 'module.'"), std::string::npos) << wrapped.output;
  auto r = run_tessera("checkpoint inspect " + pre + "/module.pt");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("state_dict (28 tensors)"), std::string::npos) << r.output;
}

// init_from_strict = false: a model with a third block and a longer context starts from a
// 2-block checkpoint (a file, or a sharded folder); what matches by name and shape is the
// checkpoint's, the rest (blocks.2, wpe of another shape) the model's own initialisation, under
// every strategy.
TEST(InitFrom, NonStrictLoadsWhatMatchesAndKeepsTheModelsOwnInitialisation) {
  const std::string dir = tessera::testing::fresh_dir("init-nonstrict");
  const std::string config = write_config(dir);
  ASSERT_EQ(run_tessera("fit --config " + config + kNoDropout + " --set trainer.max_steps=2").exit_code, 0);
  const std::string file = run_dir(dir) + "/checkpoints/last.ckpt";
  const std::string sharded_root = dir + "/sharded";
  auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=2 --set launch.devices=2 --set "
                       "strategy.plugin=fsdp --set data.batch_size=2 --set strategy.state_dict_type=sharded --set "
                       "checkpoint_io.plugin=distributed --set trainer.default_root_dir=" + sharded_root);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string folder = run_dir(sharded_root) + "/checkpoints/last";
  ASSERT_EQ(run_tessera("checkpoint export " + folder + " --to " + dir + "/folder.ckpt").exit_code, 0);
  std::map<std::string, std::map<std::string, at::Tensor>> pretrained = {
      {file, tessera::testing::checkpoint_state(file)}, {folder, tessera::testing::checkpoint_state(dir + "/folder.ckpt")}};
  // One step at lr 0 saves the weights the run started from.
  const std::string bigger = kNoDropout + " --set model.n_layer=3 --set model.block_size=64 --set optimizer.lr=0.0 " +
                             "--set trainer.max_steps=1";
  const std::string fresh_root = dir + "/fresh";
  ASSERT_EQ(run_tessera("fit --config " + config + bigger + " --set trainer.default_root_dir=" + fresh_root).exit_code, 0);
  const auto fresh = tessera::testing::checkpoint_state(run_dir(fresh_root) + "/checkpoints/last.ckpt");

  const std::string nonstrict = bigger + " --set trainer.init_from_strict=false ";
  struct Run {
    std::string from, sets;
  };
  for (const Run& run : {Run{file, "--set data.batch_size=6"},
                         Run{folder, "--set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=2"},
                         Run{folder, "--set launch.devices=2 --set strategy.plugin=fsdp2 "
                                     "--set strategy.tensor_parallel_size=2 --set data.batch_size=2"},
                         Run{file, "--set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=3"}}) {
    const std::string root = tessera::testing::fresh_dir("init-nonstrict-run");
    r = run_tessera("fit --config " + config + nonstrict + run.sets + " --set trainer.init_from=" + run.from +
                    " --set trainer.default_root_dir=" + root);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("[trainer] init_from_strict = false: 27 of the model's 40 tensors loaded from " + run.from +
                            "; keeping their initialisation: wpe.weight (the file's [32, 32], the model's [64, 32]), "
                            "blocks.2.attn.bias (not in the file)"),
              std::string::npos) << r.output;
    const auto started = tessera::testing::checkpoint_state(run_dir(root) + "/checkpoints/last.ckpt");
    ASSERT_EQ(started.size(), fresh.size()) << run.sets;
    const auto& loaded = pretrained.at(run.from);
    for (const auto& [name, value] : started) {
      const bool from_file = loaded.count(name) && loaded.at(name).sizes() == value.sizes();
      EXPECT_TRUE(at::equal(value, from_file ? loaded.at(name) : fresh.at(name))) << run.sets << ": " << name;
    }
  }
  // Strict (the default) names the way on; a file of which nothing matches is refused.
  r = run_tessera("fit --config " + config + bigger + " --set trainer.init_from=" + file +
                  " --set trainer.default_root_dir=" + dir + "/strict");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[trainer] init_from_strict = false loads the tensors that match by name and shape"),
            std::string::npos) << r.output;
  r = run_tessera("fit --config " + config + nonstrict + " --set model.n_embd=48 --set trainer.init_from=" + file +
                  " --set trainer.default_root_dir=" + dir + "/none");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("none of its 28 tensors has the name and shape of one of model 'gpt' (40 tensors)"),
            std::string::npos) << r.output;
  r = run_tessera("fit --config " + config + " --set trainer.init_from_strict=false");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("init_from_strict is set but no [trainer] init_from is"), std::string::npos) << r.output;
}

TEST(InitFrom, WhatCannotStartARunIsRefusedBeforeWork) {
  const std::string dir = tessera::testing::fresh_dir("init-bad");
  const std::string config = write_config(dir);
  const std::string two = " --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2";
  auto r = run_tessera("fit --config " + config + two + " --set trainer.init_from=" + dir + "/nope.ckpt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[trainer] init_from = \"" + dir + "/nope.ckpt\" does not exist"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << "refused before any rank starts\n" << r.output;
  r = run_tessera("fit --config " + config + two + " --set trainer.init_from=" + config);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(config + " is not a checkpoint"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << "refused before any rank starts\n" << r.output;

  ASSERT_EQ(run_tessera("fit --config " + config + " --set trainer.max_steps=2").exit_code, 0);
  const std::string weights = dir + "/weights.safetensors";
  ASSERT_EQ(run_tessera("checkpoint export " + run_dir(dir) + "/checkpoints/last.ckpt --to " + weights).exit_code, 0);
  // Another model: named tensors and shapes, before any step and without a run folder.
  const std::string other = tessera::testing::fresh_dir("init-bad-shapes");
  r = run_tessera("fit --config " + config + two + " --set model.n_embd=48 --set trainer.default_root_dir=" + other +
                  " --set trainer.init_from=" + weights);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("the checkpoint was written for a different model configuration"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << r.output;
  // Its folder holds the attempt's rank logs only (issue 46: they explain the failure), no records.
  EXPECT_FALSE(fs::exists(other + "/version_0/config.toml")) << "a run that failed to load its weights wrote records";
  // Weights only: fit cannot resume from them, and says how to start from them instead.
  r = run_tessera("fit --config " + config + " --ckpt-path " + weights);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("holds the weights only (a state dict or safetensors file, no trainer state)"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("start a new run from its weights with [trainer] init_from"), std::string::npos) << r.output;
  r = run_tessera("validate --config " + config);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("validate needs --ckpt-path last|best|PATH or [trainer] init_from"), std::string::npos)
      << r.output;
}

}  // namespace
