// More than one host (issue 45), on two "hosts" made of namespaces (tests/support/two_hosts.hpp):
// 2 hosts x 2 ranks train as 4 ranks on one host do, for every way groups are split (fsdp
// FULL_SHARD and HYBRID_SHARD, fsdp2 HSDP, dp2 x tp2); a host whose name resolves only to
// loopback is refused before training; a host killed or cut off is named by node and host in
// the survivors' report; and a job whose rank dies is restarted by Debian's torchrun and ends
// with the losses of an uninterrupted run ([trainer] resume = "auto").
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <thread>

#include "multiprocess.hpp"
#include "tessera/core/ledger.hpp"
#include "two_hosts.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::testing::CommandResult;
using tessera::testing::TwoHosts;
using Clock = std::chrono::steady_clock;

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)
#define EXPECT_LACKS(text, part) EXPECT_EQ(std::string(text).find(part), std::string::npos) << (text)

using tessera::testing::read_file;

constexpr int kPort = 29400;  // each pair of hosts has its own network: no other test can hold it

/// A 2-layer GPT on fortunes, 4 sequences per step over the data-parallel ranks.
std::string write_config(const std::string& dir, std::int64_t max_steps, const std::string& strategy,
                         const std::string& extra = "") {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = " << max_steps << "\nlog_every_n_steps = 1\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "enable_model_summary = false\nnum_sanity_val_steps = 0\nlimit_val_batches = 0\n"
                                   << "[logger]\nversion = \"0\"\n"
                                   << "[optimizer]\nname = \"adamw\"\nlr = 0.003\nschedule = \"constant\"\n"
                                   << "[strategy]\n" << strategy << "\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 32\nblock_size = 16\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n"
                                   << extra;
  return dir + "/run.toml";
}

/// The launcher's arguments for node `node` of 2 (2 ranks each), master on host 0.
std::string node_args(const TwoHosts& hosts, const std::string& config, int node, const std::string& sets = "") {
  return std::string("CUDA_VISIBLE_DEVICES= ") + tessera::testing::tessera_binary() + " fit --config " + config +
         " --set launch.devices=2 --set launch.nodes=2 --set launch.node_rank=" + std::to_string(node) +
         " --set launch.master_addr=" + hosts.name(0) + " --set launch.master_port=" + std::to_string(kPort) + " " + sets;
}

std::map<std::int64_t, double> losses(const std::string& dir) {
  return tessera::testing::metric_series(dir + "/version_0/metrics.csv", "train", "train_loss");
}

class OnTwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!hosts_.why_not().empty()) GTEST_SKIP() << "SKIPPED: two hosts cannot be made here: " << hosts_.why_not();
  }
  TwoHosts hosts_;
};

// ---------------------------------------------------------------- report rules (no processes)

using tessera::core::LedgerEntry;

LedgerEntry entry(std::int64_t rank, std::int64_t published_ms, std::int64_t waiting, const std::string& host,
                  std::int64_t node) {
  LedgerEntry e;
  e.rank = rank;
  e.published_ms = published_ms;
  e.step = 18;
  e.phase = "train";
  e.issued = 40;
  e.issued_tag = "backward reduce-scatter of blocks.1";
  e.waiting = waiting;
  e.waiting_tag = waiting ? e.issued_tag : "";
  e.host = host;
  e.node = node;
  return e;
}

TEST(Reports, AHostWhoseRanksAllStoppedIsNamedByNodeAndHost) {
  const std::int64_t now = 1'000'000;
  std::vector<std::optional<LedgerEntry>> ledgers = {entry(0, now, 40, "hosta", 0), entry(1, now - 100, 40, "hosta", 0),
                                                     entry(2, now - 3000, 0, "hostb", 1),
                                                     entry(3, now - 3000, 0, "hostb", 1)};
  auto d = tessera::core::diagnose(0, ledgers, {}, now, 2.0);
  EXPECT_EQ(d.root, 2);
  EXPECT_EQ(d.cause, "lost");
  EXPECT_CONTAINS(d.text, "node 1 (hostb): ranks 2-3 lost at step 18 (no heartbeat for 3 s");
  EXPECT_CONTAINS(d.text, "rank 3 (node 1, hostb) also stopped responding at step 18");
  EXPECT_LACKS(d.text, "runs at step");
}

