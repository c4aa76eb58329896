#include "train/anomaly.hpp"

#include <algorithm>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/sharded.hpp"

namespace tessera::host {
namespace {

std::string ranks_of(const at::Tensor& flags) {
  std::vector<std::string> ranks;
  for (std::int64_t r = 0; r < flags.numel(); ++r)
    if (flags[r].item<double>() > 0) ranks.push_back(std::to_string(r));
  return "[" + sdk::join(ranks) + "]";
}

// The sharding unit that holds `name`: the longest unit path that prefixes it; the root otherwise.
std::string unit_of(const std::string& name, const std::vector<std::string>& units) {
  std::string best;
  for (const auto& u : units)
    if (!u.empty() && u.size() > best.size() && name.compare(0, u.size() + 1, u + ".") == 0) best = u;
  return best.empty() ? "<root>" : best;
}

// Rare path, collective: every parameter's full reduced gradient (summoned from the shards),
// its NaN and Inf counts agreed over ranks, and the one where the trouble appeared first in
// backward: the last in the network's registration order, which follows the forward order.
std::string trace_gradient(sdk::Strategy& strategy, sdk::Module& module) {
  auto network = module.network();
  sdk::SummonOptions options;
  options.writeback = false;
  options.with_grads = true;
  sdk::GuardPtr full = sdk::summon_full_params(*network, options);
  const auto named = network->named_parameters();
  std::vector<at::Tensor> counts;
  for (const auto& item : named) {
    const at::Tensor& g = item.value().grad();
    counts.push_back(g.defined() ? at::stack({at::isnan(g).sum(), at::isinf(g).sum()}).to(at::kFloat)
                                 : at::zeros({2}, at::TensorOptions().dtype(at::kFloat).device(strategy.root_device())));
  }
  if (counts.empty()) return "";
  at::Tensor agreed = strategy.reduce(at::stack(counts), sdk::ReduceOp::max).to(at::kCPU);
  const std::vector<std::string> units = sdk::fsdp_modules(*network);
  std::vector<std::string> bad_units, bad_params;
  std::string origin;
  for (std::size_t i = 0; i < named.size(); ++i) {
    const double nans = agreed[static_cast<std::int64_t>(i)][0].item<double>();
    const double infs = agreed[static_cast<std::int64_t>(i)][1].item<double>();
    if (nans + infs == 0) continue;
    const std::string& name = named[i].key();
    const std::string unit = unit_of(name, units);
    if (std::find(bad_units.begin(), bad_units.end(), unit) == bad_units.end()) bad_units.push_back(unit);
    bad_params.push_back(name);
    origin = (units.size() > 1 ? "unit '" + unit + "', " : std::string()) + "parameter '" + name + "' (" + std::to_string(static_cast<std::int64_t>(nans)) +
             " NaN, " + std::to_string(static_cast<std::int64_t>(infs)) + " Inf of " +
             std::to_string(named[i].value().numel()) + " elements)";
  }
  if (bad_params.empty()) return "";
  return "it appeared first in backward in " + origin + "; " + std::to_string(bad_params.size()) +
         " parameter(s) have non-finite gradients" +
         (units.size() > 1 ? ", in unit(s) [" + sdk::join(bad_units) + "]" : std::string());
}

}  // namespace

AnomalyReport check_finite_step(sdk::Strategy& strategy, sdk::Module& module, const at::Tensor& loss,
                                std::int64_t rank, std::int64_t world) {
  strategy.precision().unscale_gradients(strategy.optimizer(), strategy);
  const c10::Device device = strategy.root_device();
  std::vector<at::Tensor> finite{at::isfinite(loss.detach().to(device)).all()};
  for (const auto& group : strategy.optimizer().param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined() && p.grad().numel() > 0) finite.push_back(at::isfinite(p.grad()).all());
  at::Tensor mine = at::zeros({2, world}, at::TensorOptions().dtype(at::kFloat).device(device));
  mine[0][rank] = at::logical_not(finite[0]).to(at::kFloat);
  mine[1][rank] = at::logical_not(at::stack(finite).slice(0, 1).all()).to(at::kFloat);
  const at::Tensor flags = strategy.reduce(mine, sdk::ReduceOp::max).to(at::kCPU);
  AnomalyReport report;
  if (flags.sum().item<double>() == 0) return report;
  report.finite = false;
  const bool loss_bad = flags[0].sum().item<double>() > 0, grads_bad = flags[1].sum().item<double>() > 0;
  // A grad scaler expects the odd inf/NaN: it skips the step and lowers the scale.
  report.scaler_skips = strategy.precision().state_dict().contains("scale");
  if (report.scaler_skips) {
    report.message = std::string("non-finite ") + (loss_bad ? "loss" : "gradients") + " on rank(s) " +
                     ranks_of(flags[loss_bad ? 0 : 1]);
    return report;
  }
  std::string where = grads_bad ? trace_gradient(strategy, module) : "";
  report.message = std::string(loss_bad ? "the loss is NaN/Inf on rank(s) " + ranks_of(flags[0])
                                        : "NaN/Inf gradient before the optimizer step") +
                   (grads_bad ? "; reduced gradient shards are non-finite on rank(s) " + ranks_of(flags[1]) : "") +
                   (where.empty() ? "" : "; " + where) +
                   ". The optimizer did not step, so the weights and the last checkpoint are untouched; look for a "
                   "log of 0, a division by zero or an overflow there, or lower the learning rate / clip gradients";
  return report;
}

}  // namespace tessera::host
