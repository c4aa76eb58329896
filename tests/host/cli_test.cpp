// The binary: failing ranks, the allocator, shared-memory collectives, idle workers, usage.
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "multiprocess.hpp"
#include "sanitizers.hpp"
#include "tessera/sdk/autocast.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/safetensors.hpp"
#include "host_fixtures.hpp"

namespace {

using namespace tessera::testing::host;

TEST(Failures, AKilledRankEndsTheJobNamingIt) {
  std::string dir = tessera::testing::fresh_dir("kill");
  auto start = std::chrono::steady_clock::now();
  auto r = run_tessera("fit --config " + write_config(dir) + " --set launch.devices=3 --set strategy.plugin=ddp",
                       "TESSERA_FAULT_INJECT=rank=1,step=2,kind=kill", 120);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
  EXPECT_LT(seconds, 60) << "the job took too long to stop";
  EXPECT_NE(std::system(("pgrep -f '" + dir + "/run[.]toml' >/dev/null").c_str()), 0) << "a rank outlived the job";
}

TEST(Failures, AHungRankBecomesACollectiveTimeoutReport) {
  std::string dir = tessera::testing::fresh_dir("hang");
  auto r = run_tessera("fit --config " + write_config(dir) +
                           " --set launch.devices=2 --set strategy.plugin=fsdp --set launch.collective_timeout_s=5",
                       "TESSERA_FAULT_INJECT=rank=1,step=2,kind=hang", 120);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("failed first"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0: reduce timed out after 5 s"), std::string::npos)
      << "the report should say which collective timed out on which rank\n" << r.output;
  EXPECT_NE(std::system(("pgrep -f '" + dir + "/run[.]toml' >/dev/null").c_str()), 0) << "a rank outlived the job";
}

// The binary's malloc is jemalloc (memory on the 1/N line without environment variables):
// jemalloc itself answers MALLOC_CONF, which glibc's malloc ignores.
TEST(Cli, TheBinarysAllocatorIsJemalloc) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  auto r = run_tessera("--version", "MALLOC_CONF=stats_print:true");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("___ Begin jemalloc statistics ___"), std::string::npos) << r.output;
}

// Every training process keeps the pages it frees for the next step (jemalloc's decay off:
// each step faulted its activations in again), and any of them may serve a later request. In a job of several ranks the arena of blocks
// above the oversize threshold still purges at once (kept, they serve few later requests:
// FSDP's 1/N memory). jemalloc's statistics, printed at exit, say what each process runs with.
namespace {
// The decay time of arena `index`, as jemalloc's statistics print it ("   dirty:   N/A ..."
// for none, "   dirty:     0 ..." for an immediate purge); "" when the arena is not listed.
std::string arena_decay(const std::string& stats, const std::string& index) {
  auto at = stats.find("arenas[" + index + "]:");
  if (at == std::string::npos) return "";
  at = stats.find("   dirty:", at);
  std::istringstream line(stats.substr(at + 9, 40));
  std::string decay;
  line >> decay;
  return decay;
}
std::string opt_narenas(const std::string& stats) {
  auto at = stats.find("opt.narenas: ");
  return at == std::string::npos ? "" : stats.substr(at + 13, stats.find('\n', at) - at - 13);
}
}  // namespace

TEST(Cli, TrainingKeepsFreedPagesShardedJobsReturnOversizeBlocks) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  const std::string dir = tessera::testing::fresh_dir("allocator-decay");
  auto one = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1", "MALLOC_CONF=stats_print:true");
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("(arenas.dirty_decay_ms: -1)"), std::string::npos) << one.output;
  // Any kept extent serves any request (PlanVsMeasuredPeak.ALongRunStaysAtThePlannedPeak).
  EXPECT_NE(one.output.find("opt.lg_extent_max_active_fit: 20"), std::string::npos) << one.output;
  EXPECT_EQ(arena_decay(one.output, "0"), "N/A") << one.output;
  const std::string oversize_arena = opt_narenas(one.output);  // it follows the ordinary ones
  ASSERT_FALSE(oversize_arena.empty()) << one.output;
  EXPECT_NE(arena_decay(one.output, oversize_arena), "0") << one.output;  // "N/A", or "" if never made
  const std::string dir2 = tessera::testing::fresh_dir("allocator-decay-2");
  auto two = run_tessera("fit --config " + write_config(dir2) + " --set trainer.max_steps=1 --set launch.devices=2 "
                         "--set strategy.plugin=fsdp", "MALLOC_CONF=stats_print:true");
  EXPECT_EQ(two.exit_code, 0) << two.output;
  const std::string rank1 = file_bytes(dir2 + "/version_0/logs/rank-1.log");
  EXPECT_NE(rank1.find("(arenas.dirty_decay_ms: -1)"), std::string::npos) << rank1;
  EXPECT_EQ(arena_decay(rank1, oversize_arena), "0") << rank1;
  // A decay the user sets wins.
  auto chosen = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1",
                            "MALLOC_CONF=stats_print:true,dirty_decay_ms:500");
  EXPECT_NE(chosen.output.find("(arenas.dirty_decay_ms: 500)"), std::string::npos) << chosen.output;
}

