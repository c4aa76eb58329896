#include "trainer.hpp"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/data_loader.hpp"
#include "tessera/sdk/build_config.hpp"  // TESSERA_WITH_CUDA, before the #if below
#include "tessera/sdk/error.hpp"
#include "lr_schedule.hpp"

#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace tessera::host {

namespace {

using Clock = std::chrono::steady_clock;

std::string format(double value, int precision = 4) {
  std::ostringstream out;
  out << std::setprecision(precision) << value;
  return out.str();
}

std::string duration(double seconds) {
  auto s = static_cast<std::int64_t>(seconds);
  std::ostringstream out;
  out << std::setfill('0') << s / 3600 << ":" << std::setw(2) << (s / 60) % 60 << ":" << std::setw(2) << s % 60;
  return out.str();
}

/// Averages named scalar metrics over ranks with a single all-reduce.
std::map<std::string, double> reduce_mean(sdk::Strategy& strategy, const std::map<std::string, double>& local) {
  std::vector<double> values;
  for (const auto& [name, value] : local) values.push_back(value);
  if (values.empty()) return {};
  at::Tensor packed = at::tensor(values, at::kDouble).to(at::kFloat).to(strategy.root_device());
  at::Tensor reduced = strategy.reduce(packed, sdk::ReduceOp::mean).to(at::kCPU).to(at::kDouble);
  std::map<std::string, double> out;
  std::size_t i = 0;
  for (const auto& [name, value] : local) out[name] = reduced[static_cast<std::int64_t>(i++)].item<double>();
  return out;
}

}  // namespace

Trainer::Trainer(Config config, const sdk::ClusterInfo& cluster, RunLog& log)
    : config_(std::move(config)), cluster_(cluster), log_(log),
      loader_(core::PluginLoader::search_path(config_.plugin_dirs)) {}

Trainer::~Trainer() {
  if (strategy_) strategy_->teardown();
}

void Trainer::setup(const std::string& stage) {
  using sdk::PluginKind;
  auto create = [&](const std::string& section, PluginKind kind) {
    const sdk::Options& options = config_.plugins.at(section);
    auto object = loader_.create(kind, config_.plugin_names.at(section), options);
    options.check_all_used({"plugin"});
    return object;
  };
  // Every plugin is created (and its configuration checked) before any work starts.
  strategy_ = std::dynamic_pointer_cast<sdk::Strategy>(create("strategy", PluginKind::strategy));
  precision_ = std::dynamic_pointer_cast<sdk::Precision>(create("precision", PluginKind::precision));
  checkpoint_io_ = std::dynamic_pointer_cast<sdk::CheckpointIO>(create("checkpoint_io", PluginKind::checkpoint_io));
  model_ = std::dynamic_pointer_cast<sdk::Module>(create("model", PluginKind::model));
  data_ = std::dynamic_pointer_cast<sdk::DataModule>(create("data", PluginKind::data));
  TESSERA_CHECK(strategy_ && precision_ && checkpoint_io_ && model_ && data_,
                "a plugin created an object of the wrong interface");

  strategy_->connect(precision_, checkpoint_io_);
  strategy_->setup_environment(cluster_);
  precision_->check_device(strategy_->root_device());
  at::manual_seed(static_cast<std::uint64_t>(config_.trainer.seed));
  {
    sdk::GuardPtr sharded = strategy_->model_sharded_context();
    sdk::GuardPtr dtype = precision_->module_init_context();
    model_->configure_model();
  }
  std::int64_t parameters = 0;
  for (const auto& p : model_->network()->parameters()) parameters += p.numel();
  strategy_->setup(model_, config_.optimizer);
  data_->setup(stage);
  log_.info("tessera " + stage + ": strategy " + config_.plugin_names.at("strategy") + ", precision " +
            precision_->precision() + ", model " + config_.plugin_names.at("model") + " (" +
            format(static_cast<double>(parameters) / 1e6, 4) + "M parameters), data " +
            config_.plugin_names.at("data") + ", " + std::to_string(cluster_.world_size) + " rank(s) [" +
            cluster_.environment + "] on " + strategy_->root_device().str());
}

