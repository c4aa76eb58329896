// [callbacks] weight_averaging / ema_weight_averaging against PyTorch and across resumes.
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

}  // namespace
