// 2 hosts x 2 ranks (fsdp FULL_SHARD, a 3.2M-parameter GPT, Gloo on CPU), with the group's
// gathers and reductions in two levels (shared memory within a host, Gloo between hosts) and
// through Gloo alone ([launch] shared_memory_collectives = false):
//   - bytes that crossed the link per optimizer step (both ends' tx counters, the difference of
//     a long and a short run, so that start-up and the final checkpoint cancel out), against
//     `tessera plan`'s figure for the same job;
//   - throughput with the link unlimited and limited by tc to each rate given (default 10gbit,
//     1gbit: each "host" here has about one core).
//   build/bin/two_hosts_bench [steps=10] [rate ...]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "multiprocess.hpp"
#include "two_hosts.hpp"

namespace {

using tessera::testing::TwoHosts;

std::string write_config(const std::string& dir, int steps) {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = " << steps << "\nlog_every_n_steps = 1\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "enable_model_summary = false\nnum_sanity_val_steps = 0\nlimit_val_batches = 0\n"
                                   << "[logger]\nversion = \"0\"\n[optimizer]\nname = \"adamw\"\nlr = 0.001\n"
                                   << "[strategy]\nplugin = \"fsdp\"\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 4\nn_head = 4\nn_embd = 256\nblock_size = 64\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 64\nbatch_size = 8\n";
  return dir + "/run.toml";
}

std::string sets(const TwoHosts& hosts, int node, bool two_levels) {
  return " --set launch.devices=2 --set launch.nodes=2 --set launch.node_rank=" + std::to_string(node) +
         " --set launch.master_addr=" + hosts.name(0) + " --set launch.master_port=29500 --set launch.num_threads=1" +
         " --set launch.shared_memory_collectives=" + (two_levels ? "true" : "false");
}

double tx_bytes(const TwoHosts& hosts) {
  double sum = 0;
  for (int h = 0; h < 2; ++h)
    sum += std::atof(tessera::testing::run_command(
                         hosts.on(h, "cat /sys/class/net/" + hosts.interface(h) + "/statistics/tx_bytes"))
                         .output.c_str());
  return sum;
}

struct Run {
  double bytes = 0;              ///< crossed the link, both directions
  double tokens_per_s = 0;       ///< median over the steps after the first two
};

Run fit(const TwoHosts& hosts, int steps, bool two_levels) {
  const std::string dir = tessera::testing::fresh_dir("two-hosts-bench");
  const std::string config = write_config(dir, steps);
  const std::string binary = std::string("CUDA_VISIBLE_DEVICES= ") + tessera::testing::tessera_binary() + " fit --config " + config;
  const double before = tx_bytes(hosts);
  auto [a, b] = hosts.run_both(binary + sets(hosts, 0, two_levels), binary + sets(hosts, 1, two_levels), 600);
  Run run;
  run.bytes = tx_bytes(hosts) - before;
  if (a.exit_code != 0 || b.exit_code != 0) {
    std::fprintf(stderr, "the job failed:\n%s\n%s\n", a.output.c_str(), b.output.c_str());
    std::exit(1);
  }
  std::vector<double> rates;
  for (const auto& [step, value] : tessera::testing::metric_series(dir + "/version_0/metrics.csv", "train", "tokens_per_s"))
    if (step > 2) rates.push_back(value);
  std::sort(rates.begin(), rates.end());
  run.tokens_per_s = rates.empty() ? 0 : rates[rates.size() / 2];
  tessera::testing::remove_dir(dir);
  return run;
}

/// tessera plan's bytes between hosts per step, summed over the 4 ranks.
double planned(const TwoHosts& hosts, bool two_levels) {
  const std::string dir = tessera::testing::fresh_dir("two-hosts-plan");
  auto r = tessera::testing::run_tessera("plan --json --config " + write_config(dir, 10) + sets(hosts, 0, two_levels));
  tessera::testing::remove_dir(dir);
  const auto json = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  return json.at("between_hosts_per_step_bytes").get<double>() * json.at("world_size").get<double>();
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 10;
  std::vector<std::string> rates{""};
  for (int i = 2; i < argc; ++i) rates.push_back(argv[i]);
  if (argc <= 2) rates.insert(rates.end(), {"10gbit", "1gbit"});
  TwoHosts hosts;
  if (!hosts.why_not().empty()) {
    std::fprintf(stderr, "two hosts cannot be made here: %s\n", hosts.why_not().c_str());
    return 1;
  }
  std::printf("2 hosts x 2 ranks, fsdp FULL_SHARD, GPT 4 x 256 (3.2M parameters), T=64, batch 8 per rank, Gloo on CPU\n\n");
  std::printf("bytes between the hosts per optimizer step (both directions; runs of %d and 4 steps, differenced):\n", steps);
  for (bool two_levels : {false, true}) {
    const double per_step = (fit(hosts, steps, two_levels).bytes - fit(hosts, 4, two_levels).bytes) / (steps - 4);
    const double plan = planned(hosts, two_levels);
    std::printf("  %-28s measured %7.2f MB   plan %7.2f MB   measured/plan %.3f\n",
                two_levels ? "two levels" : "Gloo alone", per_step / 1048576, plan / 1048576, per_step / plan);
  }
  std::printf("\nthroughput (tokens/s, median of steps 3-%d):\n", steps);
  for (const std::string& rate : rates) {
    hosts.set_rate(rate);
    const Run flat = fit(hosts, steps, false), two = fit(hosts, steps, true);
    std::printf("  link %-10s Gloo alone %9.0f   two levels %9.0f   two levels / Gloo alone %.2fx\n",
                rate.empty() ? "unlimited" : rate.c_str(), flat.tokens_per_s, two.tokens_per_s,
                two.tokens_per_s / flat.tokens_per_s);
  }
  hosts.set_rate("");
  return 0;
}
