// The learning-rate range test (`tessera lr-find`, and [lr_find] before_fit): the loop that
// drives lr_find.hpp's LrRangeTest through the strategy, as fit trains.
#include <chrono>
#include <cmath>
#include <optional>

#include "data/data_loader.hpp"
#include "train/lr_find.hpp"
#include "train/trainer_steps.hpp"

namespace tessera::host {

namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace

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
    TrainedStep trained = train_step(*data.loader, accumulate, lr, /*check_loss=*/false);  // divergence ends the test
    next_batch_ += accumulate;
    ++global_step_;
    clock.window_items += trained.items;
    faults_.at_step(global_step_);
    const StepSync sync = synchronise_step(trained.loss_sum, /*out_of_time=*/false, clock.window_items);
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

}  // namespace tessera::host
