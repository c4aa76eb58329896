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
#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

class TESSERA_SDK_API CheckpointIOFeatures {
 public:
  virtual ~CheckpointIOFeatures();
  /// Whether save_checkpoint takes ShardInfo::sharded = true (every rank writes its shard,
  /// rank 0 finalizes). Called on any rank, before setup; must not touch the filesystem.
  virtual bool saves_sharded() const = 0;
};

}  // namespace tessera::sdk
