// host::Config: values, defaults, --set overrides and every error path (file, line, key,
// valid choices, "did you mean"); plugin creation errors from the loader; the LR schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "config/config.hpp"
#include "tessera/core/checkpoint.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/error.hpp"
#include "train/lr_find.hpp"
#include "train/lr_schedule.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::host::Config;

/// Writes `text` to a fresh file named after the running test and returns its path.
std::string write_toml(const std::string& text) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::temp_directory_path() / ("tessera-config-test-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::path path = dir / (std::string(info->test_suite_name()) + "." + info->name() + ".toml");
  std::ofstream(path) << text;
  return path.string();
}

/// Loads `text` and returns the error message (fails the test when it loads).
std::string load_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  std::string path = write_toml(text);
  try {
    Config::load(path, overrides);
  } catch (const tessera::sdk::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error for:\n" << text;
  return "";
}

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

TEST(Config, ReadsEverySection) {
  std::string path = write_toml(R"(plugin_dirs = ["/opt/plugins"]
[trainer]
max_steps = 20
accumulate_grad_batches = 2
gradient_clip_val = 1.5
gradient_clip_algorithm = "norm"
norm_type = 2.0
val_check_interval = 5
limit_val_batches = 3
log_every_n_steps = 2
seed = 7
default_root_dir = "runs/x"
checkpoint_every_n_steps = 10
save_last = false
enable_progress_bar = false
[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 1e-4
[lr_scheduler]
schedule = "constant"
warmup_steps = 4
[launch]
devices = 2
master_port = 29511
[strategy]
plugin = "fsdp"
sharding_strategy = "FULL_SHARD"
[data]
plugin = "fashion_mnist"
batch_size = 32
shuffle = false
)");
  Config c = Config::load(path, {});
  EXPECT_EQ(c.path(), path);
  EXPECT_EQ(c.plugin_dirs, std::vector<std::string>{"/opt/plugins"});
  EXPECT_EQ(c.trainer.max_steps, 20);
  EXPECT_EQ(c.trainer.accumulate_grad_batches, 2);
  EXPECT_DOUBLE_EQ(c.trainer.gradient_clip_val, 1.5);
  EXPECT_EQ(c.trainer.val_check_interval, 5);
  EXPECT_FALSE(c.trainer.limit_val_batches.fraction);
  EXPECT_EQ(c.trainer.limit_val_batches.of(10), 3);
  EXPECT_EQ(c.trainer.seed, 7);
  EXPECT_EQ(c.trainer.default_root_dir, "runs/x");
  EXPECT_EQ(c.trainer.checkpoint_every_n_steps, 10);
  EXPECT_FALSE(c.trainer.save_last);
  EXPECT_EQ(c.trainer.enable_progress_bar, "false");
  EXPECT_EQ(c.optimizer.name, "sgd");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.1);
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 1e-4);
  EXPECT_EQ(c.schedule.schedule, "constant");
  EXPECT_EQ(c.schedule.warmup_steps, 4);
  EXPECT_EQ(c.launch.devices, 2);
  EXPECT_EQ(c.launch.master_port, 29511);
  EXPECT_EQ(c.plugin_names.at("strategy"), "fsdp");
  EXPECT_EQ(c.plugin_names.at("data"), "fashion_mnist");
  EXPECT_EQ(c.data.batch_size, 32);
  EXPECT_FALSE(c.data.shuffle);
  // Plugin keys are left for the plugin: sharding_strategy is still unread.
  EXPECT_EQ(c.plugins.at("strategy").get_string("sharding_strategy", ""), "FULL_SHARD");
}

TEST(Config, DefaultsAreSensible) {
  Config c = Config::load(write_toml(""), {});
  EXPECT_EQ(c.plugin_names.at("strategy"), "single_device");
  EXPECT_EQ(c.plugin_names.at("precision"), "precision");
  EXPECT_EQ(c.plugin_names.at("checkpoint_io"), "torch");
  EXPECT_EQ(c.optimizer.name, "adamw");
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.trainer.accumulate_grad_batches, 1);
  EXPECT_EQ(c.trainer.max_steps, -1);
  EXPECT_EQ(c.trainer.max_epochs, 1);
  EXPECT_EQ(c.schedule.schedule, "cosine");
  EXPECT_EQ(c.schedule.warmup_steps, 0);
  EXPECT_EQ(c.launch.devices, 1);
  EXPECT_TRUE(c.data.shuffle);
}

