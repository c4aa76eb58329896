#pragma once
// The learning-rate range test behind `tessera lr-find` (Lightning's Tuner.lr_find, after
// Smith, "Cyclical Learning Rates for Training Neural Networks"): train for a number of steps
// while the learning rate rises from min_lr to max_lr, follow a smoothed loss, stop once it
// diverges, and suggest the learning rate where it fell the fastest.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace tessera::host {

class LrRangeTest {
 public:
  explicit LrRangeTest(const LrFindSettings& settings);

  /// The learning rate of step `step` (0-based): min_lr at the first, max_lr at the last, in
  /// between on a geometric (exponential) or arithmetic (linear) progression.
  double lr(std::int64_t step) const;

  /// Records the global loss of the next step, trained at lr(steps()). Returns false when the
  /// test should stop: the smoothed loss is not finite, or above early_stop_threshold x its best.
  bool record(double loss);

  std::int64_t steps() const { return static_cast<std::int64_t>(losses_.size()); }
  const std::vector<double>& losses() const { return losses_; }
  const std::vector<double>& smoothed() const { return smoothed_; }

  /// The step whose learning rate is suggested: the steepest fall of the smoothed loss against
  /// log(lr) (the learning rate itself in linear mode), skipping the first 10 steps and the last
  /// as Lightning's suggestion() does; none when fewer than 2 finite points remain.
  std::optional<std::int64_t> suggestion() const;

  /// step,lr,loss,smoothed_loss: one line per step.
  void write_csv(const std::string& path) const;

  /// The smoothed loss against lr as text (`width` x `height` cells, axes and the suggestion
  /// below; Lightning's plot()): '*' the curve, 'o' the suggested point, '^' a value above the
  /// top (the first step's loss: a divergence beyond it is clipped); "" before 2 steps.
  std::string plot(int width = 60, int height = 10) const;

 private:
  LrFindSettings settings_;
  std::vector<double> losses_, smoothed_;
  double average_ = 0.0;  ///< the losses' exponential moving average, before bias correction
  double best_ = 0.0;
};

}  // namespace tessera::host
