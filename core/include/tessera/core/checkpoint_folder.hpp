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
/// Removes what interrupted saves left in `folder` (hidden .<name>.tmp-* files and folders, the
/// old format's *.staging folders), except those of the save `keep_save_id`. Returns them.
std::vector<std::string> sweep_interrupted(const std::string& folder, const std::string& keep_save_id = "");
/// Removes all but the `keep_last_k` newest committed checkpoints of `folder` (never the one
/// `last` points at; nothing for keep_last_k <= 0). Returns what was removed.
std::vector<std::string> prune_checkpoints(const std::string& folder, std::int64_t keep_last_k);

}  // namespace tessera::core
