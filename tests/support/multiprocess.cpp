#include "multiprocess.hpp"

#include "tessera/core/checkpoint_folder.hpp"  // remove_tree

#include <torch/cuda.h>

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <filesystem>

#include "tessera/core/checkpoint.hpp"
#include "tessera/toolkit/openblas.hpp"

#include <ATen/Parallel.h>

extern char** environ;

namespace tessera::testing {

namespace {

constexpr const char* kRankVariable = "TESSERA_TEST_RANK";

sdk::ClusterInfo cluster_from_environment();

/// One rank's end: its exit code after `body`, the test's failures counted.
[[noreturn]] void run_rank(const std::function<void(const sdk::ClusterInfo& cluster)>& body) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test runner killed by ctest's timeout leaves no rank behind
  if (::getppid() == 1) std::_Exit(3);
  int code = 0;
  try {
    body(cluster_from_environment());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s threw: %s\n", std::getenv(kRankVariable), e.what());
    code = 2;
  }
  if (code == 0 && ::testing::Test::HasFailure()) code = 1;
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

/// The last `lines` lines of a rank's log, without LibTorch's backtrace frames (a c10::Error's
/// what() ends with dozens of them, which would push its message out of the report).
std::string tail(const std::string& path, std::size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string line; std::getline(in, line);)
    if (line.find("frame #") == std::string::npos) all.push_back(line);
  std::ostringstream out;
  for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out << "    " << all[i] << "\n";
  return out.str();
}

sdk::ClusterInfo cluster_from_environment() {
  sdk::ClusterInfo c;
  c.global_rank = std::atoll(std::getenv(kRankVariable));
  c.world_size = std::atoll(std::getenv("WORLD_SIZE"));
  c.local_rank = c.global_rank;
  c.local_world_size = c.world_size;
  c.master_addr = "127.0.0.1";
  c.master_port = std::atoll(std::getenv("MASTER_PORT"));
  c.environment = "test";
  c.collective_timeout_s = std::atoll(std::getenv("TESSERA_TEST_COLLECTIVE_TIMEOUT"));
  return c;
}

}  // namespace

const char* plugin_dir() { return TESSERA_BUILD_PLUGIN_DIR; }

const char* tessera_binary() { return TESSERA_BINARY; }

