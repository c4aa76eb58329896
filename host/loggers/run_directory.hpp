#pragma once
// Run folders as Lightning's loggers make them: default_root_dir/[name/]version_N, one per
// fit / validate / test, each with its config.toml, hparams.yaml, metrics and checkpoints/.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace tessera::host {

/// default_root_dir/[name]: the folder that holds the version folders.
std::string versions_parent(const std::string& default_root_dir, const LoggerSettings& logger);

/// Creates the next free version_N under `parent` (atomically: two runs never share one) and
/// returns N. Called by rank 0 only; the others get N by broadcast.
std::int64_t create_next_version(const std::string& parent);

/// The run folder of a job whose ranks all start on this host, chosen once before any rank
/// starts (so that its rank logs can go to its logs/ folder): the next free version_N, or the
/// fixed [logger] version. Created; returned as a path.
std::string create_job_run_directory(const std::string& default_root_dir, const LoggerSettings& logger);

/// Where a job's rank logs go when no run folder is known before its ranks start (predict, or
/// a job on several nodes, whose ranks then log into the run folder once it is chosen):
/// default_root_dir/logs/`what`-YYYYmmdd-HHMMSS-PID, a folder no other job shares.
std::string job_log_directory(const std::string& default_root_dir, const std::string& what);

/// The run folder for `version` ("N" -> version_N; other text -> that folder name).
std::string run_directory(const std::string& parent, const std::string& version);

/// The newest committed checkpoint (the checkpoint folder's `last` pointer) of the newest run
/// under `parent` that has one (with a fixed [logger] version, of that run only), if any.
std::optional<std::string> newest_run_checkpoint(const std::string& parent, const LoggerSettings& logger);

/// `--ckpt-path auto` ([trainer] resume = "auto"): the newest committed checkpoint that
/// verifies (core::verify_checkpoint: every checksum), newest run first and, within a run,
/// newest commit first, so that an auto-restarted job goes on from the last good save when the
/// newest is damaged. Each checkpoint passed over is described in `passed_over` (its path and
/// why); nullopt when none verifies or there is none.
std::optional<std::string> newest_verified_checkpoint(const std::string& parent, const LoggerSettings& logger,
                                                      std::vector<std::string>& passed_over);

/// `--ckpt-path last`: the newest committed checkpoint (core::resolve_last: the checkpoint
/// folder's `last` pointer) of the newest run under `parent` that has one. With a fixed
/// [logger] version only that run is searched.
/// Throws naming where it looked when there is none (and `asked`, the --ckpt-path it serves).
std::string find_last_checkpoint(const std::string& parent, const LoggerSettings& logger,
                                 const std::string& asked = "last");

/// `--ckpt-path best` (Lightning's): the best checkpoint the model_checkpoint callback recorded
/// in that newest checkpoint (its best_model_path: by the monitored metric, or the latest top-k
/// save without a monitor; the first monitoring callback decides where there are several).
/// Throws when none is recorded or the file is gone.
std::string find_best_checkpoint(const std::string& parent, const LoggerSettings& logger);

}  // namespace tessera::host
