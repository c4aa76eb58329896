// A run's checkpoint folder: the `last` pointer, the sweep of interrupted saves, keep_last_k.
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::core {

namespace fs = std::filesystem;

namespace {

int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path) == 0 ? 0 : errno; }

fs::path folder_of(const std::string& path) {
  fs::path p(path);
  return p.has_parent_path() ? p.parent_path() : fs::path(".");
}

bool is_committed(const fs::path& entry) {
  std::error_code ec;
  if (fs::is_symlink(entry, ec)) return false;
  if (fs::is_directory(entry, ec)) return fs::exists(entry / kManifestName, ec);
  if (!fs::is_regular_file(entry, ec) || entry.filename().string().front() == '.') return false;
  char magic[4] = {};
  std::ifstream in(entry, std::ios::binary);
  in.read(magic, sizeof magic);
  return in.gcount() == 4 && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

/// When a checkpoint was committed: its manifest's time, or the file's.
fs::file_time_type commit_time(const fs::path& entry) {
  std::error_code ec;
  return fs::is_directory(entry, ec) ? fs::last_write_time(entry / kManifestName, ec) : fs::last_write_time(entry, ec);
}

}  // namespace

void remove_tree(const std::string& path, std::error_code& ec) {
  ec.clear();
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) {
    if (errno != ENOENT) ec.assign(errno, std::generic_category());
    return;
  }
  // Depth first (a folder after what it holds), links removed, not followed.
  const int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) ec.assign(rc > 0 ? rc : errno, std::generic_category());
}

std::string agree_on_save_id(sdk::Strategy& strategy) {
  std::random_device device;
  const std::int64_t mine = static_cast<std::int64_t>((static_cast<std::uint64_t>(device()) << 31) ^ device());
  at::Tensor id = at::full({1}, mine, at::kLong).to(strategy.root_device());
  strategy.broadcast(id, 0);
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(id.cpu().item<std::int64_t>()));
  return text;
}

void update_last(const std::string& path) {
  const fs::path folder = folder_of(path), link = folder / kLastPointer;
  const fs::path temp = folder / ("." + std::string(kLastPointer) + ".tmp-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove(temp, ec);
  fs::create_symlink(fs::path(path).filename(), temp, ec);
  TESSERA_CHECK(!ec, "cannot create ", temp.string(), ": ", ec.message());
  fs::rename(temp, link, ec);  // atomic: `last` always names a committed checkpoint
  if (ec) {
    fs::remove(temp);
    TESSERA_FAIL("cannot point ", link.string(), " at ", path, ": ", ec.message());
  }
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string resolve_last(const std::string& folder) {
  const fs::path link = fs::path(folder) / kLastPointer;
  std::error_code ec;
  TESSERA_CHECK(fs::is_symlink(link, ec), "no committed checkpoint in ", folder, " (", link.string(),
                " does not exist): nothing to resume from 'last'");
  const fs::path target = fs::path(folder) / fs::read_symlink(link, ec);
  TESSERA_CHECK(!ec && is_committed(target), link.string(), " points at ", target.string(),
                ", which is not a committed checkpoint (removed by hand?)");
  return target.string();
}

std::vector<std::string> sweep_interrupted(const std::string& folder, const std::string& keep_save_id) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return removed;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temporary = name.front() == '.' && name.find(".tmp-") != std::string::npos;
    const bool staging = name.size() > 8 && name.compare(name.size() - 8, 8, ".staging") == 0;  // the old format's
    if (!temporary && !staging) continue;
    if (!keep_save_id.empty() && name.size() > keep_save_id.size() &&
        name.compare(name.size() - keep_save_id.size(), keep_save_id.size(), keep_save_id) == 0)
      continue;
    remove_tree(entry.path().string(), ec);
    if (!ec) removed.push_back(entry.path().string());
  }
  return removed;
}

std::vector<std::string> prune_checkpoints(const std::string& folder, std::int64_t keep_last_k) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (keep_last_k <= 0 || !fs::is_directory(folder, ec)) return removed;
  std::vector<fs::path> committed;
  for (const auto& entry : fs::directory_iterator(folder, ec))
    if (is_committed(entry.path())) committed.push_back(entry.path());
  std::sort(committed.begin(), committed.end(),
            [](const fs::path& a, const fs::path& b) { return commit_time(a) > commit_time(b); });
  fs::path last;
  if (fs::is_symlink(fs::path(folder) / kLastPointer, ec))
    last = fs::path(folder) / fs::read_symlink(fs::path(folder) / kLastPointer, ec);
  for (std::size_t i = static_cast<std::size_t>(keep_last_k); i < committed.size(); ++i) {
    if (committed[i] == last) continue;
    remove_tree(committed[i].string(), ec);
    TESSERA_CHECK(!ec, "cannot remove old checkpoint ", committed[i].string(), ": ", ec.message());
    removed.push_back(committed[i].string());
  }
  return removed;
}

}  // namespace tessera::core
