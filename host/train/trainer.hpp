#pragma once
// The trainer: creates the plugins and callbacks, wires them like Lightning's Trainer, and
// runs fit, validate, test or predict on this rank, with a run folder per fit/validate/test.
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "callbacks/callbacks.hpp"
#include "config/config.hpp"
#include "loggers/logger.hpp"
#include "loggers/run_log.hpp"
#include "plugin_loader.hpp"
#include "trace/trace.hpp"
#include "tessera/sdk/callback.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/strategy.hpp"
#include "train/fault_injection.hpp"
#include "train/lr_schedule.hpp"
#include "train/torch_profiler.hpp"

namespace tessera::core {
class DataLoader;
}

namespace tessera::host {

class Trainer final : public sdk::Trainer {
 public:
  /// Takes the config by value: move it in, since a copied TOML table loses the source
  /// lines that error messages name.
  Trainer(Config config, const sdk::ClusterInfo& cluster, RunLog& log);
  ~Trainer() override;

  /// `ckpt_path`: "" (none), "last", "best", "auto" (see resolve_checkpoint) or a path.
  void fit(const std::string& ckpt_path);
  void validate(const std::string& ckpt_path);
  void test(const std::string& ckpt_path);
  void predict(const std::string& ckpt_path);
  /// The learning-rate range test ([lr_find], lr_find.hpp): trains from the model's initial
  /// weights (or [trainer] init_from) through the strategy, as fit, while the learning rate
  /// rises; writes lr_find.csv in the run folder and logs the suggested learning rate. No
  /// callback runs and nothing is saved, as in Lightning's Tuner.lr_find.
  void lr_find();
  /// The process exit code for the run: 0, or 128 + signal when fit was interrupted.
  int exit_code() const { return exit_code_; }

  /// The one place `--ckpt-path` is resolved: "last" is the newest checkpoint of the
  /// newest run under default_root_dir/[logger name] (see find_last_checkpoint), "best" the
  /// one its model_checkpoint recorded (find_best_checkpoint); any other value is a path that
  /// must exist. For `fit`, "last" with no checkpoint yet is "": training starts from the
  /// beginning (Lightning's fit(ckpt_path="last"), so that one command starts a job and resumes
  /// it after a requeue); the other commands need one. "auto" ([trainer] resume = "auto") is
  /// the newest that verifies (newest_verified_checkpoint), what an auto-restarted job needs
  /// when its newest save is damaged; what it passed over is said in `notes`.
  static std::string resolve_checkpoint(const Config& config, const std::string& ckpt_path, bool fit = false,
                                        std::vector<std::string>* notes = nullptr);
  /// [trainer] init_from when a command restores no checkpoint (`checkpoint`, resolved, is ""):
  /// the checkpoint whose weights the model starts from, checked to exist and to be one (any
  /// format load_checkpoint_file reads, or a sharded folder); "" when there is none to apply.
  static std::string initial_weights(const Config& config, const std::string& checkpoint);
  /// validate and test evaluate the weights of `checkpoint` (--ckpt-path, resolved) or `initial`
  /// (initial_weights()): without either they would evaluate random weights, and refuse.
  static void check_weights_given(const std::string& command, const std::string& checkpoint, const std::string& initial);

  /// A model whose hyper-parameters name a `block_size` (its context length, e.g. the gpt's
  /// positional table) takes sequences of at most that many tokens: a longer `sequence` (from
  /// `source`, e.g. "[data] block_size = 256") throws naming both keys; a shorter one returns
  /// a note for the log (positions past it are never trained); otherwise "".
  /// [trainer] freeze: every parameter named, or under a module path named, stops training
  /// (requires_grad false) before the strategy sees the model; a name that matches nothing
  /// throws listing the model's top-level modules. Returns the elements frozen.
  static std::int64_t freeze_parameters(const Config& config, torch::nn::Module& network);

  static std::string check_sequence_length(const Config& config, const sdk::Checkpoint& model_hparams,
                                           std::int64_t sequence, const std::string& source);

