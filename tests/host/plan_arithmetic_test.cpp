// `tessera plan`'s arithmetic (unit tests, no process): the memory plan of each sharding
// strategy and its traffic, precision, offload, CUDA device and host rows, the largest batch
// that fits, and fit's warning when the plan exceeds the machine. Against the binary: plan_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "multiprocess.hpp"
#include "plan/plan.hpp"
#include "tessera/core/comm.hpp"
#include "fsdp/memory_plan.hpp"

namespace {

using tessera::testing::metric_series;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;
namespace fsdp = tessera::core::fsdp;
namespace host = tessera::host;

fsdp::PlannedUnitSizes unit(const std::string& name, std::int64_t rows, std::int64_t row_numel) {
  return {name, {{rows, row_numel}}};
}

/// Two 1,000-element units (10 rows of 100) and a 24-element root, fp32.
fsdp::ShardedPlanInput two_units(std::int64_t shard, fsdp::ShardingStrategy strategy) {
  fsdp::ShardedPlanInput in;
  in.units = {unit("blocks.0", 10, 100), unit("blocks.1", 10, 100), unit("<root>", 2, 12)};
  in.shard_size = shard;
  in.sharding_strategy = strategy;
  return in;
}

double sent(const tessera::sdk::MemoryLayout& layout) {
  double total = 0;
  for (const auto& c : layout.collectives) total += host::ring_bytes_sent(c.kind, c.bytes, c.group_size);
  return total;
}

TEST(PlanArithmetic, RingBytes) {
  EXPECT_DOUBLE_EQ(host::ring_bytes_sent("all_gather", 400, 4), 300);
  EXPECT_DOUBLE_EQ(host::ring_bytes_sent("reduce_scatter", 400, 4), 300);
  EXPECT_DOUBLE_EQ(host::ring_bytes_sent("all_reduce", 400, 4), 600);
  EXPECT_DOUBLE_EQ(host::ring_bytes_sent("all_reduce", 400, 1), 0);
  EXPECT_EQ(host::optimizer_moments("adamw", 0), 2);
  EXPECT_EQ(host::optimizer_moments("sgd", 0.9), 1);
  EXPECT_EQ(host::optimizer_moments("sgd", 0), 0);
}

/// 2 hosts x 2 ranks, 400 bytes of data: what crosses between the hosts per rank, on average.
TEST(PlanArithmetic, BytesBetweenHosts) {
  // Two levels: a rank exchanges only its own 100 with the other host, an all-reduce its 200 piece.
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("all_gather", 400, 4, 2, true, false), 100);
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("reduce_scatter", 400, 4, 2, true, false), 100);
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("all_reduce", 400, 4, 2, true, false), 200);
  // Gloo alone: 2 of a 4-rank ring's steps cross; an all-to-all sends 100 to each of 2 remote ranks.
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("all_gather", 400, 4, 2, false, false), 150);
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("all_reduce", 400, 4, 2, false, false), 300);
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("reduce_scatter", 400, 4, 2, false, false), 200);
  // One host: nothing crosses; one rank per host: everything it sends does; NCCL: not known.
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("all_gather", 400, 4, 4, true, false), 0);
  EXPECT_DOUBLE_EQ(host::crossing_hosts_bytes("all_gather", 400, 4, 1, true, false), 300);
  EXPECT_LT(host::crossing_hosts_bytes("all_gather", 400, 4, 2, true, true), 0);
}

