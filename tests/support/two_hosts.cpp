#include "two_hosts.hpp"

#include "multiprocess.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

namespace tessera::testing {

namespace {

namespace fs = std::filesystem;

/// `text` as one single-quoted shell word.
std::string quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

using tessera::testing::read_file;

/// Runs `command`; "" when it succeeded, else what it said.
std::string must(const std::string& command) {
  CommandResult r = run_command(command + " 2>&1");
  return r.exit_code == 0 ? std::string() : "`" + command + "` failed (" + std::to_string(r.exit_code) + "): " + r.output;
}

/// Namespaces of earlier test processes that were killed before their clean-up ran.
void remove_stale() {
  CommandResult list = run_command("ip netns list 2>/dev/null");
  std::regex name("^(ts[ab])([0-9]+)\\b");
  std::istringstream in(list.output);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, name)) continue;
    if (fs::exists("/proc/" + m[2].str())) continue;  // its test process is still running
    const std::string ns = m[1].str() + m[2].str();
    run_command("ip netns pids " + ns + " 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns del " + ns +
                " >/dev/null 2>&1");
  }
}

}  // namespace

TwoHosts::TwoHosts() : tag_(std::to_string(::getpid())) {
  if (::geteuid() != 0) {
    why_not_ = "network namespaces need root (CI runs as root)";
    return;
  }
  if (run_command("command -v ip >/dev/null && command -v unshare >/dev/null && command -v nsenter >/dev/null")
          .exit_code != 0) {
    why_not_ = "iproute2 (ip) and util-linux (unshare, nsenter) are needed";
    return;
  }
  remove_stale();
  dir_ = fresh_dir("two-hosts");
  for (int h = 0; h < 2 && why_not_.empty(); ++h) {
    why_not_ = must("ip netns add " + ns(h));
    made_netns_[h] = why_not_.empty();
  }
  if (why_not_.empty())
    why_not_ = must("ip link add " + interface(0) + " type veth peer name " + interface(1));
  for (int h = 0; h < 2 && why_not_.empty(); ++h) {
    why_not_ = must("ip link set " + interface(h) + " netns " + ns(h));
    if (why_not_.empty())
      why_not_ = must("ip -n " + ns(h) + " addr add " + address(h) + "/24 dev " + interface(h) + " && ip -n " + ns(h) +
                      " link set " + interface(h) + " up && ip -n " + ns(h) + " link set lo up");
  }
  for (int h = 0; h < 2 && why_not_.empty(); ++h) {
    write_hosts(h, "127.0.0.1 localhost\n" + address(0) + " " + name(0) + "\n" + address(1) + " " + name(1) + "\n");
    const std::string ready = dir_ + "/ready-" + std::to_string(h);
    // The holder: its own host name, /dev/shm and /etc/hosts, then it sleeps; commands join
    // its namespaces with nsenter. It dies with this process (PR_SET_PDEATHSIG).
    const std::string inner = "hostname " + name(h) + " && mount -t tmpfs -o size=256m tmpfs /dev/shm && mount --bind " +
                              dir_ + "/hosts-" + std::to_string(h) + " /etc/hosts && touch " + ready +
                              " && exec sleep 100000";
    const std::string command = "exec ip netns exec " + ns(h) + " unshare --uts --mount --propagation private /bin/sh -c " +
                                quote(inner) + " > " + dir_ + "/holder-" + std::to_string(h) + ".log 2>&1";
    pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    holder_[h] = pid;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    int status = 0;
    while (!fs::exists(ready) && std::chrono::steady_clock::now() < until && ::waitpid(pid, &status, WNOHANG) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!fs::exists(ready))
      why_not_ = "host " + name(h) + " could not be made (unshare --uts --mount, a tmpfs on /dev/shm): " +
                 read_file(dir_ + "/holder-" + std::to_string(h) + ".log");
  }
  if (why_not_.empty()) {
    CommandResult check = run_command(on(1, "hostname; getent hosts " + name(0)) + " 2>&1");
    if (check.output.find(name(1)) == std::string::npos || check.output.find(address(0)) == std::string::npos)
      why_not_ = "the two hosts do not work (host name, /etc/hosts): " + check.output;
  }
}

TwoHosts::~TwoHosts() {
  for (int h = 0; h < 2; ++h) {
    if (made_netns_[h])  // what the tests started inside and left behind (bounded runs should leave nothing)
      run_command("ip netns pids " + ns(h) + " 2>/dev/null | xargs -r kill -9 2>/dev/null");
    if (holder_[h] > 0) {
      ::kill(holder_[h], SIGKILL);
      ::waitpid(holder_[h], nullptr, 0);
    }
  }
  for (int h = 0; h < 2; ++h)
    if (made_netns_[h]) run_command("ip netns del " + ns(h) + " >/dev/null 2>&1");  // also removes the veth pair
  run_command("ip link del " + interface(0) + " >/dev/null 2>&1");  // in case it never moved into its namespace
  if (!dir_.empty()) remove_dir(dir_);
}

std::string TwoHosts::ns(int host) const { return std::string(host == 0 ? "tsa" : "tsb") + tag_; }
std::string TwoHosts::name(int host) const { return host == 0 ? "tessera-a" : "tessera-b"; }
std::string TwoHosts::address(int host) const { return host == 0 ? "10.77.0.1" : "10.77.0.2"; }
std::string TwoHosts::interface(int host) const { return ns(host); }

std::string TwoHosts::on(int host, const std::string& command) const {
  return "nsenter -t " + std::to_string(holder_[host]) + " -n -u -m -- /bin/sh -c " +
         quote("cd " + quote(fs::current_path().string()) + " && " + command);
}

std::pair<CommandResult, CommandResult> TwoHosts::run_both(const std::string& a, const std::string& b,
                                                           int timeout_s) const {
  const std::string out = dir_ + "/run";
  const std::string t = "timeout -k 5 " + std::to_string(timeout_s) + " ";
  run_command("( " + t + on(0, a) + " > " + out + "-0.out 2>&1; echo $? > " + out + "-0.rc ) & ( " + t + on(1, b) +
              " > " + out + "-1.out 2>&1; echo $? > " + out + "-1.rc ) & wait");
  auto result = [&](int h) {
    std::string rc = read_file(out + "-" + std::to_string(h) + ".rc");
    return CommandResult{rc.empty() ? -1 : std::stoi(rc), read_file(out + "-" + std::to_string(h) + ".out")};
  };
  return {result(0), result(1)};
}

void TwoHosts::write_hosts(int host, const std::string& text) const {
  std::ofstream(dir_ + "/hosts-" + std::to_string(host), std::ios::trunc) << text;  // same inode: the bind mount sees it
}

void TwoHosts::kill_all(int host) const {
  run_command("ip netns pids " + ns(host) + " | grep -vx " + std::to_string(holder_[host]) +
              " | xargs -r kill -9 2>/dev/null");
}

void TwoHosts::set_link(bool up) const {
  for (int h = 0; h < 2; ++h)
    run_command("ip -n " + ns(h) + " link set " + interface(h) + (up ? " up" : " down") + " >/dev/null 2>&1");
}

void TwoHosts::set_rate(const std::string& rate) const {
  for (int h = 0; h < 2; ++h) {
    run_command("tc -n " + ns(h) + " qdisc del dev " + interface(h) + " root >/dev/null 2>&1");
    if (!rate.empty())
      run_command("tc -n " + ns(h) + " qdisc add dev " + interface(h) + " root tbf rate " + rate +
                  " burst 1mb latency 50ms >/dev/null 2>&1");
  }
}

}  // namespace tessera::testing
