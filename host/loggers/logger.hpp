#pragma once
// Lightning's loggers: each writes one run's metrics and hyper-parameters into the run's
// folder (default_root_dir/[name/]version_N, see run_directory.hpp). Rank 0 only.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>

#include "tessera/sdk/types.hpp"

namespace tessera::host {

/// Flat hyper-parameters: "n_layer" -> 2, "optimizer.lr" -> 0.003, "strategy" -> "fsdp".
using HyperParameters = std::map<std::string, std::variant<bool, std::int64_t, double, std::string>>;

/// `dict`'s scalars under `prefix` (nested dicts joined with '.', lists as text).
void flatten_hyperparameters(const sdk::Checkpoint& dict, const std::string& prefix, HyperParameters& out);

class Logger {
 public:
  virtual ~Logger() = default;
  virtual void log_hyperparams(const HyperParameters& params) = 0;
  /// `stage`: "train", "val", "validate", "test".
  virtual void log_metrics(const std::map<std::string, double>& metrics, std::int64_t step, std::int64_t epoch,
                           const std::string& stage) = 0;
  /// The run ended: "success", "failed" or "interrupted".
  virtual void finalize(const std::string& status) = 0;
};

/// metrics.csv (step,epoch,stage,metric,value: one row per value) and hparams.yaml.
std::unique_ptr<Logger> make_csv_logger(const std::string& run_dir);
/// An events.out.tfevents.* file TensorBoard reads: scalars, and hyper-parameters for its
/// HPARAMS tab (with the run's status at the end).
std::unique_ptr<Logger> make_tensorboard_logger(const std::string& run_dir);

}  // namespace tessera::host