TEST(PlanArithmetic, FullShardSendsTwoAllGathersAndOneReduceScatterOfTheModel) {
  auto layout = fsdp::plan_sharded_memory(two_units(4, fsdp::ShardingStrategy::FULL_SHARD));
  // Flat padded shards: 1000/4 = 250 per unit, the root's 24 -> 6.
  EXPECT_DOUBLE_EQ(layout.param_bytes, (250 + 250 + 6) * 4.0);
  EXPECT_DOUBLE_EQ(layout.grad_bytes, (250 + 250 + 6) * 4.0);
  EXPECT_EQ(layout.optimizer_numel, 506);
  // Forward all-gather of everything, backward re-gather of the units but the last (it and the
  // root stay gathered), one reduce-scatter of everything: 3/4 of each on a ring of 4.
  ASSERT_EQ(layout.collectives.size(), 3u);
  EXPECT_DOUBLE_EQ(sent(layout), 0.75 * (2024 + 1000 + 2024) * 4.0);
  // The root and two units (running + prefetched) gathered at once.
  EXPECT_DOUBLE_EQ(layout.gathered_bytes, (24 + 2 * 1000) * 4.0);
  auto no_prefetch = two_units(4, fsdp::ShardingStrategy::FULL_SHARD);
  no_prefetch.backward_prefetch = fsdp::BackwardPrefetch::NONE;
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(no_prefetch).gathered_bytes, (24 + 1000) * 4.0);
}

TEST(PlanArithmetic, ShardGradOpKeepsEveryUnitAndGathersOnce) {
  auto layout = fsdp::plan_sharded_memory(two_units(4, fsdp::ShardingStrategy::SHARD_GRAD_OP));
  EXPECT_DOUBLE_EQ(layout.gathered_bytes, 2024 * 4.0);
  // A unit's parameters go when its backward is done, as its gradient comes: at backward's
  // start, the peak, every unit is gathered beside the root's and one unit's gradients.
  EXPECT_DOUBLE_EQ(layout.unsharded_grad_bytes, (24 + 1000) * 4.0);
  EXPECT_DOUBLE_EQ(sent(layout), 0.75 * (2024 + 2024) * 4.0);
}

// One rank keeping its shards in host memory (cpu_offload on CUDA) does not alias them: it
// copies each unit to the device as a sharded rank gathers it.
TEST(PlanArithmetic, OneOffloadedRankCopiesItsUnitsToTheDevice) {
  auto in = two_units(1, fsdp::ShardingStrategy::FULL_SHARD);
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).gathered_bytes, 0);
  in.offloaded = true;
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).gathered_bytes, (24 + 2 * 1000) * 4.0);
}

TEST(PlanArithmetic, NoShardAndHybridAllReduce) {
  auto no_shard = two_units(1, fsdp::ShardingStrategy::NO_SHARD);
  no_shard.replicate_size = 4;
  auto layout = fsdp::plan_sharded_memory(no_shard);
  EXPECT_DOUBLE_EQ(layout.param_bytes, 2024 * 4.0);
  EXPECT_DOUBLE_EQ(layout.gathered_bytes, 0);  // one-rank shard groups alias their shards
  EXPECT_DOUBLE_EQ(sent(layout), 2 * 0.75 * 2024 * 4.0);
  auto hybrid = two_units(2, fsdp::ShardingStrategy::HYBRID_SHARD);
  hybrid.replicate_size = 2;
  layout = fsdp::plan_sharded_memory(hybrid);
  EXPECT_DOUBLE_EQ(layout.param_bytes, (500 + 500 + 12) * 4.0);
  // Within the pair: 2 all-gathers + reduce-scatter; across pairs: all-reduce of the shards.
  EXPECT_DOUBLE_EQ(sent(layout), 0.5 * (2024 + 1000 + 2024) * 4.0 + 2 * 0.5 * 1012 * 4.0);
}

