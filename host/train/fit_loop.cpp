// The fit loop: the training data and its sampler position, one optimizer step (micro-batches,
// anomaly check, clipping, optimizer), what every rank learns after it, the progress line, and
// fit itself (epochs, validation, checkpoints, stopping). Setup is in trainer.cpp.
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
#include "train/trainer_steps.hpp"

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

}  // namespace

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

bool Trainer::loss_finite_on_every_rank(const at::Tensor& loss_sum) {
  // One scalar all-reduce: a rank alone with a NaN loss must not step while the others stop.
  const at::Tensor bad = at::logical_not(at::isfinite(loss_sum)).to(at::kFloat).reshape({1});
  return strategy_->reduce(bad.to(strategy_->root_device()), sdk::ReduceOp::max).item<double>() == 0;
}

at::Tensor label_count(const sdk::Batch& batch) {
  const bool labels = batch.target.defined() && !at::isFloatingType(batch.target.scalar_type());
  return labels ? batch.target.ne(-100).sum().to(at::kFloat) : at::full({}, static_cast<double>(batch.size()), at::kFloat);
}

at::Tensor Trainer::loss_divisors(const std::vector<sdk::Batch>& batches) {
  const auto accumulate = static_cast<double>(batches.size());
  const auto on_root = at::TensorOptions().dtype(at::kFloat).device(strategy_->root_device());
  if (config_.trainer.loss_average == "micro_batches") return at::full({static_cast<std::int64_t>(batches.size())}, accumulate, on_root);
  // Counted where the loader made them (the host: no sync).
  std::vector<at::Tensor> counts;
  for (const sdk::Batch& b : batches) counts.push_back(label_count(b));
  const at::Tensor local = at::stack(counts).to(on_root);
  // Every rank's labels in one scalar all-reduce; its result stays on the device (no .item()).
  const at::Tensor total = strategy_->reduce(local.sum().reshape({1}), sdk::ReduceOp::sum);
  // The mean's weights: loss_m x labels_m x world / total, whose gradient the strategy's average
  // over ranks turns into the global batch's mean (tensor-parallel ranks count their shared batch
  // alike, so the world's total is tp times the data ranks' and the ratio holds). Equal counts give
  // exactly `accumulate`; a micro-batch without labels gets inf (its loss weighs nothing).
  return total / (local * static_cast<double>(cluster_.world_size));
}

