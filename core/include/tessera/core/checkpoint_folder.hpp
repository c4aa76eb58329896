#pragma once
/// A run's checkpoint folder: `last` (a symlink to the newest committed checkpoint, replaced
/// atomically at every commit), the sweep of what interrupted saves left, and keep_last_k.
/// A checkpoint is committed when it is a torch.save file or a folder with a manifest.
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

namespace tessera::sdk {
class Strategy;
}

namespace tessera::core {

constexpr const char* kLastPointer = "last";

/// Removes `path` and, for a folder, everything in it, links not followed; a missing path is
/// no error. Not std::filesystem::remove_all: a pip wheel's LibTorch exports a copy of
/// libstdc++'s filesystem code (pytorch/pytorch#133437) that calls binaries bind to, and its
/// remove_all of a folder jumped to address 0 there (H200, torch 2.11).
void remove_tree(const std::string& path, std::error_code& ec);

/// A random id for one save, the same on every rank (rank 0's, broadcast). Collective.
std::string agree_on_save_id(sdk::Strategy& strategy);
/// Rank 0, after `path` was committed: points <its folder>/last at it (atomically, fsynced).
void update_last(const std::string& path);
/// The checkpoint <folder>/last points at; throws if there is none or it is not committed.
std::string resolve_last(const std::string& folder);
/// Held by a process while it writes a save's temporary (a file, or a sharded save's folder:
/// every rank while it writes its part, rank 0 until it commits): a shared flock(2) on it, so
/// that a sweep can tell a temporary being written from one whose writer is gone.
class WriterLock {
 public:
  WriterLock() = default;
  /// Locks `path` (creating it as an empty file with `create`); throws naming it on failure.
  explicit WriterLock(const std::string& path, bool create = false);
  WriterLock(WriterLock&& other) noexcept;
  WriterLock& operator=(WriterLock&& other) noexcept;
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;
  ~WriterLock();

 private:
  int fd_ = -1;
};

/// Rank 0 of a sharded save keeps its folder's lock from its own part until the commit.
void hold_writer_lock(const std::string& path);
void release_writer_lock(const std::string& path);

/// Whether `name` is the name of an interrupted save's leftover (.<name>.tmp-*, the old
/// format's *.staging).
bool is_save_leftover(const std::string& name);
/// Whether some process still writes the leftover `path` (holds its WriterLock; for the `last`
/// pointer's .last.tmp-PID, whether PID runs).
bool writer_alive(const std::string& path);

/// Removes what interrupted saves left in `folder` (hidden .<name>.tmp-* files and folders, the
/// old format's *.staging folders) whose writer is gone, except those of the save
/// `keep_save_id`. Returns them.
std::vector<std::string> sweep_interrupted(const std::string& folder, const std::string& keep_save_id = "");

/// A leftover found under a run root.
struct Leftover {
  std::string path;
  std::uintmax_t bytes = 0;
  bool in_use = false;  ///< its writer still runs: never removed
};
/// Every leftover of interrupted saves anywhere under `root` (recursively, links not followed).
std::vector<Leftover> find_leftovers(const std::string& root);
/// Removes those of find_leftovers(root) whose writer is gone; returns what was removed.
std::vector<Leftover> remove_leftovers(const std::string& root);
/// The committed checkpoints of `folder`, the newest commit first (none for a missing folder).
std::vector<std::string> committed_checkpoints(const std::string& folder);
/// Reads `path` (a checkpoint file or a sharded checkpoint's folder) and checks every checksum
/// it records, and a sharded folder's file sizes and save id; throws naming the damaged file.
/// Returns what was checked, for a message.
std::string verify_checkpoint(const std::string& path);
/// Removes all but the `keep_last_k` newest committed checkpoints of `folder` (never the one
/// `last` points at; nothing for keep_last_k <= 0). Returns what was removed.
std::vector<std::string> prune_checkpoints(const std::string& folder, std::int64_t keep_last_k);

}  // namespace tessera::core