// Issue 64's spelling: [trainer] checkpoint_format names the [checkpoint_io] plugin.
TEST(Config, CheckpointFormatChoosesTheCheckpointIoPlugin) {
  EXPECT_EQ(Config::load(write_toml("[trainer]\ncheckpoint_format = \"dcp\"\n"), {}).plugin_names.at("checkpoint_io"),
            "dcp");
  EXPECT_EQ(Config::load(write_toml("[trainer]\ncheckpoint_format = \"dcp\"\n[checkpoint_io]\nplugin = \"dcp\"\n"), {})
                .plugin_names.at("checkpoint_io"),
            "dcp");
  EXPECT_CONTAINS(load_error("[trainer]\ncheckpoint_format = \"dcp\"\n[checkpoint_io]\nplugin = \"torch\"\n"),
                  "[checkpoint_io] plugin = \"torch\" and [trainer] checkpoint_format = \"dcp\" choose different "
                  "checkpoint formats: keep one");
  EXPECT_CONTAINS(load_error("[trainer]\ncheckpoint_format = \"pt\"\n"), "checkpoint_format");
}

TEST(Config, ScheduleKeysMayLiveInTheOptimizerSection) {
  Config c = Config::load(write_toml("[optimizer]\nlr = 0.01\nwarmup_steps = 3\nmin_lr = 0.001\n"), {});
  EXPECT_EQ(c.schedule.warmup_steps, 3);
  EXPECT_DOUBLE_EQ(c.schedule.min_lr, 0.001);
}

TEST(Config, ScheduleKeySetTwiceIsAnError) {
  std::string e = load_error("[optimizer]\nwarmup_steps = 3\n[lr_scheduler]\nwarmup_steps = 4\n");
  EXPECT_CONTAINS(e, ":2: [optimizer] warmup_steps and ");
  EXPECT_CONTAINS(e, ":4: [lr_scheduler] warmup_steps both set the schedule's warmup_steps");
}

TEST(Config, MinLrAboveLrIsAnError) {
  EXPECT_CONTAINS(load_error("[optimizer]\nlr = 0.001\nmin_lr = 0.01\n"), "min_lr = 0.01 is above [optimizer] lr");
}

TEST(Config, SetOverridesParseValuesAsToml) {
  Config c = Config::load(write_toml("[trainer]\nmax_steps = 100\n[strategy]\nplugin = \"fsdp\"\n"),
                          {"trainer.max_steps=5", "strategy.sharding_strategy=\"SHARD_GRAD_OP\"",
                           "data.prompt=Hello", "optimizer.betas=[0.8, 0.9]", "trainer.save_last=false",
                           "optimizer.lr=2e-3", "model.plugin=mlp"});
  EXPECT_EQ(c.trainer.max_steps, 5);
  EXPECT_FALSE(c.trainer.save_last);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-3);
  EXPECT_EQ(c.plugin_names.at("model"), "mlp");  // a section the file does not have
  EXPECT_EQ(c.plugins.at("strategy").get_string("sharding_strategy", ""), "SHARD_GRAD_OP");
  EXPECT_EQ(c.plugins.at("data").get_string("prompt", ""), "Hello");  // a bare word is a string
}

TEST(Config, SetValuesWithSpacesAndEqualsSigns) {
  Config c = Config::load(write_toml(""), {"data.prompt=Q: a = b?"});
  EXPECT_EQ(c.plugins.at("data").get_string("prompt", ""), "Q: a = b?");
}

TEST(Config, SetErrorsNameTheOverride) {
  EXPECT_CONTAINS(load_error("", {"max_steps=5"}), "--set max_steps=5: expected section.key=value");
  EXPECT_CONTAINS(load_error("", {"trainer.max_steps"}), "expected section.key=value");
  std::string e = load_error("", {"trainer.max_steps=\"five\""});
  EXPECT_CONTAINS(e, "[trainer] max_steps must be an integer, found string");
  EXPECT_CONTAINS(e, "--set trainer.max_steps=\"five\"");
  EXPECT_CONTAINS(load_error("", {"trainr.max_steps=5"}), "unknown section [trainr] (did you mean 'trainer'?)");
}

TEST(Config, MissingFileIsNamed) {
  try {
    Config::load("/nonexistent/run.toml", {});
    FAIL() << "expected an error";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_CONTAINS(e.what(), "config file /nonexistent/run.toml does not exist");
  }
}

TEST(Config, InvalidTomlNamesFileLineAndColumn) {
  std::string path = write_toml("[trainer]\nmax_steps = = 3\n");
  std::string e = load_error("[trainer]\nmax_steps = = 3\n");
  EXPECT_CONTAINS(e, ":2:");
  EXPECT_CONTAINS(e, "invalid TOML");
}

TEST(Config, UnknownSectionSuggestsTheClosest) {
  std::string e = load_error("[trainer]\nmax_steps = 3\n\n[optimiser]\nlr = 0.1\n");
  EXPECT_CONTAINS(e, ":4: unknown section [optimiser] (did you mean 'optimizer'?)");
  EXPECT_CONTAINS(e, "valid sections: trainer, optimizer, lr_scheduler, lr_find, launch, logger, callbacks, strategy, precision");
}