TEST(Reports, ARankWhoseProcessIsGoneIsNamedExitedNotStuck) {
  const std::int64_t now = 1'000'000;
  std::vector<std::optional<LedgerEntry>> ledgers = {entry(0, now, 40, "hosta", 0), entry(1, now - 100, 0, "hosta", 0)};
  ledgers[1]->issued = 39;  // behind rank 0, outside any collective
  auto stuck = tessera::core::diagnose(0, ledgers, {}, now, 2.0);  // alive: it is stuck outside collectives
  EXPECT_EQ(stuck.cause, "stuck");
  auto gone = tessera::core::diagnose(0, ledgers, {}, now, 2.0, {1});
  EXPECT_EQ(gone.root, 1);
  EXPECT_EQ(gone.cause, "exited");
  EXPECT_CONTAINS(gone.text, "rank 1 exited at step 18 without a report (its process is gone)");
  EXPECT_LACKS(gone.text, "stuck");
  // One host: ranks are named without a host, as before.
  EXPECT_EQ(tessera::core::rank_name(1, ledgers), "rank 1");
}

TEST(Reports, RankListsAndRecordsKeepTheRootSummary) {
  EXPECT_EQ(tessera::core::ranks_text({2, 3}), "ranks 2-3");
  EXPECT_EQ(tessera::core::ranks_text({0, 2}), "ranks 0, 2");
  EXPECT_EQ(tessera::core::ranks_text({4}), "rank 4");
  tessera::core::FailureRecord f{1, 99, true, 2, "collective broke\nsecond line"};
  f.root_summary = "node 1 (hostb): ranks 2-3 lost at step 18";
  auto back = tessera::core::FailureRecord::parse(f.serialize());
  EXPECT_EQ(back.root_summary, f.root_summary);
  EXPECT_EQ(back.message, f.message);
  LedgerEntry e = entry(2, 5, 0, "hostb", 1);
  auto parsed = LedgerEntry::parse(e.serialize());
  EXPECT_EQ(parsed.host, "hostb");
  EXPECT_EQ(parsed.node, 1);
}

// ---------------------------------------------------------------- parity: 2 x 2 = 4 x 1

struct Layout {
  const char* name;
  const char* strategy;  ///< the [strategy] table
  int tp;                ///< ranks that see the same batch
  const char* path = "";  ///< what the log says carries a group's collectives
};
// Else GoogleTest prints a Layout as its bytes (pointers), different at each run of the binary,
// in the test names ctest lists and keys its cost data by.
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class Parity : public OnTwoHosts, public ::testing::WithParamInterface<Layout> {};

TEST_P(Parity, TwoHostsOfTwoRanksTrainAsFourRanksOnOneHost) {
  const Layout layout = GetParam();
  // Gloo carries every collective on both sides and each rank computes on one thread, so the
  // same sums run in the same order: one host or two must not change a bit.
  const std::string batch = "--set data.batch_size=" + std::to_string(4 * layout.tp / 4) +
                            " --set launch.shared_memory_collectives=false --set launch.num_threads=1";
  std::string one = tessera::testing::fresh_dir(std::string("parity-one-") + layout.name);
  auto single = tessera::testing::run_tessera(
      "fit --config " + write_config(one, 3, layout.strategy) + " --set launch.devices=4 " + batch, "", 240);
  ASSERT_EQ(single.exit_code, 0) << single.output;

  std::string two = tessera::testing::fresh_dir(std::string("parity-two-") + layout.name);
  std::string config = write_config(two, 3, layout.strategy);
  auto [a, b] = hosts_.run_both(node_args(hosts_, config, 0, batch), node_args(hosts_, config, 1, batch), 240);
  ASSERT_EQ(a.exit_code, 0) << "host a:\n" << a.output << "\nhost b:\n" << b.output;
  ASSERT_EQ(b.exit_code, 0) << "host b:\n" << b.output << "\nhost a:\n" << a.output;
  // Each node's ranks bound the link's address, every split group too (a group on loopback
  // would have failed to connect across the hosts).
  const auto reference = losses(one), across = losses(two);
  ASSERT_EQ(reference.size(), 3u) << single.output;
  ASSERT_EQ(across.size(), 3u) << a.output << read_file(two + "/version_0/logs/rank-2.log");
  // metrics.csv keeps 8 digits: equal there (a wrong reduction or shard is off by far more).
  for (const auto& [step, loss] : reference)
    EXPECT_NEAR(across.at(step), loss, 1e-6 * std::abs(loss)) << layout.name << " step " << step;
  // Each group names its path in the log: across hosts Gloo binds the link's address.
  EXPECT_CONTAINS(read_file(two + "/version_0/logs/rank-2.log"), "collectives: Gloo over " + hosts_.address(1));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Parity,
    ::testing::Values(Layout{"fsdp_full_shard", "plugin = \"fsdp\"", 1},
                      Layout{"fsdp_hybrid_shard",
                             "plugin = \"fsdp\"\nsharding_strategy = \"HYBRID_SHARD\"\nhybrid_shard_group_size = 2", 1},
                      Layout{"fsdp2_hsdp", "plugin = \"fsdp2\"\ndata_parallel_replicate_size = 2", 1},
                      Layout{"fsdp2_dp2_tp2", "plugin = \"fsdp2\"\ntensor_parallel_size = 2", 2}),
    [](const ::testing::TestParamInfo<Layout>& info) { return std::string(info.param.name); });

