// Cluster environments on fake variable maps: what torchrun, Slurm, Open MPI and the local
// launcher set, and the errors for what they leave out.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cluster/cluster.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/sdk/error.hpp"

namespace {

using tessera::core::cluster_info;
using tessera::core::detect_cluster_environment;
using tessera::core::Environment;
using tessera::core::slurm_hostnames;
using tessera::core::slurm_tasks_per_node;

std::string error_of(const Environment& env, const std::string& kind) {
  try {
    cluster_info(env, kind);
  } catch (const tessera::sdk::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ClusterEnvironment, NothingSetIsSingle) {
  Environment env{{"HOME", "/root"}};
  EXPECT_EQ(detect_cluster_environment(env), "single");
  auto c = cluster_info(env, "auto", {"10.0.0.1", 1234, 17});
  EXPECT_EQ(c.environment, "single");
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.global_rank, 0);
  EXPECT_EQ(c.master_addr, "10.0.0.1");
  EXPECT_EQ(c.collective_timeout_s, 17);
}

TEST(ClusterEnvironment, Torchrun) {
  Environment env{{"RANK", "5"},          {"WORLD_SIZE", "8"},         {"LOCAL_RANK", "1"},
                  {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},      {"MASTER_ADDR", "node7"},
                  {"MASTER_PORT", "29400"},  {"TORCHELASTIC_RUN_ID", "x"}};
  EXPECT_EQ(detect_cluster_environment(env), "torchrun");
  auto c = cluster_info(env, "auto");
  EXPECT_EQ(c.environment, "torchrun");
  EXPECT_EQ(c.global_rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "node7");
  EXPECT_EQ(c.master_port, 29400);
}

TEST(ClusterEnvironment, TorchrunWithoutGroupRankDerivesTheNode) {
  Environment env{{"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"},
                  {"MASTER_PORT", "29500"}};
  auto c = cluster_info(env, "auto");
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
}

TEST(ClusterEnvironment, LocalLauncherChildrenAreTorchrunWorkersWithAMarker) {
  Environment env{{"RANK", "1"},           {"WORLD_SIZE", "2"},   {"LOCAL_RANK", "1"},     {"LOCAL_WORLD_SIZE", "2"},
                  {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "4000"}, {"TESSERA_LAUNCHED", "1"}};
  EXPECT_EQ(detect_cluster_environment(env), "local");
  auto local = cluster_info(env, "auto");
  env.erase("TESSERA_LAUNCHED");
  auto torchrun = cluster_info(env, "auto");
  EXPECT_EQ(torchrun.environment, "torchrun");
  EXPECT_EQ(local.global_rank, torchrun.global_rank);
  EXPECT_EQ(local.master_port, torchrun.master_port);
}

TEST(ClusterEnvironment, Slurm) {
  Environment env{{"SLURM_PROCID", "5"},           {"SLURM_NTASKS", "8"},     {"SLURM_LOCALID", "1"},
                  {"SLURM_NODEID", "2"},           {"SLURM_NNODES", "4"},     {"SLURM_JOB_NAME", "train"},
                  {"SLURM_NODELIST", "node[01-04],x"}, {"SLURM_JOB_ID", "1234567"}, {"SLURM_TASKS_PER_NODE", "2(x4)"}};
  EXPECT_EQ(detect_cluster_environment(env), "slurm");
  auto c = cluster_info(env, "auto");
  EXPECT_EQ(c.environment, "slurm");
  EXPECT_EQ(c.global_rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.node_rank, 2);
  EXPECT_EQ(c.num_nodes, 4);
  EXPECT_EQ(c.master_addr, "node01");    // the first node
  EXPECT_EQ(c.master_port, 15000 + 4567);  // Lightning's: last four digits of the job id + 15000
  env["MASTER_PORT"] = "777";
  env["MASTER_ADDR"] = "head";
  c = cluster_info(env, "auto");
  EXPECT_EQ(c.master_port, 777);
  EXPECT_EQ(c.master_addr, "head");
}

TEST(ClusterEnvironment, SlurmInteractiveAllocationIsNotAJob) {
  Environment env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_NAME", "bash"}};
  EXPECT_EQ(detect_cluster_environment(env), "single");
  env["SLURM_JOB_NAME"] = "interactive";
  EXPECT_EQ(detect_cluster_environment(env), "single");
}

TEST(ClusterEnvironment, SlurmNodeLists) {
  EXPECT_EQ(slurm_hostnames("node[01-04],x"), (std::vector<std::string>{"node01", "node02", "node03", "node04", "x"}));
  EXPECT_EQ(slurm_hostnames("gpu[8-10,12]-ib,login"),
            (std::vector<std::string>{"gpu8-ib", "gpu9-ib", "gpu10-ib", "gpu12-ib", "login"}));
  EXPECT_EQ(slurm_hostnames("a[098-101]"), (std::vector<std::string>{"a098", "a099", "a100", "a101"}));
  EXPECT_EQ(slurm_hostnames("single"), (std::vector<std::string>{"single"}));
  EXPECT_EQ(slurm_hostnames("a,b[1-2],c[5]"), (std::vector<std::string>{"a", "b1", "b2", "c5"}));
  EXPECT_THROW(slurm_hostnames("n[1-"), tessera::sdk::Error);
  EXPECT_THROW(slurm_hostnames("n[4-2]"), tessera::sdk::Error);
  EXPECT_THROW(slurm_hostnames("n[a-b]"), tessera::sdk::Error);
  EXPECT_EQ(slurm_tasks_per_node("2(x3),1"), (std::vector<std::int64_t>{2, 2, 2, 1}));
  EXPECT_EQ(slurm_tasks_per_node("4"), (std::vector<std::int64_t>{4}));
}

TEST(ClusterEnvironment, OpenMPI) {
  Environment env{{"OMPI_COMM_WORLD_RANK", "3"},       {"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                  {"OMPI_COMM_WORLD_NODE_RANK", "1"},  {"MASTER_ADDR", "host0"}};
  EXPECT_EQ(detect_cluster_environment(env), "mpi");
  auto c = cluster_info(env, "auto", {"127.0.0.1", 0, 60});
  EXPECT_EQ(c.environment, "mpi");
  EXPECT_EQ(c.global_rank, 3);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "host0");
  EXPECT_EQ(c.master_port, 29500);
  // Several nodes and no master address anywhere: an error that says what to export.
  env.erase("MASTER_ADDR");
  std::string message = error_of(env, "auto");
  EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
}

TEST(ClusterEnvironment, PrecedenceFollowsLightning) {
  Environment env{{"RANK", "0"},         {"WORLD_SIZE", "1"},   {"LOCAL_RANK", "0"},          {"MASTER_PORT", "1"},
                  {"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "1"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}};
  EXPECT_EQ(detect_cluster_environment(env), "torchrun");
  env.erase("RANK");
  EXPECT_EQ(detect_cluster_environment(env), "slurm");
  env.erase("SLURM_NTASKS");
  EXPECT_EQ(detect_cluster_environment(env), "mpi");
}

TEST(ClusterEnvironment, ForcedEnvironmentNamesTheMissingVariable) {
  std::string message = error_of({{"RANK", "0"}}, "torchrun");
  EXPECT_NE(message.find("'torchrun' needs the variable WORLD_SIZE"), std::string::npos) << message;
  message = error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "slurm");
  EXPECT_NE(message.find("SLURM_LOCALID"), std::string::npos) << message;
  message = error_of({}, "slurmm");
  EXPECT_NE(message.find("did you mean"), std::string::npos) << message;
}

TEST(ClusterEnvironment, MalformedValuesAreErrors) {
  Environment env{{"RANK", "two"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}};
  std::string message = error_of(env, "auto");
  EXPECT_NE(message.find("RANK = 'two' is not an integer"), std::string::npos) << message;
  env["RANK"] = "4";
  message = error_of(env, "auto");
  EXPECT_NE(message.find("rank 4 is outside world size 4"), std::string::npos) << message;
  env["RANK"] = "1";
  env["MASTER_PORT"] = "70000";
  message = error_of(env, "auto");
  EXPECT_NE(message.find("master port 70000"), std::string::npos) << message;
}

/// Whether a plain socket (no SO_REUSEADDR, as a stranger's bind) can bind `port`.
bool plain_bind_succeeds(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return bound;
}

TEST(ReservedPort, IsKeptFromOthersButTakenByTheRendezvousStore) {
  tessera::core::ReservedPort reserved, other;
  EXPECT_GT(reserved.port(), 0);
  EXPECT_NE(reserved.port(), other.port());
  EXPECT_FALSE(plain_bind_succeeds(reserved.port())) << "a stranger's bind got the reserved port";
  // c10d's TCPStore, as the ranks' rendezvous opens it, listens on the held port.
  tessera::core::AgentStore store("127.0.0.1", reserved.port(), /*server=*/true, /*timeout_s=*/10);
  EXPECT_EQ(store.port(), reserved.port());
}

}  // namespace
