// `tessera plan` against the binary: the plan against the peak RSS that `tessera fit` measures
// on 1, 2 and 4 ranks (within 10%), on issue 61's vocab-128k llama and the shipped gpt (15%), the
// largest batch it offers run, tensor parallelism, bad input handled as fit handles it, the
// check before fit, and the plan's output. The arithmetic alone: plan_arithmetic_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <tuple>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "multiprocess.hpp"
#include "sanitizers.hpp"
#include "plan/plan.hpp"
#include "tessera/core/comm.hpp"
#include "fsdp/memory_plan.hpp"

namespace {

using tessera::testing::metric_series;
using tessera::testing::run_dir;
using tessera::testing::run_tessera;
namespace fsdp = tessera::core::fsdp;
namespace host = tessera::host;

/// A 6-layer, 768-wide GPT (~43M parameters, ~680 MB of fp32 AdamW state unsharded): large
/// enough that model state dominates the process baseline, small enough to train on 2 cores.
/// Two steps reach the steady peak: the second holds the optimizer state the first allocated
/// beside its gradients and activations, as every later step does.
std::string write_config(const std::string& dir) {
  std::ofstream(dir + "/plan.toml") << "[trainer]\nmax_steps = 2\nlog_every_n_steps = 1\nenable_progress_bar = false\n"
                                    << "save_last = false\ndefault_root_dir = \"" << dir << "\"\n"
                                    << "[optimizer]\nname = \"adamw\"\nlr = 3e-4\nschedule = \"constant\"\n"
                                    << "[model]\nplugin = \"gpt\"\nn_layer = 6\nn_head = 12\nn_embd = 768\n"
                                    << "block_size = 64\n[data]\nplugin = \"text\"\nblock_size = 64\nbatch_size = 4\n";
  return dir + "/plan.toml";
}

struct Case {
  const char* name;
  const char* sets;
};
// Without it GoogleTest prints a Case as its bytes (two pointers), which ctest's test list then
// carries in every name, different at each run of the binary.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class PlanVsMeasured : public ::testing::TestWithParam<Case> {};

TEST_P(PlanVsMeasured, PeakRssWithinTenPercent) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  const Case& c = GetParam();
  const std::string dir = tessera::testing::fresh_dir(std::string("plan-") + c.name);
  const std::string config = write_config(dir);
  // Host memory on the CPU, on a GPU machine as well (there "auto" would train on CUDA).
  const std::string sets = std::string(c.sets) + " --set strategy.accelerator='\"cpu\"'";
  auto plan = run_tessera("plan --json --config " + config + " " + sets);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto json = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  ASSERT_TRUE(json.at("known").get<bool>()) << plan.output;
  const double planned_mb = json.at("peak_rss_per_rank_bytes").get<double>() / 1048576.0;
  auto fit = run_tessera("fit --config " + config + " " + sets, "", 600);
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  auto peaks = metric_series(run_dir(dir) + "/metrics.csv", "train", "peak_rss_mb");
  ASSERT_FALSE(peaks.empty()) << fit.output;
  const double measured_mb = peaks.rbegin()->second;
  std::printf("[ plan ] %-22s planned %6.0f MB, measured %6.0f MB (%+.1f%%)\n", c.name, planned_mb, measured_mb,
              100.0 * (planned_mb - measured_mb) / measured_mb);
  EXPECT_NEAR(planned_mb, measured_mb, 0.10 * measured_mb) << plan.output;
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, PlanVsMeasured,
    ::testing::Values(Case{"single_device", "--set strategy.plugin=single_device"},
                      Case{"ddp_2", "--set strategy.plugin=ddp --set launch.devices=2 --set data.batch_size=2"},
                      Case{"fsdp_1", "--set strategy.plugin=fsdp"},
                      Case{"fsdp_2", "--set strategy.plugin=fsdp --set launch.devices=2 --set data.batch_size=2"},
                      Case{"fsdp_4", "--set strategy.plugin=fsdp --set launch.devices=4 --set data.batch_size=1"},
                      Case{"fsdp_shard_grad_op_2", "--set strategy.plugin=fsdp --set launch.devices=2 "
                                                   "--set data.batch_size=2 --set strategy.sharding_strategy=SHARD_GRAD_OP"},
                      Case{"fsdp2_2", "--set strategy.plugin=fsdp2 --set launch.devices=2 --set data.batch_size=2"},
                      Case{"fsdp2_tp_2", "--set strategy.plugin=fsdp2 --set launch.devices=2 "
                                         "--set strategy.tensor_parallel_size=2 --set data.batch_size=4"},
                      // 32 tokens a rank: where the CPU has no bf16 matrix instructions (AVX2),
                      // LibTorch's bf16 matmul is a plain loop, and 128 tokens took 112 s.
                      Case{"fsdp_bf16_mixed_2", "--set strategy.plugin=fsdp --set launch.devices=2 "
                                                "--set data.batch_size=1 --set data.block_size=32 "
                                                "--set precision.plugin=fsdp-precision --set precision.precision=bf16-mixed"},
                      // Activations a third of the peak without checkpointing: traced without
                      // the recomputation, the plan was +26% here (990 MB against 787).
                      Case{"fsdp_checkpointed_2", "--set strategy.plugin=fsdp --set launch.devices=2 "
                                                  "--set data.batch_size=16 "
                                                  "--set 'strategy.activation_checkpointing=[\"Block\"]'"},
                      // Every unit's unsharded gradient kept over 4 micro-batches: -14% (716 MB) when the
                      // plan did not count it.
                      Case{"fsdp_accumulating_2", "--set strategy.plugin=fsdp --set launch.devices=2 "
                                                  "--set data.batch_size=2 --set trainer.accumulate_grad_batches=4"}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

/// `tessera plan --json` and a short `tessera fit` of one configuration: the planned peak RSS
/// per rank, the measured one (metrics.csv's last peak_rss_mb, the max over ranks) and the plan.
struct PlannedAndMeasured {
  double planned_mb = 0, measured_mb = 0;
  nlohmann::json plan;
};
PlannedAndMeasured plan_and_fit(const std::string& name, const std::string& config, const std::string& sets,
                                const std::string& environment = "") {
  PlannedAndMeasured out;
  const std::string dir = tessera::testing::fresh_dir("plan-measured-" + name);
  const std::string all = "--config " + config + " " + sets + " --set strategy.accelerator='\"cpu\"'" +
                          " --set trainer.default_root_dir='\"" + dir + "\"' --set trainer.enable_progress_bar=false" +
                          " --set trainer.save_last=false";
  auto plan = run_tessera("plan --json " + all, environment);
  EXPECT_EQ(plan.exit_code, 0) << name << "\n" << plan.output;
  if (plan.exit_code != 0) return out;
  out.plan = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  out.planned_mb = out.plan.at("peak_rss_per_rank_bytes").get<double>() / 1048576.0;
  auto fit = run_tessera("fit " + all, environment, 600);
  EXPECT_EQ(fit.exit_code, 0) << name << "\n" << fit.output;
  auto peaks = metric_series(run_dir(dir) + "/metrics.csv", "train", "peak_rss_mb");
  EXPECT_FALSE(peaks.empty()) << name << "\n" << fit.output;
  if (!peaks.empty()) out.measured_mb = peaks.rbegin()->second;
  std::printf("[ plan ] %-34s planned %6.0f MB, measured %6.0f MB (%+.1f%%)\n", name.c_str(), out.planned_mb,
              out.measured_mb, 100.0 * (out.planned_mb - out.measured_mb) / std::max(1.0, out.measured_mb));
  return out;
}

/// A shipped config (configs/), found beside this source file.
std::string shipped_config(const std::string& name) {
  return (std::filesystem::path(__FILE__).parent_path() / "../../configs" / name).lexically_normal().string();
}

/// Issue 61's loss case (bench/training/llama-vocab128k.toml): a 2-layer, 64-wide Llama with
/// Llama 3's vocabulary, batch 1, one device, where the logits are most of the peak.
std::string write_llama_vocab128k(const std::string& dir) {
  std::ofstream(dir + "/llama128k.toml") << "[trainer]\nmax_steps = 2\nlog_every_n_steps = 1\nnum_sanity_val_steps = 0\n"
                                         << "limit_val_batches = 0\nseed = 1234\n[optimizer]\nname = \"adamw\"\nlr = 1e-3\n"
                                         << "[strategy]\nplugin = \"single_device\"\n[model]\nplugin = \"llama\"\n"
                                         << "vocab_size = 128256\nhidden_size = 64\nintermediate_size = 172\n"
                                         << "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
                                         << "max_position_embeddings = 2048\n[data]\nplugin = \"text\"\n"
                                         << "block_size = 2048\nbatch_size = 1\n";
  return dir + "/llama128k.toml";
}

/// The main job's token shards and tokenizer (configs/llama-tokens.sh's first two steps, ~6 s),
/// made once for the tests below; the --set lines that point configs/llama-tokens.toml at them.
const std::string& main_job_data() {
  static const std::string sets = [] {
    const std::string dir = tessera::testing::fresh_dir("plan-main-job-data");
    auto tokenizer = run_tessera("tokenizer train --input /usr/share/games/fortunes --vocab-size 2000 --type bpe "
                                 "--output " + dir + "/tokenizer");
    EXPECT_EQ(tokenizer.exit_code, 0) << tokenizer.output;
    auto prepare = run_tessera("data prepare --tokenizer " + dir + "/tokenizer/tokenizer.model --input "
                               "/usr/share/games/fortunes --split percent --output " + dir + "/data");
    EXPECT_EQ(prepare.exit_code, 0) << prepare.output;
    return "--set data.path='\"" + dir + "/data\"' --set data.tokenizer='\"" + dir + "/tokenizer/tokenizer.model\"'";
  }();
  return sets;
}

const char* const kShortRun = "--set trainer.max_steps=2 --set trainer.log_every_n_steps=1 "
                              "--set trainer.limit_val_batches=0 --set trainer.num_sanity_val_steps=0 "
                              "--set trainer.predict_after_fit=false --set trainer.checkpoint_every_n_steps=0";

// Issue 61.2: the plan within 15% of the measured peak where the loss path matters (vocab
// 128,256 at T 2048 and 512, fused and not), on the shipped gpt config and on the main job
// (configs/llama-tokens.toml on its token shards; both fsdp2 on 2 ranks), two steps each: the
// second holds the optimizer state beside a step's peak. ~70 s on 2 cores.
TEST(PlanVsMeasuredPeak, WithinFifteenPercentOnTheLlamaVocab128kTheShippedGptAndTheMainJob) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  const std::string dir = tessera::testing::fresh_dir("plan-measured-configs");
  const std::string llama = write_llama_vocab128k(dir);
  const std::string gpt = shipped_config("gpt-fortunes.toml");
  const std::tuple<std::string, std::string, std::string> cases[] = {
      {"llama128k_T2048_unfused", llama, "--set model.fused_loss=false"},
      {"llama128k_T2048_fused", llama, "--set model.fused_loss=true"},
      {"llama128k_T512_unfused", llama, "--set model.fused_loss=false --set data.block_size=512"},
      {"llama128k_T512_fused", llama, "--set model.fused_loss=true --set data.block_size=512"},
      {"gpt-fortunes_fsdp2_2", gpt, kShortRun},
      {"llama-tokens_fsdp2_2", shipped_config("llama-tokens.toml"), kShortRun + (" " + main_job_data())},
  };
  for (const auto& [name, config, sets] : cases) {
    const PlannedAndMeasured r = plan_and_fit(name, config, sets);
    EXPECT_NEAR(r.planned_mb, r.measured_mb, 0.15 * r.measured_mb) << name << "\n" << r.plan.dump();
  }
}

// A long run peaks where a short one does: the main job's Llama on one device at batch 1 for
// 250 steps, within 15% of the plan. With freed pages kept (host/train/allocator.cpp) and
// jemalloc's default fit for them, small requests took fresh pages every step: this run grew
// 2.4 MB a step (1.1 GB after 400 steps, against ~200 MB planned). ~30 s on 2 cores.
TEST(PlanVsMeasuredPeak, ALongRunStaysAtThePlannedPeak) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  const std::string sets = std::string(kShortRun) + " " + main_job_data() +
                           " --unset strategy --set strategy.plugin=single_device --set launch.devices=1"
                           " --set data.batch_size=1 --set trainer.max_steps=250 --set trainer.log_every_n_steps=50";
  const PlannedAndMeasured r = plan_and_fit("llama-tokens_single_b1_250_steps", shipped_config("llama-tokens.toml"), sets);
  EXPECT_NEAR(r.planned_mb, r.measured_mb, 0.15 * r.measured_mb) << r.plan.dump();
}

