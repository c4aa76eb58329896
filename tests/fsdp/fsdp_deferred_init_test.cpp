// The engine's memory: deferred init under a tracked memory cap (flat and per-parameter, batch
// norms, tensor parallelism), limit_all_gathers, cast copies freed with their unit, and the
// scheduler's last unit of forward kept for backward.
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
#include "tessera/toolkit/tensor_parallel.hpp"


namespace {

using namespace fsdp_test;
namespace toolkit = tessera::toolkit;
using tessera::testing::metric_series;
using tessera::testing::run_ranks;
using tessera::testing::run_tessera;

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
    fc = torch::nn::AnyModule(replace_module("fc", toolkit::ColumnParallelLinear(fc.get<torch::nn::LinearImpl>(), tp)));
    proj = torch::nn::AnyModule(replace_module("proj", toolkit::RowParallelLinear(proj.get<torch::nn::LinearImpl>(), tp)));
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

// MixedPrecisionPolicy on a unit, observed on what it returns: param_dtype computes it in bf16
// (its fp32 input cast, cast_forward_inputs), output_dtype casts its floating outputs.
TEST(OneRank, MixedPrecisionDtypesAreWhatAUnitReturns) {
  run_ranks(1, std::chrono::seconds(60), [&](const sdk::ClusterInfo& cluster) {
    auto comm = world(cluster);
    struct Case {
      c10::optional<at::ScalarType> param, output;
      at::ScalarType returned;
    };
    for (const Case& c : {Case{c10::nullopt, c10::nullopt, at::kFloat}, Case{at::kBFloat16, c10::nullopt, at::kBFloat16},
                          Case{at::kBFloat16, at::kFloat, at::kFloat}, Case{c10::nullopt, at::kBFloat16, at::kBFloat16}}) {
      torch::manual_seed(11);
      Net net;
      fsdp::FSDPOptions o = unit_options();
      o.mixed_precision.param_dtype = c.param;
      o.output_dtype = c.output;
      o.cast_forward_inputs = true;
      fsdp::ShardedModule sharded(net.ptr(), o, comm, core::make_local_communicator());
      sharded.begin_forward(/*training=*/false);
      at::Tensor y = sdk::invoke(net->b2, inputs(0));
      EXPECT_EQ(y.scalar_type(), c.returned) << "param_dtype " << (c.param ? c10::toString(*c.param) : "-")
                                             << ", output_dtype " << (c.output ? c10::toString(*c.output) : "-");
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

}  // namespace
