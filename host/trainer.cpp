#include "trainer.hpp"

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

#include "anomaly.hpp"
#include "loggers/run_directory.hpp"
#include "model_summary.hpp"
#include "plugin_keys.hpp"
#include "profiler.hpp"
#include "record_file.hpp"
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
#include "lr_find.hpp"
#include "lr_schedule.hpp"

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

/// sum over ranks of `sums` / sum over ranks of `weight`, for every metric, in one all-reduce
/// (in fp32, as every strategy's collectives take it: ~7 digits, ample for a mean).
std::map<std::string, double> weighted_mean(sdk::Strategy& strategy, const std::map<std::string, double>& sums,
                                            double weight) {
  if (sums.empty()) return {};
  std::vector<double> values{weight};
  for (const auto& [name, value] : sums) values.push_back(value);
  at::Tensor packed = at::tensor(values, at::kDouble).to(at::kFloat).to(strategy.root_device());
  at::Tensor reduced = strategy.reduce(packed, sdk::ReduceOp::sum).to(at::kCPU).to(at::kDouble);
  const double total = std::max(reduced[0].item<double>(), 1.0);
  std::map<std::string, double> out;
  std::int64_t i = 1;
  for (const auto& [name, value] : sums) out[name] = reduced[i++].item<double>() / total;
  return out;
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

/// Installs the handlers for one fit and restores the previous ones after it.
class StopSignals {
 public:
  StopSignals() {
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESTART;  // a collective blocked in a syscall carries on
    ::sigaction(SIGINT, &action, &old_int_);
    ::sigaction(SIGTERM, &action, &old_term_);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    g_signal = 0;
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

/// Takes what `slot` holds out of it for its lifetime (an empty one in its place) and puts it
/// back after, on an exception too: the range test runs without callbacks and loggers.
template <typename T>
class HeldOut {
 public:
  explicit HeldOut(T& slot) : slot_(slot), held_(std::move(slot)) { slot_.clear(); }
  ~HeldOut() { slot_ = std::move(held_); }
  HeldOut(const HeldOut&) = delete;
  HeldOut& operator=(const HeldOut&) = delete;

 private:
  T& slot_;
  T held_;
};

std::string metrics_line(const std::string& head, const std::map<std::string, double>& metrics, int precision = 4) {
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

}  // namespace

template <typename Step>
auto Trainer::run_step(const char* name, Step&& step) {
  try {
    return step();
  } catch (const c10::Error& error) {
    explain_step_failure(error, name, precision_->precision(), strategy_->root_device(), *model_->network());
    throw;
  }
}

Trainer::Trainer(Config config, const sdk::ClusterInfo& cluster, RunLog& log)
    : config_(std::move(config)), cluster_(cluster), log_(log),
      loader_(core::PluginLoader::search_path(config_.plugin_dirs)) {}

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

namespace {
// Test-only: TESSERA_FAULT_INJECT="rank=1,step=3,kind=exit|kill|hang|sigint|error|slow_save|nan_grad
// [,seconds=N][,param=NAME][,attempt=N]"; empty when unset.
std::map<std::string, std::string> fault_spec() {
  std::map<std::string, std::string> fields;
  const char* spec = std::getenv("TESSERA_FAULT_INJECT");
  if (spec == nullptr) return fields;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    auto eq = item.find('=');
    if (eq != std::string::npos) fields[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return fields;
}
}  // namespace

void Trainer::maybe_inject_gradient_fault() {
  std::map<std::string, std::string> fields = fault_spec();
  if (fields["kind"] != "nan_grad" || std::stoll(fields["rank"]) != cluster_.global_rank) return;
  const std::int64_t step = std::stoll(fields["step"]);
  const std::string name = fields["param"];
  at::Tensor* param = model_->network()->named_parameters().find(name);
  TESSERA_CHECK(param != nullptr, "fault injection: no parameter ", name);
  // A NaN in this rank's gradient of `name` before it is reduced, during step `step`'s backward.
  param->register_hook([this, step](const at::Tensor& grad) -> at::Tensor {
    if (global_step_ + 1 != step) return at::Tensor();
    at::Tensor poisoned = grad.clone();
    poisoned.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
    return poisoned;
  });
}

void Trainer::maybe_inject_fault(std::int64_t step, bool saving) const {
  std::map<std::string, std::string> fields = fault_spec();
  if (fields.empty() || fields["kind"] == "nan_grad" || std::stoll(fields["rank"]) != cluster_.global_rank ||
      std::stoll(fields["step"]) != step || (fields["kind"] == "slow_save") != saving)
    return;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");  // attempt=N: only torchrun's N-th attempt
  if (fields.count("attempt") && fields["attempt"] != (attempt ? attempt : "0")) return;
  log_.info("fault injection: rank " + std::to_string(cluster_.global_rank) + " " + fields["kind"] + " at step " +
            std::to_string(step));
  if (fields["kind"] == "sigint") return void(::raise(SIGINT));  // as Ctrl-C: handled at the step's end
  if (fields["kind"] == "kill") ::raise(SIGKILL);
  if (fields["kind"] == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  if (fields["kind"] == "error") TESSERA_FAIL("fault injection: rank ", cluster_.global_rank, " fails at step ", step);
  if (fields["kind"] == "slow_save") return std::this_thread::sleep_for(std::chrono::seconds(std::stoll(fields["seconds"])));
  std::_Exit(3);
}

Trainer::Evaluation Trainer::evaluate(const std::string& stage, const BatchLimit& limit, std::int64_t cap) {
  core::trace::Span span("hook", "[Trainer]" + std::string(stage == "test" ? "test" : "validation") + "_loop");
  std::shared_ptr<sdk::Dataset> dataset = stage == "test" ? data_->test_dataset() : data_->val_dataset();
  if (!dataset || dataset->size() == 0) return {};
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  spec.seed = config_.trainer.seed;
  core::DataLoader loader(dataset, strategy_->process_dataloader(spec));
  const std::int64_t batches = std::min(limit.of(loader.num_batches()), cap);
  if (batches == 0) return {};
  auto network = model_->network();
  network->train(false);
  // Each batch's metrics weighted by its size (as Lightning's): a short last batch counts for
  // its samples, and the result is the per-sample mean over every rank's batches.
  std::map<std::string, double> sums;
  double samples = 0;
  const std::string title = stage == "test" ? "testing    " : "validation ";
  for (std::int64_t i = 0; i < batches; ++i) {
    sdk::Batch batch = loader.batch(i);
    sdk::StepOutput out = run_step(stage == "test" ? "test_step" : "validation_step", [&] {
      return stage == "test" ? strategy_->test_step(batch, i) : strategy_->validation_step(batch, i);
    });
    const double weight = static_cast<double>(std::max<std::int64_t>(1, batch.size()));
    samples += weight;
    for (const auto& [name, value] : out.metrics) sums[stage + "_" + name] += value.item<double>() * weight;
    log_.progress(title + RunLog::bar(static_cast<double>(i + 1) / static_cast<double>(batches)) + "  " +
                      std::to_string(i + 1) + "/" + std::to_string(batches),
                  "", false);
  }
  network->train(true);
  return {weighted_mean(*strategy_, sums, samples), batches};
}

void Trainer::sanity_check() {
  const TrainerSettings& t = config_.trainer;
  if (t.num_sanity_val_steps == 0) return;
  const std::int64_t cap = t.num_sanity_val_steps < 0 ? std::numeric_limits<std::int64_t>::max() : t.num_sanity_val_steps;
  Evaluation sanity = evaluate("val", t.limit_val_batches, cap);
  if (sanity.batches == 0) return;  // no validation set, or limit_val_batches = 0
  // Its metrics are not printed either: a script reading the log's first val_loss would take them.
  log_.info("sanity check passed: validation_step ran on " + std::to_string(sanity.batches) +
            " batch(es) before the first step ([trainer] num_sanity_val_steps)");
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

void Trainer::validate_during_fit(const std::string& when) {
  if (config_.trainer.limit_val_batches.of(1) == 0 || !data_->val_dataset() || data_->val_dataset()->size() == 0)
    return;
  call("on_validation_start", [&](sdk::Callback& c) { c.on_validation_start(*this); });
  auto val = evaluate("val", config_.trainer.limit_val_batches).metrics;
  if (!val.empty()) {
    log_.info(metrics_line("validation " + when + ":", val));
    log_stage_metrics(val, "val");
  }
  call("on_validation_end", [&](sdk::Callback& c) { c.on_validation_end(*this); });
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
  for (const bool flag : {g_signal == SIGINT, g_signal == SIGTERM, out_of_time, should_stop_})
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
  maybe_inject_gradient_fault();
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
        maybe_inject_fault(global_step_);
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
          log_.info("interrupted by " + by + (g_signal != 0 ? "" : " on another rank") +
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

void Trainer::lr_find() {
  const std::string initial = initial_weights(config_, "");
  setup("fit", "lr-find");
  if (!initial.empty()) restore(initial, Restore::initial_weights);
  open_run_directory();
  TrainingData data = prepare_training();
  StopSignals signals;  // a Ctrl-C ends the test: the curve so far is written, with its suggestion
  try {
    if (const int signal = run_lr_range_test(data).signal) exit_code_ = 128 + signal;
  } catch (const std::exception&) {
    finish("failed");
    throw;
  }
  finish(exit_code_ == 0 ? "success" : "interrupted");
}

Trainer::RangeTestResult Trainer::run_lr_range_test(TrainingData& data) {
  // As Lightning's: no callback runs (nothing is checkpointed, nothing but divergence stops the
  // test) and nothing is logged; lr_find.csv holds the curve.
  HeldOut no_callbacks(callbacks_);
  HeldOut no_loggers(loggers_);
  const LrFindSettings& settings = config_.lr_find;
  const std::int64_t accumulate = config_.trainer.accumulate_grad_batches;
  total_steps_ = settings.num_training;
  log_.info("lr-find: " + std::to_string(total_steps_) + " optimizer steps of " +
            std::to_string(config_.data.batch_size * data.data_ranks * accumulate) + " samples, the learning rate " +
            "rising " + (settings.mode == "linear" ? "linearly" : "exponentially") + " from " +
            RunLog::number(settings.min_lr, 3) + " to " + RunLog::number(settings.max_lr, 3) +
            (settings.early_stop_threshold > 0
                 ? "; stops once the smoothed loss exceeds " + RunLog::number(settings.early_stop_threshold, 3) +
                       " x its best"
                 : ""));
  LrRangeTest test(settings);
  RangeTestResult result;
  FitClock clock{Clock::now(), Clock::now(), global_step_, 0, data.data_ranks};
  model_->network()->train(true);
  data.loader->set_epoch(epoch_);
  for (std::int64_t step = 0; step < settings.num_training; ++step) {
    if (next_batch_ + accumulate > data.epoch_batches) {  // more steps than an epoch holds: the next epoch
      ++epoch_;
      next_batch_ = 0;
      data.loader->set_epoch(epoch_);
    }
    const double lr = test.lr(step);
    TrainedStep trained = train_step(*data.loader, accumulate, lr);
    next_batch_ += accumulate;
    ++global_step_;
    clock.window_items += trained.items;
    maybe_inject_fault(global_step_);
    const StepSync sync = synchronise_step(trained.loss_sum, accumulate, /*out_of_time=*/false, clock.window_items);
    const bool go_on = test.record(sync.loss);  // the global loss: every rank decides alike
    report_step(sync, trained.result, lr, clock);
    if (sync.signal != 0) {  // SIGINT / SIGTERM on some rank
      log_.info("lr-find: interrupted after step " + std::to_string(step + 1) + " of " +
                std::to_string(settings.num_training));
      result.signal = sync.signal;
      break;
    }
    if (!go_on) {
      log_.info("lr-find: stopped after step " + std::to_string(step + 1) + " at lr " + RunLog::number(lr, 3) +
                ": the smoothed loss " + RunLog::number(test.smoothed().back()) +
                (std::isfinite(test.smoothed().back())
                     ? " exceeds " + RunLog::number(settings.early_stop_threshold, 3) + " x its best"
                     : " is not finite") +
                " (diverged)");
      break;
    }
  }
  const std::string csv = log_dir_ + "/lr_find.csv";
  if (cluster_.global_rank == 0) test.write_csv(csv);
  if (const std::string chart = test.plot(); !chart.empty())
    log_.info("lr-find: the smoothed loss against the learning rate\n" + chart);
  const std::optional<std::int64_t> best = test.suggestion();
  if (!best) {
    const bool diverged = test.steps() < settings.num_training && result.signal == 0;
    log_.info("lr-find: no suggestion: " + std::to_string(test.steps()) + " step(s) leave fewer than 2 points " +
              "once the first 10 and the last are skipped" +
              (result.signal != 0 ? std::string()
               : diverged ? "; the loss diverged that early: lower [lr_find] max_lr (and min_lr, if it diverges "
                            "from the start)"
                          : "; raise [lr_find] num_training") +
              "; the curve: " + csv);
    return result;
  }
  // Three significant digits: the lr a user would type, so that `--set optimizer.lr=` repeats it.
  const std::string lr = RunLog::number(test.lr(*best), 3);
  log_.info("lr-find: suggested lr " + lr + " (where the smoothed loss falls the fastest, step " +
            std::to_string(*best + 1) + " of " + std::to_string(test.steps()) + "); train with --set optimizer.lr=" +
            lr + " (or a little lower); the curve: " + csv);
  result.lr = std::stod(lr);
  return result;
}

void Trainer::tune_learning_rate(TrainingData& data) {
  // The test trains the model: what fit starts from is saved first and restored after, as
  // Lightning's LearningRateFinder does, so that fit trains as a run started with that lr.
  const std::string start = log_dir_ + "/lr_find_start.ckpt";
  const std::int64_t total_steps = total_steps_;
  std::optional<double> lr;
  {
    HeldOut no_callbacks(callbacks_);  // neither their hooks nor their state
    save_checkpoint(start);
    const RangeTestResult result = run_lr_range_test(data);
    if (result.signal == 0) lr = result.lr;  // else fit stops after its first step, as after any signal
    strategy_->optimizer().state().clear();  // the test's moments: the start has none (no step yet)
    restore(start, Restore::training_state);  // weights, grad scaler, RNG, step 0
  }
  restored_schedule_.reset();
  skipped_steps_ = 0;
  total_steps_ = total_steps;
  strategy_->remove_checkpoint(start);
  const double configured = config_.optimizer.lr;
  if (lr && *lr >= config_.schedule.min_lr) {
    config_.optimizer.lr = *lr;
    schedule_ = std::make_unique<LRSchedule>(config_.schedule, *lr, total_steps_);
  }
  log_.info("[lr_find] before_fit: " +
            (!lr ? "fit keeps [optimizer] lr = " + RunLog::number(configured, 6)
             : *lr < config_.schedule.min_lr
                 ? "the suggestion is below [lr_scheduler] min_lr = " + RunLog::number(config_.schedule.min_lr, 6) +
                       ": fit keeps [optimizer] lr = " + RunLog::number(configured, 6)
                 : "fit trains with lr " + RunLog::number(*lr, 6) + " instead of [optimizer] lr = " +
                       RunLog::number(configured, 6) + ", from the weights, optimizer and RNG state it had before " +
                       "the test (as a run with --set optimizer.lr=" + RunLog::number(*lr, 6) + ")"));
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

void Trainer::validate(const std::string& ckpt_path) {
  setup_with_weights("validate", ckpt_path);
  begin_run();
  call("on_validation_start", [&](sdk::Callback& c) { c.on_validation_start(*this); });
  auto metrics = evaluate("val", config_.trainer.limit_val_batches).metrics;
  log_.info(metrics_line("validate:", metrics, 6));
  log_stage_metrics(metrics, "validate");
  call("on_validation_end", [&](sdk::Callback& c) { c.on_validation_end(*this); });
  finish("success");
}

void Trainer::test(const std::string& ckpt_path) {
  setup_with_weights("test", ckpt_path);
  begin_run();
  call("on_test_start", [&](sdk::Callback& c) { c.on_test_start(*this); });
  auto metrics = evaluate("test", config_.trainer.limit_test_batches).metrics;
  log_.info(metrics_line("test:", metrics, 6));
  log_stage_metrics(metrics, "test");
  call("on_test_end", [&](sdk::Callback& c) { c.on_test_end(*this); });
  finish("success");
}

void Trainer::predict(const std::string& ckpt_path) {
  setup_with_weights("predict", ckpt_path);
  predict_batches(config_.trainer.limit_predict_batches, config_.trainer.predict_output);
}

void Trainer::predict_batches(const BatchLimit& limit, const std::string& output) {
  std::shared_ptr<sdk::Dataset> dataset = data_->predict_dataset();
  TESSERA_CHECK(dataset != nullptr, "data plugin '", config_.plugin_names.at("data"), "' has nothing to predict");
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  core::DataLoader loader(dataset, strategy_->process_dataloader(spec));
  const std::int64_t batches = limit.of(loader.num_batches());
  model_->network()->train(false);
  at::manual_seed(static_cast<std::uint64_t>(config_.trainer.seed));
  std::vector<at::Tensor> rows;
  std::vector<std::int64_t> indices;
  for (std::int64_t i = 0; i < batches; ++i) {
    sdk::Batch batch = loader.batch(i);
    at::Tensor predicted = run_step("predict_step", [&] { return strategy_->predict_step(batch, i); }).to(at::kCPU);
    if (output.empty() || i == 0) log_.info(data_->describe_prediction(batch, predicted));
    if (output.empty()) continue;
    const std::int64_t first = i * spec.batch_size, samples = batch.size();
    TESSERA_CHECK(predicted.dim() > 0 && predicted.size(0) == samples, "[trainer] predict_output: predict_step of model '",
                  config_.plugin_names.at("model"), "' returned shape ", predicted.sizes(), " for a batch of ", samples,
                  " samples; written predictions need one row per sample");
    rows.push_back(predicted);
    indices.insert(indices.end(), loader.indices().begin() + first, loader.indices().begin() + first + samples);
  }
  model_->network()->train(true);
  if (!output.empty()) write_predictions(rows, indices, output);
}

void Trainer::write_predictions(const std::vector<at::Tensor>& rows, const std::vector<std::int64_t>& indices,
                                const std::string& path) {
  TESSERA_CHECK(!rows.empty(), "[trainer] predict_output: no batch was predicted (limit_predict_batches = 0)");
  at::Tensor local = at::cat(rows);
  // Every rank's rows must stack: the same shape per sample and dtype (predicted counts are equal,
  // the sampler pads the last rank's samples with the first ones).
  constexpr std::int64_t kMaxDims = 8;
  TESSERA_CHECK(local.dim() <= kMaxDims, "[trainer] predict_output: predictions of ", local.dim(), " dimensions; at most ",
                kMaxDims, " are written");
  at::Tensor layout = at::full({kMaxDims + 1}, -1, at::kLong);
  layout[0] = static_cast<std::int64_t>(local.scalar_type());
  for (std::int64_t d = 1; d < local.dim(); ++d) layout[d] = local.size(d);
  const c10::Device device = strategy_->root_device();
  at::Tensor layouts = strategy_->all_gather(layout.to(device)).cpu();
  auto described = [&](std::int64_t r) {
    std::ostringstream out;
    out << c10::IntArrayRef(layouts[r].data_ptr<std::int64_t>(), kMaxDims + 1);
    return out.str();
  };
  for (std::int64_t r = 1; r < layouts.size(0); ++r)
    TESSERA_CHECK(at::equal(layouts[r], layouts[0]), "[trainer] predict_output: rank ", r, "'s predictions are ",
                  described(r), " (dtype code, then each sample's sizes) and rank 0's ", described(0),
                  ": predict_step must return the same shape and dtype per sample on every rank");
  // Gloo gathers no bool: as bytes.
  const bool boolean = local.scalar_type() == at::kBool;
  at::Tensor all = strategy_->all_gather((boolean ? local.to(at::kByte) : local).to(device)).cpu().flatten(0, 1);
  at::Tensor all_indices = strategy_->all_gather(at::tensor(indices, at::kLong).to(device)).cpu().flatten();
  if (!is_global_zero()) return;
  // Dataset order, each sample once (the sampler's padding and tensor-parallel ranks repeat some).
  at::Tensor order = std::get<1>(all_indices.sort(/*stable=*/true, 0, false));
  at::Tensor sorted = all_indices.index_select(0, order);
  at::Tensor first = at::ones_like(sorted, at::kBool);
  first.slice(0, 1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
  order = order.masked_select(first);
  at::Tensor predictions = all.index_select(0, order);
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  file.insert("predictions", boolean ? predictions.to(at::kBool) : predictions);
  file.insert("indices", sorted.masked_select(first));
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  core::save_pickle(file, path);
  const std::int64_t samples = predictions.size(0);
  log_.info("predictions of " + std::to_string(samples) + (samples == 1 ? " sample" : " samples") + " written to " + path +
            " ([trainer] predict_output: {\"predictions\", \"indices\"}, torch.load reads it)");
}

}  // namespace tessera::host
