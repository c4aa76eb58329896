// tessera lr-find: the range test under every strategy, and fit started with its suggestion.
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
  // Resuming keeps the run's learning rate: no test. (`last` is the fsdp-3 run's, without dropout:
  // a resume with another model hyper-parameter is refused.)
  auto resumed =
      run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=10 --set model.dropout=0.0");
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

}  // namespace
