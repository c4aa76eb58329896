#include "launch/launcher.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "cluster/cluster.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/openblas.hpp"
#include "train/allocator.hpp"

namespace tessera::host {

namespace {

using Clock = std::chrono::steady_clock;

/// How long stopped ranks get between SIGTERM and SIGKILL.
constexpr std::chrono::seconds kGracePeriod{5};
/// After a rank fails, how long the others get to fail on their own and write their
/// reports (a broken collective, a hang report) before they are stopped.
constexpr std::chrono::seconds kSettlePeriod{4};

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }


std::string tail(const std::string& path, std::size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string line; std::getline(in, line);) all.push_back(line);
  std::string out;
  for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "  | " + all[i] + "\n";
  return out.empty() ? "  | (empty)\n" : out;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status))
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "exit status " + std::to_string(WEXITSTATUS(status));
}

/// A stopped process (SIGSTOP, a debugger) cannot act on SIGTERM, nor report anything.
bool is_stopped(pid_t pid) {
  const char state = core::process_state(pid);
  return state == 'T' || state == 't';
}

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int signal) { g_interrupted = signal; }

void write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

/// Reads exactly `size` bytes; false at end of file or on an error.
bool read_all(int fd, void* data, std::size_t size) {
  auto* out = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::read(fd, out, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    out += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace

bool port_is_free(const std::string& address, std::int64_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as TCPStore binds: TIME_WAIT is no conflict
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = htons(static_cast<std::uint16_t>(port));
  in.sin_addr.s_addr = htonl(INADDR_ANY);
  if (address == "127.0.0.1" || address == "localhost") in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&in), sizeof(in)) == 0;
  ::close(fd);
  return free;
}

std::int64_t rank_threads(const LaunchSettings& settings, std::int64_t local_ranks) {
  if (settings.num_threads > 0) return settings.num_threads;
  // OMP_NUM_THREADS as LibTorch's own pool reads it (torchrun sets 1 for each worker). Spinning
  // worker threads beyond the cores cost more than they give: a tiny GPT's validation on 2 cores
  // took 11 s with 2 threads per process beside other busy processes, 1.2 s with 1.
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long value = std::strtol(omp, &end, 10);
    if (end != omp && *end == '\0' && value > 0) return std::min<std::int64_t>(value, kMaxThreads);
  }
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max<std::int64_t>(1, cores / std::max<std::int64_t>(1, local_ranks));
}

void configure_threads(const LaunchSettings& settings, const sdk::ClusterInfo& cluster) {
  const std::int64_t threads = rank_threads(settings, cluster.local_world_size);
  at::set_num_threads(static_cast<int>(threads));
  toolkit::openblas::set_num_threads(static_cast<int>(threads));
}

namespace {
sdk::ClusterInfo environment_cluster(const LaunchSettings& settings, const core::Environment& env) {
  core::ClusterDefaults defaults{settings.master_addr, settings.master_port, settings.collective_timeout_s};
  sdk::ClusterInfo cluster = core::cluster_info(env, settings.cluster_environment, defaults);
  if (cluster.environment == "single") return cluster;
  // Started by torchrun, Slurm or mpirun: the launcher decides how many ranks run; a count the
  // config sets and the job does not have is refused, not silently replaced.
  const std::string by = env.count("TESSERA_LAUNCHED")       ? "tessera's launcher"
                         : cluster.environment == "mpi"   ? "mpirun"
                         : cluster.environment == "slurm" ? "Slurm"
                                                          : cluster.environment;
  TESSERA_CHECK(settings.devices_key.empty() || settings.devices == cluster.local_world_size, settings.devices_key,
                " = ", settings.devices, " but ", by, " started ", cluster.local_world_size, " rank(s) on this node: set ",
                "devices = ", cluster.local_world_size, " or leave it out (under torchrun, Slurm or mpirun their own ",
                "count decides)");
  TESSERA_CHECK(settings.nodes_key.empty() || settings.nodes == cluster.num_nodes, settings.nodes_key, " = ",
                settings.nodes, " but ", by, " runs ", cluster.num_nodes, " node(s): set nodes = ", cluster.num_nodes,
                " or leave it out");
  return cluster;
}
}  // namespace