void run_ranks(int world_size, std::chrono::seconds timeout,
               const std::function<void(const sdk::ClusterInfo& cluster)>& body) {
  if (std::getenv(kRankVariable) != nullptr) run_rank(body);  // an executed child: be one rank, then leave

  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string filter = std::string("--gtest_filter=") + test->test_suite_name() + "." + test->name();
  std::string exe(4096, '\0');
  exe.resize(static_cast<std::size_t>(::readlink("/proc/self/exe", exe.data(), exe.size())));
  const ReservedPort reserved;  // held until the ranks are done: rank 0's store listens on it
  std::string port = std::to_string(reserved.port());
  // A rank's collectives give up well before the test's own deadline, so a hang is reported
  // by the ranks themselves ("rank 1: ... timed out") when possible.
  std::string collective_timeout = std::to_string(std::max<long>(5, timeout.count() / 2));

  // A rank is this process forked while it runs no other thread (fork() copies only the calling
  // one): LibTorch is then loaded and the test's set-up done once, not once per rank; a test
  // process that has started threads (OpenMP's pool, say) executes itself filtered instead.
  // OpenBLAS's pool is ended first, as its own fork handler would (it restarts at its next call).
  tessera::toolkit::openblas::stop_threads();
  const bool fork_ranks = core::thread_count() == 1;
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(world_size);
  std::vector<std::string> logs(world_size);
  for (int rank = 0; rank < world_size; ++rank) {
    logs[rank] = ::testing::TempDir() + "tessera-rank-" + std::to_string(::getpid()) + "-" + std::to_string(rank) + ".log";
    const std::map<std::string, std::string> rank_environment{
        {kRankVariable, std::to_string(rank)}, {"WORLD_SIZE", std::to_string(world_size)},
        {"MASTER_PORT", port},                 {"TESSERA_TEST_COLLECTIVE_TIMEOUT", collective_timeout},
        {"OPENBLAS_NUM_THREADS", "1"},         {"OMP_NUM_THREADS", "1"}};
    if (fork_ranks) {
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0) << "cannot start rank " << rank << ": " << std::strerror(errno);
      if (pid == 0) {
        const int log = ::open(logs[rank].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (log < 0) std::_Exit(4);
        ::dup2(log, STDOUT_FILENO);
        ::dup2(log, STDERR_FILENO);
        ::close(log);
        for (const auto& [name, value] : rank_environment) ::setenv(name.c_str(), value.c_str(), 1);
        // The pools read those variables when they were loaded, in the parent: set them as such.
        at::set_num_threads(1);
        tessera::toolkit::openblas::set_num_threads(1);
        run_rank(body);
      }
      pids[rank] = pid;
      continue;
    }
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    for (const auto& [name, value] : rank_environment) env_strings.push_back(name + "=" + value);
    std::vector<char*> env;
    for (auto& s : env_strings) env.push_back(s.data());
    env.push_back(nullptr);
    std::vector<char*> argv{exe.data(), filter.data(), nullptr};
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, logs[rank].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    int rc = posix_spawn(&pids[rank], exe.c_str(), &actions, nullptr, argv.data(), env.data());
    posix_spawn_file_actions_destroy(&actions);
    ASSERT_EQ(rc, 0) << "cannot start rank " << rank;
  }

  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  std::string failure;
  while (remaining > 0 && failure.empty()) {
    for (int rank = 0; rank < world_size; ++rank) {
      if (done[rank]) continue;
      int status = 0;
      if (::waitpid(pids[rank], &status, WNOHANG) != pids[rank]) continue;
      done[rank] = true;
      --remaining;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      std::ostringstream why;
      why << "rank " << rank << " of " << world_size << " ";
      if (WIFSIGNALED(status)) why << "was killed by signal " << WTERMSIG(status);
      else why << "exited with status " << WEXITSTATUS(status);
      failure = why.str() + "; its output ends:\n" + tail(logs[rank], 25);
    }
    if (failure.empty() && remaining > 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::ostringstream why;
        for (int rank = 0; rank < world_size; ++rank)
          if (!done[rank]) why << "rank " << rank << " of " << world_size << " timed out after " << timeout.count()
                               << " s; its output ends:\n" << tail(logs[rank], 15);
        failure = why.str();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  for (int rank = 0; rank < world_size; ++rank) {
    if (done[rank]) continue;
    ::kill(pids[rank], SIGKILL);
    ::waitpid(pids[rank], nullptr, 0);
  }
  for (const auto& log : logs) std::remove(log.c_str());
  if (!failure.empty()) FAIL() << failure;
}

}  // namespace tessera::testing

namespace tessera::testing {

CommandResult run_tessera(const std::string& arguments, const std::string& environment, int timeout_s) {
  // The binary's jobs are CPU jobs, as on CI, on a GPU machine too (where accelerator "auto"
  // trains on CUDA, and several local ranks would want a GPU each); the CUDA paths have tests
  // of their own. A test that means CUDA sets CUDA_VISIBLE_DEVICES itself.
  const std::string gpus = environment.find("CUDA_VISIBLE_DEVICES=") == std::string::npos ? "CUDA_VISIBLE_DEVICES= " : "";
  // One compute thread per rank, as torchrun gives its workers: ctest runs two tests at a time on
  // CI's two cores, and ranks' idle worker threads spinning beside another test's ranks made a
  // tiny model's validation 10x slower. A test that means threads sets OMP_NUM_THREADS itself.
  const std::string threads = environment.find("OMP_NUM_THREADS=") == std::string::npos ? "OMP_NUM_THREADS=1 " : "";
  return run_command(gpus + threads + environment + " timeout -k 5 " + std::to_string(timeout_s) + " " + TESSERA_BINARY + " " +
                     arguments + " 2>&1");
}

std::string visible_gpus() {
  std::string devices;
  if (const char* set = std::getenv("CUDA_VISIBLE_DEVICES")) {
    devices = set;
  } else {
    for (std::size_t d = 0; d < torch::cuda::device_count(); ++d) devices += (d ? "," : "") + std::to_string(d);
  }
  return "CUDA_VISIBLE_DEVICES=" + devices;
}

CommandResult run_command(const std::string& command) {
  CommandResult result{0, ""};
  FILE* pipe = ::popen(command.c_str(), "r");
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) result.output += buffer;
  int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

void remove_dir(const std::filesystem::path& path) {
  std::error_code ec;
  core::remove_tree(path.string(), ec);
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

std::vector<std::string> files_in(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string fresh_dir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "tessera-" + name + "-" + std::to_string(::getpid());
  remove_dir(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::map<std::string, at::Tensor> checkpoint_state(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  auto checkpoint = core::checkpoint_dict(core::load_pickle(path), path);
  for (const auto& item : core::state_dict_from(core::checkpoint_get(checkpoint, "state_dict"), path))
    out[item.key()] = item.value();
  return out;
}

std::string run_dir(const std::string& default_root_dir) {
  std::int64_t newest = -1;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(default_root_dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("version_", 0) == 0 && name.size() > 8 && name.find_first_not_of("0123456789", 8) == std::string::npos)
      newest = std::max<std::int64_t>(newest, std::stoll(name.substr(8)));
  }
  return default_root_dir + "/version_" + std::to_string(std::max<std::int64_t>(newest, 0));
}

std::map<std::int64_t, double> metric_series(const std::string& csv, const std::string& stage,
                                             const std::string& metric) {
  std::map<std::int64_t, double> out;
  std::ifstream in(csv);
  std::string line;
  std::getline(in, line);  // header: step,epoch,stage,metric,value
  while (std::getline(in, line)) {
    std::stringstream row(line);
    std::string step, epoch, row_stage, name, value;
    std::getline(row, step, ',');
    std::getline(row, epoch, ',');
    std::getline(row, row_stage, ',');
    std::getline(row, name, ',');
    std::getline(row, value, ',');
    if (row_stage == stage && name == metric) out[std::stoll(step)] = std::stod(value);
  }
  return out;
}

}  // namespace tessera::testing
