// Where every Gloo group of this process binds (c10d_shared.hpp): the interface that reaches
// the master, or the one named; a multi-host job whose host name resolves only to loopback is
// refused before any group exists.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "c10d_shared.hpp"
#include "cluster/cluster.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core::c10d_detail {

namespace {

/// Every address `name` resolves to (IPv4 and IPv6), as text.
std::vector<std::string> resolve(const std::string& name) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::vector<std::string> addresses;
  if (::getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0) return addresses;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {0};
    const void* raw = a->ai_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
                                              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (::inet_ntop(a->ai_family, raw, text, sizeof(text)) != nullptr &&
        std::find(addresses.begin(), addresses.end(), text) == addresses.end())
      addresses.emplace_back(text);
  }
  ::freeaddrinfo(found);
  return addresses;
}

/// The local address the kernel routes to `host` from (a UDP connect sends nothing), or "".
std::string route_to(const std::string& host, std::int64_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) return "";
  std::string local;
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in mine{};
    socklen_t length = sizeof(mine);
    char text[INET_ADDRSTRLEN] = {0};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &length) == 0 &&
        ::inet_ntop(AF_INET, &mine.sin_addr, text, sizeof(text)) != nullptr)
      local = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return local;
}

/// The name of the interface that holds IPv4 `address`, or "".
std::string interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {0};
    if (::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text)) != nullptr &&
        address == text)
      name = i->ifa_name;
  }
  ::freeifaddrs(list);
  return name;
}

}  // namespace

void choose_gloo_address(const sdk::ClusterInfo& cluster, const CommSettings& settings) {
  const char* env = std::getenv("GLOO_SOCKET_IFNAME");
  std::string interface = !settings.interface.empty() ? settings.interface : env != nullptr ? env : "";
  std::string address = route_to(cluster.master_addr, cluster.master_port);
  const std::string host = host_name();
  const std::string where = "node " + std::to_string(cluster.node_rank) + " (" + host + ", rank " +
                            std::to_string(cluster.global_rank) + ")";
  if (!interface.empty()) {
    ifaddrs* list = nullptr;
    bool exists = false;
    if (::getifaddrs(&list) == 0) {
      for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) exists = exists || interface == i->ifa_name;
      ::freeifaddrs(list);
    }
    TESSERA_CHECK(exists, where, ": ", (settings.interface.empty() ? "GLOO_SOCKET_IFNAME" : "[launch] interface"),
                  " = \"", interface, "\" is no network interface of this host",
                  (address.empty() || interface_of(address).empty()
                       ? std::string()
                       : " (the one that reaches the master " + cluster.master_addr + " is \"" + interface_of(address) +
                             "\")"));
  } else if (cluster.num_nodes > 1) {
    // A master on loopback means every node runs on this machine: nothing to check.
    TESSERA_CHECK(!address.empty(), where, ": the master address '", cluster.master_addr, "' does not resolve to a ",
                  "reachable IPv4 address from this host: set [launch] master_addr (or MASTER_ADDR) to node 0's ",
                  "network address, the same on every node");
    std::vector<std::string> own = resolve(host);
    bool usable = is_loopback(address);
    for (const auto& a : own) usable = usable || !is_loopback(a);
    std::string listed;
    for (const auto& a : own) listed += (listed.empty() ? "" : ", ") + a;
    const std::string fix = interface_of(address).empty()
                                ? std::string("[launch] interface = \"<the interface that reaches the other hosts>\"")
                                : "[launch] interface = \"" + interface_of(address) +
                                      "\" (the interface that reaches the master " + cluster.master_addr + ")";
    TESSERA_CHECK(usable, where, ": this host's name '", host, "' resolves ",
                  (own.empty() ? std::string("to no address") : "only to loopback (" + listed + ")"), " in a job across ",
                  cluster.num_nodes, " nodes; the other hosts could not connect to it. Map '", host,
                  "' to this host's network address in /etc/hosts (or DNS), or set ", fix, " or GLOO_SOCKET_IFNAME");
  }
  std::lock_guard<std::mutex> lock(shared().mutex);
  shared().gloo_interface = interface;
  shared().gloo_address = address.empty() ? std::string("127.0.0.1") : address;
}

}  // namespace tessera::core::c10d_detail
