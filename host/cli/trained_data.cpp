#include "cli/trained_data.hpp"

#include <optional>

#include <toml++/toml.h>

#include "tessera/core/checkpoint_folder.hpp"
#include "checkpoint/huggingface.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/token_shards.hpp"
#include "tessera/toolkit/tokenizer.hpp"

namespace tessera::host {

namespace {

namespace fs = std::filesystem;

/// save_pretrained's tokenizer files (fast and slow tokenizers, chat templates), the model files aside.
const std::vector<std::string>& tokenizer_file_names() {
  static const std::vector<std::string> names = {
      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "added_tokens.json",
      "vocab.json",     "merges.txt",            "vocab.txt",               "chat_template.jinja", "chat_template.json"};
  return names;
}

/// What the ids of a [data] section mean: `hash` tells two apart ("" when unknown).
struct Vocabulary {
  std::string described;
  std::string hash;
};

Vocabulary vocabulary_of(const std::string& plugin, const std::string& tokenizer, const std::string& path) {
  if (plugin == "text") return {"[data] plugin = \"text\" (byte ids, 0-255)", "bytes"};
  if (plugin != "tokens") return {"[data] plugin = \"" + plugin + "\"", ""};
  if (!tokenizer.empty())
    if (std::optional<fs::path> file = toolkit::tokenizer_file(tokenizer))
      return {"[data] plugin = \"tokens\" with the tokenizer " + file->string(), toolkit::xxh64_file(*file)};
  std::error_code ec;
  if (!path.empty() && fs::is_regular_file(fs::path(path) / toolkit::kManifestName, ec)) {
    const toolkit::TokenManifest manifest = toolkit::read_manifest(path);
    if (!manifest.tokenizer_xxh64.empty())
      return {"[data] plugin = \"tokens\" prepared with the tokenizer " + manifest.tokenizer_name + " (" +
                  (fs::path(path) / toolkit::kManifestName).string() + ")",
              manifest.tokenizer_xxh64};
  }
  return {"[data] plugin = \"tokens\"", ""};
}

/// The Hugging Face folder an init_from names (the folder, or a weights file inside one), or "":
/// config.json beside model.safetensors or its index, as save_pretrained writes them.
fs::path hf_folder_of(const std::string& init_from) {
  std::error_code ec;
  if (init_from.empty() || !fs::exists(init_from, ec)) return {};
  const fs::path folder = fs::is_directory(init_from, ec) ? fs::path(init_from) : fs::path(init_from).parent_path();
  const bool weights = fs::is_regular_file(folder / "model.safetensors", ec) ||
                       fs::is_regular_file(folder / "model.safetensors.index.json", ec);
  return weights && fs::is_regular_file(folder / "config.json", ec) ? folder : fs::path();
}

std::string string_at(const toml::table& root, const char* section, const char* key) {
  const toml::node* node = root.at_path(std::string(section) + "." + key).node();
  if (node == nullptr) return "";
  if (const auto* list = node->as_array(); list && !list->empty()) return list->get(0)->value_or(std::string());
  return node->value_or(std::string());
}

std::string option_string(const sdk::Options& options, const std::string& key) {
  const sdk::Value value = options.value(key);
  if (value.is<std::string>()) return value.as<std::string>();
  if (value.is<std::vector<sdk::Value>>() && !value.as<std::vector<sdk::Value>>().empty() &&
      value.as<std::vector<sdk::Value>>().front().is<std::string>())
    return value.as<std::vector<sdk::Value>>().front().as<std::string>();
  return "";
}

}  // namespace

std::string run_config_of_checkpoint(const std::string& checkpoint) {
  if (checkpoint.empty()) return "";
  std::error_code ec;
  fs::path path(checkpoint);
  if (path.filename() == core::kLastPointer) path = core::resolve_last(path.parent_path().string());
  const fs::path folder = fs::absolute(path).lexically_normal().parent_path();
  if (folder.filename() != "checkpoints" || !fs::is_regular_file(folder.parent_path() / kRunConfig, ec)) return "";
  return (folder.parent_path() / kRunConfig).string();
}

std::string trained_data_warning(const Config& config, const std::string& checkpoint) {
  const sdk::Options& data = config.plugins.at("data");
  const Vocabulary now = vocabulary_of(config.plugin_names.at("data"), option_string(data, "tokenizer"),
                                       option_string(data, "path"));
  Vocabulary trained;
  std::string trained_where;
  if (const std::string run_config = run_config_of_checkpoint(checkpoint); !run_config.empty()) {
    toml::table root;
    try {
      root = toml::parse_file(run_config);
    } catch (const toml::parse_error&) {
      return "";  // not ours to judge: the checkpoint loads or fails on its own
    }
    trained = vocabulary_of(string_at(root, "data", "plugin"), string_at(root, "data", "tokenizer"),
                            string_at(root, "data", "path"));
    trained_where = "checkpoint " + checkpoint + " was trained (" + run_config + ") on ";
  } else if (const fs::path folder = hf_folder_of(config.trainer.init_from); checkpoint.empty() && !folder.empty()) {
    if (std::optional<fs::path> file = toolkit::tokenizer_file(folder)) {
      trained = {"the ids of its tokenizer " + file->string(), toolkit::xxh64_file(*file)};
      trained_where = "the weights of [trainer] init_from = \"" + config.trainer.init_from + "\" come with ";
    }
  }
  if (trained.hash.empty() || now.hash.empty() || trained.hash == now.hash) return "";
  return trained_where + trained.described + ", but this config's data is " + now.described +
         ": the prompt's ids (and those decoded back) mean other tokens to the model than those it learned, so its "
         "output will be meaningless. Use the training run's [data] section (its tokenizer)";
}

std::vector<fs::path> hf_tokenizer_files(const fs::path& folder) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const std::string& name : tokenizer_file_names())
    if (fs::is_regular_file(folder / name, ec)) files.push_back(folder / name);
  return files;
}

