#pragma once
/// The sharded checkpoint format (the `distributed` IO): a folder with one safetensors file per
/// rank, holding only that rank's pieces, and a JSON manifest written last by rank 0:
///
///   step=6.ckpt/rank-0-of-2.safetensors   this rank's pieces: "state_dict/<name>",
///   step=6.ckpt/rank-1-of-2.safetensors   "optimizer/<name>/<moment>", and its other tensors
///   step=6.ckpt/manifest.json             format version, save id, world size, each tensor's
///                                         global shape, dtype and pieces per file, each file's
///                                         size and xxh64 checksums, the trainer state
///
/// Each file's __metadata__ has the save's id (checked against the manifest) and the rest of
/// that rank's checkpoint as JSON ("tessera.tree"; tensors as {"__tensor__": name}).
/// Commit protocol: every rank writes into a temporary folder beside the target and fsyncs
/// its file, then a small record of it; rank 0 checks every record, writes the manifest,
/// fsyncs the folder and renames it into place (exchanging it with an existing checkpoint of
/// the same name), then fsyncs the parent. A folder without a manifest is never a checkpoint.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/safetensors.hpp"
#include "tessera/core/tensor_piece.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core {

constexpr const char* kShardedFormatName = "tessera-sharded";
constexpr std::int64_t kShardedFormatVersion = 1;
constexpr const char* kManifestName = "manifest.json";

/// A random id for one save (hex); every rank of the save must use the same one.
std::string new_save_id();

/// The temporary folder of save `save_id` of `path`: hidden, beside it (.<name>.tmp-<id>).
std::string temporary_folder(const std::string& path, const std::string& save_id);

/// This rank's part of a sharded save: its tensors into <temporary folder>/rank-R-of-N.safetensors
/// (fsynced), then its record (size, checksums, pieces). The pieces of the state_dict tensors
/// come from checkpoint[kTensorPiecesKey] (or the legacy fsdp key); their optimizer moments
/// (optimizer_states[0], matched by parameter name) are pieces of the same shape. A tensor of
/// stacked pieces is stored as one file tensor per piece ("<name>", "<name>#1", ...).
void write_shard(const sdk::Checkpoint& checkpoint, const std::string& path, std::int64_t rank, std::int64_t world,
                 const std::string& save_id);

/// Rank 0, after every rank's write_shard returned: checks every record (present, same save
/// id, consistent global shapes and dtypes), writes the manifest and publishes the folder at
/// `path` atomically. On failure the temporary folder is removed and `path` is untouched.
/// `wait_s` > 0: waits up to that long for ranks still writing (asynchronous saves).
void commit_shards(const std::string& path, std::int64_t world, const std::string& save_id, std::int64_t wait_s = 0);

/// What a manifest says about one file and one sharded tensor.
struct ManifestPiece {
  std::string file;
  TensorPiece piece;
  std::string key;  ///< its name in the file: the tensor's, "<name>#k" for part k > 0 of stacked pieces
};
struct ManifestTensor {
  std::string dtype;
  std::vector<std::int64_t> global_shape;
  std::vector<ManifestPiece> pieces;
};
struct Manifest {
  std::string path;  ///< the checkpoint folder
  std::int64_t format_version = 0;
  std::string tessera_version, save_id;
  std::int64_t world_size = 0;
  std::map<std::string, FileDigest> files;         ///< file name -> size and checksums
  std::map<std::string, ManifestTensor> tensors;   ///< "state_dict/<name>", "optimizer/<name>/<moment>"
  std::string trainer_state;                        ///< rank 0's checkpoint tree (JSON), for tools
};

/// PyTorch DCP folders saved during training ([checkpoint_io] plugin = "dcp"), with the commit protocol of
/// tessera's sharded saves: each rank writes its pieces of the weights and optimizer moments as
/// chunks of `__R_0.distcp` (a flat range as the boxes it decomposes into) and its other entries
/// (loops, RNG, callbacks, the optimizer's param_groups) as the bytes item
/// `tessera.trainer_state.rank_R` (a torch.save'd dict), into the save's temporary folder, fsyncs
/// it, then writes its record. A full save is rank 0's alone with world 1. Rank-local fsdp state
/// (state_dict_type = "local") is refused.
void write_dcp_shard(const sdk::Checkpoint& checkpoint, const std::string& path, std::int64_t rank,
                     std::int64_t world, const std::string& save_id);
