#pragma once
/// Cluster environments (Lightning's ClusterEnvironment): where this process sits in the
/// job, read from the variables its launcher set. "local" (tessera's own launcher, which
/// sets torchrun's variables plus TESSERA_LAUNCHED), "torchrun", "slurm", "mpi" (Open MPI's
/// mpirun) or "single" (none of them: one process, or the local launcher itself).
/// Pure functions of an environment map, so every rule is unit-testable without a cluster.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/sdk/types.hpp"

namespace tessera::core {

/// Variable name -> value.
using Environment = std::map<std::string, std::string>;

/// Every name cluster_environment accepts: "auto" plus the environments below.
const std::vector<std::string>& cluster_environment_names();

/// The environment that started this process, in Lightning's order of precedence: local,
/// torchrun (RANK, WORLD_SIZE, LOCAL_RANK), slurm (SLURM_NTASKS and SLURM_PROCID, not an
/// interactive `bash`/`interactive` allocation), mpi (OMPI_COMM_WORLD_RANK/SIZE), else single.
std::string detect_cluster_environment(const Environment& env);

/// What a config says when the environment does not: the master address and port (0 =
/// none), and the collective timeout copied into the result.
struct ClusterDefaults {
  std::string master_addr = "127.0.0.1";
  std::int64_t master_port = 0;
  std::int64_t collective_timeout_s = 60;
};

/// This process's place in the job under environment `kind` ("auto" detects it). Throws
/// sdk::Error naming a missing or malformed variable, an unknown kind, or a rank outside
/// the world.
sdk::ClusterInfo cluster_info(const Environment& env, const std::string& kind, const ClusterDefaults& defaults = {});

/// Every host of a Slurm node list, in order: "node[01-03,07],gpu9" -> node01 node02 node03
/// node07 gpu9 (zero padding kept, text after a bracket appended, nested lists rejected).
std::vector<std::string> slurm_hostnames(const std::string& nodelist);

/// Slurm's per-node task counts, e.g. SLURM_TASKS_PER_NODE "2(x3),1" -> {2, 2, 2, 1}.
std::vector<std::int64_t> slurm_tasks_per_node(const std::string& value);

/// This process's environment variables.
Environment process_environment();

/// The state letter of process `pid` from /proc (R, S, D, T stopped, t traced, Z zombie, ...),
/// or 0 when there is no such process. Alive means neither 0 nor Z nor X.
char process_state(std::int64_t pid);

/// The threads this process runs now (entries of /proc/self/task; 0 when unreadable). fork()
/// copies only the calling thread: a process may fork and go on running code in the child only
/// while this is 1.
std::size_t thread_count();

/// A free TCP port held until a rendezvous store listens on it, in this process or another:
/// bound and never listening, with SO_REUSEADDR, so that c10d's TCPStore (which binds with
/// SO_REUSEADDR) can take it while no other bind or outgoing connection is given it. Asking
/// the kernel for a free port and letting it go left a gap before the store listened, in
/// which a concurrent job (two multi-rank tests under ctest -j) could draw the same one.
/// For one-rank NCCL groups, tests and benches; the local launcher's store picks its own port.
class ReservedPort {
 public:
  ReservedPort();
  ~ReservedPort();
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace tessera::core
