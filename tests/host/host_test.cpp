// End-to-end behaviour of the `tessera` binary: exact resume (also across strategies and
// world sizes), checkpoint contents, predict, bad input, and failing ranks.
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

namespace {

namespace fs = std::filesystem;
using tessera::testing::metric_series;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;

/// `metric` over every run folder under `root` (version_0, version_1, ...): a resumed run
/// continues in a new folder, and its values replace the old ones from where it resumed.
std::map<std::int64_t, double> all_runs(const std::string& root, const std::string& stage, const std::string& metric) {
  std::map<std::int64_t, double> out;
  for (int v = 0; fs::exists(root + "/version_" + std::to_string(v)); ++v)
    for (const auto& [step, value] : metric_series(root + "/version_" + std::to_string(v) + "/metrics.csv", stage, metric))
      out[step] = value;
  return out;
}

/// A small GPT run on fortunes; `extra` is appended to the config.
std::string write_config(const std::string& dir, const std::string& extra = "") {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 8\nlog_every_n_steps = 1\nseed = 3\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "checkpoint_every_n_steps = 4\n"
                                   << "[optimizer]\nname = \"adamw\"\nlr = 0.003\nwarmup_steps = 2\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\n"
                                   << "block_size = 32\ndropout = 0.1\nmax_new_tokens = 20\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 32\nbatch_size = 4\n"
                                   << "prompt = \"Q: \"\n"
                                   << extra;
  return dir + "/run.toml";
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// write_config without its checkpoint_every_n_steps: for a [callbacks.model_checkpoint] of the
/// test's own in `extra` (fit refuses both), or a run with only the trainer's default saves.
std::string write_config_own_checkpoints(const std::string& dir, const std::string& extra = "") {
  std::string config = write_config(dir, extra);
  std::string text = file_bytes(config);
  const std::string key = "checkpoint_every_n_steps = 4\n";
  text.erase(text.find(key), key.size());
  std::ofstream(config) << text;
  return config;
}

void expect_losses_equal(const std::map<std::int64_t, double>& a, const std::map<std::int64_t, double>& b,
                         std::int64_t from, std::int64_t to, double tol) {
  for (std::int64_t step = from; step <= to; ++step) {
    ASSERT_TRUE(a.count(step) && b.count(step)) << "no loss logged at step " << step;
    EXPECT_NEAR(a.at(step), b.at(step), tol) << "step " << step;
  }
}

/// An uninterrupted run, and the same run killed at step 6 and resumed from its step-4
/// checkpoint with --ckpt-path (possibly under another strategy / world size with the same
/// global batch; `through` may hand over another file made from it). The resumed losses
/// (steps 5-8) must equal the uninterrupted ones.
void check_resume(const std::string& name, const std::string& first_sets, const std::string& resume_sets, double tol,
                  const std::function<std::string(const std::string&)>& through = nullptr) {
  std::string full = tessera::testing::fresh_dir(name + "-full");
  auto a = run_tessera("fit --config " + write_config(full) + " " + first_sets);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  std::string part = tessera::testing::fresh_dir(name + "-part");
  auto b = run_tessera("fit --config " + write_config(part) + " " + first_sets, "TESSERA_FAULT_INJECT=rank=0,step=6,kind=kill");
  ASSERT_NE(b.exit_code, 0) << b.output;
  // save_last writes last.ckpt beside each checkpoint (as Lightning): the killed run's is step 4's.
  auto last = tessera::core::checkpoint_dict(tessera::core::load_pickle(run_dir(part) + "/checkpoints/last.ckpt"), "last");
  ASSERT_EQ(last.at("global_step").toInt(), 4);
  std::string from = run_dir(part) + "/checkpoints/step=4.ckpt";
  if (through) from = through(from);
  if (from.empty()) return;  // `through` failed (and said so)
  auto c = run_tessera("fit --config " + part + "/run.toml --ckpt-path " + from + " " + resume_sets);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("resuming at step 4"), std::string::npos) << c.output;
  expect_losses_equal(metric_series(run_dir(full) + "/metrics.csv", "train", "train_loss"),
                      all_runs(part, "train", "train_loss"), 1, 8, tol);
}

TEST(Resume, SingleDeviceResumesExactly) { check_resume("resume-single", "", "", 1e-6); }

TEST(Resume, AcrossAnEpochEndWithAccumulationClippingAndValidation) {
  // A corpus of ~35 training windows: 8 batches of 4 = 4 optimizer steps per epoch with
  // accumulate_grad_batches = 2, so step=4.ckpt is written at the end of epoch 0, before
  // its validation; the resumed run must validate, reshuffle for epoch 1 and go on alike.
  std::string corpus = tessera::testing::fresh_dir("resume-epoch-corpus") + "/corpus.txt";
  {
    std::ofstream out(corpus);
    for (int i = 0; out.tellp() < 1200; ++i) out << "line " << i << ": the quick brown fox jumps over the lazy dog\n";
  }
  const std::string sets = "--set data.path=" + corpus + " --set trainer.max_steps=10 --set trainer.max_epochs=5" +
                           " --set trainer.accumulate_grad_batches=2 --set trainer.gradient_clip_val=0.5" +
                           " --set trainer.val_check_interval=0";
  std::string full = tessera::testing::fresh_dir("resume-epoch-full");
  auto a = run_tessera("fit --config " + write_config(full) + " " + sets);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_NE(a.output.find("validation after epoch 1"), std::string::npos) << "expected several epochs\n" << a.output;
  std::string part = tessera::testing::fresh_dir("resume-epoch-part");
  auto b = run_tessera("fit --config " + write_config(part) + " " + sets, "TESSERA_FAULT_INJECT=rank=0,step=6,kind=kill");
  ASSERT_NE(b.exit_code, 0) << b.output;
  auto c = run_tessera("fit --config " + part + "/run.toml --ckpt-path " + run_dir(part) + "/checkpoints/step=4.ckpt " + sets);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  expect_losses_equal(metric_series(run_dir(full) + "/metrics.csv", "train", "train_loss"),
                      all_runs(part, "train", "train_loss"), 1, 10, 1e-6);
  auto val_full = metric_series(run_dir(full) + "/metrics.csv", "val", "val_loss");
  auto val_part = all_runs(part, "val", "val_loss");
  ASSERT_FALSE(val_full.empty());
  EXPECT_EQ(val_full.size(), val_part.size());
  for (const auto& [step, loss] : val_full) EXPECT_NEAR(val_part[step], loss, 1e-6) << "validation at step " << step;
}

TEST(Resume, FSDPTwoRanksResumesExactly) {
  check_resume("resume-fsdp", "--set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2",
               "--set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2", 1e-5);
}

TEST(Resume, FSDPCheckpointReshardsToThreeRanks) {
  // Global batch 12 on 2 ranks (6 each) and on 3 ranks (4 each): the resumed run continues
  // the 2-rank run's losses although every shard changed shape.
  // No dropout: its masks depend on how the batch is split over ranks.
  check_resume("reshard-3", "--set model.dropout=0.0 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=6",
               "--set model.dropout=0.0 --set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=4", 1e-4);
}

TEST(Resume, FSDPCheckpointLoadsIntoSingleDevice) {
  check_resume("fsdp-to-single", "--set model.dropout=0.0 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2",
               "--set model.dropout=0.0 --set data.batch_size=4", 1e-4);
}

TEST(Resume, SingleDeviceCheckpointLoadsIntoFSDP) {
  check_resume("single-to-fsdp", "--set model.dropout=0.0",
               "--set model.dropout=0.0 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2", 1e-4);
}

// The GPT with weight_decay_norms_and_biases = false builds two param groups in another order
// than its parameters (matrices first, then biases and LayerNorms): every strategy must save
// each moment under its own parameter's name, or a resume elsewhere mixes them up.
const std::string kTwoParamGroups =
    "--set model.dropout=0.0 --set model.weight_decay_norms_and_biases=false --set optimizer.weight_decay=0.1 ";

TEST(Resume, TwoParamGroupsFromFSDPIntoSingleDevice) {
  check_resume("groups-fsdp-to-single", kTwoParamGroups + "--set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2",
               kTwoParamGroups + "--set data.batch_size=4", 1e-4);
}

TEST(Resume, TwoParamGroupsFromSingleDeviceIntoFSDP2OnThreeRanks) {
  check_resume("groups-single-to-fsdp2", kTwoParamGroups + "--set data.batch_size=6",
               kTwoParamGroups + "--set launch.devices=3 --set strategy.plugin=fsdp2 --set data.batch_size=2", 1e-4);
}

TEST(Checkpoint, TwoParamGroupsReadInPythonMatchTheirParameters) {
  if (!fs::exists("/usr/bin/python3") || std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed: torch.load compatibility not checked";
  std::string dir = tessera::testing::fresh_dir("groups-pyload");
  auto r = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=2 " + kTwoParamGroups +
                       "--set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Each moment has its named parameter's shape; the second group (weight decay 0) holds exactly
  // the biases and LayerNorm weights, and every parameter is in one group.
  std::string command =
      "/usr/bin/python3 -c \"import sys; sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "'); "
      "from safe_torch_load import load; c = load('" + run_dir(dir) + "/checkpoints/last.ckpt'); "
      "o = c['optimizer_states'][0]; names = o['param_names']; sd = c['state_dict']; "
      "assert all(s['exp_avg'].shape == sd[names[i]].shape for i, s in o['state'].items()); "
      "g0, g1 = o['param_groups']; assert g0['weight_decay'] == 0.1 and g1['weight_decay'] == 0.0; "
      "plain = lambda n: n.endswith('.bias') or 'ln_' in n; "
      "assert all(plain(names[i]) for i in g1['params']) and not any(plain(names[i]) for i in g0['params']); "
      "assert sorted(g0['params'] + g1['params']) == list(range(len(sd))); print('ok')\"";
  EXPECT_EQ(std::system(command.c_str()), 0);
}

TEST(Checkpoint, HasTheDocumentedKeysAndFullShapes) {
  std::string dir = tessera::testing::fresh_dir("keys");
  auto r = run_tessera("fit --config " + write_config(dir) +
                       " --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(run_dir(dir) + "/checkpoints/step=4.ckpt"));
  auto checkpoint = tessera::core::checkpoint_dict(tessera::core::load_pickle(run_dir(dir) + "/checkpoints/last.ckpt"), "last");
  for (const char* key : {"state_dict", "optimizer_states", "precision_plugin", "global_step", "epoch",
                          "batch_in_epoch", "lr_schedulers", "rng_state", "hyper_parameters", "tessera_version"})
    EXPECT_TRUE(checkpoint.contains(key)) << key;
  EXPECT_EQ(checkpoint.at("global_step").toInt(), 8);
  auto state = tessera::testing::checkpoint_state(run_dir(dir) + "/checkpoints/last.ckpt");
  EXPECT_EQ(state.at("wte.weight").sizes(), (std::vector<std::int64_t>{256, 32}));  // full, not a shard
  EXPECT_EQ(state.at("blocks.1.fc.weight").sizes(), (std::vector<std::int64_t>{128, 32}));
  auto optimizer = tessera::core::checkpoint_dict(checkpoint.at("optimizer_states").toListRef()[0], "optimizer");
  EXPECT_EQ(optimizer.at("param_names").toListRef().size(), state.size());
}

TEST(Checkpoint, PythonTorchLoadReadsIt) {
  if (!fs::exists("/usr/bin/python3") || std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed: torch.load compatibility not checked";
  std::string dir = tessera::testing::fresh_dir("pyload");
  auto r = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string command = "/usr/bin/python3 -c \"import sys; sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "'); "
                        "from safe_torch_load import load; c = load('" + run_dir(dir) +
                        "/checkpoints/last.ckpt'); assert c['global_step'] == 2; "
                        "assert tuple(c['state_dict']['wte.weight'].shape) == (256, 32); print('ok')\"";
  EXPECT_EQ(std::system(command.c_str()), 0);
  // A weights-only one (model_checkpoint save_weights_only) too.
  const std::string weights_dir = tessera::testing::fresh_dir("pyload-weights");
  r = run_tessera("fit --config " +
                  write_config_own_checkpoints(weights_dir, "[callbacks.model_checkpoint]\nevery_n_train_steps = 2\n"
                                                            "save_weights_only = true\n") +
                  " --set trainer.max_steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  command = "/usr/bin/python3 -c \"import sys; sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "'); "
            "from safe_torch_load import load; c = load('" + run_dir(weights_dir) +
            "/checkpoints/step=2.ckpt'); assert c['weights_only'] and 'optimizer_states' not in c; "
            "assert tuple(c['state_dict']['wte.weight'].shape) == (256, 32); print('ok')\"";
  EXPECT_EQ(std::system(command.c_str()), 0);
}

TEST(Checkpoint, ResavedByPythonResumesExactly) {
  // A user loads a checkpoint in Python (PyTorch's safe unpickler) and saves it again with
  // torch.save: Tessera reads Python's pickle (untyped lists, Python's own records) and resumes.
  if (!fs::exists("/usr/bin/python3") || std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed: no Python to re-save with";
  check_resume("python-resaved", "", "", 1e-6, [](const std::string& path) {
    const std::string resaved = path + ".resaved.pt";
    const std::string command = "/usr/bin/python3 -c \"import sys, torch; sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR
                                "'); from safe_torch_load import load; torch.save(load(sys.argv[1]), sys.argv[2])\" " +
                                path + " " + resaved;
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    return fs::exists(resaved) ? resaved : std::string();
  });
}

// [trainer] init_from: a new run starts from another run's weights (fine-tuning) with a fresh
// optimizer, schedule and step, from any format into any strategy and world size.
const std::string kNoDropout = " --set model.dropout=0.0";

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

/// lr_find.csv as columns: "step", "lr", "loss", "smoothed_loss" -> one value per row.
std::map<std::string, std::vector<double>> read_lr_find(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "step,lr,loss,smoothed_loss") << path;
  std::map<std::string, std::vector<double>> columns;
  while (std::getline(in, line)) {
    std::stringstream row(line);
    std::string cell;
    for (const char* name : {"step", "lr", "loss", "smoothed_loss"}) {
      std::getline(row, cell, ',');
      columns[name].push_back(std::stod(cell));
    }
  }
  return columns;
}

// tessera lr-find (Lightning's Tuner.lr_find): the same global batch gives one device's loss
// curve and suggestion under fsdp, ddp and fsdp2 with tensor parallelism; a diverging loss
// stops the test early; nothing is saved and no callback runs; init_from sets its start.
TEST(LrFind, EveryStrategyTracesTheOneDeviceCurveAndSuggestsTheSameLr) {
  const std::string dir = tessera::testing::fresh_dir("lr-find");
  const std::string config = write_config(dir, "[lr_find]\nnum_training = 24\nmin_lr = 1e-5\nmax_lr = 0.05\n");
  const std::string common = " --set model.dropout=0.0 --set data.shuffle=false";
  std::map<std::string, std::map<std::string, std::vector<double>>> curves;
  std::map<std::string, std::string> suggested;
  int version = 0;
  for (const auto& [name, sets] : std::vector<std::pair<std::string, std::string>>{
           {"one", " --set data.batch_size=6"},
           {"fsdp-3", " --set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=2"},
           {"ddp-2", " --set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=3"},
           {"fsdp2-tp2", " --set launch.devices=2 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2 "
                         "--set data.batch_size=6"}}) {
    auto r = run_tessera("lr-find --config " + config + common + sets);
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    const std::string run = dir + "/version_" + std::to_string(version++);
    EXPECT_NE(r.output.find("tessera lr-find: strategy"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("lr-find: 24 optimizer steps of 6 samples"), std::string::npos) << name << "\n" << r.output;
    const auto at = r.output.find("lr-find: suggested lr ");
    ASSERT_NE(at, std::string::npos) << name << "\n" << r.output;
    suggested[name] = r.output.substr(at, r.output.find(' ', at + 22) - at);
    EXPECT_NE(r.output.find("the curve: " + run + "/lr_find.csv"), std::string::npos) << r.output;
    curves[name] = read_lr_find(run + "/lr_find.csv");
    EXPECT_FALSE(fs::exists(run + "/checkpoints")) << name << ": lr-find saved a checkpoint";
    ASSERT_EQ(curves[name]["lr"].size(), 24u) << name;
    EXPECT_NEAR(curves[name]["lr"].front(), 1e-5, 1e-12);
    EXPECT_NEAR(curves[name]["lr"].back(), 0.05, 1e-9);
    for (std::size_t i = 0; i < 24; ++i) {
      EXPECT_NEAR(curves[name]["lr"][i], curves["one"]["lr"][i], 1e-9 * curves["one"]["lr"][i]) << name << " step " << i;
      EXPECT_NEAR(curves[name]["loss"][i], curves["one"]["loss"][i], 1e-4) << name << " step " << i;
    }
    EXPECT_EQ(suggested[name], suggested["one"]) << name;
  }
  // The loss falls over the range on this model: the test trained.
  EXPECT_LT(curves["one"]["loss"].back(), curves["one"]["loss"].front() - 0.5);

  // A learning rate far too high diverges: the test stops early and says why.
  auto r = run_tessera("lr-find --config " + config + common + " --set lr_find.max_lr=1000 --set lr_find.num_training=60");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(diverged)"), std::string::npos) << r.output;
  const auto diverged = read_lr_find(dir + "/version_" + std::to_string(version++) + "/lr_find.csv");
  EXPECT_LT(diverged.at("step").size(), 60u);

  // From a trained checkpoint's weights ([trainer] init_from), the curve starts lower.
  ASSERT_EQ(run_tessera("fit --config " + config + common + " --set trainer.max_steps=8").exit_code, 0);
  const std::string trained = dir + "/version_" + std::to_string(version++) + "/checkpoints/last.ckpt";
  r = run_tessera("lr-find --config " + config + common + " --set data.batch_size=6 --set trainer.init_from=\"" +
                  trained + "\"");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("weights initialized from " + trained), std::string::npos) << r.output;
  const auto from_trained = read_lr_find(dir + "/version_" + std::to_string(version++) + "/lr_find.csv");
  EXPECT_LT(from_trained.at("loss").front(), curves["one"]["loss"].front() - 0.3);

  // A Ctrl-C (on rank 1 of 2) ends the test at that step: the curve so far is written, and both
  // ranks exit 128 + SIGINT (the step's all-reduce carries the signal), as fit does.
  r = run_tessera("lr-find --config " + config + common + " --set launch.devices=2 --set strategy.plugin=fsdp",
                  "TESSERA_FAULT_INJECT=rank=1,step=5,kind=sigint");
  EXPECT_EQ(r.exit_code, 130) << r.output;
  EXPECT_NE(r.output.find("lr-find: interrupted after step 5 of 24"), std::string::npos) << r.output;
  EXPECT_EQ(read_lr_find(dir + "/version_" + std::to_string(version++) + "/lr_find.csv").at("step").size(), 5u);

  // What does not apply is refused before any rank starts.
  r = run_tessera("lr-find --config " + config + " --ckpt-path last");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("--ckpt-path does not apply to `tessera lr-find`: to test learning rates from a checkpoint's "
                          "weights, set [trainer] init_from"), std::string::npos) << r.output;
  r = run_tessera("lr-find --config " + config + " --set trainer.fast_dev_run=true");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("[trainer] fast_dev_run runs every loop"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/version_" + std::to_string(version))) << "a refused lr-find left a run folder";
}

// [lr_find] before_fit (Lightning's LearningRateFinder): fit runs the range test, restores the
// weights, optimizer, grad scaler and RNG it started from, and trains exactly as a run started
// with the suggested lr (dropout on: the RNG is restored too); under fsdp as on one device.
TEST(LrFind, BeforeFitTrainsExactlyAsARunStartedWithTheSuggestedLr) {
  const std::string dir = tessera::testing::fresh_dir("lr-find-fit");
  const std::string config =
      write_config(dir, "[lr_find]\nnum_training = 24\nmin_lr = 1e-5\nmax_lr = 0.05\nbefore_fit = true\n");
  auto suggested_lr = [](const std::string& output) {
    const std::string head = "[lr_find] before_fit: fit trains with lr ";
    const auto at = output.find(head);
    return at == std::string::npos ? std::string() : output.substr(at + head.size(), output.find(' ', at + head.size()) - at - head.size());
  };
  int version = 0;
  for (const auto& [name, sets] : std::vector<std::pair<std::string, std::string>>{
           {"one, dropout", " --set data.batch_size=6"},
           {"fsdp-3", " --set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=2 --set model.dropout=0.0"}}) {
    auto tuned = run_tessera("fit --config " + config + sets);
    ASSERT_EQ(tuned.exit_code, 0) << name << "\n" << tuned.output;
    const std::string lr = suggested_lr(tuned.output);
    ASSERT_FALSE(lr.empty()) << name << "\n" << tuned.output;
    const std::string tuned_run = dir + "/version_" + std::to_string(version++);
    EXPECT_TRUE(fs::exists(tuned_run + "/lr_find.csv")) << name;
    EXPECT_FALSE(fs::exists(tuned_run + "/lr_find_start.ckpt")) << name << ": the test's start was left behind";
    EXPECT_TRUE(fs::exists(tuned_run + "/checkpoints/step=4.ckpt")) << name;
    auto plain = run_tessera("fit --config " + config + " --set lr_find.before_fit=false --set optimizer.lr=" + lr +
                             " --set data.batch_size=6" + (name == "fsdp-3" ? " --set model.dropout=0.0" : ""));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    const std::string plain_run = dir + "/version_" + std::to_string(version++);
    const auto expected = metric_series(plain_run + "/metrics.csv", "train", "train_loss");
    const auto found = metric_series(tuned_run + "/metrics.csv", "train", "train_loss");
    ASSERT_EQ(found.size(), 8u) << name << ": the test's steps are not fit's (nothing of them is logged)";
    ASSERT_EQ(expected.size(), 8u);
    const double tolerance = name == "fsdp-3" ? 2e-4 : 0.0;  // one device against itself: bitwise
    expect_losses_equal(found, expected, 1, 8, tolerance);
  }
  // Resuming keeps the run's learning rate: no test.
  auto resumed = run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=10");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("[lr_find] before_fit is not applied: resuming from"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("lr-find: "), std::string::npos) << resumed.output;
  // A Ctrl-C during the test ends it; fit keeps its lr, stops after its first step and saves.
  auto interrupted = run_tessera("fit --config " + config, "TESSERA_FAULT_INJECT=rank=0,step=5,kind=sigint");
  EXPECT_EQ(interrupted.exit_code, 130) << interrupted.output;
  EXPECT_NE(interrupted.output.find("lr-find: interrupted after step 5 of 24"), std::string::npos) << interrupted.output;
  EXPECT_NE(interrupted.output.find("[lr_find] before_fit: fit keeps [optimizer] lr = 0.003"), std::string::npos)
      << interrupted.output;
  EXPECT_NE(interrupted.output.find("at step 1: checkpoint saved to"), std::string::npos) << interrupted.output;
}

// tessera config: every key the host and the selected plugins read, the set ones as set and each
// default commented out, for any plugin (fsdp's keys after --set strategy.plugin=fsdp, a
// callback's, a sub-table's); the listing is itself an equivalent config (it lists itself, and
// trains as the original).
TEST(ConfigListing, EveryKeyWithItsDefaultAndTheListingIsAnEquivalentConfig) {
  const std::string dir = tessera::testing::fresh_dir("config-listing");
  const std::string config = write_config(dir, "[callbacks.early_stopping]\nmonitor = \"val_loss\"\n");
  auto r = run_tessera("config --config " + config + " --set strategy.plugin=fsdp --set optimizer.lr=3e-4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string listing = r.output;
  for (const char* line : {"\nlog_every_n_steps = 1\nmax_steps = 8\n", "\nlr = 3e-04\n",
                           "\n# accumulate_grad_batches = 1\n", "\n# limit_train_batches = 1.0\n",
                           "\n[strategy]\nplugin = \"fsdp\"\n", "\n# sharding_strategy = \"FULL_SHARD\"\n",
                           "\n# limit_all_gathers = true\n", "\n# tie_embeddings = true\n",
                           "\n[callbacks.early_stopping]\nmonitor = \"val_loss\"\n", "\n# patience = 3\n",
                           "\n[lr_find]\n# before_fit = false\n", "\n# init_scale = 65536.0\n"})
    EXPECT_NE(listing.find(line), std::string::npos) << "no '" << line << "' in:\n" << listing;
  // The trainer's own checkpoint callback (from [trainer]'s keys) adds none of its keys to [trainer].
  const std::size_t trainer_at = listing.find("\n[trainer]\n");
  const std::string trainer = listing.substr(trainer_at, listing.find("\n[", trainer_at + 1) - trainer_at);
  for (const char* key : {"# monitor", "# save_top_k", "# every_n_train_steps"})
    EXPECT_EQ(trainer.find(key), std::string::npos) << key << " in:\n" << trainer;
  // fsdp2's "auto" keys and sub-table, noted by the plugin itself.
  r = run_tessera("config --config " + config + " --set strategy.plugin=fsdp2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\n# tensor_parallel_size = \"auto\"\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\n[strategy.mp_policy]\n# cast_forward_inputs = true\n"), std::string::npos) << r.output;
  // The listing as a config: it lists itself, and a run from it trains as one from the original.
  std::ofstream(dir + "/listed.toml") << listing;
  r = run_tessera("config --config " + dir + "/listed.toml");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.substr(r.output.find('\n')), listing.substr(listing.find('\n')));
  ASSERT_EQ(run_tessera("fit --config " + config + " --set strategy.plugin=fsdp --set optimizer.lr=3e-4 --set "
                        "trainer.max_steps=3").exit_code, 0);
  ASSERT_EQ(run_tessera("fit --config " + dir + "/listed.toml --set trainer.max_steps=3").exit_code, 0);
  expect_losses_equal(metric_series(dir + "/version_1/metrics.csv", "train", "train_loss"),
                      metric_series(dir + "/version_0/metrics.csv", "train", "train_loss"), 1, 3, 0.0);
  // Errors name the key as for any command.
  r = run_tessera("config --config " + config + " --set trainer.max_stepz=3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("(did you mean 'max_steps'?)"), std::string::npos) << r.output;
}

// Every default the listing shows is a valid setting: with each "# key = value" line uncommented
// the config is accepted, lists every key as set, and trains as the original. Keys that do not
// apply under the other settings are not listed (check_val_every_n_epoch beside a step count
// for val_check_interval, init_from_strict without init_from, the clipping keys without
// clipping, [trainer]'s checkpoint keys beside a model_checkpoint callback), and a default that
// means "not set" can be written (early_stopping's divergence_threshold = nan).
TEST(ConfigListing, EveryListedDefaultUncommentedIsAcceptedAndTrainsTheSame) {
  const std::string dir = tessera::testing::fresh_dir("config-defaults");
  const std::string callbacks =
      "[callbacks.early_stopping]\nmonitor = \"val_loss\"\n[callbacks.lr_monitor]\n"
      "[callbacks.best]\nplugin = \"model_checkpoint\"\nmonitor = \"val_loss\"\n";
  const std::vector<std::string> variants = {
      " --set strategy.plugin=fsdp --set trainer.val_check_interval=4",
      " --set strategy.plugin=fsdp2 --set launch.devices=2 --set trainer.gradient_clip_val=1.0",
      " --set strategy.plugin=ddp --set launch.devices=2 --set trainer.gradient_clip_val=0.5 "
      "--set trainer.gradient_clip_algorithm=value --set trainer.val_check_interval=0.5"};
  int version = 0;
  for (std::size_t v = 0; v < variants.size(); ++v) {
    const std::string config = write_config_own_checkpoints(dir, callbacks);
    auto r = run_tessera("config --config " + config + variants[v]);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    // The listing with its "# key = default" lines uncommented, and how many there were.
    auto uncomment = [](const std::string& listing) {
      std::pair<std::string, std::size_t> out;
      std::istringstream lines(listing);
      for (std::string line; std::getline(lines, line);) {
        const bool commented_key = line.rfind("# ", 0) == 0 && line.find(" = ") != std::string::npos;
        out.second += commented_key;
        out.first += (commented_key ? line.substr(2) : line) + "\n";
      }
      return out;
    };
    const std::string listing = r.output;
    const auto [uncommented, defaults] = uncomment(listing);
    EXPECT_GT(defaults, 50u) << listing;
    const std::size_t trainer_at = listing.find("[trainer]\n");
    const std::string trainer = listing.substr(trainer_at, listing.find("\n[", trainer_at) - trainer_at);
    std::vector<std::string> absent = {"init_from_strict", "save_last", "checkpoint_every_n_steps"};
    if (v == 0) absent.insert(absent.end(), {"check_val_every_n_epoch", "gradient_clip_algorithm", "norm_type"});
    if (v == 2) absent.push_back("norm_type");  // clipping by value
    for (const std::string& key : absent)
      EXPECT_EQ(trainer.find("\n# " + key + " = "), std::string::npos) << key << " listed in:\n" << trainer;
    EXPECT_NE(listing.find("\n# divergence_threshold = nan\n"), std::string::npos) << listing;
    const std::string all_set = dir + "/all-set-" + std::to_string(v) + ".toml";
    std::ofstream(all_set) << uncommented;
    r = run_tessera("config --config " + all_set);
    ASSERT_EQ(r.exit_code, 0) << uncommented << "\n" << r.output;
    EXPECT_EQ(uncomment(r.output).second, 0u) << "a default is still listed as unset:\n" << r.output;
    ASSERT_EQ(run_tessera("fit --config " + config + variants[v] + " --set trainer.max_steps=3").exit_code, 0);
    ASSERT_EQ(run_tessera("fit --config " + all_set + " --set trainer.max_steps=3").exit_code, 0);
    expect_losses_equal(metric_series(dir + "/version_" + std::to_string(version + 1) + "/metrics.csv", "train", "train_loss"),
                        metric_series(dir + "/version_" + std::to_string(version) + "/metrics.csv", "train", "train_loss"),
                        1, 3, 0.0);
    version += 2;
  }
}

// Weight averaging (Lightning's WeightAveraging / EMAWeightAveraging, which Lightning refuses
// under sharding): each rank averages its own shards, so every strategy validates on and saves
// the average one device computes on the same global batch.
namespace weight_averaging {

namespace sdk = tessera::sdk;

const std::string kEma = "[callbacks.ema]\nplugin = \"ema_weight_averaging\"\ndecay = 0.5\n";
const std::string kValidate = " --set trainer.val_check_interval=2 --set trainer.limit_val_batches=2 --set model.dropout=0.0";

sdk::StateDict saved(const std::string& file, const std::string& key) {
  auto c = tessera::core::checkpoint_dict(tessera::core::load_pickle(file), file);
  return tessera::core::state_dict_from(c.at(key), file + " [" + key + "]");
}

void expect_state_near(const sdk::StateDict& a, const sdk::StateDict& b, double tol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& item : a) {
    ASSERT_TRUE(b.contains(item.key())) << what << ": " << item.key();
    EXPECT_LE((item.value() - b[item.key()]).abs().max().item<double>(), tol) << what << ": " << item.key();
  }
}

}  // namespace weight_averaging

TEST(WeightAveraging, EveryStrategyValidatesAndSavesTheOneDeviceAverage) {
  using namespace weight_averaging;
  namespace sdk = tessera::sdk;
  auto fit = [](const std::string& name, const std::string& extra, const std::string& sets) {
    const std::string dir = tessera::testing::fresh_dir("wa-" + name);
    auto r = run_tessera("fit --config " + write_config(dir, extra) + kValidate + sets);
    EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("weight averaging: the model now holds the average of 8 updates"), std::string::npos)
        << name << "\n" << r.output;
    return run_dir(dir);
  };
  const std::string one = fit("one", kEma, " --set data.batch_size=12");
  const auto one_val = metric_series(one + "/metrics.csv", "val", "val_loss");
  ASSERT_EQ(one_val.size(), 4u);
  const auto one_average = saved(one + "/checkpoints/last.ckpt", "state_dict");
  const auto one_current = saved(one + "/checkpoints/last.ckpt", "current_model_state");
  for (const auto& [name, sets] : std::vector<std::pair<std::string, std::string>>{
           {"fsdp-3", " --set launch.devices=3 --set strategy.plugin=fsdp"},
           {"fsdp2-2", " --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=6"},
           {"ddp-2", " --set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=6"}}) {
    const std::string run = fit(name, kEma, sets);
    expect_losses_equal(metric_series(run + "/metrics.csv", "val", "val_loss"), one_val, 2, 2, 2e-5);
    for (std::int64_t step : {4, 6, 8})
      EXPECT_NEAR(metric_series(run + "/metrics.csv", "val", "val_loss").at(step), one_val.at(step), 2e-5) << name;
    expect_state_near(saved(run + "/checkpoints/last.ckpt", "state_dict"), one_average, 1e-5, name + " average");
    expect_state_near(saved(run + "/checkpoints/last.ckpt", "current_model_state"), one_current, 1e-5, name + " weights");
  }
  // The average is not the weights, and validation saw it: decay 0 (the average is the latest
  // weights) validates exactly as a run without averaging.
  double largest = 0;
  for (const auto& item : one_average) largest = std::max(largest, (item.value() - one_current[item.key()]).abs().max().item<double>());
  EXPECT_GT(largest, 1e-4);
  const std::string plain_dir = tessera::testing::fresh_dir("wa-plain");
  ASSERT_EQ(run_tessera("fit --config " + write_config(plain_dir) + kValidate + " --set data.batch_size=12").exit_code, 0);
  const std::string zero = fit("zero", "[callbacks.ema]\nplugin = \"ema_weight_averaging\"\ndecay = 0.0\n", " --set data.batch_size=12");
  expect_losses_equal(metric_series(zero + "/metrics.csv", "val", "val_loss"),
                      metric_series(run_dir(plain_dir) + "/metrics.csv", "val", "val_loss"), 2, 2, 0.0);
  EXPECT_NE(metric_series(zero + "/metrics.csv", "val", "val_loss").at(8), one_val.at(8));
  // Equal weights (SWA) under fsdp on 3 ranks, against one device.
  const std::string swa = "[callbacks.swa]\nplugin = \"weight_averaging\"\n";
  const std::string swa_one = fit("swa-one", swa, " --set data.batch_size=12");
  const std::string swa_fsdp = fit("swa-fsdp", swa, " --set launch.devices=3 --set strategy.plugin=fsdp");
  for (std::int64_t step : {2, 4, 6, 8})
    EXPECT_NEAR(metric_series(swa_fsdp + "/metrics.csv", "val", "val_loss").at(step),
                metric_series(swa_one + "/metrics.csv", "val", "val_loss").at(step), 2e-5);
  // validate from the checkpoint evaluates the average, as the last validation of fit did.
  auto v = run_tessera("validate --config " + write_config(tessera::testing::fresh_dir("wa-validate")) + kValidate +
                       " --set data.batch_size=12 --ckpt-path " + one + "/checkpoints/last.ckpt");
  ASSERT_EQ(v.exit_code, 0) << v.output;
  std::ostringstream expected;
  expected << "val_loss " << std::setprecision(6) << one_val.at(8);
  EXPECT_NE(v.output.find(expected.str()), std::string::npos) << expected.str() << "\n" << v.output;
}

// The average is torch's AveragedModel's over the weights after each update Lightning's
// should_update allows: computed here from the weights each step's checkpoint saved.
TEST(WeightAveraging, IsTorchsEmaAndEqualAverageOfTheUpdatedWeights) {
  using namespace weight_averaging;
  namespace sdk = tessera::sdk;
  auto run = [](const std::string& name, const std::string& extra) {
    const std::string dir = tessera::testing::fresh_dir("wa-math-" + name);
    const std::string config = write_config_own_checkpoints(dir, extra + "[callbacks.every]\nplugin = \"model_checkpoint\"\n"
                                                                         "every_n_train_steps = 1\nsave_top_k = -1\n");
    auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=4");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::vector<sdk::StateDict> weights, averages;
    for (int step = 1; step <= 4; ++step) {
      const std::string file = run_dir(dir) + "/checkpoints/step=" + std::to_string(step) + ".ckpt";
      weights.push_back(saved(file, "current_model_state"));
      averages.push_back(saved(file, "state_dict"));
    }
    return std::make_pair(weights, averages);
  };
  // EMA from step index 1 (global step 2): the first update copies, then decay x average + (1 - decay) x weights.
  auto [w, avg] = run("ema", "[callbacks.ema]\nplugin = \"ema_weight_averaging\"\ndecay = 0.75\nupdate_starting_at_step = 1\n");
  sdk::StateDict expected;
  for (const auto& item : w[1]) {
    at::Tensor a = item.value().clone();
    a = 0.75 * a + 0.25 * w[2][item.key()];
    a = 0.75 * a + 0.25 * w[3][item.key()];
    expected.insert(item.key(), a);
  }
  expect_state_near(avg[3], expected, 1e-6, "ema");
  expect_state_near(avg[1], w[1], 0.0, "ema's first update copies");
  // Equal weights every second step (step indices 0 and 2: global steps 1 and 3).
  auto [sw, savg] = run("swa", "[callbacks.swa]\nplugin = \"weight_averaging\"\nupdate_every_n_steps = 2\n");
  sdk::StateDict mean;
  for (const auto& item : sw[0]) mean.insert(item.key(), (item.value() + sw[2][item.key()]) / 2);
  expect_state_near(savg[3], mean, 1e-6, "swa");
  expect_state_near(savg[1], sw[0], 0.0, "swa after one update");
  // Bad settings are refused before any work, naming the key.
  const std::string bad = tessera::testing::fresh_dir("wa-bad");
  auto r = run_tessera("fit --config " + write_config(bad, "[callbacks.ema]\nplugin = \"ema_weight_averaging\"\ndecay = 1.5\n"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[callbacks.ema] decay = 1.5 is out of range [0, 1]"), std::string::npos) << r.output;
  r = run_tessera("fit --config " + write_config(bad, "[callbacks.swa]\nplugin = \"weight_averaging\"\ndecay = 0.9\n"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("decay is not a known key"), std::string::npos) << r.output;
  r = run_tessera("fit --config " + write_config(bad, kEma + "[callbacks.swa]\nplugin = \"weight_averaging\"\n"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[callbacks.ema] and [callbacks.swa] both average the weights: keep one"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(bad + "/version_0")) << "a refused run left a run folder";
  // tessera plan counts the average's copy.
  r = run_tessera("plan --config " + write_config(bad, kEma) + " --set strategy.plugin=fsdp --set launch.devices=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("weight average"), std::string::npos) << r.output;
}

// Resuming restores the weights and their average (full and sharded checkpoints; the sharded
// one re-cut for fsdp2 on 2 ranks): the run goes on as if never stopped, and the sharded save
// exports to the full one's bytes.
TEST(WeightAveraging, ResumesExactlyFromFullAndShardedCheckpoints) {
  using namespace weight_averaging;
  namespace sdk = tessera::sdk;
  const std::string fsdp3 = " --set launch.devices=3 --set strategy.plugin=fsdp";
  const std::string sharded = " --set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed";
  std::string full_run;  // the full checkpoints' run, the sharded save's reference
  for (const std::string& io : {std::string(), sharded}) {
    const std::string dir = tessera::testing::fresh_dir(io.empty() ? "wa-resume-full" : "wa-resume-sharded");
    const std::string config = write_config(dir, kEma);
    ASSERT_EQ(run_tessera("fit --config " + config + kValidate + fsdp3 + io).exit_code, 0);
    const std::string whole = run_dir(dir);
    auto resumed = run_tessera("fit --config " + config + kValidate + fsdp3 + io + " --ckpt-path " + whole +
                               "/checkpoints/step=4.ckpt");
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const std::string part = run_dir(dir);
    expect_losses_equal(metric_series(part + "/metrics.csv", "train", "train_loss"),
                        metric_series(whole + "/metrics.csv", "train", "train_loss"), 5, 8, 0.0);
    const auto val = metric_series(part + "/metrics.csv", "val", "val_loss");
    for (std::int64_t step : {6, 8})  // validated on the restored average
      EXPECT_EQ(val.at(step), metric_series(whole + "/metrics.csv", "val", "val_loss").at(step)) << "step " << step;
    if (io.empty()) {
      full_run = whole;
      expect_state_near(saved(part + "/checkpoints/last.ckpt", "state_dict"),
                        saved(whole + "/checkpoints/last.ckpt", "state_dict"), 0.0, "average after resuming");
      // Without the callback, fit goes on from the trained weights: the same training losses.
      const std::string plain = tessera::testing::fresh_dir("wa-resume-plain");
      auto r = run_tessera("fit --config " + write_config(plain) + kValidate + fsdp3 + " --ckpt-path " + whole +
                           "/checkpoints/step=4.ckpt");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("without a weight-averaging callback, fit goes on from the weights"), std::string::npos)
          << r.output;
      expect_losses_equal(metric_series(run_dir(plain) + "/metrics.csv", "train", "train_loss"),
                          metric_series(whole + "/metrics.csv", "train", "train_loss"), 5, 8, 0.0);
      continue;
    }
    auto other = run_tessera("fit --config " + config + kValidate + sharded +
                             " --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=6 --ckpt-path " +
                             whole + "/checkpoints/step=4.ckpt");
    ASSERT_EQ(other.exit_code, 0) << other.output;
    expect_losses_equal(metric_series(run_dir(dir) + "/metrics.csv", "val", "val_loss"),
                        metric_series(whole + "/metrics.csv", "val", "val_loss"), 6, 6, 2e-5);
    const std::string exported = dir + "/exported.ckpt";
    auto e = run_tessera("checkpoint export " + whole + "/checkpoints/step=4.ckpt --to " + exported);
    ASSERT_EQ(e.exit_code, 0) << e.output;
    for (const char* key : {"state_dict", "current_model_state"})
      expect_state_near(saved(exported, key), saved(full_run + "/checkpoints/step=4.ckpt", key), 0.0, key);
  }
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
  int checked = 0;
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
        // this test's business; one that stops at [strategy] must name the leftover keys.
        EXPECT_NE(r.output.find("Remove them from [strategy] to use " + strategy), std::string::npos) << what;
        EXPECT_EQ(r.output.find("must be"), std::string::npos) << what;
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 12);
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

TEST(Failures, AKilledRankEndsTheJobNamingIt) {
  std::string dir = tessera::testing::fresh_dir("kill");
  auto start = std::chrono::steady_clock::now();
  auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=3 --set strategy.plugin=ddp",
                       "TESSERA_FAULT_INJECT=rank=1,step=2,kind=kill", 120);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  EXPECT_LT(seconds, 60) << "the job took too long to stop";
  EXPECT_NE(std::system(("pgrep -f '" + dir + "/run[.]toml' >/dev/null").c_str()), 0) << "a rank outlived the job";
}

TEST(Failures, AHungRankBecomesACollectiveTimeoutReport) {
  std::string dir = tessera::testing::fresh_dir("hang");
  auto r = run_tessera("fit --config " + write_config(dir) +
                           " --set launch.devices=2 --set strategy.plugin=fsdp --set launch.collective_timeout_s=5",
                       "TESSERA_FAULT_INJECT=rank=1,step=2,kind=hang", 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("failed first"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0: reduce timed out after 5 s"), std::string::npos)
      << "the report should say which collective timed out on which rank\n" << r.output;
  EXPECT_NE(std::system(("pgrep -f '" + dir + "/run[.]toml' >/dev/null").c_str()), 0) << "a rank outlived the job";
}

// The binary's malloc is jemalloc (memory on the 1/N line without environment variables):
// jemalloc itself answers MALLOC_CONF, which glibc's malloc ignores.
TEST(Cli, TheBinarysAllocatorIsJemalloc) {
  auto r = run_tessera("--version", "MALLOC_CONF=stats_print:true");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("___ Begin jemalloc statistics ___"), std::string::npos) << r.output;
}

// Every training process keeps the pages it frees for the next step (jemalloc's decay off:
// each step faulted its activations in again). In a job of several ranks the arena of blocks
// above the oversize threshold still purges at once (kept, they serve few later requests:
// FSDP's 1/N memory). jemalloc's statistics, printed at exit, say what each process runs with.
namespace {
// The decay time of arena `index`, as jemalloc's statistics print it ("   dirty:   N/A ..."
// for none, "   dirty:     0 ..." for an immediate purge); "" when the arena is not listed.
std::string arena_decay(const std::string& stats, const std::string& index) {
  auto at = stats.find("arenas[" + index + "]:");
  if (at == std::string::npos) return "";
  at = stats.find("   dirty:", at);
  std::istringstream line(stats.substr(at + 9, 40));
  std::string decay;
  line >> decay;
  return decay;
}
std::string opt_narenas(const std::string& stats) {
  auto at = stats.find("opt.narenas: ");
  return at == std::string::npos ? "" : stats.substr(at + 13, stats.find('\n', at) - at - 13);
}
}  // namespace

TEST(Cli, TrainingKeepsFreedPagesShardedJobsReturnOversizeBlocks) {
  const std::string dir = tessera::testing::fresh_dir("allocator-decay");
  auto one = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1", "MALLOC_CONF=stats_print:true");
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("(arenas.dirty_decay_ms: -1)"), std::string::npos) << one.output;
  EXPECT_EQ(arena_decay(one.output, "0"), "N/A") << one.output;
  const std::string oversize_arena = opt_narenas(one.output);  // it follows the ordinary ones
  ASSERT_FALSE(oversize_arena.empty()) << one.output;
  EXPECT_NE(arena_decay(one.output, oversize_arena), "0") << one.output;  // "N/A", or "" if never made
  const std::string dir2 = tessera::testing::fresh_dir("allocator-decay-2");
  auto two = run_tessera("fit --config " + write_config(dir2) + " --set trainer.max_steps=1 --set launch.devices=2 "
                         "--set strategy.plugin=fsdp", "MALLOC_CONF=stats_print:true");
  EXPECT_EQ(two.exit_code, 0) << two.output;
  const std::string rank1 = file_bytes(dir2 + "/version_0/logs/rank-1.log");
  EXPECT_NE(rank1.find("(arenas.dirty_decay_ms: -1)"), std::string::npos) << rank1;
  EXPECT_EQ(arena_decay(rank1, oversize_arena), "0") << rank1;
  // A decay the user sets wins.
  auto chosen = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1",
                            "MALLOC_CONF=stats_print:true,dirty_decay_ms:500");
  EXPECT_NE(chosen.output.find("(arenas.dirty_decay_ms: 500)"), std::string::npos) << chosen.output;
}

// Ranks of one host move their all-gathers, reduce-scatters and all-reduces through shared
// memory (Gloo on loopback carried ~1 GB/s); [launch] shared_memory_collectives = false leaves
// every collective to Gloo. Each rank's log says which carried them, and the training matches.
TEST(Cli, RanksOfOneHostCollectThroughSharedMemoryUnlessTurnedOff) {
  std::map<bool, double> final_loss;
  for (bool shared : {true, false}) {
    const std::string dir = tessera::testing::fresh_dir(shared ? "shm-on" : "shm-off");
    auto run = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=3 --set launch.devices=2 "
                           "--set strategy.plugin=fsdp --set launch.shared_memory_collectives=" +
                           (shared ? "true" : "false --set strategy.process_group_backend=gloo"));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const std::string rank1 = file_bytes(dir + "/version_0/logs/rank-1.log");
    const std::string expected = shared ? "collectives: shared memory among the 2 ranks of this host" : "collectives: Gloo\n";
    EXPECT_NE(rank1.find(expected), std::string::npos) << rank1;
    auto loss = tessera::testing::metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
    ASSERT_FALSE(loss.empty());
    final_loss[shared] = loss.rbegin()->second;
  }
  EXPECT_NEAR(final_loss[true], final_loss[false], 1e-4);
}

// A /dev/shm without room for the segment (here a 1 MiB tmpfs in a mount namespace of the
// job's own) leaves every collective to Gloo: rank 0's reservation fails up front, every rank
// learns it through the store, the job trains and says so; no rank hits SIGBUS later.
TEST(Cli, AFullDevShmLeavesTheCollectivesToGloo) {
  if (tessera::testing::run_command("unshare -m true 2>&1").exit_code != 0)
    GTEST_SKIP() << "SKIPPED: this machine lets no process make a mount namespace (unshare -m)";
  const std::string dir = tessera::testing::fresh_dir("shm-full");
  auto run = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=3 --set launch.devices=2 "
                         "--set strategy.plugin=fsdp",
                         "unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$@\"' sh");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* rank : {"0", "1"}) {
    const std::string log = file_bytes(dir + "/version_0/logs/rank-" + rank + ".log");
    EXPECT_NE(log.find("collectives: Gloo\n"), std::string::npos) << "rank " << rank << "\n" << log;
  }
  auto loss = tessera::testing::metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
  ASSERT_EQ(loss.size(), 3u) << run.output;
  EXPECT_TRUE(std::isfinite(loss.rbegin()->second));
}

// libgomp's workers spin 300,000 times after a parallel region by default, and OpenBLAS's
// (pthreads build) for 2^28 cycles after a matmul, each on the cores the other needs: a training
// process runs with GOMP_SPINCOUNT=10000 and OPENBLAS_THREAD_TIMEOUT=20, set before either loads
// by re-executing itself once; ranks inherit them (no second re-execution), and a choice of the
// user's stands. libgomp itself prints its settings under OMP_DISPLAY_ENV; OpenBLAS prints
// nothing, so its setting is read from the running process's environment.
TEST(Cli, TrainingProcessesKeepIdleWorkersFromSpinning) {
  auto count = [](const std::string& text, const std::string& what) {
    std::size_t n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  const std::string clean_env =
      "env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY -u OPENBLAS_THREAD_TIMEOUT OMP_DISPLAY_ENV=VERBOSE";
  const std::string dir = tessera::testing::fresh_dir("openmp-spin");
  auto one = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1", clean_env);
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(count(one.output, "GOMP_SPINCOUNT = '300000'"), 1u) << one.output;  // before the re-execution
  EXPECT_EQ(count(one.output, "GOMP_SPINCOUNT = '10000'"), 1u) << one.output;
  const std::string dir2 = tessera::testing::fresh_dir("openmp-spin-2");
  auto two = run_tessera("fit --config " + write_config(dir2) + " --set trainer.max_steps=1 --set launch.devices=2 "
                         "--set strategy.plugin=ddp", clean_env);
  EXPECT_EQ(two.exit_code, 0) << two.output;
  const std::string rank1 = file_bytes(dir2 + "/version_0/logs/rank-1.log");
  EXPECT_EQ(count(rank1, "GOMP_SPINCOUNT ="), 1u) << rank1;
  EXPECT_EQ(count(rank1, "GOMP_SPINCOUNT = '10000'"), 1u) << rank1;
  auto chosen = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1",
                            clean_env + " OMP_WAIT_POLICY=ACTIVE OPENBLAS_THREAD_TIMEOUT=20");
  EXPECT_EQ(chosen.exit_code, 0) << chosen.output;
  EXPECT_EQ(count(chosen.output, "OMP_WAIT_POLICY = 'ACTIVE'"), 1u) << chosen.output;
  EXPECT_EQ(count(chosen.output, "GOMP_SPINCOUNT = '10000'"), 0u) << chosen.output;

  // The environment a training process runs in, read from /proc once it has re-executed.
  auto training_environment = [&](const std::string& name, const std::string& env) {
    const std::string run = tessera::testing::fresh_dir(name);
    std::ofstream(run + "/environ.sh")
        << "cd " << run << "\n" << clean_env << " " << env << " CUDA_VISIBLE_DEVICES= " << tessera::testing::tessera_binary() << " fit --config " << write_config(run)
        << " --set trainer.max_steps=100000 > out.txt 2>&1 &\npid=$!\n"
        << "for i in $(seq 600); do tr '\\0' '\\n' < /proc/$pid/environ > environ.txt 2>/dev/null;"
        << " grep -q '^GOMP_SPINCOUNT=' environ.txt && break; sleep 0.05; done\n"
        << "cat /proc/$pid/comm > comm.txt\nkill -KILL $pid\n";
    EXPECT_EQ(std::system(("timeout 60 bash " + run + "/environ.sh").c_str()), 0);
    // Named after its binary, not after /proc/self/exe ("exe"), once re-executed.
    EXPECT_EQ(file_bytes(run + "/comm.txt"), "tessera\n");
    return file_bytes(run + "/environ.txt");
  };
  using GetParallel = int (*)();
  auto openblas_parallel = reinterpret_cast<GetParallel>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  // Only OpenBLAS's pthreads build has a pool of its own (its OpenMP build waits in libgomp's;
  // LibTorch's pip wheels use MKL).
  const bool pthreads = openblas_parallel != nullptr && openblas_parallel() == 1;
  const std::string set = training_environment("openblas-timeout", "");
  EXPECT_NE(set.find("GOMP_SPINCOUNT=10000\n"), std::string::npos) << set;
  EXPECT_EQ(set.find("OPENBLAS_THREAD_TIMEOUT=20\n") != std::string::npos, pthreads) << set;
  const std::string kept = training_environment("openblas-timeout-chosen", "OPENBLAS_THREAD_TIMEOUT=24");
  EXPECT_NE(kept.find("OPENBLAS_THREAD_TIMEOUT=24\n"), std::string::npos) << kept;
  EXPECT_EQ(kept.find("OPENBLAS_THREAD_TIMEOUT=20"), std::string::npos) << kept;
}

TEST(Cli, HelpUsageAndBadArguments) {
  auto help = run_tessera("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("tessera fit|validate|test|predict --config FILE.toml"), std::string::npos) << help.output;
  auto none = run_tessera("");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.output.find("no command given"), std::string::npos) << none.output;
  auto typo = run_tessera("fitt --config x.toml");
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_NE(typo.output.find("unknown command 'fitt' (did you mean 'fit'?)"), std::string::npos) << typo.output;
  auto no_config = run_tessera("fit");
  EXPECT_NE(no_config.output.find("fit needs --config FILE.toml"), std::string::npos) << no_config.output;
  auto missing = run_tessera("fit --config /nonexistent/run.toml");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("config file /nonexistent/run.toml does not exist"), std::string::npos)
      << missing.output;
}

TEST(Trainer, ProgressBarLogLinesAndMetricsCsv) {
  std::string dir = tessera::testing::fresh_dir("progress");
  auto bar = run_tessera("fit --config " + write_config(dir) +
                         " --set trainer.max_steps=3 --set trainer.enable_progress_bar=true --set trainer.save_last=false"
                         " --set trainer.val_check_interval=3 --set trainer.limit_val_batches=2");
  ASSERT_EQ(bar.exit_code, 0) << bar.output;
  EXPECT_NE(bar.output.find("\r\033[Kepoch 0 [####################] 100% 3/3  loss "), std::string::npos) << bar.output;
  EXPECT_NE(bar.output.find("\r\033[Kvalidation [####################] 100% "), std::string::npos) << bar.output;
  EXPECT_NE(bar.output.find(" tokens/s"), std::string::npos) << bar.output;
  EXPECT_FALSE(fs::exists(run_dir(dir) + "/checkpoints/last.ckpt"));
  std::string plain_dir = tessera::testing::fresh_dir("plain");
  auto plain = run_tessera("fit --config " + write_config(plain_dir) + " --set trainer.max_steps=3");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("\r"), std::string::npos) << "no bar when enable_progress_bar = false";
  EXPECT_NE(plain.output.find("epoch 0 step 3/3  loss "), std::string::npos) << plain.output;
  std::ifstream csv(run_dir(plain_dir) + "/metrics.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header, "step,epoch,stage,metric,value");
  EXPECT_EQ(metric_series(run_dir(plain_dir) + "/metrics.csv", "train", "train_loss").size(), 3u);
  EXPECT_GT(metric_series(run_dir(plain_dir) + "/metrics.csv", "train", "tokens_per_s").at(3), 0.0);
  EXPECT_TRUE(fs::exists(run_dir(plain_dir) + "/logs/rank-0.log"));
}

TEST(Trainer, GradientAccumulationEqualsTheLargerBatch) {
  // No dropout: accumulate 2 x batch 2 sees exactly the samples of batch 4, in one step.
  std::string a_dir = tessera::testing::fresh_dir("accumulate");
  auto a = run_tessera("fit --config " + write_config(a_dir) +
                       " --set model.dropout=0.0 --set trainer.max_steps=4 --set data.batch_size=2"
                       " --set trainer.accumulate_grad_batches=2 --set trainer.gradient_clip_val=0.5");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  std::string b_dir = tessera::testing::fresh_dir("big-batch");
  auto b = run_tessera("fit --config " + write_config(b_dir) +
                       " --set model.dropout=0.0 --set trainer.max_steps=4 --set trainer.gradient_clip_val=0.5");
  ASSERT_EQ(b.exit_code, 0) << b.output;
  expect_losses_equal(metric_series(run_dir(a_dir) + "/metrics.csv", "train", "train_loss"),
                      metric_series(run_dir(b_dir) + "/metrics.csv", "train", "train_loss"), 1, 4, 1e-5);
}

TEST(Trainer, ValidateAndTestPrintMetricsFromACheckpoint) {
  std::string dir = tessera::testing::fresh_dir("validate");
  ASSERT_EQ(run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=2").exit_code, 0);
  for (const char* stage : {"validate", "test"}) {
    auto r = run_tessera(std::string(stage) + " --config " + dir + "/run.toml --ckpt-path last " +
                         "--set trainer.limit_val_batches=2 --set trainer.limit_test_batches=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::string prefix = std::string(stage) == "validate" ? "val_loss " : "test_loss ";
    EXPECT_NE(r.output.find(std::string(stage) + ":  " + prefix), std::string::npos) << r.output;
  }
}

TEST(TrainingLoop, LimitTrainBatchesAndValidationAtFractionsOfEveryNthEpoch) {
  // 4 epochs of 4 steps; validation at half of every second epoch and at its end.
  std::string dir = tessera::testing::fresh_dir("loop-schedule");
  auto r = run_tessera("fit --config " + write_config(dir) +
                       " --set trainer.max_steps=-1 --set trainer.max_epochs=4 --set trainer.limit_train_batches=4"
                       " --set trainer.val_check_interval=0.5 --set trainer.check_val_every_n_epoch=2"
                       " --set trainer.limit_val_batches=1 --set trainer.num_sanity_val_steps=0"
                       " --set trainer.checkpoint_every_n_steps=0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string csv = run_dir(dir) + "/metrics.csv";
  auto train = metric_series(csv, "train", "train_loss");
  ASSERT_EQ(train.size(), 16u) << r.output;
  EXPECT_EQ(train.rbegin()->first, 16);
  std::vector<std::int64_t> val_steps;
  for (const auto& [step, value] : metric_series(csv, "val", "val_loss")) val_steps.push_back(step);
  EXPECT_EQ(val_steps, (std::vector<std::int64_t>{6, 8, 14, 16})) << r.output;
  EXPECT_NE(r.output.find("validation after epoch 3:"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("validation after epoch 2:"), std::string::npos) << r.output;
}

TEST(TrainingLoop, SanityCheckValidatesBeforeTheFirstStepAndLeavesTrainingAsItWas) {
  const std::string sets = " --set trainer.max_steps=3 --set trainer.limit_val_batches=3";
  std::string off = tessera::testing::fresh_dir("sanity-off");
  auto a = run_tessera("fit --config " + write_config(off) + sets + " --set trainer.num_sanity_val_steps=0");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.find("sanity check"), std::string::npos) << a.output;
  std::string on = tessera::testing::fresh_dir("sanity-default");
  auto b = run_tessera("fit --config " + write_config(on) + sets);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  const auto check = b.output.find("sanity check passed: validation_step ran on 2 batch(es)");
  ASSERT_NE(check, std::string::npos) << b.output;
  EXPECT_LT(check, b.output.find("epoch 0 step 1/3")) << "before the first step\n" << b.output;
  EXPECT_TRUE(metric_series(run_dir(on) + "/metrics.csv", "val", "val_loss").empty()) << "a sanity check logs nothing";
  // Evaluation draws no random numbers and leaves the weights alone: the same losses, bit for bit.
  auto with = metric_series(run_dir(on) + "/metrics.csv", "train", "train_loss");
  auto without = metric_series(run_dir(off) + "/metrics.csv", "train", "train_loss");
  ASSERT_EQ(with.size(), 3u);
  EXPECT_EQ(with, without);
  std::string all = tessera::testing::fresh_dir("sanity-all");
  auto c = run_tessera("fit --config " + write_config(all) + sets + " --set trainer.num_sanity_val_steps=-1");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("sanity check passed: validation_step ran on 3 batch(es)"), std::string::npos) << c.output;
}

TEST(TrainingLoop, MinStepsHoldsEarlyStoppingBack) {
  // mode = "max" on a falling val_loss: early stopping asks to stop within a few steps.
  std::string dir = tessera::testing::fresh_dir("min-steps");
  std::string config = write_config(dir, "[callbacks.early_stopping]\nmonitor = \"val_loss\"\nmode = \"max\"\n"
                                         "patience = 2\nmin_delta = 0.0\n");
  const std::int64_t min_steps = 9;
  auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=30 --set trainer.val_check_interval=1 " +
                       "--set trainer.limit_val_batches=2 --set trainer.min_steps=" + std::to_string(min_steps));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Replayed from the logged validation losses: the first request, and the first one at or after min_steps.
  double best = -1e30;
  std::int64_t wait = 0, first_request = -1, expected_stop = -1;
  for (const auto& [step, loss] : metric_series(run_dir(dir) + "/metrics.csv", "val", "val_loss")) {
    if (loss > best) {
      best = loss, wait = 0;
    } else if (++wait >= 2) {
      if (first_request < 0) first_request = step;
      if (step >= min_steps) {
        expected_stop = step;
        break;
      }
    }
  }
  ASSERT_GT(first_request, 0) << r.output;
  ASSERT_LT(first_request, min_steps) << "early stopping never asked before min_steps: nothing was held back\n"
                                      << r.output;
  ASSERT_GE(expected_stop, min_steps) << r.output;
  EXPECT_NE(r.output.find("a stop was requested at step " + std::to_string(first_request)), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[trainer] min_steps = 9 is not reached: training continues"), std::string::npos) << r.output;
  auto train = metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
  EXPECT_EQ(train.rbegin()->first, expected_stop) << r.output;
}

TEST(TrainingLoop, OverfitBatchesTrainsOnTheSameBatchesEveryEpoch) {
  // With lr = 0 the weights never change, so a loss depends on its batch only: under
  // overfit_batches epoch 1 sees epoch 0's batches again; under limit_train_batches it reshuffles.
  auto losses = [](const std::string& name, const std::string& sets) {
    std::string dir = tessera::testing::fresh_dir(name);
    auto r = run_tessera("fit --config " + write_config(dir) + " --set optimizer.lr=0.0 --set model.dropout=0.0" +
                         " --set trainer.max_steps=-1 --set trainer.max_epochs=2 --set trainer.checkpoint_every_n_steps=0 " +
                         sets);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
  };
  auto overfit = losses("overfit", "--set trainer.overfit_batches=2");
  ASSERT_EQ(overfit.size(), 4u);
  EXPECT_EQ(overfit.at(1), overfit.at(3));
  EXPECT_EQ(overfit.at(2), overfit.at(4));
  EXPECT_NE(overfit.at(1), overfit.at(2));
  auto limited = losses("limited", "--set trainer.limit_train_batches=2");
  ASSERT_EQ(limited.size(), 4u);
  EXPECT_NE(limited.at(1), limited.at(3));
}

TEST(TrainingLoop, FastDevRunRunsEveryLoopBrieflyAndWritesNoMetricsNorCheckpoints) {
  std::string dir = tessera::testing::fresh_dir("fast-dev-run");
  auto r = run_tessera("fit --config " + write_config(dir) +
                       " --set trainer.fast_dev_run=2 --set strategy.plugin=fsdp --set launch.devices=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fast_dev_run = 2: 2 training step(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("epoch 0 step 2/2  loss "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 3/"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("validation after epoch 0:  val_loss "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("sanity check"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(run_dir(dir) + "/metrics.csv"));
  EXPECT_TRUE(!fs::exists(run_dir(dir) + "/checkpoints") || fs::is_empty(run_dir(dir) + "/checkpoints"))
      << "checkpoint_every_n_steps = 4 and save_last are off under fast_dev_run";
}

TEST(TrainingLoop, EnableCheckpointingAndModelSummaryTurnedOff) {
  std::string dir = tessera::testing::fresh_dir("no-checkpointing");
  std::string config = write_config_own_checkpoints(dir);
  auto on = run_tessera("fit --config " + config + " --set trainer.max_steps=2");
  ASSERT_EQ(on.exit_code, 0) << on.output;
  EXPECT_NE(on.output.find(" total\n"), std::string::npos) << "the model summary is on by default\n" << on.output;
  EXPECT_TRUE(fs::exists(run_dir(dir) + "/checkpoints/last.ckpt")) << on.output;
  auto off = run_tessera("fit --config " + config + " --set trainer.max_steps=2 --set trainer.enable_checkpointing=false"
                         " --set trainer.enable_model_summary=false");
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_EQ(off.output.find(" total\n"), std::string::npos) << off.output;
  EXPECT_EQ(off.output.find("checkpoint saved"), std::string::npos) << off.output;
  EXPECT_FALSE(fs::exists(run_dir(dir) + "/checkpoints/last.ckpt")) << off.output;
  std::ofstream(config, std::ios::app) << "[callbacks.model_checkpoint]\nsave_last = true\n";
  auto refused = run_tessera("fit --config " + config + " --set trainer.enable_checkpointing=false");
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("[callbacks.model_checkpoint] is a model_checkpoint, but [trainer] "
                                "enable_checkpointing = false: remove one of them"),
            std::string::npos)
      << refused.output;
}

TEST(Cli, PluginsListsEveryShippedPlugin) {
  auto r = run_tessera("plugins");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"single_device", "ddp", "fsdp", "fsdp_cpu_offload", "precision", "fsdp-precision",
                           "torch", "distributed", "gpt", "llama", "mlp", "cnn", "text", "fashion_mnist", "tokens"})
    EXPECT_NE(r.output.find(std::string(" ") + name + " "), std::string::npos) << name << "\n" << r.output;
}

// ---- run folders, callbacks, loggers, profiler, stopping (issue 12) ----

std::string slurp(const std::string& path) { return file_bytes(path); }

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(RunDirectory, VersionFoldersConfigHparamsAndLast) {
  std::string dir = tessera::testing::fresh_dir("versions");
  std::string config = write_config(dir);
  for (int i = 0; i < 2; ++i) {
    auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=" + std::to_string(2 + i));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("run directory: " + dir + "/version_" + std::to_string(i)), std::string::npos) << r.output;
  }
  for (int i = 0; i < 2; ++i) {
    std::string run = dir + "/version_" + std::to_string(i);
    EXPECT_TRUE(fs::exists(run + "/checkpoints/last.ckpt")) << run;
    EXPECT_EQ(metric_series(run + "/metrics.csv", "train", "train_loss").size(), 2u + i) << "one run's rows each";
    // The resolved configuration: the file's keys with --set applied, every default commented out.
    std::string saved = slurp(run + "/config.toml");
    EXPECT_NE(saved.find("\nmax_steps = " + std::to_string(2 + i) + "\n"), std::string::npos) << saved;
    EXPECT_NE(saved.find("\nn_embd = 32\n"), std::string::npos) << saved;
    EXPECT_NE(saved.find("\n# accumulate_grad_batches = 1\n"), std::string::npos) << saved;
    EXPECT_NE(saved.find("\n# tie_embeddings = true\n"), std::string::npos) << saved;
    std::string hparams = slurp(run + "/hparams.yaml");
    EXPECT_NE(hparams.find("n_layer: 2"), std::string::npos) << hparams;
    EXPECT_NE(hparams.find("strategy: \"single_device\""), std::string::npos) << hparams;
  }
  // --ckpt-path last: the newest run's checkpoint (step 3 of version_1), in a new version_2.
  auto resumed = run_tessera("fit --config " + config + " --set trainer.max_steps=4 --ckpt-path last");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("restored " + dir + "/version_1/checkpoints/last.ckpt (resuming at step 3)"),
            std::string::npos) << resumed.output;
  EXPECT_EQ(metric_series(dir + "/version_2/metrics.csv", "train", "train_loss").size(), 1u);
  // A named run: default_root_dir/name/version.
  auto named = run_tessera("fit --config " + config + " --set trainer.max_steps=1 --set logger.name=exp" +
                           " --set logger.version=baseline");
  ASSERT_EQ(named.exit_code, 0) << named.output;
  EXPECT_TRUE(fs::exists(dir + "/exp/baseline/checkpoints/last.ckpt"));
  // Nothing to resume from: fit starts from the beginning (Lightning's fit(ckpt_path="last")),
  // so the same command starts a job and resumes it after a requeue; saying where it looked.
  // The commands that evaluate a checkpoint need one.
  std::string empty = tessera::testing::fresh_dir("versions-empty");
  const std::string requeued = "fit --config " + write_config(empty) + " --ckpt-path last --set trainer.max_steps=";
  auto first = run_tessera(requeued + "2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("--ckpt-path last: no checkpoint yet in any run under " + empty +
                              ": training starts from the beginning"),
            std::string::npos)
      << first.output;
  auto again = run_tessera(requeued + "3");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("(resuming at step 2)"), std::string::npos) << again.output;
  std::string none_dir = tessera::testing::fresh_dir("versions-none");
  auto none = run_tessera("validate --config " + write_config(none_dir) + " --ckpt-path last");
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("--ckpt-path last: no checkpoint in any run under " + none_dir), std::string::npos)
      << none.output;
}

