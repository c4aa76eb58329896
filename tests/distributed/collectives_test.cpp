// Collectives over real Gloo process groups, with and without the shared-memory channel beside
// them (comm/shared_memory_channel.hpp), and in two levels over ranks that play several hosts
// (comm/hierarchical_collectives.hpp), against a serial computation of the same result.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>

#include "multiprocess.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/sdk/error.hpp"

namespace {

using tessera::core::make_communicator;
using tessera::sdk::ReduceOp;

/// Rank r's deterministic input of `n` elements.
at::Tensor input_of(std::int64_t rank, std::int64_t n, at::ScalarType dtype) {
  return (at::arange(n, at::kFloat) * 0.25 + static_cast<double>(rank) * 10 - 3).to(dtype);
}

/// (world size, shared memory, hosts): every test runs over Gloo alone, with the shared-memory
/// channel, and with ranks r and r + hosts on one host (rank % hosts: a host's ranks are not
/// consecutive), which makes the gathers and reductions two-level.
class Collectives : public ::testing::TestWithParam<std::tuple<int, bool, int>> {
 protected:
  /// The world group of this test's transport.
  static tessera::core::CommunicatorPtr world_group(const tessera::sdk::ClusterInfo& cluster) {
    tessera::core::CommSettings settings;
    settings.shared_memory = std::get<1>(GetParam());
    tessera::core::set_comm_settings(settings);
    if (const int hosts = std::get<2>(GetParam()); hosts > 1)
      ::setenv("TESSERA_TEST_HOST_ID", std::to_string(cluster.global_rank % hosts).c_str(), 1);
    auto comm = make_communicator(cluster, c10::kCPU);
    if (std::get<2>(GetParam()) > 1)
      EXPECT_NE(tessera::core::world_transport().find("two levels: shared memory among the " +
                                                      std::to_string(std::get<0>(GetParam()) / std::get<2>(GetParam())) +
                                                      " ranks of each of " + std::to_string(std::get<2>(GetParam())) +
                                                      " hosts, Gloo across hosts"),
                std::string::npos)
          << tessera::core::world_transport();
    return comm;
  }
  /// Whether the channel must have carried the reductions and gathers.
  static bool expects_shared_memory() { return std::get<1>(GetParam()) && std::get<0>(GetParam()) > 1; }
};

TEST_P(Collectives, MatchSerialComputation) {
  const int world = std::get<0>(GetParam());
  tessera::testing::run_ranks(world, std::chrono::seconds(60), [&](const tessera::sdk::ClusterInfo& cluster) {
    auto comm = world_group(cluster);
    const std::int64_t rank = comm->rank();
    ASSERT_EQ(comm->size(), world);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const double tol = dtype == at::kFloat ? 1e-6 : 1e-1;
      const std::int64_t n = 7;  // a shard size: flat sizes world*7 are padded shards of odd totals
      // all_gather into one flat tensor
      at::Tensor gathered = at::empty({world * n}, dtype);
      comm->all_gather(gathered, input_of(rank, n, dtype), "test all_gather")->wait();
      std::vector<at::Tensor> expected_parts;
      for (int r = 0; r < world; ++r) expected_parts.push_back(input_of(r, n, dtype));
      EXPECT_TRUE(at::equal(gathered, at::cat(expected_parts))) << "all_gather " << dtype;

      // reduce_scatter (sum and mean) from one flat tensor
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean, ReduceOp::max}) {
        at::Tensor shard = at::empty({n}, dtype);
        comm->reduce_scatter(shard, input_of(rank, world * n, dtype), op, "test reduce_scatter")->wait();
        at::Tensor all = at::stack([&] {
          std::vector<at::Tensor> v;
          for (int r = 0; r < world; ++r) v.push_back(input_of(r, world * n, dtype).to(at::kFloat));
          return v;
        }());
        at::Tensor reduced = op == ReduceOp::max ? std::get<0>(all.max(0)) : all.sum(0);
        if (op == ReduceOp::mean) reduced = reduced / world;
        EXPECT_TRUE(at::allclose(shard.to(at::kFloat), reduced.narrow(0, rank * n, n), tol, tol))
            << "reduce_scatter " << dtype << " op " << static_cast<int>(op);
      }

      // all_reduce in place
      at::Tensor t = input_of(rank, 5, dtype);
      comm->all_reduce(t, ReduceOp::sum, "test all_reduce")->wait();
      at::Tensor sum = at::zeros({5}, at::kFloat);
      for (int r = 0; r < world; ++r) sum += input_of(r, 5, dtype).to(at::kFloat);
      EXPECT_TRUE(at::allclose(t.to(at::kFloat), sum, tol, tol)) << "all_reduce " << dtype;

      // broadcast from the last rank
      at::Tensor b = input_of(rank, 3, dtype);
      comm->broadcast(b, world - 1, "test broadcast")->wait();
      EXPECT_TRUE(at::equal(b, input_of(world - 1, 3, dtype))) << "broadcast " << dtype;
      // and of a 0-dim tensor (a bf16 one went to Gloo as bytes through a view 0-dim tensors refuse)
      at::Tensor scalar = input_of(rank, 1, dtype).squeeze();
      comm->broadcast(scalar, world - 1, "test broadcast 0-dim")->wait();
      EXPECT_EQ(scalar.dim(), 0);
      EXPECT_TRUE(at::equal(scalar, input_of(world - 1, 1, dtype).squeeze())) << "0-dim broadcast " << dtype;
    }