// Accumulating micro-batches without reducing them (PyTorch's no_sync), every unit keeps its
// unsharded gradient until the last one reduces; reduce_every_micro_batch keeps none but
// reduce-scatters each micro-batch.
TEST(PlanArithmetic, AccumulatedMicroBatchesKeepUnshardedGradientsOrReduceEachTime) {
  auto in = two_units(4, fsdp::ShardingStrategy::FULL_SHARD);
  const auto one = fsdp::plan_sharded_memory(in);
  EXPECT_DOUBLE_EQ(one.unsharded_grad_bytes, (24 + 2 * 1000) * 4.0);  // the root and both units (at most 3)
  in.units.insert(in.units.begin(), {unit("blocks.a", 10, 100), unit("blocks.b", 10, 100)});  // 4 units + root
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).unsharded_grad_bytes, (24 + 3 * 1000) * 4.0);
  in.micro_batches = 4;
  const auto accumulating = fsdp::plan_sharded_memory(in);
  EXPECT_DOUBLE_EQ(accumulating.unsharded_grad_bytes, (24 + 4 * 1000) * 4.0);
  EXPECT_DOUBLE_EQ(accumulating.collectives.back().bytes, 4024 * 4.0);  // one reduce-scatter per step
  in.reduce_every_micro_batch = true;
  const auto reducing = fsdp::plan_sharded_memory(in);
  EXPECT_DOUBLE_EQ(reducing.unsharded_grad_bytes, (24 + 3 * 1000) * 4.0);
  ASSERT_EQ(reducing.collectives.back().kind, "reduce_scatter");
  EXPECT_DOUBLE_EQ(reducing.collectives.back().bytes, 4 * 4024 * 4.0);
  EXPECT_NE(reducing.collectives.back().what.find("every one of 4 micro-batches"), std::string::npos);
}

// A reduce-scatter input that is a copy (per-parameter order, or cast to reduce_dtype) lets
// its unit's unsharded gradient go: backward holds the root's and the computing unit's, and
// the two copies in flight are collective buffers. The flat layout reduces from the gradient.
// Either way each reduction in flight has its output, a shard.
TEST(PlanArithmetic, CopiedReduceInputsStandForTheirUnitsGradients) {
  auto in = two_units(4, fsdp::ShardingStrategy::FULL_SHARD);
  in.units.insert(in.units.begin(), {unit("blocks.a", 10, 100), unit("blocks.b", 10, 100)});  // 4 units + root
  in.transport = fsdp::PlannedTransport::nccl;  // no receive or staging buffers to count
  const auto flat = fsdp::plan_sharded_memory(in);
  EXPECT_DOUBLE_EQ(flat.unsharded_grad_bytes, (24 + 3 * 1000) * 4.0);
  EXPECT_DOUBLE_EQ(flat.collective_buffer_bytes, 2 * 250 * 4.0);
  in.layout = fsdp::ParamLayout::per_parameter;
  const auto per_parameter = fsdp::plan_sharded_memory(in);
  // Gathered sizes: a unit 4 x 3 rows of 100 (10 rows padded to 12), the root 4 x 1 row of 12.
  EXPECT_DOUBLE_EQ(per_parameter.unsharded_grad_bytes, (48 + 1200) * 4.0);
  // Two inputs and outputs in flight, and the all-gather output beside the unit.
  EXPECT_DOUBLE_EQ(per_parameter.collective_buffer_bytes, (2 * 1200 + 2 * 300 + 1200) * 4.0);
}

TEST(PlanArithmetic, UnevenShardsTakeTheLargestRank) {
  auto in = two_units(3, fsdp::ShardingStrategy::FULL_SHARD);
  EXPECT_EQ(fsdp::shard_unit(in.units[0], fsdp::ParamLayout::flat, 3).shard, 334);  // 1000 padded to 1002
  EXPECT_EQ(fsdp::shard_unit(in.units[0], fsdp::ParamLayout::per_parameter, 3).shard, 400);  // 4 of 10 rows
  EXPECT_EQ(fsdp::shard_unit(in.units[0], fsdp::ParamLayout::per_parameter, 3).gathered, 1200);
}

TEST(PlanArithmetic, MixedPrecisionGathersAndReducesInHalfKeepsFp32Master) {
  auto in = two_units(2, fsdp::ShardingStrategy::FULL_SHARD);
  in.compute_dtype = in.reduce_dtype = c10::ScalarType::BFloat16;
  auto layout = fsdp::plan_sharded_memory(in);
  EXPECT_DOUBLE_EQ(layout.param_bytes, 1012 * 4.0);
  EXPECT_DOUBLE_EQ(layout.gathered_bytes, (24 + 2 * 1000) * 2.0);
  EXPECT_DOUBLE_EQ(sent(layout), 0.5 * (2024 + 1000 + 2024) * 2.0);
}