fs::path run_generation_config(const std::string& run_config) {
  toml::table root;
  try {
    root = toml::parse_file(run_config);
  } catch (const toml::parse_error& e) {
    TESSERA_FAIL(run_config, ": invalid TOML: ", e.description());
  }
  std::error_code ec;
  std::vector<fs::path> folders;
  if (const std::string config = string_at(root, "model", "config"); !config.empty())
    folders.push_back(fs::path(config).parent_path());
  if (const fs::path folder = hf_folder_of(string_at(root, "trainer", "init_from")); !folder.empty())
    folders.push_back(folder);
  for (const fs::path& folder : folders)
    if (fs::is_regular_file(folder / "generation_config.json", ec)) return folder / "generation_config.json";
  return {};
}

std::vector<fs::path> run_tokenizer_files(const std::string& run_config, std::string& source) {
  source.clear();
  toml::table root;
  try {
    root = toml::parse_file(run_config);
  } catch (const toml::parse_error& e) {
    TESSERA_FAIL(run_config, ": invalid TOML: ", e.description());
  }
  std::error_code ec;
  const std::string tokenizer = string_at(root, "data", "tokenizer");
  if (!tokenizer.empty()) {
    const fs::path folder = fs::is_directory(tokenizer, ec) ? fs::path(tokenizer) : fs::path(tokenizer).parent_path();
    std::vector<fs::path> files = hf_tokenizer_files(folder);
    // A tokenizer file under another name (e.g. sp.model) goes under the name transformers reads.
    if (fs::is_regular_file(tokenizer, ec)) {
      bool listed = false;
      for (const fs::path& f : files) listed = listed || fs::equivalent(f, tokenizer, ec);
      if (!listed) files.push_back(tokenizer);
    }
    if (!files.empty()) {
      source = "[data] tokenizer = \"" + tokenizer + "\"";
      return files;
    }
  }
  const std::string init_from = string_at(root, "trainer", "init_from");
  if (const fs::path folder = hf_folder_of(init_from); !folder.empty()) {
    std::vector<fs::path> files = hf_tokenizer_files(folder);
    if (!files.empty()) source = "[trainer] init_from = \"" + init_from + "\"";
    return files;
  }
  return {};
}

}  // namespace tessera::host
