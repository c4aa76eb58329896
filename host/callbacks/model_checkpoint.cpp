// Lightning's ModelCheckpoint: saves every_n_train_steps / every_n_epochs / train_time_interval, keeps the
// save_top_k best by `monitor` (or the latest ones without a monitor), and last.ckpt.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>

#include <ATen/ATen.h>

#include "callbacks/callbacks.hpp"
#include "config/config.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/strategy.hpp"

namespace tessera::host {

namespace {

class ModelCheckpoint final : public sdk::Callback {
 public:
  explicit ModelCheckpoint(const sdk::Options& o)
      : dirpath_(o.get_string({"dirpath", "the folder of the saves; \"\": the run's checkpoints/"}, "")),
        filename_(o.get_string(
            {"filename", "the save's name, e.g. \"{epoch}-{val_loss:.3f}\"; default \"{step}\" = step=N.ckpt"},
            "{step}")),
        monitor_(
            o.get_string({"monitor", "the logged metric that ranks saves for save_top_k; \"\": the newest saves"}, "")),
        mode_(o.get_choice({"mode", "min: lower monitor is better; max: higher is better"}, "min", {"min", "max"})),
        save_top_k_(o.get_int({"save_top_k", "keep the k best saves; -1: all, 0: none"}, 1, -1)),
        every_n_train_steps_(o.get_int({"every_n_train_steps", "save every N optimizer steps; 0: off"}, 0, 0)),
        train_time_interval_s_(read_duration(
            o,
            {"train_time_interval", "save every \"DD:HH:MM:SS\" or seconds of training (by rank 0's clock); 0: off"})),
        every_n_epochs_(
            o.get_int({"every_n_epochs",
                       "save at the end of every Nth epoch; 0: off (default 1 without a step or time interval)"},
                      every_n_train_steps_ > 0 || train_time_interval_s_ > 0 ? 0 : 1, 0)),
        save_last_(o.get_bool({"save_last", "keep last.ckpt pointing at the newest save"}, false)),
        save_weights_only_(o.get_bool(
            {"save_weights_only",
             "weights, step and callbacks' state only: validate/test/predict load it, fit cannot resume from it"},
            false)),
        auto_insert_metric_name_(
            o.get_bool({"auto_insert_metric_name", "filename's {val_loss} becomes val_loss=0.123"}, true)) {
    TESSERA_CHECK(!monitor_.empty() || save_top_k_ <= 1, o.locate("save_top_k"), " = ", save_top_k_,
                  " needs a monitor: without [", o.section(), "] monitor the latest checkpoint is kept (1), all (-1) or ",
                  "none (0)");
    TESSERA_CHECK(train_time_interval_s_ == 0 || (every_n_train_steps_ == 0 && every_n_epochs_ == 0),
                  o.locate("train_time_interval"), " and ",
                  o.locate(every_n_train_steps_ > 0 ? "every_n_train_steps" : "every_n_epochs"),
                  " both say when to save: keep one (as Lightning's ModelCheckpoint)");
    TESSERA_CHECK(filename_.find('/') == std::string::npos, o.locate("filename"),
                  " is a file name template (e.g. \"{epoch}-{val_loss:.3f}\"), not a path: use dirpath for the folder");
  }

  void setup(sdk::Trainer& trainer, const std::string&) override {
    if (dirpath_.empty()) dirpath_ = trainer.log_dir() + "/checkpoints";
  }

  void on_train_start(sdk::Trainer&) override { interval_start_ = Clock::now(); }

  void on_train_batch_end(sdk::Trainer& trainer, const sdk::StepOutput&, const sdk::Batch&, std::int64_t) override {
    std::int64_t step = trainer.global_step();
    if (every_n_train_steps_ > 0 && step % every_n_train_steps_ == 0 && step != last_saved_step_) save(trainer);
    if (train_time_interval_s_ > 0 && interval_elapsed(trainer) && step != last_saved_step_) {
      save(trainer);
      interval_start_ = Clock::now();
    }
  }

