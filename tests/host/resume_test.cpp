// Exact resume (across strategies and world sizes) and what a checkpoint holds, read by Python.
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

}  // namespace