// Over Gloo a reduce-scatter receives every rank's copy of its chunk (an all-to-all) and a list
// all-gather is staged; NCCL reduces from the input and gathers into the unit itself. Every
// transport writes each reduction's output, a shard (500 elements here).
TEST(PlanArithmetic, NcclNeedsNoReceiveNorStagingBuffers) {
  auto in = two_units(2, fsdp::ShardingStrategy::FULL_SHARD);
  in.transport = fsdp::PlannedTransport::gloo;
  // Two reductions of the largest unit (1,000 fp32) in flight, and one staged all-gather.
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).collective_buffer_bytes, (2 * 1000 + 1000 + 2 * 500) * 4.0);
  in.transport = fsdp::PlannedTransport::nccl;
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).collective_buffer_bytes, 2 * 500 * 4.0);
  // Reduced in fp32 from bf16 gradients: the cast input is a buffer of its own, whatever the
  // transport; and so are the bf16 copies of the shards that the all-gathers send.
  in.compute_dtype = c10::ScalarType::BFloat16;
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).collective_buffer_bytes,
                   2 * 1000 * 4.0 + 2 * 500 * 2.0 + 2 * 500 * 4.0);
  // Shared memory: the same, plus the shard group's segment; NCCL has none.
  in.transport = fsdp::PlannedTransport::shared_memory;
  EXPECT_DOUBLE_EQ(fsdp::plan_sharded_memory(in).collective_buffer_bytes,
                   2 * 1000 * 4.0 + 2 * 500 * 2.0 + 2 * 500 * 4.0 + tessera::core::shared_memory_segment_bytes(2));
}

// A CUDA job: the model state, gathered units, collective buffers and activations are device
// rows with a peak of their own; the host holds the baseline and the trainer. cpu_offload
// keeps the shards, their gradients and the optimizer state on the host.
TEST(PlanArithmetic, CudaJobsPlanDeviceAndHostApart) {
  host::PlanInputs in;
  in.strategy = "fsdp";
  in.layout = fsdp::plan_sharded_memory(two_units(2, fsdp::ShardingStrategy::FULL_SHARD));
  in.baseline_bytes = 1000;
  in.runtime_bytes = 300;
  in.activation_bytes = 500;
  in.cuda = true;
  in.cublas_workspace_bytes = 64;
  host::MemoryPlan plan = host::make_plan(in);
  EXPECT_TRUE(std::any_of(plan.rows.begin(), plan.rows.end(), [](const host::PlanRow& r) {
    return r.name == "cuBLAS workspace" && r.bytes == 2 * 64 && r.on_device;  // forward's thread and backward's
  }));
  double device = 0, host_rows = 0;
  for (const auto& r : plan.rows) {
    (r.on_device ? device : host_rows) += r.bytes;
    EXPECT_EQ(r.on_device, r.name != "trainer runtime") << r.name;
  }
  EXPECT_TRUE(plan.cuda);
  EXPECT_DOUBLE_EQ(plan.device_peak, device);
  EXPECT_DOUBLE_EQ(host_rows, 300);
  EXPECT_DOUBLE_EQ(plan.training_peak, 1000 + 300);
  EXPECT_DOUBLE_EQ(plan.baseline, 1000);
  // The host's warning counts host rows only.
  EXPECT_EQ(host::memory_warning(plan, plan.job_bytes + 1, 1), "");
  const std::string warning = host::memory_warning(plan, plan.job_bytes / 2, 1);
  EXPECT_NE(warning.find("trainer runtime"), std::string::npos) << warning;
  EXPECT_EQ(warning.find("activations"), std::string::npos) << warning;

  in.cpu_offload = true;
  host::MemoryPlan offloaded = host::make_plan(in);
  double state = 0;
  for (const auto& r : offloaded.rows) {
    const bool is_state = r.name == "parameters" || r.name == "gradients" || r.name == "optimizer state";
    EXPECT_EQ(r.on_device, !is_state && r.name != "trainer runtime") << r.name;
    if (is_state) state += r.bytes;
  }
  EXPECT_GT(state, 0);
  EXPECT_DOUBLE_EQ(offloaded.device_peak, plan.device_peak - state);
  EXPECT_DOUBLE_EQ(offloaded.training_peak, plan.training_peak + state);
  // Offloaded gradients stay in host memory: freeing device gradients changes nothing there.
  in.gradients_freed_after_step = true;
  EXPECT_DOUBLE_EQ(host::make_plan(in).device_peak, offloaded.device_peak);
  // A CPU job has no device rows, and no cuBLAS workspace.
  in.cuda = in.cpu_offload = false;
  host::MemoryPlan cpu = host::make_plan(in);
  EXPECT_DOUBLE_EQ(cpu.device_peak, 0);
  EXPECT_TRUE(std::none_of(cpu.rows.begin(), cpu.rows.end(), [](const host::PlanRow& r) { return r.name == "cuBLAS workspace"; }));
}

