#include "cluster/cluster.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>

#include "tessera/sdk/error.hpp"

extern char** environ;

namespace tessera::core {

namespace {

bool has(const Environment& env, const std::string& name) { return env.count(name) != 0; }

std::string get(const Environment& env, const std::string& name, const std::string& fallback) {
  auto it = env.find(name);
  return it == env.end() ? fallback : it->second;
}

std::int64_t parse_int(const std::string& text, const std::string& what) {
  std::size_t used = 0;
  std::int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSERA_CHECK(used == text.size() && !text.empty(), what, " = '", text, "' is not an integer");
  return value;
}

std::int64_t require_int(const Environment& env, const std::string& name, const std::string& kind) {
  auto it = env.find(name);
  TESSERA_CHECK(it != env.end(), "cluster environment '", kind, "' needs the variable ", name,
                ", which is not set (set [launch] cluster_environment = \"auto\" to detect the environment)");
  return parse_int(it->second, "cluster environment '" + kind + "': " + name);
}

std::int64_t optional_int(const Environment& env, const std::string& name, const std::string& kind,
                          std::int64_t fallback) {
  return has(env, name) ? require_int(env, name, kind) : fallback;
}

/// Splits at commas that are not inside brackets.
std::vector<std::string> split_top_level(const std::string& text) {
  std::vector<std::string> parts;
  std::string current;
  int depth = 0;
  for (char c : text) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      parts.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  parts.push_back(current);
  return parts;
}

}  // namespace

const std::vector<std::string>& cluster_environment_names() {
  static const std::vector<std::string> names = {"auto", "local", "torchrun", "slurm", "mpi", "single"};
  return names;
}

std::string detect_cluster_environment(const Environment& env) {
  if (has(env, "TESSERA_LAUNCHED") && has(env, "RANK")) return "local";
  if (has(env, "RANK") && has(env, "WORLD_SIZE") && has(env, "LOCAL_RANK")) return "torchrun";
  // Lightning: an interactive Slurm allocation (salloc + bash) is not a Slurm-launched job.
  std::string job_name = get(env, "SLURM_JOB_NAME", "");
  if (has(env, "SLURM_NTASKS") && has(env, "SLURM_PROCID") && job_name != "bash" && job_name != "interactive")
    return "slurm";
  if (has(env, "OMPI_COMM_WORLD_RANK") && has(env, "OMPI_COMM_WORLD_SIZE")) return "mpi";
  return "single";
}

std::vector<std::string> slurm_hostnames(const std::string& nodelist) {
  std::vector<std::string> hosts;
  for (const std::string& item : split_top_level(nodelist)) {
    if (item.empty()) continue;
    auto open = item.find('[');
    if (open == std::string::npos) {
      hosts.push_back(item);
      continue;
    }
    auto close = item.find(']', open);
    TESSERA_CHECK(close != std::string::npos && item.find('[', open + 1) == std::string::npos,
                  "SLURM_NODELIST = '", nodelist, "': cannot parse '", item,
                  "' (expected host names or prefix[a-b,c]suffix ranges)");
    std::string prefix = item.substr(0, open), suffix = item.substr(close + 1);
    for (const std::string& range : split_top_level(item.substr(open + 1, close - open - 1))) {
      auto dash = range.find('-');
      std::string first = range.substr(0, dash), last = dash == std::string::npos ? first : range.substr(dash + 1);
      std::int64_t from = parse_int(first, "SLURM_NODELIST range '" + range + "'");
      std::int64_t to = parse_int(last, "SLURM_NODELIST range '" + range + "'");
      TESSERA_CHECK(from <= to, "SLURM_NODELIST = '", nodelist, "': range ", range, " is empty");
      for (std::int64_t n = from; n <= to; ++n) {
        std::string digits = std::to_string(n);
        if (digits.size() < first.size()) digits.insert(0, first.size() - digits.size(), '0');  // keep padding
        hosts.push_back(prefix + digits + suffix);
      }
    }
  }
  return hosts;
}

std::vector<std::int64_t> slurm_tasks_per_node(const std::string& value) {
  std::vector<std::int64_t> counts;
  for (const std::string& item : split_top_level(value)) {
    auto paren = item.find("(x");
    std::int64_t tasks = parse_int(item.substr(0, paren), "SLURM_TASKS_PER_NODE");
    std::int64_t repeat = 1;
    if (paren != std::string::npos) {
      TESSERA_CHECK(item.back() == ')', "SLURM_TASKS_PER_NODE = '", value, "': cannot parse '", item, "'");
      repeat = parse_int(item.substr(paren + 2, item.size() - paren - 3), "SLURM_TASKS_PER_NODE");
    }
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), tasks);
  }
  return counts;
}

