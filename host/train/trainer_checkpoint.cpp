// The trainer's checkpoints: what a save holds, resuming from one, and starting a run from a
// checkpoint's weights (init_from, strict or by matching name and shape).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include "loggers/logger.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/comm.hpp"
#include "checkpoint/huggingface.hpp"
#include "tessera/core/ledger.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/checkpoint_io_features.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "plan/plan.hpp"
#include "tessera/toolkit/lora.hpp"
#include "train/trainer.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace tessera::host {

namespace {

using core::kWeightsOnlyKey;

/// "xxh64:<hex>" of a LoRA base's files: config.json and the weights files of a Hugging Face
/// folder (sorted by name), or the one file; read once at init_from (disk speed).
std::string base_digest(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::directory_iterator(path, ec)) {
      const std::string ext = entry.path().extension().string();
      if (entry.is_regular_file() && (entry.path().filename() == "config.json" || ext == ".safetensors" ||
                                      ext == ".bin" || ext == ".ckpt" || ext == ".distcp" || ext == ".json"))
        files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  XXH64_state_t* state = XXH64_createState();
  XXH64_reset(state, 0);
  std::vector<char> buffer(std::size_t{1} << 22);
  for (const fs::path& file : files) {
    const std::string name = file.filename().string();
    XXH64_update(state, name.data(), name.size());
    std::ifstream in(file, std::ios::binary);
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      XXH64_update(state, buffer.data(), static_cast<std::size_t>(in.gcount()));
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(XXH64_digest(state)));
  XXH64_freeState(state);
  return std::string("xxh64:") + hex;
}

void refuse_weights_only(const sdk::Checkpoint& checkpoint, const std::string& path) {
  if (!checkpoint.contains(kWeightsOnlyKey) || !checkpoint.at(kWeightsOnlyKey).toBool()) return;
  // tessera's weights-only saves keep the step; a bare state dict or a safetensors file has none.
  TESSERA_FAIL("checkpoint ", path, " holds the weights only (",
               checkpoint.contains("global_step") ? "model_checkpoint save_weights_only = true"
                                                  : "a state dict or safetensors file, no trainer state",
               "): it has no optimizer state to resume training from. Evaluate it with validate, test or predict, ",
               "start a new run from its weights with [trainer] init_from, or resume fit from a checkpoint saved ",
               "without save_weights_only");
}

/// Lowers the kernel's peak-RSS mark (VmHWM, getrusage's ru_maxrss) to the current RSS, so
/// that the peak of one phase can be read; false where the kernel does not allow it.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

/// "KEY = NOW, the checkpoint's model has THEN"; for a JSON object held as a string (the llama's
/// hf_config_json), only the members that differ.
std::string describe_change(const std::string& key, const std::string& now, const std::string& then) {
  const std::string plain = key + " = " + now + ", the checkpoint's model has " + then;
  nlohmann::json a, b;
  try {
    a = nlohmann::json::parse(nlohmann::json::parse(now).get<std::string>());
    b = nlohmann::json::parse(nlohmann::json::parse(then).get<std::string>());
  } catch (const std::exception&) {
    return plain;
  }
  if (!a.is_object() || !b.is_object()) return plain;
  std::vector<std::string> members;
  for (const auto& [member, value] : a.items())
    if (!b.contains(member)) members.push_back(member + " = " + value.dump() + " (the checkpoint's has none)");
    else if (b[member] != value) members.push_back(member + " = " + value.dump() + " (the checkpoint's: " + b[member].dump() + ")");
  for (const auto& [member, value] : b.items())
    if (!a.contains(member)) members.push_back(member + " absent (the checkpoint's: " + value.dump() + ")");
  return key + " differs in " + sdk::join(members, ", ");
}

}  // namespace

