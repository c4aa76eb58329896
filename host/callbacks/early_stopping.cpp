// Lightning's EarlyStopping: stops fit when `monitor` has not improved by more than
// min_delta for `patience` consecutive checks (each validation, or each training epoch end),
// at once when it passes stopping_threshold (good enough) or divergence_threshold (hopeless).
#include <cmath>
#include <sstream>

#include "callbacks/callbacks.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {

class EarlyStopping final : public sdk::Callback {
 public:
  explicit EarlyStopping(const sdk::Options& o)
      : monitor_(o.get_string({"monitor", "the logged metric watched, e.g. val_loss"}, "")),
        mode_(o.get_choice({"mode", "min: lower is better; max: higher is better"}, "min", {"min", "max"})),
        min_delta_(o.get_double({"min_delta", "the least change that counts as an improvement"}, 0.0, 0.0)),
        patience_(o.get_int({"patience", "checks without improvement before stopping"}, 3, 0)),
        strict_(o.get_bool({"strict", "stop with an error when the monitored metric is never logged"}, true)),
        check_finite_(o.get_bool({"check_finite", "stop when the metric becomes NaN or infinite"}, true)),
        check_on_train_epoch_end_(o.get_bool(
            {"check_on_train_epoch_end", "check at the end of each training epoch instead of after validation"},
            false)),
        stopping_threshold_(
            o.get_double({"stopping_threshold", "stop once the metric is better than this; nan: none"}, NAN)),
        divergence_threshold_(
            o.get_double({"divergence_threshold", "stop once the metric is worse than this; nan: none"}, NAN)) {
    TESSERA_CHECK(!monitor_.empty(), o.source(), ": [", o.section(),
                  "] needs monitor = \"...\": the metric to watch, e.g. \"val_loss\"");
  }

  void on_validation_end(sdk::Trainer& trainer) override {
    if (!check_on_train_epoch_end_ && trainer.stage() == "fit") check(trainer);
  }
  void on_train_epoch_end(sdk::Trainer& trainer) override {
    if (check_on_train_epoch_end_) check(trainer);
  }

  std::string state_key() const override { return "EarlyStopping{monitor=" + monitor_ + ",mode=" + mode_ + "}"; }
  sdk::Checkpoint state_dict() const override {
    sdk::Checkpoint state = sdk::make_checkpoint();
    state.insert("wait_count", wait_count_);
    state.insert("best_score", best_);
    state.insert("patience", patience_);
    return state;
  }
  void load_state_dict(const sdk::Checkpoint& state) override {
    wait_count_ = state.at("wait_count").toInt();
    best_ = state.at("best_score").toDouble();
  }

 private:
  void check(sdk::Trainer& trainer) {
    auto it = trainer.callback_metrics().find(monitor_);
    if (it == trainer.callback_metrics().end()) {
      std::string logged;
      for (const auto& [name, value] : trainer.callback_metrics()) logged += (logged.empty() ? "" : ", ") + name;
      TESSERA_CHECK(!strict_, "[callbacks] early_stopping monitors '", monitor_, "', which is not logged (logged: ",
                    logged, "); set strict = false to skip checks without it");
      return;
    }
    double current = it->second;
    std::ostringstream why;
    const char* better = mode_ == "min" ? " < " : " > ";
    const char* worse = mode_ == "min" ? " > " : " < ";
    if (check_finite_ && !std::isfinite(current)) {
      why << "Monitored metric " << monitor_ << " = " << current << " is not finite";
    } else if (!std::isnan(stopping_threshold_) && is_better(current, stopping_threshold_, mode_, 0.0)) {
      why << "Stopping threshold reached: " << monitor_ << " = " << current << better << stopping_threshold_;
    } else if (!std::isnan(divergence_threshold_) && is_better(divergence_threshold_, current, mode_, 0.0)) {
      why << "Divergence threshold reached: " << monitor_ << " = " << current << worse << divergence_threshold_;
    } else if (std::isnan(best_) || is_better(current, best_, mode_, min_delta_)) {
      best_ = current;
      wait_count_ = 0;
      return;
    } else if (++wait_count_ < patience_) {
      return;
    } else {
      why << "Monitored metric " << monitor_ << " did not improve in the last " << wait_count_
          << " records. Best score: " << best_;
    }
    trainer.print("early stopping at step " + std::to_string(trainer.global_step()) + ": " + why.str() +
                  ". Signaling Trainer to stop.");
    trainer.request_stop(why.str());
  }

  std::string monitor_, mode_;
  double min_delta_;
  std::int64_t patience_;
  bool strict_, check_finite_, check_on_train_epoch_end_;
  double stopping_threshold_, divergence_threshold_;  ///< NaN: not set
  std::int64_t wait_count_ = 0;
  double best_ = NAN;
};

}  // namespace

std::shared_ptr<sdk::Callback> make_early_stopping(const sdk::Options& options) {
  return std::make_shared<EarlyStopping>(options);
}

}  // namespace tessera::host