// Ranks of one host move their all-gathers, reduce-scatters and all-reduces through shared
// memory (Gloo on loopback carried ~1 GB/s); [launch] shared_memory_collectives = false leaves
// every collective to Gloo. Each rank's log says which carried them, and the training matches.
TEST(Cli, RanksOfOneHostCollectThroughSharedMemoryUnlessTurnedOff) {
  std::map<bool, double> final_loss;
  for (bool shared : {true, false}) {
    const std::string dir = tessera::testing::fresh_dir(shared ? "shm-on" : "shm-off");
    auto run = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=3 --set launch.devices=2 "
                           "--set strategy.plugin=fsdp --set launch.shared_memory_collectives=" +
                           (shared ? "true" : "false --set strategy.process_group_backend=gloo"));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const std::string rank1 = file_bytes(dir + "/version_0/logs/rank-1.log");
    const std::string expected = shared ? "collectives: shared memory among the 2 ranks of this host" : "collectives: Gloo\n";
    EXPECT_NE(rank1.find(expected), std::string::npos) << rank1;
    auto loss = tessera::testing::metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
    ASSERT_FALSE(loss.empty());
    final_loss[shared] = loss.rbegin()->second;
  }
  EXPECT_NEAR(final_loss[true], final_loss[false], 1e-4);
}

// A /dev/shm without room for the segment (here a 1 MiB tmpfs in a mount namespace of the
// job's own) leaves every collective to Gloo: rank 0's reservation fails up front, every rank
// learns it through the store, the job trains and says so; no rank hits SIGBUS later.
TEST(Cli, AFullDevShmLeavesTheCollectivesToGloo) {
  if (tessera::testing::run_command("unshare -m true 2>&1").exit_code != 0)
    GTEST_SKIP() << "SKIPPED: this machine lets no process make a mount namespace (unshare -m)";
  const std::string dir = tessera::testing::fresh_dir("shm-full");
  auto run = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=3 --set launch.devices=2 "
                         "--set strategy.plugin=fsdp",
                         "unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec \"$@\"' sh");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* rank : {"0", "1"}) {
    const std::string log = file_bytes(dir + "/version_0/logs/rank-" + rank + ".log");
    EXPECT_NE(log.find("collectives: Gloo\n"), std::string::npos) << "rank " << rank << "\n" << log;
  }
  auto loss = tessera::testing::metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss");
  ASSERT_EQ(loss.size(), 3u) << run.output;
  EXPECT_TRUE(std::isfinite(loss.rbegin()->second));
}

