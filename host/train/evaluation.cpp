// The evaluation loops: validation (during fit, and `tessera validate`), test, and Lightning's
// sanity check before the first step.
#include <algorithm>
#include <limits>

#include <ATen/ATen.h>

#include "data/data_loader.hpp"
#include "trace/trace.hpp"
#include "train/trainer_steps.hpp"

namespace tessera::host {

namespace {

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

}  // namespace

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
  // its samples, and the result is the per-sample mean over every rank's batches. Its size is
  // its labels under [trainer] loss_average = "labels", as in training: a masked or packed
  // row's mean counts for the tokens it was taken over.
  const bool by_labels = config_.trainer.loss_average == "labels";
  std::map<std::string, double> sums;
  double samples = 0;
  const std::string title = stage == "test" ? "testing    " : "validation ";
  for (std::int64_t i = 0; i < batches; ++i) {
    sdk::Batch batch = loader.batch(i);
    sdk::StepOutput out = run_step(stage == "test" ? "test_step" : "validation_step", [&] {
      return stage == "test" ? strategy_->test_step(batch, i) : strategy_->validation_step(batch, i);
    });
    const double weight = by_labels ? label_count(batch).item<double>()
                                    : static_cast<double>(std::max<std::int64_t>(1, batch.size()));
    if (weight == 0) continue;  // no label: its mean is 0 / 0
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

void Trainer::validate(const std::string& ckpt_path) { evaluate_checkpoint("validate", ckpt_path); }

void Trainer::test(const std::string& ckpt_path) { evaluate_checkpoint("test", ckpt_path); }

void Trainer::evaluate_checkpoint(const std::string& command, const std::string& ckpt_path) {
  const bool test = command == "test";
  setup_with_weights(command, ckpt_path);
  begin_run();
  if (test) call("on_test_start", [&](sdk::Callback& c) { c.on_test_start(*this); });
  else call("on_validation_start", [&](sdk::Callback& c) { c.on_validation_start(*this); });
  auto metrics = evaluate(test ? "test" : "val", test ? config_.trainer.limit_test_batches
                                                      : config_.trainer.limit_val_batches).metrics;
  log_.info(metrics_line(command + ":", metrics, 6));
  log_stage_metrics(metrics, command);
  if (test) call("on_test_end", [&](sdk::Callback& c) { c.on_test_end(*this); });
  else call("on_validation_end", [&](sdk::Callback& c) { c.on_validation_end(*this); });
  finish("success");
}

}  // namespace tessera::host