// The "largest batch_size" the plan offers fits: with the machine's memory set to 3,000 MB the
// plan of the unfused T 512 llama (about 1 GB more each sample: its logits) offers a batch, and
// fit at that batch peaks within those 3,000 MB. (At batch 2 the plan is 2,225 MB against a
// measured 1,759, +26%: safe, but the unfused logits' per-sample scaling is not yet within 15%.)
TEST(PlanVsMeasuredPeak, TheLargestBatchSizeItOffersFits) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  const std::string dir = tessera::testing::fresh_dir("plan-measured-batch");
  const std::string config = write_llama_vocab128k(dir);
  const std::string sets = " --set model.fused_loss=false --set data.block_size=512";
  const double available_mb = 3000;
  const std::string environment = "TESSERA_MEMORY_AVAILABLE_MB=" + std::to_string(available_mb);
  auto plan = run_tessera("plan --json --config " + config + sets, environment);
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto json = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  const std::int64_t largest = json.at("largest_batch_size").get<std::int64_t>();
  ASSERT_GE(largest, 1) << plan.output;
  ASSERT_LE(largest, 4) << plan.output;  // bounded by the 3,000 MB, not by the search
  const PlannedAndMeasured r = plan_and_fit("llama128k_T512_unfused_batch_" + std::to_string(largest), config,
                                            sets + " --set trainer.max_steps=1 --set data.batch_size=" +
                                                std::to_string(largest),
                                            environment);
  EXPECT_GT(r.measured_mb, 0);
  EXPECT_LE(r.measured_mb, available_mb) << "batch_size " << largest << " was offered within " << available_mb << " MB";
}

