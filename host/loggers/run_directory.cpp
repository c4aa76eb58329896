#include "run_directory.hpp"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <vector>

#include "tessera/core/checkpoint_folder.hpp"
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

std::string run_directory(const std::string& parent, const std::string& version) {
  bool number = !version.empty() && std::all_of(version.begin(), version.end(), ::isdigit);
  return parent + "/" + (number ? "version_" + version : version);
}

std::string find_last_checkpoint(const std::string& parent, const LoggerSettings& logger) {
  std::vector<std::pair<std::int64_t, fs::path>> runs;
  std::error_code ec;
  if (!logger.version.empty()) {
    runs.emplace_back(0, run_directory(parent, logger.version));
  } else {
    for (const auto& entry : fs::directory_iterator(parent, ec))
      if (auto n = version_number(entry.path())) runs.emplace_back(*n, entry.path());
    std::sort(runs.rbegin(), runs.rend());
  }
  for (const auto& [n, run] : runs)
    if (auto checkpoint = newest_checkpoint(run / "checkpoints")) return checkpoint->string();
  TESSERA_FAIL("--ckpt-path last: no checkpoint in any run under ", parent,
               logger.version.empty() ? " (looked in version_*/checkpoints/)"
                                      : " (looked in " + run_directory(parent, logger.version) + "/checkpoints/)",
               "; pass a checkpoint file with --ckpt-path PATH, or train first with tessera fit");
}

}  // namespace tessera::host