/// Rank 0, after every rank's write_dcp_shard: merges the records into `.metadata` (checked as a
/// reader checks it: every tensor covered exactly), fsyncs and publishes the folder at `path`
/// (exchanging it with a checkpoint there). On failure the temporary folder goes, `path` stays.
void commit_dcp(const std::string& path, std::int64_t world, const std::string& save_id);

/// Whether `path` is a folder in this format (it has a manifest).
bool is_sharded_checkpoint(const std::string& path);
/// PyTorch Distributed Checkpoint (torch.distributed.checkpoint) folders, told by their metadata
/// file: strategies read them (init_from, --ckpt-path) as they read this format.
constexpr const char* kDcpMetadataName = ".metadata";
bool is_dcp_checkpoint(const std::string& path);
/// Reads and checks the manifest: format, a version this build reads, every field present.
Manifest read_manifest(const std::string& path);
/// The model's tensors in the manifest, by their names in the model ("w" for "state_dict/w"),
/// pointing into `manifest`.
std::map<std::string, const ManifestTensor*> model_tensors(const Manifest& manifest);
/// The manifest's and the files' name of model tensor `name` ("state_dict/<name>"), or of its
/// entry in another model-shaped dict (kModelShapedKeys: "current_model_state/<name>").
std::string model_tensor_key(const std::string& name, const std::string& dict = "state_dict");
/// Whether the save holds no model tensors: fsdp's state_dict_type = "local", flat shards that
/// only the same world size, strategy and model read.
bool holds_rank_local_state(const Manifest& manifest);

/// Reads pieces of a committed checkpoint's tensors as byte ranges of its files: each block
/// read is checked against the manifest's checksums, each file's save id against its save id.
class ShardedReader {
 public:
  explicit ShardedReader(Manifest manifest);
  ~ShardedReader();
  const Manifest& manifest() const { return manifest_; }
  /// `piece` of tensor `name` ("state_dict/<param>", "optimizer/<param>/<moment>"), laid out as
  /// piece.local_shape(); throws if the files do not cover all of it.
  at::Tensor read(const std::string& name, const TensorPiece& piece);
  /// One of its files, opened (and checked) once.
  SafetensorsReader& file(const std::string& name);

 private:
  Manifest manifest_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
};

/// Loads the checkpoint at `path` re-cut to `wanted` (name -> piece; whole pieces give full
/// tensors): "state_dict" and the optimizer moments of those parameters hold exactly those
/// pieces, read as byte ranges of the files that hold them (each block checksum-verified);
/// every other entry is rank `rank`'s (rank 0's when the checkpoint had fewer ranks). Names and
/// global shapes are compared with `wanted` before any tensor data is read; every wanted
/// element of every parameter and moment must be covered, and every file must carry the save id.
sdk::Checkpoint load_sharded(const std::string& path, const std::map<std::string, TensorPiece>& wanted,
                             std::int64_t rank);
/// The same with stacked pieces wanted (core/tensor_piece.hpp): each tensor is its pieces read
/// one by one and concatenated along dim 0.
sdk::Checkpoint load_sharded(const std::string& path, const std::map<std::string, StackedPieces>& wanted,
                             std::int64_t rank);

/// Rank `rank`'s checkpoint as it was saved (its own pieces, named in kTensorPiecesKey when
/// they are pieces of global tensors): what a same-layout load (fsdp LOCAL) reads.
sdk::Checkpoint load_shard(const std::string& path, std::int64_t rank);

/// A committed checkpoint's entries besides the model and optimizer state (global_step, epoch,
/// callbacks, ...), in either format, without reading tensor data: a torch.save file is mapped,
/// a sharded folder gives its manifest's trainer state (where tensors, rank 0's RNG state, are
/// left undefined). What `--ckpt-path best` reads.
sdk::Checkpoint read_trainer_state(const std::string& path);

/// Every file's size and checksums against the manifest; throws naming the first bad file.
void verify_sharded(const std::string& path);

/// Names and global shapes of a checkpoint against the wanted ones (shared by the readers):
/// throws "`where` does not match the model ..." listing mismatched, missing and unexpected.
void check_against_wanted(const std::map<std::string, std::vector<std::int64_t>>& saved,
                          const std::map<std::string, TensorPiece>& wanted, const std::string& where);

}  // namespace tessera::core
