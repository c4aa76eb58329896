// End-to-end behaviour of the `tessera` binary: exact resume (also across strategies and
// world sizes), checkpoint contents, predict, bad input, and failing ranks.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::testing::metric_series;
using tessera::testing::run_tessera;

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

void expect_losses_equal(const std::map<std::int64_t, double>& a, const std::map<std::int64_t, double>& b,
                         std::int64_t from, std::int64_t to, double tol) {
  for (std::int64_t step = from; step <= to; ++step) {
    ASSERT_TRUE(a.count(step) && b.count(step)) << "no loss logged at step " << step;
    EXPECT_NEAR(a.at(step), b.at(step), tol) << "step " << step;
  }
}

/// An uninterrupted run, and the same run killed at step 6 and resumed from its step-4
/// checkpoint with --ckpt-path (possibly under another strategy / world size with the same
/// global batch). The resumed losses (steps 5-8) must equal the uninterrupted ones.
void check_resume(const std::string& name, const std::string& first_sets, const std::string& resume_sets, double tol) {
  std::string full = tessera::testing::fresh_dir(name + "-full");
  auto a = run_tessera("fit --config " + write_config(full) + " " + first_sets);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  std::string part = tessera::testing::fresh_dir(name + "-part");
  auto b = run_tessera("fit --config " + write_config(part) + " " + first_sets, "TESSERA_FAULT_INJECT=rank=0,step=6,kind=kill");
  ASSERT_NE(b.exit_code, 0) << b.output;
  ASSERT_FALSE(fs::exists(part + "/checkpoints/last.ckpt"));
  auto c = run_tessera("fit --config " + part + "/run.toml --ckpt-path " + part + "/checkpoints/step=4.ckpt " +
                       resume_sets);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("resuming at step 4"), std::string::npos) << c.output;
  expect_losses_equal(metric_series(full + "/metrics.csv", "train", "train_loss"),
                      metric_series(part + "/metrics.csv", "train", "train_loss"), 1, 8, tol);
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
  auto c = run_tessera("fit --config " + part + "/run.toml --ckpt-path " + part + "/checkpoints/step=4.ckpt " + sets);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  expect_losses_equal(metric_series(full + "/metrics.csv", "train", "train_loss"),
                      metric_series(part + "/metrics.csv", "train", "train_loss"), 1, 10, 1e-6);
  auto val_full = metric_series(full + "/metrics.csv", "val", "val_loss");
  auto val_part = metric_series(part + "/metrics.csv", "val", "val_loss");
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

TEST(Checkpoint, HasTheDocumentedKeysAndFullShapes) {
  std::string dir = tessera::testing::fresh_dir("keys");
  auto r = run_tessera("fit --config " + write_config(dir) +
                       " --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(fs::exists(dir + "/checkpoints/step=4.ckpt"));
  auto checkpoint = tessera::core::checkpoint_dict(tessera::core::load_pickle(dir + "/checkpoints/last.ckpt"), "last");
  for (const char* key : {"state_dict", "optimizer_states", "precision_plugin", "global_step", "epoch",
                          "batch_in_epoch", "lr_schedulers", "rng_state", "hyper_parameters", "tessera_version"})
    EXPECT_TRUE(checkpoint.contains(key)) << key;
  EXPECT_EQ(checkpoint.at("global_step").toInt(), 8);
  auto state = tessera::testing::checkpoint_state(dir + "/checkpoints/last.ckpt");
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
  std::string command = "/usr/bin/python3 -c \"import torch; c = torch.load('" + dir +
                        "/checkpoints/last.ckpt'); assert c['global_step'] == 2; "
                        "assert tuple(c['state_dict']['wte.weight'].shape) == (256, 32); print('ok')\"";
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

TEST(BadInput, WrongShapesInACheckpointAreRefusedAndTheCheckpointKept) {
  std::string dir = tessera::testing::fresh_dir("shapes");
  ASSERT_EQ(run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=4").exit_code, 0);
  std::string before = file_bytes(dir + "/checkpoints/last.ckpt");
  auto r = run_tessera("fit --config " + dir + "/run.toml --ckpt-path last --set model.n_embd=48");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("has shape [256, 32]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("different model configuration"), std::string::npos) << r.output;
  EXPECT_EQ(file_bytes(dir + "/checkpoints/last.ckpt"), before) << "the existing checkpoint was modified";
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

TEST(BadInput, MissingDataFileNamesTheKeyAndPackage) {
  std::string dir = tessera::testing::fresh_dir("nodata");
  auto r = run_tessera("fit --config " + write_config(dir) + " --set data.path=/nonexistent/corpus.txt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[data] path = \"/nonexistent/corpus.txt\": no such file or directory"), std::string::npos)
      << r.output;
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
                         " --set trainer.max_steps=3 --set trainer.enable_progress_bar=true --set trainer.save_last=false");
  ASSERT_EQ(bar.exit_code, 0) << bar.output;
  EXPECT_NE(bar.output.find("\r\033[Kstep 3/3  loss "), std::string::npos) << bar.output;
  EXPECT_NE(bar.output.find(" tokens/s"), std::string::npos) << bar.output;
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/last.ckpt"));
  std::string plain_dir = tessera::testing::fresh_dir("plain");
  auto plain = run_tessera("fit --config " + write_config(plain_dir) + " --set trainer.max_steps=3");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("\r"), std::string::npos) << "no bar when enable_progress_bar = false";
  EXPECT_NE(plain.output.find("epoch 0 step 3/3  loss "), std::string::npos) << plain.output;
  std::ifstream csv(plain_dir + "/metrics.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header, "step,epoch,stage,metric,value");
  EXPECT_EQ(metric_series(plain_dir + "/metrics.csv", "train", "train_loss").size(), 3u);
  auto lr = metric_series(plain_dir + "/metrics.csv", "train", "lr");
  ASSERT_EQ(lr.size(), 3u);
  EXPECT_NEAR(lr.at(1), 0.0015, 1e-12);  // warmup_steps = 2: lr / 2, then lr
  EXPECT_NEAR(lr.at(2), 0.003, 1e-12);
  EXPECT_GT(metric_series(plain_dir + "/metrics.csv", "train", "tokens_per_s").at(3), 0.0);
  EXPECT_TRUE(fs::exists(plain_dir + "/logs/rank-0.log"));
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
  expect_losses_equal(metric_series(a_dir + "/metrics.csv", "train", "train_loss"),
                      metric_series(b_dir + "/metrics.csv", "train", "train_loss"), 1, 4, 1e-5);
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

TEST(Cli, PluginsListsEveryShippedPlugin) {
  auto r = run_tessera("plugins");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"single_device", "ddp", "fsdp", "fsdp_cpu_offload", "precision", "fsdp-precision",
                           "torch", "distributed", "gpt", "mlp", "cnn", "text", "fashion_mnist"})
    EXPECT_NE(r.output.find(std::string(" ") + name + " "), std::string::npos) << name << "\n" << r.output;
}

}  // namespace
