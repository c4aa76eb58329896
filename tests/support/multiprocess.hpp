#pragma once
/// Multi-process tests over real c10d: run_ranks() re-executes the current test binary,
/// filtered to the current test, once per rank (fresh processes, no fork of a threaded
/// process), with the rendezvous in the environment. In each child the same run_ranks()
/// call runs `body` for that rank and exits; in the parent it waits with a deadline and
/// fails the test naming the rank that failed, crashed or hung, with its output tail.
#include <chrono>
#include <functional>

#include "tessera/sdk/types.hpp"

namespace tessera::testing {

void run_ranks(int world_size, std::chrono::seconds timeout,
               const std::function<void(const sdk::ClusterInfo& cluster)>& body);

/// A free TCP port on 127.0.0.1.
int free_port();

/// The build tree's plugin directory (for core::PluginLoader in tests).
const char* plugin_dir();

}  // namespace tessera::testing