TEST(Config, TopLevelKeysOtherThanPluginDirsAreErrors) {
  std::string e = load_error("plugin_dir = [\"/x\"]\n");
  EXPECT_CONTAINS(e, ":1: unknown top-level key plugin_dir (did you mean 'plugin_dirs'?)");
  EXPECT_CONTAINS(load_error("seed = 3\n[trainer]\n"), "every other key belongs in a section");
}

TEST(Config, BatchLimitsFollowLightning) {
  Config c = Config::load(
      write_toml("[trainer]\nlimit_val_batches = 0.25\nlimit_test_batches = 0\nlimit_predict_batches = 1.0\n"), {});
  EXPECT_EQ(c.trainer.limit_val_batches.of(10), 2);  // a fraction, rounded down
  EXPECT_EQ(c.trainer.limit_val_batches.of(3), 1);   // ... but at least one batch
  EXPECT_EQ(c.trainer.limit_test_batches.of(10), 0);  // 0 skips the loop
  EXPECT_EQ(c.trainer.limit_predict_batches.of(7), 7);
  Config d = Config::load(write_toml(""), {});
  EXPECT_EQ(d.trainer.limit_val_batches.of(9), 9);  // default: all
  EXPECT_EQ(d.trainer.limit_predict_batches.of(9), 1);
  EXPECT_EQ(d.trainer.limit_val_batches.of(0), 0);
  EXPECT_CONTAINS(load_error("[trainer]\nlimit_val_batches = 1.5\n"), "limit_val_batches = 1.5 is out of range [0, 1]");
  EXPECT_CONTAINS(load_error("[trainer]\nlimit_val_batches = -1\n"), "limit_val_batches = -1 is out of range [0, ");
  EXPECT_CONTAINS(load_error("[trainer]\nlimit_test_batches = \"all\"\n"),
                  ":2: [trainer] limit_test_batches must be an integer (a number of batches, 0 skips the loop) or a "
                  "float in [0.0, 1.0] (a fraction of the batches), found string");
}

TEST(Config, TrainingLoopKeysFollowLightning) {
  Config c = Config::load(write_toml("[trainer]\nlimit_train_batches = 0.5\nval_check_interval = 0.25\n"
                                     "check_val_every_n_epoch = 2\nnum_sanity_val_steps = -1\nmin_steps = 3\n"
                                     "min_epochs = 1\nmax_epochs = 4\n"),
                          {});
  EXPECT_EQ(c.trainer.limit_train_batches.of(10), 5);
  EXPECT_EQ(c.trainer.val_check_interval, 0);  // a float is a fraction of an epoch, not steps
  EXPECT_DOUBLE_EQ(c.trainer.val_check_fraction, 0.25);
  EXPECT_EQ(c.trainer.check_val_every_n_epoch, 2);
  EXPECT_EQ(c.trainer.num_sanity_val_steps, -1);
  EXPECT_EQ(c.trainer.min_steps, 3);
  EXPECT_EQ(c.trainer.min_epochs, 1);
  Config d = Config::load(write_toml("[trainer]\nval_check_interval = 50\n"), {});
  EXPECT_EQ(d.trainer.val_check_interval, 50);
  EXPECT_DOUBLE_EQ(d.trainer.val_check_fraction, 1.0);
  EXPECT_EQ(d.trainer.num_sanity_val_steps, 2);  // Lightning's default
  EXPECT_EQ(d.trainer.limit_train_batches.of(9), 9);
  EXPECT_CONTAINS(load_error("[trainer]\nlimit_train_batches = 0\n"),
                  ":2: [trainer] limit_train_batches leaves no batch to train on");
  EXPECT_CONTAINS(load_error("[trainer]\nval_check_interval = 0.0\n"),
                  ":2: [trainer] val_check_interval = 0.0 is no fraction of an epoch");
  EXPECT_CONTAINS(load_error("[trainer]\nval_check_interval = 1.5\n"), "val_check_interval = 1.5 is out of range [0, 1]");
  EXPECT_CONTAINS(load_error("[trainer]\nval_check_interval = 10\ncheck_val_every_n_epoch = 2\n"),
                  ":2: [trainer] val_check_interval = 10 counts steps over the whole run, across epochs, so ");
  EXPECT_CONTAINS(load_error("[trainer]\ncheck_val_every_n_epoch = 0\n"), "check_val_every_n_epoch = 0 is out of range [1, ");
  EXPECT_CONTAINS(load_error("[trainer]\nnum_sanity_val_steps = -2\n"), "num_sanity_val_steps = -2 is out of range [-1, ");
  EXPECT_CONTAINS(load_error("[trainer]\nmax_steps = 5\nmin_steps = 10\n"),
                  ":3: [trainer] min_steps = 10 is more than ");
  EXPECT_CONTAINS(load_error("[trainer]\nmin_epochs = 3\n"),
                  ":2: [trainer] min_epochs = 3 is more than [trainer] max_epochs (default) = 1");
}