/// Tensor parallelism: the plan holds one tp rank's real pieces (the attention and MLP weights
/// halved, LayerNorms, row-parallel biases and the embeddings whole) and sends the activation
/// all-reduces the traced forward and its backward make: per layer, the attention's and the
/// MLP's output in forward and their inputs' gradients in backward, one (4, 64, 768) fp32 each.
TEST(PlanTensorParallel, HoldsOneRanksPiecesAndSendsTheActivationAllReduces) {
  const std::string dir = tessera::testing::fresh_dir("plan-tp");
  auto plan = run_tessera("plan --json --config " + write_config(dir) +
                          " --set strategy.plugin=fsdp2 --set launch.devices=2 --set strategy.tensor_parallel_size=2");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto json = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  const std::int64_t C = 768, layers = 6, vocab = 256, block = 64;
  const std::int64_t root = vocab * C + block * C + 2 * C;  // tied wte / lm_head, wpe, ln_f
  const std::int64_t layer = 2 * C + (3 * C * C + 3 * C) / 2 + C * C / 2 + C + 2 * C + (4 * C * C + 4 * C) / 2 +
                             4 * C * C / 2 + C;  // ln_1, attn / 2, proj / 2 + bias, ln_2, fc / 2, fc_proj / 2 + bias
  EXPECT_EQ(json.at("per_rank_bytes").at("parameters").get<double>(), 4.0 * (root + layers * layer));
  double forward = 0, backward = 0;
  for (const auto& t : json.at("traffic")) {
    const std::string what = t.at("what");
    if (what.find("tensor-parallel") == std::string::npos) continue;
    EXPECT_EQ(t.at("kind"), "all_reduce");
    EXPECT_EQ(t.at("group_size"), 2);
    (what.find("forward") != std::string::npos ? forward : backward) += t.at("data_bytes").get<double>();
  }
  EXPECT_EQ(forward, 2.0 * layers * 4 * block * C * 4) << plan.output;
  EXPECT_EQ(backward, forward) << plan.output;
  EXPECT_EQ(json.at("sent_per_step_bytes").get<double>(), forward + backward) << plan.output;  // 2 (g-1)/g = 1
}

