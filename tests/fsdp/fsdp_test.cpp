// core::fsdp::ShardedModule on real ranks (Gloo on loopback) against an unsharded reference
// in the same process: tied weights across units, ignored modules, summon_full_params /
// apply / LOCAL state dicts / scatter_full_optim_state_dict, the unit-plan check, deferred
// init under a tracked memory cap, sharded-state bytes ~1/N; and through the `tessera`
// binary: SHARDED checkpoints resharded 2 -> 3 ranks and 2 ranks -> single device.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/device_mesh.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/core/tp_group.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/unit.hpp"

namespace tessera::core::fsdp {
// ctest lists a layout case by its name, not by GoogleTest's dump of the enum's bytes (found by
// argument-dependent lookup, so in the enum's namespace).
void PrintTo(ParamLayout layout, std::ostream* os) { *os << (layout == ParamLayout::flat ? "flat" : "per_parameter"); }
}  // namespace tessera::core::fsdp

namespace {

namespace core = tessera::core;
namespace fsdp = tessera::core::fsdp;
namespace sdk = tessera::sdk;
using tessera::testing::metric_series;
using tessera::testing::run_ranks;
using tessera::testing::run_tessera;

constexpr std::int64_t kWidth = 13;  // 13*13+13 = 182 parameters per Linear: indivisible by 3 and 4

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

constexpr std::int64_t kBatch = 12;  // global batch: divisible by 1, 2, 3, 4

at::Tensor inputs(int step) {
  at::Generator g = at::detail::createCPUGenerator(100 + step);
  return at::randn({kBatch, kWidth}, g);
}
at::Tensor targets(int step) {
  at::Generator g = at::detail::createCPUGenerator(200 + step);
  return at::randn({kBatch, 3}, g);
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(0.02).weight_decay(0.1); }

/// Freezes b2 and head (requires_grad false), as a fine-tuning model would.
void freeze_b2_and_head(Net& net) {
  for (auto& p : net->b2->parameters()) p.requires_grad_(false);
  for (auto& p : net->head->parameters()) p.requires_grad_(false);
}

/// The unsharded reference: full batch, one process.
std::map<std::string, at::Tensor> reference_after(int steps, bool frozen_b2_and_head = false) {
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

core::CommunicatorPtr world(const sdk::ClusterInfo& cluster) {
  return cluster.world_size == 1 ? core::make_local_communicator() : core::make_communicator(cluster, c10::kCPU);
}

fsdp::FSDPOptions unit_options() {
  fsdp::FSDPOptions o;
  o.unit_classes = {"Block"};
  o.rank0_only = false;
  return o;
}

/// One FSDP training step on this rank's rows of the global batch.
void train_step(fsdp::ShardedModule& sharded, Net& net, torch::optim::Optimizer& optimizer, int step,
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

std::vector<at::Tensor> tensors_of(const std::vector<sdk::NamedParameter>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}

void expect_matches(const sdk::StateDict& state, const std::map<std::string, at::Tensor>& reference, double tol,
                    const std::string& what) {
  ASSERT_EQ(static_cast<std::size_t>(state.size()), reference.size()) << what;
  for (const auto& [name, value] : reference) {
    const at::Tensor* got = state.find(name);
    ASSERT_NE(got, nullptr) << what << ": no " << name;
    EXPECT_TRUE(at::allclose(*got, value, tol, tol)) << what << ": " << name << " differs by "
                                                     << (*got - value).abs().max().item<double>();
  }
}

class Engine : public ::testing::TestWithParam<int> {};

// Tied weight across b1/b3 (kept in the root), head ignored (replicated, all-reduced),
// AdamW with weight decay on per-parameter views of the shards: the same parameters as the
// unsharded run after 3 steps; optimizer names are the original ones; the sharded state
// shrinks as 1/N.
TEST_P(Engine, TiedAcrossUnitsAndIgnoredModuleMatchUnsharded) {
  const int n = GetParam();
  run_ranks(n, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto reference = reference_after(3);
    auto comm = world(cluster);
    for (bool ignore_head : {false, true}) {
      torch::manual_seed(7);
      Net net;
      fsdp::FSDPOptions o = unit_options();
      if (ignore_head) o.ignored_modules = {"head"};
      fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
      EXPECT_EQ(sharded.fsdp_modules(), (std::vector<std::string>{"b1", "b2", "b3", ""}));
      EXPECT_EQ(sharded.fsdp_modules(/*root_only=*/true), (std::vector<std::string>{""}));
      std::set<std::string> names;
      for (const auto& p : sharded.optimizer_parameters()) names.insert(p.name);
      EXPECT_EQ(names, (std::set<std::string>{"b1.fc.weight", "b1.fc.bias", "b1.shared.weight", "b1.shared.bias",
                                              "b2.fc.weight", "b2.fc.bias", "b3.fc.weight", "b3.fc.bias",
                                              "head.weight", "head.bias"}));
      torch::optim::AdamW optimizer(tensors_of(sharded.optimizer_parameters()), adamw());
      for (int s = 0; s < 3; ++s) train_step(sharded, net, optimizer, s, cluster);
      // Both names of the tied weight are in the state dict, with the same values.
      expect_matches(sharded.full_state_dict(), reference, 2e-5,
                     "rank " + std::to_string(cluster.global_rank) + (ignore_head ? " ignored head" : ""));
      // Sharded state: master shards + sharded grads, fp32; units padded to a multiple of n.
      std::int64_t padded = 0;
      const std::int64_t per_unit[] = {182, 182, 182, 182 + (ignore_head ? 0 : 42)};  // b1-b3; root: tied + head
      for (std::int64_t u : per_unit) padded += (u + n - 1) / n * n;
      EXPECT_EQ(sharded.sharded_bytes(), 2 * 4 * padded / n) << "rank " << cluster.global_rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Engine, ::testing::Values(1, 2, 3, 4));

// A unit with nothing to train (b2) keeps no sharded gradient and is not reduced; a frozen
// ignored module (head) gets no all-reduced zeros. Training still equals one process's.
TEST(EngineApi, FrozenUnitsAndIgnoredParametersKeepNoGradients) {
  run_ranks(3, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    auto reference = reference_after(3, /*frozen_b2_and_head=*/true);
    auto comm = world(cluster);
    torch::manual_seed(7);
    Net net;
    freeze_b2_and_head(net);
    fsdp::FSDPOptions o = unit_options();
    o.ignored_modules = {"head"};
    fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
    torch::optim::AdamW optimizer(tensors_of(sharded.optimizer_parameters()), adamw());
    for (int s = 0; s < 3; ++s) {
      train_step(sharded, net, optimizer, s, cluster);
      EXPECT_FALSE(net->head->weight.grad().defined()) << "step " << s;
    }
    expect_matches(sharded.full_state_dict(), reference, 2e-5, "rank " + std::to_string(cluster.global_rank));
    // Units b1, b2, b3 and the root (the tied Linear): 182 elements each, 61 per rank; a
    // gradient shard for the three that train.
    EXPECT_EQ(sharded.sharded_bytes(), 4 * 61 * 4 + 4 * 61 * 3) << "rank " << cluster.global_rank;
  });
}

TEST(EngineApi, SummonApplyLocalStateAndScatteredOptimizerState) {
  run_ranks(2, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    torch::manual_seed(7);
    Net reference;
    torch::manual_seed(7);
    Net net;
    fsdp::ShardedModule sharded(net.ptr(), unit_options(), comm, core::make_local_communicator());
    {
      sdk::GuardPtr full = sharded.summon_full_params(/*writeback=*/false);
      EXPECT_TRUE(at::equal(net->b2->fc->weight, reference->b2->fc->weight));
      EXPECT_TRUE(at::equal(net->b1->shared->weight, reference->b1->shared->weight));
      torch::NoGradGuard no_grad;
      net->b2->fc->bias.fill_(9.0);  // not written back
    }
    EXPECT_TRUE(at::equal(*sharded.full_state_dict().find("b2.fc.bias"), reference->b2->fc->bias));
    {
      sdk::GuardPtr full = sharded.summon_full_params(/*writeback=*/true);
      torch::NoGradGuard no_grad;
      net->b2->fc->bias.add_(1.0);
    }
    EXPECT_TRUE(at::allclose(*sharded.full_state_dict().find("b2.fc.bias"), reference->b2->fc->bias + 1.0));
    {
      sdk::GuardPtr full = sharded.summon_full_params(false, /*rank0_only=*/true);
      if (cluster.global_rank == 0) EXPECT_TRUE(at::equal(net->b3->fc->weight, reference->b3->fc->weight));
      else EXPECT_EQ(full, nullptr);
    }
    EXPECT_THROW(sharded.summon_full_params(true, true), sdk::Error);
    sharded.apply([](torch::nn::Module& m) {
      if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&m)) linear->bias.fill_(0.25);
    });
    for (const auto& item : sharded.full_state_dict())
      if (item.key().find("bias") != std::string::npos) EXPECT_TRUE(at::all(item.value() == 0.25).item<bool>()) << item.key();

    // LOCAL state dict round trip.
    sdk::StateDict local = sharded.local_state_dict();
    EXPECT_NE(local.find("b1.flat_param"), nullptr);
    EXPECT_NE(local.find("flat_param"), nullptr);
    sharded.apply([](torch::nn::Module& m) {
      for (auto& p : m.parameters(/*recurse=*/false)) p.fill_(-1.0);
    });
    sharded.load_local_state_dict(local);
    for (const auto& item : sharded.full_state_dict())
      if (item.key().find("bias") != std::string::npos) EXPECT_TRUE(at::all(item.value() == 0.25).item<bool>()) << item.key();

    // Optimizer state: full on rank 0 only, scattered into a fresh optimizer's shards.
    torch::optim::AdamW optimizer(tensors_of(sharded.optimizer_parameters()), adamw());
    train_step(sharded, net, optimizer, 0, cluster);
    train_step(sharded, net, optimizer, 1, cluster);
    sdk::Checkpoint full = sharded.full_optim_state_dict(optimizer);  // rank0_only = false here
    EXPECT_TRUE(full.contains("state"));
    torch::optim::AdamW fresh(tensors_of(sharded.optimizer_parameters()), adamw());
    sharded.scatter_full_optim_state_dict(fresh, cluster.global_rank == 0 ? full : sdk::make_checkpoint());
    // And the same from a PARAM_NAME-keyed full dict through shard_full_optim_state_dict.
    torch::optim::AdamW third(tensors_of(sharded.optimizer_parameters()), adamw());
    core::load_optimizer_state_dict(
        third, sharded.shard_full_optim_state_dict(core::rekey_optim_state_dict(full, core::OptimStateKeyType::PARAM_NAME)),
        core::optimizer_order_names(third, sharded.optimizer_parameters()));
    const auto names = core::optimizer_order_names(optimizer, sharded.optimizer_parameters());
    auto a = core::optimizer_state_dict(optimizer, names).at("state").toGenericDict();
    for (auto* other : {&fresh, &third}) {
      auto b = core::optimizer_state_dict(*other, names).at("state").toGenericDict();
      ASSERT_EQ(a.size(), b.size());
      for (const auto& entry : a)
        for (const char* key : {"exp_avg", "exp_avg_sq"})
          EXPECT_TRUE(at::equal(entry.value().toGenericDict().at(key).toTensor(),
                                b.at(entry.key()).toGenericDict().at(key).toTensor()))
              << "rank " << cluster.global_rank << " param " << entry.key().toInt() << " " << key;
    }
  });
}

// The total norm over every shard (tied weight counted once, ignored head counted once
// although replicated) equals the unsharded one, for the 2-norm and the inf-norm; clipping
// scales every gradient alike.
TEST(EngineApi, ClipGradNormEqualsTheUnshardedNorm) {
  run_ranks(3, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      torch::manual_seed(7);
      Net reference;
      (reference->forward(inputs(0)) - targets(0)).pow(2).mean().backward();
      std::vector<at::Tensor> grads;
      std::set<const void*> seen;
      for (const auto& p : reference->parameters())
        if (seen.insert(p.unsafeGetTensorImpl()).second) grads.push_back(p.grad().reshape({-1}));
      at::Tensor all = at::cat(grads);
      const double expected = std::isinf(norm_type) ? all.abs().max().item<double>() : all.norm().item<double>();

      torch::manual_seed(7);
      Net net;
      fsdp::FSDPOptions o = unit_options();
      o.ignored_modules = {"head"};
      fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
      const std::int64_t rows = kBatch / 3, first = rows * cluster.global_rank;
      sharded.begin_forward(true);
      at::Tensor loss = (net->forward(inputs(0).narrow(0, first, rows)) - targets(0).narrow(0, first, rows)).pow(2).mean();
      sharded.begin_backward(true);
      loss.backward();
      sharded.finish_backward();
      const double total = sharded.clip_grad_norm(expected / 4, norm_type);
      EXPECT_NEAR(total, expected, 1e-5 * expected) << "norm " << norm_type << " rank " << cluster.global_rank;
      // After clipping to a quarter, the norm is a quarter.
      EXPECT_NEAR(sharded.clip_grad_norm(1e9, norm_type), expected / 4, 1e-4 * expected) << "norm " << norm_type;
    }
  });
}

