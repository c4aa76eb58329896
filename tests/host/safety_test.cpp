// Nothing lost, nothing silent (issue 46): run records written or refused loudly, rank logs
// per run, jobs that cannot fit refused before work, leftovers of interrupted saves removed,
// plugins that cannot take the host down, nonsense refused. Real processes (the tessera binary).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "loggers/record_file.hpp"
#include "multiprocess.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/sdk/error.hpp"

namespace {

namespace fs = std::filesystem;
using tessera::testing::run_tessera;
using Clock = std::chrono::steady_clock;

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)
#define EXPECT_LACKS(text, part) EXPECT_EQ(std::string(text).find(part), std::string::npos) << (text)

using tessera::testing::read_file;

/// A 2-layer GPT that trains a few steps in seconds on fortunes; `extra` is appended (TOML).
std::string write_config(const std::string& dir, std::int64_t max_steps, const std::string& extra = "") {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = " << max_steps << "\nlog_every_n_steps = 1\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "checkpoint_every_n_steps = 1\n"
                                   << "[strategy]\nplugin = \"ddp\"\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 2\nn_embd = 16\n"
                                   << "block_size = 16\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nbatch_size = 2\n"
                                   << extra;
  return dir + "/run.toml";
}

/// A tmpfs of `size` mounted on `dir` (unmounted by the destructor); `ok` false where mounting is refused.
struct SmallFilesystem {
  std::string dir;
  bool ok;
  std::string why;
  SmallFilesystem(std::string d, const std::string& size) : dir(std::move(d)) {
    fs::create_directories(dir);
    ok = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
    if (!ok) why = std::strerror(errno);
  }
  /// Fills what is left with one file.
  void fill() const {
    const int fd = ::open((dir + "/filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const std::string block(1 << 16, 'x');
    for (std::size_t size : {block.size(), std::size_t{4096}, std::size_t{1}})
      while (::write(fd, block.data(), size) > 0) {
      }
    ::close(fd);
  }
  ~SmallFilesystem() {
    if (ok) ::umount2(dir.c_str(), MNT_DETACH);
  }
};

// ---------------------------------------------------------------- 1. checked run records

TEST(RunRecords, AFailedWriteThrowsNamingTheFileAndWhy) {
  tessera::host::RecordFile full("/dev/full", tessera::host::RecordFile::Mode::append);
  try {
    full.write("step,epoch,stage,metric,value\n");
    FAIL() << "a write to /dev/full succeeded";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_CONTAINS(e.what(), "cannot write the run record /dev/full: No space left on device (wrote 0 of 30 bytes)");
  }
  EXPECT_NO_THROW(full.write("more")) << "after the error, later writes (an error path's log line) are dropped";
  EXPECT_THROW(tessera::host::write_record("/proc/version/x", "text"), tessera::sdk::Error);
}

// The log filesystem full: fit ends non-zero naming the record it could not write, and the
// checkpoints a run already committed there are kept.
TEST(RunRecords, AFullDiskEndsTheRunNamingTheRecord) {
  const std::string dir = tessera::testing::fresh_dir("records-full") + "/root";
  SmallFilesystem disk(dir, "4m");
  if (!disk.ok) GTEST_SKIP() << "SKIPPED: cannot mount a small tmpfs here (" << disk.why << "); this test needs one";
  auto first = run_tessera("fit --config " + write_config(dir, 2), "", 120);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_CONTAINS(first.output, "run records in " + dir + "/version_0/: config.toml, hparams.yaml, metrics.csv, "
                                "checkpoints/, logs/rank-*.log");
  const std::string checkpoint = dir + "/version_0/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::exists(checkpoint)) << first.output;
  const auto committed = fs::file_size(checkpoint);
  disk.fill();
  auto full = run_tessera("fit --config " + dir + "/run.toml --ckpt-path last --set trainer.max_steps=4", "", 120);
  EXPECT_NE(full.exit_code, 0) << full.output;
  EXPECT_CONTAINS(full.output, "cannot write the run record " + dir + "/version_1/");
  EXPECT_CONTAINS(full.output, ": No space left on device");
  EXPECT_CONTAINS(full.output, "checkpoints already committed are kept");
  EXPECT_EQ(fs::file_size(checkpoint), committed);
  fs::remove(dir + "/filler");
  auto check = tessera::testing::run_command(std::string(tessera::testing::tessera_binary()) + " checkpoint verify " +
                                             checkpoint + " 2>&1");
  EXPECT_EQ(check.exit_code, 0) << check.output;
}

// ---------------------------------------------------------------- 2. rank logs per run

// The documented requeue (fit --ckpt-path last into the same root) keeps the crashed attempt's
// logs, which explain the crash, and the launcher quotes the failed run's own log.
TEST(RankLogs, ARequeueKeepsTheCrashedAttemptsLogs) {
  const std::string dir = tessera::testing::fresh_dir("logs-requeue");
  const std::string config = write_config(dir, 4);
  auto crash = run_tessera("fit --config " + config + " --set launch.devices=2",
                           "TESSERA_FAULT_INJECT=rank=1,step=2,kind=exit", 120);
  EXPECT_NE(crash.exit_code, 0) << crash.output;
  EXPECT_CONTAINS(crash.output, "last lines of " + dir + "/version_0/logs/rank-1.log");
  auto requeue = run_tessera("fit --config " + config + " --ckpt-path last --set launch.devices=2", "", 120);
  ASSERT_EQ(requeue.exit_code, 0) << requeue.output;
  const std::string crashed = read_file(dir + "/version_0/logs/rank-1.log");
  EXPECT_CONTAINS(crashed, "fault injection: rank 1 exit at step 2");
  const std::string resumed = read_file(dir + "/version_1/logs/rank-1.log");
  EXPECT_CONTAINS(resumed, "step 4/4");
  EXPECT_LACKS(resumed, "fault injection");
  EXPECT_LACKS(crashed, "step 4/4");
  EXPECT_FALSE(fs::exists(dir + "/logs/rank-1.log")) << "no log shared by the runs of a root";
}

// ---------------------------------------------------------------- 3. memory check before work

// [data] batch_size = 100000 is refused before any rank starts, with the plan and the largest
// batch that fits; skip_memory_check = true starts a job the plan says does not fit.
TEST(MemoryCheck, AnOversizedBatchIsRefusedInSeconds) {
  const std::string dir = tessera::testing::fresh_dir("memory-refused");
  const auto start = Clock::now();
  auto r = run_tessera("fit --config " + write_config(dir, 2) + " --set data.batch_size=100000 --set launch.devices=2",
                       "TESSERA_MEMORY_AVAILABLE_MB=4000", 120);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "tessera: error: the memory plan needs");
  EXPECT_CONTAINS(r.output, "but only 4000 MB is available");
  EXPECT_CONTAINS(r.output, "fit refuses a job that does not fit the machine before any rank starts");
  EXPECT_CONTAINS(r.output, "largest batch_size");  // the plan's table
  EXPECT_CONTAINS(r.output, "lower [data] batch_size (at most ");
  EXPECT_CONTAINS(r.output, "set [trainer] skip_memory_check = true");
  EXPECT_LACKS(r.output, "launched");
  EXPECT_FALSE(fs::exists(dir + "/version_0")) << "no run started";
  EXPECT_LT(seconds, 60) << "refused after " << seconds << " s";

  auto skipped = run_tessera("fit --config " + write_config(dir, 1) + " --set trainer.skip_memory_check=true",
                             "TESSERA_MEMORY_AVAILABLE_MB=1", 120);
  EXPECT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_CONTAINS(skipped.output, "tessera: warning: the memory plan needs");
}

TEST(MemoryCheck, MoreLocalRanksThanTheHostCanRunAreRefused) {
  const std::string dir = tessera::testing::fresh_dir("ranks-refused");
  auto r = run_tessera("fit --config " + write_config(dir, 2) + " --set launch.devices=1024", "", 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "[launch] devices = 1024 local ranks, but this host has ");
  EXPECT_LACKS(r.output, "launched");
}

// ---------------------------------------------------------------- 4. leftovers of interrupted saves

// A save killed mid-write leaves a hidden temporary; the next fit in the root (a resume writes
// into a new run folder) removes it, but never one a running save still writes; `tessera
// checkpoint gc` lists and removes the same.
TEST(Leftovers, InterruptedSavesAreRemovedOnlyWhenTheirWriterIsGone) {
  const std::string dir = tessera::testing::fresh_dir("leftovers");
  const std::string folder = dir + "/version_0/checkpoints";
  fs::create_directories(folder + "/.step=3.ckpt.tmp-5a5a");
  std::ofstream(folder + "/.step=3.ckpt.tmp-5a5a/rank-00000-of-00002.safetensors") << std::string(1000, 'x');
  std::ofstream(folder + "/.last.ckpt.tmp-999999-0") << std::string(2000, 'x');  // a killed writer's
  const std::string live = folder + "/.step=4.ckpt.tmp-" + std::to_string(::getpid()) + "-0";
  tessera::core::WriterLock writing(live, /*create=*/true);  // a save this process is still writing

  auto dry = tessera::testing::run_command(std::string(tessera::testing::tessera_binary()) + " checkpoint gc " + dir +
                                           " --dry-run 2>&1");
  EXPECT_EQ(dry.exit_code, 0) << dry.output;
  EXPECT_CONTAINS(dry.output, "would remove " + folder + "/.last.ckpt.tmp-999999-0");
  EXPECT_CONTAINS(dry.output, "would remove " + folder + "/.step=3.ckpt.tmp-5a5a");
  EXPECT_CONTAINS(dry.output, "kept     " + live + " ");
  EXPECT_TRUE(fs::exists(folder + "/.last.ckpt.tmp-999999-0"));

  auto fit = run_tessera("fit --config " + write_config(dir, 1), "", 120);
  EXPECT_EQ(fit.exit_code, 0) << fit.output;
  EXPECT_CONTAINS(fit.output, "tessera: removed 2 leftover(s) of interrupted saves");
  EXPECT_FALSE(fs::exists(folder + "/.last.ckpt.tmp-999999-0"));
  EXPECT_FALSE(fs::exists(folder + "/.step=3.ckpt.tmp-5a5a"));
  EXPECT_TRUE(fs::exists(live)) << "a save in progress was removed";

  std::ofstream(dir + "/version_1/checkpoints/.x.ckpt.tmp-999998-0") << "x";
  auto gc = tessera::testing::run_command(std::string(tessera::testing::tessera_binary()) + " checkpoint gc " + dir +
                                          " 2>&1");
  EXPECT_EQ(gc.exit_code, 0) << gc.output;
  EXPECT_CONTAINS(gc.output, "removed  " + dir + "/version_1/checkpoints/.x.ckpt.tmp-999998-0");
  EXPECT_FALSE(fs::exists(dir + "/version_1/checkpoints/.x.ckpt.tmp-999998-0"));
  EXPECT_TRUE(fs::exists(live));
}

// ---------------------------------------------------------------- 5. asynchronous saves

// "checkpoint saved" only once a background save is committed; a background save that fails
// (its disk full) is an error naming the file, and `last` never moves to it.
TEST(AsyncSaves, SavedIsSaidOnlyOnceCommittedAndAFailureNamesTheFile) {
  const std::string dir = tessera::testing::fresh_dir("async-ok");
  auto ok = run_tessera("fit --config " + write_config(dir, 2, "[checkpoint_io]\nasync = true\n"), "", 120);
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  const std::string path = dir + "/version_0/checkpoints/";
  const auto queued = ok.output.find("checkpoint queued: " + path);
  const auto saved = ok.output.find("checkpoint saved: " + path);
  EXPECT_NE(queued, std::string::npos) << ok.output;
  EXPECT_NE(saved, std::string::npos) << ok.output;
  EXPECT_LT(queued, saved) << ok.output;
  EXPECT_CONTAINS(ok.output, "(committed in the background)");

  const std::string full = tessera::testing::fresh_dir("async-full");
  SmallFilesystem disk(full + "/version_0/checkpoints", "32k");  // the checkpoint (~100 KB) cannot fit
  if (!disk.ok) GTEST_SKIP() << "SKIPPED: cannot mount a small tmpfs here (" << disk.why << "); the rest needs one";
  auto failed = run_tessera("fit --config " + write_config(full, 2, "[checkpoint_io]\nasync = true\n[logger]\n"
                                                                    "version = \"0\"\n"), "", 120);
  EXPECT_NE(failed.exit_code, 0) << failed.output;
  EXPECT_CONTAINS(failed.output, "checkpoint queued: " + full + "/version_0/checkpoints/");
  EXPECT_CONTAINS(failed.output, "the background save of checkpoint " + full + "/version_0/checkpoints/");
  EXPECT_CONTAINS(failed.output, "`last` still names the previous checkpoint");
  EXPECT_LACKS(failed.output, "checkpoint saved: ");
  EXPECT_FALSE(fs::is_symlink(full + "/version_0/checkpoints/last"));
}

// ---------------------------------------------------------------- 7. nonsense refused

TEST(Nonsense, MaxStepsZeroIsRefused) {
  const std::string dir = tessera::testing::fresh_dir("max-steps-0");
  auto r = run_tessera("fit --config " + write_config(dir, 0), "", 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, "[trainer] max_steps = 0 would train nothing");
  EXPECT_FALSE(fs::exists(dir + "/version_0"));
}

// Resuming with a model hyper-parameter that differs from the checkpoint's record (the same
// shapes: nothing else would notice) is refused naming the key, unless the run lists it.
TEST(Nonsense, ResumingWithChangedHyperParametersIsRefusedNamingEachKey) {
  const std::string dir = tessera::testing::fresh_dir("hparams-changed");
  const std::string config = write_config(dir, 2);
  ASSERT_EQ(run_tessera("fit --config " + config, "", 120).exit_code, 0);
  auto changed = run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=3 "
                             "--set model.n_head=4 --set model.dropout=0.2", "", 120);
  EXPECT_NE(changed.exit_code, 0) << changed.output;
  EXPECT_CONTAINS(changed.output, "the model's hyper-parameters differ from those the checkpoint was trained with");
  EXPECT_CONTAINS(changed.output, "[model] n_head = 4, the checkpoint's model has 2");
  EXPECT_CONTAINS(changed.output, "[model] dropout = 0.2, the checkpoint's model has ");
  EXPECT_CONTAINS(changed.output, "[trainer] resume_changed_hparams = [\"dropout\", \"n_head\"]");
  auto allowed = run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=3 "
                             "--set model.n_head=4 --set 'trainer.resume_changed_hparams=[\"n_head\"]'", "", 120);
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
  EXPECT_CONTAINS(allowed.output, "note: resuming with a changed hyper-parameter ([trainer] resume_changed_hparams): "
                                  "[model] n_head = 4");
}