Trainer::TrainedStep Trainer::train_step(core::DataLoader& loader, std::int64_t accumulate, double lr,
                                         bool check_loss) {
  const TrainerSettings& t = config_.trainer;
  for (auto& group : strategy_->optimizer().param_groups()) group.options().set_lr(lr);
  TrainedStep step;
  // The step's micro-batches first: their label counts weigh each one's loss before any backward.
  std::vector<sdk::Batch> batches;
  {
    core::trace::Span span("hook", "[DataLoader]next");
    for (std::int64_t m = 0; m < accumulate; ++m) batches.push_back(loader.batch(next_batch_ + m));
  }
  const at::Tensor divisors = loss_divisors(batches);
  for (std::int64_t m = 0; m < accumulate; ++m) {
    const std::int64_t batch_idx = next_batch_ + m;
    core::ledger_set_step(global_step_ + 1, m);
    sdk::Batch batch = std::move(batches[static_cast<std::size_t>(m)]);
    call("on_train_batch_start", [&](sdk::Callback& c) { c.on_train_batch_start(*this, batch, batch_idx); });
    check_trainable_unchanged();
    sdk::StepOutput out;
    {
      core::trace::Span span("hook", "[Strategy]training_step");
      out = run_step("training_step", [&] { return strategy_->training_step(batch, batch_idx); });
    }
    // A micro-batch without labels adds nothing (its mean loss is 0 / 0).
    const at::Tensor divisor = divisors[m].to(out.loss.device());
    // fp32 whatever the loss's dtype: a bf16 divisor would be off by up to 0.4%.
    const at::Tensor weighted = at::where(at::isinf(divisor), at::zeros({}, divisor.options()), out.loss / divisor);
    {
      core::trace::Span span("hook", "[Strategy]backward");
      run_step("backward", [&] { strategy_->backward(weighted, /*sync_gradients=*/m == accumulate - 1); });
    }
    const at::Tensor loss = weighted.detach().to(at::kFloat);
    step.loss_sum = step.loss_sum.defined() ? step.loss_sum + loss : loss;
    step.items += out.items;
    if (m < accumulate - 1) {
      call("on_train_batch_end", [&](sdk::Callback& c) { c.on_train_batch_end(*this, out, batch, batch_idx); });
    } else {  // its hook runs after the optimizer step, as Lightning's
      step.last_out = std::move(out);
      step.last_batch = std::move(batch);
    }
  }
  if (t.detect_anomaly || (check_loss && !loss_finite_on_every_rank(step.loss_sum))) {
    core::trace::Span span("hook", "[Trainer]detect_anomaly");
    AnomalyReport anomaly =
        check_finite_step(*strategy_, *model_, step.loss_sum, cluster_.global_rank, cluster_.world_size);
    const bool skip = !anomaly.finite && !anomaly.scaler_skips && !t.detect_anomaly && t.nonfinite_loss == "skip";
    TESSERA_CHECK(anomaly.finite || anomaly.scaler_skips || skip, "step ", global_step_ + 1,
                  t.detect_anomaly ? " ([trainer] detect_anomaly): " : " ([trainer] nonfinite_loss = \"stop\"): ",
                  anomaly.message, t.detect_anomaly ? "" : "; [trainer] nonfinite_loss = \"skip\" skips such steps");
    if (skip) {
      strategy_->optimizer().zero_grad();
      step.result.stepped = false;
      step.nonfinite_skipped = true;
      return step;
    }
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

Trainer::StepSync Trainer::synchronise_step(const at::Tensor& loss_sum, bool out_of_time, std::int64_t window_items) {
  // Built on the device by kernels only: a host-to-device copy would wait for the step as well.
  const auto on_root = at::TensorOptions().dtype(at::kFloat).device(strategy_->root_device());
  std::vector<at::Tensor> parts{loss_sum.to(on_root).reshape({})};
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
  const double own_mb = static_cast<double>(std::max<std::int64_t>(usage.ru_maxrss, earlier_peak_rss_kb_)) / 1024.0;
  // Each rank's own, in its log only (`tessera report` draws them per rank).
  log_.to_file("peak RSS of rank " + std::to_string(cluster_.global_rank) + ": " + RunLog::number(own_mb, 5) + " MB");
  const double peak_mb = max_over_ranks(own_mb);
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
  std::vector<std::string> notes;
  const std::string checkpoint = resolve_checkpoint(config_, ckpt_path, /*fit=*/true, &notes);  // before a new run folder exists
  for (const std::string& note : notes) log_.info(note);
  if ((ckpt_path == "last" || ckpt_path == "auto") && checkpoint.empty() && notes.empty())
    log_.info("--ckpt-path " + ckpt_path + ": no checkpoint yet in any run under " +
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

  if (t.profiler == "pytorch") torch_profiler_ = std::make_unique<TorchProfiler>(strategy_->root_device().is_cuda());
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
        if (torch_profiler_) torch_profiler_->before_step(global_step_ + 1);
        TrainedStep step = train_step(loader, accumulate, lr);
        next_batch_ += accumulate;
        ++global_step_;
        if (torch_profiler_) torch_profiler_->after_step(global_step_, global_step_ == total_steps_);
        clock.window_items += step.items;
        call("on_after_optimizer_step", [&](sdk::Callback& c) { c.on_after_optimizer_step(*this); });
        if (step.nonfinite_skipped) {
          ++skipped_steps_;
          log_.info("step " + std::to_string(global_step_) + ": non-finite loss, the optimizer step is skipped " +
                    "([trainer] nonfinite_loss = \"skip\"), " + std::to_string(skipped_steps_) +
                    " step(s) skipped so far");
        } else if (!step.result.stepped) {  // the grad scaler saw inf/NaN: expected now and then, counted, not a failure
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
            synchronise_step(step.loss_sum, t.max_time_s > 0 && elapsed >= t.max_time_s, clock.window_items);
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

}  // namespace tessera::host
