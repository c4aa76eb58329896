// The in-process fake communicator (tests/support) against the real Gloo communicator: the
// same script of collectives, on the same inputs, gives the same results and byte counts.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "fake_communicator.hpp"
#include "multiprocess.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/sdk/error.hpp"
#include "errors.hpp"

namespace {

using tessera::core::Communicator;
using tessera::core::CommunicatorPtr;
using tessera::sdk::ReduceOp;
using tessera::testing::run_fake_ranks;

at::Tensor input_of(std::int64_t rank, std::int64_t n, at::ScalarType dtype) {
  return (at::arange(n, at::kFloat) * 0.25 + static_cast<double>(rank) * 10 - 3).to(dtype);
}

/// Every collective of the Communicator interface, in both dtypes, with two in flight at
/// once and a split; returns each result (and the byte counts) in call order.
std::vector<at::Tensor> script(Communicator& comm) {
  const std::int64_t rank = comm.rank(), world = comm.size();
  std::vector<at::Tensor> out;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor gathered = at::empty({world * 7}, dtype);
    comm.all_gather(gathered, input_of(rank, 7, dtype), "all_gather")->wait();
    out.push_back(gathered);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean, ReduceOp::max, ReduceOp::min}) {
      at::Tensor shard = at::empty({5}, dtype);
      comm.reduce_scatter(shard, input_of(rank, world * 5, dtype) * (rank + 1), op, "reduce_scatter")->wait();
      out.push_back(shard);
      at::Tensor t = input_of(rank, 6, dtype) * (rank % 2 ? -1 : 1);
      comm.all_reduce(t, op, "all_reduce")->wait();
      out.push_back(t);
    }
    at::Tensor b = input_of(rank, 3, dtype);
    comm.broadcast(b, world - 1, "broadcast")->wait();
    out.push_back(b);
    at::Tensor exchanged = at::empty({world * 2}, dtype);
    comm.all_to_all(exchanged, input_of(rank, world * 2, dtype), "all_to_all")->wait();
    out.push_back(exchanged);
  }
  // Two in flight, waited in reverse order; the input changes after the start.
  at::Tensor a = at::full({4}, static_cast<double>(rank)), g = at::empty({world * 2});
  at::Tensor source = at::full({2}, static_cast<double>(rank + 1));
  auto h1 = comm.all_reduce(a, ReduceOp::sum, "async all_reduce");
  auto h2 = comm.all_gather(g, source, "async all_gather");
  h2->wait();
  h1->wait();
  out.push_back(a);
  out.push_back(g);
  // Even and odd ranks.
  std::vector<std::vector<std::int64_t>> groups(world > 1 ? 2 : 1);
  for (std::int64_t r = 0; r < world; ++r) groups[r % 2].push_back(r);
  CommunicatorPtr sub = comm.split(groups);
  at::Tensor s = at::full({1}, static_cast<double>(rank));
  sub->all_reduce(s, ReduceOp::sum, "split all_reduce")->wait();
  out.push_back(s);
  out.push_back(at::tensor(std::vector<std::int64_t>{sub->rank(), sub->size()}));
  comm.barrier("end");
  const auto& st = comm.stats();
  out.push_back(at::tensor(std::vector<std::int64_t>{st.all_gather_bytes, st.reduce_scatter_bytes, st.all_reduce_bytes,
                                                     st.broadcast_bytes, st.all_to_all_bytes, st.calls}));
  return out;
}

class FakeCommunicator : public ::testing::TestWithParam<int> {};

TEST_P(FakeCommunicator, SameResultsAsGloo) {
  const int world = GetParam();
  tessera::testing::run_ranks(world, std::chrono::seconds(90), [&](const tessera::sdk::ClusterInfo& cluster) {
    auto gloo = tessera::core::make_communicator(cluster, c10::kCPU);
    std::vector<at::Tensor> expected = script(*gloo);
    std::vector<at::Tensor> fake;
    run_fake_ranks(world, [&](CommunicatorPtr comm) {
      std::vector<at::Tensor> mine = script(*comm);
      if (comm->rank() == cluster.global_rank) fake = mine;
    });
    ASSERT_EQ(fake.size(), expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(fake[i].scalar_type(), expected[i].scalar_type()) << "result " << i;
      // Ring sums may round differently from the fake's sum in rank order: a few ulp.
      EXPECT_TRUE(at::allclose(fake[i].to(at::kDouble), expected[i].to(at::kDouble), 1e-6, 1e-6))
          << "result " << i << ": fake " << fake[i] << " gloo " << expected[i];
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FakeCommunicator, ::testing::Values(2, 3));

using tessera::testing::error_of;

TEST(FakeCommunicatorErrors, MismatchedCollectivesNameBothSides) {
  std::string message = error_of([] {
    run_fake_ranks(2, [](CommunicatorPtr comm) {
      at::Tensor t = at::ones({4});
      if (comm->rank() == 0) comm->all_reduce(t, ReduceOp::sum, "grad all-reduce")->wait();
      else comm->broadcast(t, 0, "weights broadcast")->wait();
    });
  });
  EXPECT_NE(message.find("all_reduce 'grad all-reduce'"), std::string::npos) << message;
  EXPECT_NE(message.find("broadcast 'weights broadcast'"), std::string::npos) << message;
}

TEST(FakeCommunicatorErrors, RankThatNeverCallsIsNamed) {
  std::string message = error_of([] {
    run_fake_ranks(3, [](CommunicatorPtr comm) {
      if (comm->rank() != 2) comm->barrier("epoch end");
    });
  });
  EXPECT_NE(message.find("rank 2 (world rank 2) of group world returned without calling it"), std::string::npos)
      << message;
  EXPECT_NE(message.find("barrier epoch end"), std::string::npos) << message;
}

TEST(FakeCommunicatorErrors, ExceptionOnOneRankStopsTheOthers) {
  std::string message = error_of([] {
    run_fake_ranks(2, [](CommunicatorPtr comm) {
      if (comm->rank() == 1) TESSERA_FAIL("rank one's own failure");
      comm->barrier("never completes");
    });
  });
  EXPECT_NE(message.find("rank 1: rank one's own failure"), std::string::npos) << message;
}

TEST(FakeCommunicatorErrors, SizeMismatchIsRefused) {
  std::string message = error_of([] {
    run_fake_ranks(2, [](CommunicatorPtr comm) {
      at::Tensor out = at::empty({2 * (comm->rank() + 3)});
      comm->all_gather(out, at::ones({comm->rank() + 3}), "uneven")->wait();
    });
  });
  EXPECT_NE(message.find("of 3 Float element(s)"), std::string::npos) << message;
  EXPECT_NE(message.find("of 4 Float element(s)"), std::string::npos) << message;
}

}  // namespace