  // sdk::Trainer, for callbacks.
  const std::string& stage() const override { return stage_; }
  std::int64_t global_step() const override { return global_step_; }
  std::int64_t current_epoch() const override { return epoch_; }
  std::int64_t estimated_stepping_batches() const override { return total_steps_; }
  const std::map<std::string, double>& callback_metrics() const override { return callback_metrics_; }
  void log_metrics(const std::map<std::string, double>& metrics) override;
  void print(const std::string& line) override { log_.info(line); }
  void request_stop(const std::string& reason) override;
  bool should_stop() const override { return should_stop_; }
  const std::string& log_dir() const override { return log_dir_; }
  /// `weights_only`: what --ckpt-path best reads, a third of an Adam checkpoint.
  void save_checkpoint(const std::string& path, bool weights_only = false) override;
  /// A background-saving IO's commits since the last call, each logged "checkpoint saved"
  /// (`wait`: after every queued save ends); a failed background save throws, naming the file.
  void report_committed_saves(bool wait);
  /// fit --ckpt-path: refuses model hyper-parameters that differ from the checkpoint's record,
  /// naming each, unless [trainer] resume_changed_hparams lists it.
  void check_resumed_hyper_parameters(const sdk::Checkpoint& checkpoint, const std::string& path) const;
  void remove_checkpoint(const std::string& path) override;
  /// Refuses (sdk::Error) to resume fit from a weights-only checkpoint: before any rank starts.
  static void check_resumable(const std::string& checkpoint);
  sdk::Strategy& strategy() override { return *strategy_; }
  sdk::Module& lightning_module() override { return *model_; }
  bool is_global_zero() const override { return cluster_.global_rank == 0; }