// A llama's hyper-parameters include its whole config.json (hf_config_json): a changed
// rope_theta is named as that member, not as the JSON text of both models.
TEST(Nonsense, AChangedConfigJsonMemberIsNamedAloneOnResume) {
  const std::string dir = tessera::testing::fresh_dir("hparams-config-json");
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 1\ndefault_root_dir = \"" << dir << "\"\n"
                                   << "enable_progress_bar = false\ncheckpoint_every_n_steps = 1\n"
                                   << "[strategy]\nplugin = \"single_device\"\n"
                                   << "[model]\nplugin = \"llama\"\nvocab_size = 256\nhidden_size = 16\n"
                                   << "intermediate_size = 32\nnum_hidden_layers = 1\nnum_attention_heads = 2\n"
                                   << "num_key_value_heads = 1\nrope_theta = 10000.0\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nbatch_size = 2\n";
  ASSERT_EQ(run_tessera("fit --config " + dir + "/run.toml", "", 120).exit_code, 0);
  auto changed = run_tessera("fit --config " + dir + "/run.toml --ckpt-path last --set trainer.max_steps=2 "
                             "--set model.rope_theta=500000.0", "", 120);
  EXPECT_NE(changed.exit_code, 0) << changed.output;
  EXPECT_CONTAINS(changed.output, "[model] hf_config_json differs in rope_theta = 500000.0 (the checkpoint's: 10000.0)");
  EXPECT_LACKS(changed.output, "intermediate_size");  // the members that agree are not printed
  EXPECT_CONTAINS(changed.output, "[trainer] resume_changed_hparams = [\"hf_config_json\"]");
}

