#pragma once
/// Checkpoint building blocks shared by strategies and checkpoint IO plugins: state dicts
/// inside checkpoint dictionaries, optimizer state in PyTorch's format (plus parameter
/// names, so it can be re-keyed by name), and atomic, torch.load-compatible files.
#include <array>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "tessera/core/tensor_piece.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {
class CheckpointIO;
}

namespace tessera::core {

/// A state dict as a checkpoint value: an ordered str -> tensor dictionary.
c10::IValue to_ivalue(const sdk::StateDict& state);
/// The inverse of to_ivalue; throws sdk::Error naming `what` if `value` is not one.
sdk::StateDict state_dict_from(const c10::IValue& value, const std::string& what);

/// The optimizer's state for `param` (null before its first step), whatever the LibTorch
/// version keys its state by.
const torch::optim::OptimizerParamState* optimizer_param_state(const torch::optim::Optimizer& optimizer,
                                                              const at::Tensor& param);

/// The names of the optimizer's parameters in its own order, group by group (the order of
/// PyTorch's indices), looked up by identity in `params` (what configure_optimizers was given).
/// A configure_optimizers that regroups or reorders its parameters (weight decay for some) gets
/// its state saved under the right names. Throws, naming them, when the optimizer steps on a
/// tensor that is not in `params`, on one twice, or leaves one of `params` out.
std::vector<std::string> optimizer_order_names(const torch::optim::Optimizer& optimizer,
                                               const std::vector<sdk::NamedParameter>& params);

/// PyTorch's optimizer state_dict: {"state": {index: {"step", "exp_avg", "exp_avg_sq" |
/// "momentum_buffer"}}, "param_groups": [{"lr", "betas", ..., "params": [indices]}]},
/// plus "param_names": the name of each index (PyTorch's PARAM_NAME keying). Adam, AdamW, SGD.
/// `param_names` and the param_names of the functions below are in the optimizer's order
/// (optimizer_order_names).
sdk::Checkpoint optimizer_state_dict(const torch::optim::Optimizer& optimizer,
                                     const std::vector<std::string>& param_names);
/// Restores `state` into `optimizer`, matching parameters by name when the checkpoint has
/// names (by index otherwise); keyed by PARAM_ID or PARAM_NAME. Every entry and shape is
/// checked before anything changes; a mismatch throws naming the parameter and both shapes.
/// State tensors move to each parameter's device (floating ones to its dtype, as PyTorch
/// does); each group's hyper-parameters are restored when the group counts match.
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& state,
                               const std::vector<std::string>& param_names);
/// load_optimizer_state_dict in two halves: checks every entry and shape and restores the
/// groups' hyper-parameters now, and returns what installs the per-parameter state, to run
/// later (NeMo's FSDP2Strategy restores it at the first optimizer step). The optimizer must
/// outlive the returned function.
std::function<void()> stage_optimizer_state_dict(torch::optim::Optimizer& optimizer, const sdk::Checkpoint& state,
                                                 const std::vector<std::string>& param_names);

/// `state` (an optimizer state dict) with each parameter's tensor moments (not "step")
/// replaced by fn(parameter name, moment); entries keyed by index are named through
/// "param_names". Used to re-cut moments between layouts (1-D pieces, tensor parallelism).
sdk::Checkpoint map_optimizer_moments(const sdk::Checkpoint& state,
                                      const std::function<at::Tensor(const std::string&, const at::Tensor&)>& fn);

/// How an optimizer state dict's "state" and "param_groups"/"params" are keyed (PyTorch
/// FSDP's OptimStateKeyType): by index in parameter order, or by parameter name.
enum class OptimStateKeyType { PARAM_ID, PARAM_NAME };
/// The same optimizer state keyed the other way, using its "param_names" (a PARAM_NAME
/// dict needs none: its keys are the names). Tensors are shared, not copied.
sdk::Checkpoint rekey_optim_state_dict(const sdk::Checkpoint& state, OptimStateKeyType key_type);

