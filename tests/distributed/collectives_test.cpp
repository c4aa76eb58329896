// Collectives over real Gloo process groups against a serial computation of the same result.
#include <gtest/gtest.h>

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

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, MatchSerialComputation) {
  const int world = GetParam();
  tessera::testing::run_ranks(world, std::chrono::seconds(60), [&](const tessera::sdk::ClusterInfo& cluster) {
    auto comm = make_communicator(cluster, c10::kCPU);
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

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4));

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
    if (comm->rank() == 1) return;  // rank 1 never joins the collective
    at::Tensor t = at::ones({4});
    try {
      comm->all_reduce(t, ReduceOp::sum, "backward reduce-scatter of blocks.3")->wait();
      ADD_FAILURE() << "the collective should have timed out";
    } catch (const tessera::sdk::Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("rank 0: backward reduce-scatter of blocks.3"), std::string::npos) << message;
    }
  });
}

}  // namespace
