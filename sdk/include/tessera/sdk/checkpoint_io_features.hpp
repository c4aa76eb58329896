#pragma once
/// An optional interface a CheckpointIO may also implement, so that a strategy can check
/// before any work that the IO takes what it will save (e.g. fsdp's state_dict_type =
/// "sharded" with an IO that writes one full file). Queried with dynamic_cast: an IO that
/// does not implement it (one built before it existed) is taken to accept everything and
/// refuses at save time, as before. Adding it changed no existing vtable (no ABI change).
///
///   class MyIO final : public tessera::sdk::CheckpointIO, public tessera::sdk::CheckpointIOFeatures {
///     bool saves_sharded() const override { return false; }
///     ...
#include <string>
#include <vector>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

class TESSERA_SDK_API CheckpointIOFeatures {
 public:
  virtual ~CheckpointIOFeatures();
  /// Whether save_checkpoint takes ShardInfo::sharded = true (every rank writes its shard,
  /// rank 0 finalizes). Called on any rank, before setup; must not touch the filesystem.
  virtual bool saves_sharded() const = 0;
};

/// Another optional interface, for an IO that can save in the background (e.g. `async = true`):
/// the trainer says "checkpoint queued" when save_checkpoint returns and "checkpoint saved"
/// only once the save is committed, and a failed background save ends the run naming the file.
/// Queried with dynamic_cast, as CheckpointIOFeatures (no ABI change).
class TESSERA_SDK_API AsyncCheckpointIO {
 public:
  virtual ~AsyncCheckpointIO();
  /// Whether save_checkpoint returns before the save is written.
  virtual bool saves_async() const = 0;
  /// The paths this process committed (finalize_checkpoint's saves, `last` moved to them) since
  /// the last call; never blocks. Rethrows a failed background save's error (an sdk::Error naming
  /// the checkpoint), after which `last` still names the previous commit.
  virtual std::vector<std::string> poll_committed() = 0;
  /// As poll_committed, after waiting for every queued save to end.
  virtual std::vector<std::string> wait_committed() = 0;
};

}  // namespace tessera::sdk
