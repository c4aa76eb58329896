// DeviceMesh over the in-process fake world (many shapes) and over real Gloo processes.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "fake_communicator.hpp"
#include "multiprocess.hpp"
#include "tessera/core/device_mesh.hpp"
#include "tessera/sdk/error.hpp"
#include "errors.hpp"

namespace {

using tessera::core::CommunicatorPtr;
using tessera::core::DeviceMesh;
using tessera::testing::run_fake_ranks;

/// The world ranks in `group`, in group-rank order, found by gathering them.
std::vector<std::int64_t> members(const CommunicatorPtr& group, std::int64_t world_rank) {
  at::Tensor all = at::empty({group->size()}, at::kLong);
  group->all_gather(all, at::full({1}, world_rank, at::kLong), "members")->wait();
  return std::vector<std::int64_t>(all.data_ptr<std::int64_t>(), all.data_ptr<std::int64_t>() + all.numel());
}

/// Row-major coordinates of `rank` in `shape`, computed independently of DeviceMesh.
std::vector<std::int64_t> coordinate_of(std::int64_t rank, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> c(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    c[d] = rank % shape[d];
    rank /= shape[d];
  }
  return c;
}

/// The ranks agreeing with `rank` outside `dims`, ordered row-major over `dims`.
std::vector<std::int64_t> expected_group(std::int64_t rank, const std::vector<std::int64_t>& shape,
                                         const std::vector<std::size_t>& dims) {
  std::int64_t world = 1;
  for (std::int64_t s : shape) world *= s;
  std::vector<std::int64_t> out;
  const auto mine = coordinate_of(rank, shape);
  for (std::int64_t r = 0; r < world; ++r) {
    const auto c = coordinate_of(r, shape);
    bool same = true;
    for (std::size_t d = 0; d < shape.size(); ++d)
      if (std::find(dims.begin(), dims.end(), d) == dims.end() && c[d] != mine[d]) same = false;
    if (same) out.push_back(r);
  }
  return out;
}

struct MeshCase {
  std::vector<std::int64_t> shape;
  std::vector<std::string> names;
  std::string printed;
};

/// "replicate2_shard2": the test name and what gtest prints for the parameter.
std::string label(const MeshCase& c) {
  std::string out;
  for (std::size_t d = 0; d < c.shape.size(); ++d) out += (d ? "_" : "") + c.names[d] + std::to_string(c.shape[d]);
  return out;
}
void PrintTo(const MeshCase& c, std::ostream* out) { *out << label(c); }

/// Every dimension's group and every flattened pair of dimensions hold exactly the ranks
/// that differ only there, ranked by coordinate.
void check_mesh(const CommunicatorPtr& world, const MeshCase& c) {
  DeviceMesh mesh(world, c.shape, c.names);
  const std::int64_t rank = world->rank();
  EXPECT_EQ(mesh.size(), world->size());
  EXPECT_EQ(mesh.coordinate(), coordinate_of(rank, c.shape));
  EXPECT_EQ(mesh.world_rank_at(mesh.coordinate()), rank);
  EXPECT_EQ(mesh.to_string(), c.printed);
  for (std::size_t d = 0; d < c.shape.size(); ++d) {
    const CommunicatorPtr& group = mesh.group(c.names[d]);
    EXPECT_EQ(mesh.size(c.names[d]), c.shape[d]);
    EXPECT_EQ(group->size(), c.shape[d]) << c.names[d];
    EXPECT_EQ(group->rank(), mesh.rank(c.names[d])) << c.names[d];
    EXPECT_EQ(members(group, rank), expected_group(rank, c.shape, {d})) << "group " << c.names[d] << " of rank " << rank;
  }
  for (std::size_t a = 0; a < c.shape.size(); ++a)
    for (std::size_t b = a + 1; b < c.shape.size(); ++b) {
      const CommunicatorPtr& flat = mesh.group({c.names[a], c.names[b]});
      EXPECT_EQ(flat.get(), mesh.group({c.names[a], c.names[b]}).get()) << "flattened groups are created once";
      EXPECT_EQ(flat->rank(), mesh.rank(c.names[a]) * c.shape[b] + mesh.rank(c.names[b]));
      EXPECT_EQ(members(flat, rank), expected_group(rank, c.shape, {a, b}))
          << "group (" << c.names[a] << ", " << c.names[b] << ") of rank " << rank;
    }
}

class DeviceMeshShapes : public ::testing::TestWithParam<MeshCase> {};

TEST_P(DeviceMeshShapes, GroupsOverFakeWorld) {
  const MeshCase& c = GetParam();
  std::int64_t world = 1;
  for (std::int64_t s : c.shape) world *= s;
  run_fake_ranks(static_cast<int>(world), [&](CommunicatorPtr comm) { check_mesh(comm, c); });
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DeviceMeshShapes,
    ::testing::Values(
        MeshCase{{2, 2}, {"replicate", "shard"}, "DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=(replicate, shard))"},
        MeshCase{{2, 2, 2}, {"replicate", "dp", "tp"},
                 "DeviceMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], mesh_dim_names=(replicate, dp, tp))"},
        MeshCase{{3, 2}, {"dp", "tp"}, "DeviceMesh([[0, 1], [2, 3], [4, 5]], mesh_dim_names=(dp, tp))"},
        MeshCase{{2, 3}, {"dp", "tp"}, "DeviceMesh([[0, 1, 2], [3, 4, 5]], mesh_dim_names=(dp, tp))"},
        MeshCase{{1, 4}, {"replicate", "shard"}, "DeviceMesh([[0, 1, 2, 3]], mesh_dim_names=(replicate, shard))"},
        MeshCase{{5}, {"dp"}, "DeviceMesh([0, 1, 2, 3, 4], mesh_dim_names=(dp))"}),
    [](const ::testing::TestParamInfo<MeshCase>& info) { return label(info.param); });

using tessera::testing::error_of;

TEST(DeviceMesh, BadShapesAndNamesAreRefused) {
  run_fake_ranks(4, [](CommunicatorPtr world) {
    EXPECT_NE(error_of([&] { DeviceMesh(world, {3, 2}, {"dp", "tp"}); })
                  .find("DeviceMesh shape (3, 2) over (dp, tp) has 6 ranks but the world has 4"),
              std::string::npos);
    EXPECT_NE(error_of([&] { DeviceMesh(world, {2, 2}, {"dp"}); }).find("has 2 dimension(s) but 1 name(s)"),
              std::string::npos);
    EXPECT_NE(error_of([&] { DeviceMesh(world, {2, 2}, {"dp", "dp"}); }).find("'dp' is used twice"),
              std::string::npos);
    EXPECT_NE(error_of([&] { DeviceMesh(world, {4, 0}, {"dp", "tp"}); }).find("has size 0"), std::string::npos);

    DeviceMesh mesh(world, {2, 2}, {"replicate", "shard"});
    std::string unknown = error_of([&] { mesh.group("shards"); });
    EXPECT_NE(unknown.find("has no dimension 'shards' (did you mean 'shard'?); its dimensions: replicate, shard"),
              std::string::npos)
        << unknown;
    EXPECT_NE(error_of([&] { mesh.size("tp"); }).find("no dimension 'tp'"), std::string::npos);
    EXPECT_NE(error_of([&] { mesh.group({"shard", "replicate"}); }).find("in mesh order (replicate, shard)"),
              std::string::npos);
    EXPECT_NE(error_of([&] { mesh.world_rank_at({0, 2}); }).find("outside [0, 2)"), std::string::npos);
  });
}

TEST(DeviceMesh, FsdpShardingStrategies) {
  run_fake_ranks(4, [](CommunicatorPtr world) {
    const std::int64_t rank = world->rank();
    DeviceMesh full = tessera::core::fsdp_mesh(world, "FULL_SHARD");
    EXPECT_EQ(full.shape(), (std::vector<std::int64_t>{1, 4}));
    EXPECT_EQ(full.group("shard").get(), world.get()) << "a group spanning the world is the world";
    EXPECT_EQ(full.group("replicate")->size(), 1);
    EXPECT_EQ(tessera::core::fsdp_mesh(world, "SHARD_GRAD_OP").shape(), (std::vector<std::int64_t>{1, 4}));

    DeviceMesh none = tessera::core::fsdp_mesh(world, "NO_SHARD");
    EXPECT_EQ(none.shape(), (std::vector<std::int64_t>{4, 1}));
    EXPECT_EQ(none.group("shard")->size(), 1);
    EXPECT_EQ(none.group("replicate")->rank(), rank);

    // Shard within consecutive pairs (a node), replicate across them, as PyTorch's HYBRID_SHARD.
    DeviceMesh hybrid = tessera::core::fsdp_mesh(world, "HYBRID_SHARD", 2);
    EXPECT_EQ(members(hybrid.group("shard"), rank), (std::vector<std::int64_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
    EXPECT_EQ(members(hybrid.group("replicate"), rank), (std::vector<std::int64_t>{rank % 2, rank % 2 + 2}));

    EXPECT_NE(error_of([&] { tessera::core::fsdp_mesh(world, "HYBRID_SHARD", 3); })
                  .find("HYBRID_SHARD shard group size 3 does not divide the world size 4"),
              std::string::npos);
    EXPECT_NE(error_of([&] { tessera::core::fsdp_mesh(world, "FULL_SHARD", 2); }).find("applies to HYBRID_SHARD only"),
              std::string::npos);
    EXPECT_NE(error_of([&] { tessera::core::fsdp_mesh(world, "FULL_SHARDS"); }).find("did you mean 'FULL_SHARD'"),
              std::string::npos);
  });
}

/// The same mesh logic over real processes and Gloo groups (split through a TCPStore).
TEST(DeviceMesh, GroupsOverGloo) {
  tessera::testing::run_ranks(4, std::chrono::seconds(90), [](const tessera::sdk::ClusterInfo& cluster) {
    auto world = tessera::core::make_communicator(cluster, c10::kCPU);
    check_mesh(world, MeshCase{{2, 2}, {"replicate", "shard"},
                               "DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=(replicate, shard))"});
    DeviceMesh hybrid = tessera::core::fsdp_mesh(world, "HYBRID_SHARD", 2);
    at::Tensor grad = at::full({3}, static_cast<double>(cluster.global_rank));
    // Mean over the shard group, then the replicate group = mean over the world (HYBRID_SHARD).
    hybrid.group("shard")->all_reduce(grad, tessera::sdk::ReduceOp::mean, "shard")->wait();
    hybrid.group("replicate")->all_reduce(grad, tessera::sdk::ReduceOp::mean, "replicate")->wait();
    EXPECT_TRUE(at::allclose(grad, at::full({3}, 1.5)));
    world->barrier("end");
  });
}

}  // namespace
