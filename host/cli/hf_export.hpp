#pragma once
/// `tessera checkpoint export RUN_OR_CKPT --to DIR --format hf`: a Hugging Face model folder
/// (config.json from the model's sdk::HuggingFaceModel, generation_config.json, safetensors
/// shards with their index) from a full or sharded checkpoint, streamed tensor by tensor, and
/// the tokenizer files of the run (as save_pretrained writes them beside the model).
#include <optional>
#include <string>
#include <utility>

#include <c10/core/ScalarType.h>

namespace tessera::host {

struct HfExportRequest {
  /// a default_root_dir (its newest run's last checkpoint, as --ckpt-path last finds it), a run
  /// folder (its checkpoints/last), a checkpoint, or a `last` link
  std::string source;
  std::string to;       ///< the folder to create
  std::string config;   ///< the run's config.toml; "" finds it beside the checkpoint's run
  std::int64_t max_shard_bytes = 5'000'000'000;  ///< save_pretrained's default "5GB"
  std::optional<at::ScalarType> dtype;           ///< floating tensors converted to it; none: as stored
};

/// The checkpoint a RUN_OR_CKPT names (HfExportRequest::source's forms), and the run
/// configuration beside it when there is one ("" otherwise).
std::pair<std::string, std::string> locate_checkpoint(const std::string& source);

/// Writes the folder; throws sdk::Error naming what is missing or refused (a model without
/// sdk::HuggingFaceModel, rank-local sharded state, no config to build the model from).
void export_hf(const HfExportRequest& request);

/// `--format peft`: a LoRA run's adapters as PEFT's save_pretrained writes them:
/// adapter_model.safetensors (PEFT's names: "base_model.model." + the module path +
/// ".lora_A.weight") and adapter_config.json (r, lora_alpha, lora_dropout, target_modules,
/// base_model_name_or_path: the run's init_from). Refused for a checkpoint without [model.lora].
void export_peft(const HfExportRequest& request);

}  // namespace tessera::host