// fsdp and fsdp2 free a CUDA job's sharded gradients after each step; backward allocates them
// unit by unit as it frees the units' activations, so the device peak holds the larger of the
// two, not their sum (the 1.3B bench GPT on an H200: 24,104 MB measured, 27,730 planned as a
// sum). Without traced activations the gradients stay: backward's end holds them all.
TEST(PlanArithmetic, FreedGradientsAndActivationsDoNotPeakTogetherOnTheDevice) {
  host::PlanInputs in;
  in.strategy = "fsdp";
  in.layout = fsdp::plan_sharded_memory(two_units(2, fsdp::ShardingStrategy::FULL_SHARD));
  in.cuda = true;
  const double gradients = in.layout->grad_bytes;
  ASSERT_GT(gradients, 0);
  for (const double activations : {0.0, gradients / 2, gradients * 3}) {
    in.activation_bytes = activations;
    in.gradients_freed_after_step = false;
    const host::MemoryPlan summed = host::make_plan(in);
    in.gradients_freed_after_step = true;
    const host::MemoryPlan freed = host::make_plan(in);
    EXPECT_DOUBLE_EQ(freed.device_peak, summed.device_peak - std::min(gradients, activations)) << activations;
    EXPECT_DOUBLE_EQ(freed.training_peak, summed.training_peak) << "host rows unchanged";
    const bool noted = std::any_of(freed.notes.begin(), freed.notes.end(), [](const std::string& n) {
      return n.find("do not peak together") != std::string::npos;
    });
    EXPECT_TRUE(noted);
  }
}

// LibTorch's cuBLAS workspace (at::cuda's parseChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG's
// KiB x count segments, else 32 MiB from compute capability 9 on (and for an unseen GPU), 8 MiB
// + 128 KiB before. The 6 x 384 GPT in 32-true on an H200 measured 380 MB, planned 352 without it.
TEST(PlanArithmetic, CublasWorkspaceFollowsLibTorchsDefaultsAndItsVariable) {
  const double MiB = 1048576.0, KiB = 1024.0;
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(nullptr, 9), 32 * MiB);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(nullptr, 12), 32 * MiB);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(nullptr, -1), 32 * MiB);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(nullptr, 8), 8 * MiB + 128 * KiB);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(":4096:8", 8), 32 * MiB);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(":4096:2:16:8", 9), 8 * MiB + 128 * KiB);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes(":0:0", 9), 0);
  EXPECT_DOUBLE_EQ(host::cublas_workspace_bytes("four megabytes", 8), 8 * MiB + 128 * KiB);  // LibTorch warns, keeps its default
}

