// Lightning's LearningRateMonitor: logs each parameter group's learning rate (and momentum)
// as lr-<Optimizer>[/pgN], every step or at each epoch start.

#include "callbacks/callbacks.hpp"
#include "tessera/sdk/optimizer.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

namespace {

class LearningRateMonitor final : public sdk::Callback {
 public:
  explicit LearningRateMonitor(const sdk::Options& o)
      : logging_interval_(
            o.get_choice({"logging_interval", "log each param group's learning rate every step or every epoch"}, "step",
                         {"step", "epoch"})),
        log_momentum_(o.get_bool({"log_momentum", "log the momentum (Adam's beta1) too"}, false)),
        log_weight_decay_(o.get_bool({"log_weight_decay", "log the weight decay too"}, false)) {}

  void on_train_batch_end(sdk::Trainer& trainer, const sdk::StepOutput&, const sdk::Batch&, std::int64_t) override {
    if (logging_interval_ == "step" && trainer.global_step() != logged_step_) log(trainer);
  }
  void on_train_epoch_start(sdk::Trainer& trainer) override {
    if (logging_interval_ == "epoch") log(trainer);
  }

 private:
  void log(sdk::Trainer& trainer) {
    logged_step_ = trainer.global_step();
    torch::optim::Optimizer& optimizer = trainer.strategy().optimizer();
    const sdk::OptimizerKind kind = sdk::optimizer_kind(optimizer);
    const std::string name = kind.name.empty() ? "Optimizer" : kind.name;
    std::map<std::string, double> metrics;
    const auto& groups = optimizer.param_groups();
    for (std::size_t i = 0; i < groups.size(); ++i) {
      std::string key = "lr-" + name + (groups.size() > 1 ? "/pg" + std::to_string(i + 1) : "");
      const auto& options = groups[i].options();
      metrics[key] = options.get_lr();
      if (kind.name.empty()) continue;  // another class: its lr only
      const sdk::Checkpoint hyper = sdk::hyper_parameters(options);
      // Lightning's "momentum" of Adam is beta1.
      if (log_momentum_)
        metrics[key + "-momentum"] = hyper.contains("betas") ? hyper.at("betas").toTupleRef().elements()[0].toDouble()
                                                             : hyper.at("momentum").toDouble();
      if (log_weight_decay_) metrics[key + "-weight_decay"] = hyper.at("weight_decay").toDouble();
    }
    trainer.log_metrics(metrics);
  }

  std::string logging_interval_;
  bool log_momentum_, log_weight_decay_;
  std::int64_t logged_step_ = -1;
};

}  // namespace

std::shared_ptr<sdk::Callback> make_lr_monitor(const sdk::Options& options) {
  return std::make_shared<LearningRateMonitor>(options);
}

}  // namespace tessera::host
