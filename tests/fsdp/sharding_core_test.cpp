// The sharding core's seams on real ranks (Gloo on loopback) against an unsharded reference:
// units whose forward takes several arguments and returns several tensors, with dropout
// recomputed under activation checkpointing; the size and custom wrap policies and the error
// naming the classes a network has; summon_full_params / apply / fsdp_modules reached
// through the SDK (what model plugins and callbacks call), with and without gradients.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "multiprocess.hpp"
#include "tessera/sdk/autocast.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/fsdp.hpp"
#include "fsdp/wrap.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/sharded.hpp"
#include "tessera/sdk/unit.hpp"

namespace {

namespace core = tessera::core;
namespace fsdp = tessera::core::fsdp;
namespace sdk = tessera::sdk;
using tessera::testing::run_ranks;

constexpr std::int64_t kWidth = 11;  // 11*11+11 = 132 per Linear: not divisible by 5 or 7
constexpr std::int64_t kBatch = 12;  // divisible by 1, 2, 3, 4

/// A block taking (x, mask, scale) and returning (y, aux). Its dropout acts on the weight
/// (DropConnect), so the mask does not depend on how the batch is split across ranks and
/// every rank and the reference draw the same masks from the same seed.
struct GateBlockImpl : torch::nn::Module {
  explicit GateBlockImpl(std::int64_t width) : torch::nn::Module("GateBlock") {
    fc = register_module("fc", torch::nn::Linear(width, width));
    gate = register_module("gate", torch::nn::Linear(width, width));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& mask, double scale) {
    at::Tensor w = at::dropout(fc->weight, 0.3, is_training());
    at::Tensor y = at::tanh(at::linear(x, w, fc->bias)) * mask + scale * x;
    return {y, at::sigmoid(gate(x)).mean(1)};
  }
  torch::nn::Linear fc{nullptr}, gate{nullptr};
};
TORCH_MODULE(GateBlock);

struct GateNetImpl : torch::nn::Module {
  GateNetImpl() : torch::nn::Module("GateNet") {
    b1 = register_module("b1", GateBlock(kWidth));
    b2 = register_module("b2", GateBlock(kWidth));
    head = register_module("head", torch::nn::Linear(kWidth, 2));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) {
    auto [h1, a1] = sdk::invoke(b1, x, mask, 0.5);
    auto [h2, a2] = sdk::invoke(b2, h1, mask, 0.25);
    return head(h2) + (a1 + a2).unsqueeze(1);
  }
  GateBlock b1{nullptr}, b2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GateNet);

at::Tensor batch(int step, std::int64_t cols, int salt) {
  at::Generator g = at::detail::createCPUGenerator(1000 * salt + step);
  return at::randn({kBatch, cols}, g);
}
at::Tensor mask_for(int step) { return (batch(step, kWidth, 3) > -0.5).to(at::kFloat); }

at::Tensor loss_of(GateNet& net, int step, std::int64_t first, std::int64_t rows) {
  at::Tensor out = net->forward(batch(step, kWidth, 1).narrow(0, first, rows), mask_for(step).narrow(0, first, rows));
  return (out - batch(step, 2, 2).narrow(0, first, rows)).pow(2).mean();
}

constexpr int kSteps = 3;

std::map<std::string, at::Tensor> reference_after(int steps) {
  torch::manual_seed(11);
  GateNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    loss_of(net, s, 0, kBatch).backward();
    optimizer.step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : net->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

core::CommunicatorPtr world(const sdk::ClusterInfo& cluster) {
  return cluster.world_size == 1 ? core::make_local_communicator() : core::make_communicator(cluster, c10::kCPU);
}

std::vector<at::Tensor> tensors_of(const std::vector<sdk::NamedParameter>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}

void expect_matches(const sdk::StateDict& state, const std::map<std::string, at::Tensor>& reference, double tol) {
  ASSERT_EQ(static_cast<std::size_t>(state.size()), reference.size());
  for (const auto& [name, value] : reference) {
    const at::Tensor* got = state.find(name);
    ASSERT_NE(got, nullptr) << name;
    EXPECT_TRUE(at::allclose(*got, value, tol, tol)) << name << " differs by " << (*got - value).abs().max().item<double>();
  }
}

/// kSteps of SGD with momentum on this rank's rows of each batch, as reference_after() does.
void train(fsdp::ShardedModule& sharded, GateNet& net, const sdk::ClusterInfo& cluster) {
  torch::optim::SGD optimizer(tensors_of(sharded.optimizer_parameters()), torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::int64_t rows = kBatch / cluster.world_size, first = rows * cluster.global_rank;
  for (int s = 0; s < kSteps; ++s) {
    sharded.begin_forward(true);
    at::Tensor loss = loss_of(net, s, first, rows);
    sharded.begin_backward(true);
    loss.backward();
    sharded.finish_backward();
    optimizer.step();
    sharded.after_optimizer_step();
  }
}

class MultiArgUnits : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// Gradients reach both outputs of every unit and the tensor input of the second; with
// activation checkpointing the recomputation draws the same dropout masks as the forward.
TEST_P(MultiArgUnits, MatchTheUnshardedRunWithDropout) {
  const auto [n, checkpointed] = GetParam();
  const auto expected = reference_after(kSteps);
  run_ranks(n, std::chrono::seconds(120), [&, checkpointed = checkpointed](const sdk::ClusterInfo& cluster) {
    torch::manual_seed(11);
    GateNet net;
    fsdp::FSDPOptions options;
    options.unit_classes = {"GateBlock"};
    options.rank0_only = false;
    if (checkpointed) options.activation_checkpointing = {"GateBlock"};
    auto group = world(cluster);
    fsdp::ShardedModule sharded(net.ptr(), options, group, core::make_local_communicator());
    train(sharded, net, cluster);
    expect_matches(sharded.full_state_dict(), expected, 1e-5);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, MultiArgUnits,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(false, true)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks" +
                                  (std::get<1>(info.param) ? "Checkpointed" : "");
                         });

/// FSDP2's layout over the GateBlock units, full state dicts on every rank.
fsdp::FSDPOptions per_parameter_options(bool checkpointed) {
  fsdp::FSDPOptions options;
  options.layout = fsdp::ParamLayout::per_parameter;
  options.unit_classes = {"GateBlock"};
  options.rank0_only = false;
  if (checkpointed) options.activation_checkpointing = {"GateBlock"};
  return options;
}

class PerParameterLayout : public ::testing::TestWithParam<int> {};

// FSDP2's layout: the optimizer steps on dim-0 slices that keep each parameter's name and
// N-D shape (torch.chunk's split of 11 rows: 6+5 on 2 ranks, 4+4+3 on 3); explicit prefetch
// lists replace the implicit order; training matches the unsharded run.
TEST_P(PerParameterLayout, DimZeroShardsWithOriginalNamesMatchTheUnshardedRun) {
  const int n = GetParam();
  const auto expected = reference_after(kSteps);
  run_ranks(n, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    torch::manual_seed(11);
    GateNet net;
    fsdp::FSDPOptions options = per_parameter_options(/*checkpointed=*/true);
    auto group = world(cluster);
    fsdp::ShardedModule sharded(net.ptr(), options, group, core::make_local_communicator());
    sharded.set_modules_to_forward_prefetch("b1", {"b2"});
    sharded.set_modules_to_backward_prefetch("b2", {"b1"});
    const std::int64_t chunk = (kWidth + n - 1) / n;
    const std::int64_t rows = std::max<std::int64_t>(0, std::min(chunk, kWidth - chunk * cluster.global_rank));
    std::set<std::string> names;
    for (const auto& p : sharded.optimizer_parameters()) {
      names.insert(p.name);
      if (p.name.rfind("head", 0) == 0) continue;  // 2 rows: the root unit's
      std::vector<std::int64_t> shape = p.name.find("weight") != std::string::npos
                                            ? std::vector<std::int64_t>{rows, kWidth}
                                            : std::vector<std::int64_t>{rows};
      EXPECT_EQ(p.tensor.sizes().vec(), shape) << p.name << " on rank " << cluster.global_rank;
      EXPECT_EQ(p.tensor.grad().sizes(), p.tensor.sizes()) << p.name;
    }
    std::set<std::string> original;
    for (const auto& item : net->named_parameters()) original.insert(item.key());
    EXPECT_EQ(names, original);
    train(sharded, net, cluster);
    expect_matches(sharded.full_state_dict(), expected, 1e-5);
    EXPECT_THROW(sharded.set_modules_to_forward_prefetch("b1", {"head"}), sdk::Error);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, PerParameterLayout, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

class ReshardAfterForwardToPairs : public ::testing::TestWithParam<bool> {};

// FSDP2's reshard_after_forward = 2 on 4 ranks: after forward each rank keeps half of a unit
// (not a quarter) and backward re-gathers it within its pair (ranks 0-1, 2-3), checkpointed
// or not; training matches the unsharded run.
TEST_P(ReshardAfterForwardToPairs, MatchesTheUnshardedRun) {
  const bool checkpointed = GetParam();
  const auto expected = reference_after(kSteps);
  run_ranks(4, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    torch::manual_seed(11);
    GateNet net;
    fsdp::FSDPOptions options = per_parameter_options(checkpointed);
    auto group = world(cluster);
    options.post_forward_group = group->split({{0, 1}, {2, 3}});
    fsdp::ShardedModule sharded(net.ptr(), options, group, core::make_local_communicator());
    train(sharded, net, cluster);
    expect_matches(sharded.full_state_dict(), expected, 1e-5);
    EXPECT_GT(options.post_forward_group->stats().all_gather_bytes, 0) << "backward gathers within the pair";
  });
}

INSTANTIATE_TEST_SUITE_P(Recompute, ReshardAfterForwardToPairs, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Checkpointed" : "Plain"; });

/// GateNet's forward without b2 at step `skip`: that step b2's unit reduces no gradient.
at::Tensor loss_skipping(GateNet& net, int step, std::int64_t first, std::int64_t rows, int skip) {
  at::Tensor x = batch(step, kWidth, 1).narrow(0, first, rows), mask = mask_for(step).narrow(0, first, rows);
  auto [h, aux] = sdk::invoke(net->b1, x, mask, 0.5);
  if (step != skip) {
    auto [h2, a2] = sdk::invoke(net->b2, h, mask, 0.25);
    h = h2;
    aux = aux + a2;
  }
  return (net->head(h) + aux.unsqueeze(1) - batch(step, 2, 2).narrow(0, first, rows)).pow(2).mean();
}

struct FreedCase {
  const char* name;
  fsdp::ParamLayout layout;
  int ranks, accumulate;
  bool reduce_every_micro_batch;
};

// ctest lists a case by its name, not by GoogleTest's dump of the struct's bytes.
void PrintTo(const FreedCase& c, std::ostream* os) { *os << c.name; }

class FreedShardedGrads : public ::testing::TestWithParam<FreedCase> {};

// free_sharded_grads (CUDA's default), forced on the CPU: between an optimizer step and the
// next reduction the sharded gradients hold no storage, after backward they do (zeros for a
// unit unused that step), and training is bitwise the run that keeps them, with gradient
// accumulation reduced every micro-batch or once.
TEST_P(FreedShardedGrads, ForwardRunsWithoutThemAndTrainingIsUnchanged) {
  const FreedCase c = GetParam();
  run_ranks(c.ranks, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    std::map<bool, sdk::StateDict> trained;
    auto group = world(cluster);  // one rendezvous for both runs
    for (const bool release : {false, true}) {
      torch::manual_seed(11);
      GateNet net;
      fsdp::FSDPOptions options = per_parameter_options(/*checkpointed=*/false);
      options.layout = c.layout;
      options.free_sharded_grads = release;
      options.reduce_every_micro_batch = c.reduce_every_micro_batch;
      fsdp::ShardedModule sharded(net.ptr(), options, group, core::make_local_communicator());
      const auto params = sharded.optimizer_parameters();
      torch::optim::SGD optimizer(tensors_of(params), torch::optim::SGDOptions(0.1).momentum(0.9));
      const std::int64_t rows = kBatch / cluster.world_size / c.accumulate;
      auto storage_bytes = [&](const sdk::NamedParameter& p) { return p.tensor.grad().storage().nbytes(); };
      for (int s = 0; s < kSteps; ++s) {
        for (int m = 0; m < c.accumulate; ++m) {
          sharded.begin_forward(true);
          const std::int64_t first = (cluster.global_rank * c.accumulate + m) * rows;
          at::Tensor loss = loss_skipping(net, s, first, rows, /*skip=*/1) / static_cast<double>(c.accumulate);
          sharded.begin_backward(/*sync=*/m == c.accumulate - 1);
          loss.backward();
          sharded.finish_backward();
        }
        for (const auto& p : params) EXPECT_GT(storage_bytes(p), 0u) << p.name << " at step " << s;
        optimizer.step();
        sharded.after_optimizer_step();
        for (const auto& p : params)
          EXPECT_EQ(storage_bytes(p) == 0, release) << p.name << " after step " << s << " (release " << release << ")";
      }
      trained[release] = sharded.full_state_dict();
    }
    for (const auto& item : trained[false]) {
      const at::Tensor* freed = trained[true].find(item.key());
      ASSERT_NE(freed, nullptr) << item.key();
      EXPECT_TRUE(at::equal(*freed, item.value())) << item.key();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, FreedShardedGrads,
    ::testing::Values(FreedCase{"flat_2ranks", fsdp::ParamLayout::flat, 2, 1, false},
                      FreedCase{"per_parameter_3ranks", fsdp::ParamLayout::per_parameter, 3, 1, false},
                      FreedCase{"flat_2ranks_accumulated_reduced_every_micro_batch", fsdp::ParamLayout::flat, 2, 2, true},
                      FreedCase{"per_parameter_2ranks_accumulated", fsdp::ParamLayout::per_parameter, 2, 2, false}),
    [](const auto& info) { return std::string(info.param.name); });

// Without restoring the RNG the recomputation would draw new masks: checked directly.
TEST(MultiArgUnits, RecomputationSeesTheForwardsRandomState) {
  torch::manual_seed(3);
  GateNet plain;
  torch::manual_seed(3);
  GateNet recomputed;
  fsdp::FSDPOptions options;
  options.unit_classes = {"GateBlock"};
  options.activation_checkpointing = {"GateBlock"};
  fsdp::ShardedModule sharded(recomputed.ptr(), options, core::make_local_communicator(),
                              core::make_local_communicator());
  torch::manual_seed(5);
  loss_of(plain, 0, 0, kBatch).backward();
  const float after_plain = at::rand({1}).item<float>();
  torch::manual_seed(5);
  sharded.begin_forward(true);
  at::Tensor loss = loss_of(recomputed, 0, 0, kBatch);
  sharded.begin_backward(true);
  loss.backward();
  sharded.finish_backward();
  EXPECT_EQ(at::rand({1}).item<float>(), after_plain) << "the generator continues where an uncheckpointed step leaves it";
  // The sharded gradient of b1.fc.weight is the optimizer view's .grad.
  for (const auto& p : sharded.optimizer_parameters()) {
    at::Tensor reference = plain->named_parameters()[p.name].grad().reshape({-1});
    EXPECT_TRUE(at::allclose(p.tensor.grad(), reference, 1e-6, 1e-6)) << p.name;
  }
}

/// Gradients of one step whose forward runs under CPU autocast (bf16) and whose backward runs
/// after autocast was switched off, as a precision plugin does; checkpointed or not.
std::map<std::string, at::Tensor> autocast_step_grads(bool autocast, bool checkpointed) {
  torch::manual_seed(3);
  GateNet net;
  fsdp::FSDPOptions options;
  options.unit_classes = {"GateBlock"};
  if (checkpointed) options.activation_checkpointing = {"GateBlock"};
  fsdp::ShardedModule sharded(net.ptr(), options, core::make_local_communicator(), core::make_local_communicator());
  torch::manual_seed(5);
  sharded.begin_forward(true);
  sdk::set_autocast(/*cuda=*/false, autocast, at::kBFloat16);
  at::Tensor loss = loss_of(net, 0, 0, kBatch);
  sdk::set_autocast(/*cuda=*/false, false, at::kBFloat16);
  sharded.begin_backward(true);
  loss.backward();
  sharded.finish_backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : sharded.optimizer_parameters()) out[p.name] = p.tensor.grad().clone();
  return out;
}

// The recomputation in backward runs under the autocast state of the forward, not the one
// backward runs under: checkpointed gradients equal the plain ones under bf16 autocast, which
// differ from fp32 ones by far more than the tolerance (so a recompute in fp32 would show).
TEST(MultiArgUnits, RecomputationSeesTheForwardsAutocastState) {
  const auto plain = autocast_step_grads(true, false);
  const auto recomputed = autocast_step_grads(true, true);
  const auto fp32 = autocast_step_grads(false, false);
  ASSERT_EQ(plain.size(), recomputed.size());
  double fp32_gap = 0;
  for (const auto& [name, grad] : plain) {
    EXPECT_TRUE(at::allclose(recomputed.at(name), grad, 1e-6, 1e-6))
        << name << " differs by " << (recomputed.at(name) - grad).abs().max().item<double>();
    fp32_gap = std::max(fp32_gap, (fp32.at(name) - grad).abs().max().item<double>());
  }
  EXPECT_GT(fp32_gap, 1e-4) << "bf16 autocast should change the gradients visibly";
}

/// b1 is small, b2 large: the size policy wraps b2 only; the custom one what the model says.
struct SizedNetImpl : torch::nn::Module {
  SizedNetImpl() : torch::nn::Module("SizedNet") {
    b1 = register_module("b1", GateBlock(3));
    b2 = register_module("b2", GateBlock(kWidth));
    head = register_module("head", torch::nn::Linear(kWidth, 2));
  }
  GateBlock b1{nullptr}, b2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(SizedNet);

TEST(WrapPolicies, SizeWrapsUnitClassesWithEnoughParameters) {
  SizedNet net;
  fsdp::FSDPOptions options;
  options.auto_wrap_policy = "size";
  options.unit_classes = {"GateBlock"};
  options.min_num_params = 100;  // b1 has 2 * (9 + 3) = 24, b2 has 2 * 132 = 264
  fsdp::UnitPlan plan = fsdp::plan_units(*net, options);
  ASSERT_EQ(plan.units.size(), 2u);
  EXPECT_EQ(plan.units[0].name, "b2");
  EXPECT_EQ(plan.units[0].params.size(), 4u);
  EXPECT_EQ(plan.units[1].name, "<root>");
  EXPECT_EQ(plan.units[1].params.size(), 6u);  // b1's four and head's two
  options.min_num_params = 10;
  EXPECT_EQ(fsdp::plan_units(*net, options).units.size(), 3u);
}

// Only units are recomputed: a checkpointed class that no unit has (no units at all, or the
// size policy leaving every one of them out) is refused, not accepted and ignored.
TEST(WrapPolicies, CheckpointingAClassNoUnitHasIsRefused) {
  SizedNet net;
  fsdp::FSDPOptions options;
  options.unit_classes = {"GateBlock"};
  options.activation_checkpointing = {"GateBlock"};
  options.auto_wrap_policy = "size";
  options.min_num_params = 100;  // b2 is a unit, b1 is not: b2 is recomputed
  fsdp::UnitPlan plan = fsdp::plan_units(*net, options);
  ASSERT_EQ(plan.units.size(), 2u);
  EXPECT_TRUE(plan.units[0].checkpointed);
  options.min_num_params = 1000;  // neither
  try {
    fsdp::plan_units(*net, options);
    ADD_FAILURE() << "no GateBlock unit, yet checkpointing it was accepted";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("activation_checkpointing names 'GateBlock', but no FSDP unit is one"),
              std::string::npos) << e.what();
  }
  options.auto_wrap_policy = "none";
  try {
    fsdp::plan_units(*net, options);
    ADD_FAILURE() << "auto_wrap_policy = none, yet checkpointing GateBlock was accepted";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("auto_wrap_policy (fsdp2: parallelize_fn) \"none\" makes no units"), std::string::npos) << e.what();
  }
}

TEST(WrapPolicies, CustomPolicyDecidesByModulePath) {
  SizedNet net;
  fsdp::FSDPOptions options;
  options.auto_wrap_policy = "custom";
  std::vector<std::string> asked;
  options.custom_wrap_policy = [&](const std::string& path, const torch::nn::Module&) {
    asked.push_back(path);
    return path == "b1" || path == "b1.fc";
  };
  fsdp::UnitPlan plan = fsdp::plan_units(*net, options);
  ASSERT_EQ(plan.units.size(), 2u);
  EXPECT_EQ(plan.units[0].name, "b1");
  // Outermost first; nothing inside a chosen unit is asked.
  EXPECT_EQ(asked, (std::vector<std::string>{"b1", "b2", "b2.fc", "b2.gate", "head"}));
}

TEST(WrapPolicies, AnUnknownUnitClassNamesTheClassesTheNetworkHas) {
  SizedNet net;
  EXPECT_EQ(fsdp::unit_class_problem(*net, {"GateBlock"}), "");
  const std::string problem = fsdp::unit_class_problem(*net, {"ResBlock"});
  EXPECT_NE(problem.find("no module class 'ResBlock'"), std::string::npos) << problem;
  EXPECT_NE(problem.find("[SizedNet, GateBlock, torch::nn::LinearImpl]"), std::string::npos) << problem;
  EXPECT_NE(problem.find("torch::nn::Module(\"Name\")"), std::string::npos) << problem;
}

class SummonThroughTheSdk : public ::testing::TestWithParam<int> {};

// What a model plugin or callback sees: full parameters (and gradients) of a sharded
// network, apply() with write-back, the unit list; nothing sharded: the plain network.
TEST_P(SummonThroughTheSdk, GivesFullParametersGradientsAndUnits) {
  const int n = GetParam();
  torch::manual_seed(11);
  GateNet reference;
  loss_of(reference, 0, 0, kBatch).backward();
  EXPECT_EQ(sdk::fsdp_modules(*reference), std::vector<std::string>{""});
  EXPECT_EQ(sdk::summon_full_params(*reference), nullptr);
  run_ranks(n, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    torch::manual_seed(11);
    GateNet net;
    fsdp::FSDPOptions options;
    options.unit_classes = {"GateBlock"};
    fsdp::ShardedModule sharded(net.ptr(), options, world(cluster), core::make_local_communicator());
    EXPECT_EQ(sdk::fsdp_modules(*net), (std::vector<std::string>{"b1", "b2", ""}));
    EXPECT_EQ(sdk::fsdp_modules(*net, /*root_only=*/true), std::vector<std::string>{""});
    const std::int64_t rows = kBatch / cluster.world_size, first = rows * cluster.global_rank;
    sharded.begin_forward(true);
    at::Tensor loss = loss_of(net, 0, first, rows);
    sharded.begin_backward(true);
    loss.backward();
    sharded.finish_backward();
    {
      sdk::SummonOptions o;
      o.with_grads = true;
      o.writeback = false;
      sdk::GuardPtr full = sdk::summon_full_params(*net, o);
      auto ref = reference->named_parameters();
      for (const auto& item : net->named_parameters()) {
        EXPECT_TRUE(at::allclose(item.value(), ref[item.key()], 1e-6, 1e-6)) << item.key();
        EXPECT_TRUE(at::allclose(item.value().grad(), ref[item.key()].grad(), 1e-5, 1e-6)) << item.key() << " grad";
      }
    }
    for (const auto& item : net->named_parameters()) EXPECT_FALSE(item.value().grad().defined()) << item.key();
    sdk::apply(*net, [](torch::nn::Module& m) {
      if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&m)) linear->bias.fill_(0.25);
    });
    sdk::StateDict state = sharded.full_state_dict();
    for (const auto& item : state)
      if (item.key().find("bias") != std::string::npos) EXPECT_TRUE(item.value().eq(0.25).all().item<bool>()) << item.key();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SummonThroughTheSdk, ::testing::Values(1, 2, 3));

}  // namespace