 private:
  /// Creates every plugin and sets the model up under the strategy; `stage` is the data's and
  /// the callbacks' ("fit", "validate", ...), `command` the one the log names when it differs.
  void setup(const std::string& stage, const std::string& command = "");
  /// validate, test, predict: setup, then the weights of --ckpt-path, else of [trainer] init_from.
  void setup_with_weights(const std::string& stage, const std::string& ckpt_path);
  /// Before any step: the data's sequence length against the model's context (check_sequence_length).
  void check_data_against_model(const std::string& stage);
  /// Token data (sdk::TokenVocabulary) against the model's vocab_size hyper-parameter.
  void check_vocabulary() const;
  /// After setup (and restore): the run folder, then the callbacks' setup hook.
  void begin_run();
  /// Creates this run's folder (rank 0 picks version_N, the others learn it by broadcast)
  /// and writes config.toml and the hyper-parameters into it.
  void open_run_directory();
  enum class Restore {
    weights,          ///< validate, test, predict --ckpt-path: the model's weights
    training_state,   ///< fit --ckpt-path: the weights, optimizer, scaler, schedule, RNG, step, callbacks
    initial_weights,  ///< [trainer] init_from: the weights of another run; no callback hook (this run is new)
  };
  void restore(const std::string& path, Restore what);
  /// init_from_strict = false: the names of the file's tensors (name -> shape) whose name and
  /// shape are one of the model's (model_shapes_); logs what each side keeps. Throws if none is.
  std::vector<std::string> matching_weights(const std::map<std::string, std::vector<std::int64_t>>& file,
                                            const std::string& path);
  /// init_from_strict = false: loads those of `path`'s tensors (a file, or a sharded folder
  /// streamed one tensor at a time); the model's others keep their initialisation.
  void load_matching_weights(const std::string& path);
  /// The model weights of `checkpoint`, read from `path`. A file saved from a wrapper of the
  /// model (PyTorch DDP's "module.", torch.compile's "_orig_mod.", a LightningModule's attribute
  /// such as "model.") prefixes every name: while no name is one of the model's and all share a
  /// leading component, it is dropped (logged).
  /// Resuming without a weight-averaging callback from a checkpoint saved with one: the model
  /// gets the trained weights ("current_model_state"), not their average ("state_dict").
  void resume_trained_weights(const sdk::Checkpoint& checkpoint, const std::string& path);
  sdk::StateDict model_weights(const sdk::Checkpoint& checkpoint, const std::string& path);
  struct Evaluation {
    std::map<std::string, double> metrics;  ///< averaged over batches and ranks
    std::int64_t batches = 0;               ///< run on each rank
  };
  /// Runs the loop of `stage` ("val" or "test") over `limit` of its batches, at most `cap`.
  Evaluation evaluate(const std::string& stage, const BatchLimit& limit,
                      std::int64_t cap = std::numeric_limits<std::int64_t>::max());
  /// Lightning's sanity check: num_sanity_val_steps validation batches before the first step,
  /// so that a broken validation_step fails in seconds, not after an epoch. Nothing is logged
  /// and no callback hook runs.
  void sanity_check();
  /// [trainer] sync_batchnorm: connects the model's toolkit::SyncBatchNorm2d layers to the
  /// data-parallel ranks (`data_ranks` distinct batches); refuses plain BatchNorm layers.
  void synchronise_batch_norms(std::int64_t data_ranks);
  /// A stop that min_steps / min_epochs cannot hold back (max_time, a signal, another rank's).
  void stop(const std::string& reason);
  /// Validation inside fit: metrics logged, callbacks' on_validation_start/end around it.
  void validate_during_fit(const std::string& when);
  /// `tessera validate` and `tessera test` ("validate" or "test"): a checkpoint's weights, one
  /// pass over that stage's batches between its callbacks' start and end hooks.
  void evaluate_checkpoint(const std::string& command, const std::string& ckpt_path);
  /// Runs predict_step over `limit` of the predict batches and prints the results (the first
  /// batch's only when `output` is given, where every rank's predictions are written).
  void predict_batches(const BatchLimit& limit, const std::string& output = "");
  /// Gathers every rank's predictions (`rows`, one per sample) and sample indices to rank 0,
  /// which writes them to `path` in dataset order, each sample once: the same file at any
  /// world size. Collective.
  void write_predictions(const std::vector<at::Tensor>& rows, const std::vector<std::int64_t>& indices,
                         const std::string& path);
  void log_stage_metrics(const std::map<std::string, double>& metrics, const std::string& stage);
  /// Runs `hook` on every callback, each under a profiler span.
  template <typename Hook>
  void call(const char* name, Hook&& hook);
  void finish(const std::string& status);
  /// Runs one step, explaining LibTorch's dtype errors under autocast (explain_step_failure).
  template <typename Step>
  auto run_step(const char* name, Step&& step);
  /// fit's and lr-find's batches: the strategy's sampler over the training set (and the
  /// model's batch norms synchronised, under sync_batchnorm). Checks that an epoch holds a step.
  struct TrainingData {
    std::unique_ptr<core::DataLoader> loader;
    std::int64_t data_ranks = 1;     ///< ranks that read distinct batches
    std::int64_t epoch_batches = 0;  ///< this rank's batches per epoch, after limit_train_batches
  };
  TrainingData prepare_training();
  /// A checkpoint saved with `saved_samples_per_batch` samples per micro-batch, resumed with
  /// samples_per_batch_: next_batch_ at the same sample position of the epoch, or an error.
  void resume_sample_position(std::int64_t saved_samples_per_batch);
  /// The learning-rate range test over `data` from where training stands (lr_find.hpp), without
  /// callbacks or loggers; writes lr_find.csv and returns the suggested lr, if any. A signal on
  /// any rank ends it early (`signal`), the curve so far written.
  struct RangeTestResult {
    std::optional<double> lr;
    int signal = 0;  ///< the signal that ended it early (StepSync::signal), 0 if none
  };
  RangeTestResult run_lr_range_test(TrainingData& data);
  /// [lr_find] before_fit: the range test, then fit's starting state restored, and
  /// [optimizer] lr and the schedule set to the suggestion (Lightning's LearningRateFinder).
  void tune_learning_rate(TrainingData& data);
  /// One optimizer step at learning rate `lr`, from micro-batch next_batch_ of `loader`: `accumulate`
  /// micro-batches forward and backward, the anomaly check, clipping, the optimizer step.
  struct TrainedStep {
    at::Tensor loss_sum;       ///< the micro-batches' weighted losses summed ([trainer] loss_average), on the loss's device
    std::int64_t items = 0;    ///< tokens or samples this rank trained on
    sdk::StepOutput last_out;  ///< the last micro-batch's: its on_train_batch_end runs after the step
    sdk::Batch last_batch;
    sdk::StepResult result;
    bool nonfinite_skipped = false;  ///< [trainer] nonfinite_loss = "skip" skipped its update
  };
  /// What each micro-batch's loss is divided by ([trainer] loss_average), on the root device:
  /// `accumulate` for each, or (labels) the global batch's labels over its own x world (collective).
  at::Tensor loss_divisors(const std::vector<sdk::Batch>& batches);
  /// Whether the step's loss is finite on every rank (collective).
  bool loss_finite_on_every_rank(const at::Tensor& loss_sum);
  /// `check_loss`: a non-finite loss stops or skips the step ([trainer] nonfinite_loss); off
  /// where it is the signal being waited for (the learning-rate range test's divergence).
  TrainedStep train_step(core::DataLoader& loader, std::int64_t accumulate, double lr, bool check_loss = true);
  /// What every rank learns after a step, from one all-reduce: the global loss (the bar shows
  /// what the log shows), whether any rank must stop, and the items since the last log line.
  struct StepSync {
    double loss = 0;
    int signal = 0;  ///< SIGINT if any rank got one, else SIGTERM if any did: every rank exits alike
    bool out_of_time = false, callback_stop = false;
    double items = 0;
  };
  StepSync synchronise_step(const at::Tensor& loss_sum, bool out_of_time, std::int64_t window_items);
  /// fit's clock: the ETA, and the throughput since the last log line.
  struct FitClock {
    std::chrono::steady_clock::time_point run_start, window_start;
    std::int64_t start_step = 0, window_items = 0;
    std::int64_t data_ranks = 1;  ///< ranks that read distinct batches
  };
  /// The progress bar and, every log_every_n_steps, the log line and the train metrics.
  void report_step(const StepSync& sync, const sdk::StepResult& result, double lr, FitClock& clock);
  /// The busiest rank's peak RSS (and CUDA tensor memory), logged and a metric. Collective.
  void log_peak_memory();