std::string Trainer::resolve_checkpoint(const std::string& ckpt_path) const {
  return ckpt_path == "last" ? core::resolve_last(config_.trainer.default_root_dir + "/checkpoints") : ckpt_path;
}

void Trainer::save(const std::string& path) {
  sdk::Checkpoint checkpoint = sdk::make_checkpoint();
  checkpoint.insert("state_dict", core::to_ivalue(strategy_->lightning_module_state_dict()));
  c10::impl::GenericList optimizer_states(c10::AnyType::get());
  optimizer_states.push_back(strategy_->optimizer_state());
  checkpoint.insert("optimizer_states", optimizer_states);
  checkpoint.insert("precision_plugin", precision_->state_dict());
  checkpoint.insert("global_step", global_step_);
  checkpoint.insert("epoch", epoch_);
  checkpoint.insert("batch_in_epoch", next_batch_);
  c10::impl::GenericList lr_schedulers(c10::AnyType::get());
  lr_schedulers.push_back(schedule_->state_dict(global_step_));
  checkpoint.insert("lr_schedulers", lr_schedulers);
  checkpoint.insert("rng_state", at::detail::getDefaultCPUGenerator().get_state());
  if (strategy_->root_device().is_cuda())
    checkpoint.insert("cuda_rng_state", at::globalContext().defaultGenerator(strategy_->root_device()).get_state());
  checkpoint.insert("hyper_parameters", model_->hyper_parameters());
  checkpoint.insert("tessera_version", std::string(TESSERA_VERSION));
  checkpoint.insert("save_id", core::agree_on_save_id(*strategy_));
  const auto start = std::chrono::steady_clock::now();
  strategy_->save_checkpoint(checkpoint, path);
  log_.info("checkpoint saved: " + path + " (step " + std::to_string(global_step_) + ", training paused " +
            format(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3) + " s)");
}

void Trainer::restore(const std::string& path, bool with_training_state) {
  const auto start = std::chrono::steady_clock::now();
  sdk::Checkpoint checkpoint = strategy_->load_checkpoint(path);
  strategy_->load_model_state_dict(
      core::state_dict_from(core::checkpoint_get(checkpoint, "state_dict"), "checkpoint " + path + " [state_dict]"),
      /*strict=*/true);
  if (with_training_state) {
    auto optimizer_states = core::checkpoint_get(checkpoint, "optimizer_states").toListRef();
    TESSERA_CHECK(!optimizer_states.empty(), "checkpoint ", path, " has no optimizer state");
    strategy_->load_optimizer_state(core::checkpoint_dict(optimizer_states[0], "checkpoint optimizer_states[0]"));
    precision_->load_state_dict(core::checkpoint_dict(core::checkpoint_get(checkpoint, "precision_plugin"),
                                                      "checkpoint precision_plugin"));
    global_step_ = core::checkpoint_get(checkpoint, "global_step").toInt();
    epoch_ = core::checkpoint_get(checkpoint, "epoch").toInt();
    next_batch_ = core::checkpoint_get(checkpoint, "batch_in_epoch").toInt();
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
  }
  log_.info("restored " + path + (with_training_state ? " (resuming at step " + std::to_string(global_step_) + ")" : "") +
            " in " + format(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 3) + " s");
}

