#pragma once
/// Callback plugins (Lightning's Callback): code the trainer runs at fixed points of fit,
/// validate and test. Every hook has an empty default, so a callback overrides only what it
/// needs. Hooks run on every rank, in the order of the config's [callbacks.*] tables, with
/// checkpointing callbacks last (as Lightning orders them). A hook may call collective
/// methods of the trainer (save_checkpoint, strategy().reduce, ...): every rank runs it.
///
///   class StopOnLoss final : public tessera::sdk::Callback {
///     void on_train_batch_end(Trainer& trainer, const StepOutput&, const Batch&, std::int64_t) override {
///       if (trainer.callback_metrics().at("train_loss") < 2.0) trainer.request_stop("loss below 2");
///     }
///   };
///   TESSERA_PLUGIN(callback, "1.0.0", tessera::sdk::plugin_entry<StopOnLoss>("stop_on_loss", "..."));
#include <cstdint>
#include <exception>
#include <map>
#include <string>

#include "tessera/sdk/plugin.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::sdk {

class Module;
class Strategy;

/// What a callback sees of the running trainer (Lightning's `trainer` argument).
class TESSERA_SDK_API Trainer {
 public:
  virtual ~Trainer();

  /// "fit", "validate", "test" or "predict".
  virtual const std::string& stage() const = 0;
  /// Optimizer steps taken so far (Lightning's global_step).
  virtual std::int64_t global_step() const = 0;
  /// The epoch being trained, 0-based (after an epoch ends: the next one).
  virtual std::int64_t current_epoch() const = 0;
  /// The optimizer steps this fit will take (max_steps, or max_epochs x steps per epoch).
  virtual std::int64_t estimated_stepping_batches() const = 0;
  /// The latest value of every metric logged so far ("train_loss", "val_loss", ...), each
  /// already averaged over ranks: the same on every rank.
  virtual const std::map<std::string, double>& callback_metrics() const = 0;
  /// Sends `metrics` to the loggers at the current global step (rank 0 writes them) and
  /// adds them to callback_metrics(). Values must be the same on every rank.
  virtual void log_metrics(const std::map<std::string, double>& metrics) = 0;
  /// A line on rank 0's terminal and in every rank's log file.
  virtual void print(const std::string& line) = 0;

  /// Asks fit to stop after the current step (Lightning's `trainer.should_stop = True`).
  /// Any rank may ask; all ranks stop at the same step.
  virtual void request_stop(const std::string& reason) = 0;
  virtual bool should_stop() const = 0;

  /// This run's directory (default_root_dir/[name/]version_N), where loggers write.
  virtual const std::string& log_dir() const = 0;
  /// Saves a training checkpoint at `path` (collective: call on every rank). `weights_only`
  /// (Lightning's): the model's state, the step and the callbacks' state, without the
  /// optimizer, grad scaler, schedule and RNG states; fit cannot resume from it.
  virtual void save_checkpoint(const std::string& path, bool weights_only = false) = 0;
  /// Removes a checkpoint written by save_checkpoint (collective).
  virtual void remove_checkpoint(const std::string& path) = 0;

  virtual Strategy& strategy() = 0;
  virtual Module& lightning_module() = 0;
  virtual bool is_global_zero() const = 0;
};

class TESSERA_SDK_API Callback : public PluginObject {
 public:
  ~Callback() override;

  virtual void setup(Trainer& trainer, const std::string& stage);
  virtual void teardown(Trainer& trainer, const std::string& stage);
  virtual void on_fit_start(Trainer& trainer);
  virtual void on_fit_end(Trainer& trainer);
  virtual void on_train_start(Trainer& trainer);
  virtual void on_train_end(Trainer& trainer);
  virtual void on_train_epoch_start(Trainer& trainer);
  /// After the epoch's last step and its end-of-epoch validation, if any.
  virtual void on_train_epoch_end(Trainer& trainer);
  virtual void on_train_batch_start(Trainer& trainer, const Batch& batch, std::int64_t batch_idx);
  /// After each batch; for the last micro-batch of an accumulation, after the optimizer
  /// step and after a validation due at this step (callbacks see its metrics).
  virtual void on_train_batch_end(Trainer& trainer, const StepOutput& outputs, const Batch& batch,
                                  std::int64_t batch_idx);
  /// After each optimizer step, before a validation due at that step (Lightning's callbacks do
  /// this in on_train_batch_end, which runs before its validation; here that hook runs after).
  virtual void on_after_optimizer_step(Trainer& trainer);
  virtual void on_validation_start(Trainer& trainer);
  /// The validation metrics are in callback_metrics() by then.
  virtual void on_validation_end(Trainer& trainer);
  virtual void on_test_start(Trainer& trainer);
  virtual void on_test_end(Trainer& trainer);
  /// `checkpoint` is about to be saved; add to it (e.g. this callback's own state is
  /// stored under "callbacks"/state_key() by the trainer already).
  virtual void on_save_checkpoint(Trainer& trainer, Checkpoint& checkpoint);
  virtual void on_load_checkpoint(Trainer& trainer, const Checkpoint& checkpoint);
  /// fit/validate/test failed with `error` (or was interrupted by a signal: then the
  /// trainer has already saved its checkpoint).
  virtual void on_exception(Trainer& trainer, const std::exception& error);

  /// The key of this callback's state in a checkpoint's "callbacks" dict; "" (the default)
  /// means the callback has no state.
  virtual std::string state_key() const;
  virtual Checkpoint state_dict() const;
  virtual void load_state_dict(const Checkpoint& state);
};

}  // namespace tessera::sdk
