#pragma once
// PyTorch's Distributed Checkpoint (torch.distributed.checkpoint, "DCP") folders, as torchtitan,
// NeMo AutoModel and FSDP2 jobs save them: `.metadata`, a pickle of each state-dict key's global
// shape, dtype and chunks (offsets and sizes) and of where each chunk is stored, and data files
// `__R_K.distcp` holding each chunk as a torch.save record at a recorded byte range.
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "tessera/core/tensor_piece.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {
class Module;
}

namespace tessera::core {

/// Where DCP stores one item: bytes [offset, offset + length) of `file` (relative to the folder).
struct DcpStorage {
  std::string file;
  std::uint64_t offset = 0, length = 0;
};
struct DcpChunk {
  std::vector<std::int64_t> offsets, sizes;
  DcpStorage storage;
};
struct DcpTensor {
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> size;
  std::vector<DcpChunk> chunks;
};
struct DcpMetadata {
  std::map<std::string, DcpTensor> tensors;
  std::map<std::string, DcpStorage> bytes;  ///< BytesStorageMetadata items (torch.save'd Python objects)
};

/// `.metadata`'s pickle read into DcpMetadata without running it: only DCP's metadata classes,
/// torch.Size, dtypes, layouts and containers may appear (anything else is refused naming the
/// byte offset); every chunk must lie inside its tensor and have a storage record.
DcpMetadata parse_dcp_metadata(std::string_view pickle, const std::string& what);
/// DIR/.metadata parsed, and every storage range checked against the size of its file.
DcpMetadata read_dcp_metadata(const std::string& folder);

/// What read_trainer_state says of a DCP folder without reading tensors: a save of tessera's
/// gives rank 0's trainer state; a foreign folder is weights-only when it holds no optimizer moments.
sdk::Checkpoint dcp_trainer_state(const std::string& path);

/// The head counts a torchtitan Llama's q/k weights are permuted by (its Hugging Face
/// converter's `_permute`): from the model's Hugging Face config.json; zero when unknown.
struct DcpModelShape {
  std::int64_t heads = 0, kv_heads = 0;
};
DcpModelShape dcp_model_shape(const std::string& hf_config_json);
/// The same for a model plugin: its config when it is a sdk::HuggingFaceModel, zero otherwise.
DcpModelShape dcp_model_shape(const sdk::Module& model);

/// The DCP folder at `path` re-cut to `wanted` (each tensor laid out as its pieces stacked along
/// dim 0), as tessera's own readers return a checkpoint: "state_dict", and when the folder holds
/// optimizer moments for every parameter, "optimizer_states" and the training state to resume
/// from (global_step from torchtitan's train_state.step or the optimizer's step); otherwise it is
/// marked weights-only. Model keys are matched as saved (`name`), under torchtitan's `model.`
/// prefix, or by torchtitan's Llama names (`layers.N.attention.wq.weight`, with q/k permuted
/// back to Hugging Face's rotary layout by `shape`'s head counts); optimizer moments as
/// `optimizer.state.<fqn>.<moment>` (torchtitan), `optim.state.` or `state.`. Only the chunks that
/// overlap a wanted piece are read. Names and shapes are compared before any tensor data is read.
/// A folder tessera saved (write_dcp_shard) also restores its trainer state: rank `rank`'s
/// entries (rank 0's when the save had fewer ranks).
sdk::Checkpoint load_dcp(const std::string& path, const std::map<std::string, StackedPieces>& wanted,
                         const DcpModelShape& shape, std::int64_t rank = 0);

/// Writes a DCP folder that torch.distributed.checkpoint.load reads (FileSystemReader, PyTorch
/// 2.x): each tensor added is one chunk, a torch.save record appended to `__0_0.distcp`; commit()
/// writes `.metadata` and renames the hidden temporary folder into place (fsynced first), so an
/// interrupted export never leaves a folder that reads as a checkpoint. `path` must not exist.
class DcpWriter {
 public:
  explicit DcpWriter(std::string path);
  ~DcpWriter();  ///< removes the temporary folder unless committed
  DcpWriter(const DcpWriter&) = delete;
  DcpWriter& operator=(const DcpWriter&) = delete;
  /// `value` whole under `key` (optimizer.* and train_state.* keys are recorded as nested under
  /// "optimizer" / "train_state" in DCP's planner_data, as torchtitan's state dict nests them).
  void add(const std::string& key, const at::Tensor& value);
  void commit();

 private:
  std::string path_, temp_;
  std::unique_ptr<std::ofstream> data_;
  std::uint64_t written_ = 0;
  DcpMetadata metadata_;
  bool committed_ = false;
};

/// `tessera checkpoint export CKPT --to DIR --format dcp`: a full checkpoint file or a sharded
/// folder (any world size) as a DCP folder, streamed one tensor at a time: the weights under
/// their own names (as `dcp.load(model.state_dict())` asks for them), the optimizer moments and
/// steps as torchtitan's OptimizersContainer names them (optimizer.state.<name>.<moment>), the
/// global step as its train_state.step. Returns the number of tensors written.
std::size_t export_dcp(const std::string& checkpoint, const std::string& to);

/// The pickle DcpWriter writes as `.metadata` (for tests: parse_dcp_metadata reads it back).
std::string dcp_metadata_pickle(const DcpMetadata& metadata);

}  // namespace tessera::core
