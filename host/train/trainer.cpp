#include "train/trainer_steps.hpp"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <limits>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

#include "compose/plugin_set.hpp"
#include "loggers/record_file.hpp"
#include "loggers/run_directory.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/clip_grad.hpp"
#include "tessera/core/comm.hpp"
#include "data/data_loader.hpp"
#include "fsdp/wrap.hpp"
#include "tessera/core/ledger.hpp"
#include "trace/trace.hpp"
#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below
#include "tessera/sdk/checkpoint_io_features.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/sync_batch_norm.hpp"
#include "tessera/sdk/token_data.hpp"
#include "train/anomaly.hpp"
#include "train/lr_find.hpp"
#include "train/lr_schedule.hpp"
#include "train/model_summary.hpp"
#include "train/profiler.hpp"

#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace tessera::host {

namespace {

/// The signal that asked fit to stop (SIGINT, SIGTERM); a second one ends the process.
volatile sig_atomic_t g_signal = 0;

void on_stop_signal(int signal) {
  if (g_signal != 0) {
    ::signal(signal, SIG_DFL);
    ::raise(signal);
  }
  g_signal = signal;
}

}  // namespace

StopSignals::StopSignals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // a collective blocked in a syscall carries on
  ::sigaction(SIGINT, &action, &old_int_);
  ::sigaction(SIGTERM, &action, &old_term_);
}

StopSignals::~StopSignals() {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
  g_signal = 0;
}

int StopSignals::received() { return g_signal; }

std::string metrics_line(const std::string& head, const std::map<std::string, double>& metrics, int precision) {
  std::string line = head;
  for (const auto& [name, value] : metrics) line += "  " + name + " " + RunLog::number(value, precision);
  return line;
}

/// LibTorch's dtype errors inside a step under autocast, explained: the classic is LibTorch
/// 1.13's CPU autocast leaving LayerNorm out of its cast lists, so a LayerNorm fed by a bf16
/// Linear output meets its fp32 weight. Other errors pass through unchanged.
void explain_step_failure(const c10::Error& error, const std::string& step, const std::string& precision,
                          const c10::Device& device, torch::nn::Module& network) {
  std::string message = error.what_without_backtrace();
  const bool dtype_error = message.find("scalar type") != std::string::npos || message.find("dtype") != std::string::npos;
  if (!dtype_error || precision.find("-mixed") == std::string::npos) throw;
  std::vector<std::string> norms;
  for (const auto& item : network.named_modules("", /*include_self=*/false))
    if (item.value()->name() == "torch::nn::LayerNormImpl") norms.push_back(item.key());
  std::string listed;
  for (std::size_t i = 0; i < norms.size() && i < 6; ++i) listed += (i ? ", " : "") + norms[i];
  if (norms.size() > 6) listed += ", ... (" + std::to_string(norms.size()) + " in all)";
  TESSERA_FAIL(step, " failed under precision ", precision, " on ", device.str(), ": ",
               message.substr(0, message.find('\n')), ".\n  Likely cause: autocast runs Linear and matmul in ",
               precision.substr(0, precision.find('-')), " but ",
               norms.empty() ? "leaves some ops of the model in fp32, so one of them met a low-precision input"
                             : "LibTorch's " + std::string(device.is_cpu() ? "CPU " : "") +
                                   "autocast leaves LayerNorm out, so a LayerNorm fed by a low-precision output "
                                   "meets its fp32 weight. LayerNorm modules in the model: " + listed,
               ".\n  Fix: give those modules fp32 inputs in the model (e.g. norm(x.to(at::kFloat))), or use "
               "[precision] precision = \"bf16-true\" (the whole model in bf16)");
}

Trainer::Trainer(Config config, const sdk::ClusterInfo& cluster, RunLog& log)
    : config_(std::move(config)), cluster_(cluster), log_(log),
      loader_(core::PluginLoader::search_path(config_.plugin_dirs)), faults_(cluster.global_rank, log) {}

Trainer::~Trainer() {
  if (strategy_) strategy_->teardown();
}

