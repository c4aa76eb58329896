#include "train/model_summary.hpp"

#include <cstdio>
#include <vector>

#include <ATen/ATen.h>

#include "tessera/sdk/sharded.hpp"

namespace tessera::host {

namespace {

std::string human(double value, const char* const* units) {
  int i = 0;
  while (value >= 1000 && units[i + 1] != nullptr) value /= 1000, ++i;
  char out[32];
  std::snprintf(out, sizeof(out), i == 0 ? "%.0f %s" : "%.1f %s", value, units[i]);
  std::string text = out;
  return text.back() == ' ' ? text.substr(0, text.size() - 1) : text;
}
std::string count(double n) {
  static const char* const units[] = {"", "K", "M", "B", nullptr};
  return human(n, units);
}
std::string bytes(double n) {
  static const char* const units[] = {"B", "kB", "MB", "GB", "TB", nullptr};
  return human(n, units);
}

std::int64_t numel(const std::vector<at::Tensor>& tensors) {
  std::int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

}  // namespace

std::string model_summary(sdk::Module& model, sdk::Strategy& strategy, const sdk::OptimizerSettings& optimizer) {
  auto network = model.network();
  std::vector<std::vector<std::string>> rows = {{"", "Name", "Type", "Params"}};
  std::int64_t index = 0;
  for (const auto& child : network->named_children())
    rows.push_back({std::to_string(index++), child.key(), child.value()->name(), count(numel(child.value()->parameters()))});
  std::int64_t own = numel(network->parameters(/*recurse=*/false));
  if (own > 0) rows.push_back({std::to_string(index++), "(root)", network->name(), count(own)});
  std::int64_t total = 0, trainable = 0;
  for (const auto& p : network->parameters()) total += p.numel(), trainable += p.requires_grad() ? p.numel() : 0;

  // What this rank's optimizer steps on (shards under FSDP): its parameters, their
  // gradients and the optimizer's state (Adam keeps two moments, SGD with momentum one).
  double param_bytes = 0;
  for (const auto& group : strategy.optimizer().param_groups())
    for (const auto& p : group.params()) param_bytes += static_cast<double>(p.numel() * p.element_size());
  double moments = optimizer.name == "sgd" ? (optimizer.momentum > 0 ? 1 : 0) : 2;
  at::Tensor per_rank = at::tensor(std::vector<double>{param_bytes}, at::kDouble).to(at::kFloat);
  per_rank = strategy.reduce(per_rank.to(strategy.root_device()), sdk::ReduceOp::max).to(at::kCPU);
  param_bytes = per_rank[0].item<double>();

  std::vector<std::size_t> width(4, 0);
  for (const auto& row : rows)
    for (std::size_t c = 0; c < 4; ++c) width[c] = std::max(width[c], row[c].size());
  std::string out;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (std::size_t c = 0; c < 4; ++c) {
      std::string cell = rows[r][c];
      out += (c ? " | " : "  ") + cell + std::string(width[c] - cell.size(), ' ');
    }
    out += "\n";
    if (r == 0) out += "  " + std::string(width[0] + width[1] + width[2] + width[3] + 9, '-') + "\n";
  }
  out += "  " + count(static_cast<double>(trainable)) + " trainable params, " +
         count(static_cast<double>(total - trainable)) + " non-trainable, " + count(static_cast<double>(total)) +
         " total\n";
  // The sharding plan: each unit with the parameters it gathers (those under its path that no
  // deeper unit holds; the root unit holds the rest).
  if (sdk::sharded_model(*network) != nullptr) {
    const std::vector<std::string> units = sdk::fsdp_modules(*network);
    std::vector<double> held(units.size(), 0);
    for (const auto& p : network->named_parameters()) {
      std::size_t owner = units.size(), depth = 0;
      for (std::size_t u = 0; u < units.size(); ++u) {
        const std::string& path = units[u];
        bool under = path.empty() || p.key().rfind(path + ".", 0) == 0;
        if (under && (owner == units.size() || path.size() + 1 > depth)) owner = u, depth = path.size() + 1;
      }
      if (owner < units.size()) held[owner] += static_cast<double>(p.value().numel());
    }
    out += "  sharding units (" + std::to_string(units.size()) + ", forward order):";
    for (std::size_t u = 0; u < units.size(); ++u)
      out += (u ? ", " : " ") + (units[u].empty() ? std::string("<root>") : units[u]) + " " + count(held[u]);
    out += "\n";
  }
  out += "  per rank (max over " + std::to_string(strategy.world_size()) + "): parameters " + bytes(param_bytes) +
         ", gradients " + bytes(param_bytes) + ", optimizer state " + bytes(moments * param_bytes) + " (" +
         optimizer.name + ")";
  return out;
}

}  // namespace tessera::host