// [trainer] resume = "auto" passes over a damaged newest save for the newest that verifies,
// says so, and keeps the damaged one as it was; --ckpt-path last still refuses it.
TEST(Resume, AutoGoesOnFromTheNewestCheckpointThatVerifies) {
  const std::string dir = tessera::testing::fresh_dir("resume-auto-damaged");
  const std::string config = write_config(dir, 3, "[callbacks.model_checkpoint]\nevery_n_train_steps = 1\n"
                                                  "save_top_k = -1\nsave_last = false\n");
  {  // the callback's own section replaces [trainer] checkpoint_every_n_steps
    std::string text = read_file(config);
    text.erase(text.find("checkpoint_every_n_steps = 1\n"), 29);
    std::ofstream(config) << text;
  }
  ASSERT_EQ(run_tessera("fit --config " + config, "", 120).exit_code, 0);
  const std::vector<std::string> saves = tessera::core::committed_checkpoints(dir + "/version_0/checkpoints");
  ASSERT_GE(saves.size(), 2u);
  const std::string newest = saves[0], previous = saves[1];
  {  // bit rot in the middle of the newest save: same size, other bytes
    std::fstream file(newest, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(fs::file_size(newest) / 2));
    file.write("\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f\x7f", 16);
  }
  const std::string damaged = read_file(newest);
  ASSERT_NE(run_tessera("checkpoint verify " + newest, "", 60).exit_code, 0) << "the damage must be detectable";
  auto last = run_tessera("fit --config " + config + " --ckpt-path last --set trainer.max_steps=4", "", 120);
  EXPECT_NE(last.exit_code, 0) << "an explicit --ckpt-path last is that checkpoint or an error\n" << last.output;
  auto resumed = run_tessera("fit --config " + config + " --set trainer.max_steps=4 --set trainer.resume=auto", "", 120);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_CONTAINS(resumed.output, "resume = \"auto\": passed over a checkpoint that does not verify (it is kept): " + newest);
  EXPECT_CONTAINS(resumed.output, "resume = \"auto\": resuming from " + previous + ", the newest checkpoint that verifies");
  EXPECT_CONTAINS(resumed.output, "step 3/4");  // the previous save was step 2's: steps 3 and 4 train again
  EXPECT_EQ(read_file(newest), damaged) << "the damaged save was changed";
}

