#include "train/lr_find.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include <ATen/ATen.h>

#include "loggers/record_file.hpp"
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
  std::ostringstream out;
  out << "step,lr,loss,smoothed_loss\n" << std::setprecision(10);
  for (std::int64_t i = 0; i < steps(); ++i)
    out << i << "," << lr(i) << "," << losses_[i] << "," << smoothed_[i] << "\n";
  write_record(path, out.str());
}

std::string LrRangeTest::plot(int width, int height) const {
  const std::int64_t n = steps();
  if (n < 2) return "";
  // y from the lowest smoothed loss to the first one (a loss that diverges goes off the top).
  double low = smoothed_[0], high = smoothed_[0];
  for (double v : smoothed_)
    if (std::isfinite(v)) low = std::min(low, v);
  if (!(high > low)) high = low + 1.0;
  const int columns = static_cast<int>(std::min<std::int64_t>(width, n));
  const std::optional<std::int64_t> best = suggestion();
  auto column_of = [&](std::int64_t step) {
    return static_cast<int>(std::llround(static_cast<double>(step) * (columns - 1) / static_cast<double>(n - 1)));
  };
  std::vector<std::string> grid(static_cast<std::size_t>(height), std::string(static_cast<std::size_t>(columns), ' '));
  for (std::int64_t step = 0; step < n; ++step) {
    const double v = smoothed_[static_cast<std::size_t>(step)];
    const int row = !std::isfinite(v) || v > high
                        ? 0
                        : static_cast<int>(std::llround((high - v) / (high - low) * (height - 1)));
    char& cell = grid[static_cast<std::size_t>(row)][static_cast<std::size_t>(column_of(step))];
    const char mark = best && step == *best ? 'o' : !std::isfinite(v) || v > high ? '^' : '*';
    if (cell != 'o') cell = mark;
  }
  auto number = [](double v) {
    std::ostringstream out;
    out << std::setprecision(3) << v;
    return out.str();
  };
  const std::string top = number(high), bottom = number(low);
  const std::size_t margin = std::max(top.size(), bottom.size());
  std::ostringstream out;
  for (int row = 0; row < height; ++row) {
    const std::string label = row == 0 ? top : row == height - 1 ? bottom : "";
    out << std::string(margin - label.size(), ' ') << label << " |" << grid[static_cast<std::size_t>(row)] << "\n";
  }
  out << std::string(margin + 1, ' ') << '+' << std::string(static_cast<std::size_t>(columns), '-') << "\n";
  const std::string left = number(lr(0)), right = number(lr(n - 1));
  const std::string axis = settings_.mode == "linear" ? "lr" : "lr (log scale)";
  const int gap = std::max(1, columns - static_cast<int>(left.size() + right.size()));
  std::string under = left + std::string(static_cast<std::size_t>(gap), ' ') + right;
  const std::size_t middle = (under.size() - axis.size()) / 2;
  if (under.size() > axis.size() + 2 &&
      under.substr(middle - 1, axis.size() + 2).find_first_not_of(' ') == std::string::npos)
    under.replace(middle, axis.size(), axis);
  out << std::string(margin + 2, ' ') << under;
  if (best)
    out << "\n" << std::string(margin + 2 + static_cast<std::size_t>(column_of(*best)), ' ') << "^ o: suggested lr "
        << number(lr(*best));
  return out.str();
}

}  // namespace tessera::host