    // Asynchronous: two collectives in flight, then compute, then wait.
    at::Tensor a = at::ones({1000}), c = at::full({1000}, 2.0);
    auto h1 = comm->all_reduce(a, ReduceOp::sum, "async 1");
    auto h2 = comm->all_reduce(c, ReduceOp::sum, "async 2");
    at::Tensor busy = at::mm(at::ones({64, 64}), at::ones({64, 64}));
    h1->wait();
    h2->wait();
    EXPECT_EQ(a[0].item<float>(), world);
    EXPECT_EQ(c[999].item<float>(), 2.0 * world);
    EXPECT_EQ(comm->stats().all_gather_bytes, (world - 1) * (7 * 4 + 7 * 2));  // one fp32 and one bf16 gather
    // 2 gathers, 6 reduce-scatters, 2 + 2 all-reduces; broadcasts stay on Gloo.
    EXPECT_EQ(comm->stats().shared_memory_calls, expects_shared_memory() ? 12 : 0);

    // split into {even ranks} and {odd ranks}
    std::vector<std::vector<std::int64_t>> groups(2);
    for (int r = 0; r < world; ++r) groups[r % 2].push_back(r);
    if (world == 1) groups.pop_back();
    auto sub = comm->split(groups);
    at::Tensor s = at::full({1}, static_cast<double>(rank));
    sub->all_reduce(s, ReduceOp::sum, "test split")->wait();
    double expected = 0;
    for (std::int64_t r : groups[rank % 2]) expected += static_cast<double>(r);
    EXPECT_EQ(s.item<double>(), expected);
    comm->barrier("end");
  });
}

/// Flat buffers whose true size does not divide by the world size: callers pad to a
/// multiple (as FSDP's flat parameters do), and the padding must not leak into the result.
TEST_P(Collectives, PaddedFlatBuffersAllToAllAndReductions) {
  const int world = std::get<0>(GetParam());
  tessera::testing::run_ranks(world, std::chrono::seconds(60), [&](const tessera::sdk::ClusterInfo& cluster) {
    auto comm = world_group(cluster);
    const std::int64_t rank = comm->rank();
    std::int64_t expected_rs_bytes = 0;
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const double tol = dtype == at::kFloat ? 1e-6 : 5e-2;
      for (std::int64_t total : {1, 5, 23, 1001}) {
        const std::int64_t shard_numel = (total + world - 1) / world;
        const std::int64_t padded = shard_numel * world;
        // Every rank holds the same full tensor, padded with zeros; shard r is its r-th chunk.
        at::Tensor full = (at::arange(total, at::kFloat) * 0.5 - 7).to(dtype);
        at::Tensor flat = at::zeros({padded}, dtype);
        flat.narrow(0, 0, total).copy_(full);
        at::Tensor gathered = at::full({padded}, 99.0, dtype);
        comm->all_gather(gathered, flat.narrow(0, rank * shard_numel, shard_numel), "padded all_gather")->wait();
        EXPECT_TRUE(at::equal(gathered.narrow(0, 0, total), full)) << "total " << total << " " << dtype;
        EXPECT_TRUE(at::equal(gathered.narrow(0, total, padded - total), at::zeros({padded - total}, dtype)));

        // Gradients: rank r contributes (r + 1) * full; the shard is the sum's r-th chunk.
        at::Tensor grad = flat * static_cast<double>(rank + 1);
        at::Tensor shard = at::empty({shard_numel}, dtype);
        comm->reduce_scatter(shard, grad, ReduceOp::sum, "padded reduce_scatter")->wait();
        expected_rs_bytes += (world - 1) * shard_numel * static_cast<std::int64_t>(shard.element_size());
        at::Tensor expected = flat.to(at::kFloat) * (world * (world + 1) / 2.0);
        EXPECT_TRUE(at::allclose(shard.to(at::kFloat), expected.narrow(0, rank * shard_numel, shard_numel), tol, tol))
            << "total " << total << " " << dtype;
      }

      // all_to_all: chunk r of rank q's input lands in chunk q of rank r's output.
      const std::int64_t chunk = 3;
      at::Tensor input = (at::arange(world * chunk, at::kFloat) + 100.0 * rank).to(dtype);
      at::Tensor output = at::empty({world * chunk}, dtype);
      comm->all_to_all(output, input, "all_to_all")->wait();
      for (int q = 0; q < world; ++q) {
        at::Tensor from_q = (at::arange(world * chunk, at::kFloat) + 100.0 * q).narrow(0, rank * chunk, chunk);
        EXPECT_TRUE(at::equal(output.narrow(0, q * chunk, chunk), from_q.to(dtype))) << "from rank " << q;
      }

      // all_reduce mean and min, in place, fp32 accumulation for bf16.
      at::Tensor m = at::full({4}, static_cast<double>(rank), dtype);
      comm->all_reduce(m, ReduceOp::mean, "mean")->wait();
      EXPECT_NEAR(m[0].item<double>(), (world - 1) / 2.0, tol);
      at::Tensor lo = at::full({2}, static_cast<double>(rank + 3), dtype);
      comm->all_reduce(lo, ReduceOp::min, "min")->wait();
      EXPECT_EQ(lo[1].item<double>(), 3.0);
    }
    EXPECT_EQ(comm->stats().reduce_scatter_bytes, expected_rs_bytes)
        << "reduce_scatter puts (world - 1) shards on the wire per call";
    comm->barrier("end");
  });
}

