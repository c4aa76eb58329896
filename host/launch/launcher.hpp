#pragma once
// The local launcher (Lightning's subprocess launcher): start and supervise this node's
// ranks, or, started by a launcher, find this process's place in the job through the
// cluster environments of core/src/cluster/cluster.hpp.
#include <optional>
#include <string>

#include "config/config.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::host {

/// The job as far as it is known before any rank starts: under tessera's own launcher
/// devices x nodes ranks ("local"), otherwise what the environment says (torchrun, Slurm, MPI).
sdk::ClusterInfo planned_cluster(const LaunchSettings& settings);

/// If this process must start local ranks ([launch] devices x nodes > 1 and no cluster
/// environment detected), re-executes this binary once per rank with torchrun's variables
/// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT),
/// supervises them and returns the exit code for the launcher. Rank 0 keeps the terminal;
/// every rank's output goes to `log_dir`/rank-K.log (rank 0's stderr is teed there). When a
/// rank fails, exits or is killed, the others are stopped (SIGTERM, SIGKILL after a grace
/// period) and the first failing rank is reported with its status and log tail; ranks die
/// with the launcher (PR_SET_PDEATHSIG). Otherwise fills `cluster` for this process and
/// returns nullopt. Throws sdk::Error for a bad environment or a busy multi-node port.
std::optional<int> launch_or_join(const LaunchSettings& settings, const std::string& log_dir, int argc, char** argv,
                                  sdk::ClusterInfo& cluster);

/// Compute threads per rank: [launch] num_threads, else OMP_NUM_THREADS where set, else cores /
/// local ranks.
std::int64_t rank_threads(const LaunchSettings& settings, std::int64_t local_ranks);
/// Compute threads for this rank (rank_threads). Sets
/// at::set_num_threads and OpenBLAS's own pool (openblas_set_num_threads when the loaded
/// BLAS has it), which at::set_num_threads does not touch.
void configure_threads(const LaunchSettings& settings, const sdk::ClusterInfo& cluster);

/// Whether `port` can be bound on `address` right now (a TCPStore could listen there).
bool port_is_free(const std::string& address, std::int64_t port);

}  // namespace tessera::host
