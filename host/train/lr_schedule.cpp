#include "train/lr_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

LRSchedule::LRSchedule(const ScheduleSettings& settings, double base_lr, std::int64_t total_steps)
    : settings_(settings), base_lr_(base_lr), total_steps_(total_steps) {}

double LRSchedule::lr(std::int64_t step) const {
  const auto& s = settings_;
  if (step < s.warmup_steps) return base_lr_ * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  if (s.schedule == "constant" || total_steps_ <= s.warmup_steps) return base_lr_;
  double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) /
                                      static_cast<double>(total_steps_ - s.warmup_steps));
  if (s.schedule == "linear") return s.min_lr + (base_lr_ - s.min_lr) * (1.0 - progress);
  return s.min_lr + 0.5 * (base_lr_ - s.min_lr) * (1.0 + std::cos(M_PI * progress));
}

sdk::Checkpoint LRSchedule::state_dict(std::int64_t steps_done) const {
  sdk::Checkpoint state = sdk::make_checkpoint();
  c10::List<double> base_lrs({base_lr_});
  c10::List<double> last_lr({lr(std::max<std::int64_t>(0, steps_done - 1))});
  state.insert("base_lrs", base_lrs);
  state.insert("last_epoch", steps_done);
  state.insert("_last_lr", last_lr);
  state.insert("schedule", settings_.schedule);
  state.insert("warmup_steps", settings_.warmup_steps);
  state.insert("min_lr", settings_.min_lr);
  state.insert("total_steps", total_steps_);
  return state;
}

std::string LRSchedule::compare(const sdk::Checkpoint& state, std::int64_t steps_done, const std::string& where) const {
  auto get = [&](const char* key) { return core::checkpoint_get(state, key); };
  TESSERA_CHECK(get("last_epoch").toInt() == steps_done, where, " last_epoch = ", get("last_epoch").toInt(),
                " disagrees with the checkpoint's global_step = ", steps_done, ": the checkpoint is inconsistent");
  std::ostringstream changes;
  auto note = [&](const char* key, const auto& saved, const auto& now) {
    if (saved != now) changes << " " << key << " " << saved << " -> " << now << ";";
  };
  note("lr", get("base_lrs").toDoubleList().get(0), base_lr_);
  note("schedule", get("schedule").toStringRef(), settings_.schedule);
  note("warmup_steps", get("warmup_steps").toInt(), settings_.warmup_steps);
  note("min_lr", get("min_lr").toDouble(), settings_.min_lr);
  note("total_steps", get("total_steps").toInt(), total_steps_);
  std::string text = changes.str();
  if (text.empty()) return "";
  text.pop_back();
  return where + ": the configured learning-rate schedule differs from the checkpoint's (" + text.substr(1) +
         "); the configured one applies from step " + std::to_string(steps_done);
}

}  // namespace tessera::host