/// Several collectives of different kinds in flight at once, waited in reverse order, with
/// compute in between; and a 2-D split (rows and columns, as a DP x TP mesh needs).
TEST_P(Collectives, AsyncOverlapAndTwoDimensionalSplit) {
  const int world = std::get<0>(GetParam());
  tessera::testing::run_ranks(world, std::chrono::seconds(60), [&](const tessera::sdk::ClusterInfo& cluster) {
    auto comm = world_group(cluster);
    const std::int64_t rank = comm->rank();
    const std::int64_t n = 1 << 16;
    at::Tensor gathered = at::empty({world * n});
    at::Tensor shard = at::empty({n});
    at::Tensor summed = at::full({n}, static_cast<double>(rank));
    auto h1 = comm->all_gather(gathered, at::full({n}, static_cast<double>(rank)), "overlap all_gather");
    auto h2 = comm->reduce_scatter(shard, at::ones({world * n}), ReduceOp::sum, "overlap reduce_scatter");
    auto h3 = comm->all_reduce(summed, ReduceOp::sum, "overlap all_reduce");
    at::Tensor busy = at::mm(at::rand({128, 128}), at::rand({128, 128}));  // compute while they run
    h3->wait();
    h2->wait();
    h1->wait();
    EXPECT_EQ(busy.size(0), 128);
    for (int r = 0; r < world; ++r) EXPECT_EQ(gathered[r * n + n - 1].item<float>(), r);
    EXPECT_EQ(shard[n - 1].item<float>(), world);
    EXPECT_EQ(summed[0].item<float>(), world * (world - 1) / 2.0);

    // Rows {0,1},{2,3}; columns {0,2},{1,3} (for world 2: one row, two columns; 1 and 3: rows of one).
    const int width = world % 2 == 0 ? 2 : 1;
    std::vector<std::vector<std::int64_t>> rows, columns(width);
    for (int r = 0; r < world; ++r) {
      if (r % width == 0) rows.emplace_back();
      rows.back().push_back(r);
      columns[r % width].push_back(r);
    }
    auto row = comm->split(rows);
    auto column = comm->split(columns);
    EXPECT_EQ(row->size(), width);
    EXPECT_EQ(column->size(), world / width);
    at::Tensor row_sum = at::full({1}, static_cast<double>(rank));
    row->all_reduce(row_sum, ReduceOp::sum, "row")->wait();
    at::Tensor column_gather = at::empty({column->size()});
    column->all_gather(column_gather, at::full({1}, static_cast<double>(rank)), "column")->wait();
    double expected_row = 0;
    for (std::int64_t r : rows[rank / width]) expected_row += static_cast<double>(r);
    EXPECT_EQ(row_sum.item<double>(), expected_row);
    for (std::int64_t i = 0; i < column->size(); ++i)
      EXPECT_EQ(column_gather[i].item<double>(), static_cast<double>(columns[rank % width][i]));
    comm->barrier("end");
  });
}