void Trainer::save_checkpoint(const std::string& path, bool weights_only) {
  core::trace::Span span("hook", "[Trainer]save_checkpoint");
  core::LedgerPhase phase("save_checkpoint");  // collectives here wait up to [launch] checkpoint_timeout_s
  faults_.at_step(global_step_, /*saving=*/true);
  sdk::Checkpoint checkpoint = sdk::make_checkpoint();
  checkpoint.insert("state_dict", core::to_ivalue(strategy_->lightning_module_state_dict()));
  if (weights_only) {
    checkpoint.insert(kWeightsOnlyKey, true);
  } else {  // what resuming needs besides the weights
    c10::impl::GenericList optimizer_states(c10::AnyType::get());
    optimizer_states.push_back(strategy_->optimizer_state());
    checkpoint.insert("optimizer_states", optimizer_states);
    checkpoint.insert("precision_plugin", precision_->state_dict());
    c10::impl::GenericList lr_schedulers(c10::AnyType::get());
    lr_schedulers.push_back(schedule_->state_dict(global_step_));
    checkpoint.insert("lr_schedulers", lr_schedulers);
    checkpoint.insert("rng_state", at::detail::getDefaultCPUGenerator().get_state());
    if (strategy_->root_device().is_cuda())
      checkpoint.insert("cuda_rng_state", at::globalContext().defaultGenerator(strategy_->root_device()).get_state());
  }
  checkpoint.insert("global_step", global_step_);
  checkpoint.insert("epoch", epoch_);
  checkpoint.insert("batch_in_epoch", next_batch_);
  if (samples_per_batch_ > 0) checkpoint.insert("samples_per_batch", samples_per_batch_);
  sdk::Checkpoint hyper_parameters = model_->hyper_parameters();
  if (hyper_parameters.contains("lora_r") && !lora_base_.empty()) {
    hyper_parameters.insert("lora_base_model_name_or_path", lora_base_);
    hyper_parameters.insert("lora_base_hash", lora_base_hash_);
  }
  checkpoint.insert("hyper_parameters", hyper_parameters);
  sdk::Checkpoint callback_states = sdk::make_checkpoint();  // Lightning's "callbacks": state_key -> state
  for (const auto& [name, callback] : callbacks_)
    if (std::string key = callback->state_key(); !key.empty()) callback_states.insert(key, callback->state_dict());
  checkpoint.insert("callbacks", callback_states);
  checkpoint.insert("tessera_version", std::string(TESSERA_VERSION));
  checkpoint.insert("save_id", core::agree_on_save_id(*strategy_));
  call("on_save_checkpoint", [&](sdk::Callback& c) { c.on_save_checkpoint(*this, checkpoint); });
  const auto start = std::chrono::steady_clock::now();
  strategy_->save_checkpoint(checkpoint, path);
  auto* async = dynamic_cast<sdk::AsyncCheckpointIO*>(checkpoint_io_.get());
  const bool queued = async != nullptr && async->saves_async();
  log_.info(std::string(queued ? "checkpoint queued: " : "checkpoint saved: ") + path + " (step " +
            std::to_string(global_step_) + (weights_only ? ", weights only" : "") + ", training paused " +
            RunLog::number(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3) + " s" +
            (queued ? "; written in the background: \"checkpoint saved\" follows once it is committed" : "") + ")");
  if (queued) report_committed_saves(/*wait=*/false);
}

void Trainer::report_committed_saves(bool wait) {
  auto* async = dynamic_cast<sdk::AsyncCheckpointIO*>(checkpoint_io_.get());
  if (async == nullptr || !async->saves_async()) return;
  for (const std::string& path : wait ? async->wait_committed() : async->poll_committed())
    log_.info("checkpoint saved: " + path + " (committed in the background)");
}

void Trainer::resume_trained_weights(const sdk::Checkpoint& checkpoint, const std::string& path) {
  // A weight-averaging run saved its average as "state_dict" and the trained weights beside it.
  // Its callback restores both; without one, fit goes on from the trained weights.
  if (!checkpoint.contains(core::kCurrentModelStateKey)) return;
  for (const auto& [name, callback] : callbacks_)
    if (dynamic_cast<KeepsWeightCopy*>(callback.get()) != nullptr) return;
  strategy_->load_model_state_dict(
      core::state_dict_from(checkpoint.at(core::kCurrentModelStateKey), "checkpoint " + path + " [current_model_state]"),
      /*strict=*/true);
  log_.info("checkpoint " + path + " holds weights and their average (weight averaging): without a weight-averaging "
            "callback, fit goes on from the weights and the average is not continued");
}