TEST(Config, EnableCheckpointingFalseRefusesTheKeysThatAskForCheckpoints) {
  Config c = Config::load(write_toml("[trainer]\nenable_checkpointing = false\nenable_model_summary = false\n"), {});
  EXPECT_FALSE(c.trainer.enable_checkpointing);
  EXPECT_FALSE(c.trainer.enable_model_summary);
  EXPECT_CONTAINS(load_error("[trainer]\nenable_checkpointing = false\nsave_last = true\n"),
                  ":2: [trainer] enable_checkpointing = false, but ");
  EXPECT_CONTAINS(load_error("[trainer]\nenable_checkpointing = false\ncheckpoint_every_n_steps = 5\n"),
                  ":3: [trainer] checkpoint_every_n_steps configures checkpoints: remove one of them");
}

TEST(Config, OverfitBatchesLimitsTrainingAndValidationUnshuffled) {
  Config c = Config::load(write_toml("[trainer]\noverfit_batches = 3\n"), {});
  EXPECT_EQ(c.trainer.limit_train_batches.of(100), 3);
  EXPECT_EQ(c.trainer.limit_val_batches.of(100), 3);
  EXPECT_FALSE(c.data.shuffle);
  Config f = Config::load(write_toml("[trainer]\noverfit_batches = 0.1\n"), {});
  EXPECT_EQ(f.trainer.limit_train_batches.of(100), 10);
  Config off = Config::load(write_toml("[trainer]\noverfit_batches = 0\n"), {});
  EXPECT_TRUE(off.data.shuffle);
  EXPECT_EQ(off.trainer.limit_train_batches.of(100), 100);
  EXPECT_CONTAINS(load_error("[trainer]\noverfit_batches = 2\nlimit_val_batches = 5\n"),
                  ":2: [trainer] overfit_batches sets limit_val_batches too: remove ");
  EXPECT_CONTAINS(load_error("[trainer]\noverfit_batches = 2\n[data]\nshuffle = true\n"),
                  ":4: [data] shuffle = true, but [trainer] overfit_batches trains on the same batches every epoch");
}

TEST(Config, FastDevRunShortensEveryLoopAndTurnsOffLoggersAndCheckpoints) {
  Config c = Config::load(write_toml("[trainer]\nfast_dev_run = 3\nmax_steps = 500\naccumulate_grad_batches = 2\n"
                                     "num_sanity_val_steps = 4\ncheckpoint_every_n_steps = 10\n"
                                     "[logger]\nloggers = [\"csv\", \"tensorboard\"]\n"),
                          {});
  EXPECT_EQ(c.trainer.max_steps, 3);
  EXPECT_EQ(c.trainer.max_epochs, 1);
  EXPECT_EQ(c.trainer.limit_train_batches.of(100), 6);  // 3 steps of 2 accumulated batches: one short epoch
  EXPECT_EQ(c.trainer.limit_val_batches.of(100), 3);
  EXPECT_EQ(c.trainer.limit_test_batches.of(100), 3);
  EXPECT_EQ(c.trainer.num_sanity_val_steps, 0);
  EXPECT_EQ(c.trainer.checkpoint_every_n_steps, 0);
  EXPECT_FALSE(c.trainer.save_last);
  EXPECT_TRUE(c.logger.loggers.empty());
  EXPECT_EQ(Config::load(write_toml("[trainer]\nfast_dev_run = true\n"), {}).trainer.max_steps, 1);
  Config off = Config::load(write_toml("[trainer]\nfast_dev_run = false\nmax_steps = 7\n"), {});
  EXPECT_EQ(off.trainer.max_steps, 7);
  EXPECT_EQ(off.logger.loggers.size(), 1u);
  EXPECT_CONTAINS(load_error("[trainer]\nfast_dev_run = \"yes\"\n"),
                  ":2: [trainer] fast_dev_run must be true, false or a number of batches");
  EXPECT_CONTAINS(load_error("[trainer]\nfast_dev_run = -1\n"), "fast_dev_run = -1 is out of range [0, ");
}

TEST(Config, SectionMustBeATable) {
  EXPECT_CONTAINS(load_error("trainer = 3\n"), "trainer must be a table ([trainer])");
}