/// Messages larger than a shared-memory slot (several rounds, sizes that divide nothing),
/// collectives in place (the input is the output's own chunk, as FSDP gathers and reduces its
/// flat buffers), every dtype the reductions take, and all-reduce results identical in every bit
/// on every rank (DDP's replicas must not drift apart).
class LargeCollectives : public Collectives {};  // fewer two-level layouts: each runs for seconds

TEST_P(LargeCollectives, LargeMessagesInPlaceEveryDtypeSameBitsOnEveryRank) {
  const int world = std::get<0>(GetParam());
  tessera::testing::run_ranks(world, std::chrono::seconds(90), [&](const tessera::sdk::ClusterInfo& cluster) {
    auto comm = world_group(cluster);
    const std::int64_t rank = comm->rank();
    // Bounded values (a wrong sum is off by far more than the tolerance), different per rank.
    auto wave = [](std::int64_t r, std::int64_t numel, at::ScalarType dtype) {
      return (at::sin(at::arange(numel, at::kDouble) * (r + 1)) * 100).to(dtype);
    };
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const double tol = dtype == at::kFloat ? 1e-3 : 2.0;
      const std::int64_t n = 600001;  // 2.4 MB of fp32 per rank: past one 2 MiB slot
      // In-place all-gather: this rank's shard already sits in its chunk of the output.
      at::Tensor gathered = at::zeros({world * n}, dtype);
      gathered.narrow(0, rank * n, n).copy_(wave(rank, n, dtype));
      comm->all_gather(gathered, gathered.narrow(0, rank * n, n), "in-place all_gather")->wait();
      for (int r = 0; r < world; ++r)
        EXPECT_TRUE(at::equal(gathered.narrow(0, r * n, n), wave(r, n, dtype))) << "chunk " << r << " " << dtype;

      // In-place reduce-scatter: the output is this rank's chunk of the input.
      at::Tensor grads = wave(rank, world * n, dtype);
      at::Tensor shard = grads.narrow(0, rank * n, n);
      comm->reduce_scatter(shard, grads, ReduceOp::sum, "in-place reduce_scatter")->wait();
      at::Tensor sum = at::zeros({n}, at::kFloat);
      for (int r = 0; r < world; ++r) sum += wave(r, world * n, dtype).to(at::kFloat).narrow(0, rank * n, n);
      EXPECT_TRUE(at::allclose(shard.to(at::kFloat), sum, tol, tol)) << "reduce_scatter " << dtype;
    }

    struct Case {
      at::ScalarType dtype;
      ReduceOp op;
      std::int64_t numel;
    };
    for (const Case& c : {Case{at::kDouble, ReduceOp::sum, 700001}, Case{at::kFloat, ReduceOp::mean, 1100003},
                          Case{at::kHalf, ReduceOp::mean, 5003}, Case{at::kLong, ReduceOp::max, 300007},
                          Case{at::kInt, ReduceOp::min, 9}, Case{at::kBFloat16, ReduceOp::sum, 1048577}}) {
      at::Tensor t = (wave(rank, c.numel, at::kDouble) * 10).to(c.dtype);
      comm->all_reduce(t, c.op, "all_reduce")->wait();
      at::Tensor again = (wave(rank, c.numel, at::kDouble) * 10).to(c.dtype);
      comm->all_reduce(again, c.op, "all_reduce again")->wait();
      EXPECT_TRUE(at::equal(again, t)) << "the same all_reduce gave other bits the second time: " << c.dtype;
      at::Tensor rows = at::stack([&] {
        std::vector<at::Tensor> v;
        for (int r = 0; r < world; ++r) v.push_back((wave(r, c.numel, at::kDouble) * 10).to(c.dtype).to(at::kDouble));
        return v;
      }());
      at::Tensor expected = c.op == ReduceOp::max   ? std::get<0>(rows.max(0))
                            : c.op == ReduceOp::min ? std::get<0>(rows.min(0))
                                                    : rows.sum(0) / (c.op == ReduceOp::mean ? world : 1);
      const double tol = c.dtype == at::kHalf || c.dtype == at::kBFloat16 ? 8.0 : 1e-3;
      EXPECT_TRUE(at::allclose(t.to(at::kDouble), expected, tol, tol)) << "all_reduce " << c.dtype;
      at::Tensor everyone = at::empty({world * c.numel}, c.dtype);
      comm->all_gather(everyone, t, "compare results")->wait();
      for (int r = 0; r < world; ++r)
        EXPECT_TRUE(at::equal(everyone.narrow(0, r * c.numel, c.numel), t)) << "rank " << r << "'s " << c.dtype << " result differs";
    }
    comm->barrier("end");
  });
}

