// The training loop: progress and metrics, accumulation, limits, stopping, run folders, frozen parameters.
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
                         "--set trainer.limit_val_batches=2 --set trainer.limit_test_batches=2 --set data.test_fraction=0.02");
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
    std::string saved = file_bytes(run + "/config.toml");
    EXPECT_NE(saved.find("\nmax_steps = " + std::to_string(2 + i) + "  # "), std::string::npos) << saved;
    EXPECT_NE(saved.find("\nn_embd = 32  # "), std::string::npos) << saved;
    EXPECT_NE(saved.find("\n# accumulate_grad_batches = 1  # "), std::string::npos) << saved;
    EXPECT_NE(saved.find("\n# tie_embeddings = true  # "), std::string::npos) << saved;
    std::string hparams = file_bytes(run + "/hparams.yaml");
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
  std::string out = file_bytes(dir + "/out.txt");
  EXPECT_EQ(file_bytes(dir + "/rc"), "130\n") << out;
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
  ASSERT_EQ(std::system(command.c_str()), 0) << file_bytes(out);
  std::string text = file_bytes(out);
  EXPECT_EQ(text.find("\033["), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 0 step 3/3  loss "), std::string::npos) << text;
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

}  // namespace
