// CPU cost of the FSDP engine's per-unit work (gather/free bookkeeping, the unit runner, the
// pre-backward function, grad-accumulator hooks, reduce and re-attach) on one rank: a model
// of many tiny units trained with and without ShardedModule, reported per unit and per
// parameter tensor. Tiny units make compute negligible, so the difference is the overhead.
//   build/bin/fsdp_overhead_bench [units] [steps]
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "tessera/core/comm.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/sdk/unit.hpp"

namespace {

namespace fsdp = tessera::core::fsdp;

struct UnitImpl : torch::nn::Module {
  UnitImpl() : torch::nn::Module("Unit") {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return b(a(x)); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Unit);

struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(int n) {
    for (int i = 0; i < n; ++i) units.push_back(register_module("u" + std::to_string(i), Unit()));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& u : units) x = tessera::sdk::invoke(u, x);
    return x;
  }
  std::vector<Unit> units;
};
TORCH_MODULE(Chain);

/// Seconds per training step of `net`, with the engine driving it when `sharded` is set.
double seconds_per_step(Chain& net, fsdp::ShardedModule* sharded, std::vector<at::Tensor> params, int steps) {
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(1e-3));
  at::Tensor x = at::randn({2, 4});
  auto step = [&] {
    if (sharded) sharded->begin_forward(true);
    at::Tensor loss = net->forward(x).sum();
    if (sharded) sharded->begin_backward(true);
    loss.backward();
    if (sharded) sharded->finish_backward();
    optimizer.step();
    if (sharded) sharded->after_optimizer_step();
    else optimizer.zero_grad();
  };
  for (int i = 0; i < 5; ++i) step();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
}

}  // namespace

int main(int argc, char** argv) {
  const int units = argc > 1 ? std::atoi(argv[1]) : 64;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 200;
  at::set_num_threads(1);
  Chain plain(units);
  double base = seconds_per_step(plain, nullptr, plain->parameters(), steps);
  std::printf("engine overhead, %d units of 4 parameter tensors, one rank; plain step %.1f us:\n", units, base * 1e6);
  // fsdp's flat layout gathers in place; fsdp2's per-parameter one copies each unit out of
  // the all-gather's buffer and its gradients into the reduce-scatter's (copy-out/copy-in).
  for (auto layout : {fsdp::ParamLayout::flat, fsdp::ParamLayout::per_parameter}) {
    Chain net(units);
    fsdp::FSDPOptions options;
    options.unit_classes = {"Unit"};
    options.layout = layout;
    auto comm = tessera::core::make_local_communicator();
    fsdp::ShardedModule sharded(net.ptr(), options, comm, comm);
    std::vector<at::Tensor> shards;
    for (const auto& p : sharded.optimizer_parameters()) shards.push_back(p.tensor);
    double with = seconds_per_step(net, &sharded, shards, steps);
    const double per_unit = (with - base) / units * 1e6;
    std::printf("  %-28s step %.1f us (%.2fx plain): %.2f us per unit, %.2f us per parameter tensor\n",
                layout == fsdp::ParamLayout::flat ? "fsdp (flat parameters)" : "fsdp2 (per-parameter)", with * 1e6,
                with / base, per_unit, per_unit / 4);
  }
  return 0;
}
