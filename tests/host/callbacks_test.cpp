// Callbacks (model checkpoint, early stopping, lr monitor), the TensorBoard logger and the profiler.
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
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

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
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
  r = run_tessera("test --config " + config + " --ckpt-path best --set trainer.limit_test_batches=1 --set data.test_fraction=0.02");
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
  auto decoded = nlohmann::json::parse(file_bytes(json_path));
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
    auto json = nlohmann::json::parse(file_bytes(path));
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

// profiler = "pytorch" (Lightning's PyTorchProfiler): LibTorch's profiler over training steps 3 to
// 5, Lightning's default schedule (steps 3-4 of a 4-step run): each rank's trace holds the model's
// operators, and the table says where the steps went. On CUDA with Kineto the device's kernels
// come too (bench/gpu: `[trainer] profiler = "pytorch"` on the GPU rows).
TEST(Profiler, PyTorchProfilerRecordsStepsThreeToFiveOnEveryRank) {
  std::string dir = tessera::testing::fresh_dir("torch-profiler");
  for (const int steps : {6, 4}) {
    auto r = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=" + std::to_string(steps) +
                         " --set trainer.profiler=pytorch --set launch.devices=2 --set strategy.plugin=fsdp "
                         "--set data.batch_size=2");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string window = steps == 6 ? "training steps 3-5 of rank 0" : "training steps 3-4 of rank 0";
    for (const std::string text : {"Profiler report (pytorch): " + window, std::string("host operators by time"),
                                   std::string("aten::")})
      EXPECT_NE(r.output.find(text), std::string::npos) << text << "\n" << r.output;
    EXPECT_TRUE(fs::exists(run_dir(dir) + "/profiler.txt"));
    for (int rank = 0; rank < 2; ++rank) {
      const std::string path = run_dir(dir) + "/pytorch-trace-rank-" + std::to_string(rank) + ".json";
      ASSERT_TRUE(fs::exists(path)) << path;
      std::set<std::string> ops;
      const auto trace = nlohmann::json::parse(file_bytes(path));
      for (const auto& e : trace["traceEvents"])
        if (e["ph"] == "X") {
          ops.insert(e["name"].get<std::string>());
          EXPECT_EQ(e["pid"].get<int>(), rank) << "a host operator under another rank's pid in " << path;
        }
      EXPECT_TRUE(std::any_of(ops.begin(), ops.end(), [](const std::string& op) { return op.find("mm") != std::string::npos; }))
          << "no matrix product among " << ops.size() << " operators in " << path;
    }
  }
}

}  // namespace