TEST(Config, TypoKeySuggestsTheClosest) {
  std::string e = load_error("[trainer]\nmax_steps = 3\nmax_stpes = 4\n");
  EXPECT_CONTAINS(e, ":3: [trainer] max_stpes is not a known key (did you mean 'max_steps'?)");
  EXPECT_CONTAINS(e, "known keys:");
  EXPECT_CONTAINS(load_error("[optimizer]\nweight_decy = 0.1\n"),
                  "[optimizer] weight_decy is not a known key (did you mean 'weight_decay'?)");
  EXPECT_CONTAINS(load_error("[launch]\ndevice = 2\n"), "[launch] device is not a known key (did you mean 'devices'?)");
  EXPECT_CONTAINS(load_error("[lr_scheduler]\nwarmup_step = 2\n"),
                  "[lr_scheduler] warmup_step is not a known key (did you mean 'warmup_steps'?)");
}

TEST(Config, WrongTypeNamesExpectedAndFound) {
  EXPECT_CONTAINS(load_error("[trainer]\nmax_steps = \"ten\"\n"),
                  ":2: [trainer] max_steps must be an integer, found string \"ten\"");
  EXPECT_CONTAINS(load_error("[optimizer]\nlr = \"fast\"\n"), "[optimizer] lr must be a number, found string \"fast\"");
  // A quoted number gets the way out (TOML writes infinity as a bare inf).
  EXPECT_CONTAINS(load_error("[trainer]\ngradient_clip_val = 1.0\nnorm_type = \"inf\"\n"),
                  ":3: [trainer] norm_type must be a number, found string \"inf\": write it without quotes (inf)");
  EXPECT_CONTAINS(load_error("[trainer]\nsave_last = 1\n"), ":2: [trainer] save_last must be true or false, found integer");
  EXPECT_CONTAINS(load_error("[data]\nbatch_size = 2.5\n"), "[data] batch_size must be an integer, found floating-point");
  EXPECT_CONTAINS(load_error("plugin_dirs = \"/x\"\n"), "plugin_dirs must be an array of directory names");
}

TEST(Config, OutOfRangeNamesTheRange) {
  EXPECT_CONTAINS(load_error("[trainer]\naccumulate_grad_batches = 0\n"),
                  ":2: [trainer] accumulate_grad_batches = 0 is out of range [1, ");
  EXPECT_CONTAINS(load_error("[optimizer]\nlr = -0.1\n"), "[optimizer] lr = -0.1 is out of range [0, ");
  EXPECT_CONTAINS(load_error("[optimizer]\nbetas = [0.9, 1.5]\n"), "[optimizer] betas must be two numbers in [0, 1)");
  EXPECT_CONTAINS(load_error("[launch]\nmaster_port = 70000\n"), "[launch] master_port = 70000 is out of range [0, 65535]");
  EXPECT_CONTAINS(load_error("[launch]\nnodes = 2\nnode_rank = 2\n"), "[launch] node_rank = 2 is out of range [0, 1]");
  EXPECT_CONTAINS(load_error("[data]\nbatch_size = 0\n"), "[data] batch_size = 0 is out of range [1, ");
}

TEST(Config, BadChoiceListsTheValidOnes) {
  EXPECT_CONTAINS(load_error("[optimizer]\nname = \"adamww\"\n"),
                  "[optimizer] name = \"adamww\" is not valid (did you mean 'adamw'?); valid: adamw, adam, sgd");
  EXPECT_CONTAINS(load_error("[lr_scheduler]\nschedule = \"cosin\"\n"),
                  "schedule = \"cosin\" is not valid (did you mean 'cosine'?); valid: cosine, linear, constant");
  EXPECT_CONTAINS(load_error("[trainer]\ngradient_clip_val = 1.0\ngradient_clip_algorithm = \"valeu\"\n"),
                  "(did you mean 'value'?); valid: norm, value");
  EXPECT_CONTAINS(load_error("[launch]\ncluster_environment = \"slurn\"\n"), "(did you mean 'slurm'?)");
}

TEST(Config, GradientClippingKeysThatWouldBeIgnoredAreRefused) {
  const Config value = Config::load(write_toml("[trainer]\ngradient_clip_val = 0.5\ngradient_clip_algorithm = \"value\"\n"), {});
  EXPECT_EQ(value.trainer.gradient_clip_algorithm, "value");
  EXPECT_DOUBLE_EQ(value.trainer.gradient_clip_val, 0.5);
  EXPECT_EQ(Config::load(write_toml(""), {}).trainer.gradient_clip_algorithm, "norm");
  EXPECT_CONTAINS(load_error("[trainer]\ngradient_clip_val = 0.5\ngradient_clip_algorithm = \"value\"\nnorm_type = 1.0\n"),
                  ":4: [trainer] norm_type applies to gradient_clip_algorithm = \"norm\" only");
  EXPECT_CONTAINS(load_error("[trainer]\nnorm_type = 1.0\n"),
                  ":2: [trainer] norm_type is set but nothing is clipped (no [trainer] gradient_clip_val)");
  EXPECT_CONTAINS(load_error("[trainer]\ngradient_clip_val = 0.0\ngradient_clip_algorithm = \"norm\"\n"),
                  "gradient_clip_algorithm is set but nothing is clipped");
}

