#pragma once
// What the host's end-to-end tests share: a small GPT run on fortunes, the losses of every run
// folder of a root, and the kill-and-resume check (tests/host/*_test.cpp, one file per feature).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"

namespace tessera::testing::host {

namespace fs = std::filesystem;
using tessera::testing::metric_series;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;

/// Appended to a command: the run without dropout (so that losses depend on the weights alone).
inline const std::string kNoDropout = " --set model.dropout=0.0";

/// `metric` over every run folder under `root` (version_0, version_1, ...): a resumed run
/// continues in a new folder, and its values replace the old ones from where it resumed.
inline std::map<std::int64_t, double> all_runs(const std::string& root, const std::string& stage, const std::string& metric) {
  std::map<std::int64_t, double> out;
  for (int v = 0; fs::exists(root + "/version_" + std::to_string(v)); ++v)
    for (const auto& [step, value] : metric_series(root + "/version_" + std::to_string(v) + "/metrics.csv", stage, metric))
      out[step] = value;
  return out;
}

/// A small GPT run on fortunes; `extra` is appended to the config.
inline std::string write_config(const std::string& dir, const std::string& extra = "") {
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

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// write_config without its checkpoint_every_n_steps: for a [callbacks.model_checkpoint] of the
/// test's own in `extra` (fit refuses both), or a run with only the trainer's default saves.
inline std::string write_config_own_checkpoints(const std::string& dir, const std::string& extra = "") {
  std::string config = write_config(dir, extra);
  std::string text = file_bytes(config);
  const std::string key = "checkpoint_every_n_steps = 4\n";
  text.erase(text.find(key), key.size());
  std::ofstream(config) << text;
  return config;
}

inline void expect_losses_equal(const std::map<std::int64_t, double>& a, const std::map<std::int64_t, double>& b,
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
inline void check_resume(const std::string& name, const std::string& first_sets, const std::string& resume_sets, double tol,
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

}  // namespace tessera::testing::host
