// Collective bandwidth between local ranks against message size, N ranks (default 2): Gloo on
// loopback and tessera's shared-memory channel (comm/shared_memory_channel.hpp) side by side,
// all measured in the same run so the ratios mean something. all_gather into one flat tensor,
// reduce_scatter (Gloo: all_to_all + local sum), all_reduce.
//   collectives_bench [--world-size N] [--max-mb M] [--seconds S] [--bf16]
// Bus bandwidth follows nccl-tests: all_gather / reduce_scatter move (n-1)/n of the full
// buffer per rank, all_reduce 2(n-1)/n. rs/ag: Gloo's reduce_scatter bandwidth over its
// all_gather's for the same bytes (issue 13 asks >= 0.9x); shm/gloo: the channel over Gloo.
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cluster/cluster.hpp"
#include "tessera/core/comm.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using tessera::core::Communicator;

struct Settings {
  int world_size = 2;
  double max_mb = 64;
  double seconds = 0.4;  ///< per (operation, size)
  bool bf16 = false;
};

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--world-size") s.world_size = std::stoi(next());
    else if (a == "--max-mb") s.max_mb = std::stod(next());
    else if (a == "--seconds") s.seconds = std::stod(next());
    else if (a == "--bf16") s.bf16 = true;
    else {
      std::fprintf(stderr, "usage: collectives_bench [--world-size N] [--max-mb M] [--seconds S] [--bf16]\n");
      std::exit(2);
    }
  }
  return s;
}

/// Mean seconds per call of `op` over about `budget` seconds: a warm-up call, a 3-call
/// estimate, then a count that rank 0 picks and broadcasts, timed between barriers so that
/// no synchronisation of the bench itself is inside the measurement.
template <typename Op>
double time_per_call(Communicator& comm, double budget, Op op) {
  op();
  comm.barrier("bench: estimate");
  auto start = Clock::now();
  for (int i = 0; i < 3; ++i) op();
  double estimate = std::chrono::duration<double>(Clock::now() - start).count() / 3;
  at::Tensor calls = at::full({1}, std::max(3.0, std::min(1e5, budget / std::max(estimate, 1e-7))), at::kDouble);
  comm.broadcast(calls, 0, "bench: calls")->wait();
  const auto n = static_cast<std::int64_t>(calls.item<double>());
  comm.barrier("bench: start");
  start = Clock::now();
  for (std::int64_t i = 0; i < n; ++i) op();
  return std::chrono::duration<double>(Clock::now() - start).count() / static_cast<double>(n);
}

