#include "host_layout.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "store_text.hpp"

namespace tessera::core::detail {

namespace {

std::string read_link(const char* path) {
  char buffer[256];
  ssize_t n = ::readlink(path, buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, static_cast<std::size_t>(n)) : std::string("?");
}

std::string host_identity() {
  if (const char* test = std::getenv("TESSERA_TEST_HOST_ID"); test != nullptr && *test != '\0')
    return std::string("test host ") + test;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  return boot_id + " " + read_link("/proc/self/ns/mnt") + " " + read_link("/proc/self/ns/pid");
}

}  // namespace

std::int64_t HostLayout::ranks_per_host() const {
  const std::size_t first = hosts.empty() ? 0 : hosts.front().size();
  for (const auto& ranks : hosts)
    if (ranks.size() != first) return 0;
  return static_cast<std::int64_t>(first);
}

std::vector<pid_t> HostLayout::local_pids() const {
  std::vector<pid_t> out;
  for (std::int64_t r : hosts[static_cast<std::size_t>(host)]) out.push_back(pids[static_cast<std::size_t>(r)]);
  return out;
}

HostLayout exchange_host_layout(c10d::Store& store, std::int64_t rank, std::int64_t size) {
  store.set("tessera/host/" + std::to_string(rank), to_bytes(host_identity() + "\n" + std::to_string(::getpid())));
  HostLayout layout;
  std::vector<std::string> identities;
  for (std::int64_t r = 0; r < size; ++r) {
    const std::string entry = to_string(store.get("tessera/host/" + std::to_string(r)));
    const std::size_t nl = entry.find('\n');
    const std::string identity = entry.substr(0, nl);
    layout.pids.push_back(static_cast<pid_t>(std::stol(entry.substr(nl + 1))));
    const auto known = std::find(identities.begin(), identities.end(), identity);
    const auto h = static_cast<std::size_t>(known - identities.begin());
    if (known == identities.end()) {
      identities.push_back(identity);
      layout.hosts.emplace_back();
    }
    if (r == rank) {
      layout.host = static_cast<std::int64_t>(h);
      layout.local = static_cast<std::int64_t>(layout.hosts[h].size());
    }
    layout.hosts[h].push_back(r);
  }
  return layout;
}

bool on_every_rank(c10d::Store& store, const std::string& key, std::int64_t rank, std::int64_t size, bool mine) {
  store.set(key + "/" + std::to_string(rank), to_bytes(mine ? "1" : "0"));
  bool all = true;
  for (std::int64_t r = 0; r < size; ++r) all = to_string(store.get(key + "/" + std::to_string(r))) == "1" && all;
  return all;
}

}  // namespace tessera::core::detail