  Config config_;
  sdk::ClusterInfo cluster_;
  RunLog& log_;
  core::PluginLoader loader_;
  FaultInjection faults_;
  std::shared_ptr<sdk::Strategy> strategy_;
  std::shared_ptr<sdk::Precision> precision_;
  std::shared_ptr<sdk::CheckpointIO> checkpoint_io_;
  std::shared_ptr<sdk::Module> model_;
  std::shared_ptr<sdk::DataModule> data_;
  std::vector<NamedCallback> callbacks_;
  std::vector<std::unique_ptr<Logger>> loggers_;
  std::string stage_;
  std::string log_dir_;
  std::map<std::string, double> callback_metrics_;
  bool should_stop_ = false;
  std::string stop_reason_;
  int exit_code_ = 0;
  // Where training stands (saved in checkpoints, restored by --ckpt-path).
  std::int64_t global_step_ = 0;
  std::int64_t epoch_ = 0;
  std::int64_t next_batch_ = 0;
  /// Samples in one micro-batch over all data-parallel ranks (batch_size x data ranks): with
  /// next_batch_ it says how far into the epoch's sample order training stands, whatever the
  /// world size (saved as "samples_per_batch"; 0 until known).
  std::int64_t samples_per_batch_ = 0;
  std::int64_t restored_samples_per_batch_ = 0;
  std::int64_t total_steps_ = 0;
  std::int64_t skipped_steps_ = 0;  ///< optimizer steps the grad scaler skipped in this run
  std::unique_ptr<LRSchedule> schedule_;
  std::unique_ptr<TorchProfiler> torch_profiler_;  ///< [trainer] profiler = "pytorch", in fit
  std::optional<sdk::Checkpoint> restored_schedule_;  ///< from --ckpt-path, checked against the config
  std::string restored_from_;
  std::int64_t earlier_peak_rss_kb_ = 0;  ///< the peak RSS before a restore reset the kernel's mark
  /// The model's parameters and buffers as configure_model built them (full shapes, before the
  /// strategy shards or splits them): what a non-strict init_from matches against.
  std::map<std::string, std::vector<std::int64_t>> model_shapes_;
  /// A LoRA model's base ([model.lora]): what its init_from was and a digest of its files, saved
  /// in each checkpoint's hyper_parameters (lora_base_model_name_or_path, lora_base_hash) and
  /// carried on by a resumed run; empty without LoRA or init_from.
  std::string lora_base_, lora_base_hash_;
  /// init_from of a LoRA model from a base without adapters (a Hugging Face folder, a full
  /// fine-tuning checkpoint): true when `names` hold every tensor of the model but its adapters
  /// and none of these (refused naming the difference otherwise); the adapters then keep their
  /// initialisation (PEFT's: lora_B = 0, so step 1 computes the base's outputs). False for a
  /// model without adapters or names holding some (loaded strictly).
  bool loads_lora_base(const std::vector<std::string>& names, const std::string& path) const;
  /// init_from a PEFT adapter folder (adapter_config.json + adapter_model.safetensors): its base
  /// (base_model_name_or_path, a Hugging Face folder here) into the model, then the adapter, after
  /// checking r, lora_alpha and target_modules against [model.lora].
  void restore_peft(const std::string& path);
  /// Each parameter's requires_grad after the strategy's setup (check_trainable_unchanged).
  std::vector<std::tuple<std::string, at::Tensor, bool>> trainable_at_setup_;
  /// Which parameters train is fixed at setup: the optimizer holds those (and fsdp/fsdp2 built
  /// gradient hooks and buffers for them). A requires_grad changed later (by a callback or the
  /// model) would train differently under each strategy, or not at all: it stops the run.
  void check_trainable_unchanged() const;
};

template <typename Hook>
void Trainer::call(const char* name, Hook&& hook) {
  for (auto& [callback_name, callback] : callbacks_) {
    core::trace::Span span("hook", core::trace::enabled() ? "[Callback]" + callback_name + "." + name : "");
    hook(*callback);
  }
}

}  // namespace tessera::host