TEST(PlanArithmetic, PlanSumsRowsAndWarnsAboveAvailableMemory) {
  host::PlanInputs in;
  in.strategy = "fsdp";
  in.layout = fsdp::plan_sharded_memory(two_units(4, fsdp::ShardingStrategy::FULL_SHARD));
  in.local_ranks = 4;
  in.world_size = 4;
  in.baseline_bytes = 1000;
  in.activation_bytes = 500;
  host::MemoryPlan plan = host::make_plan(in);
  ASSERT_TRUE(plan.known);
  double rows = 0;
  for (const auto& r : plan.rows) rows += r.bytes;
  EXPECT_DOUBLE_EQ(plan.training_peak, 1000 + rows);
  EXPECT_DOUBLE_EQ(plan.job_bytes, 4 * plan.peak);
  // AdamW: two moments per element the optimizer steps on.
  for (const auto& r : plan.rows)
    if (r.name == "optimizer state") EXPECT_DOUBLE_EQ(r.bytes, 2 * 506 * 4.0);
  EXPECT_EQ(host::memory_warning(plan, plan.job_bytes + 1, 4), "");
  EXPECT_NE(host::memory_warning(plan, plan.job_bytes / 2, 4).find("warning: the memory plan needs"), std::string::npos);
  // A strategy that does not describe its layout: said so, no made-up figures.
  in.layout.reset();
  plan = host::make_plan(in);
  EXPECT_FALSE(plan.known);
  ASSERT_FALSE(plan.notes.empty());
  EXPECT_NE(plan.notes[0].find("does not implement sdk::StrategyMemoryLayout"), std::string::npos);
}

// Lightning's scale_batch_size, predicted: the largest batch whose plan fits, the activations
// traced for 4 samples scaled per sample; host memory for every local rank, a CUDA job's device too.
TEST(PlanArithmetic, LargestBatchSizeIsTheLastThatFits) {
  host::PlanInputs in;
  in.strategy = "fsdp";
  in.layout = fsdp::plan_sharded_memory(two_units(2, fsdp::ShardingStrategy::FULL_SHARD));
  in.local_ranks = 2;
  in.baseline_bytes = 100000;
  in.activation_bytes = 4 * 5000.0;  // traced for 4 samples
  const host::MemoryPlan traced = host::make_plan(in);
  ASSERT_GT(traced.training_peak, traced.setup_peak);
  const double per_rank_without_activations = traced.peak - in.activation_bytes;
  const double room_for_10 = 2 * (per_rank_without_activations + 10 * 5000.0);
  EXPECT_EQ(host::largest_batch_size(in, 4, room_for_10, -1), 10);
  EXPECT_EQ(host::largest_batch_size(in, 4, room_for_10 - 1, -1), 9);
  EXPECT_EQ(host::largest_batch_size(in, 4, 2 * per_rank_without_activations - 1, -1), 0);  // not one sample
  EXPECT_EQ(host::largest_batch_size(in, 4, -1, -1), std::int64_t{1} << 20);                // nothing bounds it

  in.cuda = true;  // the activations are device memory: the GPU bounds the batch, the host does not
  const double device_without_activations = host::make_plan(in).device_peak - in.activation_bytes;
  EXPECT_EQ(host::largest_batch_size(in, 4, 1e12, device_without_activations + 7 * 5000.0), 7);
  EXPECT_EQ(host::largest_batch_size(in, 4, 1e12, device_without_activations + 7 * 5000.0 - 1), 6);
  host::MemoryPlan plan = host::make_plan(in);
  plan.largest_batch_size = 0;
  EXPECT_NE(host::memory_warning(plan, 1, 2).find("lower [data] batch_size (even 1 does not fit)"), std::string::npos);
  plan.largest_batch_size = 6;
  EXPECT_NE(host::memory_warning(plan, 1, 2).find("lower [data] batch_size (at most 6 fits)"), std::string::npos);
}

}  // namespace