// libgomp's workers spin 300,000 times after a parallel region by default, and OpenBLAS's
// (pthreads build) for 2^28 cycles after a matmul, each on the cores the other needs: a training
// process runs with GOMP_SPINCOUNT=10000 and OPENBLAS_THREAD_TIMEOUT=20, set before either loads
// by re-executing itself once; ranks are forked from it and run with its pools' settings (no
// second re-execution, no second load of libgomp), and a choice of the user's stands. libgomp itself prints its settings under OMP_DISPLAY_ENV; OpenBLAS prints
// nothing, so its setting is read from the running process's environment.
TEST(Cli, TrainingProcessesKeepIdleWorkersFromSpinning) {
  auto count = [](const std::string& text, const std::string& what) {
    std::size_t n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  const std::string clean_env =
      "env -u GOMP_SPINCOUNT -u OMP_WAIT_POLICY -u OPENBLAS_THREAD_TIMEOUT OMP_DISPLAY_ENV=VERBOSE";
  const std::string dir = tessera::testing::fresh_dir("openmp-spin");
  auto one = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1", clean_env);
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(count(one.output, "GOMP_SPINCOUNT = '300000'"), 1u) << one.output;  // before the re-execution
  EXPECT_EQ(count(one.output, "GOMP_SPINCOUNT = '10000'"), 1u) << one.output;
  const std::string dir2 = tessera::testing::fresh_dir("openmp-spin-2");
  auto two = run_tessera("fit --config " + write_config(dir2) + " --set trainer.max_steps=1 --set launch.devices=2 "
                         "--set strategy.plugin=ddp", clean_env);
  EXPECT_EQ(two.exit_code, 0) << two.output;
  // libgomp prints its settings when it loads: once before the launcher's re-execution, once
  // after, never in a rank (forked, it runs the launcher's libgomp as loaded with 10000).
  EXPECT_EQ(count(two.output, "GOMP_SPINCOUNT = '300000'"), 1u) << two.output;
  EXPECT_EQ(count(two.output, "GOMP_SPINCOUNT = '10000'"), 1u) << two.output;
  const std::string rank1 = file_bytes(dir2 + "/version_0/logs/rank-1.log");
  EXPECT_EQ(count(rank1, "GOMP_SPINCOUNT ="), 0u) << rank1;
  EXPECT_NE(rank1.find("step 1/1"), std::string::npos) << rank1;
  auto chosen = run_tessera("fit --config " + write_config(dir) + " --set trainer.max_steps=1",
                            clean_env + " OMP_WAIT_POLICY=ACTIVE OPENBLAS_THREAD_TIMEOUT=20");
  EXPECT_EQ(chosen.exit_code, 0) << chosen.output;
  EXPECT_EQ(count(chosen.output, "OMP_WAIT_POLICY = 'ACTIVE'"), 1u) << chosen.output;
  EXPECT_EQ(count(chosen.output, "GOMP_SPINCOUNT = '10000'"), 0u) << chosen.output;

  // The environment a training process runs in, read from /proc once it has re-executed.
  auto training_environment = [&](const std::string& name, const std::string& env) {
    const std::string run = tessera::testing::fresh_dir(name);
    std::ofstream(run + "/environ.sh")
        << "cd " << run << "\n" << clean_env << " " << env << " CUDA_VISIBLE_DEVICES= " << tessera::testing::tessera_binary() << " fit --config " << write_config(run)
        << " --set trainer.max_steps=100000 > out.txt 2>&1 &\npid=$!\n"
        << "for i in $(seq 600); do tr '\\0' '\\n' < /proc/$pid/environ > environ.txt 2>/dev/null;"
        << " grep -q '^GOMP_SPINCOUNT=' environ.txt && break; sleep 0.05; done\n"
        << "cat /proc/$pid/comm > comm.txt\nkill -KILL $pid\n";
    EXPECT_EQ(std::system(("timeout 60 bash " + run + "/environ.sh").c_str()), 0);
    // Named after its binary, not after /proc/self/exe ("exe"), once re-executed.
    EXPECT_EQ(file_bytes(run + "/comm.txt"), "tessera\n");
    return file_bytes(run + "/environ.txt");
  };
  using GetParallel = int (*)();
  auto openblas_parallel = reinterpret_cast<GetParallel>(::dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  // Only OpenBLAS's pthreads build has a pool of its own (its OpenMP build waits in libgomp's;
  // LibTorch's pip wheels use MKL).
  const bool pthreads = openblas_parallel != nullptr && openblas_parallel() == 1;
  const std::string set = training_environment("openblas-timeout", "");
  EXPECT_NE(set.find("GOMP_SPINCOUNT=10000\n"), std::string::npos) << set;
  EXPECT_EQ(set.find("OPENBLAS_THREAD_TIMEOUT=20\n") != std::string::npos, pthreads) << set;
  const std::string kept = training_environment("openblas-timeout-chosen", "OPENBLAS_THREAD_TIMEOUT=24");
  EXPECT_NE(kept.find("OPENBLAS_THREAD_TIMEOUT=24\n"), std::string::npos) << kept;
  EXPECT_EQ(kept.find("OPENBLAS_THREAD_TIMEOUT=20"), std::string::npos) << kept;
}

TEST(Cli, HelpUsageAndBadArguments) {
  auto help = run_tessera("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("tessera fit|validate|test|predict --config FILE.toml"), std::string::npos) << help.output;
  auto none = run_tessera("");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.output.find("no command given"), std::string::npos) << none.output;
  auto typo = run_tessera("fitt --config x.toml");
  EXPECT_EQ(typo.exit_code, 2);
  EXPECT_NE(typo.output.find("unknown command 'fitt' (did you mean 'fit'?)"), std::string::npos) << typo.output;
  auto no_config = run_tessera("fit");
  EXPECT_NE(no_config.output.find("fit needs --config FILE.toml"), std::string::npos) << no_config.output;
  auto missing = run_tessera("fit --config /nonexistent/run.toml");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("config file /nonexistent/run.toml does not exist"), std::string::npos)
      << missing.output;
}

TEST(Cli, PluginsListsEveryShippedPlugin) {
  auto r = run_tessera("plugins");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"single_device", "ddp", "fsdp", "fsdp_cpu_offload", "precision", "fsdp-precision",
                           "torch", "distributed", "gpt", "llama", "mlp", "cnn", "text", "fashion_mnist", "tokens"})
    EXPECT_NE(r.output.find(std::string(" ") + name + " "), std::string::npos) << name << "\n" << r.output;
}



}  // namespace
