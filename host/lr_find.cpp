#include "lr_find.hpp"

#include <cmath>
#include <fstream>
#include <iomanip>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {
constexpr double kBeta = 0.98;          // the smoothing's forget rate (Lightning's _LRCallback)
constexpr std::int64_t kSkipBegin = 10;  // the suggestion ignores the noisy start ...
constexpr std::int64_t kSkipEnd = 1;     // ... and the last step, often the divergence itself
}  // namespace

LrRangeTest::LrRangeTest(const LrFindSettings& settings) : settings_(settings) {}

double LrRangeTest::lr(std::int64_t step) const {
  const double r = static_cast<double>(step) / static_cast<double>(settings_.num_training - 1);
  if (settings_.mode == "linear") return settings_.min_lr + r * (settings_.max_lr - settings_.min_lr);
  return settings_.min_lr * std::pow(settings_.max_lr / settings_.min_lr, r);
}

bool LrRangeTest::record(double loss) {
  losses_.push_back(loss);
  average_ = kBeta * average_ + (1 - kBeta) * loss;
  const double smoothed = average_ / (1 - std::pow(kBeta, static_cast<double>(losses_.size())));
  smoothed_.push_back(smoothed);
  if (!std::isfinite(smoothed)) return false;
  const bool diverged = settings_.early_stop_threshold > 0 && losses_.size() > 1 &&
                        smoothed > settings_.early_stop_threshold * best_;
  if (losses_.size() == 1 || smoothed < best_) best_ = smoothed;
  return !diverged;
}

std::optional<std::int64_t> LrRangeTest::suggestion() const {
  std::vector<double> lrs, losses;  // lrs: the curve's x axis
  std::vector<std::int64_t> steps;
  for (std::int64_t i = kSkipBegin; i < this->steps() - kSkipEnd; ++i) {
    if (!std::isfinite(smoothed_[i])) continue;
    lrs.push_back(settings_.mode == "linear" ? lr(i) : std::log(lr(i)));
    losses.push_back(smoothed_[i]);
    steps.push_back(i);
  }
  if (losses.size() < 2) return std::nullopt;
  // The slope of the curve as it is plotted: against log(lr) on an exponential range (fastai's
  // steepest point), against lr on a linear one; central differences inside, one-sided at the
  // ends (torch.gradient). Lightning takes d(loss)/d(lr) on either, which on an exponential
  // range divides the noise of the first, tiny steps by tinier lr differences and lands there.
  const at::Tensor gradient = at::gradient(at::tensor(losses, at::kDouble), {at::tensor(lrs, at::kDouble)})[0];
  return steps[static_cast<std::size_t>(gradient.argmin().item<std::int64_t>())];
}

void LrRangeTest::write_csv(const std::string& path) const {
  std::ofstream out(path);
  TESSERA_CHECK(out.good(), "cannot write ", path);
  out << "step,lr,loss,smoothed_loss\n" << std::setprecision(10);
  for (std::int64_t i = 0; i < steps(); ++i)
    out << i << "," << lr(i) << "," << losses_[i] << "," << smoothed_[i] << "\n";
  TESSERA_CHECK(out.good(), "cannot write ", path);
}

}  // namespace tessera::host
