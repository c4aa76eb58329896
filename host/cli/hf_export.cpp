#include "cli/hf_export.hpp"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "cli/trained_data.hpp"
#include "compose/plugin_set.hpp"
#include "config/config.hpp"
#include "loggers/run_directory.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "checkpoint/huggingface.hpp"
#include "plugin_loader.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/module.hpp"

namespace tessera::host {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

constexpr const char* kRunConfig = "config.toml";  // what each run folder keeps (Trainer)

}  // namespace

std::pair<std::string, std::string> locate_checkpoint(const std::string& where) {
  std::error_code ec;
  fs::path source(where);
  std::string checkpoint = where, config;
  if (fs::is_directory(source, ec) && !fs::exists(source / kRunConfig, ec) && !core::is_sharded_checkpoint(where)) {
    // A default_root_dir (or its [logger] name folder): the newest run's last checkpoint, as
    // --ckpt-path last finds it, so a documented command never names one version_N.
    checkpoint = find_last_checkpoint(where, LoggerSettings{}, "export " + where);
    source = fs::path(checkpoint);
  }
  if (fs::is_directory(source, ec) && fs::exists(source / kRunConfig, ec)) {  // a run folder
    checkpoint = core::resolve_last((source / "checkpoints").string());
    config = (source / kRunConfig).string();
  } else {
    if (source.filename() == core::kLastPointer) checkpoint = core::resolve_last(source.parent_path().string());
    // <run>/checkpoints/<checkpoint>: the run's config is two levels up.
    const fs::path folder = fs::absolute(checkpoint).lexically_normal().parent_path();
    if (folder.filename() == "checkpoints" && fs::exists(folder.parent_path() / kRunConfig, ec))
      config = (folder.parent_path() / kRunConfig).string();
  }
  return {checkpoint, config};
}

namespace {

/// The checkpoint and the run configuration that built its model.
std::pair<std::string, std::string> locate(const HfExportRequest& request) {
  auto [checkpoint, config] = locate_checkpoint(request.source);
  if (!request.config.empty()) config = request.config;
  TESSERA_CHECK(!config.empty(), "export --format hf builds the model to ask for its config.json and found no run ",
                "configuration for ", request.source, ": pass a default_root_dir (its newest run), a run folder ",
                "(runs/NAME/version_N), a checkpoint inside one, or --config FILE.toml");
  return {checkpoint, config};
}

/// The model's config.json, with torch_dtype set; refuses a model that has none by name.
std::string model_config_json(const std::string& config_path, at::ScalarType dtype) {
  const Config config = Config::load(config_path, {});
  core::PluginLoader loader(core::PluginLoader::search_path(config.plugin_dirs));
  const std::shared_ptr<sdk::Module> module = compose_model(loader, config);
  const std::string& name = config.plugin_names.at("model");
  const auto* hf = dynamic_cast<const sdk::HuggingFaceModel*>(module.get());
  TESSERA_CHECK(hf != nullptr, "model '", name, "' (", config_path, ") does not implement sdk::HuggingFaceModel: its ",
                "tensor names and configuration are not Hugging Face's, so no Hugging Face folder describes it; ",
                "export its weights with --to FILE.safetensors instead");
  json out;
  try {
    out = json::parse(hf->hf_config_json());
  } catch (const std::exception& e) {
    TESSERA_FAIL("model '", name, "': hf_config_json() is not JSON: ", e.what());
  }
  TESSERA_CHECK(out.is_object(), "model '", name, "': hf_config_json() is not a JSON object");
  out["torch_dtype"] = core::hf_dtype_name(dtype);
  return out.dump(2);
}

/// save_pretrained's generation_config.json for a model without one: the token ids of config.json.
std::string generation_config_json(const std::string& config_json) {
  const json config = json::parse(config_json);
  json out = {{"_from_model_config", true}};
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (config.contains(key) && !config.at(key).is_null()) out[key] = config.at(key);
  return out.dump(2);
}

/// save_pretrained writes the tokenizer beside the model: the files of the tokenizer the run
/// trained with (its [data] tokenizer's folder, else its init_from Hugging Face folder).
void copy_tokenizer(const std::string& config_path, const std::string& to) {
  std::string source;
  const std::vector<fs::path> files = run_tokenizer_files(config_path, source);
  if (files.empty()) {
    std::cout << "no tokenizer files copied: " << config_path << " names no tokenizer ([data] tokenizer) and no "
              << "Hugging Face folder holding one ([trainer] init_from); copy them into " << to << " yourself\n";
    return;
  }
  std::vector<std::string> names;
  for (const fs::path& file : files) {
    std::string name = file.filename().string();
    const auto& known = hf_tokenizer_files(file.parent_path());
    if (std::find(known.begin(), known.end(), file) == known.end())  // e.g. sp.model: transformers reads tokenizer.model
      name = file.extension() == ".json" ? "tokenizer.json" : "tokenizer.model";
    std::error_code ec;
    fs::copy_file(file, fs::path(to) / name, fs::copy_options::overwrite_existing, ec);
    TESSERA_CHECK(!ec, "cannot copy the tokenizer file ", file.string(), " to ", (fs::path(to) / name).string(), ": ",
                  ec.message());
    names.push_back(name);
  }
  std::cout << "copied the tokenizer (" << sdk::join(names) << ") from " << source << "\n";
}

}  // namespace

