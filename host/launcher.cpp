#include "launcher.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "tessera/sdk/error.hpp"

extern char** environ;

namespace tessera::host {

namespace {

std::int64_t require_int(const std::map<std::string, std::string>& env, const std::string& name,
                         const std::string& environment) {
  auto it = env.find(name);
  TESSERA_CHECK(it != env.end(), "cluster environment '", environment, "' needs the variable ", name,
                ", which is not set");
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    TESSERA_FAIL("cluster environment '", environment, "': ", name, "=", it->second, " is not an integer");
  }
}

std::string get(const std::map<std::string, std::string>& env, const std::string& name, const std::string& fallback) {
  auto it = env.find(name);
  return it == env.end() ? fallback : it->second;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

std::string tail(const std::string& path, std::size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string line; std::getline(in, line);) all.push_back(line);
  std::string out;
  for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "  | " + all[i] + "\n";
  return out;
}

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int signal) { g_interrupted = signal; }

}  // namespace

std::map<std::string, std::string> environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

std::string first_slurm_host(const std::string& nodelist) {
  std::string first = nodelist.substr(0, nodelist.find(','));
  auto bracket = nodelist.find('[');
  if (bracket == std::string::npos || bracket > first.size()) return first;
  std::string prefix = nodelist.substr(0, bracket);
  std::string range = nodelist.substr(bracket + 1, nodelist.find(']', bracket) - bracket - 1);
  std::string head = range.substr(0, range.find_first_of(",-"));
  return prefix + head;
}

sdk::ClusterInfo detect_cluster(const std::map<std::string, std::string>& env, const LaunchSettings& settings) {
  std::string kind = settings.cluster_environment;
  if (kind == "auto") {
    if (env.count("TESSERA_LAUNCHED")) kind = "local";
    else if (env.count("TORCHELASTIC_RUN_ID") || (env.count("RANK") && env.count("WORLD_SIZE") && env.count("LOCAL_RANK")))
      kind = "torchrun";
    else if (env.count("SLURM_NTASKS") && env.count("SLURM_PROCID") && get(env, "SLURM_JOB_NAME", "") != "bash" &&
             get(env, "SLURM_JOB_NAME", "") != "interactive")
      kind = "slurm";
    else if (env.count("OMPI_COMM_WORLD_RANK") && env.count("OMPI_COMM_WORLD_SIZE"))
      kind = "mpi";
    else
      kind = "single";
  }
  sdk::ClusterInfo c;
  c.environment = kind;
  c.collective_timeout_s = settings.collective_timeout_s;
  if (kind == "single") {
    c.master_addr = settings.master_addr;
    c.master_port = settings.master_port;
    return c;
  }
  if (kind == "local" || kind == "torchrun") {
    c.global_rank = require_int(env, "RANK", kind);
    c.world_size = require_int(env, "WORLD_SIZE", kind);
    c.local_rank = require_int(env, "LOCAL_RANK", kind);
    c.local_world_size = env.count("LOCAL_WORLD_SIZE") ? require_int(env, "LOCAL_WORLD_SIZE", kind) : c.world_size;
    c.master_addr = get(env, "MASTER_ADDR", "127.0.0.1");
    c.master_port = require_int(env, "MASTER_PORT", kind);
    c.node_rank = env.count("GROUP_RANK") ? require_int(env, "GROUP_RANK", kind) : c.global_rank / c.local_world_size;
  } else if (kind == "slurm") {
    c.global_rank = require_int(env, "SLURM_PROCID", kind);
    c.world_size = require_int(env, "SLURM_NTASKS", kind);
    c.local_rank = require_int(env, "SLURM_LOCALID", kind);
    c.node_rank = env.count("SLURM_NODEID") ? require_int(env, "SLURM_NODEID", kind) : 0;
    c.local_world_size = env.count("SLURM_NTASKS_PER_NODE")
                             ? std::stoll(get(env, "SLURM_NTASKS_PER_NODE", "1"))
                             : c.world_size;
    c.master_addr = get(env, "MASTER_ADDR", first_slurm_host(get(env, "SLURM_NODELIST", "127.0.0.1")));
    // Lightning's choice: a port derived from the job id, the same on every node.
    std::int64_t job = env.count("SLURM_JOB_ID") ? require_int(env, "SLURM_JOB_ID", kind) : 0;
    c.master_port = env.count("MASTER_PORT") ? require_int(env, "MASTER_PORT", kind) : 10000 + job % 20000;
  } else if (kind == "mpi") {
    c.global_rank = require_int(env, "OMPI_COMM_WORLD_RANK", kind);
    c.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", kind);
    c.local_rank = env.count("OMPI_COMM_WORLD_LOCAL_RANK") ? require_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", kind) : 0;
    c.local_world_size =
        env.count("OMPI_COMM_WORLD_LOCAL_SIZE") ? require_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", kind) : c.world_size;
    c.node_rank = env.count("OMPI_COMM_WORLD_NODE_RANK") ? require_int(env, "OMPI_COMM_WORLD_NODE_RANK", kind)
                                                         : c.global_rank / c.local_world_size;
    c.master_addr = get(env, "MASTER_ADDR", settings.master_addr);
    c.master_port = env.count("MASTER_PORT") ? require_int(env, "MASTER_PORT", kind)
                                             : (settings.master_port ? settings.master_port : 29500);
  } else {
    TESSERA_FAIL("unknown cluster environment '", kind, "'");
  }
  TESSERA_CHECK(c.world_size >= 1 && c.global_rank >= 0 && c.global_rank < c.world_size, "cluster environment '",
                kind, "': rank ", c.global_rank, " is outside world size ", c.world_size);
  c.num_nodes = std::max<std::int64_t>(1, c.world_size / std::max<std::int64_t>(1, c.local_world_size));
  return c;
}

