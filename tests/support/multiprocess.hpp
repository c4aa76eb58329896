#pragma once
/// Multi-process tests over real c10d: run_ranks() re-executes the current test binary,
/// filtered to the current test, once per rank (fresh processes, no fork of a threaded
/// process), with the rendezvous in the environment. In each child the same run_ranks()
/// call runs `body` for that rank and exits; in the parent it waits with a deadline and
/// fails the test naming the rank that failed, crashed or hung, with its output tail.
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "cluster/cluster.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::testing {

void run_ranks(int world_size, std::chrono::seconds timeout,
               const std::function<void(const sdk::ClusterInfo& cluster)>& body);

using core::ReservedPort;

/// The build tree's plugin directory (for core::PluginLoader in tests).
const char* plugin_dir();

}  // namespace tessera::testing

namespace tessera::testing {

/// Result of running the `tessera` binary.
struct CommandResult {
  int exit_code;
  std::string output;  ///< stdout and stderr together
};

/// Runs `/bin/sh -c command` and collects what it writes to stdout (append 2>&1 for stderr).
CommandResult run_command(const std::string& command);

/// Runs the build tree's `tessera` with `arguments` (shell words) and extra environment
/// assignments ("A=1 B=2"), bounded by `timeout_s` (the `timeout` command kills it). No GPU is
/// visible to it unless `environment` sets CUDA_VISIBLE_DEVICES, and it runs one compute thread
/// per rank (OMP_NUM_THREADS=1) unless `environment` sets OMP_NUM_THREADS.
CommandResult run_tessera(const std::string& arguments, const std::string& environment = "", int timeout_s = 300);

/// The environment assignment that shows run_tessera's binary the GPUs this test process sees
/// (CUDA_VISIBLE_DEVICES as set, else every device), for the tests that mean CUDA.
std::string visible_gpus();

/// The build tree's `tessera` executable.
const char* tessera_binary();

/// A fresh empty directory under the test temp dir.
std::string fresh_dir(const std::string& name);
/// Removes a test's folder and what it holds (core::remove_tree: std::filesystem::remove_all
/// crashes on a folder where a pip wheel's LibTorch is linked).
void remove_dir(const std::filesystem::path& path);

/// A file's bytes ("" when it cannot be read).
std::string read_file(const std::filesystem::path& path);
/// The names of what a folder holds, sorted.
std::vector<std::string> files_in(const std::filesystem::path& dir);

/// The named tensors of a checkpoint's state_dict.
std::map<std::string, at::Tensor> checkpoint_state(const std::string& path);

/// The newest run folder (version_N with the largest N) under a default_root_dir.
std::string run_dir(const std::string& default_root_dir);

/// Rows of metrics.csv for `metric` in stage `stage`: step -> value.
std::map<std::int64_t, double> metric_series(const std::string& csv, const std::string& stage, const std::string& metric);

}  // namespace tessera::testing
