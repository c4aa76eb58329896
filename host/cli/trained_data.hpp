#pragma once
// What a checkpoint was trained on, read back from its run folder's config.toml: the data's
// vocabulary (bytes, or which tokenizer) for predict's warning, and the tokenizer files a
// Hugging Face export copies beside the weights (as save_pretrained writes them).
#include <filesystem>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace tessera::host {

/// The configuration each run folder keeps (Trainer writes it beside checkpoints/).
inline constexpr const char* kRunConfig = "config.toml";

/// The run folder's config.toml of a checkpoint inside one (RUN/checkpoints/CKPT, or a `last`
/// link there), or "" when it is not in a run folder.
std::string run_config_of_checkpoint(const std::string& checkpoint);

/// predict / validate / test, before any rank starts: "" when the ids the weights were trained
/// on (the training run's [data] section, or the tokenizer of the [trainer] init_from Hugging
/// Face folder) are those this config's data gives, or when that is unknown; otherwise a warning
/// naming both (byte ids against a tokenizer's, or two tokenizers whose files differ).
std::string trained_data_warning(const Config& config, const std::string& checkpoint);

/// The tokenizer files of Hugging Face's save_pretrained that `folder` holds (tokenizer.json,
/// tokenizer_config.json, special_tokens_map.json, tokenizer.model, ...), in a fixed order.
std::vector<std::filesystem::path> hf_tokenizer_files(const std::filesystem::path& folder);

/// The tokenizer files of the run whose config.toml is `run_config`: those of the folder its
/// [data] tokenizer names (or holds that file), else of its [trainer] init_from Hugging Face
/// folder. `source` receives where they were found ("" when none).
std::vector<std::filesystem::path> run_tokenizer_files(const std::string& run_config, std::string& source);

/// The generation_config.json the run's model came with (transformers' save_pretrained writes the
/// one the model was loaded with): beside its [model] config file, else in its [trainer] init_from
/// Hugging Face folder; "" when neither holds one.
std::filesystem::path run_generation_config(const std::string& run_config);

}  // namespace tessera::host