TEST(Callbacks, ModelCheckpointKeepsTheTopKByTheMonitoredMetric) {
  // mode = "max" on a falling val_loss: the early checkpoints are the ones to keep, so later
  // ones are refused or pruned.
  std::string dir = tessera::testing::fresh_dir("topk");
  std::string config = write_config_own_checkpoints(
      dir, "[callbacks.best]\nplugin = \"model_checkpoint\"\nmonitor = \"val_loss\"\n"
           "mode = \"max\"\nsave_top_k = 2\nevery_n_train_steps = 1\n"
           "filename = \"{step}-{val_loss:.5f}\"\nsave_last = true\n");
  auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=6 --set trainer.val_check_interval=1 " +
                       "--set trainer.limit_val_batches=3 --set trainer.checkpoint_every_n_steps=0");
  EXPECT_NE(r.exit_code, 0) << "[trainer] checkpoint keys beside [callbacks.best] must be refused";
  EXPECT_NE(r.output.find("both configure checkpointing"), std::string::npos) << r.output;
  r = run_tessera("fit --config " + config + " --set trainer.max_steps=6 --set trainer.val_check_interval=1 " +
                  "--set trainer.limit_val_batches=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto val = metric_series(run_dir(dir) + "/metrics.csv", "val", "val_loss");
  ASSERT_EQ(val.size(), 6u);
  std::vector<std::pair<double, std::int64_t>> by_score;
  for (const auto& [step, loss] : val) by_score.emplace_back(-loss, step);
  std::sort(by_score.begin(), by_score.end());
  std::vector<std::string> expected = {"last", "last.ckpt"};  // "last": the newest-commit pointer
  for (int i = 0; i < 2; ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "step=%lld-val_loss=%.5f.ckpt", static_cast<long long>(by_score[i].second),
                  -by_score[i].first);
    expected.push_back(name);
  }
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(checkpoint_files(run_dir(dir) + "/checkpoints"), expected) << r.output;
  auto last = tessera::core::checkpoint_dict(tessera::core::load_pickle(run_dir(dir) + "/checkpoints/last.ckpt"), "last");
  EXPECT_EQ(last.at("global_step").toInt(), 6);
  auto state = tessera::core::checkpoint_dict(last.at("callbacks"), "callbacks");
  EXPECT_TRUE(state.contains("ModelCheckpoint{monitor=val_loss,mode=max}"));

  // --ckpt-path best (Lightning's): the best by the monitor, as the newest checkpoint's callback
  // state records it (mode max: the highest val_loss).
  char best[64];
  std::snprintf(best, sizeof(best), "/checkpoints/step=%lld-val_loss=%.5f.ckpt",
                static_cast<long long>(by_score[0].second), -by_score[0].first);
  const std::string recorded =
      tessera::core::checkpoint_dict(state.at("ModelCheckpoint{monitor=val_loss,mode=max}"), "state")
          .at("best_model_path")
          .toStringRef();
  EXPECT_NE(recorded.find(best), std::string::npos) << recorded;
  auto v = run_tessera("validate --config " + config + " --ckpt-path best --set trainer.limit_val_batches=1");
  ASSERT_EQ(v.exit_code, 0) << v.output;
  EXPECT_NE(v.output.find(std::string("restored ") + run_dir(dir).substr(0, run_dir(dir).rfind('/')) + "/version_0" + best),
            std::string::npos)
      << v.output;
}