/// Activation checkpointing recomputes each block's forward in backward, and with it the
/// block's two activation all-reduces; the embeddings' and the head's are not recomputed.
TEST(PlanTensorParallel, CheckpointedUnitsAllReduceTheirActivationsAgain) {
  const std::string dir = tessera::testing::fresh_dir("plan-tp-checkpointed");
  auto plan = run_tessera("plan --json --config " + write_config(dir) +
                          " --set strategy.plugin=fsdp2 --set launch.devices=2 --set strategy.tensor_parallel_size=2"
                          " --set 'strategy.activation_checkpointing=[\"Block\"]'");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto json = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  const double layers = 6, block = 64, C = 768, activation = 4 * block * C * 4;  // (4, 64, 768) fp32
  double forward = -1, recomputed = -1;
  for (const auto& t : json.at("traffic")) {
    const std::string what = t.at("what");
    if (what.find("tensor-parallel forward") != std::string::npos) forward = t.at("data_bytes").get<double>();
    if (what.find("recomputed forwards (12)") != std::string::npos) recomputed = t.at("data_bytes").get<double>();
  }
  EXPECT_EQ(forward, 2 * layers * activation) << plan.output;
  EXPECT_EQ(recomputed, forward) << plan.output;
  for (const auto& note : json.at("notes")) EXPECT_EQ(note.get<std::string>().find("not counted"), std::string::npos) << note;
}

