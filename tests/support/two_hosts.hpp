#pragma once
/// Two "hosts" on one machine, for multi-host tests: each is a network + UTS + mount namespace
/// with its own host name, a private /dev/shm and its own /etc/hosts, and the two are joined by
/// a veth pair whose addresses exist inside those namespaces only. Needs root and iproute2 (CI
/// runs as root); where the namespaces cannot be made, why_not() says why and the test skips
/// with that reason. Everything made (namespaces, links, the processes holding them, files) is
/// removed by the destructor, also when the test failed; namespaces left by a test process that
/// was killed are removed by the next one.
#include <string>
#include <utility>

#include "multiprocess.hpp"

namespace tessera::testing {

class TwoHosts {
 public:
  TwoHosts();
  ~TwoHosts();
  TwoHosts(const TwoHosts&) = delete;
  TwoHosts& operator=(const TwoHosts&) = delete;

  /// Empty when both hosts are up; otherwise why they could not be made.
  const std::string& why_not() const { return why_not_; }

  /// Host 0 or 1: its host name ("tessera-a", "tessera-b"), its address on the link and the
  /// name of its end of the link (an interface that exists only inside that host).
  std::string name(int host) const;
  std::string address(int host) const;
  std::string interface(int host) const;

  /// `command` (shell) wrapped to run on `host`: in its namespaces, in the current directory.
  std::string on(int host, const std::string& command) const;

  /// Runs `a` on host 0 and `b` on host 1 at the same time, each bounded by `timeout_s` (then
  /// killed), and returns what each wrote (stdout and stderr) with its exit code.
  std::pair<CommandResult, CommandResult> run_both(const std::string& a, const std::string& b, int timeout_s) const;

  /// Replaces host `host`'s /etc/hosts (the default maps both names to their link addresses).
  void write_hosts(int host, const std::string& text) const;

  /// Kills every process running on `host` (SIGKILL), as a machine that loses power.
  void kill_all(int host) const;

  /// Takes the link down (both ends) or brings it back up.
  void set_link(bool up) const;

  /// Limits each end of the link to `rate` (tc's tbf, e.g. "1gbit"); "" removes the limit.
  void set_rate(const std::string& rate) const;

 private:
  std::string ns(int host) const;

  std::string why_not_;
  std::string tag_;
  std::string dir_;
  int holder_[2] = {-1, -1};  ///< pid of the process that holds each host's UTS and mount namespaces
  bool made_netns_[2] = {false, false};
};

}  // namespace tessera::testing