void Trainer::maybe_inject_fault(std::int64_t step) const {
  // Test-only: TESSERA_FAULT_INJECT="rank=1,step=3,kind=exit|kill|hang".
  const char* spec = std::getenv("TESSERA_FAULT_INJECT");
  if (spec == nullptr) return;
  std::map<std::string, std::string> fields;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    auto eq = item.find('=');
    if (eq != std::string::npos) fields[item.substr(0, eq)] = item.substr(eq + 1);
  }
  if (std::stoll(fields["rank"]) != cluster_.global_rank || std::stoll(fields["step"]) != step) return;
  log_.info("fault injection: rank " + std::to_string(cluster_.global_rank) + " " + fields["kind"] + " at step " +
            std::to_string(step));
  if (fields["kind"] == "kill") ::raise(SIGKILL);
  if (fields["kind"] == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  std::_Exit(3);
}

std::map<std::string, double> Trainer::evaluate(const std::string& stage, const BatchLimit& limit) {
  std::shared_ptr<sdk::Dataset> dataset = stage == "test" ? data_->test_dataset() : data_->val_dataset();
  if (!dataset || dataset->size() == 0) return {};
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  spec.seed = config_.trainer.seed;
  core::DataLoader loader(dataset, strategy_->process_dataloader(spec));
  const std::int64_t batches = limit.of(loader.num_batches());
  if (batches == 0) return {};
  auto network = model_->network();
  network->train(false);
  std::map<std::string, double> sums;
  for (std::int64_t i = 0; i < batches; ++i) {
    sdk::Batch batch = loader.batch(i);
    sdk::StepOutput out = stage == "test" ? strategy_->test_step(batch, i) : strategy_->validation_step(batch, i);
    for (const auto& [name, value] : out.metrics) sums[stage + "_" + name] += value.item<double>();
  }
  network->train(true);
  for (auto& [name, value] : sums) value /= static_cast<double>(std::max<std::int64_t>(1, batches));
  return reduce_mean(*strategy_, sums);
}

