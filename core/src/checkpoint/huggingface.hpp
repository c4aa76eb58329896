#pragma once
/// Hugging Face model folders, as `save_pretrained` writes them: `config.json` beside
/// `model.safetensors`, or beside `model-0000k-of-0000n.safetensors` and
/// `model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}).
/// Reading looks at headers only (the tensors are mapped later by load_checkpoint_file, so a rank
/// touches only the bytes it copies); writing streams tensor by tensor into shards of at most a
/// given size.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/safetensors.hpp"

namespace tessera::core {

constexpr const char* kHfConfigName = "config.json";
constexpr const char* kHfGenerationConfigName = "generation_config.json";
constexpr const char* kHfWeightsName = "model.safetensors";
constexpr const char* kHfIndexName = "model.safetensors.index.json";

/// Whether `path` is a folder holding config.json and model.safetensors or model.safetensors.index.json.
bool is_hf_directory(const std::string& path);

/// One tensor of a Hugging Face folder: the file that holds it (a name inside the folder) and
/// its header entry.
struct HfTensor {
  std::string file;
  SafetensorsEntry entry;
};
struct HfDirectory {
  std::string path;         ///< the folder
  std::string weights;      ///< what load_checkpoint_file maps: model.safetensors or the index (full path)
  std::string config_json;  ///< config.json's text
  std::map<std::string, HfTensor> tensors;
};
/// Reads config.json and the header of every weights file (as transformers does, model.safetensors
/// when present, else the index). A file the index names that is missing, a tensor the index puts
/// in a file without it, a malformed index, header or config: sdk::Error naming the file.
HfDirectory read_hf_directory(const std::string& path);

/// An index's weight_map ({tensor: file}), checked: a JSON object with a weight_map of file names
/// without a folder part, each of which exists beside the index (a missing one is named with a
/// tensor the index puts in it).
std::map<std::string, std::string> read_safetensors_index(const std::string& index_path);

/// The folder's names and shapes against the model's (`model`: name -> full shape): throws naming
/// each tensor whose shape differs, with its file and both shapes, and (strict) the model's
/// tensors the folder lacks and the folder's tensors the model does not have.
void check_hf_against_model(const HfDirectory& dir, const std::map<std::string, std::vector<std::int64_t>>& model,
                            bool strict);

/// A folder's config.json against the model's own (sdk::HuggingFaceModel::hf_config_json):
/// another model_type, or another value of an architecture key that both state (everything but
/// kHfConfigKeysNotCompared; objects such as rope_scaling key by key), throws naming each.
/// `model_type_only`: the model_type alone (init_from_strict = false: a model changed on purpose).
void check_hf_config(const std::string& file_config, const std::string& model_config, const std::string& where,
                     bool model_type_only = false);
/// Keys that do not change what the weights compute (or that a fine-tune changes on purpose).
inline const std::vector<std::string> kHfConfigKeysNotCompared{
    "torch_dtype",  "transformers_version", "_name_or_path", "architectures",          "use_cache",
    "bos_token_id", "eos_token_id",         "pad_token_id",  "max_position_embeddings", "initializer_range"};

/// config.json's torch_dtype name of a floating type ("float32", "bfloat16", "float16").
std::string hf_dtype_name(at::ScalarType type);

/// "5GB" (10^9), "500MB", "2GiB" (2^30), "64KiB", "1000" (bytes): the bytes. Throws naming `what`.
std::int64_t parse_byte_size(const std::string& text, const std::string& what);

/// What write_hf_directory wrote.
struct HfExport {
  std::vector<std::string> files;  ///< the weights files, in order
  std::int64_t total_bytes = 0;    ///< of tensor data (the index's total_size)
};
/// Writes a Hugging Face folder at `dir` (absent or empty; published by one rename once every
/// file is written and fsynced): `config_json`, `generation_config_json` and the tensors of
/// `specs` (dtypes and shapes as they will be stored), in shards of at most `max_shard_bytes` of
/// data each (a larger tensor gets a shard of its own, as save_pretrained does), one shard as
/// model.safetensors, several as model-0000k-of-0000n.safetensors with model.safetensors.index.json.
/// Tensors are ordered by element size, largest first (each offset is then aligned to its
/// element), and each comes from `produce(i)` just before it is written: one tensor in memory.
HfExport write_hf_directory(const std::string& dir, const std::vector<TensorSpec>& specs,
                            const std::function<at::Tensor(std::size_t)>& produce, const std::string& config_json,
                            const std::string& generation_config_json, std::int64_t max_shard_bytes);

}  // namespace tessera::core