// A loss that turns NaN/Inf (here an absurd learning rate) stops the run before the optimizer
// steps on it, on every rank, naming where it appeared; nonfinite_loss = "skip" skips such
// steps instead and counts them.
TEST(NonfiniteLoss, StopsBeforeTheOptimizerStepsUnlessToldToSkip) {
  const std::string dir = tessera::testing::fresh_dir("nonfinite-loss");
  const std::string config = write_config(dir, 4, "[optimizer]\nname = \"sgd\"\nlr = 1e30\n[launch]\ndevices = 2\n");
  auto stopped = run_tessera("fit --config " + config, "", 120);
  EXPECT_NE(stopped.exit_code, 0) << stopped.output;
  EXPECT_CONTAINS(stopped.output, "step 2 ([trainer] nonfinite_loss = \"stop\"): the loss is NaN/Inf on rank(s) [0, 1]");
  EXPECT_CONTAINS(stopped.output, "The optimizer did not step");
  EXPECT_CONTAINS(stopped.output, "[trainer] nonfinite_loss = \"skip\" skips such steps");
  EXPECT_LACKS(stopped.output, "step 2/4");
  auto skipped = run_tessera("fit --config " + config + " --set trainer.nonfinite_loss=skip", "", 120);
  EXPECT_EQ(skipped.exit_code, 0) << skipped.output;
  EXPECT_CONTAINS(skipped.output, "step 2: non-finite loss, the optimizer step is skipped ([trainer] nonfinite_loss = "
                                  "\"skip\"), 1 step(s) skipped so far");
  EXPECT_CONTAINS(skipped.output, "step 4/4");
}