void Trainer::check_resumed_hyper_parameters(const sdk::Checkpoint& checkpoint, const std::string& path) const {
  if (!checkpoint.contains("hyper_parameters") || !checkpoint.at("hyper_parameters").isGenericDict()) return;
  HyperParameters recorded, now;
  flatten_hyperparameters(checkpoint.at("hyper_parameters").toGenericDict(), "", recorded);
  flatten_hyperparameters(model_->hyper_parameters(), "", now);
  auto text = [](const HyperParameters::mapped_type& value) {
    return std::visit([](const auto& v) { return nlohmann::json(v).dump(); }, value);
  };
  const std::vector<std::string>& allowed = config_.trainer.resume_changed_hparams;
  std::vector<std::string> changed, keys;
  for (const auto& [key, value] : now) {
    // Keys only one side has: a plugin that gained or lost one, not a change of this run's.
    if (!recorded.count(key) || recorded.at(key) == value) continue;
    const std::string line = "[model] " + describe_change(key, text(value), text(recorded.at(key)));
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) {
      log_.info("note: resuming with a changed hyper-parameter ([trainer] resume_changed_hparams): " + line);
      continue;
    }
    changed.push_back(line);
    keys.push_back("\"" + key + "\"");
  }
  TESSERA_CHECK(changed.empty(), "fit --ckpt-path ", path, ": the model's hyper-parameters differ from those the ",
                "checkpoint was trained with:\n  ", sdk::join(changed, "\n  "), "\nresume with the checkpoint's values ",
                "(its run folder's config.toml has them), start a new run from its weights with [trainer] init_from, ",
                "or, if the change is meant, list the keys in [trainer] resume_changed_hparams = [", sdk::join(keys), "]");
  for (const std::string& key : allowed)
    TESSERA_CHECK(now.count(key), "[trainer] resume_changed_hparams names \"", key, "\", which is not a hyper-parameter ",
                  "of model '", config_.plugin_names.at("model"), "'", sdk::did_you_mean(key, [&] {
                    std::vector<std::string> names;
                    for (const auto& item : now) names.push_back(item.first);
                    return names;
                  }()));
}

void Trainer::check_resumable(const std::string& checkpoint) {
  refuse_weights_only(core::read_trainer_state(checkpoint), checkpoint);
}

void Trainer::remove_checkpoint(const std::string& path) {
  strategy_->remove_checkpoint(path);
  log_.to_file("checkpoint removed: " + path);
}

namespace {

constexpr const char* kPeftConfigName = "adapter_config.json";
constexpr const char* kPeftWeightsName = "adapter_model.safetensors";

bool is_peft_directory(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) && std::filesystem::exists(std::filesystem::path(path) / kPeftConfigName, ec);
}

/// A PEFT folder's adapter_config.json, checked: a LoRA adapter whose weights file is there and
/// whose base is a Hugging Face folder on this machine.
nlohmann::json read_peft_config(const std::string& path) {
  const std::filesystem::path dir(path);
  std::ifstream in(dir / kPeftConfigName);
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    TESSERA_FAIL((dir / kPeftConfigName).string(), " is not JSON: ", e.what());
  }
  TESSERA_CHECK(config.value("peft_type", "") == "LORA", (dir / kPeftConfigName).string(), ": peft_type ",
                config.contains("peft_type") ? config.at("peft_type").dump() : "(none)",
                "; tessera continues LoRA adapters (\"LORA\") only");
  TESSERA_CHECK(std::filesystem::exists(dir / kPeftWeightsName), "PEFT folder ", path, " has no ", kPeftWeightsName,
                " (adapter_model.bin, PyTorch's pickle, is not read: save it with safe_serialization=True)");
  const nlohmann::json base = config.value("base_model_name_or_path", nlohmann::json());
  TESSERA_CHECK(base.is_string() && core::is_hf_directory(base.get<std::string>()), (dir / kPeftConfigName).string(),
                ": base_model_name_or_path = ", base.dump(), " is not a Hugging Face model folder on this machine; ",
                "the adapter's base must be one (download it and write its path there)");
  return config;
}

}  // namespace