sdk::ClusterInfo planned_cluster(const LaunchSettings& settings) {
  sdk::ClusterInfo cluster = environment_cluster(settings, core::process_environment());
  if (cluster.environment == "single" && settings.devices * settings.nodes > 1) {
    cluster.environment = "local";
    cluster.world_size = settings.devices * settings.nodes;
  }
  return cluster;
}

std::optional<int> launch_or_join(const LaunchSettings& settings, const std::string& log_dir, int argc, char** argv,
                                  sdk::ClusterInfo& cluster) {
  (void)argc;
  const core::Environment env = core::process_environment();
  cluster = environment_cluster(settings, env);
  if (cluster.environment != "single" || settings.devices * settings.nodes == 1) return std::nullopt;

  // We are the local launcher: start this node's `devices` ranks.
  const std::int64_t local = settings.devices, world = settings.devices * settings.nodes;
  std::int64_t port = settings.master_port;
  if (settings.nodes == 1) {
    if (port != 0 && !port_is_free(settings.master_addr, port)) {
      std::cerr << "tessera: [launch] master_port = " << port << " is in use; the local ranks use a free port instead\n";
      port = 0;
    }
  } else {
    TESSERA_CHECK(port != 0, "[launch] nodes = ", settings.nodes,
                  " needs an explicit [launch] master_port, the same on every node");
    TESSERA_CHECK(settings.node_rank != 0 || port_is_free(settings.master_addr, port), "[launch] master_port = ", port,
                  " is already in use on this host, where node 0's rendezvous must listen: choose a free port "
                  "(the same on every node)");
  }
  // Node 0's launcher hosts the rendezvous store, as torchrun's agent does: the ranks join it
  // as clients, and their ledgers and failure reports outlive any one rank.
  std::unique_ptr<core::AgentStore> store;
  auto start_store = [&] {
    if (settings.node_rank != 0) return;
    store = std::make_unique<core::AgentStore>(settings.master_addr, port, true,
                                               static_cast<double>(settings.rendezvous_timeout_s));
    port = store->port();
  };
  // [Note: forked ranks] A rank is this process forked after its checks, not the binary executed
  // again: LibTorch's ~290 libraries are then loaded and relocated, its operators registered, the
  // config read and the plugins loaded once per job instead of once per rank (~0.5-1.5 s each on
  // 2 busy cores). fork() copies only the calling thread, so it is done while this process runs
  // no other: the store (a thread) starts after the forks, and each rank waits on a pipe for its
  // port. OpenBLAS's pool is ended first, as its own fork handler would (it restarts at its next
  // call). A launcher that runs other threads (a plugin's, say) executes the binary as before.
  toolkit::openblas::stop_threads();
  const bool fork_ranks = core::thread_count() == 1;
  int go_pipe[2] = {-1, -1};
  if (fork_ranks) {
    TESSERA_CHECK(::pipe2(go_pipe, O_CLOEXEC) == 0, "cannot create a pipe to start the ranks: ", std::strerror(errno));
    std::cout << std::flush;
    std::cerr << std::flush;
    std::fflush(nullptr);  // else each rank would print what this process had buffered again
    return_freed_pages();  // what the checks freed would be resident in every rank
  } else {
    start_store();
  }
  std::filesystem::create_directories(log_dir);
  const std::int64_t threads = rank_threads(settings, local);

  // Rank 0 keeps the terminal (its progress bar needs a TTY on stdout); its stderr comes
  // through this pipe so that the launcher can tee it into rank-0.log.
  int err_pipe[2] = {-1, -1};
  TESSERA_CHECK(::pipe2(err_pipe, O_CLOEXEC) == 0, "cannot create a pipe for rank 0's output: ", std::strerror(errno));

  std::vector<pid_t> pids(local, -1);
  std::vector<std::string> logs(local);
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  pid_t group = 0;  // every rank in one process group: one kill() reaches them and their children
  const pid_t launcher = ::getpid();
  for (std::int64_t i = 0; i < local; ++i) {
    std::int64_t rank = settings.node_rank * local + i;
    logs[i] = log_dir + "/rank-" + std::to_string(rank) + ".log";
    core::Environment child = env;
    child["TESSERA_LAUNCHED"] = "1";
    child["RANK"] = std::to_string(rank);
    child["LOCAL_RANK"] = std::to_string(i);
    child["WORLD_SIZE"] = std::to_string(world);
    child["LOCAL_WORLD_SIZE"] = std::to_string(local);
    child["GROUP_RANK"] = std::to_string(settings.node_rank);
    child["ROLE_RANK"] = std::to_string(rank);
    child["ROLE_WORLD_SIZE"] = std::to_string(world);
    child["MASTER_ADDR"] = settings.master_addr;
    child["MASTER_PORT"] = std::to_string(port);
    child["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    child["TORCHELASTIC_RESTART_COUNT"] = "0";
    child["OMP_NUM_THREADS"] = std::to_string(threads);
    child["OPENBLAS_NUM_THREADS"] = std::to_string(threads);
    std::vector<std::string> strings;
    for (const auto& [k, v] : child) strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string log_path = logs[i];

    pid_t pid = ::fork();
    if (pid < 0) {
      int error = errno;
      if (group != 0) ::kill(-group, SIGKILL);
      TESSERA_FAIL("cannot start rank ", rank, ": fork failed: ", std::strerror(error));
    }
    if (pid == 0) {
      ::setpgid(0, group);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher, whatever kills it
      if (::getppid() != launcher) ::_exit(1);
      int fd = ::open(log_path.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
      if (i == 0) {
        ::dup2(err_pipe[1], STDERR_FILENO);
      } else if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
      if (fork_ranks) {
        for (int unused : {go_pipe[1], err_pipe[0], err_pipe[1]}) ::close(unused);
        std::int64_t master_port = -1;  // end of file: the launcher could not start the store
        if (!read_all(go_pipe[0], &master_port, sizeof(master_port)) || master_port < 0) ::_exit(1);
        ::close(go_pipe[0]);
        child["MASTER_PORT"] = std::to_string(master_port);
        for (const auto& [k, v] : child) ::setenv(k.c_str(), v.c_str(), 1);
        if (fd >= 0) ::close(fd);
        cluster = environment_cluster(settings, core::process_environment());
        return std::nullopt;
      }
      ::execve(exe.c_str(), argv, envp.data());
      std::string message = "tessera: cannot execute " + exe + ": " + std::strerror(errno) + "\n";
      write_all(STDERR_FILENO, message.data(), message.size());
      ::_exit(127);
    }
    ::setpgid(pid, group);  // also here: whichever of parent and child runs first
    if (group == 0) group = pid;
    pids[i] = pid;
  }
  ::close(err_pipe[1]);
  if (fork_ranks) {
    ::close(go_pipe[0]);
    try {
      start_store();
    } catch (...) {
      ::close(go_pipe[1]);  // the ranks read end of file and leave
      for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
      throw;
    }
    const std::int64_t master_port = port;
    for (std::int64_t i = 0; i < local; ++i) write_all(go_pipe[1], reinterpret_cast<const char*>(&master_port), sizeof(master_port));
    ::close(go_pipe[1]);
  }
  std::cerr << "tessera: launched " << local << " local rank(s) of world size " << world << " (node "
            << settings.node_rank << " of " << settings.nodes << ", master " << settings.master_addr << ":" << port
            << ", " << threads << " thread(s) each), logs in " << log_dir << "/\n";

  struct sigaction action {};
  action.sa_handler = on_signal;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGHUP, &action, nullptr);

  int rank0_log = ::open(logs[0].c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  int err_read = err_pipe[0];
  auto pump = [&](int timeout_ms) {
    if (err_read < 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
    pollfd p{err_read, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return;
    char buffer[8192];
    ssize_t n = ::read(err_read, buffer, sizeof(buffer));
    if (n > 0) {
      write_all(STDERR_FILENO, buffer, static_cast<std::size_t>(n));
      if (rank0_log >= 0) write_all(rank0_log, buffer, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      ::close(err_read);
      err_read = -1;
    }
  };

  struct Failed {
    std::int64_t rank;
    pid_t pid;
    int status;
    std::int64_t time_ms;
  };
  std::vector<Failed> failed;
  std::vector<Failed> stopped;  // ended by the launcher's stop: in the report if it had reported a failure
  std::vector<bool> done(local, false);
  std::int64_t remaining = local;
  int exit_code = 0;
  std::string report;
  bool stopping = false, killed = false, settling = false;
  Clock::time_point kill_at{}, settle_until{};
  auto stop_all = [&] {
    if (stopping) return;
    stopping = true;
    ::kill(-group, g_interrupted == SIGINT ? SIGINT : SIGTERM);  // a Ctrl-C reaches the ranks as one
    for (std::int64_t i = 0; i < local; ++i)  // no grace for a process that cannot act on it
      if (!done[i] && is_stopped(pids[i])) ::kill(pids[i], SIGKILL);
    kill_at = Clock::now() + kGracePeriod;
  };
  auto all_left_stopped = [&] {
    for (std::int64_t i = 0; i < local; ++i)
      if (!done[i] && !is_stopped(pids[i])) return false;
    return true;
  };
  while (remaining > 0) {
    pump(50);
    for (std::int64_t i = 0; i < local; ++i) {
      if (done[i]) continue;
      int status = 0;
      pid_t r = ::waitpid(pids[i], &status, WNOHANG);
      if (r != pids[i]) continue;
      done[i] = true;
      --remaining;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (stopping) {  // stopped by us: not a root cause
        stopped.push_back({settings.node_rank * local + i, pids[i], status, core::wall_ms()});
        continue;
      }
      if (i == 0) pump(0);     // rank 0's last words are in the pipe
      failed.push_back({settings.node_rank * local + i, pids[i], status, core::wall_ms()});
      if (!settling) {
        settling = true;
        settle_until = Clock::now() + kSettlePeriod;
      }
    }
    if (settling && !stopping && (remaining == 0 || Clock::now() >= settle_until || all_left_stopped())) stop_all();
    if (g_interrupted && !stopping) {
      report = std::string("tessera: interrupted by ") + strsignal(g_interrupted) + "; stopping all ranks\n";
      exit_code = 128 + g_interrupted;
      stop_all();
    }
    if (stopping && !killed && remaining > 0 && Clock::now() >= kill_at) {
      ::kill(-group, SIGKILL);  // the group exists while any member is unreaped
      killed = true;
    }
  }
  if (!failed.empty() && report.empty()) {
    std::map<std::int64_t, core::FailureRecord> records;
    std::vector<std::optional<core::LedgerEntry>> ledgers;
    {
      std::unique_ptr<core::AgentStore> client;
      core::AgentStore* reader = store.get();
      if (reader == nullptr) {
        try {
          client = std::make_unique<core::AgentStore>(settings.master_addr, port, false, 5.0);
          reader = client.get();
        } catch (const std::exception&) {  // node 0's launcher (and its store) is gone
        }
      }
      if (reader != nullptr) {
        records = reader->failures(world);
        ledgers = reader->ledgers(world);
      }
    }
    ledgers.resize(static_cast<std::size_t>(world));
    // Every rank that joined published a ledger: none at all means the store could not be read
    // (node 0 is gone or unreachable), and nothing can be said of records or steps.
    const bool store_read = std::any_of(ledgers.begin(), ledgers.end(), [](const auto& l) { return l.has_value(); });
    // The root cause: the earliest failure of a rank's own (an error it reported, a signal, an
    // exit without a report), not the first process reaped; failures caused by another rank
    // (a broken or timed-out collective) are consequences.
    auto own = [&](const Failed& f) { return !records.count(f.rank) || !records.at(f.rank).consequence; };
    auto time_of = [&](const Failed& f) { return records.count(f.rank) ? records.at(f.rank).time_ms : f.time_ms; };
    const Failed* root = nullptr;
    for (const Failed& f : failed)
      if (own(f) && (root == nullptr || time_of(f) < time_of(*root))) root = &f;
    std::int64_t blamed = -1;  // a rank named by the others' hang reports that never failed itself
    const Failed* namer = nullptr;
    if (root == nullptr) {
      for (const Failed& f : failed)  // the first to detect it saw the least disturbed picture
        if (namer == nullptr && records.count(f.rank) && records.at(f.rank).root >= 0)
          blamed = records.at(f.rank).root, namer = &f;
      if (blamed < 0) root = &failed.front();
    }
    auto log_of = [&](std::int64_t rank) { return log_dir + "/rank-" + std::to_string(rank) + ".log"; };
    // "rank 1 (pid 123)", with the node and host once the job spans several.
    auto who = [&](std::int64_t rank, pid_t pid) {
      std::string s = "rank " + std::to_string(rank) + " (pid " + std::to_string(pid);
      if (settings.nodes > 1) s += ", node " + std::to_string(settings.node_rank) + " " + core::host_name();
      return s + ")";
    };
    auto at_step = [&](std::int64_t rank) {
      const auto& l = ledgers[static_cast<std::size_t>(rank)];
      if (!store_read) return std::string();
      if (!l) return std::string(" before it joined the job");
      return l->step >= 0 ? " at step " + std::to_string(l->step) : std::string(" before training");
    };
    if (root != nullptr) {
      exit_code = WIFEXITED(root->status) ? WEXITSTATUS(root->status) : 128 + WTERMSIG(root->status);
      if (!store_read)
        report = "tessera: " + who(root->rank, root->pid) + " failed first: " + describe_status(root->status) +
                 " (the rendezvous store at " + settings.master_addr + ":" + std::to_string(port) +
                 " could not be read for the other ranks' reports); stopping the other ranks\n";
      else if (records.count(root->rank))  // it reported its own error
        report = "tessera: " + who(root->rank, root->pid) + " failed first: " + describe_status(root->status) +
                 at_step(root->rank) + "; stopping the other ranks\n";
      else  // it died without a word: killed, crashed, or exited
        report = "tessera: " + who(root->rank, root->pid) + " exited: " + describe_status(root->status) +
                 at_step(root->rank) + " without reporting an error; it failed first, stopping the other ranks\n";
      report += "  last lines of " + log_of(root->rank) + ":\n" + tail(log_of(root->rank), 15);
    } else {
      const Failed& first = *namer;
      const core::FailureRecord& named_by = records.at(first.rank);
      exit_code = WIFEXITED(first.status) ? WEXITSTATUS(first.status) : 128 + WTERMSIG(first.status);
      std::int64_t local_index = blamed - settings.node_rank * local;
      const bool here = local_index >= 0 && local_index < local;
      const std::string summary = named_by.root_summary.empty() ? std::string() : ": " + named_by.root_summary;
      if (here)  // alive when the launcher stopped it: hung, stopped, or stuck
        report = "tessera: " + who(blamed, pids[local_index]) + " failed first" + summary + " (named by rank " +
                 std::to_string(first.rank) + "'s hang report; it did not exit by itself: stopped by the launcher)\n";
      else  // on another node: its own launcher reports how it ended
        report = "tessera: " + core::rank_name(blamed, ledgers) + " on another node failed first" + summary +
                 " (named by rank " + std::to_string(first.rank) + "'s hang report)\n";
      report += "  rank " + std::to_string(first.rank) + " reported: " + named_by.message + "\n";
      if (here) report += "  last lines of " + log_of(blamed) + ":\n" + tail(log_of(blamed), 15);
    }
    // The others in the order they failed: a consequence only where its own report says so.
    std::vector<const Failed*> others;
    for (const Failed& f : failed)
      if (&f != root) others.push_back(&f);
    // A rank that reported its failure but had not exited when the settle period ended (a slow
    // exit: a large process's teardown, a sanitizer's leak check) is one of them too.
    for (const Failed& f : stopped)
      if (records.count(f.rank)) others.push_back(&f);
    std::stable_sort(others.begin(), others.end(),
                     [&](const Failed* x, const Failed* y) { return time_of(*x) < time_of(*y); });
    for (const Failed* f : others) {
      const bool consequence = records.count(f->rank) && records.at(f->rank).consequence;
      const char* label = consequence ? "  as a consequence: " : records.count(f->rank) ? "  also failed, by itself: " : "  also failed: ";
      report += std::string(label) + who(f->rank, f->pid) +
                " " + describe_status(f->status) +
                (records.count(f->rank) ? ": " + first_line(records.at(f->rank).message) : std::string()) + "\n";
    }
  }
  while (err_read >= 0) pump(100);
  if (rank0_log >= 0) ::close(rank0_log);
  if (!report.empty()) std::cerr << report << std::flush;
  return exit_code;
}

}  // namespace tessera::host
