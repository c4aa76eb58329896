#pragma once
// Cluster environments (Lightning's ClusterEnvironment) and the local launcher: decide
// where this process sits in the job, or start and supervise the local ranks.
#include <map>
#include <optional>
#include <string>

#include "config.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::host {

/// The environment this process was started in, from its variables: our own launcher's
/// children ("local"), torchrun, Slurm, Open MPI, or none of them ("single"). `settings`
/// may force one (cluster_environment != "auto"). Throws naming a missing variable.
sdk::ClusterInfo detect_cluster(const std::map<std::string, std::string>& env, const LaunchSettings& settings);

/// The first host of a Slurm node list: "node[01-04,07],gpu9" -> "node01".
std::string first_slurm_host(const std::string& nodelist);

/// The process environment as a map.
std::map<std::string, std::string> environment();

/// If this process must start local ranks ([launch] devices > 1 and no cluster environment
/// detected), re-executes this binary once per rank with torchrun's variables, supervises
/// them, and returns the exit code for the launcher: the first failing rank is reported
/// with its status and log tail, and the others are stopped. Otherwise fills `cluster` for
/// this process and returns nullopt.
std::optional<int> launch_or_join(const LaunchSettings& settings, const std::string& log_dir, int argc, char** argv,
                                  sdk::ClusterInfo& cluster);

/// Threads for this rank: at::set_num_threads and OpenBLAS's own pool.
void configure_threads(const LaunchSettings& settings, const sdk::ClusterInfo& cluster);

}  // namespace tessera::host