// ---------------------------------------------------------------- 9. weighted validation

// val_loss is the per-sample mean over the whole validation set: 101 images in batches of 16
// (a last batch of 5), checked against the same mean computed in Python from the weights.
TEST(Validation, MetricsAreWeightedByBatchSize) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "SKIPPED: /usr/bin/python3 with torch (python3-torch) is not installed";
  const std::string dir = tessera::testing::fresh_dir("weighted-val");
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 2\nenable_progress_bar = false\nnum_sanity_val_steps = 0\n"
                                   << "default_root_dir = \"" << dir << "\"\n"
                                   << "[strategy]\nplugin = \"single_device\"\n"
                                   << "[model]\nplugin = \"mlp\"\nhidden_sizes = [32]\n"
                                   << "[data]\nplugin = \"fashion_mnist\"\nval_size = 101\nbatch_size = 16\n"
                                   << "train_limit = 64\ntest_limit = 16\n";
  ASSERT_EQ(run_tessera("fit --config " + dir + "/run.toml", "", 120).exit_code, 0);
  auto validate = run_tessera("validate --config " + dir + "/run.toml --ckpt-path last", "", 120);
  ASSERT_EQ(validate.exit_code, 0) << validate.output;
  const auto val = tessera::testing::metric_series(dir + "/version_1/metrics.csv", "validate", "val_loss");
  ASSERT_EQ(val.size(), 1u) << read_file(dir + "/version_1/metrics.csv");
  const std::string script = dir + "/reference.py";
  std::ofstream(script) << "import gzip, struct, sys, torch\n"
                           "sys.path.insert(0, '" TESSERA_TEST_SUPPORT_DIR "')\n"
                           "from safe_torch_load import load\n"
                           "def idx(path):\n"
                           "    data = gzip.open(path).read()\n"
                           "    dims = data[3]\n"
                           "    shape = struct.unpack('>' + 'I' * dims, data[4:4 + 4 * dims])\n"
                           "    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)\n"
                           "root = '/usr/share/datasets/fashion-mnist/'\n"
                           "images = idx(root + 'train-images-idx3-ubyte.gz')[-101:]\n"
                           "labels = idx(root + 'train-labels-idx1-ubyte.gz')[-101:].long()\n"
                           "x = ((images.float() / 255 - 0.2860) / 0.3530).flatten(1)\n"
                           "w = load(sys.argv[1])['state_dict']\n"
                           "h = torch.relu(x @ w['layers.0.linear.weight'].T + w['layers.0.linear.bias'])\n"
                           "logits = h @ w['head.weight'].T + w['head.bias']\n"
                           "per_sample = torch.nn.functional.cross_entropy(logits, labels, reduction='none')\n"
                           "batch_means = [per_sample[i:i + 16].mean() for i in range(0, 101, 16)]\n"
                           "print('%.8f %.8f' % (per_sample.mean(), sum(batch_means) / len(batch_means)))\n";
  auto python = tessera::testing::run_command("/usr/bin/python3 " + script + " " + dir +
                                              "/version_0/checkpoints/last.ckpt 2>&1");
  ASSERT_EQ(python.exit_code, 0) << python.output;
  std::istringstream numbers(python.output);
  double per_sample = 0, mean_of_batch_means = 0;
  numbers >> per_sample >> mean_of_batch_means;
  EXPECT_NEAR(val.begin()->second, per_sample, 1e-5) << python.output;
  EXPECT_GT(std::abs(per_sample - mean_of_batch_means), 1e-4)
      << "the short last batch should move a plain mean of batch means: the check would prove nothing";
}