std::string Trainer::initial_weights(const Config& config, const std::string& checkpoint) {
  const std::string& path = config.trainer.init_from;
  if (!checkpoint.empty() || path.empty()) return "";
  TESSERA_CHECK(std::filesystem::exists(path), "[trainer] init_from = \"", path, "\" does not exist: give a checkpoint ",
                "(a .ckpt file, a sharded checkpoint folder or a `last` link to one), a torch.save'd state dict, a ",
                ".safetensors file, a Hugging Face model folder or a PyTorch DCP folder; relative paths are taken ",
                "from the working directory");
  try {
    if (is_peft_directory(path)) {
      const nlohmann::json peft = read_peft_config(path);
      (void)core::read_hf_directory(peft.at("base_model_name_or_path").get<std::string>());
      return path;
    }
    if (core::is_hf_directory(path)) {
      (void)core::read_hf_directory(path);  // the index, every file and header; the names and shapes at load
      return path;
    }
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec) && !core::is_sharded_checkpoint(path) && !core::is_dcp_checkpoint(path))
      for (const char* name : {core::kHfConfigName, core::kHfWeightsName, core::kHfIndexName})
        TESSERA_CHECK(!std::filesystem::exists(std::filesystem::path(path) / name, ec), "it holds ", name,
                      " but is not a Hugging Face model folder: that needs ", core::kHfConfigName, " and ",
                      core::kHfWeightsName, " or ", core::kHfIndexName);
    (void)core::read_trainer_state(path);  // a format tessera reads; the tensors are compared at load
  } catch (const sdk::Error& e) {
    TESSERA_FAIL("[trainer] init_from = \"", path, "\": ", e.what());
  }
  return path;
}

void Trainer::check_weights_given(const std::string& command, const std::string& checkpoint,
                                  const std::string& initial) {
  TESSERA_CHECK((command != "validate" && command != "test") || !checkpoint.empty() || !initial.empty(), command,
                " needs --ckpt-path last|best|PATH or [trainer] init_from: without either it would evaluate the ",
                "model's random initial weights");
}

void Trainer::restore_peft(const std::string& path) {
  nlohmann::json peft;
  try {
    peft = read_peft_config(path);
  } catch (const sdk::Error& e) {
    TESSERA_FAIL("[trainer] init_from = \"", path, "\": ", e.what());
  }
  const sdk::Checkpoint h = model_->hyper_parameters();
  TESSERA_CHECK(h.contains("lora_r"), "[trainer] init_from = \"", path, "\" is a PEFT LoRA adapter, but model '",
                config_.plugin_names.at("model"), "' has no [model.lora]: add the table with the adapter's r = ",
                peft.value("r", nlohmann::json()).dump(), ", alpha = ", peft.value("lora_alpha", nlohmann::json()).dump(),
                " and target_modules = ", peft.value("target_modules", nlohmann::json()).dump());
  std::vector<std::string> differ;
  const std::int64_t r = h.at("lora_r").toInt();
  const double alpha = h.at("lora_alpha").toDouble();
  std::vector<std::string> targets;
  {
    const std::string joined = h.at("lora_target_modules").toStringRef();
    for (std::size_t start = 0; start < joined.size();) {
      const std::size_t comma = std::min(joined.find(',', start), joined.size());
      targets.push_back(joined.substr(start, comma - start));
      start = comma + 1;
    }
  }
  if (peft.value("r", nlohmann::json()) != nlohmann::json(r))
    differ.push_back("r: the adapter's " + peft.value("r", nlohmann::json()).dump() + ", [model.lora] " + std::to_string(r));
  if (!peft.contains("lora_alpha") || !peft.at("lora_alpha").is_number() || peft.at("lora_alpha").get<double>() != alpha)
    differ.push_back("lora_alpha: the adapter's " + peft.value("lora_alpha", nlohmann::json()).dump() +
                     ", [model.lora] alpha " + nlohmann::json(alpha).dump());
  std::vector<std::string> theirs;
  if (peft.contains("target_modules") && peft.at("target_modules").is_array())
    for (const auto& t : peft.at("target_modules")) theirs.push_back(t.is_string() ? t.get<std::string>() : t.dump());
  std::vector<std::string> a = theirs, b = targets;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  if (a != b)
    differ.push_back("target_modules: the adapter's " + peft.value("target_modules", nlohmann::json()).dump() +
                     ", [model.lora] " + nlohmann::json(targets).dump());
  TESSERA_CHECK(differ.empty(), "[trainer] init_from = \"", path, "\": the adapter does not fit [model.lora]: ",
                sdk::join(differ, "; "), "; set [model.lora] as the adapter's adapter_config.json has it");
  const std::string base = peft.at("base_model_name_or_path").get<std::string>();
  restore(base, Restore::initial_weights);  // the base, strictly; the adapters keep their initialisation
  const std::string weights = (std::filesystem::path(path) / kPeftWeightsName).string();
  try {
    const sdk::StateDict state = model_weights(strategy_->load_checkpoint(weights), weights);  // base_model.model. dropped
    std::vector<std::string> missing, unexpected;
    for (const auto& [name, shape] : model_shapes_)
      if (toolkit::is_lora_parameter(name) && !state.contains(name)) missing.push_back(name);
    for (const auto& item : state)
      if (!toolkit::is_lora_parameter(item.key()) || !model_shapes_.count(item.key())) unexpected.push_back(item.key());
    TESSERA_CHECK(missing.empty() && unexpected.empty(), "its tensors are not the model's adapters: ", missing.size(),
                  " missing [", sdk::join(missing), "], ", unexpected.size(), " not adapters of the model [",
                  sdk::join(unexpected), "]");
    strategy_->load_model_state_dict(state, /*strict=*/false);
  } catch (const std::exception& e) {
    const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
    TESSERA_FAIL("[trainer] init_from = \"", path, "\" (", kPeftWeightsName, "): ",
                 torch_error ? torch_error->what_without_backtrace() : e.what());
  }
  log_.info("[trainer] init_from = " + path + ": the PEFT adapter (r " + std::to_string(r) + ", lora_alpha " +
            nlohmann::json(alpha).dump() + ") on its base " + base + ", continued");
}

