// Checkpoint IO plugins.
//  `torch`:       one full checkpoint file, atomic, readable by Python's torch.load.
//  `distributed`: sharded checkpoints: a directory with one file per rank and a metadata
//                 file, published atomically by rank 0 once every shard is written.
#include <filesystem>
#include <fstream>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::sdk::Checkpoint;
using tessera::sdk::CheckpointMetadata;
using tessera::sdk::ShardInfo;

/// One file: the whole checkpoint.
class TorchCheckpointIO : public tessera::sdk::CheckpointIO {
 public:
  explicit TorchCheckpointIO(const tessera::sdk::Options&) {}

  void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) override {
    TESSERA_CHECK(!shard.sharded, "checkpoint_io \"torch\" writes full checkpoints only; for sharded state use "
                                  "[checkpoint_io] plugin = \"distributed\"");
    tessera::core::save_pickle(checkpoint, path);
  }
  void finalize_checkpoint(const std::string&, const ShardInfo&) override {}

  Checkpoint load_checkpoint(const std::string& path, const ShardInfo&) override {
    TESSERA_CHECK(fs::is_regular_file(path), "checkpoint ", path, " does not exist or is not a file",
                  fs::is_directory(path) ? " (it is a directory: a sharded checkpoint? use [checkpoint_io] plugin = "
                                           "\"distributed\")"
                                         : "");
    return tessera::core::checkpoint_dict(tessera::core::load_pickle(path), "checkpoint " + path);
  }

  CheckpointMetadata read_metadata(const std::string& path) override {
    TESSERA_CHECK(fs::is_regular_file(path), "checkpoint ", path, " does not exist or is not a file");
    return CheckpointMetadata{false, 1, "torch"};
  }

  void remove_checkpoint(const std::string& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/// Sharded: <path>/shard-<r>-of-<n>.pt + <path>/metadata.json; full saves as `torch`.
class DistributedCheckpointIO final : public TorchCheckpointIO {
 public:
  explicit DistributedCheckpointIO(const tessera::sdk::Options& options) : TorchCheckpointIO(options) {}

  void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) override {
    if (!shard.sharded) return TorchCheckpointIO::save_checkpoint(checkpoint, path, ShardInfo{});
    tessera::core::save_pickle(checkpoint, (staging(path) / shard_name(shard.rank, shard.world_size)).string());
  }

  void finalize_checkpoint(const std::string& path, const ShardInfo& shard) override {
    if (!shard.sharded) return;
    fs::path stage = staging(path);
    for (std::int64_t r = 0; r < shard.world_size; ++r)
      TESSERA_CHECK(fs::exists(stage / shard_name(r, shard.world_size)), "sharded checkpoint ", path, ": shard ", r,
                    " of ", shard.world_size, " was not written; the previous checkpoint is kept");
    tessera::core::atomic_write((stage / "metadata.json").string(), [&](std::ostream& out) {
      out << "{\"format\": \"tessera-sharded\", \"sharded\": true, \"world_size\": " << shard.world_size
          << ", \"tessera_version\": \"" << TESSERA_VERSION << "\"}\n";
    });
    // Replace an existing checkpoint only once the new one is complete.
    fs::path target(path), old = fs::path(path + ".old");
    std::error_code ec;
    fs::remove_all(old, ec);
    if (fs::exists(target)) fs::rename(target, old);
    fs::rename(stage, target);
    fs::remove_all(old, ec);
  }

  Checkpoint load_checkpoint(const std::string& path, const ShardInfo& shard) override {
    if (!fs::is_directory(path)) return TorchCheckpointIO::load_checkpoint(path, shard);
    CheckpointMetadata meta = read_metadata(path);
    TESSERA_CHECK(shard.rank >= 0 && shard.rank < meta.world_size, "sharded checkpoint ", path, " has ",
                  meta.world_size, " shards; shard ", shard.rank, " does not exist");
    std::string file = (fs::path(path) / shard_name(shard.rank, meta.world_size)).string();
    return tessera::core::checkpoint_dict(tessera::core::load_pickle(file), "checkpoint shard " + file);
  }

  CheckpointMetadata read_metadata(const std::string& path) override {
    if (!fs::is_directory(path)) return TorchCheckpointIO::read_metadata(path);
    fs::path meta = fs::path(path) / "metadata.json";
    std::ifstream in(meta);
    TESSERA_CHECK(in.good(), "sharded checkpoint ", path, " has no metadata.json: it is incomplete or not a "
                             "checkpoint");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto at = text.find("\"world_size\":");
    TESSERA_CHECK(at != std::string::npos, meta.string(), " has no world_size");
    return CheckpointMetadata{true, std::stoll(text.substr(at + 13)), "tessera-sharded"};
  }

 private:
  static fs::path staging(const std::string& path) { return fs::path(path + ".staging"); }
  static std::string shard_name(std::int64_t rank, std::int64_t world) {
    return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt";
  }
};

}  // namespace

TESSERA_PLUGIN(checkpoint_io, TESSERA_VERSION,
               tessera::sdk::plugin_entry<TorchCheckpointIO>("torch", "one full .ckpt file, readable by torch.load"),
               tessera::sdk::plugin_entry<DistributedCheckpointIO>(
                   "distributed", "sharded checkpoints: one file per rank plus metadata, published atomically"));
