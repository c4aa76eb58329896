// A run's checkpoint folder: the `last` pointer, the sweep of interrupted saves, keep_last_k.
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <utility>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "dcp.hpp"
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
  if (fs::is_directory(entry, ec)) return fs::exists(entry / kManifestName, ec) || is_dcp_checkpoint(entry.string());
  if (!fs::is_regular_file(entry, ec) || entry.filename().string().front() == '.') return false;
  char magic[4] = {};
  std::ifstream in(entry, std::ios::binary);
  in.read(magic, sizeof magic);
  return in.gcount() == 4 && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

/// When a checkpoint was committed: its manifest's time, or the file's.
fs::file_time_type commit_time(const fs::path& entry) {
  std::error_code ec;
  if (!fs::is_directory(entry, ec)) return fs::last_write_time(entry, ec);
  return fs::last_write_time(entry / (is_dcp_checkpoint(entry.string()) ? kDcpMetadataName : kManifestName), ec);
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

WriterLock::WriterLock(const std::string& path, bool create) {
  fd_ = ::open(path.c_str(), create ? O_WRONLY | O_CREAT | O_CLOEXEC : O_RDONLY | O_CLOEXEC, 0644);
  TESSERA_CHECK(fd_ >= 0, "cannot ", create ? "create " : "open ", path, ": ", std::strerror(errno));
  while (::flock(fd_, LOCK_SH) != 0 && errno == EINTR) {
  }
}

WriterLock::WriterLock(WriterLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

WriterLock& WriterLock::operator=(WriterLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

WriterLock::~WriterLock() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {
std::mutex g_held_mutex;
std::map<std::string, WriterLock>& held_locks() {
  static auto* held = new std::map<std::string, WriterLock>();  // never destroyed: an async save may end late
  return *held;
}
}  // namespace

void hold_writer_lock(const std::string& path) {
  WriterLock lock(path);
  std::lock_guard<std::mutex> guard(g_held_mutex);
  held_locks()[path] = std::move(lock);
}

void release_writer_lock(const std::string& path) {
  std::lock_guard<std::mutex> guard(g_held_mutex);
  held_locks().erase(path);
}

bool is_save_leftover(const std::string& name) {
  const bool temporary = !name.empty() && name.front() == '.' && name.find(".tmp-") != std::string::npos;
  const bool staging = name.size() > 8 && name.compare(name.size() - 8, 8, ".staging") == 0;  // the old format's
  return temporary || staging;
}

bool writer_alive(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  const std::string pointer = "." + std::string(kLastPointer) + ".tmp-";
  if (name.rfind(pointer, 0) == 0) {  // a symlink, written in one step by the process its name says
    const pid_t pid = static_cast<pid_t>(std::atoll(name.c_str() + pointer.size()));
    return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  const bool locked = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return locked;
}

std::vector<std::string> sweep_interrupted(const std::string& folder, const std::string& keep_save_id) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return removed;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (!is_save_leftover(name)) continue;
    if (!keep_save_id.empty() && name.size() > keep_save_id.size() &&
        name.compare(name.size() - keep_save_id.size(), keep_save_id.size(), keep_save_id) == 0)
      continue;
    if (writer_alive(entry.path().string())) continue;  // another run's save in progress
    remove_tree(entry.path().string(), ec);
    if (!ec) removed.push_back(entry.path().string());
  }
  return removed;
}

std::vector<Leftover> find_leftovers(const std::string& root) {
  std::vector<Leftover> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return found;
  fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const fs::path& path = it->path();
    if (!is_save_leftover(path.filename().string())) continue;
    Leftover leftover{path.string(), 0, writer_alive(path.string())};
    std::error_code size_ec;
    if (it->is_directory(size_ec) && !it->is_symlink(size_ec)) {
      for (fs::recursive_directory_iterator inner(path, size_ec), inner_end; !size_ec && inner != inner_end;
           inner.increment(size_ec))
        if (inner->is_regular_file(size_ec)) leftover.bytes += inner->file_size(size_ec);
      it.disable_recursion_pending();  // its contents are part of it
    } else if (it->is_regular_file(size_ec)) {
      leftover.bytes = it->file_size(size_ec);
    }
    found.push_back(leftover);
  }
  return found;
}

std::vector<Leftover> remove_leftovers(const std::string& root) {
  std::vector<Leftover> removed;
  for (const Leftover& leftover : find_leftovers(root)) {
    if (leftover.in_use) continue;
    std::error_code ec;
    remove_tree(leftover.path, ec);
    if (!ec) removed.push_back(leftover);
  }
  return removed;
}

std::vector<std::string> committed_checkpoints(const std::string& folder) {
  std::error_code ec;
  std::vector<fs::path> committed;
  if (!fs::is_directory(folder, ec)) return {};
  for (const auto& entry : fs::directory_iterator(folder, ec))
    if (is_committed(entry.path())) committed.push_back(entry.path());
  std::sort(committed.begin(), committed.end(),
            [](const fs::path& a, const fs::path& b) { return commit_time(a) > commit_time(b); });
  return {committed.begin(), committed.end()};
}

std::string verify_checkpoint(const std::string& path) {
  if (is_dcp_checkpoint(path)) {
    (void)read_dcp_metadata(path);
    return "its .metadata reads and every chunk's byte range lies in its file (DCP records no checksums)";
  }
  if (is_sharded_checkpoint(path)) {
    verify_sharded(path);
    return "every file's size, checksums and save id match its manifest";
  }
  const sdk::Checkpoint checkpoint = load_checkpoint_file(path);
  check_tensor_checksums(checkpoint, path);
  return checkpoint.contains(kTensorChecksumsKey) ? "every tensor's checksum matches"
                                                  : "readable (written without checksums)";
}

std::vector<std::string> prune_checkpoints(const std::string& folder, std::int64_t keep_last_k) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (keep_last_k <= 0) return removed;
  const std::vector<std::string> committed = committed_checkpoints(folder);
  fs::path last;
  if (fs::is_symlink(fs::path(folder) / kLastPointer, ec))
    last = fs::path(folder) / fs::read_symlink(fs::path(folder) / kLastPointer, ec);
  for (std::size_t i = static_cast<std::size_t>(keep_last_k); i < committed.size(); ++i) {
    if (fs::path(committed[i]) == last) continue;
    remove_tree(committed[i], ec);
    TESSERA_CHECK(!ec, "cannot remove old checkpoint ", committed[i], ": ", ec.message());
    removed.push_back(committed[i]);
  }
  return removed;
}

}  // namespace tessera::core
