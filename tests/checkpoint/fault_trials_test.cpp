// Fault trials through the `tessera` binary: a 2-rank FSDP run saving at every step is killed
// (kill -9 of a rank or of the launcher) at random moments once it saved, then resumed from
// `last`, 10 times in one run folder for each IO. `last` must always name a committed checkpoint that
// verifies, never an older one than before, and what interrupted saves left is swept.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/sharded_checkpoint.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::testing::run_tessera;

std::int64_t step_of(const std::string& checkpoint) {
  if (tessera::core::is_dcp_checkpoint(checkpoint))
    return tessera::core::read_trainer_state(checkpoint).at("global_step").toInt();
  if (tessera::core::is_sharded_checkpoint(checkpoint)) {
    const std::string state = tessera::core::read_manifest(checkpoint).trainer_state;
    const auto at = state.find("\"global_step\":");
    return at == std::string::npos ? -1 : std::stoll(state.substr(at + 14));
  }
  const auto name = fs::path(checkpoint).filename().string();  // step=N.ckpt
  return name.rfind("step=", 0) == 0 ? std::stoll(name.substr(5)) : -1;
}

int temporaries_in(const fs::path& dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.path().filename().string().find(".tmp-") != std::string::npos) ++n;
  return n;
}

class FaultTrials : public ::testing::TestWithParam<const char*> {};

TEST_P(FaultTrials, KillsDuringSavesNeverLoseOrRewindLast) {
  const std::string io = GetParam();
  const std::string dir = tessera::testing::fresh_dir(std::string("faults-") + io);
  std::ofstream(dir + "/run.toml")
      << "[trainer]\nmax_steps = 100000\nlog_every_n_steps = 1\nseed = 3\ndefault_root_dir = \"" << dir
      << "\"\nenable_progress_bar = false\ncheckpoint_every_n_steps = 1\nsave_last = false\n"
      << "[optimizer]\nname = \"adamw\"\nlr = 0.001\n"
      << "[launch]\ndevices = 2\ncollective_timeout_s = 20\n"
      << "[strategy]\nplugin = \"fsdp\"\nstate_dict_type = \"" << (io == "torch" ? "full" : "sharded") << "\"\n"
      << "[checkpoint_io]\nplugin = \"" << io << "\"\nkeep_last_k = 2\n"
      << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 4\nn_embd = 256\nblock_size = 32\ndropout = 0.0\n"
      << "[data]\nplugin = \"text\"\nblock_size = 32\nbatch_size = 2\n"
      << "[logger]\nversion = 0\n";  // every trial resumes into the same run folder and checkpoint folder
  const fs::path checkpoints = fs::path(dir) / "version_0" / "checkpoints";
  std::mt19937 rng(static_cast<unsigned>(::getpid()));
  std::int64_t last_step = -1;
  int during_save = 0;
  // 10 for each of torch and distributed, 20 kills in all (the count), and 4 for dcp, whose
  // commit is distributed's; a trial costs a start, a load and a few steps, ~10 s on the 2-core CI
  // machine.
  const int trials = io == "dcp" ? 4 : 10;
  for (int trial = 0; trial < trials; ++trial) {
    const double delay = std::uniform_real_distribution<double>(0.0, 1.5)(rng);
    const bool kill_rank = trial % 2 == 0;
    // The launcher in the background; once this launch saved a checkpoint (so the kill falls
    // among steps and saves, not in the start-up), after `delay` s more, kill -9 one rank (a
    // random child of the launcher) or the launcher itself (its ranks die with it).
    const std::string log_path = dir + "/trial.log";
    // The previous trial's log goes first: the background job truncates it only once it runs,
    // and the loop below must not find the old "checkpoint saved" (then the launcher may have no
    // ranks yet to kill). A launcher without ranks is killed, so a failed trial leaves nothing.
    const std::string script = "rm -f " + log_path + "; " + std::string(tessera::testing::tessera_binary()) +
                               " fit --config " + dir + "/run.toml --ckpt-path last > " +  // one command, as a requeue runs it
                               log_path + " 2>&1 & L=$!; " + "for i in $(seq 1200); do grep -qs \"checkpoint saved\" " +
                               log_path + " && break; sleep 0.05; done; sleep " + std::to_string(delay) +
                               "; C=$(pgrep -P $L); [ -n \"$C\" ] || { kill -9 $L; echo no ranks to kill; exit 1; }; " +
                               (kill_rank ? "set -- $C; shift $((RANDOM % $#)); kill -9 $1" : "kill -9 $L") +
                               // every process of the run gone (ranks die with the launcher, asynchronously)
                               "; for p in $L $C; do timeout 60 tail --pid=$p -f /dev/null; done";
    ASSERT_EQ(std::system(("bash -c '" + script + "'").c_str()), 0);
    std::ifstream log(dir + "/trial.log");
    const std::string output((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    if (temporaries_in(checkpoints) > 0) ++during_save;
    if (!fs::is_symlink(checkpoints / tessera::core::kLastPointer)) {
      ASSERT_EQ(last_step, -1) << "`last` disappeared after trial " << trial << "\n" << output;
      continue;  // killed before its first commit
    }
    const std::string last = tessera::core::resolve_last(checkpoints.string());
    auto verify = run_tessera("checkpoint verify " + last);
    EXPECT_EQ(verify.exit_code, 0) << "trial " << trial << ": " << verify.output;
    const std::int64_t step = step_of(last);
    EXPECT_GE(step, last_step) << "trial " << trial << ": `last` went back from step " << last_step;
    last_step = step;
  }
  ASSERT_GE(last_step, 1) << "no trial got as far as a checkpoint: the kills came too early";
  // A clean resume from `last` loads it, sweeps what the killed saves left, and trains on.
  auto r = run_tessera("fit --config " + dir + "/run.toml --ckpt-path last --set trainer.max_steps=" +
                       std::to_string(last_step + 1));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming at step " + std::to_string(last_step)), std::string::npos) << r.output;
  EXPECT_EQ(temporaries_in(checkpoints), 0);
  std::cout << "[ fault trials ] " << io << ": " << trials << " kills, " << during_save
            << " left an interrupted save behind; `last` at step " << last_step << "\n";
}

INSTANTIATE_TEST_SUITE_P(IO, FaultTrials, ::testing::Values("distributed", "torch", "dcp"));

}  // namespace