void Trainer::fit(const std::string& ckpt_path) {
  setup("fit");
  if (!ckpt_path.empty()) restore(resolve_checkpoint(ckpt_path), /*with_training_state=*/true);
  const TrainerSettings& t = config_.trainer;
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  spec.shuffle = config_.data.shuffle;
  spec.drop_last = true;
  spec.seed = t.seed;
  core::DataLoader loader(data_->train_dataset(), strategy_->process_dataloader(spec));
  const std::int64_t accumulate = t.accumulate_grad_batches;
  const std::int64_t steps_per_epoch = loader.num_batches() / accumulate;
  TESSERA_CHECK(steps_per_epoch > 0, "the training set gives this rank ", loader.num_batches(),
                " batches per epoch, fewer than [trainer] accumulate_grad_batches = ", accumulate,
                ": lower [data] batch_size or accumulate_grad_batches");
  total_steps_ = t.max_steps > 0 ? t.max_steps : t.max_epochs * steps_per_epoch;
  schedule_ = std::make_unique<LRSchedule>(config_.schedule, config_.optimizer.lr, total_steps_);
  if (restored_schedule_) {
    std::string change = schedule_->compare(*restored_schedule_, global_step_, restored_from_ + " [lr_schedulers][0]");
    if (!change.empty()) log_.info(change);
  }
  log_.info("global batch = " + std::to_string(config_.data.batch_size) + " per rank x " +
            std::to_string(cluster_.world_size) + " ranks x " + std::to_string(accumulate) + " accumulated = " +
            std::to_string(config_.data.batch_size * cluster_.world_size * accumulate) + " samples; " +
            std::to_string(total_steps_) + " optimizer steps");

  const std::string unit = data_->item_unit();
  auto window_start = Clock::now();
  auto run_start = Clock::now();
  std::int64_t window_items = 0, window_steps = 0, start_step = global_step_;
  double last_loss = NAN;
  auto network = model_->network();
  network->train(true);
  while (epoch_ < t.max_epochs && global_step_ < total_steps_) {
    loader.set_epoch(epoch_);
    while (next_batch_ + accumulate <= loader.num_batches() && global_step_ < total_steps_) {
      const double lr = schedule_->lr(global_step_);
      for (auto& group : strategy_->optimizer().param_groups()) group.options().set_lr(lr);
      at::Tensor loss_sum = at::zeros({}, at::kFloat);
      for (std::int64_t m = 0; m < accumulate; ++m) {
        sdk::StepOutput out = strategy_->training_step(loader.batch(next_batch_ + m), next_batch_ + m);
        strategy_->backward(out.loss / static_cast<double>(accumulate), /*sync_gradients=*/m == accumulate - 1);
        loss_sum += out.loss.detach().to(at::kCPU).to(at::kFloat);
        window_items += out.items;
      }
      sdk::StepResult result = strategy_->optimizer_step(t.gradient_clip_val, t.norm_type);
      next_batch_ += accumulate;
      ++global_step_;
      ++window_steps;
      maybe_inject_fault(global_step_);
      last_loss = loss_sum.item<double>() / static_cast<double>(accumulate);

      const bool log_now = global_step_ % t.log_every_n_steps == 0 || global_step_ == total_steps_ ||
                           global_step_ == start_step + 1;
      double elapsed = std::chrono::duration<double>(Clock::now() - window_start).count();
      double per_step = std::chrono::duration<double>(Clock::now() - run_start).count() /
                        static_cast<double>(global_step_ - start_step);
      std::string bar = "step " + std::to_string(global_step_) + "/" + std::to_string(total_steps_) + "  loss " +
                        format(last_loss) + "  lr " + format(lr, 3) + "  ETA " +
                        duration(per_step * static_cast<double>(total_steps_ - global_step_));
      if (log_now) {
        std::map<std::string, double> metrics = reduce_mean(*strategy_, {{"train_loss", last_loss}});
        // Throughput of the whole job: every rank's items since the last log line.
        at::Tensor items = strategy_->reduce(at::full({}, static_cast<double>(window_items), at::kFloat).to(
                                                 strategy_->root_device()),
                                             sdk::ReduceOp::sum);
        double rate = items.item<double>() / std::max(elapsed, 1e-9);
        metrics["lr"] = lr;
        metrics[unit + "_per_s"] = rate;
        if (result.grad_norm >= 0) metrics["grad_norm"] = result.grad_norm;
        if (!result.stepped) metrics["skipped_step"] = 1;
        std::string line = "epoch " + std::to_string(epoch_) + " step " + std::to_string(global_step_) + "/" +
                           std::to_string(total_steps_) + "  loss " + format(metrics["train_loss"]) + "  lr " +
                           format(lr, 3) + "  " + format(rate, 5) + " " + unit + "/s  ETA " +
                           duration(per_step * static_cast<double>(total_steps_ - global_step_));
        log_.progress(bar + "  " + format(rate, 5) + " " + unit + "/s", line, true);
        log_.metrics(global_step_, epoch_, "train", metrics);
        window_items = 0;
        window_steps = 0;
        window_start = Clock::now();
      } else {
        log_.progress(bar, "", false);
      }
      if (t.val_check_interval > 0 && global_step_ % t.val_check_interval == 0) {
        auto val = evaluate("val", t.limit_val_batches);
        if (!val.empty()) {
          std::string line = "validation at step " + std::to_string(global_step_) + ":";
          for (const auto& [name, value] : val) line += "  " + name + " " + format(value);
          log_.info(line);
          log_.metrics(global_step_, epoch_, "val", val);
        }
      }
      if (t.checkpoint_every_n_steps > 0 && global_step_ % t.checkpoint_every_n_steps == 0)
        save(t.default_root_dir + "/checkpoints/step=" + std::to_string(global_step_) + ".ckpt");
    }
    if (next_batch_ + accumulate > loader.num_batches()) {  // the epoch is complete
      ++epoch_;
      next_batch_ = 0;
      if (t.val_check_interval == 0) {
        auto val = evaluate("val", t.limit_val_batches);
        std::string line = "validation after epoch " + std::to_string(epoch_ - 1) + ":";
        for (const auto& [name, value] : val) line += "  " + name + " " + format(value);
        if (!val.empty()) log_.info(line), log_.metrics(global_step_, epoch_, "val", val);
      }
    }
  }
  auto max_over_ranks = [&](double value) {
    at::Tensor t = at::full({}, value, at::kFloat).to(strategy_->root_device());
    return strategy_->reduce(t, sdk::ReduceOp::max).item<double>();
  };
  // Peak resident memory of the busiest rank: the figure FSDP is meant to lower.
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  double peak_mb = max_over_ranks(static_cast<double>(usage.ru_maxrss) / 1024.0);
  log_.info("peak RSS per rank (max over ranks): " + format(peak_mb, 5) + " MB");
  log_.metrics(global_step_, epoch_, "train", {{"peak_rss_mb", peak_mb}});
#if TESSERA_WITH_CUDA
  // And the peak of tensor memory on the GPU (what cpu_offload and sharding lower there).
  if (strategy_->root_device().is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(strategy_->root_device().index());
    const auto peak = stats.allocated_bytes[0].peak;  // [0]: StatType::AGGREGATE (its namespace moved in LibTorch 2)
    double cuda_mb = max_over_ranks(static_cast<double>(peak) / 1048576.0);
    log_.info("peak CUDA tensor memory per rank (max over ranks): " + format(cuda_mb, 5) + " MB");
    log_.metrics(global_step_, epoch_, "train", {{"peak_cuda_mb", cuda_mb}});
  }
#endif
  if (t.save_last) save(t.default_root_dir + "/checkpoints/last.ckpt");
  if (t.predict_after_fit) {
    log_.info("sample from the trained model:");
    predict_batches(BatchLimit{false, 1.0});
  }
}