void Trainer::restore(const std::string& path, Restore what) {
  if (what == Restore::initial_weights && is_peft_directory(path)) return restore_peft(path);
  const bool with_training_state = what == Restore::training_state;
  core::LedgerPhase phase("load_checkpoint");
  // The memory a load costs (the busiest rank's peak above what it held before): about its
  // shard under a sharding strategy, whatever the checkpoint's format.
  earlier_peak_rss_kb_ = std::max(earlier_peak_rss_kb_, proc_status_kb("VmHWM"));
  const bool peak_measured = reset_peak_rss();
  const std::int64_t rss_before_kb = proc_status_kb("VmRSS");
  const auto start = std::chrono::steady_clock::now();
  sdk::Checkpoint checkpoint = sdk::make_checkpoint();
  std::string file = path;  // what the strategy loads: a Hugging Face folder's weights file or index
  if (what == Restore::initial_weights && core::is_hf_directory(path)) {
    const bool strict = config_.trainer.init_from_strict;
    try {
      const core::HfDirectory hf = core::read_hf_directory(path);
      // Tensors first: a shape error names the tensor, its file and both shapes.
      std::vector<std::string> names;
      for (const auto& item : hf.tensors) names.push_back(item.first);
      if (strict && !loads_lora_base(names, path)) core::check_hf_against_model(hf, model_shapes_, /*strict=*/true);
      if (const auto* model = dynamic_cast<const sdk::HuggingFaceModel*>(model_.get()))
        core::check_hf_config(hf.config_json, model->hf_config_json(),
                              (std::filesystem::path(path) / core::kHfConfigName).string(), /*model_type_only=*/!strict);
      file = hf.weights;
    } catch (const sdk::Error& e) {
      TESSERA_FAIL("[trainer] init_from = \"", path, "\": ", e.what(),
                   strict ? "; if the model differs from the folder's on purpose (a new head, added layers), [trainer] "
                            "init_from_strict = false loads the tensors that match by name and shape"
                          : "");
    }
  }
  if (what == Restore::initial_weights && !config_.trainer.init_from_strict) {
    load_matching_weights(file);
  } else {
    try {
      checkpoint = strategy_->load_checkpoint(file);
      if (with_training_state) check_resumed_hyper_parameters(checkpoint, file);  // before shapes can disagree
      const sdk::StateDict weights = model_weights(checkpoint, file);
      std::vector<std::string> names;
      for (const auto& item : weights) names.push_back(item.key());
      const bool base_only = what == Restore::initial_weights && loads_lora_base(names, path);
      strategy_->load_model_state_dict(weights, /*strict=*/!base_only);
      if (base_only)
        log_.info("[trainer] init_from = " + path + ": the base of the LoRA model ([model.lora]); its adapters start " +
                  "from PEFT's initialisation (lora_A kaiming uniform, lora_B zeros)");
    } catch (const std::exception& e) {
      const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
      const std::string message = torch_error ? torch_error->what_without_backtrace() : e.what();
      if (what != Restore::initial_weights && message.find(path) != std::string::npos) throw;  // names its file
      if (what != Restore::initial_weights)
        TESSERA_FAIL("checkpoint ", path, ": ", message, "; it does not fit model '", config_.plugin_names.at("model"),
                     "' as configured: pass a checkpoint of this model, use the [model] settings it was trained with ",
                     "(its run folder's config.toml), or start a new run from its matching weights with [trainer] ",
                     "init_from and init_from_strict = false");
      TESSERA_FAIL("[trainer] init_from = \"", path, "\": ", message, "; if the model differs from the checkpoint's on ",
                   "purpose (a new head, added layers), [trainer] init_from_strict = false loads the tensors that ",
                   "match by name and shape and keeps the model's initialisation for the others");
    }
  }
  if (what == Restore::initial_weights && model_->hyper_parameters().contains("lora_r")) {
    lora_base_ = std::filesystem::absolute(path).lexically_normal().string();
    lora_base_hash_ = base_digest(path);
  }
  if (with_training_state && checkpoint.contains("hyper_parameters") && checkpoint.at("hyper_parameters").isGenericDict()) {
    const auto h = checkpoint.at("hyper_parameters").toGenericDict();  // a resumed LoRA run keeps its base's identity
    if (h.contains("lora_base_model_name_or_path")) lora_base_ = h.at("lora_base_model_name_or_path").toStringRef();
    if (h.contains("lora_base_hash")) lora_base_hash_ = h.at("lora_base_hash").toStringRef();
  }
  if (with_training_state) {
    refuse_weights_only(checkpoint, path);
    resume_trained_weights(checkpoint, path);
    auto optimizer_states = core::checkpoint_get(checkpoint, "optimizer_states").toListRef();
    TESSERA_CHECK(!optimizer_states.empty(), "checkpoint ", path, " has no optimizer state");
    try {
      strategy_->load_optimizer_state(core::checkpoint_dict(optimizer_states[0], "checkpoint optimizer_states[0]"));
    } catch (const std::exception& e) {
      const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
      TESSERA_FAIL("checkpoint ", path, " [optimizer_states][0] does not fit this run's optimizer ([optimizer] name = \"",
                   config_.optimizer.name, "\"): ", torch_error ? torch_error->what_without_backtrace() : e.what(),
                   "; resume with the optimizer the checkpoint was saved with (its run folder's config.toml), or ",
                   "start a new run from its weights with [trainer] init_from");
    }
    precision_->load_state_dict(core::checkpoint_dict(core::checkpoint_get(checkpoint, "precision_plugin"),
                                                      "checkpoint precision_plugin"));
    global_step_ = core::checkpoint_get(checkpoint, "global_step").toInt();
    epoch_ = core::checkpoint_get(checkpoint, "epoch").toInt();
    next_batch_ = core::checkpoint_get(checkpoint, "batch_in_epoch").toInt();
    restored_samples_per_batch_ =  // absent from checkpoints written before it was saved
        checkpoint.contains("samples_per_batch") ? core::checkpoint_get(checkpoint, "samples_per_batch").toInt() : 0;
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(core::checkpoint_get(checkpoint, "rng_state").toTensor());
    if (strategy_->root_device().is_cuda() && checkpoint.contains("cuda_rng_state")) {
      at::Generator cuda_generator = at::globalContext().defaultGenerator(strategy_->root_device());
      cuda_generator.set_state(core::checkpoint_get(checkpoint, "cuda_rng_state").toTensor());
    }
    if (checkpoint.contains("lr_schedulers")) {  // absent from checkpoints written before the schedule state was saved
      auto schedulers = core::checkpoint_get(checkpoint, "lr_schedulers").toListRef();
      TESSERA_CHECK(schedulers.size() == 1, "checkpoint ", path, " [lr_schedulers] has ", schedulers.size(),
                    " entries; tessera writes exactly one");
      restored_schedule_ = core::checkpoint_dict(schedulers[0], "checkpoint " + path + " [lr_schedulers][0]");
      restored_from_ = path;
    }
    if (checkpoint.contains("callbacks")) {
      sdk::Checkpoint states = core::checkpoint_dict(checkpoint.at("callbacks"), "checkpoint " + path + " [callbacks]");
      for (const auto& [name, callback] : callbacks_)
        if (std::string key = callback->state_key(); !key.empty() && states.contains(key))
          callback->load_state_dict(core::checkpoint_dict(states.at(key), "checkpoint [callbacks][" + key + "]"));
    }
  }
  if (what != Restore::initial_weights)
    call("on_load_checkpoint", [&](sdk::Callback& c) { c.on_load_checkpoint(*this, checkpoint); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  checkpoint = sdk::make_checkpoint();  // what the load left mapped or allocated goes before the peak is read
  const double load_peak_mb =
      static_cast<double>(std::max<std::int64_t>(0, proc_status_kb("VmHWM") - rss_before_kb)) / 1024.0;
  at::Tensor busiest = at::full({}, peak_measured ? load_peak_mb : -1.0, at::kFloat).to(strategy_->root_device());
  const double busiest_mb = strategy_->reduce(busiest, sdk::ReduceOp::max).to(at::kCPU).item<double>();
  log_.info((what == Restore::initial_weights ? "weights initialized from " : "restored ") + path +
            (with_training_state ? " (resuming at step " + std::to_string(global_step_) + ")" : "") +
            (what == Restore::initial_weights ? " ([trainer] init_from)" : "") +
            " in " + RunLog::number(seconds, 3) + " s" +
            (busiest_mb >= 0 ? ", load peak +" + std::to_string(std::llround(busiest_mb)) + " MB RSS per rank" : ""));
}

bool Trainer::loads_lora_base(const std::vector<std::string>& names, const std::string& path) const {
  std::vector<std::string> adapters, missing, unexpected;
  for (const auto& [name, shape] : model_shapes_)
    if (toolkit::is_lora_parameter(name)) adapters.push_back(name);
  if (adapters.empty()) return false;
  const std::set<std::string> given(names.begin(), names.end());
  for (const std::string& name : names)
    if (toolkit::is_lora_parameter(name)) return false;  // a LoRA checkpoint: loaded strictly, adapters included
  for (const auto& [name, shape] : model_shapes_)
    if (!toolkit::is_lora_parameter(name) && !given.count(name)) missing.push_back(name);
  for (const std::string& name : names)
    if (!model_shapes_.count(name)) unexpected.push_back(name);
  TESSERA_CHECK(missing.empty() && unexpected.empty(), "[trainer] init_from = \"", path,
                "\" is not the base of this LoRA model ([model.lora]): ", missing.size(), " of the base's tensors ",
                "missing [", sdk::join(missing), "], ", unexpected.size(), " not in the model [", sdk::join(unexpected),
                "]");
  return true;
}

sdk::StateDict Trainer::model_weights(const sdk::Checkpoint& checkpoint, const std::string& path) {
  const sdk::StateDict state =
      core::state_dict_from(core::checkpoint_get(checkpoint, "state_dict"), "checkpoint " + path + " [state_dict]");
  sdk::StateDict out = state;
  std::string dropped;
  auto names_a_model_tensor = [&] {
    for (const auto& item : out)
      if (model_shapes_.count(item.key())) return true;
    return false;
  };
  while (!out.is_empty() && !names_a_model_tensor()) {
    const std::string& first = out.begin()->key();
    const std::size_t dot = first.find('.');
    if (dot == std::string::npos) break;
    const std::string prefix = first.substr(0, dot + 1);
    sdk::StateDict stripped;
    for (const auto& item : out) {
      if (item.key().rfind(prefix, 0) != 0) return state;  // not one wrapper's: compared as saved
      stripped.insert(item.key().substr(prefix.size()), item.value());
    }
    out = std::move(stripped);
    dropped += prefix;
  }
  if (dropped.empty() || !names_a_model_tensor()) return state;
  log_.info("checkpoint " + path + ": every tensor's name starts with '" + dropped +
            "' (a wrapper's: PyTorch DDP's module., torch.compile's _orig_mod., a LightningModule's attribute), " +
            "which is dropped to match the model's names");
  return out;
}

std::vector<std::string> Trainer::matching_weights(const std::map<std::string, std::vector<std::int64_t>>& file,
                                                   const std::string& path) {
  auto shape = [](at::IntArrayRef sizes) {
    std::ostringstream out;
    out << sizes;
    return out.str();
  };
  std::vector<std::string> matching, unused, kept;
  for (const auto& [name, sizes] : file) {
    auto it = model_shapes_.find(name);
    if (it == model_shapes_.end()) unused.push_back(name);
    else if (sizes != it->second) kept.push_back(name + " (the file's " + shape(sizes) + ", the model's " + shape(it->second) + ")");
    else matching.push_back(name);
  }
  for (const auto& [name, sizes] : model_shapes_)
    if (!file.count(name)) kept.push_back(name + " (not in the file)");
  TESSERA_CHECK(!matching.empty(), "[trainer] init_from = \"", path, "\": none of its ", file.size(),
                " tensors has the name and shape of one of model '", config_.plugin_names.at("model"), "' (",
                model_shapes_.size(), " tensors): is it a checkpoint of this model?");
  log_.info("[trainer] init_from_strict = false: " + std::to_string(matching.size()) + " of the model's " +
            std::to_string(model_shapes_.size()) + " tensors loaded from " + path +
            (kept.empty() ? "" : "; keeping their initialisation: " + sdk::join(kept)) +
            (unused.empty() ? "" : "; not used from the file: " + sdk::join(unused)));
  return matching;
}

void Trainer::load_matching_weights(const std::string& path) {
  TESSERA_CHECK(!core::is_dcp_checkpoint(path), "[trainer] init_from = \"", path, "\" is a PyTorch DCP folder, which ",
                "loads by name and shape in full only: set init_from_strict = true (the default)");
  std::map<std::string, std::vector<std::int64_t>> shapes;
  if (core::is_sharded_checkpoint(path)) {
    // The strategy reads a sharded folder as the pieces its rank owns, every one of which must be
    // there. The matching tensors are read whole instead, about 256 MiB at a time (a rank holds
    // that beside the model), each batch loaded alone: a state dict that leaves tensors out
    // leaves them as they are.
    core::ShardedReader reader(core::read_manifest(path));
    TESSERA_CHECK(!core::holds_rank_local_state(reader.manifest()), "[trainer] init_from = \"", path,
                  "\" holds rank-local state (fsdp state_dict_type = \"local\"), not the model's tensors");
    for (const auto& [name, t] : core::model_tensors(reader.manifest())) shapes.emplace(name, t->global_shape);
    const std::vector<std::string> names = matching_weights(shapes, path);
    sdk::StateDict batch;
    std::size_t bytes = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
      at::Tensor t = reader.read(core::model_tensor_key(names[i]), core::TensorPiece::whole(shapes.at(names[i])));
      bytes += t.nbytes();
      batch.insert(names[i], std::move(t));
      if (bytes < (std::size_t{256} << 20) && i + 1 < names.size()) continue;
      strategy_->load_model_state_dict(batch, /*strict=*/false);
      batch.clear();
      bytes = 0;
    }
    return;
  }
  // A file: mapped, a rank reads what it keeps.
  const sdk::StateDict state = model_weights(strategy_->load_checkpoint(path), path);
  for (const auto& item : state) shapes.emplace(item.key(), item.value().sizes().vec());
  sdk::StateDict matching;
  for (const std::string& name : matching_weights(shapes, path)) matching.insert(name, state[name]);
  strategy_->load_model_state_dict(matching, /*strict=*/false);
}

}  // namespace tessera::host