/// The error line of a run: what follows "tessera: error: ".
std::string error_of(const std::string& output) {
  const auto at = output.find("error: ");
  return at == std::string::npos ? output : output.substr(at);
}

TEST(PlanBadInput, BehavesAsFit) {
  auto none = run_tessera("plan");
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.output.find("plan needs --config FILE.toml"), std::string::npos) << none.output;
  const std::string dir = tessera::testing::fresh_dir("plan-bad-input");
  const std::string config = write_config(dir);
  for (const std::string sets : {"--set strategy.plugin=fsdpp", "--set strategy.plugin=single_device --set launch.devices=2",
                                 "--set strategy.plugin=fsdp --set strategy.sharding_strategy=FULL", "--set trainer.max_stepz=3",
                                 "--set data.block_size=128"}) {
    auto plan = run_tessera("plan --config " + config + " " + sets);
    auto fit = run_tessera("fit --config " + config + " " + sets);
    EXPECT_EQ(plan.exit_code, 1) << sets << "\n" << plan.output;
    EXPECT_EQ(fit.exit_code, 1) << sets << "\n" << fit.output;
    EXPECT_EQ(error_of(plan.output), error_of(fit.output)) << sets;
  }
  auto json = run_tessera("fit --json --config " + config);
  EXPECT_EQ(json.exit_code, 2);
  EXPECT_NE(json.output.find("--json applies to `tessera plan` only"), std::string::npos) << json.output;
}

