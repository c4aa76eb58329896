// Parity: N ranks under a strategy produce the same losses and final parameters as the
// single-device run on the same global batch. Real processes through `tessera fit` and its
// launcher, real Gloo on loopback, models whose parameter sizes do not divide by 2, 3 or 4.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>

#include "multiprocess.hpp"

namespace {

using tessera::testing::checkpoint_state;
using tessera::testing::metric_series;
using tessera::testing::run_tessera;

constexpr int kMicroBatch = 12;  // global micro-batch: divisible by 1, 2, 3 and 4 ranks

struct Run {
  std::map<std::int64_t, double> losses;
  std::map<std::string, at::Tensor> state;
};

/// The two parity models: an MLP on Fashion-MNIST (units of 784*257+257 and 257*101+101
/// parameters) and a tiny GPT on fortunes (tied embedding, 3 heads of width 12).
std::string model_config(const std::string& model) {
  if (model == "mlp")
    return "[model]\nplugin = \"mlp\"\nhidden_sizes = [257, 101]\n"
           "[data]\nplugin = \"fashion_mnist\"\ntrain_limit = 600\nval_size = 100\ntest_limit = 100\n";
  if (model == "cnn_bn")  // BatchNorm in both conv units; 5 and 7 channels divide by no world size
    return "[model]\nplugin = \"cnn\"\nchannels1 = 5\nchannels2 = 7\nhidden = 33\nbatch_norm = true\n"
           "[data]\nplugin = \"fashion_mnist\"\ntrain_limit = 600\nval_size = 100\ntest_limit = 100\n";
  // GQA (6 query heads over 2 key-value heads), q/k/v/o biases, untied head; qwen3: the same with
  // Qwen3's per-head q/k norms, replicated under tensor parallelism
  if (model == "llama" || model == "qwen3")
    return "[model]\nplugin = \"llama\"\n" +
           std::string(model == "qwen3" ? "model_type = \"qwen3\"\nhead_dim = 6\n" : "") +
           "vocab_size = 256\nhidden_size = 36\nintermediate_size = 50\n"
           "num_hidden_layers = 2\nnum_attention_heads = 6\nnum_key_value_heads = 2\nattention_bias = true\n"
           "rms_norm_eps = 1e-5\n"
           "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n";
  return "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 3\nn_embd = 36\nblock_size = 16\n"
         "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n";
}

/// `dp`: the data-parallel ranks (default: all; fewer under tensor parallelism, whose ranks read
/// the same batch), which share the global micro-batch.
Run fit(const std::string& name, const std::string& model, int world, const std::string& strategy_sets,
        int accumulate = 1, int dp = 0) {
  std::string dir = tessera::testing::fresh_dir(name + "-" + std::to_string(world));
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 6\nlog_every_n_steps = 1\nseed = 7\n"
                                   << "accumulate_grad_batches = " << accumulate << "\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "[optimizer]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\nschedule = \"constant\"\n"
                                   << model_config(model);
  std::string args = "fit --config " + dir + "/run.toml --set launch.devices=" + std::to_string(world) +
                     " --set data.batch_size=" + std::to_string(kMicroBatch / (dp > 0 ? dp : world)) + " " +
                     strategy_sets;
  auto result = run_tessera(args, "", 240);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return Run{metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss"),
             checkpoint_state(tessera::testing::run_dir(dir) + "/checkpoints/last.ckpt")};
}

void expect_same(const Run& reference, const Run& run, const std::string& what, double tol) {
  ASSERT_EQ(reference.losses.size(), 6u) << what;
  ASSERT_EQ(run.losses.size(), reference.losses.size()) << what;
  for (const auto& [step, loss] : reference.losses)
    EXPECT_NEAR(run.losses.at(step), loss, tol * std::max(1.0, std::abs(loss))) << what << " step " << step;
  ASSERT_EQ(run.state.size(), reference.state.size()) << what;
  for (const auto& [name, tensor] : reference.state) {
    ASSERT_TRUE(run.state.count(name)) << what << ": missing " << name;
    const at::Tensor& other = run.state.at(name);
    ASSERT_EQ(other.sizes(), tensor.sizes()) << what << " " << name;
    EXPECT_TRUE(at::allclose(other, tensor, tol, tol))
        << what << ": parameter " << name << " differs by " << (other - tensor).abs().max().item<double>();
  }
}

/// One test per (strategy, model): the single-device reference once, then 1-4 ranks (the base
/// test of each strategy and model; a variant runs 2 and 3 ranks, one dividing nothing and one
/// dividing some parameter sizes, which the suite's time on 2 cores allows).
/// `strategy_sets` go to the parallel runs only; `trainer_sets` to the reference as well.
void check_parity(const std::string& strategy, const std::string& strategy_sets, const std::string& model,
                  int accumulate = 1, std::vector<int> worlds = {1, 2, 3, 4}, const std::string& trainer_sets = "",
                  double tol = 2e-5) {
  // SGD with momentum: Adam's normalisation would turn float rounding noise in near-zero
  // gradients into lr-sized steps and hide real differences behind a loose tolerance.
  Run reference =
      fit("reference-" + model, model, 1, "--set strategy.plugin=single_device " + trainer_sets, accumulate);
  for (int world : worlds) {
    SCOPED_TRACE(strategy + " on " + std::to_string(world) + " rank(s), " + model);
    Run run = fit(strategy + "-" + model, model, world,
                  "--set strategy.plugin=" + strategy + " " + strategy_sets + " " + trainer_sets, accumulate);
    expect_same(reference, run, strategy + " x" + std::to_string(world), tol);
  }
}

TEST(Parity, DDPMatchesSingleDeviceMLP) { check_parity("ddp", "", "mlp"); }
TEST(Parity, DDPMatchesSingleDeviceGPT) { check_parity("ddp", "", "gpt"); }
TEST(Parity, DDPWithGradientAccumulation) { check_parity("ddp", "", "mlp", /*accumulate=*/3, {2, 3}); }

TEST(Parity, FSDPFullShardMLP) { check_parity("fsdp", "--set strategy.sharding_strategy=FULL_SHARD", "mlp"); }
TEST(Parity, FSDPFullShardGPTTiedEmbedding) { check_parity("fsdp", "", "gpt"); }
TEST(Parity, FSDPShardGradOp) { check_parity("fsdp", "--set strategy.sharding_strategy=SHARD_GRAD_OP", "gpt", 1, {2, 3}); }
TEST(Parity, FSDPNoShard) { check_parity("fsdp", "--set strategy.sharding_strategy=NO_SHARD", "mlp", 1, {2, 3}); }
TEST(Parity, FSDPHybridShard) {
  check_parity("fsdp", "--set strategy.sharding_strategy=HYBRID_SHARD --set strategy.hybrid_shard_group_size=2", "mlp",
               1, {2, 4});
}
TEST(Parity, FSDPPrefetchAndActivationCheckpointing) {
  check_parity("fsdp",
               "--set strategy.forward_prefetch=true --set strategy.backward_prefetch=BACKWARD_POST "
               "--set strategy.activation_checkpointing=Block",
               "gpt");
}
TEST(Parity, FSDPNoPrefetchRootOnly) {
  check_parity("fsdp", "--set strategy.backward_prefetch=none --set strategy.auto_wrap_policy=none", "mlp", 1, {2, 3});
}
TEST(Parity, FSDPGradientAccumulationNoSync) { check_parity("fsdp", "", "gpt", /*accumulate=*/3, {2, 3}); }
TEST(Parity, FSDPGradientAccumulationReduceEveryMicroBatch) {
  check_parity("fsdp", "--set strategy.reduce_every_micro_batch=true", "mlp", /*accumulate=*/2, {2, 3});
}
// Offloading moves a CUDA device's state to host memory; on the CPU it would do nothing, so each
// way of asking for it is refused before any rank starts, naming the setting (the GPU run of
// fsdp_cpu_offload is tests/fsdp's CUDA test).
TEST(Parity, CPUOffloadOnTheCPUIsRefused) {
  const std::string dir = tessera::testing::fresh_dir("cpu-offload-refused");
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 1\ndefault_root_dir = \"" << dir << "\"\n"
                                   << model_config("mlp");
  for (const auto& [sets, named] : std::vector<std::pair<std::string, std::string>>{
           {"--set strategy.plugin=fsdp_cpu_offload", "[strategy] plugin = \"fsdp_cpu_offload\" (use \"fsdp\")"},
           {"--set strategy.plugin=fsdp --set strategy.cpu_offload=true", "cpu_offload = true"},
           {"--set strategy.plugin=fsdp2 --set strategy.offload_policy=cpu", "offload_policy = \"cpu\""}}) {
    auto result = run_tessera("fit --config " + dir + "/run.toml --set launch.devices=2 " + sets, "", 60);
    EXPECT_NE(result.exit_code, 0) << sets << "\n" << result.output;
    EXPECT_NE(result.output.find(named), std::string::npos) << sets << "\n" << result.output;
    EXPECT_NE(result.output.find("this run is on the CPU, where they are host memory already"), std::string::npos)
        << sets << "\n" << result.output;
    EXPECT_FALSE(std::filesystem::exists(dir + "/version_0/checkpoints")) << sets << ": refused before any work";
  }
}
TEST(Parity, FSDPGradientClipping) {
  check_parity("fsdp", "", "gpt", 1, {2, 3}, "--set trainer.gradient_clip_val=0.05");
}
TEST(Parity, FSDPGradientClippingInfNorm) {
  check_parity("fsdp", "", "mlp", 1, {2, 3}, "--set trainer.gradient_clip_val=0.01 --set trainer.norm_type=inf");
}
// fsdp2: per-parameter dim-0 shards (uneven on 3 and 4 ranks: 36 rows, 3 * 36, 257, 101).
TEST(Parity, FSDP2GPT) { check_parity("fsdp2", "", "gpt"); }
TEST(Parity, FSDP2MLPWithClipping) {
  check_parity("fsdp2", "", "mlp", 1, {2, 3}, "--set trainer.gradient_clip_val=0.05");
}
TEST(Parity, FSDP2ReshardAfterForwardFalseAndCheckpointing) {
  check_parity("fsdp2", "--set strategy.reshard_after_forward=false --set strategy.activation_checkpointing=Block",
               "gpt", 1, {4});
}
// reshard_after_forward = 2 on 4 ranks: backward gathers within pairs of shard ranks.
TEST(Parity, FSDP2ReshardAfterForwardTwoAndCheckpointing) {
  check_parity("fsdp2", "--set strategy.reshard_after_forward=2 --set strategy.activation_checkpointing=Block", "gpt",
               1, {4});
}
TEST(Parity, FSDP2HSDPReplicate2Shard2) {
  check_parity("fsdp2", "--set strategy.data_parallel_replicate_size=2", "mlp", 1, {4});
}
TEST(Parity, FSDP2GradientAccumulationNoSync) { check_parity("fsdp2", "", "gpt", /*accumulate=*/3, {2, 3}); }
// [trainer] sync_batchnorm: BatchNorm statistics over the global batch, so N ranks train as
// one device does (losses, parameters and running statistics); without it they do not.
// Tolerance 1e-4, not 2e-5: the first conv's weight gradient is a small difference of large
// per-rank sums (BatchNorm's input gradient is mean-free over the global batch, not over a
// rank's, and the images' mean multiplies it), so float summation order shows as ~1e-5 of that
// gradient and ~3e-5 in its weights after 6 steps; every other tensor and the losses agree to ~1e-7.
// The llama (Hugging Face's LlamaForCausalLM; tests/models/llama_test.cpp checks it against Hugging
// Face's modeling code): every strategy equals one device, its decoder layers as FSDP units.
TEST(Parity, DDPLlama) { check_parity("ddp", "", "llama", 1, {2}); }
TEST(Parity, FSDPLlamaWithActivationCheckpointing) {
  check_parity("fsdp", "--set strategy.activation_checkpointing=LlamaDecoderLayer", "llama", 1, {3});
}
TEST(Parity, FSDP2LlamaDeferredInit) {
  // Deferred init builds the layers unit by unit and draws each parameter by its name: the
  // eager single-device model's weights, so the runs train alike from step 1.
  check_parity("fsdp2", "--set strategy.deferred_init=true", "llama", 1, {2});
}
// The llama's fused kernels (RMSNorm with its residual add, rotary, SwiGLU: on the CPU by default)
// train as the unfused math Hugging Face's modeling code writes, under every strategy: the same
// losses and parameters after 6 steps (fp32; the kernels round as the ops do within ~1e-7).
TEST(Parity, LlamaFusedKernelsTrainAsTheUnfusedMathUnderEveryStrategy) {
  const std::string on = "--set model.fused_rms_norm=true --set model.fused_rotary=true --set model.fused_swiglu=true";
  const std::string off =
      "--set model.fused_rms_norm=false --set model.fused_rotary=false --set model.fused_swiglu=false";
  for (const auto& [strategy, world] : std::vector<std::pair<std::string, int>>{
           {"single_device", 1}, {"ddp", 2}, {"fsdp", 2}, {"fsdp2", 3}}) {
    SCOPED_TRACE(strategy);
    const std::string sets = "--set strategy.plugin=" + strategy + " ";
    const auto unfused = fit(strategy + "-unfused-llama", "llama", world, sets + off);
    const auto fused = fit(strategy + "-fused-llama", "llama", world, sets + on);
    expect_same(unfused, fused, strategy + " fused against unfused", 2e-5);
  }
}

// As Qwen3, whose q/k norms each tp rank applies to its own heads: their gradients are summed over
// the tp ranks (without, q_norm's weight drifted 5e-4 from one device's in 4 steps).
TEST(Parity, FSDP2LlamaDp2Tp2) {
  const auto reference = fit("reference-qwen3-tp", "qwen3", 1, "--set strategy.plugin=single_device");
  const auto run = fit("fsdp2-tp2-qwen3", "qwen3", 4,
                      "--set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2 "
                      "--set strategy.activation_checkpointing=LlamaDecoderLayer",
                      1, /*dp=*/2);
  expect_same(reference, run, "fsdp2 dp 2 x tp 2", 2e-5);
}

const std::string kSyncBatchNorm = "--set trainer.sync_batchnorm=true";
constexpr double kSyncBatchNormTol = 1e-4;
TEST(Parity, DDPSyncBatchNormCNN) {
  check_parity("ddp", "", "cnn_bn", 1, {2, 3}, kSyncBatchNorm, kSyncBatchNormTol);
}
TEST(Parity, FSDPSyncBatchNormCNN) { check_parity("fsdp", "", "cnn_bn", 1, {2, 3}, kSyncBatchNorm, kSyncBatchNormTol); }
TEST(Parity, FSDP2SyncBatchNormCNN) { check_parity("fsdp2", "", "cnn_bn", 1, {2}, kSyncBatchNorm, kSyncBatchNormTol); }
TEST(Parity, SyncBatchNormIsLibTorchsBatchNormOverTheGlobalBatch) {
  // Against torch::nn::BatchNorm2d on one device (LibTorch's kernel in float; the synchronised
  // layer's statistics in double).
  const auto reference = fit("reference-cnn_bn-libtorch", "cnn_bn", 1, "--set strategy.plugin=single_device");
  const auto run = fit("ddp-cnn_bn-synced", "cnn_bn", 2, "--set strategy.plugin=ddp " + kSyncBatchNorm);
  expect_same(reference, run, "ddp x2 with sync_batchnorm against LibTorch's BatchNorm2d", kSyncBatchNormTol);
}
TEST(Parity, BatchNormWithoutSyncIsPerRank) {
  const auto reference = fit("reference-cnn_bn-unsynced", "cnn_bn", 1, "--set strategy.plugin=single_device");
  const auto run = fit("ddp-cnn_bn-unsynced", "cnn_bn", 2, "--set strategy.plugin=ddp");
  ASSERT_EQ(run.losses.size(), reference.losses.size());
  double largest = 0;
  for (const auto& [step, loss] : reference.losses) largest = std::max(largest, std::abs(run.losses.at(step) - loss));
  EXPECT_GT(largest, 1e-3) << "per-rank BatchNorm statistics should change the losses: the sync tests prove nothing";
}

// gradient_clip_algorithm = "value" (Lightning's; clip_grad_value_): each gradient element is
// clamped, on shards and tensor pieces as on whole gradients, so N ranks still match one device.
const std::string kClipByValue = "--set trainer.gradient_clip_val=0.002 --set trainer.gradient_clip_algorithm=value";
TEST(Parity, FSDPGradientClippingByValue) { check_parity("fsdp", "", "gpt", 1, {2, 3}, kClipByValue); }
TEST(Parity, FSDP2GradientClippingByValue) { check_parity("fsdp2", "", "gpt", 1, {3}, kClipByValue); }
TEST(Parity, DDPGradientClippingByValue) { check_parity("ddp", "", "mlp", 1, {2}, kClipByValue); }
TEST(Parity, GradientClippingByValueClampsTheUnscaledGradients) {
  const std::string single = "--set strategy.plugin=single_device ";
  const auto unclipped = fit("unclipped-gpt", "gpt", 1, single);
  const auto clipped = fit("clipped-gpt", "gpt", 1, single + kClipByValue);
  ASSERT_EQ(clipped.losses.size(), unclipped.losses.size());
  double largest = 0;
  for (const auto& [step, loss] : unclipped.losses) largest = std::max(largest, std::abs(clipped.losses.at(step) - loss));
  EXPECT_GT(largest, 1e-3) << "a clip value of 0.002 should change this training: the parity tests above prove nothing";
  // Under a grad scaler (2^10, exact in bf16's range) the clamp acts on the unscaled gradients,
  // after the scaler's inf check: the same training as without a scaler. Clamped while still
  // scaled, every gradient above 0.002 / 1024 would be cut.
  const std::string bf16 = single + "--set precision.precision=bf16-mixed " + kClipByValue;
  expect_same(fit("clipped-bf16", "gpt", 1, bf16),
              fit("clipped-bf16-scaled", "gpt", 1, bf16 + " --set precision.scaler=true --set precision.init_scale=1024"),
              "bf16-mixed clipped by value, with and without a grad scaler", 2e-5);
}

TEST(Parity, DDPGradientClippingInfNorm) {
  check_parity("ddp", "", "mlp", 1, {2, 3}, "--set trainer.gradient_clip_val=0.01 --set trainer.norm_type=inf");
}

}  // namespace
