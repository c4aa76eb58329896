#pragma once
// What the FSDP engine tests share (fsdp_test.cpp, fsdp_deferred_init_test.cpp,
// fsdp_binary_test.cpp): a three-unit net with a weight tied across units, its unsharded
// reference, and the world of a rank.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "multiprocess.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/sdk/unit.hpp"

namespace tessera::core::fsdp {
// ctest lists a layout case by its name, not by GoogleTest's dump of the enum's bytes (found by
// argument-dependent lookup, so in the enum's namespace).
inline void PrintTo(ParamLayout layout, std::ostream* os) {
  *os << (layout == ParamLayout::flat ? "flat" : "per_parameter");
}
}  // namespace tessera::core::fsdp

namespace fsdp_test {

namespace core = tessera::core;
namespace fsdp = tessera::core::fsdp;
namespace sdk = tessera::sdk;

inline constexpr std::int64_t kWidth = 13;  // 13*13+13 = 182 parameters per Linear: indivisible by 3 and 4

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t width, torch::nn::Linear shared_linear, bool bias = true) : torch::nn::Module("Block") {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(bias)));
    if (shared_linear) shared = register_module("shared", shared_linear);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = at::tanh(fc(x));
    return shared ? y + 0.5 * shared(x) : y;
  }
  torch::nn::Linear fc{nullptr}, shared{nullptr};
};
TORCH_MODULE(Block);

/// Three units; b1 and b3 share one Linear (a tied weight used by two different units);
/// head stays in the root (or is ignored).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool b2_bias = true) : torch::nn::Module("Net") {
    torch::nn::Linear tied(kWidth, kWidth);
    b1 = register_module("b1", Block(kWidth, tied));
    b2 = register_module("b2", Block(kWidth, nullptr, b2_bias));
    b3 = register_module("b3", Block(kWidth, tied));
    head = register_module("head", torch::nn::Linear(kWidth, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    return head(sdk::invoke(b3, sdk::invoke(b2, sdk::invoke(b1, x))));
  }
  Block b1{nullptr}, b2{nullptr}, b3{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

inline constexpr std::int64_t kBatch = 12;  // global batch: divisible by 1, 2, 3, 4

inline at::Tensor inputs(int step) {
  at::Generator g = at::detail::createCPUGenerator(100 + step);
  return at::randn({kBatch, kWidth}, g);
}
inline at::Tensor targets(int step) {
  at::Generator g = at::detail::createCPUGenerator(200 + step);
  return at::randn({kBatch, 3}, g);
}

inline torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(0.02).weight_decay(0.1); }

/// Freezes b2 and head (requires_grad false), as a fine-tuning model would.
inline void freeze_b2_and_head(Net& net) {
  for (auto& p : net->b2->parameters()) p.requires_grad_(false);
  for (auto& p : net->head->parameters()) p.requires_grad_(false);
}

/// The unsharded reference: full batch, one process.
inline std::map<std::string, at::Tensor> reference_after(int steps, bool frozen_b2_and_head = false) {
  torch::manual_seed(7);
  Net net;
  if (frozen_b2_and_head) freeze_b2_and_head(net);
  std::vector<at::Tensor> params;
  std::set<const void*> seen;  // named_parameters() lists the tied weight under both names
  for (const auto& p : net->parameters())
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  torch::optim::AdamW optimizer(params, adamw());
  for (int s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    (net->forward(inputs(s)) - targets(s)).pow(2).mean().backward();
    optimizer.step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : net->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

inline core::CommunicatorPtr world(const sdk::ClusterInfo& cluster) {
  return cluster.world_size == 1 ? core::make_local_communicator() : core::make_communicator(cluster, c10::kCPU);
}

inline fsdp::FSDPOptions unit_options() {
  fsdp::FSDPOptions o;
  o.unit_classes = {"Block"};
  o.rank0_only = false;
  return o;
}

/// One FSDP training step on this rank's rows of the global batch.
inline void train_step(fsdp::ShardedModule& sharded, Net& net, torch::optim::Optimizer& optimizer, int step,
                const sdk::ClusterInfo& cluster) {
  const std::int64_t rows = kBatch / cluster.world_size, first = rows * cluster.global_rank;
  sharded.begin_forward(/*training=*/true);
  at::Tensor loss = (net->forward(inputs(step).narrow(0, first, rows)) - targets(step).narrow(0, first, rows)).pow(2).mean();
  sharded.begin_backward(/*sync=*/true);
  loss.backward();
  sharded.finish_backward();
  optimizer.step();
  sharded.after_optimizer_step();
}

inline std::vector<at::Tensor> tensors_of(const std::vector<sdk::NamedParameter>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}

inline void expect_matches(const sdk::StateDict& state, const std::map<std::string, at::Tensor>& reference, double tol,
                    const std::string& what) {
  ASSERT_EQ(static_cast<std::size_t>(state.size()), reference.size()) << what;
  for (const auto& [name, value] : reference) {
    const at::Tensor* got = state.find(name);
    ASSERT_NE(got, nullptr) << what << ": no " << name;
    EXPECT_TRUE(at::allclose(*got, value, tol, tol)) << what << ": " << name << " differs by "
                                                     << (*got - value).abs().max().item<double>();
  }
}

}  // namespace fsdp_test