TEST(Config, NumWorkersIsRefusedWithAReason) {
  EXPECT_NO_THROW(Config::load(write_toml("[data]\nnum_workers = 0\n"), {}));
  EXPECT_CONTAINS(load_error("[data]\nnum_workers = 4\n"), ":2: [data] num_workers is not supported");
}

TEST(Config, PluginSectionsNeedAStringPluginName) {
  EXPECT_CONTAINS(load_error("[model]\nplugin = 3\n"), "[model] plugin must be a string");
}

/// Creating the configured plugins: the loader names unknown plugins, the plugin's own
/// getters and check_all_used name its keys (what the trainer does before any work).
std::shared_ptr<tessera::sdk::PluginObject> create_strategy(const Config& c) {
  tessera::core::PluginLoader loader(tessera::core::PluginLoader::search_path({PLUGIN_DIR}));
  const tessera::sdk::Options& options = c.plugins.at("strategy");
  auto object = loader.create(tessera::sdk::PluginKind::strategy, c.plugin_names.at("strategy"), options);
  options.check_all_used({"plugin"});
  return object;
}

std::string create_error(const std::string& text) {
  Config c = Config::load(write_toml(text), {});
  try {
    create_strategy(c);
  } catch (const tessera::sdk::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error for:\n" << text;
  return "";
}

TEST(ConfigPlugins, UnknownPluginIsALoaderErrorWithSuggestion) {
  EXPECT_CONTAINS(create_error("[strategy]\nplugin = \"single_devise\"\n"),
                  "no strategy plugin named 'single_devise' (did you mean 'single_device'?)");
}

TEST(ConfigPlugins, PluginKeysAreCheckedByThePlugin) {
  EXPECT_NO_THROW(create_strategy(Config::load(write_toml("[strategy]\naccelerator = \"cpu\"\n"), {})));
  std::string e = create_error("[strategy]\nplugin = \"single_device\"\naccelerater = \"cpu\"\n");
  EXPECT_CONTAINS(e, ":3: [strategy] accelerater is not a known key (did you mean 'accelerator'?)");
  EXPECT_CONTAINS(create_error("[strategy]\naccelerator = \"tpu\"\n"),
                  "[strategy] accelerator = \"tpu\" is not valid (did you mean 'cpu'?); valid: auto, cpu, cuda");
}

using tessera::host::LRSchedule;
using tessera::host::ScheduleSettings;

TEST(LRSchedule, LinearWarmupThenCosineToMinLr) {
  ScheduleSettings s;
  s.warmup_steps = 4;
  s.min_lr = 0.1;
  LRSchedule schedule(s, 1.0, 14);
  EXPECT_DOUBLE_EQ(schedule.lr(0), 0.25);
  EXPECT_DOUBLE_EQ(schedule.lr(3), 1.0);
  EXPECT_DOUBLE_EQ(schedule.lr(4), 1.0);  // the cosine starts at lr
  EXPECT_NEAR(schedule.lr(9), 0.1 + 0.45, 1e-12);  // half way: (lr + min_lr) / 2
  EXPECT_NEAR(schedule.lr(14), 0.1, 1e-12);
  EXPECT_NEAR(schedule.lr(100), 0.1, 1e-12);  // past the end it stays at min_lr
  for (std::int64_t step = 4; step < 14; ++step) EXPECT_GT(schedule.lr(step), schedule.lr(step + 1)) << step;
}

TEST(LRSchedule, LinearWarmupThenLinearDecayToMinLr) {
  ScheduleSettings s;
  s.schedule = "linear";
  s.warmup_steps = 2;
  s.min_lr = 0.2;
  LRSchedule schedule(s, 1.0, 10);
  EXPECT_DOUBLE_EQ(schedule.lr(0), 0.5);
  EXPECT_DOUBLE_EQ(schedule.lr(2), 1.0);
  for (std::int64_t step = 2; step <= 10; ++step)  // a straight line from lr at step 2 to min_lr at step 10
    EXPECT_NEAR(schedule.lr(step), 1.0 - 0.8 * static_cast<double>(step - 2) / 8.0, 1e-12) << step;
  EXPECT_NEAR(schedule.lr(50), 0.2, 1e-12);
}

TEST(LRSchedule, ConstantAndNoWarmup) {
  ScheduleSettings s;
  s.schedule = "constant";
  LRSchedule constant(s, 0.5, 10);
  for (std::int64_t step : {0, 5, 9}) EXPECT_DOUBLE_EQ(constant.lr(step), 0.5);
  ScheduleSettings c;
  LRSchedule cosine(c, 0.5, 10);
  EXPECT_DOUBLE_EQ(cosine.lr(0), 0.5);
  EXPECT_NEAR(cosine.lr(5), 0.25, 1e-12);
}

TEST(LRSchedule, StateDictHasLambdaLRKeysAndComparesAfterAReload) {
  ScheduleSettings s;
  s.warmup_steps = 2;
  LRSchedule schedule(s, 0.01, 8);
  auto state = schedule.state_dict(3);
  EXPECT_EQ(state.at("last_epoch").toInt(), 3);
  EXPECT_DOUBLE_EQ(state.at("base_lrs").toDoubleList().get(0), 0.01);
  EXPECT_DOUBLE_EQ(state.at("_last_lr").toDoubleList().get(0), schedule.lr(2));
  // Through a pickle, as in a checkpoint file.
  std::string path = write_toml("");
  tessera::core::save_pickle(state, path + ".pkl");
  auto loaded = tessera::core::checkpoint_dict(tessera::core::load_pickle(path + ".pkl"), "schedule");
  EXPECT_EQ(schedule.compare(loaded, 3, "ckpt"), "");
  EXPECT_THROW(schedule.compare(loaded, 4, "ckpt"), tessera::sdk::Error);
  LRSchedule longer(s, 0.01, 16);
  EXPECT_CONTAINS(longer.compare(loaded, 3, "ckpt"), "total_steps 8 -> 16");
}

using tessera::host::LrFindSettings;
using tessera::host::LrRangeTest;

TEST(LrRangeTest, RisesFromMinToMaxGeometricallyOrLinearly) {
  LrFindSettings s;
  s.min_lr = 1e-6;
  s.max_lr = 1.0;
  s.num_training = 7;
  LrRangeTest exponential(s);
  for (std::int64_t i = 0; i < 7; ++i) EXPECT_NEAR(exponential.lr(i), std::pow(10.0, -6.0 + i), 1e-12 * std::pow(10.0, i)) << i;
  s.mode = "linear";
  s.min_lr = 0.0;
  s.max_lr = 0.6;
  LrRangeTest linear(s);
  for (std::int64_t i = 0; i < 7; ++i) EXPECT_NEAR(linear.lr(i), 0.1 * static_cast<double>(i), 1e-12) << i;
}

TEST(LrRangeTest, SmoothsTheLossAndStopsOnceItDivergesOrIsNotFinite) {
  LrFindSettings s;
  LrRangeTest test(s);
  // Lightning's bias-corrected moving average (beta 0.98): equal losses smooth to themselves.
  EXPECT_TRUE(test.record(2.0));
  EXPECT_TRUE(test.record(2.0));
  EXPECT_NEAR(test.smoothed()[1], 2.0, 1e-12);
  EXPECT_TRUE(test.record(1.0));
  const double average = (0.98 * 0.98 * 0.02 * 2 + 0.98 * 0.02 * 2 + 0.02 * 1.0) / (1 - std::pow(0.98, 3));
  EXPECT_NEAR(test.smoothed()[2], average, 1e-12);
  // The best smoothed loss so far is ~1.97: a smoothed loss above 4 x that stops the test.
  bool go_on = true;
  while (go_on && test.steps() < 50) go_on = test.record(1000.0);
  EXPECT_FALSE(go_on);
  EXPECT_GT(test.smoothed().back(), 4 * average);
  EXPECT_LT(test.smoothed()[test.steps() - 2], 4 * average) << "it should stop at the first step above";
  LrRangeTest nan_loss(s);
  EXPECT_TRUE(nan_loss.record(3.0));
  EXPECT_FALSE(nan_loss.record(std::nan("")));
  s.early_stop_threshold = 0;  // never stops for a high loss; a non-finite one still ends it
  LrRangeTest never(s);
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(never.record(i == 0 ? 1.0 : 1e6)) << i;
  EXPECT_FALSE(never.record(INFINITY));
}

TEST(LrRangeTest, SuggestsTheSteepestFallAgainstLogLrSkippingTheStartAndTheEnd) {
  LrFindSettings s;
  s.num_training = 60;
  s.early_stop_threshold = 0;
  // A loss that falls as a logistic in log(lr), steepest at step 40, then rises past step 50.
  // A noisy dip at step 3 (skipped) and a cliff at the last step (skipped) do not count.
  LrRangeTest test(s);
  for (std::int64_t i = 0; i < 60; ++i) {
    double loss = 3.0 - 2.0 / (1.0 + std::exp(-(static_cast<double>(i) - 40.0) / 3.0));
    if (i == 3) loss -= 50;
    if (i > 50) loss += 0.5 * static_cast<double>(i - 50);
    if (i == 59) loss = -1e6;
    test.record(loss);
  }
  // The smoothing delays the curve by a few steps: the steepest smoothed fall comes after step 40.
  const std::optional<std::int64_t> best = test.suggestion();
  ASSERT_TRUE(best.has_value());
  EXPECT_GE(*best, 40);
  EXPECT_LE(*best, 50);
  std::int64_t steepest = 11;  // recomputed here: central differences in log(lr), i.e. in steps
  for (std::int64_t i = 11; i < 58; ++i)
    if (test.smoothed()[i + 1] - test.smoothed()[i - 1] < test.smoothed()[steepest + 1] - test.smoothed()[steepest - 1])
      steepest = i;
  EXPECT_EQ(*best, steepest);
  // Fewer than 2 points once the first 10 steps and the last are skipped: no suggestion.
  LrRangeTest short_test(s);
  for (int i = 0; i < 12; ++i) short_test.record(1.0 - 0.01 * i);
  EXPECT_FALSE(short_test.suggestion().has_value());
  short_test.record(0.8);
  EXPECT_TRUE(short_test.suggestion().has_value());
}

TEST(LrRangeTest, PlotsTheCurveWithTheSuggestionAndClipsADivergence) {
  LrFindSettings s;
  s.num_training = 40;
  s.min_lr = 1e-6;
  s.max_lr = 1.0;
  s.early_stop_threshold = 0;
  LrRangeTest test(s);
  for (int i = 0; i < 40; ++i) test.record(i < 38 ? 3.0 - 2.0 / (1.0 + std::exp(-(i - 25.0) / 2.0)) : 1e3);
  const std::string chart = test.plot(40, 8);
  std::vector<std::string> lines;
  for (std::stringstream in(chart); lines.emplace_back(), std::getline(in, lines.back());) {}
  lines.pop_back();
  ASSERT_EQ(lines.size(), 8u + 3u) << chart;  // 8 rows, the axis, its labels, the suggestion
  EXPECT_EQ(lines[0].substr(lines[0].find_first_not_of(' ')).rfind("3 |", 0), 0u) << chart;  // the first loss on top
  EXPECT_NE(lines[0].find('^'), std::string::npos) << "the divergence is clipped at the top\n" << chart;
  EXPECT_NE(lines[9].find("1e-06"), std::string::npos) << chart;
  EXPECT_NE(lines[9].find("lr (log scale)"), std::string::npos) << chart;
  const std::optional<std::int64_t> best = test.suggestion();
  ASSERT_TRUE(best.has_value());
  std::ostringstream suggested;
  suggested << std::setprecision(3) << test.lr(*best);
  EXPECT_NE(lines[10].find("^ o: suggested lr " + suggested.str()), std::string::npos) << chart;
  // The suggestion's column holds the 'o', straight above the '^' of the last line.
  const std::size_t column = lines[10].find('^');
  int marks = 0;
  for (int row = 0; row < 8; ++row) marks += lines[static_cast<std::size_t>(row)][column] == 'o';
  EXPECT_EQ(marks, 1) << chart;
  EXPECT_EQ(LrRangeTest(s).plot(), "");
}

TEST(Config, LrFindSectionIsCheckedBeforeAnyWork) {
  std::string path = write_toml("[lr_find]\nmin_lr = 1e-6\nmax_lr = 0.1\nnum_training = 40\nmode = \"linear\"\n"
                                "early_stop_threshold = 0\n");
  Config c = Config::load(path, {});
  EXPECT_DOUBLE_EQ(c.lr_find.min_lr, 1e-6);
  EXPECT_DOUBLE_EQ(c.lr_find.max_lr, 0.1);
  EXPECT_EQ(c.lr_find.num_training, 40);
  EXPECT_EQ(c.lr_find.mode, "linear");
  EXPECT_DOUBLE_EQ(c.lr_find.early_stop_threshold, 0.0);
  EXPECT_CONTAINS(load_error("[lr_find]\nmin_lr = 0.1\nmax_lr = 0.01\n"),
                  ":3: [lr_find] max_lr = 0.01 is not above min_lr = 0.1");
  EXPECT_CONTAINS(load_error("[lr_find]\nmin_lr = 0.0\n"), "an exponential range starts above 0");
  EXPECT_CONTAINS(load_error("[lr_find]\nnum_trainng = 5\n"), "(did you mean 'num_training'?)");
  EXPECT_CONTAINS(load_error("[lr_find]\nmode = \"cosine\"\n"), "valid: exponential, linear");
  EXPECT_CONTAINS(load_error("[trainer]\nfast_dev_run = true\n[lr_find]\nbefore_fit = true\n"),
                  ":4: [lr_find] before_fit = true runs [lr_find] num_training steps before fit");
  EXPECT_CONTAINS(load_error("[lr_find]\nnum_training = 1\n"), "[lr_find] num_training = 1 is out of range [2, ");
}

}  // namespace