void Trainer::validate(const std::string& ckpt_path) {
  setup("validate");
  if (!ckpt_path.empty()) restore(resolve_checkpoint(ckpt_path), false);
  auto metrics = evaluate("val", config_.trainer.limit_val_batches);
  std::string line = "validate:";
  for (const auto& [name, value] : metrics) line += "  " + name + " " + format(value, 6);
  log_.info(line);
  log_.metrics(global_step_, epoch_, "validate", metrics);
}

void Trainer::test(const std::string& ckpt_path) {
  setup("test");
  if (!ckpt_path.empty()) restore(resolve_checkpoint(ckpt_path), false);
  auto metrics = evaluate("test", config_.trainer.limit_test_batches);
  std::string line = "test:";
  for (const auto& [name, value] : metrics) line += "  " + name + " " + format(value, 6);
  log_.info(line);
  log_.metrics(global_step_, epoch_, "test", metrics);
}

void Trainer::predict(const std::string& ckpt_path) {
  setup("predict");
  if (!ckpt_path.empty()) restore(resolve_checkpoint(ckpt_path), false);
  predict_batches(config_.trainer.limit_predict_batches);
}

void Trainer::predict_batches(const BatchLimit& limit) {
  std::shared_ptr<sdk::Dataset> dataset = data_->predict_dataset();
  TESSERA_CHECK(dataset != nullptr, "data plugin '", config_.plugin_names.at("data"), "' has nothing to predict");
  sdk::DataLoaderSpec spec;
  spec.batch_size = config_.data.batch_size;
  core::DataLoader loader(dataset, strategy_->process_dataloader(spec));
  const std::int64_t batches = limit.of(loader.num_batches());
  model_->network()->train(false);
  at::manual_seed(static_cast<std::uint64_t>(config_.trainer.seed));
  for (std::int64_t i = 0; i < batches; ++i) {
    sdk::Batch batch = loader.batch(i);
    at::Tensor output = strategy_->predict_step(batch, i);
    log_.info(data_->describe_prediction(batch, output.to(at::kCPU)));
  }
  model_->network()->train(true);
}

}  // namespace tessera::host
