#include "cli/hf_export.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
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
#include "tessera/core/safetensors.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/module.hpp"

namespace tessera::host {

namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;  // config.json keeps its keys in order

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
  ordered_json out;
  try {
    out = ordered_json::parse(hf->hf_config_json());
  } catch (const std::exception& e) {
    TESSERA_FAIL("model '", name, "': hf_config_json() is not JSON: ", e.what());
  }
  TESSERA_CHECK(out.is_object(), "model '", name, "': hf_config_json() is not a JSON object");
  out["torch_dtype"] = core::hf_dtype_name(dtype);
  return out.dump(2);
}

/// save_pretrained's generation_config.json: the one the run's model came with (chat models name
/// their end-of-turn token there), else, for a model without one, the token ids of config.json.
std::string generation_config_json(const std::string& run_config, const std::string& config_json) {
  if (const fs::path source = run_generation_config(run_config); !source.empty()) {
    std::ifstream in(source, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    try {
      TESSERA_CHECK(ordered_json::parse(text).is_object(), source.string(), " is not a JSON object");
    } catch (const ordered_json::exception& e) {
      TESSERA_FAIL(source.string(), " (the model's generation config, copied by the export) is not JSON: ", e.what());
    }
    std::cout << "copied " << source.string() << "\n";
    return text;
  }
  const ordered_json config = ordered_json::parse(config_json);
  ordered_json out = {{"_from_model_config", true}};
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

/// A checkpoint's model tensors, full file or sharded folder, each read when asked for.
struct CheckpointTensors {
  explicit CheckpointTensors(const std::string& checkpoint) {
    if (core::is_sharded_checkpoint(checkpoint)) {
      sharded = std::make_unique<core::ShardedReader>(core::read_manifest(checkpoint));
      TESSERA_CHECK(!core::holds_rank_local_state(sharded->manifest()), "checkpoint ", checkpoint,
                    " holds rank-local state (fsdp state_dict_type = \"local\"), not the model's tensors; resume it ",
                    "and save with [strategy] state_dict_type = \"sharded\" or \"full\" to export it");
      for (const auto& [name, t] : core::model_tensors(sharded->manifest()))
        specs.push_back({name, core::scalar_type_of(t->dtype, name), t->global_shape});
      // Each tensor assembled from the byte ranges of its pieces just before it is written.
      read = [this](std::size_t i) {
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
      // Mapped: each tensor's pages are dropped once it is written (when the next one is asked
      // for); the adapters a merge reads beside a weight are small.
      read = [this, previous = mapped.size()](std::size_t i) mutable {
        if (previous < mapped.size() && previous != i) core::release_loaded_pages(mapped[previous]);
        previous = i;
        return mapped[i];
      };
    }
    TESSERA_CHECK(!specs.empty(), "checkpoint ", checkpoint, " holds no model tensors");
    for (std::size_t i = 0; i < specs.size(); ++i) index[specs[i].name] = i;
  }
  CheckpointTensors(const CheckpointTensors&) = delete;
  CheckpointTensors& operator=(const CheckpointTensors&) = delete;

  std::vector<core::TensorSpec> specs;
  std::function<at::Tensor(std::size_t)> read;
  std::map<std::string, std::size_t> index;
  std::unique_ptr<core::ShardedReader> sharded;
  std::vector<at::Tensor> mapped;
  sdk::Checkpoint file = sdk::make_checkpoint();  // the last mapped tensor's pages go with it
};

/// The LoRA configuration a checkpoint's hyper_parameters record ([model.lora]); none without.
struct LoraRecord {
  std::int64_t r = 0;
  double alpha = 0, dropout = 0;
  std::vector<std::string> target_modules;
  std::string base_model, base_hash;
  double scaling() const { return alpha / static_cast<double>(r); }
};

std::optional<LoraRecord> lora_record(const std::string& checkpoint) {
  const sdk::Checkpoint state = core::read_trainer_state(checkpoint);
  if (!state.contains("hyper_parameters") || !state.at("hyper_parameters").isGenericDict()) return std::nullopt;
  const auto h = state.at("hyper_parameters").toGenericDict();
  if (!h.contains("lora_r")) return std::nullopt;
  LoraRecord out;
  out.r = h.at("lora_r").toInt();
  out.alpha = h.at("lora_alpha").toDouble();
  out.dropout = h.at("lora_dropout").toDouble();
  const std::string targets = h.at("lora_target_modules").toStringRef();
  for (std::size_t start = 0; start < targets.size();) {
    const std::size_t comma = std::min(targets.find(',', start), targets.size());
    if (comma > start) out.target_modules.push_back(targets.substr(start, comma - start));
    start = comma + 1;
  }
  if (h.contains("lora_base_model_name_or_path")) out.base_model = h.at("lora_base_model_name_or_path").toStringRef();
  if (h.contains("lora_base_hash")) out.base_hash = h.at("lora_base_hash").toStringRef();
  return out;
}

bool ends_with(const std::string& name, const std::string& tail) {
  return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}
bool is_adapter(const std::string& name) { return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight"); }

}  // namespace

void export_hf(const HfExportRequest& request) {
  const std::pair<std::string, std::string> located = locate(request);
  const std::string& checkpoint = located.first;
  const std::string& config_path = located.second;
  CheckpointTensors tensors(checkpoint);
  std::vector<core::TensorSpec> specs;
  std::function<at::Tensor(std::size_t)> read;
  const std::optional<LoraRecord> lora = lora_record(checkpoint);
  std::size_t merged = 0;
  if (!lora) {
    specs = tensors.specs;
    read = tensors.read;
  } else {
    // PEFT's merge_and_unload: each adapted weight becomes W + (alpha / r) B A (in fp32), the
    // adapters are left out, and every tensor keeps the base's Hugging Face name.
    std::vector<std::size_t> source;                                      // specs[j] is tensors.specs[source[j]]
    std::map<std::size_t, std::pair<std::size_t, std::size_t>> adapters;  // j -> (its A, its B)
    for (std::size_t i = 0; i < tensors.specs.size(); ++i) {
      const std::string& name = tensors.specs[i].name;
      if (is_adapter(name)) continue;
      if (ends_with(name, ".weight")) {
        const std::string module = name.substr(0, name.size() - 7);
        auto a = tensors.index.find(module + ".lora_A.weight"), b = tensors.index.find(module + ".lora_B.weight");
        if (a != tensors.index.end() && b != tensors.index.end()) adapters[specs.size()] = {a->second, b->second};
      }
      source.push_back(i);
      specs.push_back(tensors.specs[i]);
    }
    merged = adapters.size();
    TESSERA_CHECK(merged > 0, "checkpoint ", checkpoint, " records [model.lora] but holds no lora_A / lora_B tensors");
    read = [&tensors, source, adapters, scaling = lora->scaling()](std::size_t j) {
      auto it = adapters.find(j);
      if (it == adapters.end()) return tensors.read(source[j]);
      const at::Tensor a = tensors.read(it->second.first).to(at::kFloat);
      const at::Tensor b = tensors.read(it->second.second).to(at::kFloat);
      return tensors.read(source[j]).to(at::kFloat) + at::matmul(b, a) * scaling;
    };
  }
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
      config_json, generation_config_json(config_path, config_json), request.max_shard_bytes);
  std::cout << "exported " << checkpoint << " to " << request.to << " (Hugging Face: " << specs.size() << " tensors, "
            << (lora ? std::to_string(merged) + " with their LoRA adapters merged (W + alpha / r B A), " : "")
            << core::hf_dtype_name(dtype) << ", " << done.total_bytes << " bytes in " << done.files.size()
            << (done.files.size() == 1 ? " file" : " files + " + std::string(core::kHfIndexName)) << ")\n";
  copy_tokenizer(config_path, request.to);
}

void export_peft(const HfExportRequest& request) {
  const std::string checkpoint = locate_checkpoint(request.source).first;
  const std::optional<LoraRecord> lora = lora_record(checkpoint);
  TESSERA_CHECK(lora, "checkpoint ", checkpoint, " was not trained with LoRA (its hyper_parameters record no ",
                "[model.lora]): --format peft writes a LoRA adapter; export the whole model with --format hf");
  CheckpointTensors tensors(checkpoint);
  std::vector<core::TensorSpec> specs;
  std::vector<std::size_t> source;
  for (std::size_t i = 0; i < tensors.specs.size(); ++i) {
    if (!is_adapter(tensors.specs[i].name)) continue;
    core::TensorSpec spec = tensors.specs[i];
    spec.name = "base_model.model." + spec.name;  // PEFT's PeftModel wraps the model as base_model.model
    if (request.dtype && at::isFloatingType(spec.dtype)) spec.dtype = *request.dtype;
    specs.push_back(spec);
    source.push_back(i);
  }
  TESSERA_CHECK(!specs.empty(), "checkpoint ", checkpoint, " records [model.lora] but holds no lora_A / lora_B tensors");
  std::error_code ec;
  fs::create_directories(request.to, ec);
  TESSERA_CHECK(!ec, "cannot create ", request.to, ": ", ec.message());
  const std::string weights = (fs::path(request.to) / "adapter_model.safetensors").string();
  core::atomic_write_file(weights, [&](const std::string& temp) {
    core::write_safetensors(
        temp, specs, [&](std::size_t i) { return tensors.read(source[i]).to(specs[i].dtype).contiguous(); },
        {{"format", "pt"}});
  });
  // LoraConfig's fields as PEFT writes them (to_dict), those Tessera computes with set, the
  // others at PEFT's defaults.
  ordered_json config;
  config["base_model_name_or_path"] = lora->base_model.empty() ? ordered_json() : ordered_json(lora->base_model);
  config["bias"] = "none";
  config["fan_in_fan_out"] = false;
  config["inference_mode"] = true;
  config["init_lora_weights"] = true;
  config["layers_to_transform"] = nullptr;
  config["layers_pattern"] = nullptr;
  config["lora_alpha"] = lora->alpha;
  config["lora_dropout"] = lora->dropout;
  config["modules_to_save"] = nullptr;
  config["peft_type"] = "LORA";
  config["r"] = lora->r;
  config["revision"] = nullptr;
  config["target_modules"] = lora->target_modules;
  config["task_type"] = "CAUSAL_LM";
  config["use_dora"] = false;
  config["use_rslora"] = false;
  core::atomic_write_file((fs::path(request.to) / "adapter_config.json").string(), [&](const std::string& temp) {
    std::ofstream out(temp);
    out << config.dump(2) << "\n";
    TESSERA_CHECK(out.good(), "cannot write ", temp);
  });
  std::cout << "exported " << checkpoint << " to " << request.to << " (PEFT LoRA adapter: " << specs.size()
            << " tensors, r " << lora->r << ", lora_alpha " << lora->alpha << ", target_modules "
            << sdk::join(lora->target_modules) << "; base "
            << (lora->base_model.empty() ? std::string("not recorded") : lora->base_model) << ")\n";
}

}  // namespace tessera::host
