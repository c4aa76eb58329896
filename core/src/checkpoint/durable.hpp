#pragma once
// Making a write durable before it is published (the checkpoint writers' commit protocols).
#include <filesystem>

namespace tessera::core::detail {

/// fsync(2) of a file or a folder (its entries); throws sdk::Error naming it.
void fsync_path(const std::filesystem::path& path, bool directory);

/// Renames the finished folder `folder` to `target` (atomically exchanging it with a checkpoint
/// already there, which is then removed) and fsyncs the parent: the commit of a folder save.
void publish_folder(const std::filesystem::path& folder, const std::filesystem::path& target);

}  // namespace tessera::core::detail