void export_hf(const HfExportRequest& request) {
  const std::pair<std::string, std::string> located = locate(request);
  const std::string& checkpoint = located.first;
  const std::string& config_path = located.second;
  std::vector<core::TensorSpec> specs;
  std::function<at::Tensor(std::size_t)> read;
  std::unique_ptr<core::ShardedReader> sharded;
  std::vector<at::Tensor> mapped;
  sdk::Checkpoint file = sdk::make_checkpoint();
  if (core::is_sharded_checkpoint(checkpoint)) {
    sharded = std::make_unique<core::ShardedReader>(core::read_manifest(checkpoint));
    TESSERA_CHECK(!core::holds_rank_local_state(sharded->manifest()), "checkpoint ", checkpoint,
                  " holds rank-local state (fsdp state_dict_type = \"local\"), not the model's tensors; resume it and ",
                  "save with [strategy] state_dict_type = \"sharded\" or \"full\" to export it");
    for (const auto& [name, t] : core::model_tensors(sharded->manifest()))
      specs.push_back({name, core::scalar_type_of(t->dtype, name), t->global_shape});
    // Each tensor assembled from the byte ranges of its pieces just before it is written.
    read = [&](std::size_t i) {
      return sharded->read(core::model_tensor_key(specs[i].name), core::TensorPiece::whole(specs[i].shape));
    };
  } else {
    file = core::load_checkpoint_file(checkpoint);
    core::check_tensor_checksums(file, checkpoint);
    const sdk::StateDict state =
        core::state_dict_from(core::checkpoint_get(file, "state_dict"), checkpoint + " [state_dict]");
    for (const auto& item : state) {
      specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
      mapped.push_back(item.value());
    }
    // Mapped: each tensor's pages are dropped once it is written (when the next one is asked for).
    read = [&, previous = mapped.size()](std::size_t i) mutable {
      if (previous < mapped.size()) core::release_loaded_pages(mapped[previous]);
      previous = i;
      return mapped[i];
    };
  }
  TESSERA_CHECK(!specs.empty(), "checkpoint ", checkpoint, " holds no model tensors");
  // The dtype asked for, else the stored one (the first floating tensor's: tessera keeps one).
  std::optional<at::ScalarType> stored;
  for (const auto& s : specs)
    if (at::isFloatingType(s.dtype) && !stored) stored = s.dtype;
  const at::ScalarType dtype = request.dtype.value_or(stored.value_or(at::kFloat));
  for (auto& s : specs)
    if (at::isFloatingType(s.dtype)) s.dtype = dtype;
  const std::string config_json = model_config_json(config_path, dtype);
  // The last mapped tensor's pages go with the mapping when `file` does.
  const core::HfExport done = core::write_hf_directory(
      request.to, specs,
      [&](std::size_t i) { return read(i).to(specs[i].dtype).contiguous(); },
      config_json, generation_config_json(config_json), request.max_shard_bytes);
  std::cout << "exported " << checkpoint << " to " << request.to << " (Hugging Face: " << specs.size() << " tensors, "
            << core::hf_dtype_name(dtype) << ", " << done.total_bytes << " bytes in " << done.files.size()
            << (done.files.size() == 1 ? " file" : " files + " + std::string(core::kHfIndexName)) << ")\n";
  copy_tokenizer(config_path, request.to);
}

}  // namespace tessera::host
