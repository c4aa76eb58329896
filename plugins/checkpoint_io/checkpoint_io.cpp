// Checkpoint IO plugins.
//  `torch`:       one full checkpoint file, atomic, readable by Python's torch.load.
//  `distributed`: sharded checkpoints: a directory with one file per rank and a metadata
//                 file, published atomically by rank 0 once every shard is written.
#include <filesystem>
#include <fstream>
#include <set>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::sdk::Checkpoint;
using tessera::sdk::CheckpointMetadata;
using tessera::sdk::ShardInfo;

constexpr const char* kShardedFormat = "tessera-sharded";

/// Whether `path` starts like a torch.save file (a zip archive).
bool has_zip_magic(const fs::path& path) {
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(magic, sizeof magic);
  return in.gcount() == 4 && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

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
    check_file(path);
    return tessera::core::checkpoint_dict(tessera::core::load_pickle(path), "checkpoint " + path);
  }

  CheckpointMetadata read_metadata(const std::string& path) override {
    check_file(path);
    TESSERA_CHECK(has_zip_magic(path), path, " is not a checkpoint: it is not in torch.save's zip format");
    return CheckpointMetadata{false, 1, "torch"};
  }

  void remove_checkpoint(const std::string& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
    TESSERA_CHECK(!ec, "cannot remove checkpoint ", path, ": ", ec.message());
  }

 private:
  static void check_file(const std::string& path) {
    std::error_code ec;
    TESSERA_CHECK(fs::exists(path, ec), "checkpoint ", path, " does not exist");
    TESSERA_CHECK(!fs::is_directory(path, ec), "checkpoint ", path,
                  " is a directory: a sharded checkpoint? Load it with [checkpoint_io] plugin = \"distributed\"");
  }
};

/// Sharded: <path>/shard-<r>-of-<n>.pt + <path>/metadata.json; full saves as `torch`.
/// Shards are written into <path>.staging/; finalize publishes it by renames, keeping the
/// previous checkpoint as <path>.old until the new one is in place.
class DistributedCheckpointIO final : public TorchCheckpointIO {
 public:
  explicit DistributedCheckpointIO(const tessera::sdk::Options& options) : TorchCheckpointIO(options) {}

  void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) override {
    if (!shard.sharded) return TorchCheckpointIO::save_checkpoint(checkpoint, path, ShardInfo{});
    TESSERA_CHECK(shard.world_size >= 1 && shard.rank >= 0 && shard.rank < shard.world_size,
                  "sharded checkpoint ", path, ": shard ", shard.rank, " of ", shard.world_size, " is out of range");
    tessera::core::save_pickle(checkpoint, (staging(path) / shard_name(shard.rank, shard.world_size)).string());
  }

  void finalize_checkpoint(const std::string& path, const ShardInfo& shard) override {
    if (!shard.sharded) return;
    fs::path stage = staging(path);
    std::set<std::string> expected;
    for (std::int64_t r = 0; r < shard.world_size; ++r) {
      expected.insert(shard_name(r, shard.world_size));
      TESSERA_CHECK(fs::exists(stage / shard_name(r, shard.world_size)), "sharded checkpoint ", path, ": shard ", r,
                    " of ", shard.world_size, " was not written; the previous checkpoint is kept");
    }
    // Leftovers of an earlier interrupted save (other world sizes, temporaries) are not part of it.
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(stage))
      if (!expected.count(entry.path().filename().string())) fs::remove_all(entry.path(), ec);
    boost::property_tree::ptree meta;
    meta.put("format", kShardedFormat);
    meta.put("sharded", true);
    meta.put("world_size", shard.world_size);
    meta.put("tessera_version", TESSERA_VERSION);
    tessera::core::atomic_write((stage / "metadata.json").string(),
                                [&](std::ostream& out) { boost::property_tree::write_json(out, meta); });
    fs::path target(path), old = aside(path);
    fs::remove_all(old, ec);
    if (fs::exists(target)) rename_or_fail(target, old);
    rename_or_fail(stage, target);
    fs::remove_all(old, ec);
  }

  Checkpoint load_checkpoint(const std::string& path, const ShardInfo& shard) override {
    const std::string where = resolve(path);
    if (!fs::is_directory(where)) return TorchCheckpointIO::load_checkpoint(where, shard);
    CheckpointMetadata meta = read_metadata(where);
    TESSERA_CHECK(shard.rank >= 0 && shard.rank < meta.world_size, "sharded checkpoint ", where, " has ",
                  meta.world_size, " shards (0..", meta.world_size - 1, "); shard ", shard.rank, " does not exist");
    std::string file = (fs::path(where) / shard_name(shard.rank, meta.world_size)).string();
    return tessera::core::checkpoint_dict(tessera::core::load_pickle(file), "checkpoint shard " + file);
  }

  CheckpointMetadata read_metadata(const std::string& path) override {
    const std::string where = resolve(path);
    if (!fs::is_directory(where)) return TorchCheckpointIO::read_metadata(where);
    fs::path file = fs::path(where) / "metadata.json";
    TESSERA_CHECK(fs::exists(file), "sharded checkpoint ", where, " has no metadata.json: it is incomplete or not a ",
                  "checkpoint");
    boost::property_tree::ptree meta;
    try {
      boost::property_tree::read_json(file.string(), meta);
    } catch (const std::exception& e) {
      TESSERA_FAIL(file.string(), " is not valid JSON: ", e.what());
    }
    const std::string format = meta.get<std::string>("format", "");
    TESSERA_CHECK(format == kShardedFormat, file.string(), " has format \"", format, "\"; expected \"", kShardedFormat,
                  "\"");
    const auto world = meta.get_optional<std::int64_t>("world_size");
    TESSERA_CHECK(world && *world >= 1, file.string(), " has no valid world_size");
    return CheckpointMetadata{true, *world, kShardedFormat};
  }

  void remove_checkpoint(const std::string& path) override {
    TorchCheckpointIO::remove_checkpoint(path);
    TorchCheckpointIO::remove_checkpoint(staging(path).string());
    TorchCheckpointIO::remove_checkpoint(aside(path).string());
  }

 private:
  static fs::path staging(const std::string& path) { return fs::path(path + ".staging"); }
  static fs::path aside(const std::string& path) { return fs::path(path + ".old"); }
  static std::string shard_name(std::int64_t rank, std::int64_t world) {
    return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt";
  }
  /// A save that died between its two renames leaves only <path>.old: that is the
  /// previous complete checkpoint, so it is what `path` means.
  static std::string resolve(const std::string& path) {
    std::error_code ec;
    if (!fs::exists(path, ec) && fs::exists(aside(path) / "metadata.json", ec)) return aside(path).string();
    return path;
  }
  static void rename_or_fail(const fs::path& from, const fs::path& to) {
    std::error_code ec;
    fs::rename(from, to, ec);
    TESSERA_CHECK(!ec, "cannot rename ", from.string(), " to ", to.string(), ": ", ec.message());
  }
};

}  // namespace

TESSERA_PLUGIN(checkpoint_io, TESSERA_VERSION,
               tessera::sdk::plugin_entry<TorchCheckpointIO>("torch", "one full .ckpt file, readable by torch.load"),
               tessera::sdk::plugin_entry<DistributedCheckpointIO>(
                   "distributed", "sharded checkpoints: one file per rank plus metadata, published atomically"));
