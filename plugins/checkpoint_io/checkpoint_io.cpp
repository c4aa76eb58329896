// Checkpoint IO plugins.
//  `torch`:       one full checkpoint file, atomic, readable by Python's torch.load, with the
//                 xxh64 of every tensor inside (checked at load).
//  `distributed`: sharded checkpoints: a folder with one safetensors file per rank and a JSON
//                 manifest, committed by rank 0 once every rank's file is written
//                 (core/sharded_checkpoint.hpp); full saves as `torch`.
//  `dcp`:         PyTorch Distributed Checkpoint folders, each rank's chunks and rank 0's
//                 .metadata, committed as `distributed` commits (core/src/checkpoint/dcp.hpp).
// Both read either format (and the sharded pickles before the manifest): `plugin` chooses how
// saves are written. Both: `last` points at the newest commit, interrupted saves are swept
// before this process's first save into a folder, keep_last_k prunes after a commit, and
// async = true writes in a background thread from a host-memory snapshot.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/checkpoint_io.hpp"
#include "tessera/sdk/checkpoint_io_features.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/plugin.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::sdk::Checkpoint;
using tessera::sdk::CheckpointMetadata;
using tessera::sdk::ShardInfo;

/// Whether `path` starts like a torch.save file (a zip archive).
bool has_zip_magic(const fs::path& path) {
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(magic, sizeof magic);
  return in.gcount() == 4 && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

std::string folder_of(const std::string& path) {
  return fs::path(path).has_parent_path() ? fs::path(path).parent_path().string() : ".";
}

/// Save jobs run one after another on one background thread; a job's error is rethrown by
/// the next wait().
class BackgroundWriter {
 public:
  ~BackgroundWriter() {
    try {
      wait();
    } catch (const std::exception& e) {  // nothing left to report it to
      std::cerr << "tessera: error: background checkpoint save failed: " << e.what() << "\n";
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  /// `path`: the checkpoint the job writes, named by its error.
  void submit(std::function<void()> job, const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    jobs_.push_back({std::move(job), path});
    wake_.notify_all();
  }
  /// Blocks until every submitted job is done; rethrows the first error.
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return jobs_.empty() && !busy_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  /// Rethrows the first error, if a job failed; never blocks on a job.
  void rethrow() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_ && jobs_.empty() && !busy_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      auto [job, path] = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      lock.unlock();
      std::exception_ptr failed;
      if (!error_) {  // after a failure the rest of that save is skipped: `last` never moves to it
        try {
          job();
        } catch (const std::exception& e) {
          failed = std::make_exception_ptr(tessera::sdk::Error(
              "the background save of checkpoint " + path + " failed: " +
              std::string(e.what()).substr(0, std::string(e.what()).find('\n')) +  // not LibTorch's backtrace
              "; it was not committed (`last` still names the previous checkpoint)"));
        } catch (...) {
          failed = std::make_exception_ptr(tessera::sdk::Error("the background save of checkpoint " + path +
                                                               " failed (a non-standard exception); it was not committed"));
        }
      }
      lock.lock();
      if (failed && !error_) error_ = failed;
      busy_ = false;
      done_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::deque<std::pair<std::function<void()>, std::string>> jobs_;
  std::exception_ptr error_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;
};

/// Saves the whole checkpoint as one file; reads that and the sharded folders that
/// DistributedCheckpointIO writes.
class TorchCheckpointIO : public tessera::sdk::CheckpointIO,
                          public tessera::sdk::CheckpointIOFeatures,
                          public tessera::sdk::AsyncCheckpointIO {
 public:
  explicit TorchCheckpointIO(const tessera::sdk::Options& options)
      : keep_last_k_(options.get_int(
            {"keep_last_k",
             "keep the k newest committed checkpoints of the folder, pruned only after a commit; 0: keep all"},
            0, 0)),
        async_(options.get_bool({"async",
                                 "save from a host-memory snapshot on a background thread; the next save, any load and "
                                 "any removal wait for it"},
                                false)) {}

  bool saves_sharded() const override { return false; }

  void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) override {
    TESSERA_CHECK(!shard.sharded, "checkpoint_io \"torch\" writes full checkpoints only; for sharded state use "
                                  "[checkpoint_io] plugin = \"distributed\"");
    writer_.wait();  // the previous save is committed (or failed) before the next one starts
    sweep_once(path, "");
    if (!async_) return write_full(checkpoint, path);
    Checkpoint snapshot = tessera::core::snapshot_to_host(checkpoint);
    writer_.submit([snapshot, path] { write_full(snapshot, path); }, path);
  }
  /// Rank 0, once the checkpoint at `path` is complete: `last` points at it, then keep_last_k prunes.
  void finalize_checkpoint(const std::string& path, const ShardInfo&) override {
    if (async_) return writer_.submit([this, path] { committed(path); }, path);
    committed(path);
  }

  bool saves_async() const override { return async_; }
  std::vector<std::string> poll_committed() override {
    writer_.rethrow();
    return take_committed();
  }
  std::vector<std::string> wait_committed() override {
    writer_.wait();
    return take_committed();
  }

  // A run that switches IOs resumes from the other's checkpoints (as Lightning's FSDP loads a
  // file or a folder whatever its state_dict_type).
  Checkpoint load_checkpoint(const std::string& path, const ShardInfo& shard) override {
    writer_.wait();  // a save in flight may be publishing `path`
    if (fs::is_directory(path)) return load_shard(path, shard);
    check_file(path);
    Checkpoint c = tessera::core::load_checkpoint_file(path);
    tessera::core::check_tensor_checksums(c, path);
    return c;
  }

  CheckpointMetadata read_metadata(const std::string& path) override {
    writer_.wait();
    if (fs::is_directory(path)) return folder_metadata(path);
    check_file(path);
    TESSERA_CHECK(has_zip_magic(path), path, " is not a checkpoint: it is not in torch.save's zip format");
    return CheckpointMetadata{false, 1, "torch"};
  }

  void remove_checkpoint(const std::string& path) override {
    writer_.wait();  // never remove anything while a save is not committed
    std::error_code ec;
    tessera::core::remove_tree(path, ec);
    TESSERA_CHECK(!ec, "cannot remove checkpoint ", path, ": ", ec.message());
  }

 protected:
  /// Before this process's first save into a folder, what interrupted saves left there goes.
  void sweep_once(const std::string& path, const std::string& save_id) {
    if (swept_.insert(folder_of(path)).second) tessera::core::sweep_interrupted(folder_of(path), save_id);
  }
  void committed(const std::string& path) {
    tessera::core::update_last(path);
    tessera::core::prune_checkpoints(folder_of(path), keep_last_k_);
    if (!async_) return;
    std::lock_guard<std::mutex> lock(committed_mutex_);
    committed_.push_back(path);
  }
  std::vector<std::string> take_committed() {
    std::lock_guard<std::mutex> lock(committed_mutex_);
    return std::exchange(committed_, {});
  }
  /// Optimizer state in the model's parameter order (what Python's optimizers expect), every
  /// tensor's checksum inside.
  static void write_full(const Checkpoint& checkpoint, const std::string& path) {
    tessera::core::save_pickle(
        tessera::core::with_tensor_checksums(tessera::core::optimizer_states_in_model_order(checkpoint)), path);
  }
  static void check_file(const std::string& path) {
    std::error_code ec;
    TESSERA_CHECK(fs::exists(path, ec), "checkpoint ", path, " does not exist");
  }

  std::int64_t keep_last_k_;
  bool async_;
  std::set<std::string> swept_;
  std::mutex committed_mutex_;
  std::vector<std::string> committed_;  // async commits not yet reported (poll_committed)
  BackgroundWriter writer_;  // last: joined before the members its jobs use go

 private:
  static constexpr const char* kLegacyFormat = "tessera-sharded-pickle";  // before the manifest (tessera 0.1)

  /// A sharded folder: the manifest's format, or the one before it (metadata.json + shard-R-of-N.pt pickles).
  static CheckpointMetadata folder_metadata(const std::string& path) {
    // Strategies read DCP folders themselves (the chunks overlapping their pieces).
    TESSERA_CHECK(!tessera::core::is_dcp_checkpoint(path), path, " is a PyTorch DCP folder: the strategy reads it ",
                  "(init_from, --ckpt-path), not checkpoint_io");
    if (fs::exists(fs::path(path) / tessera::core::kManifestName)) {
      tessera::core::Manifest manifest = tessera::core::read_manifest(path);
      return CheckpointMetadata{true, manifest.world_size, tessera::core::kShardedFormatName};
    }
    fs::path file = fs::path(path) / "metadata.json";
    TESSERA_CHECK(fs::exists(file), "sharded checkpoint ", path, " has no ", tessera::core::kManifestName,
                  ": it is not a committed checkpoint (an interrupted save?)");
    boost::property_tree::ptree meta;
    try {
      boost::property_tree::read_json(file.string(), meta);
    } catch (const std::exception& e) {
      TESSERA_FAIL(file.string(), " is not valid JSON: ", e.what());
    }
    const std::string format = meta.get<std::string>("format", "");
    TESSERA_CHECK(format == "tessera-sharded", file.string(), " has format \"", format,
                  "\"; expected \"tessera-sharded\"");
    const auto world = meta.get_optional<std::int64_t>("world_size");
    TESSERA_CHECK(world && *world >= 1, file.string(), " has no valid world_size");
    return CheckpointMetadata{true, *world, kLegacyFormat};
  }

  static Checkpoint load_shard(const std::string& path, const ShardInfo& shard) {
    CheckpointMetadata meta = folder_metadata(path);
    TESSERA_CHECK(shard.rank >= 0 && shard.rank < meta.world_size, "sharded checkpoint ", path, " has ",
                  meta.world_size, " shards (0..", meta.world_size - 1, "); shard ", shard.rank, " does not exist");
    if (meta.format == tessera::core::kShardedFormatName) return tessera::core::load_shard(path, shard.rank);
    std::string file =
        (fs::path(path) / ("shard-" + std::to_string(shard.rank) + "-of-" + std::to_string(meta.world_size) + ".pt"))
            .string();
    return tessera::core::checkpoint_dict(tessera::core::load_pickle(file), "checkpoint shard " + file);
  }
};

/// Saves sharded: core::write_shard on every rank, core::commit_shards on rank 0.
class DistributedCheckpointIO final : public TorchCheckpointIO {
 public:
  explicit DistributedCheckpointIO(const tessera::sdk::Options& options)
      : TorchCheckpointIO(options),
        commit_timeout_s_(options.get_int(
            {"commit_timeout_s", "with async: seconds rank 0 waits for the other ranks' files before the save fails"},
            600, 1)) {}

  bool saves_sharded() const override { return true; }

  void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) override {
    if (!shard.sharded) return TorchCheckpointIO::save_checkpoint(checkpoint, path, ShardInfo{});
    TESSERA_CHECK(checkpoint.contains("save_id") && checkpoint.at("save_id").isString(), "sharded checkpoint ", path,
                  ": the checkpoint has no 'save_id' (the same string on every rank of one save; the trainer sets it)");
    const std::string save_id = checkpoint.at("save_id").toStringRef();
    writer_.wait();
    if (shard.rank == 0) {
      sweep_once(path, save_id);
      pending_[path] = save_id;
    }
    if (!async_) return tessera::core::write_shard(checkpoint, path, shard.rank, shard.world_size, save_id);
    Checkpoint snapshot = tessera::core::snapshot_to_host(checkpoint);
    writer_.submit([snapshot, path, shard, save_id] {
      tessera::core::write_shard(snapshot, path, shard.rank, shard.world_size, save_id);
    }, path);
  }

  /// Rank 0: commits once every rank's part is written (async: waits for them in the background).
  void finalize_checkpoint(const std::string& path, const ShardInfo& shard) override {
    if (!shard.sharded) return TorchCheckpointIO::finalize_checkpoint(path, shard);
    auto it = pending_.find(path);
    TESSERA_CHECK(it != pending_.end(), "sharded checkpoint ", path,
                  ": finalize_checkpoint on a rank that did not save rank 0's part of it");
    const std::string save_id = it->second;
    pending_.erase(it);
    auto commit = [this, path, world = shard.world_size, save_id, wait_s = async_ ? commit_timeout_s_ : 0] {
      tessera::core::commit_shards(path, world, save_id, wait_s);
      committed(path);
    };
    if (async_) return writer_.submit(commit, path);
    commit();
  }

 private:
  std::int64_t commit_timeout_s_;
  std::map<std::string, std::string> pending_;  // path -> save id of rank 0's saves not yet finalized
};

/// Saves PyTorch Distributed Checkpoint folders (torch.distributed.checkpoint.load reads them;
/// core/src/checkpoint/dcp.hpp): each rank writes its own chunks, rank 0 the .metadata, with
/// the commit protocol of `distributed`; full saves (rank 0 alone) as one rank's folder.
class DcpCheckpointIO final : public TorchCheckpointIO {
 public:
  explicit DcpCheckpointIO(const tessera::sdk::Options& options) : TorchCheckpointIO(options) {
    TESSERA_CHECK(!async_, options.locate("async"), " = true: checkpoint_io \"dcp\" saves synchronously; ",
                  "asynchronous saves are checkpoint_io \"distributed\"'s");
  }

  bool saves_sharded() const override { return true; }

  void save_checkpoint(const Checkpoint& checkpoint, const std::string& path, const ShardInfo& shard) override {
    TESSERA_CHECK(checkpoint.contains("save_id") && checkpoint.at("save_id").isString(), "DCP checkpoint ", path,
                  ": the checkpoint has no 'save_id' (the same string on every rank of one save; the trainer sets it)");
    const std::string save_id = checkpoint.at("save_id").toStringRef();
    const std::int64_t rank = shard.sharded ? shard.rank : 0, world = shard.sharded ? shard.world_size : 1;
    if (rank == 0) {
      sweep_once(path, save_id);
      pending_[path] = save_id;
    }
    tessera::core::write_dcp_shard(checkpoint, path, rank, world, save_id);
  }

  void finalize_checkpoint(const std::string& path, const ShardInfo& shard) override {
    auto it = pending_.find(path);
    TESSERA_CHECK(it != pending_.end(), "DCP checkpoint ", path,
                  ": finalize_checkpoint on a rank that did not save rank 0's part of it");
    const std::string save_id = it->second;
    pending_.erase(it);
    tessera::core::commit_dcp(path, shard.sharded ? shard.world_size : 1, save_id);
    committed(path);
  }

 private:
  std::map<std::string, std::string> pending_;  // path -> save id of rank 0's saves not yet finalized
};

}  // namespace

TESSERA_PLUGIN(checkpoint_io, TESSERA_VERSION,
               tessera::sdk::plugin_entry<TorchCheckpointIO>("torch", "one full .ckpt file, readable by torch.load"),
               tessera::sdk::plugin_entry<DistributedCheckpointIO>(
                   "distributed", "sharded checkpoints: one safetensors file per rank plus a JSON manifest, "
                                  "committed atomically"),
               tessera::sdk::plugin_entry<DcpCheckpointIO>(
                   "dcp", "PyTorch Distributed Checkpoint folders (torch.distributed.checkpoint reads them): each "
                          "rank's chunks plus rank 0's .metadata, committed atomically"));