TEST(PlanInFit, RefusesBeforeAnyWorkWhenThePlanExceedsTheMachine) {
  const std::string dir = tessera::testing::fresh_dir("plan-warning");
  std::ofstream(dir + "/small.toml") << "[trainer]\nmax_steps = 1\nenable_progress_bar = false\nsave_last = false\n"
                                     << "default_root_dir = \"" << dir << "\"\n"
                                     << "[model]\nplugin = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n"
                                     << "[data]\nplugin = \"text\"\nblock_size = 32\nbatch_size = 2\n";
  auto refused = run_tessera("fit --config " + dir + "/small.toml", "TESSERA_MEMORY_AVAILABLE_MB=1");
  EXPECT_NE(refused.exit_code, 0) << refused.output;  // refused before any rank starts (issue 46)
  EXPECT_NE(refused.output.find("tessera: error: the memory plan needs"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("set [trainer] skip_memory_check = true"), std::string::npos) << refused.output;
  auto fit = run_tessera("fit --config " + dir + "/small.toml --set trainer.skip_memory_check=true",
                         "TESSERA_MEMORY_AVAILABLE_MB=1");
  EXPECT_EQ(fit.exit_code, 0) << fit.output;  // skip_memory_check: a warning, not an error
  EXPECT_NE(fit.output.find("warning: the memory plan needs"), std::string::npos) << fit.output;
  EXPECT_NE(fit.output.find("only 1 MB is available"), std::string::npos) << fit.output;
  EXPECT_NE(fit.output.find("lower [data] batch_size (even 1 does not fit)"), std::string::npos) << fit.output;
  auto quiet = run_tessera("fit --config " + dir + "/small.toml --set trainer.default_root_dir=" + dir + "/b");
  EXPECT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(quiet.output.find("warning: the memory plan"), std::string::npos) << quiet.output;
}

// fit plans the host memory of a job that trains on the CPU, on any machine; a CUDA job's
// bound is its device memory, planned by `tessera plan` (fit would trace the forward on the
// CPU first). Keyed on the job's accelerator, not on whether this machine has a GPU.
// A CUDA job is checked without tracing its forward: its host rows (the process, the trainer)
// against the host's memory, its device rows (state, gathered units, buffers; activations not
// counted, so "at least") against the GPU's.
TEST(PlanInFit, ACudaJobIsCheckedForHostAndDeviceMemory) {
  const std::string dir = tessera::testing::fresh_dir("plan-warning-cuda");
  std::ofstream(dir + "/small.toml") << "[trainer]\nmax_steps = 1\nenable_progress_bar = false\nsave_last = false\n"
                                     << "default_root_dir = \"" << dir << "\"\n[strategy]\naccelerator = \"cuda\"\n"
                                     << "[model]\nplugin = \"gpt\"\nn_layer = 1\nn_head = 2\nn_embd = 32\nblock_size = 32\n"
                                     << "[data]\nplugin = \"text\"\nblock_size = 32\nbatch_size = 2\n";
  auto line_of = [](const std::string& output, const std::string& start) {
    const std::size_t at = output.find(start);
    return at == std::string::npos ? std::string() : output.substr(at, output.find('\n', at) - at);
  };
  auto fit = run_tessera("fit --config " + dir + "/small.toml --set trainer.skip_memory_check=true",
                         "TESSERA_MEMORY_AVAILABLE_MB=1");
  const std::string host = line_of(fit.output, "warning: the memory plan needs");
  ASSERT_FALSE(host.empty()) << fit.output;
  EXPECT_NE(host.find("on this machine"), std::string::npos) << host;
  for (const char* device_row : {"parameters", "activations", "gathered units"})
    EXPECT_EQ(host.find(device_row), std::string::npos) << device_row << " is device memory: " << host;
  if (fit.exit_code != 0)  // this machine has no GPU (or this build no CUDA): refused, and said why
    EXPECT_NE(fit.output.find("accelerator = \"cuda\""), std::string::npos) << fit.output;

  fit = run_tessera("fit --config " + dir + "/small.toml --set trainer.skip_memory_check=true",
                    "TESSERA_DEVICE_MEMORY_MB=0.01");
  const std::string device = line_of(fit.output, "warning: the memory plan needs at least");
  ASSERT_FALSE(device.empty()) << fit.output;
  for (const char* part : {"of CUDA memory per rank (parameters", "activations not counted", "but the GPU has 0 MB"})
    EXPECT_NE(device.find(part), std::string::npos) << part << "\n" << device;
  EXPECT_EQ(fit.output.find("on this machine"), std::string::npos) << "the host has room: " << fit.output;
}

// `tessera plan` names the largest batch that fits this machine, and plans traced anew at other
// batch sizes bear it out to a sample (each plan measures its own process's baseline, which
// moves by a fraction of a MB from one run to the next: the edges are a sample either side).
TEST(PlanOutput, LargestBatchSizeFitsTheMachine) {
  const std::string dir = tessera::testing::fresh_dir("plan-batch");
  const std::string config = write_config(dir) + " --set launch.devices=2 --set strategy.plugin=fsdp";
  auto plan_json = [&](std::int64_t batch_size, const std::string& available_mb) {
    auto run = run_tessera("plan --json --config " + config + " --set data.batch_size=" + std::to_string(batch_size),
                           "TESSERA_MEMORY_AVAILABLE_MB=" + available_mb);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    return nlohmann::json::parse(run.output.substr(run.output.find('{')));
  };
  const auto traced = plan_json(2, "1000000");
  const double per_sample = traced["per_rank_bytes"]["activations"].get<double>() / 2;
  const double available = traced["machine_bytes"].get<double>() + 2 * 20 * per_sample;  // ~20 more per rank
  const std::string available_mb = std::to_string(available / 1048576.0);
  const std::int64_t largest = plan_json(2, available_mb)["largest_batch_size"].get<std::int64_t>();
  EXPECT_GE(largest, 18);
  EXPECT_LE(largest, 22);
  EXPECT_LE(plan_json(largest - 1, available_mb)["machine_bytes"].get<double>(), available);
  EXPECT_GT(plan_json(largest + 2, available_mb)["machine_bytes"].get<double>(), available);
  auto table = run_tessera("plan --config " + config + " --set data.batch_size=2", "TESSERA_MEMORY_AVAILABLE_MB=" + available_mb);
  std::smatch row;
  ASSERT_TRUE(std::regex_search(table.output, row, std::regex("largest batch_size +([0-9]+)  \\[data\\] batch_size per "
                                                              "rank within the [0-9]+ MB available to 2 local rank")))
      << table.output;
  EXPECT_NEAR(std::stod(row[1].str()), static_cast<double>(largest), 1.0) << table.output;
}

// A dataset smaller than the batch is traced whole: the per-sample figure divides by the samples
// traced, not by [data] batch_size (which counted 4096 samples' activations as 44's).
TEST(PlanOutput, LargestBatchSizeScalesFromTheSamplesTraced) {
  const std::string dir = tessera::testing::fresh_dir("plan-batch-small-data");
  std::ofstream corpus(dir + "/corpus.txt");
  for (int i = 0; i < 60; ++i) corpus << "Q: What is a flat parameter? A: " << i << " shards.\n";
  corpus.close();
  const std::string config = write_config(dir) + " --set launch.devices=2 --set strategy.plugin=fsdp --set data.path='\"" +
                             dir + "/corpus.txt\"'";
  auto largest = [&](std::int64_t batch_size) {
    auto run = run_tessera("plan --json --config " + config + " --set data.batch_size=" + std::to_string(batch_size),
                           "TESSERA_MEMORY_AVAILABLE_MB=3000");
    EXPECT_EQ(run.exit_code, 0) << run.output;
    const auto json = nlohmann::json::parse(run.output.substr(run.output.find('{')));
    return json["largest_batch_size"].get<double>();
  };
  const double traced_whole = largest(100000), traced_four = largest(4);
  EXPECT_GT(traced_four, 4);
  EXPECT_NEAR(traced_whole, traced_four, 1.0);
}

TEST(PlanOutput, TableNamesEveryRowAndTheTraffic) {
  const std::string dir = tessera::testing::fresh_dir("plan-table");
  auto plan = run_tessera("plan --config " + write_config(dir) +
                          " --set strategy.plugin=fsdp --set launch.devices=4 --set data.batch_size=1");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  for (const char* row : {"parameters", "gradients", "optimizer state", "gathered units", "unsharded gradients",
                          "collective buffers", "activations", "runtime baseline", "peak RSS per rank", "all_gather",
                          "reduce_scatter", "FULL_SHARD"})
    EXPECT_NE(plan.output.find(row), std::string::npos) << row << "\n" << plan.output;
  EXPECT_EQ(plan.output.find("device memory"), std::string::npos) << "a CPU job's plan is of the memory it uses";
}

// A CUDA job's plan (planned here without a GPU: the plan sets up no device) puts the model
// state, gathered units and activations on the device with a peak of their own, as the JSON
// says too; NCCL moves the tensors themselves (no Gloo receive buffers); cpu_offload keeps the
// state on the host. For each strategy that plans a layout.
TEST(PlanOutput, ACudaJobsPlanHasADevicePeak) {
  const std::string dir = tessera::testing::fresh_dir("plan-cuda");
  const std::string config = write_config(dir);
  const std::string cuda = " --set strategy.accelerator='\"cuda\"' --set data.batch_size=1";
  auto table = run_tessera("plan --config " + config + " --set strategy.plugin=fsdp" + cuda);
  ASSERT_EQ(table.exit_code, 0) << table.output;
  for (const char* text : {"peak CUDA per rank", "device  ", "accelerator = \"cuda\": the device rows are CUDA tensors"})
    EXPECT_NE(table.output.find(text), std::string::npos) << text << "\n" << table.output;

  auto json_of = [&](const std::string& sets) {
    auto run = run_tessera("plan --json --config " + config + " " + sets);
    EXPECT_EQ(run.exit_code, 0) << sets << "\n" << run.output;
    return nlohmann::json::parse(run.output.substr(run.output.find('{')));
  };
  auto device_sum = [](const nlohmann::json& plan) {
    double sum = 0;
    for (const auto& name : plan["on_device"]) sum += plan["per_rank_bytes"][name.get<std::string>()].get<double>();
    return sum;
  };
  for (const char* strategy : {"fsdp", "fsdp2", "ddp", "single_device"}) {
    const std::string devices = std::string(strategy) == "single_device" ? "1" : "2";
    const std::string sets = std::string("--set strategy.plugin=") + strategy + " --set launch.devices=" + devices;
    nlohmann::json cpu = json_of(sets + " --set strategy.accelerator='\"cpu\"' --set data.batch_size=1"),
                   gpu = json_of(sets + cuda);
    EXPECT_FALSE(cpu["cuda"].get<bool>());
    EXPECT_EQ(cpu["peak_cuda_per_rank_bytes"].get<double>(), 0) << strategy;
    ASSERT_TRUE(gpu["cuda"].get<bool>()) << strategy;
    EXPECT_GT(gpu["peak_cuda_per_rank_bytes"].get<double>(), gpu["per_rank_bytes"]["optimizer state"].get<double>());
    // fsdp and fsdp2 free their gradients after each step, LibTorch 2's zero_grad the others':
    // the peak holds them or the activations.
    const bool freed = std::string(strategy).rfind("fsdp", 0) == 0 || TORCH_VERSION_MAJOR >= 2;
    const auto& rows = gpu["per_rank_bytes"];
    const double overlap =
        freed ? std::min(rows["gradients"].get<double>(), rows["activations"].get<double>()) : 0.0;
    EXPECT_GT(rows["activations"].get<double>(), 0) << strategy;
    EXPECT_NEAR(gpu["peak_cuda_per_rank_bytes"].get<double>(), device_sum(gpu) - overlap, 8) << strategy;  // whole bytes
    EXPECT_EQ(gpu["on_device"].size(), gpu["per_rank_bytes"].size() - 2) << strategy << ": all but runtime and baseline";
    // The host keeps what a training process holds besides the tensors.
    EXPECT_LT(gpu["training_peak_bytes"].get<double>(), cpu["training_peak_bytes"].get<double>()) << strategy;
    const double gloo = cpu["per_rank_bytes"].value("collective buffers", 0.0),
                 nccl = gpu["per_rank_bytes"].value("collective buffers", 0.0);
    if (std::string(strategy) != "single_device") EXPECT_LT(nccl, gloo) << strategy << ": shared memory's segment, Gloo's copies";
  }
  // Offloaded by each strategy's own key (fsdp_cpu_offload is fsdp with the key on).
  for (const char* offload : {"--set strategy.plugin=fsdp --set strategy.cpu_offload=true",
                              "--set strategy.plugin=fsdp_cpu_offload", "--set strategy.plugin=fsdp2 --set strategy.offload_policy=cpu"}) {
    nlohmann::json offloaded = json_of(std::string(offload) + " --set launch.devices=2" + cuda);
    EXPECT_EQ(offloaded["on_device"].size(), offloaded["per_rank_bytes"].size() - 5) << offload;
    for (const auto& name : offloaded["on_device"])
      EXPECT_TRUE(name != "parameters" && name != "gradients" && name != "optimizer state") << offload << ": " << name;
    EXPECT_NEAR(offloaded["peak_cuda_per_rank_bytes"].get<double>(), device_sum(offloaded), 8) << offload;
  }
}

// The toolkit's causal attention computes its softmax in fp32 on every device (as Hugging Face's
// models do), so the CPU trace already holds the fp32 probabilities that CUDA's autocast would
// add: a CUDA bf16-mixed plan counts exactly the CPU plan's activations, checkpointed or not, and
// notes no softmax outputs of its own. (Before the toolkit's attention, gpt's softmax ran in bf16
// and a CUDA plan added 4 bytes per element of each layer's probabilities.)
TEST(PlanOutput, ACudaAutocastPlanAddsNothingForAnFp32Softmax) {
  const std::string dir = tessera::testing::fresh_dir("plan-cuda-autocast");
  const std::string config = write_config(dir);
  // 16 tokens: the traced bf16 step is slow where the CPU has no bf16 matrix instructions.
  const std::string bf16 = " --set strategy.plugin=fsdp --set data.batch_size=1 --set data.block_size=16 "
                           "--set precision.plugin=fsdp-precision --set precision.precision=bf16-mixed";
  auto activations = [&](const std::string& accelerator, const std::string& sets) {
    auto run = run_tessera("plan --json --config " + config + sets + " --set strategy.accelerator='\"" +
                           accelerator + "\"'");
    EXPECT_EQ(run.exit_code, 0) << run.output;
    return nlohmann::json::parse(run.output.substr(run.output.find('{')))["per_rank_bytes"]["activations"].get<double>();
  };
  const double cpu = activations("cpu", bf16);
  EXPECT_GT(cpu, 0);
  EXPECT_NEAR(activations("cuda", bf16), cpu, 2);
  const std::string checkpointed = bf16 + " --set 'strategy.activation_checkpointing=[\"Block\"]'";
  EXPECT_NEAR(activations("cuda", checkpointed), activations("cpu", checkpointed), 2);
  auto table = run_tessera("plan --config " + config + bf16 + " --set strategy.accelerator='\"cuda\"'");
  EXPECT_EQ(table.output.find("softmax / log_softmax output(s) CUDA's autocast computes in fp32"), std::string::npos)
      << table.output;
  // Without autocast (32-true) nothing is added.
  auto fp32 = run_tessera("plan --json --config " + config + " --set strategy.plugin=fsdp --set data.batch_size=1 "
                          "--set strategy.accelerator='\"cuda\"'");
  EXPECT_EQ(fp32.output.find("softmax"), std::string::npos) << fp32.output;
}

}  // namespace
