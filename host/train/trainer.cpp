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

#include "cli/plugin_keys.hpp"
#include "loggers/record_file.hpp"
#include "loggers/run_directory.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/clip_grad.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/data_loader.hpp"
#include "tessera/core/fsdp/wrap.hpp"
#include "tessera/core/ledger.hpp"
#include "tessera/core/trace.hpp"
#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below
#include "tessera/sdk/checkpoint_io_features.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/sync_batch_norm.hpp"
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

using Clock = std::chrono::steady_clock;

std::string duration(double seconds) {
  auto s = static_cast<std::int64_t>(seconds);
  std::ostringstream out;
  out << std::setfill('0') << s / 3600 << ":" << std::setw(2) << (s / 60) % 60 << ":" << std::setw(2) << s % 60;
  return out.str();
}

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
  using sdk::PluginKind;
  stage_ = stage;
  auto create = [&](const std::string& section, PluginKind kind) {
    return create_plugin(loader_, kind, section, config_);
  };
  // Every plugin and callback is created (and its configuration checked) before any work starts.
  strategy_ = std::dynamic_pointer_cast<sdk::Strategy>(create("strategy", PluginKind::strategy));
  precision_ = std::dynamic_pointer_cast<sdk::Precision>(create("precision", PluginKind::precision));
  checkpoint_io_ = std::dynamic_pointer_cast<sdk::CheckpointIO>(create("checkpoint_io", PluginKind::checkpoint_io));
  model_ = std::dynamic_pointer_cast<sdk::Module>(create("model", PluginKind::model));
  data_ = std::dynamic_pointer_cast<sdk::DataModule>(create("data", PluginKind::data));
  TESSERA_CHECK(strategy_ && precision_ && checkpoint_io_ && model_ && data_,
                "a plugin created an object of the wrong interface");
  callbacks_ = make_callbacks(config_, loader_);
  if (!config_.trainer.profiler.empty()) core::trace::enable(true);

  strategy_->connect(precision_, checkpoint_io_);
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
  std::int64_t parameters = 0;
  for (const auto& p : model_->network()->parameters()) parameters += p.numel();
  strategy_->setup(model_, config_.optimizer);
  for (const auto& item : model_->network()->named_parameters())
    trainable_at_setup_.emplace_back(item.key(), item.value(), item.value().requires_grad());
  data_->setup(stage);
  check_data_against_model(stage);
  log_.info("tessera " + (command.empty() ? stage : command) + ": strategy " + config_.plugin_names.at("strategy") + ", precision " +
            precision_->precision() + ", model " + config_.plugin_names.at("model") + " (" +
            RunLog::number(static_cast<double>(parameters) / 1e6, 4) + "M parameters" +
            (frozen > 0 ? ", " + RunLog::number(static_cast<double>(frozen) / 1e6, 4) + "M frozen by [trainer] freeze" : "") +
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

std::string Trainer::resolve_checkpoint(const Config& config, const std::string& ckpt_path, bool fit) {
  if (ckpt_path.empty()) return "";
  const std::string runs = versions_parent(config.trainer.default_root_dir, config.logger);
  if (ckpt_path == "last" && fit) return newest_run_checkpoint(runs, config.logger).value_or("");
  if (ckpt_path == "last") return find_last_checkpoint(runs, config.logger);
  if (ckpt_path == "best") return find_best_checkpoint(runs, config.logger);
  TESSERA_CHECK(std::filesystem::exists(ckpt_path), "--ckpt-path ", ckpt_path,
                " does not exist: pass a checkpoint written by tessera fit, \"last\" or \"best\"");
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
  std::vector<sdk::SyncBatchNorm2dImpl*> layers;
  for (const auto& item : model_->network()->named_modules("", /*include_self=*/false)) {
    torch::nn::Module* m = item.value().get();
    if (auto* layer = dynamic_cast<sdk::SyncBatchNorm2dImpl*>(m)) {
      layers.push_back(layer);
      synchronised.push_back(item.key());
    } else if (core::fsdp::is_batch_norm(*m)) {  // LibTorch's own
      plain.push_back(item.key());
    }
  }
  TESSERA_CHECK(plain.empty(), "[trainer] sync_batchnorm = true, but ", sdk::join(plain), " ",
                (plain.size() == 1 ? "is a torch::nn BatchNorm layer, which normalises" : "are torch::nn BatchNorm layers, which normalise"),
                " over this rank's samples only: build ", (plain.size() == 1 ? "it" : "them"),
                " as tessera::sdk::SyncBatchNorm2d (<tessera/sdk/sync_batch_norm.hpp>, a drop-in BatchNorm2d)");
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

Trainer::TrainingData Trainer::prepare_training() {
  const TrainerSettings& t = config_.trainer;
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  spec.shuffle = config_.data.shuffle;
  spec.drop_last = true;
  spec.seed = t.seed;
  const sdk::DataLoaderSpec sampled = strategy_->process_dataloader(spec);
  TrainingData data;
  data.loader = std::make_unique<core::DataLoader>(data_->train_dataset(), sampled);
  // Ranks that read distinct batches (tensor-parallel ranks share theirs): the global batch
  // and the throughput count each sample once.
  data.data_ranks = std::max<std::int64_t>(1, sampled.num_replicas);
  samples_per_batch_ = config_.data.batch_size * data.data_ranks;
  resume_sample_position(restored_samples_per_batch_);
  restored_samples_per_batch_ = 0;
  if (t.sync_batchnorm) synchronise_batch_norms(data.data_ranks);
  const std::int64_t all_batches = data.loader->num_batches();
  data.epoch_batches = t.limit_train_batches.of(all_batches);
  TESSERA_CHECK(data.epoch_batches >= t.accumulate_grad_batches, "the training set gives this rank ",
                data.epoch_batches, " batches per epoch",
                (data.epoch_batches < all_batches ? " ([trainer] limit_train_batches)" : ""),
                ", fewer than [trainer] accumulate_grad_batches = ", t.accumulate_grad_batches,
                ": lower [data] batch_size or accumulate_grad_batches");
  return data;
}

void Trainer::resume_sample_position(std::int64_t saved_samples_per_batch) {
  // The sampler is a pure function of (seed, epoch, position in the epoch's order), and micro-batch
  // i covers positions [i * samples_per_batch, (i + 1) * samples_per_batch) at any world size: a
  // checkpoint resumes at another world size with the same global batch as is; with another global
  // batch, at the first batch none of whose samples were trained on (an elastic restart must not
  // fail because its world size changed; a partial batch is skipped, never trained twice).
  if (saved_samples_per_batch <= 0 || saved_samples_per_batch == samples_per_batch_ || next_batch_ == 0) return;
  const std::int64_t position = next_batch_ * saved_samples_per_batch;
  next_batch_ = (position + samples_per_batch_ - 1) / samples_per_batch_;
  const std::int64_t skipped = next_batch_ * samples_per_batch_ - position;
  log_.info("resuming " + std::to_string(position) + " samples into epoch " + std::to_string(epoch_) + " with batches of " +
            std::to_string(samples_per_batch_) + " samples (the checkpoint's: " + std::to_string(saved_samples_per_batch) +
            "): batch " + std::to_string(next_batch_) + " of the epoch comes next" +
            (skipped ? ", skipping the " + std::to_string(skipped) +
                           " samples before it (choose a global batch that divides " + std::to_string(position) +
                           " to resume exactly)"
                     : ""));
}

Trainer::TrainedStep Trainer::train_step(core::DataLoader& loader, std::int64_t accumulate, double lr) {
  const TrainerSettings& t = config_.trainer;
  for (auto& group : strategy_->optimizer().param_groups()) group.options().set_lr(lr);
  TrainedStep step;
  for (std::int64_t m = 0; m < accumulate; ++m) {
    const std::int64_t batch_idx = next_batch_ + m;
    core::ledger_set_step(global_step_ + 1, m);
    sdk::Batch batch;
    {
      core::trace::Span span("hook", "[DataLoader]next");
      batch = loader.batch(batch_idx);
    }
    call("on_train_batch_start", [&](sdk::Callback& c) { c.on_train_batch_start(*this, batch, batch_idx); });
    check_trainable_unchanged();
    sdk::StepOutput out;
    {
      core::trace::Span span("hook", "[Strategy]training_step");
      out = run_step("training_step", [&] { return strategy_->training_step(batch, batch_idx); });
    }
    {
      core::trace::Span span("hook", "[Strategy]backward");
      run_step("backward", [&] {
        strategy_->backward(out.loss / static_cast<double>(accumulate), /*sync_gradients=*/m == accumulate - 1);
      });
    }
    const at::Tensor loss = out.loss.detach().to(at::kFloat);
    step.loss_sum = step.loss_sum.defined() ? step.loss_sum + loss : loss;
    step.items += out.items;
    if (m < accumulate - 1) {
      call("on_train_batch_end", [&](sdk::Callback& c) { c.on_train_batch_end(*this, out, batch, batch_idx); });
    } else {  // its hook runs after the optimizer step, as Lightning's
      step.last_out = std::move(out);
      step.last_batch = std::move(batch);
    }
  }
  if (t.detect_anomaly) {
    core::trace::Span span("hook", "[Trainer]detect_anomaly");
    AnomalyReport anomaly =
        check_finite_step(*strategy_, *model_, step.loss_sum, cluster_.global_rank, cluster_.world_size);
    TESSERA_CHECK(anomaly.finite || anomaly.scaler_skips, "step ", global_step_ + 1, " ([trainer] detect_anomaly): ",
                  anomaly.message);
  }
  core::trace::Span span("hook", "[Strategy]optimizer_step");
  if (t.gradient_clip_algorithm == "value") {
    // Lightning's order: unscaled first (the scaler has then seen any inf), clamped, then
    // stepped; the strategy's own unscale is a no-op for the rest of the step.
    precision_->unscale_gradients(strategy_->optimizer(), *strategy_);
    core::clip_grad_value(strategy_->optimizer(), t.gradient_clip_val);
    step.result = strategy_->optimizer_step(/*gradient_clip_val=*/0.0, t.norm_type);
  } else {
    step.result = strategy_->optimizer_step(t.gradient_clip_val, t.norm_type);
  }
  return step;
}

Trainer::StepSync Trainer::synchronise_step(const at::Tensor& loss_sum, std::int64_t accumulate, bool out_of_time,
                                            std::int64_t window_items) {
  // Built on the device by kernels only: a host-to-device copy would wait for the step as well.
  const auto on_root = at::TensorOptions().dtype(at::kFloat).device(strategy_->root_device());
  std::vector<at::Tensor> parts{(loss_sum.to(on_root) / static_cast<double>(accumulate)).reshape({})};
  for (const bool flag : {StopSignals::received() == SIGINT, StopSignals::received() == SIGTERM, out_of_time, should_stop_})
    parts.push_back(at::full({}, flag ? 1.0 : 0.0, on_root));
  parts.push_back(at::full({}, static_cast<double>(window_items), on_root));
  const at::Tensor sum = strategy_->reduce(at::stack(parts), sdk::ReduceOp::sum).to(at::kCPU);
  StepSync sync;
  sync.loss = sum[0].item<double>() / static_cast<double>(cluster_.world_size);
  // A Ctrl-C reaches one rank or all of them; the job ends with its signal on every rank, so
  // that the launcher reports 128 + SIGINT whichever rank it sees end first.
  sync.signal = sum[1].item<double>() > 0 ? SIGINT : sum[2].item<double>() > 0 ? SIGTERM : 0;
  sync.out_of_time = sum[3].item<double>() > 0;
  sync.callback_stop = sum[4].item<double>() > 0;
  sync.items = sum[5].item<double>();
  return sync;
}

void Trainer::report_step(const StepSync& sync, const sdk::StepResult& result, double lr, FitClock& clock) {
  const TrainerSettings& t = config_.trainer;
  const bool log_now =
      global_step_ % t.log_every_n_steps == 0 || global_step_ == total_steps_ || global_step_ == clock.start_step + 1;
  const double per_step = std::chrono::duration<double>(Clock::now() - clock.run_start).count() /
                          static_cast<double>(global_step_ - clock.start_step);
  const std::string eta = duration(per_step * static_cast<double>(total_steps_ - global_step_));
  const std::string bar = "epoch " + std::to_string(epoch_) + " " +
                          RunLog::bar(static_cast<double>(global_step_) / static_cast<double>(total_steps_)) + " " +
                          std::to_string(global_step_) + "/" + std::to_string(total_steps_) + "  loss " +
                          RunLog::number(sync.loss) + "  lr " + RunLog::number(lr, 3) + "  ETA " + eta;
  if (!log_now) {
    log_.progress(bar, "", false);
    return;
  }
  // Throughput of the whole job: every data-parallel rank's items since the last log line.
  const double elapsed = std::chrono::duration<double>(Clock::now() - clock.window_start).count();
  const double rate = sync.items * static_cast<double>(clock.data_ranks) / static_cast<double>(cluster_.world_size) /
                      std::max(elapsed, 1e-9);
  const std::string unit = data_->item_unit();
  std::map<std::string, double> metrics = {{"train_loss", sync.loss}, {unit + "_per_s", rate}};
  if (result.grad_norm >= 0) metrics["grad_norm"] = result.grad_norm;
  if (skipped_steps_ > 0) metrics["skipped_steps"] = static_cast<double>(skipped_steps_);
  const std::string line = "epoch " + std::to_string(epoch_) + " step " + std::to_string(global_step_) + "/" +
                           std::to_string(total_steps_) + "  loss " + RunLog::number(sync.loss) + "  lr " +
                           RunLog::number(lr, 3) + "  " + RunLog::number(rate, 5) + " " + unit + "/s  ETA " + eta;
  log_.progress(bar + "  " + RunLog::number(rate, 5) + " " + unit + "/s", line, true);
  log_stage_metrics(metrics, "train");
  clock.window_items = 0;
  clock.window_start = Clock::now();
}

void Trainer::log_peak_memory() {
  auto max_over_ranks = [&](double value) {
    at::Tensor t = at::full({}, value, at::kFloat).to(strategy_->root_device());
    return strategy_->reduce(t, sdk::ReduceOp::max).item<double>();
  };
  // Peak resident memory of the busiest rank: the figure FSDP is meant to lower.
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  const double peak_mb =
      max_over_ranks(static_cast<double>(std::max<std::int64_t>(usage.ru_maxrss, earlier_peak_rss_kb_)) / 1024.0);
  log_.info("peak RSS per rank (max over ranks): " + RunLog::number(peak_mb, 5) + " MB");
  log_stage_metrics({{"peak_rss_mb", peak_mb}}, "train");
#if TESSERA_WITH_CUDA
  // And the peak of tensor memory on the GPU (what cpu_offload and sharding lower there).
  if (strategy_->root_device().is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(strategy_->root_device().index());
    const auto peak = stats.allocated_bytes[0].peak;  // [0]: StatType::AGGREGATE (its namespace moved in LibTorch 2)
    const double cuda_mb = max_over_ranks(static_cast<double>(peak) / 1048576.0);
    log_.info("peak CUDA tensor memory per rank (max over ranks): " + RunLog::number(cuda_mb, 5) + " MB");
    log_stage_metrics({{"peak_cuda_mb", cuda_mb}}, "train");
  }
#endif
}

void Trainer::fit(const std::string& ckpt_path) {
  const std::string checkpoint = resolve_checkpoint(config_, ckpt_path, /*fit=*/true);  // before a new run folder exists
  if (ckpt_path == "last" && checkpoint.empty())
    log_.info("--ckpt-path last: no checkpoint yet in any run under " +
              versions_parent(config_.trainer.default_root_dir, config_.logger) +
              ": training starts from the beginning (as Lightning's; the same command resumes once one is saved)");
  const std::string initial = initial_weights(config_, checkpoint);
  if (!checkpoint.empty() && !config_.trainer.init_from.empty())
    log_.info("[trainer] init_from is not applied: resuming from " + checkpoint + " restores the weights");
  setup("fit");
  if (!checkpoint.empty()) restore(checkpoint, Restore::training_state);
  if (!initial.empty()) restore(initial, Restore::initial_weights);
  begin_run();
  const TrainerSettings& t = config_.trainer;
  TrainingData data = prepare_training();
  core::DataLoader& loader = *data.loader;
  const std::int64_t data_ranks = data.data_ranks, epoch_batches = data.epoch_batches;
  const std::int64_t accumulate = t.accumulate_grad_batches;
  const std::int64_t steps_per_epoch = epoch_batches / accumulate;
  // val_check_interval as a fraction of an epoch: validate every this many steps of it.
  const std::int64_t fraction_steps =
      t.val_check_fraction < 1.0
          ? std::max<std::int64_t>(1, static_cast<std::int64_t>(t.val_check_fraction * static_cast<double>(steps_per_epoch)))
          : 0;
  auto validates_in = [&](std::int64_t epoch) { return (epoch + 1) % t.check_val_every_n_epoch == 0; };
  total_steps_ = t.max_steps > 0 ? t.max_steps : t.max_epochs * steps_per_epoch;
  schedule_ = std::make_unique<LRSchedule>(config_.schedule, config_.optimizer.lr, total_steps_);
  if (restored_schedule_) {
    std::string change = schedule_->compare(*restored_schedule_, global_step_, restored_from_ + " [lr_schedulers][0]");
    if (!change.empty()) log_.info(change);
  }
  StopSignals signals;  // a Ctrl-C during [lr_find] before_fit's test ends it, and fit after one step
  if (config_.lr_find.before_fit && !checkpoint.empty())
    log_.info("[lr_find] before_fit is not applied: resuming from " + checkpoint + " keeps the run's learning rate");
  else if (config_.lr_find.before_fit)
    tune_learning_rate(data);
  log_.info("global batch = " + std::to_string(config_.data.batch_size) + " per rank x " + std::to_string(data_ranks) +
            (data_ranks == cluster_.world_size ? " ranks" : " data-parallel rank(s) (tensor-parallel ranks share a batch)") + " x " +
            std::to_string(accumulate) + " accumulated = " +
            std::to_string(config_.data.batch_size * data_ranks * accumulate) + " samples; " +
            std::to_string(total_steps_) + " optimizer steps");
  if (t.enable_model_summary) {
    std::string summary = model_summary(*model_, *strategy_, config_.optimizer);  // collective: every rank
    if (cluster_.global_rank == 0) log_.info(summary);
  }
  if (t.fast_dev_run > 0)
    log_.info("fast_dev_run = " + std::to_string(t.fast_dev_run) + ": " + std::to_string(t.fast_dev_run) +
              " training step(s) and validation batch(es), no loggers, no checkpoints");

  FitClock clock{Clock::now(), Clock::now(), global_step_, 0, data_ranks};
  model_->network()->train(true);
  faults_.poison_gradient(*model_->network(), [this] { return global_step_; });
  try {
    call("on_fit_start", [&](sdk::Callback& c) { c.on_fit_start(*this); });
    sanity_check();
    call("on_train_start", [&](sdk::Callback& c) { c.on_train_start(*this); });
    while (epoch_ < t.max_epochs && global_step_ < total_steps_ && !should_stop_) {
      loader.set_epoch(epoch_);
      if (next_batch_ == 0) call("on_train_epoch_start", [&](sdk::Callback& c) { c.on_train_epoch_start(*this); });
      while (next_batch_ + accumulate <= epoch_batches && global_step_ < total_steps_ && !should_stop_) {
        const double lr = schedule_->lr(global_step_);
        TrainedStep step = train_step(loader, accumulate, lr);
        next_batch_ += accumulate;
        ++global_step_;
        clock.window_items += step.items;
        call("on_after_optimizer_step", [&](sdk::Callback& c) { c.on_after_optimizer_step(*this); });
        if (!step.result.stepped) {  // the grad scaler saw inf/NaN: expected now and then, counted, not a failure
          ++skipped_steps_;
          const auto scale = precision_->state_dict();
          log_.info("step " + std::to_string(global_step_) + ": the grad scaler skipped the optimizer step (inf/NaN " +
                    "gradients); loss scale now " +
                    (scale.contains("scale") ? RunLog::number(scale.at("scale").toDouble(), 6) : std::string("?")) +
                    ", " + std::to_string(skipped_steps_) + " step(s) skipped so far");
        }
        faults_.at_step(global_step_);
        report_committed_saves(/*wait=*/false);

        // The step's one all-reduce and its one wait for the device.
        const double elapsed = std::chrono::duration<double>(Clock::now() - clock.run_start).count();
        const StepSync sync =
            synchronise_step(step.loss_sum, accumulate, t.max_time_s > 0 && elapsed >= t.max_time_s, clock.window_items);
        callback_metrics_["train_loss"] = sync.loss;
        report_step(sync, step.result, lr, clock);
        const std::int64_t epoch_step = next_batch_ / accumulate;  // steps done in this epoch
        if (t.val_check_interval > 0 ? global_step_ % t.val_check_interval == 0
                                     : fraction_steps > 0 && epoch_step % fraction_steps == 0 &&
                                           epoch_step < steps_per_epoch && validates_in(epoch_))
          validate_during_fit("at step " + std::to_string(global_step_));
        const std::int64_t last_idx = next_batch_ - 1;
        call("on_train_batch_end",
             [&](sdk::Callback& c) { c.on_train_batch_end(*this, step.last_out, step.last_batch, last_idx); });

        if (sync.signal != 0) {  // SIGINT / SIGTERM on some rank
          const std::string path = log_dir_ + "/checkpoints/last.ckpt";
          save_checkpoint(path);
          report_committed_saves(/*wait=*/true);  // "saved to" below only once it is
          exit_code_ = 128 + sync.signal;
          // Under tessera's launcher a Ctrl-C reaches the ranks as the signal the launcher got.
          const std::string by = sync.signal == SIGINT    ? "Ctrl-C (SIGINT)"
                                 : sync.signal == SIGTERM ? "a stop request (SIGTERM: kill, a scheduler's preemption)"
                                                          : strsignal(sync.signal);
          log_.info("interrupted by " + by + (StopSignals::received() != 0 ? "" : " on another rank") +
                    " at step " + std::to_string(global_step_) + ": checkpoint saved to " + path +
                    "; resume with --ckpt-path last");
          sdk::Error error("fit interrupted at step " + std::to_string(global_step_));
          call("on_exception", [&](sdk::Callback& c) { c.on_exception(*this, error); });
          finish("interrupted");
          return;
        }
        if (sync.out_of_time && !should_stop_) stop("max_time " + RunLog::number(t.max_time_s, 6) + " s reached");
        if (sync.callback_stop && !should_stop_) stop("a callback on another rank asked to stop");
        if (should_stop_) log_.info("stopping at step " + std::to_string(global_step_) + ": " + stop_reason_);
      }
      if (next_batch_ + accumulate > epoch_batches) {  // the epoch is complete
        const bool validate = t.val_check_interval == 0 && validates_in(epoch_);
        ++epoch_;
        next_batch_ = 0;
        if (validate) validate_during_fit("after epoch " + std::to_string(epoch_ - 1));
        call("on_train_epoch_end", [&](sdk::Callback& c) { c.on_train_epoch_end(*this); });
      }
    }
  } catch (const std::exception& error) {
    call("on_exception", [&](sdk::Callback& c) { c.on_exception(*this, error); });
    finish("failed");
    throw;
  }
  log_peak_memory();
  call("on_train_end", [&](sdk::Callback& c) { c.on_train_end(*this); });
  call("on_fit_end", [&](sdk::Callback& c) { c.on_fit_end(*this); });
  finish("success");
  if (t.predict_after_fit) {
    log_.info("sample from the trained model:");
    data_->setup("predict");  // as Lightning sets a datamodule up for each stage it runs
    predict_batches(BatchLimit{false, 1.0});
  }
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
  if (!config_.trainer.profiler.empty()) {
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