std::string transport_name(const ::testing::TestParamInfo<std::tuple<int, bool, int>>& info) {
  const auto [world, shared_memory, hosts] = info.param;
  return std::to_string(world) + (hosts > 1 ? "_two_levels_on_" + std::to_string(hosts) + "_hosts"
                                  : shared_memory ? "_shared_memory" : "_gloo");
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool(), ::testing::Values(1)),
                         transport_name);
// 2 hosts x 2 ranks, 2 x 3 and 3 x 2: pieces and chunks that divide nothing on either level.
INSTANTIATE_TEST_SUITE_P(TwoLevels, Collectives,
                         ::testing::Values(std::make_tuple(4, true, 2), std::make_tuple(6, true, 2),
                                           std::make_tuple(6, true, 3)),
                         transport_name);
INSTANTIATE_TEST_SUITE_P(WorldSizes, LargeCollectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool(), ::testing::Values(1)),
                         transport_name);
INSTANTIATE_TEST_SUITE_P(TwoLevels, LargeCollectives, ::testing::Values(std::make_tuple(4, true, 2)), transport_name);

TEST(Collectives, LocalCommunicatorIsTheIdentity) {
  auto comm = tessera::core::make_local_communicator();
  at::Tensor out = at::empty({4});
  comm->all_gather(out, at::arange(4, at::kFloat), "local")->wait();
  EXPECT_TRUE(at::equal(out, at::arange(4, at::kFloat)));
}

TEST(Collectives, HungRankBecomesATimeoutNamingTheCollective) {
  tessera::testing::run_ranks(2, std::chrono::seconds(60), [&](const tessera::sdk::ClusterInfo& cluster) {
    tessera::sdk::ClusterInfo c = cluster;
    c.collective_timeout_s = 3;
    auto comm = make_communicator(c, c10::kCPU);
    if (comm->rank() == 1) {  // rank 1 stays alive but never joins the collective
      std::this_thread::sleep_for(std::chrono::seconds(6));
      return;
    }
    at::Tensor t = at::ones({4});
    auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t, ReduceOp::sum, "backward reduce-scatter of blocks.3")->wait();
      ADD_FAILURE() << "the collective should have timed out";
    } catch (const tessera::sdk::Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("rank 0: backward reduce-scatter of blocks.3 timed out after 3 s"), std::string::npos)
          << message;
    }
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(waited, 2.5);
    EXPECT_LT(waited, 5.5);
  });
}

/// A rank that exits while its peer waits in a collective: the peer fails at once, not after the
/// collective timeout, over Gloo (the socket closes) and over shared memory (the pid is gone).
class PeerExit : public ::testing::TestWithParam<bool> {};

TEST_P(PeerExit, FailsTheWaitingRankWithinSecondsNotAtTheTimeout) {
  tessera::testing::run_ranks(2, std::chrono::seconds(90), [&](const tessera::sdk::ClusterInfo& cluster) {
    tessera::sdk::ClusterInfo c = cluster;
    c.collective_timeout_s = 40;
    tessera::core::CommSettings settings;
    settings.shared_memory = GetParam();
    tessera::core::set_comm_settings(settings);
    auto comm = make_communicator(c, c10::kCPU);
    at::Tensor t = at::ones({1 << 20});
    comm->all_reduce(t, ReduceOp::sum, "before")->wait();
    EXPECT_EQ(comm->stats().shared_memory_calls, GetParam() ? 1 : 0);
    comm->barrier("both here");
    if (comm->rank() == 1) std::_Exit(0);  // gone without a word, as a crashed process
    auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce(t, ReduceOp::sum, "gradient all-reduce of bucket 0")->wait();
      ADD_FAILURE() << "the collective should have failed";
    } catch (const tessera::sdk::Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("rank 0: gradient all-reduce of bucket 0 failed"), std::string::npos) << message;
      if (GetParam()) EXPECT_NE(message.find("rank 1 (pid "), std::string::npos) << message;
    }
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 10.0);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, PeerExit, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "shared_memory" : "gloo"; });

}  // namespace
