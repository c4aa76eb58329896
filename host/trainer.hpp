#pragma once
// The trainer: creates the plugins, wires them like Lightning's Trainer, and runs fit,
// validate, test or predict on this rank.
#include <memory>
#include <optional>
#include <string>

#include "config.hpp"
#include "lr_schedule.hpp"
#include "run_log.hpp"
#include "tessera/core/plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

class Trainer {
 public:
  /// Takes the config by value: move it in, since a copied TOML table loses the source
  /// lines that error messages name.
  Trainer(Config config, const sdk::ClusterInfo& cluster, RunLog& log);
  ~Trainer();

  /// `ckpt_path`: "" (none), "last" (default_root_dir/checkpoints/last.ckpt) or a path.
  void fit(const std::string& ckpt_path);
  void validate(const std::string& ckpt_path);
  void test(const std::string& ckpt_path);
  void predict(const std::string& ckpt_path);

 private:
  void setup(const std::string& stage);
  std::string resolve_checkpoint(const std::string& ckpt_path) const;
  void restore(const std::string& path, bool with_training_state);
  void save(const std::string& path);
  /// Runs the loop of `stage` ("val" or "test") over `limit` of its batches; returns the
  /// metrics averaged over batches and ranks.
  std::map<std::string, double> evaluate(const std::string& stage, const BatchLimit& limit);
  /// Runs predict_step over `limit` of the predict batches and prints the results.
  void predict_batches(const BatchLimit& limit);
  void maybe_inject_fault(std::int64_t step) const;

  Config config_;
  sdk::ClusterInfo cluster_;
  RunLog& log_;
  core::PluginLoader loader_;
  std::shared_ptr<sdk::Strategy> strategy_;
  std::shared_ptr<sdk::Precision> precision_;
  std::shared_ptr<sdk::CheckpointIO> checkpoint_io_;
  std::shared_ptr<sdk::Module> model_;
  std::shared_ptr<sdk::DataModule> data_;
  // Where training stands (saved in checkpoints, restored by --ckpt-path).
  std::int64_t global_step_ = 0;
  std::int64_t epoch_ = 0;
  std::int64_t next_batch_ = 0;
  std::int64_t total_steps_ = 0;
  std::unique_ptr<LRSchedule> schedule_;
  std::optional<sdk::Checkpoint> restored_schedule_;  ///< from --ckpt-path, checked against the config
  std::string restored_from_;
};

}  // namespace tessera::host
