// The local launcher of the `tessera` binary: busy ports, failure reports, interrupts, a
// killed launcher, and torchrun's error file. Tiny GPT runs on fortunes, 2 ranks.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "multiprocess.hpp"

namespace {

using tessera::testing::run_tessera;
using Clock = std::chrono::steady_clock;

std::string write_config(const std::string& dir, std::int64_t max_steps = 4) {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = " << max_steps << "\nlog_every_n_steps = 1\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "[strategy]\nplugin = \"ddp\"\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 16\n"
                                   << "block_size = 16\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nbatch_size = 2\n";
  return dir + "/run.toml";
}

using tessera::testing::read_file;

/// Whether any process still runs with `dir` in its command line.
bool processes_left(const std::string& dir) {
  return std::system(("pgrep -f '" + dir + "/run[.]toml' >/dev/null").c_str()) == 0;
}

/// Waits up to `seconds` for every process of the run in `dir` to be gone.
bool all_gone_within(const std::string& dir, double seconds) {
  auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) {
    if (!processes_left(dir)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return !processes_left(dir);
}

/// Starts `tessera fit` on `config` in the background (output to `dir`/launcher.out).
pid_t start_fit(const std::string& dir, const std::string& config, const std::string& sets) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::string command = std::string("exec ") + tessera::testing::tessera_binary() + " fit --config " + config + " " +
                          sets + " > " + dir + "/launcher.out 2>&1";
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

/// Waits until `path` contains `text`, at most `seconds`.
bool wait_for_text(const std::string& path, const std::string& text, double seconds) {
  auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) {
    if (read_file(path).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Threads per rank: [launch] num_threads, else OMP_NUM_THREADS as LibTorch reads it (torchrun
// sets 1), else the cores over the local ranks; the launcher says how many each rank got.
TEST(Launcher, ThreadsPerRankFollowNumThreadsThenOmpNumThreads) {
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  for (const auto& [environment, sets, threads] : std::vector<std::tuple<std::string, std::string, std::int64_t>>{
           {"OMP_NUM_THREADS=3", "", 3},
           {"OMP_NUM_THREADS=3", " --set launch.num_threads=2", 2},
           {"OMP_NUM_THREADS=", "", std::max<std::int64_t>(1, cores / 2)}}) {
    std::string dir = tessera::testing::fresh_dir("launch-threads");
    auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2 --set trainer.max_steps=1" + sets,
                         environment, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(", " + std::to_string(threads) + " thread(s) each)"), std::string::npos)
        << environment << sets << "\n" << r.output;
  }
}

TEST(Launcher, EveryRankLogsAndOnlyRankZeroTalks) {
  std::string dir = tessera::testing::fresh_dir("launch-logs");
  auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2", "", 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launched 2 local rank(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[local]"), std::string::npos) << "the environment is printed at start\n" << r.output;
  for (int rank : {0, 1}) {
    std::string log = read_file(dir + "/version_0/logs/rank-" + std::to_string(rank) + ".log");
    EXPECT_NE(log.find("step"), std::string::npos) << "rank " << rank << " log:\n" << log;
  }
}

TEST(Launcher, BusyMasterPortIsReplacedByAFreeOne) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  int busy = ntohs(address.sin_port);
  std::string dir = tessera::testing::fresh_dir("launch-port");
  auto r = run_tessera("fit --config " + write_config(dir, 2) + " --set launch.devices=2 --set launch.master_port=" +
                           std::to_string(busy),
                       "", 120);
  ::close(fd);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("master_port = " + std::to_string(busy) + " is in use"), std::string::npos) << r.output;
}

TEST(Launcher, ExitingRankIsReportedWithItsStatusAndLogTail) {
  std::string dir = tessera::testing::fresh_dir("launch-exit");
  auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=2",
                       "TESSERA_FAULT_INJECT=rank=0,step=2,kind=exit", 120);
  EXPECT_EQ(r.exit_code, 3) << "the launcher exits with the failing rank's status\n" << r.output;
  EXPECT_NE(r.output.find("rank 0 (pid"), std::string::npos) << r.output;
  // It exited by itself, without an error of its own: named as exited (issue 46.8), with where its
  // last heartbeat (twice a second) showed it: "at step N", or "before training" when it died
  // before one published a step.
  EXPECT_TRUE(r.output.find("exited: exit status 3 at step ") != std::string::npos ||
              r.output.find("exited: exit status 3 before training") != std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(" without reporting an error; it failed first"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| fault injection: rank 0 exit at step 2"), std::string::npos)
      << "the report quotes the rank's log\n" << r.output;
  EXPECT_TRUE(all_gone_within(dir, 2)) << "a rank outlived the launcher";
}

TEST(Launcher, InterruptStopsEveryRank) {
  std::string dir = tessera::testing::fresh_dir("launch-interrupt");
  pid_t launcher = start_fit(dir, write_config(dir, 100000), "--set launch.devices=2");
  ASSERT_TRUE(wait_for_text(dir + "/version_0/logs/rank-1.log", "step", 90)) << read_file(dir + "/launcher.out");
  auto start = Clock::now();
  ::kill(launcher, SIGTERM);
  int status = 0;
  ::waitpid(launcher, &status, 0);
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << read_file(dir + "/launcher.out");
  EXPECT_LT(seconds, 15);
  EXPECT_NE(read_file(dir + "/launcher.out").find("interrupted"), std::string::npos) << read_file(dir + "/launcher.out");
  EXPECT_TRUE(all_gone_within(dir, 2)) << "a rank outlived the launcher";
}

TEST(Launcher, KilledLauncherLeavesNoOrphans) {
  std::string dir = tessera::testing::fresh_dir("launch-sigkill");
  pid_t launcher = start_fit(dir, write_config(dir, 100000), "--set launch.devices=2");
  ASSERT_TRUE(wait_for_text(dir + "/version_0/logs/rank-1.log", "step", 90)) << read_file(dir + "/launcher.out");
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  EXPECT_TRUE(all_gone_within(dir, 5)) << "ranks survived their launcher (PR_SET_PDEATHSIG)";
}

TEST(Launcher, TorchrunWorkerWritesTheElasticErrorFile) {
  std::string dir = tessera::testing::fresh_dir("launch-elastic");
  std::string error_file = dir + "/error.json";
  const tessera::testing::ReservedPort port;
  auto r = run_tessera("fit --config " + write_config(dir) + " --set data.path=/nonexistent",
                       "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                           std::to_string(port.port()) + " TORCHELASTIC_ERROR_FILE=" + error_file,
                       120);
  EXPECT_NE(r.exit_code, 0);
  std::string json = read_file(error_file);
  EXPECT_NE(json.find("{\"message\": {\"message\": \""), std::string::npos) << json;
  EXPECT_NE(json.find("/nonexistent"), std::string::npos) << json;
  EXPECT_NE(json.find("\"timestamp\""), std::string::npos) << json;
}

}  // namespace