  void on_train_epoch_end(sdk::Trainer& trainer) override {
    // current_epoch() is the next epoch by now: it counts the epochs done.
    if (every_n_epochs_ > 0 && trainer.current_epoch() % every_n_epochs_ == 0 &&
        trainer.global_step() != last_saved_step_)
      save(trainer);
  }

  void on_train_end(sdk::Trainer& trainer) override {
    if (save_last_ && trainer.global_step() != last_written_last_) save_last(trainer);
  }

  std::string state_key() const override { return "ModelCheckpoint{monitor=" + monitor_ + ",mode=" + mode_ + "}"; }

  sdk::Checkpoint state_dict() const override {
    sdk::Checkpoint state = sdk::make_checkpoint();
    state.insert("dirpath", dirpath_);
    state.insert("monitor", monitor_);
    state.insert("best_model_path", best_path());
    state.insert("best_model_score", best_score());
    sdk::Checkpoint kept = sdk::make_checkpoint();
    for (const auto& [path, score] : kept_) kept.insert(path, score);
    state.insert("best_k_models", kept);
    return state;
  }

  void load_state_dict(const sdk::Checkpoint& state) override {
    // Only a run that writes into the same folder takes over the saved top-k (as Lightning).
    if (!state.contains("dirpath") || state.at("dirpath").toStringRef() != dirpath_) return;
    for (const auto& item : state.at("best_k_models").toGenericDict())
      if (std::filesystem::exists(item.key().toStringRef())) kept_[item.key().toStringRef()] = item.value().toDouble();
  }

 private:
  std::string best_path() const {
    auto best = best_entry();
    return best ? best->first : "";
  }
  double best_score() const {
    auto best = best_entry();
    return best && !monitor_.empty() ? best->second : NAN;  // without a monitor there is no score
  }
  /// By the monitored metric; without a monitor the latest save (its value is the step), as
  /// Lightning's best_model_path.
  std::optional<std::pair<std::string, double>> best_entry() const {
    std::optional<std::pair<std::string, double>> best;
    for (const auto& entry : kept_)
      if (!best || (monitor_.empty() ? entry.second > best->second : is_better(entry.second, best->second, mode_)))
        best = entry;
    return best;
  }
  std::optional<std::pair<std::string, double>> worst_entry() const {
    std::optional<std::pair<std::string, double>> worst;
    for (const auto& entry : kept_)
      if (!worst || is_better(worst->second, entry.second, mode_)) worst = entry;
    return worst;
  }

  /// Whether train_time_interval has passed since training started or the last timed save, by
  /// rank 0's clock: the ranks' clocks cross it at different steps and a save is collective,
  /// so every rank takes rank 0's answer (a one-element broadcast per step, as Lightning's).
  bool interval_elapsed(sdk::Trainer& trainer) {
    const double seconds = std::chrono::duration<double>(Clock::now() - interval_start_).count();
    at::Tensor due = at::full({1}, seconds >= train_time_interval_s_ ? 1.0f : 0.0f,
                              at::TensorOptions().device(trainer.strategy().root_device()));
    trainer.strategy().broadcast(due, 0);
    return due.item<float>() > 0;
  }

  void write(sdk::Trainer& trainer, const std::string& path) {
    trainer.save_checkpoint(path, save_weights_only_);
  }