void Trainer::setup(const std::string& stage, const std::string& command) {
  stage_ = stage;
  // Every plugin and callback is created (and its configuration checked) before any work starts.
  PluginSet plugins = compose_plugins(loader_, config_);
  strategy_ = std::move(plugins.strategy);
  precision_ = std::move(plugins.precision);
  checkpoint_io_ = std::move(plugins.checkpoint_io);
  model_ = std::move(plugins.model);
  data_ = std::move(plugins.data);
  callbacks_ = make_callbacks(config_, loader_);
  if (config_.trainer.profiler == "simple" || config_.trainer.profiler == "trace") core::trace::enable(true);

  strategy_->setup_environment(cluster_);
  precision_->check_device(strategy_->root_device());
  at::manual_seed(static_cast<std::uint64_t>(config_.trainer.seed));
  {
    sdk::GuardPtr sharded = strategy_->model_sharded_context();
    sdk::GuardPtr dtype = precision_->module_init_context();
    model_->configure_model();
  }
  const std::int64_t frozen = freeze_parameters(config_, *model_->network());
  for (const auto& item : model_->network()->named_parameters()) model_shapes_[item.key()] = item.value().sizes().vec();
  for (const auto& item : model_->network()->named_buffers()) model_shapes_[item.key()] = item.value().sizes().vec();
  std::int64_t parameters = 0, trainable = 0;
  for (const auto& p : model_->network()->parameters()) {
    parameters += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  strategy_->setup(model_, config_.optimizer);
  for (const auto& item : model_->network()->named_parameters())
    trainable_at_setup_.emplace_back(item.key(), item.value(), item.value().requires_grad());
  data_->setup(stage);
  check_data_against_model(stage);
  log_.info("tessera " + (command.empty() ? stage : command) + ": strategy " + config_.plugin_names.at("strategy") + ", precision " +
            precision_->precision() + ", model " + config_.plugin_names.at("model") + " (" +
            RunLog::number(static_cast<double>(parameters) / 1e6, 4) + "M parameters" +
            (frozen > 0 ? ", " + RunLog::number(static_cast<double>(frozen) / 1e6, 4) + "M frozen by [trainer] freeze" : "") +
            (trainable + frozen < parameters ? ", " + RunLog::number(static_cast<double>(trainable) / 1e6, 4) +
                                                   "M trainable (the model froze the rest: LoRA's base)"
                                             : "") +
            "), data " +
            config_.plugin_names.at("data") + ", " + std::to_string(cluster_.world_size) + " rank(s) [" +
            cluster_.environment + "] on " + strategy_->root_device().str() +
            (core::world_transport().empty() ? "" : "; collectives: " + core::world_transport()));
}

std::int64_t Trainer::freeze_parameters(const Config& config, torch::nn::Module& network) {
  std::int64_t frozen = 0;
  for (const std::string& prefix : config.trainer.freeze) {
    bool matched = false;
    for (auto& item : network.named_parameters(/*recurse=*/true)) {
      const std::string& name = item.key();
      if (name != prefix && name.rfind(prefix + ".", 0) != 0) continue;
      matched = true;
      if (!item.value().requires_grad()) continue;  // tied to one frozen already, or frozen by the model
      item.value().requires_grad_(false);
      frozen += item.value().numel();
    }
    if (matched) continue;
    std::vector<std::string> modules;
    for (const auto& item : network.named_children()) modules.push_back(item.key());
    TESSERA_FAIL("[trainer] freeze: \"", prefix, "\" names no parameter or module of model '",
                 config.plugin_names.at("model"), "'", sdk::did_you_mean(prefix, modules), "; its top-level modules: ",
                 sdk::join(modules), " (a deeper module by its path, e.g. \"blocks.0\", a parameter by its name)");
  }
  return frozen;
}

void Trainer::check_trainable_unchanged() const {
  for (const auto& [name, tensor, requires_grad] : trainable_at_setup_)
    TESSERA_CHECK(tensor.requires_grad() == requires_grad, "step ", global_step_ + 1, ": parameter '", name,
                  "' had requires_grad = ", requires_grad ? "true" : "false", " when the optimizer was built and has ",
                  tensor.requires_grad() ? "true" : "false", " now (changed by a callback or the model): which ",
                  "parameters train is fixed at setup, under every strategy. Freeze with [trainer] freeze or ",
                  "requires_grad_(false) in configure_model(); to train others later, start a new run from this ",
                  "one's checkpoint with [trainer] init_from");
}

std::string Trainer::check_sequence_length(const Config& config, const sdk::Checkpoint& model_hparams,
                                           std::int64_t sequence, const std::string& source) {
  if (!model_hparams.contains("block_size") || !model_hparams.at("block_size").isInt()) return "";
  const std::int64_t context = model_hparams.at("block_size").toInt();
  const sdk::Options& model = config.plugins.at("model");
  const std::string model_key = model.has("block_size") ? model.locate("block_size")
                                                        : "[model] block_size (the model's default)";
  TESSERA_CHECK(sequence <= context, source, ": sequences of ", sequence, " tokens are longer than the model's context, ",
                model_key, " = ", context, ": set [data] block_size to at most ", context, ", or [model] block_size to ",
                "at least ", sequence);
  if (sequence == context) return "";
  return "note: " + source + ": sequences of " + std::to_string(sequence) + " tokens, shorter than the model's " +
         "context (" + model_key + " = " + std::to_string(context) + "): positions " + std::to_string(sequence) +
         ".." + std::to_string(context - 1) + " are never trained";
}

void Trainer::check_data_against_model(const std::string& stage) {
  check_vocabulary();
  if (stage == "predict") return;  // a prompt of any length: generation crops it to the context
  std::shared_ptr<sdk::Dataset> dataset = stage == "fit"        ? data_->train_dataset()
                                          : stage == "validate" ? data_->val_dataset()
                                                                : data_->test_dataset();
  // `validate` and `test` evaluate one split: without it they would end having evaluated nothing.
  TESSERA_CHECK(stage == "fit" || (dataset && dataset->size() > 0), "tessera ", stage, ": data plugin '",
                config_.plugin_names.at("data"), "' has no ", stage == "test" ? "test" : "validation",
                " data (its ", stage == "test" ? "test_dataset()" : "val_dataset()",
                " is empty): give it one (see `tessera config --reference` for its [data] keys)");
  if (!dataset || dataset->size() == 0) return;
  const sdk::Batch sample = dataset->get_batch({0});
  // Token sequences only: [batch, time] integer ids.
  if (!sample.input.defined() || sample.input.dim() != 2 || at::isFloatingType(sample.input.scalar_type())) return;
  const sdk::Options& data = config_.plugins.at("data");
  const std::string source = data.has("block_size") ? data.locate("block_size") + " = " +
                                                          std::to_string(sample.input.size(1))
                                                    : "the [data] plugin's " + stage + " batches";
  std::string note = check_sequence_length(config_, model_->hyper_parameters(), sample.input.size(1), source);
  if (!note.empty()) log_.info(note);
}

void Trainer::check_vocabulary() const {
  // Token data against the model's embedding: an id at or above the model's vocab_size would
  // index past it at some step; refused here, on every rank, before any step.
  const auto* vocabulary = dynamic_cast<const sdk::TokenVocabulary*>(data_.get());
  const sdk::Checkpoint hparams = model_->hyper_parameters();
  if (!vocabulary || vocabulary->vocab_size() <= 0 || !hparams.contains("vocab_size") || !hparams.at("vocab_size").isInt())
    return;
  const std::int64_t model_vocab = hparams.at("vocab_size").toInt(), data_vocab = vocabulary->vocab_size();
  const sdk::Options& model = config_.plugins.at("model");
  const std::string model_key = model.has("vocab_size") ? model.locate("vocab_size")
                                                        : "[model] vocab_size (the model's default)";
  TESSERA_CHECK(data_vocab <= model_vocab, vocabulary->vocab_source(), " holds token ids up to ", data_vocab - 1,
                " (vocab_size ", data_vocab, "), more than the model's ", model_key, " = ", model_vocab,
                ": set [model] vocab_size = ", data_vocab);
  if (data_vocab < model_vocab)
    log_.info("note: " + vocabulary->vocab_source() + " has vocab_size " + std::to_string(data_vocab) + ", the model's " +
              model_key + " = " + std::to_string(model_vocab) + ": ids " + std::to_string(data_vocab) + ".." +
              std::to_string(model_vocab - 1) + " are never trained");
}

void Trainer::begin_run() {
  open_run_directory();
  call("setup", [&](sdk::Callback& c) { c.setup(*this, stage_); });
}

void Trainer::open_run_directory() {
  const std::string parent = versions_parent(config_.trainer.default_root_dir, config_.logger);
  std::string version = config_.logger.version;
  if (const char* chosen = std::getenv("TESSERA_RUN_DIR")) {  // chosen before the ranks started (main.cpp)
    log_dir_ = chosen;
  } else {
    if (version.empty()) {
      at::Tensor n = at::zeros({1}, at::kLong);
      if (cluster_.global_rank == 0) n.fill_(create_next_version(parent));
      at::Tensor on_device = n.to(strategy_->root_device());
      strategy_->broadcast(on_device, 0);
      version = std::to_string(on_device.to(at::kCPU).item<std::int64_t>());
    }
    log_dir_ = run_directory(parent, version);
  }
  if (cluster_.global_rank == 0) {
    std::filesystem::create_directories(log_dir_);
    write_record(log_dir_ + "/config.toml", list_config(config_));  // every key, defaults included
    for (const auto& name : config_.logger.loggers)
      loggers_.push_back(name == "csv" ? make_csv_logger(log_dir_) : make_tensorboard_logger(log_dir_));
    HyperParameters hparams;
    flatten_hyperparameters(model_->hyper_parameters(), "", hparams);
    for (const auto& section : kPluginSections) hparams[section] = config_.plugin_names.at(section);
    hparams["precision"] = precision_->precision();
    hparams["optimizer.name"] = config_.optimizer.name;
    hparams["optimizer.lr"] = config_.optimizer.lr;
    hparams["data.batch_size"] = config_.data.batch_size;
    hparams["world_size"] = cluster_.world_size;
    for (auto& logger : loggers_) logger->log_hyperparams(hparams);
  }
  strategy_->barrier("run directory");
  log_.attach(log_dir_ + "/logs");
  log_.info("run directory: " + log_dir_);
}

std::string Trainer::resolve_checkpoint(const Config& config, const std::string& ckpt_path, bool fit,
                                       std::vector<std::string>* notes) {
  if (ckpt_path.empty()) return "";
  const std::string runs = versions_parent(config.trainer.default_root_dir, config.logger);
  if (ckpt_path == "auto") {
    std::vector<std::string> passed_over;
    const std::optional<std::string> good = newest_verified_checkpoint(runs, config.logger, passed_over);
    TESSERA_CHECK(good || passed_over.empty() || fit, "--ckpt-path auto: no checkpoint under ", runs,
                  " verifies:\n  ", sdk::join(passed_over, "\n  "));
    if (notes != nullptr) {
      for (const std::string& why : passed_over)
        notes->push_back("resume = \"auto\": passed over a checkpoint that does not verify (it is kept): " + why);
      if (!passed_over.empty())
        notes->push_back(good ? "resume = \"auto\": resuming from " + *good + ", the newest checkpoint that verifies"
                              : "resume = \"auto\": no checkpoint verifies; training starts from the beginning");
    }
    return good.value_or("");
  }
  if (ckpt_path == "last" && fit) return newest_run_checkpoint(runs, config.logger).value_or("");
  if (ckpt_path == "last") return find_last_checkpoint(runs, config.logger);
  if (ckpt_path == "best") return find_best_checkpoint(runs, config.logger);
  TESSERA_CHECK(std::filesystem::exists(ckpt_path), "--ckpt-path ", ckpt_path,
                " does not exist: pass a checkpoint written by tessera fit, \"last\", \"best\" or \"auto\"");
  return ckpt_path;
}

void Trainer::log_metrics(const std::map<std::string, double>& metrics) { log_stage_metrics(metrics, "train"); }

void Trainer::log_stage_metrics(const std::map<std::string, double>& metrics, const std::string& stage) {
  for (const auto& [name, value] : metrics) callback_metrics_[name] = value;
  for (auto& logger : loggers_) logger->log_metrics(metrics, global_step_, epoch_, stage);
}

void Trainer::request_stop(const std::string& reason) {
  // Lightning's min_steps / min_epochs: a callback (early stopping) cannot end training before
  // them. The step and epoch are the same on every rank, so every rank decides alike.
  const TrainerSettings& t = config_.trainer;
  if (global_step_ < t.min_steps || epoch_ < t.min_epochs) {
    log_.info("a stop was requested at step " + std::to_string(global_step_) + " (" + reason + "), but " +
              (global_step_ < t.min_steps ? "[trainer] min_steps = " + std::to_string(t.min_steps)
                                          : "[trainer] min_epochs = " + std::to_string(t.min_epochs)) +
              " is not reached: training continues");
    return;
  }
  stop(reason);
}

void Trainer::stop(const std::string& reason) {
  if (!should_stop_) stop_reason_ = reason;
  should_stop_ = true;
}

void Trainer::synchronise_batch_norms(std::int64_t data_ranks) {
  std::vector<std::string> synchronised, plain;
  std::vector<toolkit::SyncBatchNorm2dImpl*> layers;
  for (const auto& item : model_->network()->named_modules("", /*include_self=*/false)) {
    torch::nn::Module* m = item.value().get();
    if (auto* layer = dynamic_cast<toolkit::SyncBatchNorm2dImpl*>(m)) {
      layers.push_back(layer);
      synchronised.push_back(item.key());
    } else if (core::fsdp::is_batch_norm(*m)) {  // LibTorch's own
      plain.push_back(item.key());
    }
  }
  TESSERA_CHECK(plain.empty(), "[trainer] sync_batchnorm = true, but ", sdk::join(plain), " ",
                (plain.size() == 1 ? "is a torch::nn BatchNorm layer, which normalises"
                                   : "are torch::nn BatchNorm layers, which normalise"),
                " over this rank's samples only: build ", (plain.size() == 1 ? "it" : "them"),
                " as tessera::toolkit::SyncBatchNorm2d (<tessera/toolkit/sync_batch_norm.hpp>, a drop-in BatchNorm2d)");
  TESSERA_CHECK(!synchronised.empty(), "[trainer] sync_batchnorm = true, but model '", config_.plugin_names.at("model"),
                "' has no BatchNorm layer to synchronise: remove the key");
  TESSERA_CHECK(data_ranks == cluster_.world_size, "[trainer] sync_batchnorm = true under tensor parallelism is not ",
                "supported: the ranks of a tensor-parallel group share their samples");
  log_.info("sync_batchnorm: " + std::to_string(synchronised.size()) + " BatchNorm layer(s) normalise over all " +
            std::to_string(data_ranks) + " rank(s) (" + sdk::join(synchronised) + ")");
  // One rank too computes its statistics the synchronised way (in double), so that the world
  // size does not change the arithmetic; its sum over ranks is the tensor itself.
  auto strategy = strategy_;
  const bool alone = cluster_.world_size == 1;
  for (auto* layer : layers)
    layer->set_all_reduce([strategy, alone](at::Tensor& t) {
      if (!alone) t.copy_(strategy->reduce(t, sdk::ReduceOp::sum));
    });
}

void Trainer::finish(const std::string& status) {
  if (status == "failed") {
    try {  // the error that ends the run is reported; a background save's own failure too
      report_committed_saves(/*wait=*/true);
    } catch (const std::exception& e) {
      log_.info(std::string("error: ") + e.what());
    }
  } else {
    report_committed_saves(/*wait=*/true);  // a failed background save fails the run
  }
  call("teardown", [&](sdk::Callback& c) { c.teardown(*this, stage_); });
  for (auto& logger : loggers_) logger->finalize(status);
  if (status != "failed" && !log_dir_.empty()) {  // after a failure the error says what and where
    std::vector<std::string> records;
    std::error_code ec;
    for (const char* name : {"config.toml", "hparams.yaml", "metrics.csv", "lr_find.csv", "checkpoints/"})
      if (std::filesystem::exists(log_dir_ + "/" + name, ec)) records.push_back(name);
    records.push_back("logs/rank-*.log");
    log_.info("run records in " + log_dir_ + "/: " + sdk::join(records));
  }
  if (torch_profiler_) {
    const std::string table = torch_profiler_->report(
        log_dir_ + "/pytorch-trace-rank-" + std::to_string(cluster_.global_rank) + ".json", cluster_.global_rank);
    if (!table.empty() && cluster_.global_rank == 0) {
      log_.info(table + "trace written: " + log_dir_ + "/pytorch-trace-rank-*.json (https://ui.perfetto.dev)");
      write_record(log_dir_ + "/profiler.txt", table);
    }
  } else if (!config_.trainer.profiler.empty()) {
    std::vector<core::trace::Event> events = core::trace::events();
    if (config_.trainer.profiler == "simple") {
      std::string table = simple_profile(events);
      if (cluster_.global_rank == 0) {
        log_.info(table);
        write_record(log_dir_ + "/profiler.txt", table);
      }
    } else {
      std::string path = log_dir_ + "/trace-rank-" + std::to_string(cluster_.global_rank) + ".json";
      write_chrome_trace(path, cluster_.global_rank, events);
      log_.info("trace written: " + path + " (open in https://ui.perfetto.dev or chrome://tracing)");
    }
  }
}

void Trainer::setup_with_weights(const std::string& stage, const std::string& ckpt_path) {
  const std::string checkpoint = resolve_checkpoint(config_, ckpt_path);
  const std::string initial = initial_weights(config_, checkpoint);
  check_weights_given(stage, checkpoint, initial);
  setup(stage);
  if (!checkpoint.empty()) restore(checkpoint, Restore::weights);
  if (!initial.empty()) restore(initial, Restore::initial_weights);
}

}  // namespace tessera::host