/// Writes `path` atomically: `write` fills a temporary file in the same directory, which is
/// fsynced and renamed over `path` (then the directory is fsynced). If anything fails,
/// including `write` throwing, the temporary is removed and an existing file at `path` is
/// untouched; the error is rethrown (filesystem errors as sdk::Error naming the path).
void atomic_write(const std::string& path, const std::function<void(std::ostream&)>& write);
/// Pickles `value` in the zip format that torch.load reads, atomically.
void save_pickle(const c10::IValue& value, const std::string& path);
/// Loads a file written by save_pickle (or torch.save of plain containers and tensors);
/// a missing, empty, foreign or truncated file throws sdk::Error naming the path and which.
/// The file is mapped (private, copy-on-write) and its tensors point into the mapping: only
/// the pages a reader touches are read and resident (a rank copying out its shard of each
/// tensor holds about its shard). Writing into them is allowed and stays private.
c10::IValue load_pickle(const std::string& path);
/// Marks a checkpoint that holds the model's weights and no training state to resume from.
constexpr const char* kWeightsOnlyKey = "weights_only";
/// The checkpoint entries shaped like the model, each a state dict that a sharded save cuts
/// as it cuts the weights: "state_dict", and weight averaging's "current_model_state" (the
/// trained weights, while "state_dict" holds their average, as Lightning's WeightAveraging).
constexpr const char* kCurrentModelStateKey = "current_model_state";
constexpr std::array<const char*, 2> kModelShapedKeys{"state_dict", kCurrentModelStateKey};
bool is_model_shaped_key(const std::string& key);
/// A checkpoint file, whatever wrote it: a full checkpoint (load_pickle's dict, as is); a bare
/// state dict (Python's `torch.save(model.state_dict(), f)`), a safetensors file (tessera's
/// export, `safetensors.torch.save_file`) or the index of several (`*.safetensors.index.json`,
/// Hugging Face's save_pretrained) as {"state_dict": its tensors, kWeightsOnlyKey: true}.
/// Tensors point into the mapped file either way.
sdk::Checkpoint load_checkpoint_file(const std::string& path);
/// Drops the resident pages of `t`, a tensor load_pickle returned that nobody modified since
/// (touching it again reads the file again); nothing for any other tensor. For streaming
/// readers that go through a whole checkpoint once (export).
void release_loaded_pages(const at::Tensor& t);

/// Reads a sharded checkpoint written by any world size and layout (`shards` files through `io`,
/// each naming its tensors' pieces under kTensorPiecesKey or the legacy fsdp key) and returns
/// shard 0's other entries with "state_dict" and "optimizer_states"[0] re-cut to `wanted`: each
/// tensor laid out as wanted[name].local_shape() (whole pieces give a full checkpoint).
/// Before any tensor is copied, each shard's names and global shapes are compared with
/// `wanted`: another shape, a wanted tensor it lacks or a stored one not wanted throws naming
/// them; elements no shard covers throw too. Reads one shard file at a time; a folder in
/// tessera's sharded format (core/sharded_checkpoint.hpp) is read by byte ranges instead.
sdk::Checkpoint read_resharded_checkpoint(sdk::CheckpointIO& io, const std::string& path, std::int64_t shards,
                                          const std::map<std::string, TensorPiece>& wanted);
/// The same with stacked pieces wanted (tensor-parallel pieces; tessera's sharded format only).
sdk::Checkpoint read_resharded_checkpoint(sdk::CheckpointIO& io, const std::string& path, std::int64_t shards,
                                          const std::map<std::string, StackedPieces>& wanted);

/// Like atomic_write, for writers that open the file themselves: `write` fills the temporary
/// path it is given (and fsyncs it); then it is renamed over `path` and the folder fsynced.
void atomic_write_file(const std::string& path, const std::function<void(const std::string& temp)>& write);

/// Where a full checkpoint keeps the xxh64 of each of its tensors ({"state_dict/w": hex, ...}):
/// torch.save's format has no checksum LibTorch checks, so a flipped byte would load silently.
constexpr const char* kTensorChecksumsKey = "tessera_tensor_xxh64";
/// `checkpoint` with kTensorChecksumsKey added (tensors shared, not copied).
sdk::Checkpoint with_tensor_checksums(const sdk::Checkpoint& checkpoint);
/// Recomputes every checksum kTensorChecksumsKey lists (none listed: nothing to check); a
/// mismatch throws naming `path` and the tensor. Tensors load_pickle returned are hashed a
/// block at a time with their pages dropped behind (checking keeps no tensor resident).
void check_tensor_checksums(const sdk::Checkpoint& checkpoint, const std::string& path);

/// A deep copy of `checkpoint` whose tensors are all on the CPU (pinned when copied from
/// CUDA): what an asynchronous save writes while training changes the originals.
sdk::Checkpoint snapshot_to_host(const sdk::Checkpoint& checkpoint);

/// A full checkpoint's optimizer_states re-indexed so parameter indices follow the order of
/// its state_dict (the model's own order, as single device and PyTorch number them), group
/// by group, names alongside: Python's AdamW(model.parameters()).load_state_dict() then puts
/// each moment on its parameter. Tensors are shared, not copied.
sdk::Checkpoint optimizer_states_in_model_order(const sdk::Checkpoint& checkpoint);

/// Typed access into checkpoint dictionaries, with errors naming the key.
const c10::IValue& checkpoint_get(const sdk::Checkpoint& checkpoint, const std::string& key);
sdk::Checkpoint checkpoint_dict(const c10::IValue& value, const std::string& what);

}  // namespace tessera::core