int run_rank(const Settings& s) {
  tessera::sdk::ClusterInfo cluster;
  cluster.global_rank = std::atoi(std::getenv("TESSERA_BENCH_RANK"));
  cluster.world_size = s.world_size;
  cluster.local_rank = cluster.global_rank;
  cluster.local_world_size = s.world_size;
  cluster.master_port = std::atoi(std::getenv("MASTER_PORT"));
  cluster.collective_timeout_s = 120;
  at::set_num_threads(1);
  // The world group over Gloo alone; a split of all ranks gets the shared-memory channel.
  tessera::core::CommSettings settings;
  settings.shared_memory = false;
  tessera::core::set_comm_settings(settings);
  auto gloo = tessera::core::make_communicator(cluster, c10::kCPU);
  settings.shared_memory = true;
  tessera::core::set_comm_settings(settings);
  std::vector<std::int64_t> everyone;
  for (std::int64_t r = 0; r < s.world_size; ++r) everyone.push_back(r);
  auto shm = gloo->split({everyone});
  const std::int64_t n = gloo->size();
  const at::ScalarType dtype = s.bf16 ? at::kBFloat16 : at::kFloat;
  const double element = s.bf16 ? 2.0 : 4.0;
  const double bus_gather = static_cast<double>(n - 1) / static_cast<double>(n);
  if (gloo->rank() == 0) {
    std::printf("tessera collectives between local ranks: %lld ranks, %s; bus bandwidths in GB/s (nccl-tests)\n",
                static_cast<long long>(n), s.bf16 ? "bf16" : "fp32");
    std::printf("%10s | %27s | %27s | %23s | %6s\n", "", "Gloo on loopback", "shared memory", "shm / gloo", "gloo");
    std::printf("%10s | %8s %8s %9s | %8s %8s %9s | %7s %7s %7s | %6s\n", "bytes", "all_gath", "red_scat",
                "all_reduce", "all_gath", "red_scat", "all_reduce", "ag", "rs", "ar", "rs/ag");
  }
  for (double bytes = 4096; bytes <= s.max_mb * 1024 * 1024 + 1; bytes *= 4) {
    // The full (unsharded) buffer has `bytes`; rounded to a multiple of the world size.
    std::int64_t numel = static_cast<std::int64_t>(bytes / element) / n * n;
    at::Tensor full = at::rand({numel}, at::kFloat).to(dtype);
    at::Tensor shard = at::empty({numel / n}, dtype);
    at::Tensor gathered = at::empty({numel}, dtype);
    at::Tensor reduced = full.clone();
    struct Times {
      double gather, scatter, reduce;
    };
    auto measure = [&](Communicator& comm) {
      return Times{
          time_per_call(comm, s.seconds, [&] { comm.all_gather(gathered, shard, "bench all_gather")->wait(); }),
          time_per_call(comm, s.seconds, [&] {
            comm.reduce_scatter(shard, full, tessera::sdk::ReduceOp::sum, "bench reduce_scatter")->wait();
          }),
          time_per_call(comm, s.seconds, [&] {
            comm.all_reduce(reduced, tessera::sdk::ReduceOp::sum, "bench all_reduce")->wait();
          })};
    };
    const Times g = measure(*gloo), m = measure(*shm);
    if (gloo->rank() == 0) {
      double b = static_cast<double>(numel) * element;
      auto bw = [&](double t, double factor) { return b * factor / t / 1e9; };
      std::printf("%10.0f | %8.3f %8.3f %9.3f | %8.3f %8.3f %9.3f | %6.1fx %6.1fx %6.1fx | %5.2fx\n", b,
                  bw(g.gather, bus_gather), bw(g.scatter, bus_gather), bw(g.reduce, 2 * bus_gather),
                  bw(m.gather, bus_gather), bw(m.scatter, bus_gather), bw(m.reduce, 2 * bus_gather),
                  g.gather / m.gather, g.scatter / m.scatter, g.reduce / m.reduce, g.gather / g.scatter);
      std::fflush(stdout);
    }
  }
  if (shm->stats().shared_memory_calls == 0) {
    std::fprintf(stderr, "the split group did not get the shared-memory channel\n");
    return 1;
  }
  gloo->barrier("bench end");
  return 0;
}


}  // namespace

int main(int argc, char** argv) {
  Settings s = parse(argc, argv);
  if (std::getenv("TESSERA_BENCH_RANK") != nullptr) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    try {
      return run_rank(s);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %s: %s\n", std::getenv("TESSERA_BENCH_RANK"), e.what());
      return 1;
    }
  }
  const tessera::core::ReservedPort reserved;  // rank 0's store listens on it
  std::string port = std::to_string(reserved.port());
  std::vector<pid_t> pids;
  for (int rank = 0; rank < s.world_size; ++rank) {
    std::vector<std::string> strings;
    for (char** e = environ; *e != nullptr; ++e) strings.emplace_back(*e);
    strings.push_back("TESSERA_BENCH_RANK=" + std::to_string(rank));
    strings.push_back("MASTER_PORT=" + port);
    strings.push_back("OPENBLAS_NUM_THREADS=1");
    strings.push_back("OMP_NUM_THREADS=1");
    std::vector<char*> env;
    for (auto& e : strings) env.push_back(e.data());
    env.push_back(nullptr);
    pid_t pid = 0;
    if (::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, env.data()) != 0) {
      std::fprintf(stderr, "cannot start rank %d\n", rank);
      return 1;
    }
    pids.push_back(pid);
  }
  int code = 0;
  for (std::size_t rank = 0; rank < pids.size(); ++rank) {
    int status = 0;
    ::waitpid(pids[rank], &status, 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      std::fprintf(stderr, "rank %zu failed (status %d)\n", rank, status);
      code = 1;
      for (pid_t p : pids) ::kill(p, SIGKILL);
    }
  }
  return code;
}