sdk::ClusterInfo cluster_info(const Environment& env, const std::string& requested, const ClusterDefaults& defaults) {
  const auto& names = cluster_environment_names();
  TESSERA_CHECK(std::find(names.begin(), names.end(), requested) != names.end(), "[launch] cluster_environment = '",
                requested, "' is not known", sdk::did_you_mean(requested, names), "; valid: ", sdk::join(names));
  const std::string kind = requested == "auto" ? detect_cluster_environment(env) : requested;
  sdk::ClusterInfo c;
  c.environment = kind;
  c.collective_timeout_s = defaults.collective_timeout_s;
  c.master_addr = defaults.master_addr;
  c.master_port = defaults.master_port;
  if (kind == "single") return c;

  if (kind == "local" || kind == "torchrun") {
    c.global_rank = require_int(env, "RANK", kind);
    c.world_size = require_int(env, "WORLD_SIZE", kind);
    c.local_rank = require_int(env, "LOCAL_RANK", kind);
    c.local_world_size = optional_int(env, "LOCAL_WORLD_SIZE", kind, c.world_size);
    c.master_addr = get(env, "MASTER_ADDR", defaults.master_addr);
    c.master_port = require_int(env, "MASTER_PORT", kind);
    c.node_rank = optional_int(env, "GROUP_RANK", kind, c.global_rank / std::max<std::int64_t>(1, c.local_world_size));
  } else if (kind == "slurm") {
    c.global_rank = require_int(env, "SLURM_PROCID", kind);
    c.world_size = require_int(env, "SLURM_NTASKS", kind);
    c.local_rank = require_int(env, "SLURM_LOCALID", kind);
    c.node_rank = optional_int(env, "SLURM_NODEID", kind, 0);
    std::vector<std::string> hosts = slurm_hostnames(get(env, "SLURM_NODELIST", get(env, "SLURM_JOB_NODELIST", "")));
    std::int64_t nodes = optional_int(env, "SLURM_NNODES", kind, std::max<std::int64_t>(1, hosts.size()));
    if (has(env, "SLURM_TASKS_PER_NODE")) {
      auto counts = slurm_tasks_per_node(env.at("SLURM_TASKS_PER_NODE"));
      TESSERA_CHECK(c.node_rank < static_cast<std::int64_t>(counts.size()), "SLURM_TASKS_PER_NODE = '",
                    env.at("SLURM_TASKS_PER_NODE"), "' lists ", counts.size(), " nodes but SLURM_NODEID is ",
                    c.node_rank);
      c.local_world_size = counts[static_cast<std::size_t>(c.node_rank)];
    } else if (has(env, "SLURM_NTASKS_PER_NODE")) {
      c.local_world_size = require_int(env, "SLURM_NTASKS_PER_NODE", kind);
    } else {
      c.local_world_size = std::max<std::int64_t>(1, c.world_size / nodes);
    }
    c.num_nodes = nodes;
    // Lightning's choices: MASTER_ADDR if set, else the first node; the port derived from
    // the job id, so every node computes the same one.
    c.master_addr = get(env, "MASTER_ADDR", hosts.empty() ? std::string("127.0.0.1") : hosts.front());
    std::string job = get(env, "SLURM_JOB_ID", "");
    std::int64_t port = 12910;
    if (!job.empty()) port = 15000 + parse_int(job.substr(job.size() > 4 ? job.size() - 4 : 0), "SLURM_JOB_ID");
    c.master_port = optional_int(env, "MASTER_PORT", kind, port);
  } else if (kind == "mpi") {
    c.global_rank = require_int(env, "OMPI_COMM_WORLD_RANK", kind);
    c.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", kind);
    c.local_rank = optional_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", kind, c.global_rank);
    c.local_world_size = optional_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", kind, c.world_size);
    c.node_rank = optional_int(env, "OMPI_COMM_WORLD_NODE_RANK", kind,
                               c.global_rank / std::max<std::int64_t>(1, c.local_world_size));
    c.master_addr = get(env, "MASTER_ADDR", defaults.master_addr);
    c.master_port = optional_int(env, "MASTER_PORT", kind, defaults.master_port ? defaults.master_port : 29500);
    TESSERA_CHECK(c.local_world_size == c.world_size || has(env, "MASTER_ADDR") ||
                      (c.master_addr != "127.0.0.1" && c.master_addr != "localhost"),
                  "cluster environment 'mpi' spans ", c.world_size / std::max<std::int64_t>(1, c.local_world_size),
                  " nodes but the master address is ", c.master_addr,
                  ": export MASTER_ADDR (mpirun -x MASTER_ADDR=<rank 0's host>) or set [launch] master_addr");
  } else {
    TESSERA_FAIL("unknown cluster environment '", kind, "'");
  }
  TESSERA_CHECK(c.world_size >= 1 && c.global_rank >= 0 && c.global_rank < c.world_size, "cluster environment '",
                kind, "': rank ", c.global_rank, " is outside world size ", c.world_size);
  TESSERA_CHECK(c.local_world_size >= 1 && c.local_rank >= 0 && c.local_rank < c.local_world_size,
                "cluster environment '", kind, "': local rank ", c.local_rank, " is outside local world size ",
                c.local_world_size);
  TESSERA_CHECK(c.master_port > 0 && c.master_port < 65536, "cluster environment '", kind, "': master port ",
                c.master_port, " is not a valid TCP port (1-65535)");
  if (kind != "slurm") c.num_nodes = std::max<std::int64_t>(1, c.world_size / c.local_world_size);
  return c;
}

Environment process_environment() {
  Environment env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) env.emplace(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return env;
}

char process_state(std::int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return 0;
  std::size_t paren = text.rfind(')');  // the command name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < text.size() ? text[paren + 2] : 'R';
}

std::size_t thread_count() {
  std::error_code error;
  std::size_t n = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", error), end; !error && it != end; it.increment(error)) ++n;
  return error ? 0 : n;
}

ReservedPort::ReservedPort() : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
  TESSERA_CHECK(fd_ >= 0, "cannot open a socket to find a free port: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof(address);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    const int error = errno;
    ::close(fd_);
    TESSERA_FAIL("cannot find a free TCP port: ", std::strerror(error));
  }
  // After the bind, so that the kernel chose a port nobody holds; from now on only another
  // SO_REUSEADDR socket may bind it too, and only to listen there.
  const int on = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  port_ = ntohs(address.sin_port);
}

ReservedPort::~ReservedPort() { ::close(fd_); }

}  // namespace tessera::core