// ---------------------------------------------------------------- 10. messages say what and where

struct Message {
  std::string name;
  std::string command;   ///< run in the case's folder (@DIR@), after the GPT run of `write_config(dir, 1)`
  std::string expected;  ///< @DIR@ replaced
  std::string environment = "";
  std::string also = "";  ///< a second part the message must hold (@DIR@ replaced)
};

void PrintTo(const Message& m, std::ostream* os) { *os << m.name; }

class Messages : public ::testing::TestWithParam<Message> {};

std::string with_dir(std::string text, const std::string& dir) {
  for (std::string::size_type at; (at = text.find("@DIR@")) != std::string::npos;) text.replace(at, 5, dir);
  return text;
}

TEST_P(Messages, NameTheFileOrKeyAndWhatToDo) {
  const Message& m = GetParam();
  const std::string dir = tessera::testing::fresh_dir("message-" + m.name);
  ASSERT_EQ(run_tessera("fit --config " + write_config(dir, 1), "", 120).exit_code, 0);
  // Material some cases use: a folder that is not a checkpoint, an aarch64 "plugin".
  fs::create_directories(dir + "/not-a-checkpoint");
  fs::create_directories(dir + "/arm");
  {
    std::ifstream real(std::string(tessera::testing::plugin_dir()) + "/libtessera_ddp.so", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(real)), std::istreambuf_iterator<char>());
    bytes[18] = static_cast<char>(183), bytes[19] = 0;  // e_machine = EM_AARCH64
    std::ofstream(dir + "/arm/libarm.so", std::ios::binary) << bytes;
  }
  auto r = run_tessera(with_dir(m.command, dir), with_dir(m.environment, dir), 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, with_dir(m.expected, dir));
  EXPECT_CONTAINS(r.output, with_dir(m.also, dir));
}