TEST(EngineApi, RanksThatPlanDifferentUnitsFailNamingTheFirstDifference) {
  run_ranks(2, std::chrono::seconds(60), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    Net net(/*b2_bias=*/cluster.global_rank == 0);
    try {
      fsdp::ShardedModule sharded(net.ptr(), unit_options(), comm, core::make_local_communicator());
      ADD_FAILURE() << "rank " << cluster.global_rank << ": no error";
    } catch (const sdk::Error& e) {
      const std::string text = e.what();
      EXPECT_NE(text.find("unit #1"), std::string::npos) << text;
      EXPECT_NE(text.find(cluster.global_rank == 0 ? "'b2:182'" : "'b2:169'"), std::string::npos) << text;
    }
  });
}

/// Units run in an order set per step (not registration order); a step may skip one.
struct OrderNetImpl : torch::nn::Module {
  OrderNetImpl() : torch::nn::Module("OrderNet") {
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), Block(kWidth, nullptr)));
    head = register_module("head", torch::nn::Linear(kWidth, 3));
  }
  at::Tensor forward(at::Tensor x) {
    for (int i : order) x = sdk::invoke(blocks[i], x);
    return head(x);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
  std::vector<int> order;
};
TORCH_MODULE(OrderNet);

// Forward and backward prefetch follow the order recorded in the first forward (b2, b0, b1);
// in step 2 b1 does not run, so its prefetch is dropped, and step 3 must gather b1's
// stepped values, not the stale prefetched ones. Same parameters as the unsharded run.
TEST(EngineApi, PrefetchFollowsExecutionOrderAndDropsUnusedPrefetches) {
  run_ranks(2, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    const std::vector<std::vector<int>> orders = {{2, 0, 1}, {2, 0, 1}, {2, 0}, {2, 0, 1}};
    auto run = [&](fsdp::ShardedModule* sharded, OrderNet& net, std::vector<at::Tensor> params) {
      torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1));
      const std::int64_t rows = sharded ? kBatch / 2 : kBatch, first = sharded ? rows * cluster.global_rank : 0;
      for (int s = 0; s < 4; ++s) {
        net->order = orders[s];
        if (sharded) sharded->begin_forward(true);
        at::Tensor loss =
            (net->forward(inputs(s).narrow(0, first, rows)) - targets(s).narrow(0, first, rows)).pow(2).mean();
        if (sharded) sharded->begin_backward(true);
        loss.backward();
        if (sharded) sharded->finish_backward();
        optimizer.step();
        if (sharded) sharded->after_optimizer_step();
        else optimizer.zero_grad();
      }
    };
    torch::manual_seed(5);
    OrderNet reference;
    run(nullptr, reference, reference->parameters());
    std::map<std::string, at::Tensor> expected;
    for (const auto& item : reference->named_parameters()) expected[item.key()] = item.value().detach();
    auto comm = world(cluster);  // one per process: a second rendezvous on the same port races the first's teardown
    for (auto prefetch : {fsdp::BackwardPrefetch::BACKWARD_PRE, fsdp::BackwardPrefetch::BACKWARD_POST}) {
      torch::manual_seed(5);
      OrderNet net;
      fsdp::FSDPOptions o = unit_options();
      o.forward_prefetch = true;
      o.backward_prefetch = prefetch;
      fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
      run(&sharded, net, tensors_of(sharded.optimizer_parameters()));
      expect_matches(sharded.full_state_dict(), expected, 1e-5, "rank " + std::to_string(cluster.global_rank));
    }
  });
}

