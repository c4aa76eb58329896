#pragma once
/// Which of a group's ranks share a host, learnt through the group's store: ranks with the same
/// kernel boot, mounts and pids can map one shared-memory segment.
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tessera::core::detail {

struct HostLayout {
  /// The group's ranks by host, ascending; hosts in the order of their lowest rank.
  std::vector<std::vector<std::int64_t>> hosts;
  std::vector<pid_t> pids;  ///< by group rank
  std::int64_t host = 0;    ///< this rank's host (an index into `hosts`)
  std::int64_t local = 0;   ///< this rank's place among its host's ranks

  /// Ranks per host when every host holds as many, else 0.
  std::int64_t ranks_per_host() const;
  /// The pids of this rank's host, in its ranks' order.
  std::vector<pid_t> local_pids() const;
};

/// Every rank of the group publishes its host and pid, then reads all of them: every rank
/// gets the same layout. TESSERA_TEST_HOST_ID, when set, replaces the host's identity (tests
/// play several hosts on one machine with it).
HostLayout exchange_host_layout(c10d::Store& store, std::int64_t rank, std::int64_t size);

/// Whether `mine` is true on every rank of the group (each publishes its own under `key`), so
/// that all ranks take the same path.
bool on_every_rank(c10d::Store& store, const std::string& key, std::int64_t rank, std::int64_t size, bool mine);

}  // namespace tessera::core::detail