INSTANTIATE_TEST_SUITE_P(
    Issue46, Messages,
    ::testing::Values(
        Message{"full_checkpoint_of_another_shape",
                "validate --config @DIR@/run.toml --ckpt-path @DIR@/version_0/checkpoints/last.ckpt --set model.n_embd=32",
                "checkpoint @DIR@/version_0/checkpoints/last.ckpt: "},
        Message{"adamw_state_into_sgd",
                "fit --config @DIR@/run.toml --ckpt-path last --set trainer.max_steps=2 --set optimizer.name=sgd "
                "--set optimizer.momentum=0.9",
                "[optimizer_states][0] does not fit this run's optimizer ([optimizer] name = \"sgd\")"},
        Message{"folder_without_manifest", "validate --config @DIR@/run.toml --ckpt-path @DIR@/not-a-checkpoint",
                "@DIR@/not-a-checkpoint", "", "manifest.json"},
        Message{"data_path_in_proc", "fit --config @DIR@/run.toml --set data.path=/proc/self",
                "path = \"/proc/self\": cannot read /proc/self/"},
        Message{"root_under_proc", "fit --config @DIR@/run.toml --set trainer.default_root_dir=/proc/tessera-root",
                "[trainer] default_root_dir = \"/proc/tessera-root\": cannot create a run folder"},
        Message{"aarch64_plugin", "fit --config @DIR@/run.toml --set model.plugin=arm_model",
                "@DIR@/arm/libarm.so is a shared library for aarch64, but this tessera runs on x86-64",
                "TESSERA_PLUGIN_PATH=@DIR@/arm"},
        Message{"plugin_of_the_wrong_interface", "fit --config @DIR@/run.toml --set model.plugin=toy_good",
                "[model] plugin = \"toy_good\" (" TOY_DIR "/good/libtoy_good.so) created an object that is not a "
                "tessera::sdk::Module",
                "TESSERA_PLUGIN_PATH=" TOY_DIR "/good"}));

// A sharded checkpoint whose shard file was replaced by a directory ("has 4096 bytes" before).
TEST(Messages, AShardReplacedByADirectoryIsNamed) {
  const std::string dir = tessera::testing::fresh_dir("shard-directory");
  const std::string shard = dir + "/rank-00000-of-00002.safetensors";
  fs::create_directories(shard);
  tessera::core::FileDigest expected;
  expected.size = 1000;
  try {
    tessera::core::SafetensorsReader reader(shard, &expected);
    FAIL() << "a directory was read as a shard";
  } catch (const tessera::sdk::Error& e) {
    EXPECT_CONTAINS(e.what(), shard + " is a directory, not a safetensors file (the manifest lists a shard file there)");
  }
}

