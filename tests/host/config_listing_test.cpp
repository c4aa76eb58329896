// tessera config: every key with its default, and the listing as an equivalent config.
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

/// Whether `listing` has the line `text`, alone or followed by its doc ("  # ...").
bool has_line(const std::string& listing, const std::string& text) {
  std::istringstream lines(listing);
  for (std::string line; std::getline(lines, line);)
    if (line == text || line.rfind(text + "  # ", 0) == 0) return true;
  return false;
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
  for (const char* line :
       {"log_every_n_steps = 1", "max_steps = 8", "lr = 3e-04", "# accumulate_grad_batches = 1",
        "# limit_train_batches = 1.0", "[strategy]", "plugin = \"fsdp\"", "# sharding_strategy = \"FULL_SHARD\"",
        "# limit_all_gathers = true", "# tie_embeddings = true", "[callbacks.early_stopping]", "monitor = \"val_loss\"",
        "# patience = 3", "[lr_find]", "# before_fit = false", "# init_scale = 65536.0", "# init_from = \"\"",
        "# predict_output = \"\""})
    EXPECT_TRUE(has_line(listing, line)) << "no '" << line << "' in:\n" << listing;
  // Each key with its doc line, and get_choice's keys with their choices.
  EXPECT_NE(listing.find("\n# accumulate_grad_batches = 1  # micro-batches whose gradients add up"), std::string::npos)
      << listing;
  EXPECT_NE(listing.find("[FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD]"), std::string::npos) << listing;
  {
    std::istringstream lines(listing);
    for (std::string line; std::getline(lines, line);)
      if (line.find(" = ") != std::string::npos) EXPECT_NE(line.find("  # "), std::string::npos) << "no doc: " << line;
  }
  // The trainer's own checkpoint callback (from [trainer]'s keys) adds none of its keys to [trainer].
  const std::size_t trainer_at = listing.find("\n[trainer]\n");
  const std::string trainer = listing.substr(trainer_at, listing.find("\n[", trainer_at + 1) - trainer_at);
  for (const char* key : {"# monitor", "# save_top_k", "# every_n_train_steps"})
    EXPECT_EQ(trainer.find(key), std::string::npos) << key << " in:\n" << trainer;
  // fsdp2's "auto" keys and sub-table, noted by the plugin itself.
  r = run_tessera("config --config " + config + " --set strategy.plugin=fsdp2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_line(r.output, "# tensor_parallel_size = \"auto\"")) << r.output;
  EXPECT_NE(r.output.find("\n[strategy.mp_policy]\n# cast_forward_inputs = true"), std::string::npos) << r.output;
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
// means "not set" can be written (early_stopping's divergence_threshold = nan, init_from = "",
// fsdp-precision's param_dtype = "").
TEST(ConfigListing, EveryListedDefaultUncommentedIsAcceptedAndTrainsTheSame) {
  const std::string dir = tessera::testing::fresh_dir("config-defaults");
  const std::string callbacks =
      "[callbacks.early_stopping]\nmonitor = \"val_loss\"\n[callbacks.lr_monitor]\n"
      "[callbacks.best]\nplugin = \"model_checkpoint\"\nmonitor = \"val_loss\"\n";
  const std::vector<std::string> variants = {
      " --set strategy.plugin=fsdp --set trainer.val_check_interval=4 --set precision.plugin=fsdp-precision",
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
    EXPECT_TRUE(has_line(listing, "# divergence_threshold = nan")) << listing;
    // Keys read only where set before: "" means unset (the precision's own policy).
    if (v == 0)
      for (const char* key : {"init_from", "predict_output", "param_dtype", "reduce_dtype", "buffer_dtype"})
        EXPECT_TRUE(has_line(listing, "# " + std::string(key) + " = \"\"")) << key << " in:\n" << listing;
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

// docs/configuration-reference.md is what `tessera config --reference` prints from the keys'
// docs in the code: every key of the host and of every shipped plugin, none without a doc.
TEST(ConfigReference, TheCommittedReferenceIsTheGeneratedOneAndEveryKeyHasADoc) {
  auto r = run_tessera("config --reference");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string generated = r.output;
  for (std::size_t at = generated.find("(no doc)"); at != std::string::npos; at = generated.find("(no doc)", at + 1))
    ADD_FAILURE() << "a key without a doc: " << generated.substr(generated.rfind('\n', at) + 1, at - generated.rfind('\n', at) - 1);
  for (const char* part : {"## [trainer]", "| `max_steps` | `-1` |", "### plugin = \"fsdp2\"", "`[strategy.mp_policy]`",
                           "### plugin = \"llama\"", "### plugin = \"text\"", "### early_stopping",
                           "| `init_from_strict` | `true` |", "| `gradient_clip_algorithm` | `\"norm\"` |",
                           "## [lr_scheduler]\n\n| key | default | |\n| --- | --- | --- |\n| `schedule` |"})
    EXPECT_NE(generated.find(part), std::string::npos) << "no '" << part << "' in:\n" << generated;
  std::ifstream file(std::string(TESSERA_SOURCE_DIR) + "/docs/configuration-reference.md");
  const std::string committed((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (generated != committed) {  // the first line that differs, not two whole files
    std::istringstream a(generated), b(committed);
    std::string line_a, line_b;
    int line = 0;
    while (++line, std::getline(a, line_a) && std::getline(b, line_b) && line_a == line_b) continue;
    ADD_FAILURE() << "docs/configuration-reference.md differs from the code's docs at line " << line
                  << ":\n  generated: " << line_a << "\n  committed: " << line_b << "\nregenerate it with\n"
                  << "  build/bin/tessera config --reference > docs/configuration-reference.md";
  }
  // --reference stands alone: not with another command.
  r = run_tessera("plan --reference");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--reference applies to `tessera config` only"), std::string::npos) << r.output;
}

}  // namespace