/// With shared memory on (the default), a group across hosts runs in two levels: shared memory
/// among a host's ranks, Gloo only between the hosts. Its sums run in another order than one
/// host's, so the two agree to rounding; two runs on two hosts agree in every bit.
class TwoLevelParity : public OnTwoHosts, public ::testing::WithParamInterface<Layout> {};

TEST_P(TwoLevelParity, TwoHostsMatchOneHostAndRepeatTheirBits) {
  const Layout layout = GetParam();
  const std::string sets = "--set launch.num_threads=1";
  std::string one = tessera::testing::fresh_dir(std::string("two-level-one-") + layout.name);
  auto single = tessera::testing::run_tessera(
      "fit --config " + write_config(one, 3, layout.strategy) + " --set launch.devices=4 " + sets, "", 240);
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const auto reference = losses(one);
  ASSERT_EQ(reference.size(), 3u) << single.output;

  std::string runs[2];
  for (std::string& two : runs) {
    two = tessera::testing::fresh_dir(std::string("two-level-two-") + layout.name);
    std::string config = write_config(two, 3, layout.strategy);
    auto [a, b] = hosts_.run_both(node_args(hosts_, config, 0, sets), node_args(hosts_, config, 1, sets), 240);
    ASSERT_EQ(a.exit_code, 0) << "host a:\n" << a.output << "\nhost b:\n" << b.output;
    ASSERT_EQ(b.exit_code, 0) << "host b:\n" << b.output << "\nhost a:\n" << a.output;
    const auto across = losses(two);
    ASSERT_EQ(across.size(), 3u) << a.output;
    for (const auto& [step, loss] : reference)
      EXPECT_NEAR(across.at(step), loss, 1e-5 * std::abs(loss)) << layout.name << " step " << step;
    EXPECT_CONTAINS(read_file(two + "/version_0/logs/rank-2.log"), layout.path);
  }
  EXPECT_EQ(read_file(runs[0] + "/version_0/metrics.csv"), read_file(runs[1] + "/version_0/metrics.csv"));
  const std::string weights[2] = {read_file(runs[0] + "/version_0/checkpoints/last.ckpt"),
                                  read_file(runs[1] + "/version_0/checkpoints/last.ckpt")};
  ASSERT_FALSE(weights[0].empty());
  EXPECT_TRUE(weights[0] == weights[1]) << "the two runs' checkpoints differ";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TwoLevelParity,
    ::testing::Values(
        // The world group spans both hosts, two ranks on each.
        Layout{"fsdp_full_shard", "plugin = \"fsdp\"", 1,
               "two levels: shared memory among the 2 ranks of each of 2 hosts, Gloo over 10.77.0.2 across hosts"},
        // Shards within each host (shared memory), replicas across (one rank per host: Gloo).
        Layout{"fsdp2_hsdp", "plugin = \"fsdp2\"\ndata_parallel_replicate_size = 2", 1,
               "group ranks 2-3: shared memory among the 2 ranks of this host"}),
    [](const ::testing::TestParamInfo<Layout>& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------- start-up refused, bounded

TEST_F(OnTwoHosts, AHostWhoseNameResolvesOnlyToLoopbackIsRefusedBeforeTraining) {
  // Debian's default /etc/hosts: the host's own name on 127.0.1.1.
  hosts_.write_hosts(1, "127.0.0.1 localhost\n127.0.1.1 " + hosts_.name(1) + "\n" + hosts_.address(0) + " " +
                            hosts_.name(0) + "\n");
  std::string dir = tessera::testing::fresh_dir("loopback-host");
  std::string config = write_config(dir, 3, "plugin = \"fsdp\"");
  const std::string sets = "--set launch.rendezvous_timeout_s=60";
  auto start = Clock::now();
  auto [a, b] = hosts_.run_both(node_args(hosts_, config, 0, sets), node_args(hosts_, config, 1, sets), 120);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(b.exit_code, 0) << b.output;
  // Rank 2's refusal or rank 3's, whichever the launcher saw first.
  EXPECT_TRUE(std::regex_search(b.output, std::regex("node 1 \\(tessera-b, rank [23]\\): this host's name 'tessera-b' "
                                                     "resolves only to loopback \\(127\\.0\\.1\\.1\\) in a job across 2 nodes")))
      << b.output;
  EXPECT_CONTAINS(b.output, "[launch] interface = \"" + hosts_.interface(1) + "\"");
  // Host a stops as soon as host b's refusal is in the store, not at the rendezvous timeout.
  EXPECT_NE(a.exit_code, 0) << a.output;
  EXPECT_CONTAINS(a.output, "failed: node 1 (tessera-b, rank ");  // rank 2's or rank 3's refusal, whichever came first
  EXPECT_LT(seconds, 55) << a.output;
  EXPECT_FALSE(fs::exists(dir + "/version_0/metrics.csv") && !losses(dir).empty()) << "it trained";
}

TEST_F(OnTwoHosts, ARankThatNeverJoinsIsNamedWithinTheRendezvousTimeout) {
  // Host b starts nothing: host a's ranks wait for ranks 2-3 in the rendezvous, then say so.
  std::string dir = tessera::testing::fresh_dir("never-joins");
  std::string config = write_config(dir, 3, "plugin = \"fsdp\"");
  auto start = Clock::now();
  auto [a, b] = hosts_.run_both(node_args(hosts_, config, 0, "--set launch.rendezvous_timeout_s=6"), "true", 120);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(a.exit_code, 0) << a.output;
  EXPECT_CONTAINS(a.output, "rendezvous_timeout_s = 6");
  EXPECT_TRUE(a.output.find("rank 2") != std::string::npos && a.output.find("rank 3") != std::string::npos) << a.output;
  EXPECT_LT(seconds, 60) << a.output;
}

// ---------------------------------------------------------------- a host lost

/// Starts a long 2 x 2 fit; once rank 3 trains, `strike` runs; returns both nodes' results.
std::pair<CommandResult, CommandResult> lose_host(const TwoHosts& hosts, const std::string& dir,
                                                  const std::function<void()>& strike, double& seconds) {
  std::string config = write_config(dir, 100000, "plugin = \"fsdp\"");
  const std::string sets = "--set launch.collective_timeout_s=6 --set trainer.log_every_n_steps=1";
  auto job = std::async(std::launch::async, [&] {
    return hosts.run_both(node_args(hosts, config, 0, sets), node_args(hosts, config, 1, sets), 150);
  });
  auto until = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < until && job.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready &&
         !std::regex_search(read_file(dir + "/version_0/logs/rank-3.log"), std::regex("step [3-9]")))
    ;
  auto start = Clock::now();
  strike();
  auto result = job.get();
  seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

TEST_F(OnTwoHosts, AKilledHostIsNamedByNodeAndHostWithItsRanks) {
  std::string dir = tessera::testing::fresh_dir("host-kill");
  double seconds = 0;
  auto [a, b] = lose_host(hosts_, dir, [&] {
    // Every process of host b at once (its launcher and ranks), as a machine that loses power.
    hosts_.kill_all(1);
  }, seconds);
  EXPECT_NE(a.exit_code, 0) << a.output;
  EXPECT_CONTAINS(a.output, "node 1 (tessera-b): ranks 2-3 lost at step");
  EXPECT_LACKS(a.output, "stopped by the launcher");
  EXPECT_LACKS(a.output, "runs at step");
  EXPECT_LACKS(a.output, "stuck outside");
  EXPECT_LT(seconds, 6 + 20) << "survivors stop within the collective timeout\n" << a.output;
}

TEST_F(OnTwoHosts, ALinkDownIsNamedOnBothSides) {
  std::string dir = tessera::testing::fresh_dir("link-down");
  double seconds = 0;
  auto [a, b] = lose_host(hosts_, dir, [&] { hosts_.set_link(false); }, seconds);
  hosts_.set_link(true);
  EXPECT_NE(a.exit_code, 0) << a.output;
  EXPECT_NE(b.exit_code, 0) << b.output;
  // Host a hosts the store: it sees host b's heartbeats stop.
  EXPECT_CONTAINS(a.output, "node 1 (tessera-b): ranks 2-3 lost at step");
  // Host b cannot reach the store on host a: it names it.
  EXPECT_CONTAINS(b.output, "the rendezvous store at tessera-a:" + std::to_string(kPort) + " does not answer");
  EXPECT_LACKS(a.output + b.output, "stopped by the launcher");
  EXPECT_LT(seconds, 6 + 30) << a.output << b.output;
}

// ---------------------------------------------------------------- restarted by torchrun

std::string torchrun_unavailable() {
  if (!fs::exists("/usr/bin/python3") ||
      std::system("/usr/bin/python3 -c 'import torch.distributed.run' >/dev/null 2>&1") != 0)
    return "Debian's python3-torch (torchrun) is not installed";
  return "";
}

TEST(Restart, AJobWhoseRankDiesIsRestartedByTorchrunAndEndsWithTheUninterruptedLosses) {
  if (const std::string why = torchrun_unavailable(); !why.empty()) GTEST_SKIP() << "SKIPPED: " << why;
  auto config = [&](const std::string& dir) {
    // One thread per rank under both launchers (torchrun sets OMP_NUM_THREADS=1, tessera's
    // launcher cores / ranks): the same sums in the same order, bit for bit.
    std::string path = write_config(dir, 8, "plugin = \"ddp\"", "[launch]\nnum_threads = 1\n");
    std::string text = read_file(path);
    text.replace(text.find("[logger]\nversion = \"0\"\n"), 23, "");
    text.replace(text.find("[trainer]\n"), 10, "[trainer]\nresume = \"auto\"\ncheckpoint_every_n_steps = 2\n");
    std::ofstream(path) << text;
    return path;
  };
  std::string reference_dir = tessera::testing::fresh_dir("restart-reference");
  auto reference = tessera::testing::run_tessera("fit --config " + config(reference_dir) + " --set launch.devices=2",
                                                 "", 240);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;

  std::string dir = tessera::testing::fresh_dir("restart");
  const tessera::testing::ReservedPort port;
  // Rank 1 is killed at step 5 of the first attempt only; the second resumes from step 4's save.
  std::string command = "TESSERA_FAULT_INJECT=rank=1,step=5,kind=kill,attempt=0 CUDA_VISIBLE_DEVICES= timeout -k 5 240 "
                        "/usr/bin/python3 -m torch.distributed.run --nproc_per_node=2 --max_restarts=1 "
                        "--redirects 2 --tee 2 --monitor_interval 1 --master_port=" +
                        std::to_string(port.port()) + " --no_python " + tessera::testing::tessera_binary() +
                        " fit --config " + config(dir) + " 2>&1";
  auto r = tessera::testing::run_command(command);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/version_1")) << "the restarted attempt is a run of its own\n" << r.output;
  auto first = tessera::testing::metric_series(dir + "/version_0/metrics.csv", "train", "train_loss");
  // The first attempt died (rank 1 killed at step 5; torchrun tees stderr only, so the injection's
  // log line is not in this output): its run never reached the last step.
  EXPECT_FALSE(first.count(8)) << "the first attempt was not interrupted\n" << r.output;
  auto resumed = tessera::testing::metric_series(dir + "/version_1/metrics.csv", "train", "train_loss");
  auto expected = tessera::testing::metric_series(reference_dir + "/version_0/metrics.csv", "train", "train_loss");
  ASSERT_EQ(expected.size(), 8u) << reference.output;
  EXPECT_FALSE(resumed.count(4)) << "resumed after step 4's checkpoint\n" << r.output;
  for (std::int64_t step = 5; step <= 8; ++step) {
    ASSERT_TRUE(resumed.count(step)) << "step " << step << "\n" << r.output;
    EXPECT_EQ(resumed.at(step), expected.at(step)) << "step " << step;
  }
  // Bitwise: the final weights of the restarted job are the uninterrupted run's.
  auto want = tessera::testing::checkpoint_state(reference_dir + "/version_0/checkpoints/last.ckpt");
  auto got = tessera::testing::checkpoint_state(dir + "/version_1/checkpoints/last.ckpt");
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [name, tensor] : want) EXPECT_TRUE(tensor.equal(got.at(name))) << name;
}

// torchelastic's contract at a smaller world size (--nnodes=1:2): host b is lost mid-run, and
// torchrun on host a restarts its two ranks as a job of world size 2, which resumes ([trainer]
// resume = "auto") from the newest sharded checkpoint the four ranks committed. It trains exactly
// as two ranks resumed from that checkpoint by hand do (the same sums in the same order: bitwise).
TEST_F(OnTwoHosts, AnElasticJobThatLosesAHostGoesOnWithTheOtherFromTheShardedCheckpoint) {
  if (const std::string why = torchrun_unavailable(); !why.empty()) GTEST_SKIP() << "SKIPPED: " << why;
  auto config = [&](const std::string& dir) {
    std::string path = write_config(dir, 30, "plugin = \"fsdp2\"\nstate_dict_type = \"sharded\"",
                                    "[checkpoint_io]\nplugin = \"distributed\"\n[launch]\nnum_threads = 1\n");
    std::string text = read_file(path);
    text.replace(text.find("[logger]\nversion = \"0\"\n"), 23, "");
    text.replace(text.find("[trainer]\n"), 10, "[trainer]\nresume = \"auto\"\ncheckpoint_every_n_steps = 2\n");
    std::ofstream(path) << text;
    return path;
  };
  std::string dir = tessera::testing::fresh_dir("elastic");
  const std::string run = config(dir);
  const std::string torchrun =
      "CUDA_VISIBLE_DEVICES= /usr/bin/python3 -m torch.distributed.run --nnodes=1:2 --nproc_per_node=2 "
      "--max_restarts=1 --rdzv_backend=c10d --rdzv_endpoint=" + hosts_.name(0) + ":" + std::to_string(kPort) +
      " --rdzv_id=elastic --rdzv_conf=last_call_timeout=1 --redirects 2 --tee 2 --monitor_interval 1 --no_python " +
      tessera::testing::tessera_binary() + " fit --config " + run;
  auto job = std::async(std::launch::async, [&] { return hosts_.run_both(torchrun, torchrun, 240); });
  // Host b goes once the four ranks have committed a few sharded saves.
  auto until = Clock::now() + std::chrono::seconds(150);
  while (Clock::now() < until && job.wait_for(std::chrono::milliseconds(200)) != std::future_status::ready &&
         !std::regex_search(read_file(dir + "/version_0/logs/rank-3.log"), std::regex("step (7|8|9|1[0-9])")))
    ;
  hosts_.kill_all(1);
  auto [a, b] = job.get();
  ASSERT_EQ(a.exit_code, 0) << "host a:\n" << a.output << "\nhost b:\n" << b.output;
  // The restarted attempt is a run of its own, of two ranks, resumed from a four-rank save.
  const std::string log = read_file(dir + "/version_1/logs/rank-0.log");
  EXPECT_CONTAINS(log, "2 rank(s)");
  std::smatch restored;
  ASSERT_TRUE(std::regex_search(log, restored, std::regex("restored (\\S+)"))) << log << a.output;
  const std::string checkpoint = restored[1];
  EXPECT_TRUE(fs::exists(checkpoint + "/manifest.json")) << checkpoint << " is a sharded checkpoint folder";
  auto resumed = tessera::testing::metric_series(dir + "/version_1/metrics.csv", "train", "train_loss");
  ASSERT_TRUE(resumed.count(30)) << "the restarted job reached max_steps\n" << log;
  const std::int64_t first = resumed.begin()->first;
  EXPECT_GE(first, 3) << "resumed after a save, not from the start";

  // The same checkpoint resumed by hand on two ranks of one host.
  std::string by_hand = tessera::testing::fresh_dir("elastic-reference");
  auto reference = tessera::testing::run_tessera("fit --config " + config(by_hand) + " --ckpt-path " + checkpoint +
                                                     " --set launch.devices=2", "", 240);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  auto expected = tessera::testing::metric_series(by_hand + "/version_0/metrics.csv", "train", "train_loss");
  ASSERT_EQ(expected.size(), resumed.size()) << reference.output;
  for (const auto& [step, loss] : expected) EXPECT_EQ(resumed.at(step), loss) << "step " << step;
}

}  // namespace