// ---------------------------------------------------------------- 11. untrusted files

// A torch.save-shaped file whose pickle calls os.system (what Python's torch.load would run):
// refused, naming the global, before anything is unpickled.
TEST(UntrustedFiles, APickleAskingForAnyOtherGlobalIsRefused) {
  const std::string dir = tessera::testing::fresh_dir("malicious-pickle");
  const std::string marker = dir + "/pwned";
  std::ofstream(dir + "/make.py") << "import sys, zipfile\n"
                                     "command = ('touch ' + sys.argv[2]).encode()\n"
                                     "pickle = b'\\x80\\x02cos\\nsystem\\nX' + len(command).to_bytes(4, 'little') + "
                                     "command + b'\\x85R.'\n"
                                     "with zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_STORED) as z:\n"
                                     "    z.writestr('archive/data.pkl', pickle)\n"
                                     "    z.writestr('archive/version', '3\\n')\n";
  auto made = tessera::testing::run_command("python3 " + dir + "/make.py " + dir + "/evil.ckpt " + marker + " 2>&1");
  ASSERT_EQ(made.exit_code, 0) << made.output;
  auto r = tessera::testing::run_command(std::string(tessera::testing::tessera_binary()) + " checkpoint inspect " + dir +
                                         "/evil.ckpt 2>&1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_CONTAINS(r.output, dir + "/evil.ckpt: its pickle asks for the Python global os.system, which no checkpoint needs");
  EXPECT_FALSE(fs::exists(marker));
}

// What libFuzzer found (bash .ci/fuzz), each input kept in tests/fuzz/regressions/: a 999-byte
// checkpoint whose pickle gives a string a length of 4 GB (LibTorch's unpickler allocated it
// before reading: out of memory), one whose long string took 13 s, and a tokenizer.json whose
// vocabulary id is 3.3e23 (a float converted to an integer: undefined behaviour). Each is
// refused at once, saying what is wrong.
TEST(UntrustedFiles, WhatTheFuzzerFoundIsRefusedAtOnce) {
  const std::string regressions = std::string(TESSERA_SOURCE_DIR) + "/tests/fuzz/regressions/";
  // A pickle string a length of 4 GB, one that took 13 s, and a memo index of 0x74024b07 (LibTorch's
  // unpickler filled a 31 GB memo table: the machine ran out of memory after 71 s).
  for (const char* file : {"checkpoint-string-of-4-gb.ckpt", "checkpoint-slow-string.ckpt", "checkpoint-memo-of-31-gb.ckpt"}) {
    const auto start = Clock::now();
    auto r = tessera::testing::run_command(std::string(tessera::testing::tessera_binary()) + " checkpoint inspect " +
                                           regressions + file + " 2>&1");
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_CONTAINS(r.output, std::string(file) + " is not a readable checkpoint (truncated or damaged");
    EXPECT_CONTAINS(r.output, "its pickle cannot be followed at byte");
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0) << file;
  }
  // tokenizer.json: a vocabulary id of 3.3e23 (a float where an integer belongs), and one of 32 in
  // a 3-token vocabulary (the fuzzer's was 584379214: a decoding table of 18 GB).
  for (const auto& [file, expected] : std::vector<std::pair<std::string, std::string>>{
           {"hf_tokenizer-float-id.json", "model.vocab.b = 3.333333333333333e+23: an integer in [0, 6] was expected"},
           {"hf_tokenizer-sparse-id.json", "model.vocab.ab = 32: an integer in [0, 2] was expected"}}) {
    const std::string dir = tessera::testing::fresh_dir("fuzzed-tokenizer");
    fs::copy_file(regressions + file, dir + "/tokenizer.json");
    const auto start = Clock::now();
    auto r = tessera::testing::run_command(std::string(tessera::testing::tessera_binary()) + " tokenizer info --tokenizer " +
                                           dir + "/tokenizer.json 2>&1");
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_CONTAINS(r.output, expected);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 10.0) << file;
  }
}

}  // namespace