// train_time_interval (Lightning's): a save whenever that much training time has passed, by
// rank 0's clock on every rank (a save is collective). Shorter than any step: every step saves,
// on both ranks alike; a day: none but last.ckpt.
TEST(Callbacks, ModelCheckpointTrainTimeIntervalFollowsRankZerosClock) {
  auto config_with = [](const std::string& dir, const std::string& keys) {
    return write_config_own_checkpoints(dir, "[callbacks.model_checkpoint]\nsave_top_k = -1\nsave_last = true\n" + keys);
  };
  const std::string two = " --set launch.devices=2 --set strategy.plugin=fsdp --set trainer.max_steps=4";
  std::string dir = tessera::testing::fresh_dir("time-interval-short");
  auto r = run_tessera("fit --config " + config_with(dir, "train_time_interval = 1e-6\n") + two);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(checkpoint_files(run_dir(dir) + "/checkpoints"),
            (std::vector<std::string>{"last", "last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt", "step=4.ckpt"}));
  dir = tessera::testing::fresh_dir("time-interval-day");
  r = run_tessera("fit --config " + config_with(dir, "train_time_interval = \"01:00:00:00\"\n") + two);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(checkpoint_files(run_dir(dir) + "/checkpoints"), (std::vector<std::string>{"last", "last.ckpt"}));

  r = run_tessera("fit --config " + config_with(dir, "train_time_interval = 60\nevery_n_train_steps = 2\n"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train_time_interval and "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("every_n_train_steps both say when to save"), std::string::npos) << r.output;
  r = run_tessera("fit --config " + config_with(dir, "train_time_interval = \"1h\"\n"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("train_time_interval = \"1h\" is not a duration"), std::string::npos) << r.output;
}

// save_weights_only (Lightning's): the model's weights, the step and the callbacks' state; no
// optimizer, scaler, schedule or RNG state. Evaluated as any other checkpoint, refused by fit
// before any rank starts; in the sharded format too.
TEST(Callbacks, SaveWeightsOnlyKeepsTheModelWithoutTrainingState) {
  auto config_with = [](const std::string& dir, const std::string& extra) {
    return write_config_own_checkpoints(dir, "[callbacks.model_checkpoint]\nevery_n_train_steps = 2\nsave_last = true\n" + extra);
  };
  const std::string full_dir = tessera::testing::fresh_dir("weights-full");
  ASSERT_EQ(run_tessera("fit --config " + config_with(full_dir, "") + " --set trainer.max_steps=4").exit_code, 0);
  const std::string dir = tessera::testing::fresh_dir("weights-only");
  const std::string config = config_with(dir, "save_weights_only = true\n");
  auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(step 4, weights only"), std::string::npos) << r.output;
  const std::string saved = run_dir(dir) + "/checkpoints/step=4.ckpt";
  auto c = tessera::core::checkpoint_dict(tessera::core::load_pickle(saved), saved);
  for (const char* key : {"state_dict", "global_step", "hyper_parameters", "callbacks"}) EXPECT_TRUE(c.contains(key)) << key;
  for (const char* key : {"optimizer_states", "precision_plugin", "lr_schedulers", "rng_state"})
    EXPECT_FALSE(c.contains(key)) << key;
  EXPECT_EQ(c.at("global_step").toInt(), 4);
  // AdamW keeps two moments per weight: the full checkpoint is about three times as large.
  EXPECT_LT(std::filesystem::file_size(saved) * 2, std::filesystem::file_size(run_dir(full_dir) + "/checkpoints/step=4.ckpt"));

  r = run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=6 --set launch.devices=2 "
                  "--set strategy.plugin=fsdp");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("holds the weights only (model_checkpoint save_weights_only = true)"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << "refused before any rank starts\n" << r.output;
  r = run_tessera("validate --config " + config + " --ckpt-path " + saved + " --set trainer.limit_val_batches=1");
  EXPECT_EQ(r.exit_code, 0) << r.output;

  const std::string sharded_dir = tessera::testing::fresh_dir("weights-only-sharded");
  const std::string sharded = config_with(sharded_dir, "save_weights_only = true\n[strategy]\nplugin = \"fsdp\"\n"
                                                       "state_dict_type = \"sharded\"\n[checkpoint_io]\nplugin = \"distributed\"\n");
  r = run_tessera("fit --config " + sharded + " --set trainer.max_steps=2 --set launch.devices=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("validate --config " + sharded + " --ckpt-path last --set launch.devices=2 --set trainer.limit_val_batches=1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("fit --config " + sharded + " --ckpt-path last --set launch.devices=2");
  EXPECT_NE(r.output.find("holds the weights only"), std::string::npos) << r.output;
}

TEST(Callbacks, CkptPathBestWithoutAMonitorOrWithoutASave) {
  // Without a monitor the best is the latest top-k save (step=4.ckpt here), not last.ckpt.
  std::string dir = tessera::testing::fresh_dir("best-unmonitored");
  std::string config = write_config(dir);
  auto r = run_tessera("validate --config " + config + " --ckpt-path best");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--ckpt-path best: no checkpoint in any run under " + dir), std::string::npos) << r.output;
  ASSERT_EQ(run_tessera("fit --config " + config + " --set trainer.max_steps=6").exit_code, 0);
  r = run_tessera("test --config " + config + " --ckpt-path best --set trainer.limit_test_batches=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("restored " + dir + "/version_0/checkpoints/step=4.ckpt"), std::string::npos) << r.output;

  // A monitored metric that is never logged: no best was saved, and the error says so.
  dir = tessera::testing::fresh_dir("best-never-saved");
  config = write_config_own_checkpoints(
      dir, "[callbacks.model_checkpoint]\nmonitor = \"val_acc\"\nevery_n_train_steps = 2\nsave_last = true\n");
  ASSERT_EQ(run_tessera("fit --config " + config + " --set trainer.max_steps=2").exit_code, 0);
  r = run_tessera("validate --config " + config + " --ckpt-path best");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("last.ckpt (the newest checkpoint of the newest run) records no best checkpoint"),
            std::string::npos)
      << r.output;
}

TEST(Callbacks, CkptPathBestReadsAShardedCheckpointsManifest) {
  std::string dir = tessera::testing::fresh_dir("best-sharded");
  std::string config = write_config_own_checkpoints(
      dir, "[callbacks.model_checkpoint]\nmonitor = \"val_loss\"\nmode = \"max\"\nevery_n_train_steps = 2\n"
           "[strategy]\nplugin = \"fsdp\"\nstate_dict_type = \"sharded\"\n[checkpoint_io]\nplugin = \"distributed\"\n");
  const std::string two = " --set launch.devices=2 --set trainer.limit_val_batches=2";
  auto r = run_tessera("fit --config " + config + two + " --set trainer.max_steps=6 --set trainer.val_check_interval=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto val = metric_series(run_dir(dir) + "/metrics.csv", "val", "val_loss");
  ASSERT_EQ(val.size(), 3u);
  // mode max on a falling loss: the best is an early checkpoint, not the newest one.
  const auto highest = std::max_element(val.begin(), val.end(), [](auto& a, auto& b) { return a.second < b.second; });
  ASSERT_NE(highest->first, 6) << "the loss did not fall: the test cannot tell the best from the newest";
  r = run_tessera("validate --config " + config + two + " --ckpt-path best");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("restored " + dir + "/version_0/checkpoints/step=" + std::to_string(highest->first) + ".ckpt"),
            std::string::npos)
      << r.output;
}

TEST(Callbacks, EarlyStoppingStopsAfterPatienceChecksWithoutImprovement) {
  std::string dir = tessera::testing::fresh_dir("early");
  std::string config = write_config(dir, "[callbacks.early_stopping]\nmonitor = \"val_loss\"\nmode = \"max\"\n"
                                         "patience = 2\nmin_delta = 0.0\n");
  auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=30 --set trainer.val_check_interval=1 " +
                       "--set trainer.limit_val_batches=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The stop step EarlyStopping must reach, replayed from the logged validation losses.
  auto val = metric_series(run_dir(dir) + "/metrics.csv", "val", "val_loss");
  double best = -1e30;
  std::int64_t wait = 0, expected_stop = -1;
  for (const auto& [step, loss] : val) {
    if (loss > best) best = loss, wait = 0;
    else if (++wait >= 2) { expected_stop = step; break; }
  }
  ASSERT_GT(expected_stop, 0) << "val_loss rose for 30 steps?\n" << r.output;
  auto train = metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
  EXPECT_EQ(train.rbegin()->first, expected_stop);
  EXPECT_NE(r.output.find("early stopping at step " + std::to_string(expected_stop)), std::string::npos) << r.output;
  auto last = tessera::core::checkpoint_dict(tessera::core::load_pickle(run_dir(dir) + "/checkpoints/last.ckpt"), "last");
  EXPECT_EQ(last.at("global_step").toInt(), expected_stop);
}

TEST(Callbacks, EarlyStoppingStopsAtTheStoppingAndDivergenceThresholds) {
  // val_loss falls from ~5.5: below 5.0 after a few steps (good enough), above 5.0 at once (diverged).
  for (const std::string threshold : {"stopping_threshold", "divergence_threshold"}) {
    std::string dir = tessera::testing::fresh_dir("early-" + threshold);
    std::string config = write_config(dir, "[callbacks.early_stopping]\nmonitor = \"val_loss\"\npatience = 100\n" +
                                               threshold + " = 5.0\n");
    auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=30 --set trainer.val_check_interval=1 " +
                         "--set trainer.limit_val_batches=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::int64_t expected_stop = -1;
    for (const auto& [step, loss] : metric_series(run_dir(dir) + "/metrics.csv", "val", "val_loss"))
      if (threshold == "stopping_threshold" ? loss < 5.0 : loss > 5.0) {
        expected_stop = step;
        break;
      }
    ASSERT_GT(expected_stop, 0) << r.output;
    if (threshold == "stopping_threshold") EXPECT_GT(expected_stop, 1) << "val_loss started below 5?\n" << r.output;
    auto train = metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
    EXPECT_EQ(train.rbegin()->first, expected_stop) << r.output;
    EXPECT_NE(r.output.find(threshold == "stopping_threshold" ? "Stopping threshold reached: val_loss = "
                                                              : "Divergence threshold reached: val_loss = "),
              std::string::npos)
        << r.output;
  }
}

TEST(Callbacks, LrMonitorLogsTheScheduledRate) {
  std::string dir = tessera::testing::fresh_dir("lrmonitor");
  auto r = run_tessera("fit --config " + write_config(dir, "[callbacks.lr_monitor]\nlog_momentum = true\n") +
                       " --set trainer.max_steps=3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lr = metric_series(run_dir(dir) + "/metrics.csv", "train", "lr-AdamW");
  ASSERT_EQ(lr.size(), 3u);
  EXPECT_NEAR(lr.at(1), 0.0015, 1e-12);  // warmup_steps = 2: lr / 2, then lr
  EXPECT_NEAR(lr.at(2), 0.003, 1e-12);
  EXPECT_NEAR(metric_series(run_dir(dir) + "/metrics.csv", "train", "lr-AdamW-momentum").at(3), 0.9, 1e-12);
  auto typo = run_tessera("fit --config " + write_config(dir, "[callbacks.lr_monitr]\n"));
  EXPECT_NE(typo.exit_code, 0);
  EXPECT_NE(typo.output.find("'lr_monitr' is neither a built-in callback (did you mean 'lr_monitor'?)"),
            std::string::npos) << typo.output;
}

TEST(Logger, TensorBoardEventsDecodeWithPythonProtobuf) {
  if (std::system("/usr/bin/python3 -c 'import google.protobuf' 2>/dev/null") != 0 ||
      std::system("command -v protoc >/dev/null") != 0)
    GTEST_SKIP() << "python3-protobuf or protobuf-compiler is not installed: event files not decoded";
  std::string dir = tessera::testing::fresh_dir("tensorboard");
  auto r = run_tessera("fit --config " + write_config(dir, "[logger]\nloggers = [\"csv\", \"tensorboard\"]\n") +
                       " --set trainer.max_steps=4 --set trainer.val_check_interval=2 --set trainer.limit_val_batches=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string json_path = dir + "/decoded.json";
  std::string command = "/usr/bin/python3 " TESSERA_TEST_SOURCE_DIR "/read_tensorboard.py " TESSERA_PROTO_DIR " " +
                        run_dir(dir) + " > " + json_path;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto decoded = nlohmann::json::parse(slurp(json_path));
  auto csv = metric_series(run_dir(dir) + "/metrics.csv", "train", "train_loss");
  ASSERT_EQ(decoded["scalars"]["train_loss"].size(), csv.size()) << decoded.dump();
  for (const auto& [step, loss] : csv)
    EXPECT_NEAR(decoded["scalars"]["train_loss"][std::to_string(step)].get<double>(), loss, 1e-5 * std::abs(loss));
  EXPECT_EQ(decoded["scalars"]["val_loss"].size(), 2u);
  EXPECT_EQ(decoded["hparams"]["n_layer"].get<double>(), 2.0);
  EXPECT_EQ(decoded["hparams"]["strategy"].get<std::string>(), "single_device");
  EXPECT_EQ(decoded["status"].get<int>(), 1);  // STATUS_SUCCESS
}

TEST(Profiler, SummarySimpleTableAndChromeTracePerRank) {
  std::string dir = tessera::testing::fresh_dir("profiler");
  auto simple = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=3 --set trainer.profiler=simple");
  ASSERT_EQ(simple.exit_code, 0) << simple.output;
  for (const char* text : {"Profiler report (simple)", "[Strategy]backward", "[Strategy]optimizer_step",
                           "[Callback]model_checkpoint.on_train_batch_end", "| Name", "trainable params",
                           "per rank (max over 1): parameters"})
    EXPECT_NE(simple.output.find(text), std::string::npos) << text << "\n" << simple.output;
  EXPECT_TRUE(fs::exists(run_dir(dir) + "/profiler.txt"));

  auto trace = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=2 --set trainer.profiler=trace" +
                           " --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2");
  ASSERT_EQ(trace.exit_code, 0) << trace.output;
  EXPECT_NE(trace.output.find("per rank (max over 2)"), std::string::npos) << trace.output;
  // The FSDP unit plan: each unit in forward order with the parameters it gathers.
  EXPECT_NE(trace.output.find("sharding units (3, forward order): blocks.0 12.7 K, blocks.1 12.7 K, <root>"),
            std::string::npos) << trace.output;
  EXPECT_EQ(simple.output.find("sharding units"), std::string::npos) << "single_device shards nothing";
  for (int rank = 0; rank < 2; ++rank) {
    std::string path = run_dir(dir) + "/trace-rank-" + std::to_string(rank) + ".json";
    ASSERT_TRUE(fs::exists(path)) << path;
    auto json = nlohmann::json::parse(slurp(path));
    std::set<std::string> spans, collectives;
    for (const auto& e : json["traceEvents"]) {
      if (e["ph"] == "X") spans.insert(e["name"].get<std::string>());
      if (e["ph"] == "b") collectives.insert(e["name"].get<std::string>());
      if (e["ph"] == "X" || e["ph"] == "b") EXPECT_EQ(e["pid"].get<int>(), rank);
    }
    for (const char* name : {"[Strategy]training_step", "[Strategy]backward", "[Strategy]optimizer_step"})
      EXPECT_TRUE(spans.count(name)) << name << " missing from " << path;
    bool gather = false, reduce = false;
    for (const auto& name : collectives) {
      gather |= name.find("all-gather") != std::string::npos || name.find("all_gather") != std::string::npos;
      reduce |= name.find("reduce") != std::string::npos;
    }
    EXPECT_TRUE(gather && reduce) << "collective spans in " << path << ": " << nlohmann::json(collectives).dump();
  }
}

TEST(Stopping, MaxTimeStopsTheRunAndSavesLast) {
  std::string dir = tessera::testing::fresh_dir("maxtime");
  auto start = std::chrono::steady_clock::now();
  auto r = run_tessera("fit --config " + write_config(dir) +
                       " --set trainer.max_steps=100000 --set trainer.max_time='\"00:00:00:03\"' --set trainer.log_every_n_steps=50");
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("max_time 3 s reached"), std::string::npos) << r.output;
  EXPECT_LT(seconds, 60);
  auto last = tessera::core::checkpoint_dict(tessera::core::load_pickle(run_dir(dir) + "/checkpoints/last.ckpt"), "last");
  EXPECT_LT(last.at("global_step").toInt(), 100000);
  auto bad = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_time=3h");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("[trainer] max_time = \"3h\" is not a duration"), std::string::npos) << bad.output;
}

TEST(Stopping, SigintSavesACheckpointThatResumesExactly) {
  std::string full = tessera::testing::fresh_dir("sigint-full");
  ASSERT_EQ(run_tessera("fit --config " + write_config(full)).exit_code, 0);
  std::string dir = tessera::testing::fresh_dir("sigint");
  auto r = run_tessera("fit --config " + write_config(dir), "TESSERA_FAULT_INJECT=rank=0,step=3,kind=sigint");
  EXPECT_EQ(r.exit_code, 130) << r.output;
  EXPECT_NE(r.output.find("interrupted by Ctrl-C (SIGINT) at step 3: checkpoint saved to " + dir +
                          "/version_0/checkpoints/last.ckpt; resume with --ckpt-path last"),
            std::string::npos) << r.output;
  auto c = run_tessera("fit --config " + dir + "/run.toml --ckpt-path last");
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("resuming at step 3"), std::string::npos) << c.output;
  expect_losses_equal(metric_series(run_dir(full) + "/metrics.csv", "train", "train_loss"),
                      all_runs(dir, "train", "train_loss"), 1, 8, 1e-6);
  // A Ctrl-C that reaches one rank of two: the step's all-reduce carries its signal, so every
  // rank saves, says what stopped it and exits 130 (rank 0 used to exit 143, and the job's code
  // was whichever rank the launcher saw end first).
  for (int round = 0; round < 3; ++round) {
    std::string two = tessera::testing::fresh_dir("sigint-2-" + std::to_string(round));
    auto t = run_tessera("fit --config " + write_config(two) + " --set launch.devices=2 --set strategy.plugin=fsdp",
                         "TESSERA_FAULT_INJECT=rank=1,step=3,kind=sigint");
    EXPECT_EQ(t.exit_code, 130) << t.output;
    EXPECT_NE(t.output.find("interrupted by Ctrl-C (SIGINT) on another rank at step 3: checkpoint saved"), std::string::npos)
        << t.output;
  }
}

TEST(Stopping, CtrlCOnTheLauncherCheckpointsEveryRankThenExits) {
  // A real SIGINT to the launcher of 2 ranks: it asks the ranks to stop (SIGTERM), they agree
  // on a step, save last.ckpt and exit; the launcher exits 130.
  std::string dir = tessera::testing::fresh_dir("ctrlc");
  std::string config = write_config(dir);
  std::ofstream(dir + "/ctrlc.sh") << "cd " << dir << "\n(" << tessera::testing::tessera_binary() << " fit --config "
                                    << config << " --set trainer.max_steps=100000 --set launch.devices=2"
                                    << " --set strategy.plugin=ddp --set data.batch_size=2 > out.txt 2>&1 &\n"
                                    << " echo $! > pid; wait $!; echo $? > rc) &\n"
                                    << "for i in $(seq 600); do grep -q 'step 20/' version_0/logs/rank-0.log 2>/dev/null && break;"
                                    << " sleep 0.1; done\nkill -INT $(cat pid)\n"
                                    << "for i in $(seq 600); do [ -f rc ] && break; sleep 0.1; done\n";
  ASSERT_EQ(std::system(("timeout 120 bash " + dir + "/ctrlc.sh").c_str()), 0);
  std::string out = slurp(dir + "/out.txt");
  EXPECT_EQ(slurp(dir + "/rc"), "130\n") << out;
  EXPECT_NE(out.find("interrupted by"), std::string::npos) << out;
  EXPECT_NE(out.find("resume with --ckpt-path last"), std::string::npos) << out;
  ASSERT_TRUE(fs::exists(run_dir(dir) + "/checkpoints/last.ckpt")) << out;
  auto resumed = run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=100000" +
                             " --set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=2" +
                             " --set trainer.max_time=1");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming at step"), std::string::npos) << resumed.output;
}

TEST(Progress, PlainLinesUnderAPseudoTerminalThatIsNotTheUsers) {
  // As under mpirun with output to a file: our stdout is a pty, our parent's stdout is not.
  std::string dir = tessera::testing::fresh_dir("pty");
  std::string out = dir + "/out.txt";
  std::string command = "/usr/bin/python3 -c \"import pty, sys; pty.spawn(sys.argv[1:])\" " +
                        std::string(tessera::testing::tessera_binary()) + " fit --config " + write_config(dir) +
                        " --set trainer.max_steps=3 --set trainer.enable_progress_bar=auto > " + out + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << slurp(out);
  std::string text = slurp(out);
  EXPECT_EQ(text.find("\033["), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 0 step 3/3  loss "), std::string::npos) << text;
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
                              "over this rank's samples only: build it as tessera::sdk::SyncBatchNorm2d"),
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

// A model that freezes part of itself (requires_grad false: a fine-tuned backbone) keeps it
// frozen under every strategy: no gradient, no optimizer state, no weight decay moving it.
// The sharded engines once handed every parameter to the optimizer, so AdamW's decay moved
// the frozen weights and kept moments for them.
TEST(Frozen, ParametersThatRequireNoGradStayAsTheyWereUnderEveryStrategy) {
  const std::string dir = tessera::testing::fresh_dir("frozen");
  std::ofstream(dir + "/run.toml") << "plugin_dirs = [\"" TEST_PLUGIN_DIR "\"]\n"
                                   << "[trainer]\nmax_steps = 3\nseed = 1\nlog_every_n_steps = 1\n"
                                   << "[optimizer]\nname = \"adamw\"\nlr = 0.01\nweight_decay = 0.1\n"
                                   << "[model]\nplugin = \"layernorm_model\"\nfreeze_fc1 = true\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\nbatch_size = 24\ntrain_limit = 96\n";
  const std::string config = dir + "/run.toml";
  struct Run {
    std::string name, sets;
  };
  const std::vector<Run> runs = {
      {"initial", "--set optimizer.lr=0.0"},  // AdamW with lr 0 moves nothing: the initial weights
      {"single", ""},
      {"fsdp-3", "--set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=8"},
      {"fsdp2-2", "--set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=12 "
                  "--set strategy.state_dict_type=sharded --set checkpoint_io.plugin=distributed"}};
  std::map<std::string, std::map<std::string, at::Tensor>> weights;
  for (const Run& run : runs) {
    const std::string root = dir + "/" + run.name;
    auto r = run_tessera("fit --config " + config + " --set trainer.default_root_dir=" + root + " " + run.sets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("394 trainable params, 25.1 K non-trainable"), std::string::npos) << r.output;
    const std::string last = run_dir(root) + "/checkpoints/last";
    const std::string full = dir + "/" + run.name + ".ckpt";
    ASSERT_EQ(run_tessera("checkpoint export " + last + " --to " + full).exit_code, 0);
    weights[run.name] = tessera::testing::checkpoint_state(full);
    auto c = tessera::core::checkpoint_dict(tessera::core::load_pickle(full), full);
    auto optimizer = c.at("optimizer_states").toListRef()[0].toGenericDict();
    std::vector<std::string> names;
    for (const auto& name : optimizer.at("param_names").toListRef()) names.push_back(name.toStringRef());
    EXPECT_EQ(names, (std::vector<std::string>{"norm.weight", "norm.bias", "fc2.weight", "fc2.bias"})) << run.name;
    EXPECT_EQ(optimizer.at("state").toGenericDict().size(), 4u) << run.name;
  }
  for (const Run& run : runs) {
    for (const char* frozen : {"fc1.weight", "fc1.bias"})
      EXPECT_TRUE(at::equal(weights[run.name][frozen], weights["initial"][frozen])) << run.name << " moved " << frozen;
    if (run.name == "initial" || run.name == "single") continue;
    for (const char* trained : {"fc2.weight", "norm.weight"})
      EXPECT_TRUE(at::allclose(weights[run.name][trained], weights["single"][trained], 1e-4, 1e-6)) << run.name << " " << trained;
  }
  EXPECT_FALSE(at::equal(weights["single"]["fc2.weight"], weights["initial"]["fc2.weight"])) << "nothing was trained";

  // Resumed across strategies and world sizes, full and sharded: the moments of the four.
  auto r = run_tessera("fit --config " + config + " --set trainer.default_root_dir=" + dir + "/fsdp-3 --ckpt-path last " +
                       "--set trainer.max_steps=4 --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=12");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("fit --config " + config + " --set trainer.default_root_dir=" + dir + "/fsdp2-2 --ckpt-path last " +
                  "--set trainer.max_steps=4 --set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=8 " +
                  "--set checkpoint_io.plugin=distributed");
  EXPECT_EQ(r.exit_code, 0) << r.output;

  // The plan counts optimizer state for the 394 trainable elements only.
  auto optimizer_bytes = [&](const std::string& freeze) {
    auto plan = run_tessera("plan --config " + config + " --json --set launch.devices=2 --set strategy.plugin=fsdp " +
                            "--set model.freeze_fc1=" + freeze);
    EXPECT_EQ(plan.exit_code, 0) << plan.output;
    return nlohmann::json::parse(plan.output.substr(plan.output.find('{')))["per_rank_bytes"]["optimizer state"].get<double>();
  };
  EXPECT_EQ(optimizer_bytes("true"), 2 * 4 * 197);  // two fp32 moments of half the 394
  EXPECT_GT(optimizer_bytes("false"), 2 * 4 * 12000);
}

// A parameter made trainable after setup (a fine-tuning callback's unfreeze) would train on no
// strategy (the optimizer holds the trainable ones only) and differently on each: refused at
// the next step, before its forward.
TEST(Frozen, RequiresGradChangedAfterSetupStopsTheRun) {
  const std::string dir = tessera::testing::fresh_dir("unfreeze");
  std::ofstream(dir + "/run.toml") << "plugin_dirs = [\"" TEST_PLUGIN_DIR "\"]\n"
                                   << "[trainer]\nmax_steps = 4\nseed = 1\nlog_every_n_steps = 1\n"
                                   << "default_root_dir = \"" << dir << "\"\n"
                                   << "[model]\nplugin = \"layernorm_model\"\nfreeze_fc1 = true\n"
                                   << "unfreeze_fc1_at_batch = 1\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\nbatch_size = 8\ntrain_limit = 96\n";
  for (const std::string& sets : {std::string(""), std::string(" --set launch.devices=2 --set strategy.plugin=ddp"),
                                  std::string(" --set launch.devices=2 --set strategy.plugin=fsdp"),
                                  std::string(" --set launch.devices=2 --set strategy.plugin=fsdp2")}) {
    auto r = run_tessera("fit --config " + dir + "/run.toml" + sets);
    EXPECT_EQ(r.exit_code, 1) << sets << "\n" << r.output;
    EXPECT_NE(r.output.find("step 3: parameter 'fc1.weight' had requires_grad = false when the optimizer was built and "
                            "has true now (changed by a callback or the model)"),
              std::string::npos) << sets << "\n" << r.output;
    EXPECT_EQ(r.output.find("step 3/4"), std::string::npos) << sets << ": a step ran after the change\n" << r.output;
  }
}

// [trainer] freeze: named modules stop training on every strategy; a unit with nothing to
// train is gathered for backward (its inputs need gradients) but gets no gradient buffers and
// no reduce-scatter (PyTorch's FSDP2 skips it alike).
TEST(Frozen, TrainerFreezeStopsModulesAndFrozenUnitsAreNotReduced) {
  const std::string dir = tessera::testing::fresh_dir("freeze");
  const std::string config = write_config(dir, "[lr_scheduler]\nschedule = \"constant\"\n");
  const std::string sets = kNoDropout + " --set trainer.max_steps=3 --set trainer.profiler=trace "
                           "--set trainer.gradient_clip_val=0.05 "  // the norm over units with and without gradients
                           "--set 'trainer.freeze=[\"wpe\", \"blocks.1\"]' ";
  struct Run {
    std::string name, sets;
  };
  const std::vector<Run> runs = {
      {"initial", "--set optimizer.lr=0.0 --set data.batch_size=6"},
      {"single", "--set data.batch_size=6"},
      {"fsdp-3", "--set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=2"},
      {"fsdp2-2", "--set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=3 "
                  "--set 'strategy.activation_checkpointing=[\"Block\"]'"}};
  std::map<std::string, std::map<std::string, at::Tensor>> weights;
  std::map<std::int64_t, double> reference;
  for (const Run& run : runs) {
    const std::string root = dir + "/" + run.name;
    auto r = run_tessera("fit --config " + config + sets + run.sets + " --set trainer.default_root_dir=" + root);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("M frozen by [trainer] freeze"), std::string::npos) << r.output;
    weights[run.name] = tessera::testing::checkpoint_state(run_dir(root) + "/checkpoints/last.ckpt");
    auto losses = metric_series(run_dir(root) + "/metrics.csv", "train", "train_loss");
    if (run.name == "single") reference = losses;
    if (run.name != "initial" && run.name != "single") expect_losses_equal(reference, losses, 1, 3, 1e-4);
    if (run.name.rfind("fsdp", 0) != 0) continue;
    const std::string trace = file_bytes(run_dir(root) + "/trace-rank-0.json");
    EXPECT_NE(trace.find("reduce-scatter of blocks.0"), std::string::npos) << run.name;
    EXPECT_EQ(trace.find("reduce-scatter of blocks.1"), std::string::npos) << run.name << ": a frozen unit was reduced";
  }
  for (const auto& [name, initial] : weights["initial"]) {
    const bool frozen = name == "wpe.weight" || name.rfind("blocks.1.", 0) == 0;
    for (const char* run : {"single", "fsdp-3", "fsdp2-2"})
      EXPECT_EQ(at::equal(weights[run][name], initial), frozen) << run << " " << name;
  }

  auto r = run_tessera("fit --config " + config + " --set 'trainer.freeze=[\"blocks.9\"]' --set launch.devices=2 " +
                       "--set strategy.plugin=fsdp --set data.batch_size=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.output.find("launched"), std::string::npos) << "refused before any rank starts\n" << r.output;
  EXPECT_NE(r.output.find("[trainer] freeze: \"blocks.9\" names no parameter or module of model 'gpt'"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("its top-level modules: wte, wpe, drop, blocks, ln_f"), std::string::npos) << r.output;
  auto plan_of = [&](const std::string& sets) {
    auto plan = run_tessera("plan --config " + config + sets + " --json");
    EXPECT_EQ(plan.exit_code, 0) << plan.output;
    return nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  };
  const std::string frozen = " --set 'trainer.freeze=[\"wpe\", \"blocks.1\"]'";
  auto bytes = [](const nlohmann::json& plan, const char* what) { return plan["per_rank_bytes"][what].get<double>(); };
  // 34,688 parameters, of which wpe (1,024) and blocks.1 (12,704) are frozen: two fp32 moments
  // each and no gradient.
  auto plan = plan_of(frozen), unfrozen = plan_of("");
  EXPECT_EQ(bytes(unfrozen, "optimizer state") - bytes(plan, "optimizer state"), 2 * 4 * (1024 + 12704));
  EXPECT_EQ(bytes(unfrozen, "gradients") - bytes(plan, "gradients"), 4 * (1024 + 12704));
  // Sharded over 2 ranks: blocks.1, a unit with nothing to train, keeps no gradient shard (wpe's
  // is part of the root's, which trains) and is not reduce-scattered.
  const std::string fsdp = " --set launch.devices=2 --set strategy.plugin=fsdp";
  plan = plan_of(fsdp + frozen), unfrozen = plan_of(fsdp);
  EXPECT_EQ(bytes(unfrozen, "gradients") - bytes(plan, "gradients"), 4 * 12704 / 2);
  EXPECT_EQ(unfrozen["sent_per_step_bytes"].get<double>() - plan["sent_per_step_bytes"].get<double>(), 4 * 12704 / 2);
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
