#pragma once
/// Checkpoint IO plugins. Shard-aware from the start: a strategy that saves sharded state
/// goes through this interface too (every rank saves its shard, then rank 0 finalizes).
/// Saves are atomic: an interrupted or failed save never damages an existing checkpoint.
#include <cstdint>
#include <string>

#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

/// Which part of a checkpoint a call handles.
struct ShardInfo {
  std::int64_t rank = 0;        ///< shard index (this rank's, or the one to read)
  std::int64_t world_size = 1;  ///< number of shards
  bool sharded = false;         ///< false: one full checkpoint written by rank 0 alone
};

/// Read from a checkpoint without loading its tensors.
struct CheckpointMetadata {
  bool sharded = false;
  std::int64_t world_size = 1;
  std::string format;  ///< the IO plugin's format name
};

class TESSERA_SDK_API CheckpointIO : public PluginObject {
 public:
  ~CheckpointIO() override;
  /// Full: rank 0 writes `path` atomically. Sharded: each rank writes its shard into a
  /// staging location; nothing is visible at `path` until finalize_checkpoint().
  virtual void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) = 0;
  /// Rank 0, after every rank's save_checkpoint returned (the strategy barriers): writes the
  /// metadata and publishes a sharded checkpoint atomically. No-op for full checkpoints.
  virtual void finalize_checkpoint(const std::string& path, const ShardInfo& shard) = 0;
  /// Full: the whole checkpoint. Sharded: shard `shard.rank` (any rank may read any shard).
  virtual Checkpoint load_checkpoint(const std::string& path, const ShardInfo& shard) = 0;
  /// Throws sdk::Error naming the path if it is not a checkpoint of this IO.
  virtual CheckpointMetadata read_metadata(const std::string& path) = 0;
  virtual void remove_checkpoint(const std::string& path) = 0;
};

}  // namespace tessera::sdk