void configure_threads(const LaunchSettings& settings, const sdk::ClusterInfo& cluster) {
  std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  std::int64_t threads =
      settings.num_threads > 0 ? settings.num_threads : std::max<std::int64_t>(1, cores / cluster.local_world_size);
  at::set_num_threads(static_cast<int>(threads));
  // OpenBLAS keeps its own pool that at::set_num_threads does not touch.
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    set(static_cast<int>(threads));
}

std::optional<int> launch_or_join(const LaunchSettings& settings, const std::string& log_dir, int argc, char** argv,
                                  sdk::ClusterInfo& cluster) {
  auto env = environment();
  cluster = detect_cluster(env, settings);
  if (cluster.environment != "single" || settings.devices * settings.nodes == 1) return std::nullopt;

  // We are the local launcher: start `devices` ranks of this node.
  const std::int64_t local = settings.devices, world = settings.devices * settings.nodes;
  std::int64_t port = settings.master_port;
  if (port == 0) {
    TESSERA_CHECK(settings.nodes == 1, "[launch] nodes = ", settings.nodes,
                  " needs an explicit [launch] master_port shared by every node");
    port = free_port();
  }
  std::filesystem::create_directories(log_dir);
  std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  std::int64_t threads = settings.num_threads > 0 ? settings.num_threads : std::max<std::int64_t>(1, cores / local);

  std::vector<pid_t> pids(local);
  std::vector<std::string> logs(local);
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  for (std::int64_t i = 0; i < local; ++i) {
    std::int64_t rank = settings.node_rank * local + i;
    logs[i] = log_dir + "/rank-" + std::to_string(rank) + ".log";
    std::ofstream(logs[i], std::ios::trunc);  // a fresh log per run
    std::map<std::string, std::string> child = env;
    child["TESSERA_LAUNCHED"] = "1";
    child["RANK"] = std::to_string(rank);
    child["LOCAL_RANK"] = std::to_string(i);
    child["WORLD_SIZE"] = std::to_string(world);
    child["LOCAL_WORLD_SIZE"] = std::to_string(local);
    child["GROUP_RANK"] = std::to_string(settings.node_rank);
    child["MASTER_ADDR"] = settings.master_addr;
    child["MASTER_PORT"] = std::to_string(port);
    child["OMP_NUM_THREADS"] = std::to_string(threads);
    child["OPENBLAS_NUM_THREADS"] = std::to_string(threads);
    std::vector<std::string> strings;
    for (const auto& [k, v] : child) strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    TESSERA_CHECK(pid >= 0, "cannot start rank ", rank, ": fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
      if (::getppid() != parent) ::_exit(1);
      if (i != 0) {  // only rank 0 talks to the terminal; every rank also logs to its file
        int fd = ::open(logs[i].c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        ::close(fd);
      }
      ::execve(exe.c_str(), argv, envp.data());
      ::_exit(127);
    }
    pids[i] = pid;
  }
  (void)argc;
  std::cerr << "tessera: launched " << local << " local ranks (world size " << world << ", master "
            << settings.master_addr << ":" << port << "), logs in " << log_dir << "/\n";

  struct sigaction action{};
  action.sa_handler = on_signal;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);

  std::vector<bool> done(local, false);
  std::int64_t remaining = local;
  int exit_code = 0;
  std::string report;
  while (remaining > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR && g_interrupted) {
        for (std::int64_t i = 0; i < local; ++i)
          if (!done[i]) ::kill(pids[i], SIGTERM);
        if (report.empty()) report = "tessera: interrupted; stopping all ranks\n", exit_code = 128 + g_interrupted;
        continue;
      }
      if (errno == EINTR) continue;
      break;
    }
    auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    std::int64_t i = it - pids.begin();
    done[i] = true;
    --remaining;
    bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!failed || !report.empty()) continue;
    std::int64_t rank = settings.node_rank * local + i;
    exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    report = "tessera: rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") failed first: " +
             (WIFSIGNALED(status) ? std::string("killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
                                        strsignal(WTERMSIG(status)) + ")"
                                  : "exit status " + std::to_string(WEXITSTATUS(status))) +
             "\n  last lines of " + logs[i] + ":\n" + tail(logs[i], 12);
    // Stop the others: SIGTERM now, SIGKILL after a grace period (no orphans either way).
    for (std::int64_t j = 0; j < local; ++j)
      if (!done[j]) ::kill(pids[j], SIGTERM);
    std::thread([pids, local] {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      for (std::int64_t j = 0; j < local; ++j) ::kill(pids[j], SIGKILL);
    }).detach();
  }
  if (!report.empty()) std::cerr << report;
  return exit_code;
}

}  // namespace tessera::host
