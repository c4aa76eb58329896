// core::fsdp::ShardedModule on real ranks (Gloo on loopback) against an unsharded reference
// in the same process: tied weights across units, ignored modules, summon_full_params /
// apply / LOCAL state dicts / scatter_full_optim_state_dict, the unit-plan check, sharded-state
// bytes ~1/N. Deferred init and memory: fsdp_deferred_init_test.cpp; through the binary:
// fsdp_binary_test.cpp.
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

#include "fsdp_fixtures.hpp"
#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/device_mesh.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/core/tp_group.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/unit.hpp"


namespace {

using namespace fsdp_test;
using tessera::testing::metric_series;
using tessera::testing::run_ranks;
using tessera::testing::run_tessera;

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

}  // namespace
