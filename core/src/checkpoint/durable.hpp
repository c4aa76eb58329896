#pragma once
// Making a write durable before it is published (the checkpoint writers' commit protocols).
#include <filesystem>

namespace tessera::core::detail {

/// fsync(2) of a file or a folder (its entries); throws sdk::Error naming it.
void fsync_path(const std::filesystem::path& path, bool directory);

}  // namespace tessera::core::detail