// Live CPU bytes, through an allocator installed in place of LibTorch's.
std::atomic<std::int64_t> live_bytes{0}, peak_bytes{0};
struct Allocation {
  void* data;
  std::int64_t bytes;
};
void release(void* context) {
  auto* a = static_cast<Allocation*>(context);
  live_bytes -= a->bytes;
  std::free(a->data);
  delete a;
}
struct TrackingAllocator final : c10::Allocator {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)  // non-const, copy_data
  c10::DataPtr allocate(std::size_t n) override { return track(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(std::size_t n) const override { return track(n); }
#endif
  static c10::DataPtr track(std::size_t n) {
    void* data = std::aligned_alloc(64, (n + 127) / 64 * 64);
    std::int64_t now = live_bytes += static_cast<std::int64_t>(n);
    std::int64_t peak = peak_bytes.load();
    while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {}
    return {data, new Allocation{data, static_cast<std::int64_t>(n)}, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
};
TrackingAllocator tracking;

struct DeepNetImpl : torch::nn::Module {
  DeepNetImpl() : torch::nn::Module("DeepNet") {
    for (int i = 0; i < 8; ++i) blocks.push_back(register_module("b" + std::to_string(i), Block(64, nullptr)));
    head = register_module("head", torch::nn::Linear(64, 3));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = sdk::invoke(b, x);
    return head(x);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(DeepNet);

class DeferredInitUnderAMemoryCap : public ::testing::TestWithParam<fsdp::ParamLayout> {};

// 4 ranks, 8 units: under deferred init (fsdp's model_sharded_context, fsdp2's
// tensor_init_context) no rank ever holds more than 80% of the model's bytes (the model is
// never whole anywhere), the values equal a normal construction with the same seed, the
// sharded state left is ~2/N of the model (+ one unit), and it trains.
TEST_P(DeferredInitUnderAMemoryCap, BuildsUnitByUnit) {
  const fsdp::ParamLayout layout = GetParam();
  run_ranks(4, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    const std::int64_t model_bytes = (8 * (64 * 64 + 64) + 64 * 3 + 3) * 4;
    c10::SetCPUAllocator(&tracking, /*priority=*/100);
    const std::int64_t base = live_bytes.load();
    peak_bytes = base;
    DeepNet net{nullptr};
    torch::manual_seed(11);  // as the host seeds before model_sharded_context()
    {
      sdk::GuardPtr deferred = fsdp::deferred_init_guard();
      net = DeepNet();
    }
    EXPECT_TRUE(fsdp::has_deferred_tensors(*net));
    fsdp::FSDPOptions o = unit_options();
    o.deferred_init = true;
    o.layout = layout;
    auto sharded = std::make_unique<fsdp::ShardedModule>(net.ptr(), o, comm, core::make_local_communicator());
    EXPECT_FALSE(fsdp::has_deferred_tensors(*net));
    const std::int64_t peak = peak_bytes.load() - base, after = live_bytes.load() - base;
    EXPECT_LE(peak, model_bytes * 8 / 10) << "rank " << cluster.global_rank << " peaked at " << peak << " of "
                                          << model_bytes << " model bytes";
    EXPECT_LE(after, 2 * model_bytes / 4 + (64 * 64 + 64) * 4 + 4096) << "rank " << cluster.global_rank;
    // Master shard + gradient: a quarter of each block; the head (3 x 64 + 3) padded to 196
    // elements (flat) or to one row of each of its tensors (per-parameter, 64 + 1).
    const std::int64_t head = layout == fsdp::ParamLayout::flat ? 196 / 4 : 64 + 1;
    EXPECT_EQ(sharded->sharded_bytes(), 2 * 4 * (8 * 4160 / 4 + head));

    torch::manual_seed(11);
    DeepNet eager;
    sdk::StateDict full = sharded->full_state_dict();
    for (const auto& item : eager->named_parameters())
      EXPECT_TRUE(at::equal(*full.find(item.key()), item.value())) << item.key();

    torch::optim::AdamW optimizer(tensors_of(sharded->optimizer_parameters()), adamw());
    sharded->begin_forward(true);
    at::Tensor loss = net->forward(at::ones({2, 64})).pow(2).mean();
    sharded->begin_backward(true);
    loss.backward();
    sharded->finish_backward();
    optimizer.step();
    sharded->after_optimizer_step();
    EXPECT_FALSE(at::equal(*sharded->full_state_dict().find("b0.fc.weight"), *full.find("b0.fc.weight")));
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, DeferredInitUnderAMemoryCap,
                         ::testing::Values(fsdp::ParamLayout::flat, fsdp::ParamLayout::per_parameter),
                         [](const auto& info) { return info.param == fsdp::ParamLayout::flat ? "Flat" : "PerParameter"; });

struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl() : torch::nn::Module("NormBlock") {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(bn(fc(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(NormBlock);

struct NormNetImpl : torch::nn::Module {
  NormNetImpl() : torch::nn::Module("NormNet") {
    b0 = register_module("b0", NormBlock());
    b1 = register_module("b1", NormBlock());
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return head(sdk::invoke(b1, sdk::invoke(b0, x))); }
  NormBlock b0{nullptr}, b1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(NormNet);

// BatchNorm layers under deferred init, on 2 ranks: inside a unit in fp32 (initialised with
// their unit, whose unsharded memory is freed after: they were reset a second time into that
// freed memory, a segfault), and replicated in fp32 under param_dtype bf16. The values equal an
// eager build with the same seed, running statistics included, and the fp32 one trains.
TEST_P(DeferredInitUnderAMemoryCap, BatchNormLayersInsideUnitsAndReplicated) {
  const fsdp::ParamLayout layout = GetParam();
  run_ranks(2, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    for (const bool bf16_params : {false, true}) {
      NormNet net{nullptr};
      torch::manual_seed(5);
      {
        sdk::GuardPtr deferred = fsdp::deferred_init_guard();
        net = NormNet();
      }
      fsdp::FSDPOptions o = unit_options();
      o.unit_classes = {"NormBlock"};
      o.deferred_init = true;
      o.layout = layout;
      if (bf16_params) o.mixed_precision.param_dtype = at::kBFloat16;
      fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
      EXPECT_FALSE(fsdp::has_deferred_tensors(*net));
      torch::manual_seed(5);
      NormNet eager;
      sdk::StateDict full = sharded.full_state_dict();
      for (const auto& item : eager->named_parameters())
        EXPECT_TRUE(at::equal(*full.find(item.key()), item.value())) << item.key() << " bf16 " << bf16_params;
      for (const auto& item : eager->named_buffers())
        EXPECT_TRUE(at::equal(*full.find(item.key()), item.value())) << item.key() << " bf16 " << bf16_params;
      if (bf16_params) continue;  // (bf16 units training beside fp32 norm layers: MixedPrecisionPolicy's tests)
      torch::optim::SGD optimizer(tensors_of(sharded.optimizer_parameters()), torch::optim::SGDOptions(0.1));
      sharded.begin_forward(true);
      at::Tensor loss = net->forward(at::randn({4, 8})).pow(2).mean();
      sharded.begin_backward(true);
      loss.backward();
      sharded.finish_backward();
      optimizer.step();
      sharded.after_optimizer_step();
      EXPECT_FALSE(at::equal(*sharded.full_state_dict().find("b0.bn.weight"), *full.find("b0.bn.weight")));
    }
  });
}

// A tensor-parallel MLP block (fc column-parallel, proj row-parallel after parallelize()).
struct TPBlockImpl : torch::nn::Module {
  TPBlockImpl() : torch::nn::Module("TPBlock") {
    fc = torch::nn::AnyModule(register_module("fc", torch::nn::Linear(64, 128)));
    proj = torch::nn::AnyModule(register_module("proj", torch::nn::Linear(128, 64)));
  }
  at::Tensor forward(const at::Tensor& x) { return x + proj.forward<at::Tensor>(at::tanh(fc.forward<at::Tensor>(x))); }
  void parallelize(const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    fc = torch::nn::AnyModule(replace_module("fc", sdk::ColumnParallelLinear(fc.get<torch::nn::LinearImpl>(), tp)));
    proj = torch::nn::AnyModule(replace_module("proj", sdk::RowParallelLinear(proj.get<torch::nn::LinearImpl>(), tp)));
  }
  torch::nn::AnyModule fc, proj;
};
TORCH_MODULE(TPBlock);

struct TPDeepNetImpl : torch::nn::Module {
  TPDeepNetImpl() : torch::nn::Module("TPDeepNet") {
    for (int i = 0; i < 8; ++i) blocks.push_back(register_module("b" + std::to_string(i), TPBlock()));
    head = register_module("head", torch::nn::Linear(64, 3));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = sdk::invoke(b, x);
    return head(x);
  }
  std::vector<TPBlock> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TPDeepNet);

// dp 2 x tp 2 on 4 ranks, as fsdp2 runs it under deferred init: the model is built deferred,
// the tensor-parallel plan cuts its deferred weights (the pieces stay deferred), and each unit
// draws its full weights one layer at a time and keeps this rank's pieces. No rank ever holds
// more than 80% of the model's bytes, and every piece equals the eager model's weight (built
// with the same seed, LibTorch's Linear init with the full fan-in) cut by the plan.
TEST(DeferredInitTensorParallel, PeakUnderACapAndPiecesAreTheEagerModelsCut) {
  run_ranks(4, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    core::DeviceMesh mesh(world(cluster), {1, 2, 2}, {"replicate", "shard", "tp"});
    std::shared_ptr<sdk::TensorParallelGroup> tp = core::make_tensor_parallel_group(mesh.group("tp"));
    const std::int64_t model_bytes = (8 * (64 * 128 + 128 + 128 * 64 + 64) + 64 * 3 + 3) * 4;
    c10::SetCPUAllocator(&tracking, /*priority=*/100);
    const std::int64_t base = live_bytes.load();
    peak_bytes = base;
    TPDeepNet net{nullptr};
    torch::manual_seed(11);
    {
      sdk::GuardPtr deferred = fsdp::deferred_init_guard();
      net = TPDeepNet();
    }
    {
      sdk::GuardPtr deferred = core::resume_deferred_init_guard();
      for (auto& b : net->blocks) b->parallelize(tp);
    }
    for (const auto& item : net->named_parameters())
      EXPECT_TRUE(core::is_deferred(item.value())) << item.key() << ": a piece cut from deferred weights got memory";
    fsdp::FSDPOptions o = unit_options();
    o.unit_classes = {"TPBlock"};
    o.deferred_init = true;
    o.layout = fsdp::ParamLayout::per_parameter;
    o.tp_rank = tp->rank();
    o.tp_size = tp->size();
    auto sharded = std::make_unique<fsdp::ShardedModule>(net.ptr(), o, mesh.group("shard"), mesh.group("replicate"));
    EXPECT_FALSE(fsdp::has_deferred_tensors(*net));
    const std::int64_t peak = peak_bytes.load() - base, after = live_bytes.load() - base;
    EXPECT_LE(peak, model_bytes * 8 / 10) << "rank " << cluster.global_rank << " peaked at " << peak << " of "
                                          << model_bytes << " model bytes";
    EXPECT_LE(after, 2 * model_bytes / 4 + (64 * 128 + 128 + 128 * 64 + 64) * 4 + 4096) << "rank " << cluster.global_rank;

    torch::manual_seed(11);
    TPDeepNet eager;
    const auto placements = sdk::tensor_parallel_placements(*net);
    EXPECT_EQ(placements.size(), 8u * 3u);  // fc.weight, fc.bias, proj.weight
    sdk::StateDict pieces = sharded->full_state_dict();
    for (const auto& item : eager->named_parameters()) {
      auto it = placements.find(item.key());
      const at::Tensor expected = it == placements.end()
                                      ? item.value()
                                      : sdk::tensor_parallel_shard(item.value(), it->second, tp->rank(), tp->size());
      ASSERT_NE(pieces.find(item.key()), nullptr) << item.key();
      EXPECT_TRUE(at::equal(*pieces.find(item.key()), expected)) << item.key() << " on rank " << cluster.global_rank;
    }

    // It trains: the tp ranks of a shard see the same rows.
    torch::optim::AdamW optimizer(tensors_of(sharded->optimizer_parameters()), adamw());
    sharded->begin_forward(true);
    at::Tensor loss = net->forward(at::ones({2, 64}) * (1 + mesh.rank("shard"))).pow(2).mean();
    sharded->begin_backward(true);
    loss.backward();
    sharded->finish_backward();
    optimizer.step();
    sharded->after_optimizer_step();
    EXPECT_FALSE(at::equal(*sharded->full_state_dict().find("b0.fc.weight"), *pieces.find("b0.fc.weight")));
  });
}

/// One training step of the DeepNet on a batch of ones.
void deep_net_step(fsdp::ShardedModule& sharded, DeepNet& net, torch::optim::Optimizer& optimizer) {
  sharded.begin_forward(true);
  at::Tensor loss = net->forward(at::ones({2, 64})).pow(2).mean();
  sharded.begin_backward(true);
  loss.backward();
  sharded.finish_backward();
  optimizer.step();
  sharded.after_optimizer_step();
}

// limit_all_gathers, counted: with b0 prefetching b1-b3 explicitly, four blocks are gathered
// at once; under the limit two (the running unit and one ahead), and the step is the same.
TEST(LimitAllGathers, BoundsTheUnitsGatheredAtOnce) {
  run_ranks(2, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    std::map<std::int64_t, sdk::StateDict> after;
    for (std::int64_t limit : {0, 2}) {
      torch::manual_seed(11);
      DeepNet net;
      fsdp::FSDPOptions o = unit_options();
      o.max_gathered_units = limit;
      fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
      sharded.set_modules_to_forward_prefetch("b0", {"b1", "b2", "b3"});
      torch::optim::SGD optimizer(tensors_of(sharded.optimizer_parameters()), torch::optim::SGDOptions(0.1));
      deep_net_step(sharded, net, optimizer);
      EXPECT_EQ(sharded.peak_units_gathered(), limit == 0 ? 4 : 2) << "limit " << limit;
      after[limit] = sharded.full_state_dict();
    }
    for (const auto& name : after[0].keys())
      EXPECT_TRUE(at::equal(*after[0].find(name), *after[2].find(name))) << name;
  });
}

// At world size 1 a bf16 param_dtype gathers cast copies of the fp32 shards. FULL_SHARD frees
// them as it frees gathered units (as PyTorch's FSDP2 reshards at world size 1); they used to
// stay for the whole step: the whole model a second time, in bf16. fp32 units are their own
// shards: nothing to free. Both layouts.
TEST(OneRank, CastCopiesAreFreedAsGatheredUnitsAre) {
  run_ranks(1, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    for (fsdp::ParamLayout layout : {fsdp::ParamLayout::flat, fsdp::ParamLayout::per_parameter})
      for (bool bf16 : {false, true}) {
        const std::string what = std::string(layout == fsdp::ParamLayout::flat ? "flat" : "per-parameter") +
                                 (bf16 ? " bf16" : " fp32");
        torch::manual_seed(11);
        DeepNet net;
        fsdp::FSDPOptions o = unit_options();
        o.layout = layout;
        if (bf16) o.mixed_precision.param_dtype = at::kBFloat16;
        o.cast_forward_inputs = true;
        fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
        torch::optim::SGD optimizer(tensors_of(sharded.optimizer_parameters()), torch::optim::SGDOptions(0.1));
        for (int step = 0; step < 2; ++step) deep_net_step(sharded, net, optimizer);
        EXPECT_LE(sharded.peak_units_gathered(), 2) << what;
        for (auto& block : net->blocks)
          for (const auto& p : block->parameters()) {
            if (bf16) EXPECT_EQ(p.storage().nbytes(), 0u) << what << ": a block's cast copy outlived its step";
            else EXPECT_GT(p.storage().nbytes(), 0u) << what << ": an fp32 block is its shard";
          }
      }
  });
}

// The unit that ran last in forward stays gathered into backward, which starts with it (as
// torchtitan leaves its last block): once the forward order is known (from the second step),
// a step makes exactly one all-gather fewer, of that unit's bytes (the parity tests show it
// trains the same).
TEST(Scheduler, TheLastUnitOfForwardIsNotGatheredAgainForBackward) {
  run_ranks(2, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    torch::manual_seed(11);
    DeepNet net;
    fsdp::ShardedModule sharded(net.ptr(), unit_options(), comm, core::make_local_communicator());
    torch::optim::SGD optimizer(tensors_of(sharded.optimizer_parameters()), torch::optim::SGDOptions(0.1));
    std::vector<core::CommStats> per_step;
    for (int step = 0; step < 3; ++step) {
      const core::CommStats before = comm->stats();
      deep_net_step(sharded, net, optimizer);
      const core::CommStats after = comm->stats();
      per_step.push_back({after.all_gather_bytes - before.all_gather_bytes, 0, 0, 0, 0, after.calls - before.calls});
    }
    EXPECT_EQ(per_step[0].calls - per_step[1].calls, 1) << "one all-gather fewer once the order is known";
    EXPECT_GT(per_step[0].all_gather_bytes, per_step[1].all_gather_bytes);
    EXPECT_EQ(per_step[1].all_gather_bytes, per_step[2].all_gather_bytes);
    EXPECT_EQ(per_step[1].calls, per_step[2].calls);
  });
}

// --- through the binary -------------------------------------------------------------------

std::string write_config(const std::string& dir) {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 8\nlog_every_n_steps = 1\nseed = 3\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "checkpoint_every_n_steps = 4\n"
                                   << "[optimizer]\nname = \"adamw\"\nlr = 0.003\nwarmup_steps = 2\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 32\n"
                                   << "block_size = 32\ndropout = 0.0\nmax_new_tokens = 20\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 32\nbatch_size = 6\n"
                                   << "[checkpoint_io]\nplugin = \"distributed\"\n";
  return dir + "/run.toml";
}

/// A run saving SHARDED checkpoints (directories of shards) under `source`, then runs
/// resumed from its step-4 checkpoint under each of `targets` (other world sizes /
/// strategies, the same global batch of 12): they must continue with the source's losses.
void check_sharded_resume(const std::string& name, const std::string& source,
                          const std::vector<std::pair<std::string, std::string>>& targets) {
  std::string full = tessera::testing::fresh_dir(name);
  auto a = run_tessera("fit --config " + write_config(full) + source + " --set strategy.state_dict_type=sharded");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_TRUE(std::filesystem::is_directory(tessera::testing::run_dir(full) + "/checkpoints/step=4.ckpt")) << a.output;
  auto losses = metric_series(tessera::testing::run_dir(full) + "/metrics.csv", "train", "train_loss");
  for (const auto& [target, sets] : targets) {
    std::string dir = tessera::testing::fresh_dir(name + "-" + target);
    auto r = run_tessera("fit --config " + write_config(dir) + " --ckpt-path " + tessera::testing::run_dir(full) + "/checkpoints/step=4.ckpt" + sets);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto resumed = metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
    for (std::int64_t step = 5; step <= 8; ++step) {
      ASSERT_TRUE(resumed.count(step) && losses.count(step)) << target << " step " << step << "\n" << r.output;
      EXPECT_NEAR(resumed.at(step), losses.at(step), 1e-4) << target << " step " << step;
    }
  }
}

TEST(ShardedCheckpoint, ReshardsToThreeRanksAndLoadsIntoSingleDevice) {
  check_sharded_resume("sharded-2", " --set launch.devices=2 --set strategy.plugin=fsdp",
                       {{"3-ranks", " --set launch.devices=3 --set strategy.plugin=fsdp --set data.batch_size=4 "
                                    "--set strategy.state_dict_type=sharded"},
                        {"single", " --set data.batch_size=12"}});
}

// HYBRID_SHARD writes every replica's shards (overlapping pieces); NO_SHARD writes whole
// tensors from every rank. Both re-cut into FULL_SHARD on 2 ranks.
TEST(ShardedCheckpoint, HybridAndNoShardSavesLoadIntoFullShard) {
  const std::string target = " --set launch.devices=2 --set strategy.plugin=fsdp --set strategy.state_dict_type=sharded";
  check_sharded_resume("sharded-hybrid", " --set launch.devices=4 --set strategy.plugin=fsdp --set data.batch_size=3 "
                       "--set strategy.sharding_strategy=HYBRID_SHARD --set strategy.hybrid_shard_group_size=2",
                       {{"full-shard", target}});
  check_sharded_resume("sharded-noshard", " --set launch.devices=2 --set strategy.plugin=fsdp "
                       "--set strategy.sharding_strategy=NO_SHARD", {{"full-shard", target}});
}

// Deferred init of the GPT goes through its init_parameters() (nanoGPT's N(0, 0.02), not
// LibTorch's defaults), whose draws depend on each parameter's name and the seed, not on the
// order units are built in: every loss is the eager build's, under fsdp and fsdp2 (NeMo's
// tensor_init_context) alike.
TEST(DeferredInit, GPTUsesTheModelsOwnInitialisation) {
  for (const std::string strategy : {"fsdp", "fsdp2"}) {
    std::map<std::int64_t, double> losses[2];
    for (int deferred = 0; deferred < 2; ++deferred) {
      std::string dir = tessera::testing::fresh_dir(strategy + (deferred ? "-gpt-deferred" : "-gpt-eager"));
      auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2 --set strategy.plugin=" +
                           strategy + " --set strategy.accelerator=cpu --set data.batch_size=3 " +
                           "--set strategy.deferred_init=" + (deferred ? "true" : "false"));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      losses[deferred] = metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
      ASSERT_EQ(losses[deferred].size(), 8u);
    }
    for (const auto& [step, loss] : losses[0])
      EXPECT_NEAR(losses[1].at(step), loss, 1e-5 * loss) << strategy << " step " << step;
    EXPECT_LT(losses[1].at(8), losses[1].at(1)) << strategy;
  }
}

// On a CUDA machine (NCCL; one GPU, so one rank): fsdp_cpu_offload computes the same run as
// fsdp with its shards, gradients and optimizer state in CPU memory (so a lower GPU peak),
// deferred init builds on the GPU, and the GPT trains under every half precision. CI has no
// GPU: reported as skipped there.
TEST(CUDA, CPUOffloadMatchesOnTheGPUAndHalfPrecisionsTrain) {
  if (!at::hasCUDA()) GTEST_SKIP() << "SKIPPED: no CUDA device";
  struct Run {
    std::map<std::int64_t, double> losses;
    double peak_cuda_mb;
  };
  auto fit = [](const std::string& name, const std::string& sets) {
    std::string dir = tessera::testing::fresh_dir(name);
    auto r = run_tessera("fit --config " + write_config(dir) + " --set strategy.accelerator=cuda --set model.n_embd=128" +
                         " --set model.n_head=4 --set checkpoint_io.plugin=torch" + sets, tessera::testing::visible_gpus());
    EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    auto peak = metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "peak_cuda_mb");
    return Run{metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss"), peak.empty() ? 0.0 : peak.rbegin()->second};
  };
  Run on_gpu = fit("cuda-fsdp", " --set strategy.plugin=fsdp");
  Run offloaded = fit("cuda-offload", " --set strategy.plugin=fsdp_cpu_offload");
  ASSERT_EQ(on_gpu.losses.size(), 8u);
  ASSERT_EQ(offloaded.losses.size(), on_gpu.losses.size());
  for (const auto& [step, loss] : on_gpu.losses) EXPECT_NEAR(offloaded.losses.at(step), loss, 1e-4) << "step " << step;
  EXPECT_GT(on_gpu.peak_cuda_mb, 0.0);
  EXPECT_LT(offloaded.peak_cuda_mb, on_gpu.peak_cuda_mb);
  // Deferred init materialises unit by unit on the GPU (never the whole model there first).
  Run deferred = fit("cuda-deferred", " --set strategy.plugin=fsdp --set strategy.deferred_init=true");
  ASSERT_EQ(deferred.losses.size(), 8u);
  EXPECT_NEAR(deferred.losses.at(1), on_gpu.losses.at(1), 0.01 * on_gpu.losses.at(1));
  EXPECT_LE(deferred.peak_cuda_mb, on_gpu.peak_cuda_mb);
  for (const char* precision : {"16-mixed", "16-true", "bf16-mixed", "bf16-true"}) {
    // 16-true steps fp16 master shards: Adam's default eps (1e-8) is 0 in fp16 (refused), and squared
    // gradients underflow there: fp16 Adam wants an eps near 1e-4.
    Run run = fit(std::string("cuda-") + precision, std::string(" --set strategy.plugin=fsdp --set precision.plugin=fsdp-precision") +
                                                        " --set precision.precision=" + precision +
                                                        (std::string(precision) == "16-true" ? " --set optimizer.eps=1e-4" : ""));
    ASSERT_EQ(run.losses.size(), 8u) << precision;
    EXPECT_TRUE(std::isfinite(run.losses.rbegin()->second)) << precision;
    EXPECT_LT(run.losses.rbegin()->second, run.losses.begin()->second) << precision << " did not learn";
    EXPECT_NEAR(run.losses.begin()->second, on_gpu.losses.begin()->second, 0.05 * on_gpu.losses.begin()->second)
        << precision << " starts where fp32 does";
  }
}

// Every shipped strategy on one device computes the CPU's single-device run, step by step:
// on CUDA that is the NCCL path (c10d's own all-gather / reduce-scatter into flat tensors,
// world size 1), fsdp2's per-parameter layout and DDP's buckets on the GPU. The cpu instance
// runs the same comparisons (and keeps this test honest where CI has no GPU); the cuda one is
// reported as skipped there.
class OneDevice : public ::testing::TestWithParam<std::string> {};

TEST_P(OneDevice, EveryStrategyComputesTheCPUSingleDeviceRun) {
  const std::string accelerator = GetParam();
  if (accelerator == "cuda" && !at::hasCUDA()) GTEST_SKIP() << "SKIPPED: no CUDA device";
  auto losses = [&](const std::string& name, const std::string& sets) {
    std::string dir = tessera::testing::fresh_dir(name);
    auto r = run_tessera("fit --config " + write_config(dir) + " --set checkpoint_io.plugin=torch" + sets,
                         accelerator == "cuda" ? tessera::testing::visible_gpus() : "");
    EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    return metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
  };
  const auto reference = losses("one-device-reference", " --set strategy.plugin=single_device --set strategy.accelerator=cpu");
  ASSERT_EQ(reference.size(), 8u);
  for (const std::string strategy : {"single_device", "ddp", "fsdp", "fsdp2"}) {
    const auto run = losses("one-device-" + accelerator + "-" + strategy,
                            " --set strategy.plugin=" + strategy + " --set strategy.accelerator=" + accelerator);
    ASSERT_EQ(run.size(), reference.size()) << strategy;
    for (const auto& [step, loss] : reference) EXPECT_NEAR(run.at(step), loss, 1e-4 * loss) << strategy << " step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Accelerators, OneDevice, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// summon_full_params(offload_to_cpu) on a GPU: inside the guard the parameters are full CPU
// tensors; writeback reaches the shards (under a bf16 param_dtype only the changed elements,
// the others keep their exact fp32 master values); training works afterwards.
TEST(CUDA, SummonFullParamsOffloadsToTheCPU) {
  if (!at::hasCUDA()) GTEST_SKIP() << "SKIPPED: no CUDA device";
  run_ranks(1, std::chrono::seconds(120), [&](const sdk::ClusterInfo& cluster) {
    const c10::Device cuda(c10::kCUDA, 0);
    auto comm = core::make_communicator(cluster, cuda);
    for (bool bf16 : {false, true}) {
      torch::manual_seed(7);
      Net reference;
      torch::manual_seed(7);
      Net net;
      net->to(cuda);
      fsdp::FSDPOptions o = unit_options();
      if (bf16) o.mixed_precision.param_dtype = at::kBFloat16;
      fsdp::ShardedModule sharded(net.ptr(), o, comm, comm);
      {
        sdk::GuardPtr full = sharded.summon_full_params(/*writeback=*/true, /*rank0_only=*/false, /*offload_to_cpu=*/true);
        EXPECT_TRUE(net->b2->fc->weight.is_cpu()) << "bf16 " << bf16;
        EXPECT_TRUE(at::allclose(net->b2->fc->weight.to(at::kFloat), reference->b2->fc->weight, 1e-2, 1e-2));
        torch::NoGradGuard no_grad;
        net->b2->fc->bias.fill_(0.5);
      }
      EXPECT_TRUE(net->b2->fc->weight.is_cuda());
      sdk::StateDict state = sharded.full_state_dict();
      EXPECT_TRUE(at::equal(*state.find("b2.fc.bias"), at::full({kWidth}, 0.5))) << "bf16 " << bf16;
      EXPECT_TRUE(at::equal(*state.find("b2.fc.weight"), reference->b2->fc->weight)) << "bf16 " << bf16;
      torch::optim::SGD optimizer(tensors_of(sharded.optimizer_parameters()), torch::optim::SGDOptions(0.1));
      sharded.begin_forward(/*training=*/true);
      at::Tensor x = inputs(0).to(cuda, bf16 ? at::kBFloat16 : at::kFloat);
      at::Tensor loss = net->forward(x).to(at::kFloat).pow(2).mean();
      sharded.begin_backward(/*sync=*/true);
      loss.backward();
      sharded.finish_backward();
      optimizer.step();
      sharded.after_optimizer_step();
      EXPECT_FALSE(at::equal(*sharded.full_state_dict().find("b1.fc.weight"), reference->b1->fc->weight)) << "bf16 " << bf16;
    }
  });
}

TEST(StrategyConfig, InvalidCombinationsAreClearErrors) {
  std::string dir = tessera::testing::fresh_dir("fsdp-config");
  auto r = run_tessera("fit --config " + write_config(dir) +
                       " --set strategy.plugin=fsdp --set strategy.deferred_init=true --set strategy.sync_module_states=true");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("sync_module_states = true with deferred_init = true"), std::string::npos) << r.output;
  r = run_tessera("fit --config " + write_config(dir) + " --set strategy.plugin=fsdp --set 'strategy.ignored_modules=[\"lm_haed\"]'");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("ignored_modules names 'lm_haed'"), std::string::npos) << r.output;
  r = run_tessera("fit --config " + write_config(dir) + " --set strategy.plugin=fsdp --set strategy.accelerator=cpu" +
                  " --set strategy.device_id=1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("[strategy] device_id = 1 names a CUDA device, but this run is on the CPU"), std::string::npos)
      << r.output;
}

}  // namespace