  /// `{name}` or `{name:.3f}` -> "name=value" (or just the value without auto insert).
  std::string format_name(sdk::Trainer& trainer) const {
    std::map<std::string, double> values = trainer.callback_metrics();
    values["step"] = static_cast<double>(trainer.global_step());
    values["epoch"] = static_cast<double>(trainer.current_epoch());
    static const std::regex field(R"(\{([A-Za-z0-9_/.\-]+)(:[^}]*)?\})");
    std::string out, rest = filename_;
    std::smatch m;
    while (std::regex_search(rest, m, field)) {
      std::string name = m[1], spec = m[2].matched ? m[2].str().substr(1) : "";
      auto it = values.find(name);
      TESSERA_CHECK(it != values.end(), "[callbacks] model_checkpoint filename \"", filename_, "\" names {", name,
                    "}, which is not a logged metric at step ", trainer.global_step(), " (logged: step, epoch",
                    [&] { std::string s; for (const auto& [k, v] : trainer.callback_metrics()) s += ", " + k; return s; }(),
                    ")");
      char buffer[64];
      bool integer = name == "step" || name == "epoch";
      if (spec.empty()) std::snprintf(buffer, sizeof(buffer), integer ? "%.0f" : "%.4g", it->second);
      else std::snprintf(buffer, sizeof(buffer), ("%" + spec).c_str(), it->second);
      out += m.prefix().str() + (auto_insert_metric_name_ ? name + "=" : "") + buffer;
      rest = m.suffix();
    }
    return out + rest + ".ckpt";
  }

  void save(sdk::Trainer& trainer) {
    last_saved_step_ = trainer.global_step();
    if (save_top_k_ != 0) {
      std::optional<double> score;
      if (!monitor_.empty()) {
        auto it = trainer.callback_metrics().find(monitor_);
        if (it == trainer.callback_metrics().end()) {
          if (!warned_) trainer.print("ModelCheckpoint: the monitored metric '" + monitor_ + "' is not logged yet at step " +
                                      std::to_string(trainer.global_step()) + "; no top-k checkpoint until it is");
          warned_ = true;
        } else {
          score = it->second;
        }
      }
      if (monitor_.empty() || score) save_top_k(trainer, score);
    }
    if (save_last_) save_last(trainer);
  }

  void save_top_k(sdk::Trainer& trainer, std::optional<double> score) {
    std::string path = dirpath_ + "/" + format_name(trainer);
    double value = score.value_or(static_cast<double>(trainer.global_step()));
    if (score && save_top_k_ > 0 && static_cast<std::int64_t>(kept_.size()) >= save_top_k_ &&
        !is_better(value, worst_entry()->second, mode_))
      return;  // not among the best k
    // Recorded before the save, so that the checkpoint's own callback state counts it (its
    // best_model_path may be itself, as in Lightning's); undone if the save fails.
    const std::optional<double> before = kept_.count(path) ? std::optional<double>(kept_.at(path)) : std::nullopt;
    kept_[path] = value;
    try {
      write(trainer, path);
    } catch (...) {
      if (before) kept_[path] = *before;
      else kept_.erase(path);
      throw;
    }
    // Pruned only now that the new checkpoint is saved: a crash never leaves fewer than k.
    while (save_top_k_ > 0 && static_cast<std::int64_t>(kept_.size()) > save_top_k_) {
      auto worst = score ? worst_entry()->first
                         : std::min_element(kept_.begin(), kept_.end(), [](const auto& a, const auto& b) {
                             return a.second < b.second;  // without a monitor: the oldest step goes
                           })->first;
      kept_.erase(worst);
      if (worst != path) trainer.remove_checkpoint(worst);
    }
  }

  void save_last(sdk::Trainer& trainer) {
    write(trainer, dirpath_ + "/last.ckpt");
    last_written_last_ = trainer.global_step();
  }

  using Clock = std::chrono::steady_clock;
  std::string dirpath_, filename_, monitor_, mode_;
  std::int64_t save_top_k_, every_n_train_steps_;
  double train_time_interval_s_;  ///< 0: none
  std::int64_t every_n_epochs_;
  Clock::time_point interval_start_ = Clock::now();
  bool save_last_, save_weights_only_, auto_insert_metric_name_;
  std::map<std::string, double> kept_;  ///< path -> monitored score (or step without a monitor)
  std::int64_t last_saved_step_ = -1, last_written_last_ = -1;
  bool warned_ = false;
};

}  // namespace

std::shared_ptr<sdk::Callback> make_model_checkpoint(const sdk::Options& options) {
  return std::make_shared<ModelCheckpoint>(options);
}

}  // namespace tessera::host
