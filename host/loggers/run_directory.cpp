#include "loggers/run_directory.hpp"

#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <optional>
#include <vector>

#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace fs = std::filesystem;

namespace {

/// N for a folder named version_N.
std::optional<std::int64_t> version_number(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.rfind("version_", 0) != 0 || name.size() == 8) return std::nullopt;
  std::string digits = name.substr(8);
  if (!std::all_of(digits.begin(), digits.end(), ::isdigit)) return std::nullopt;
  return std::stoll(digits);
}

/// The newest committed checkpoint of a run (the checkpoint folder's `last` pointer), if any.
std::optional<fs::path> newest_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_symlink(dir / core::kLastPointer, ec)) return std::nullopt;
  return fs::path(core::resolve_last(dir.string()));
}

/// The runs under `parent`, the newest (highest version_N) first; with a fixed [logger] version, that run only.
std::vector<fs::path> runs_newest_first(const std::string& parent, const LoggerSettings& logger) {
  if (!logger.version.empty()) return {run_directory(parent, logger.version)};
  std::vector<std::pair<std::int64_t, fs::path>> numbered;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec))
    if (auto n = version_number(entry.path())) numbered.emplace_back(*n, entry.path());
  std::sort(numbered.rbegin(), numbered.rend());
  std::vector<fs::path> runs;
  for (auto& item : numbered) runs.push_back(std::move(item.second));
  return runs;
}

}  // namespace

std::string versions_parent(const std::string& default_root_dir, const LoggerSettings& logger) {
  return logger.name.empty() ? default_root_dir : default_root_dir + "/" + logger.name;
}

std::int64_t create_next_version(const std::string& parent) {
  fs::create_directories(parent);
  std::int64_t next = 0;
  for (const auto& entry : fs::directory_iterator(parent))
    if (auto n = version_number(entry.path()); n && entry.is_directory()) next = std::max(next, *n + 1);
  while (!fs::create_directory(fs::path(parent) / ("version_" + std::to_string(next)))) ++next;
  return next;
}

std::string create_job_run_directory(const std::string& default_root_dir, const LoggerSettings& logger) {
  const std::string parent = versions_parent(default_root_dir, logger);
  try {
    std::string version = logger.version;
    if (version.empty()) version = std::to_string(create_next_version(parent));
    const std::string dir = run_directory(parent, version);
    fs::create_directories(dir);
    return dir;
  } catch (const fs::filesystem_error& e) {
    TESSERA_FAIL("[trainer] default_root_dir = \"", default_root_dir, "\": cannot create a run folder in ", parent, ": ",
                 e.code().message(), " (", e.path1().string(), "): choose a folder this user can write to");
  }
}

std::string job_log_directory(const std::string& default_root_dir, const std::string& what) {
  const std::time_t now = std::time(nullptr);
  char stamp[32];
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &utc);
  return default_root_dir + "/logs/" + what + "-" + stamp + "-" + std::to_string(::getpid());
}

std::string run_directory(const std::string& parent, const std::string& version) {
  bool number = !version.empty() && std::all_of(version.begin(), version.end(), ::isdigit);
  return parent + "/" + (number ? "version_" + version : version);
}

std::optional<std::string> newest_run_checkpoint(const std::string& parent, const LoggerSettings& logger) {
  for (const fs::path& run : runs_newest_first(parent, logger))
    if (auto checkpoint = newest_checkpoint(run / "checkpoints")) return checkpoint->string();
  return std::nullopt;
}

std::optional<std::string> newest_verified_checkpoint(const std::string& parent, const LoggerSettings& logger,
                                                      std::vector<std::string>& passed_over) {
  for (const fs::path& run : runs_newest_first(parent, logger)) {
    const fs::path folder = run / "checkpoints";
    std::error_code ec;
    if (fs::is_symlink(folder / core::kLastPointer, ec) && !fs::exists(folder / core::kLastPointer, ec))
      passed_over.push_back((folder / core::kLastPointer).string() + ": points at " +
                            fs::read_symlink(folder / core::kLastPointer, ec).string() + ", which is gone");
    for (const std::string& checkpoint : core::committed_checkpoints(folder.string())) {
      try {
        core::verify_checkpoint(checkpoint);
        return checkpoint;
      } catch (const std::exception& e) {
        passed_over.push_back(checkpoint + ": " + e.what());
      }
    }
  }
  return std::nullopt;
}

std::string find_last_checkpoint(const std::string& parent, const LoggerSettings& logger, const std::string& asked) {
  if (auto checkpoint = newest_run_checkpoint(parent, logger)) return *checkpoint;
  TESSERA_FAIL("--ckpt-path ", asked, ": no checkpoint in any run under ", parent,
               logger.version.empty() ? " (looked in version_*/checkpoints/)"
                                      : " (looked in " + run_directory(parent, logger.version) + "/checkpoints/)",
               "; pass a checkpoint file with --ckpt-path PATH, or train first with tessera fit");
}

std::string find_best_checkpoint(const std::string& parent, const LoggerSettings& logger) {
  const std::string newest = find_last_checkpoint(parent, logger, "best");
  // Lightning's layout: checkpoint["callbacks"]["ModelCheckpoint{...}"]["best_model_path"].
  struct Recorded {
    std::string key, monitor, path;
  };
  std::vector<Recorded> recorded;
  const sdk::Checkpoint state = core::read_trainer_state(newest);
  if (state.contains("callbacks"))
    for (const auto& item : state.at("callbacks").toGenericDict()) {
      const std::string key = item.key().toStringRef();
      if (key.rfind("ModelCheckpoint", 0) != 0 || !item.value().isGenericDict()) continue;
      const auto callback = item.value().toGenericDict();
      auto text = [&](const char* field) {
        return callback.contains(field) && callback.at(field).isString() ? callback.at(field).toStringRef() : "";
      };
      if (!text("best_model_path").empty()) recorded.push_back({key, text("monitor"), text("best_model_path")});
    }
  TESSERA_CHECK(!recorded.empty(), "--ckpt-path best: ", newest, " (the newest checkpoint of the newest run) records ",
                "no best checkpoint: no model_checkpoint callback of that run had saved one (a monitored one saves ",
                "once its metric is logged); pass --ckpt-path last or a checkpoint path");
  // As Lightning, one callback decides: the first that monitors a metric, else the first.
  const auto chosen = std::find_if(recorded.begin(), recorded.end(), [](const Recorded& r) { return !r.monitor.empty(); });
  const Recorded& best = chosen != recorded.end() ? *chosen : recorded.front();
  std::error_code ec;
  if (fs::exists(best.path, ec)) return best.path;
  // A relative dirpath recorded by a run started from another directory: its checkpoints sit
  // beside the newest one.
  const fs::path beside = fs::path(newest).parent_path() / fs::path(best.path).filename();
  TESSERA_CHECK(fs::exists(beside, ec), "--ckpt-path best: ", best.key, " in ", newest, " names ", best.path,
                " as the best checkpoint, but it no longer exists (nor ", beside.string(), ")");
  return beside.string();
}

}  // namespace tessera::host
