// FSDPPrecision across real ranks (Gloo on loopback): the grad scaler agrees on inf across
// ranks, the policy halves the bytes FSDP moves, bf16 FSDP tracks the single-device run, and
// the scaler's state survives checkpoint/resume through the `tessera` binary.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/comm.hpp"
#include "tessera/core/fsdp.hpp"
#include "tessera/core/precision_base.hpp"
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/unit.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

namespace core = tessera::core;
namespace sdk = tessera::sdk;
using tessera::testing::metric_series;
using tessera::testing::run_ranks;
using tessera::testing::run_tessera;

sdk::Options options(const std::string& toml_text) {
  toml::table table = toml::parse(toml_text);
  return sdk::make_options("precision", "run.toml", std::move(table));
}

/// A CPU strategy on the job's world (Gloo): what the scaler agrees through.
class WorldStrategy final : public core::StrategyBase {
 public:
  explicit WorldStrategy(const sdk::ClusterInfo& cluster) : StrategyBase(cpu_options()) { setup_environment(cluster); }

 private:
  static sdk::Options cpu_options() {
    toml::table table = toml::parse("accelerator = \"cpu\"\n");
    return sdk::make_options("strategy", "test.toml", std::move(table));
  }
};

class ShardedScaler : public ::testing::TestWithParam<int> {};

// Each rank owns a different shard (as under FSDP); only the last rank sees inf, at steps 1
// and 3. Every rank must skip exactly those steps, keep its shard untouched there, and keep
// the same scale as every other rank.
TEST_P(ShardedScaler, EveryRankSkipsTheStepsWithInfOnAnyOneRank) {
  const int world = GetParam();
  run_ranks(world, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    WorldStrategy strategy(cluster);
    core::PrecisionBase precision(
        options("precision = \"bf16-mixed\"\nscaler = true\ninit_scale = 256.0\ngrowth_interval = 2\n"), true);
    const auto rank = static_cast<double>(cluster.global_rank);
    at::Tensor shard = at::full({5}, 1.0 + rank).requires_grad_();
    torch::optim::SGD optimizer({shard}, torch::optim::SGDOptions(0.1));
    const std::set<int> inf_steps = {1, 3};
    std::vector<bool> stepped;
    std::vector<double> scales;
    for (int step = 0; step < 6; ++step) {
      at::Tensor before = shard.detach().clone();
      precision.pre_backward((shard * shard).sum() * 0.5).backward();  // gradient = shard
      if (inf_steps.count(step) && cluster.global_rank == world - 1) {
        torch::NoGradGuard no_grad;
        shard.mutable_grad()[2] = step == 1 ? std::numeric_limits<double>::infinity() : std::nan("");
      }
      stepped.push_back(precision.optimizer_step(optimizer, strategy));
      optimizer.zero_grad();
      scales.push_back(precision.scale());
      if (stepped.back()) EXPECT_TRUE(at::allclose(shard.detach(), before * 0.9)) << "rank " << rank << " step " << step;
      else EXPECT_TRUE(at::equal(shard.detach(), before)) << "rank " << rank << " step " << step;
    }
    EXPECT_EQ(stepped, (std::vector<bool>{true, false, true, false, true, true})) << "rank " << rank;
    EXPECT_EQ(scales, (std::vector<double>{256, 128, 128, 64, 64, 128})) << "rank " << rank;
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShardedScaler, ::testing::Values(2, 3));

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(std::int64_t width) : torch::nn::Module("Block") {
    fc = register_module("fc", torch::nn::Linear(width, width));
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

/// Two FSDP units of 13*13+13 parameters (indivisible by 2) and a root head.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    b1 = register_module("b1", Block(13));
    b2 = register_module("b2", Block(13));
    head = register_module("head", torch::nn::Linear(13, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return head(sdk::invoke(b2, sdk::invoke(b1, x))); }
  Block b1{nullptr}, b2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Traffic {
  std::int64_t all_gather_bytes;
  std::int64_t reduce_scatter_bytes;
  at::ScalarType master_dtype;
};

/// One FSDP training step of Net under `precision_toml`, in the order the fsdp strategy
/// runs it; the bytes this rank put on the wire for it. `after_backward` sees the sharded model.
Traffic fsdp_step(const std::string& precision_toml, const core::CommunicatorPtr& comm,
                  const std::function<void(core::fsdp::ShardedModule&)>& after_backward = nullptr) {
  core::PrecisionBase precision(options(precision_toml), /*fsdp_policy=*/true);
  torch::manual_seed(0);
  Net net;
  precision.convert_module(*net);
  core::fsdp::FSDPOptions fsdp_options;
  fsdp_options.unit_classes = {"Block"};
  fsdp_options.mixed_precision = precision.mixed_precision_policy();
  core::fsdp::ShardedModule sharded(net.ptr(), fsdp_options, comm, comm);
  const core::CommStats before = comm->stats();
  sharded.begin_forward(/*training=*/true);
  at::Tensor loss;
  {
    sdk::GuardPtr guard = precision.forward_context();
    loss = precision.convert_output(net->forward(precision.convert_input(at::ones({4, 13}))).pow(2).mean());
  }
  sharded.begin_backward(/*sync=*/true);
  precision.pre_backward(loss).backward();
  sharded.finish_backward();
  if (after_backward) after_backward(sharded);
  const core::CommStats after = comm->stats();
  return Traffic{after.all_gather_bytes - before.all_gather_bytes,
                 after.reduce_scatter_bytes - before.reduce_scatter_bytes,
                 sharded.optimizer_parameters().front().tensor.scalar_type()};
}

TEST(MixedPrecisionPolicy, BytesOnTheWireHalveUnderBf16) {
  run_ranks(2, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    auto comm = core::make_communicator(cluster, c10::kCPU);
    Traffic fp32 = fsdp_step("precision = \"32-true\"\n", comm);
    Traffic bf16_true = fsdp_step("precision = \"bf16-true\"\n", comm);
    Traffic bf16_mixed = fsdp_step("precision = \"bf16-mixed\"\n", comm);
    Traffic bf16_params = fsdp_step("precision = \"bf16-mixed\"\nparam_dtype = \"bfloat16\"\n", comm);
    ASSERT_GT(fp32.all_gather_bytes, 0);
    ASSERT_GT(fp32.reduce_scatter_bytes, 0);
    // bf16 param_dtype: every all-gather moves half the bytes; bf16 reduce_dtype: every
    // reduce-scatter too. Lightning's bf16-mixed gathers fp32 parameters (autocast computes
    // in bf16) and reduces in bf16.
    EXPECT_EQ(bf16_true.all_gather_bytes * 2, fp32.all_gather_bytes);
    EXPECT_EQ(bf16_true.reduce_scatter_bytes * 2, fp32.reduce_scatter_bytes);
    EXPECT_EQ(bf16_mixed.all_gather_bytes, fp32.all_gather_bytes);
    EXPECT_EQ(bf16_mixed.reduce_scatter_bytes * 2, fp32.reduce_scatter_bytes);
    EXPECT_EQ(bf16_params.all_gather_bytes * 2, fp32.all_gather_bytes);
    EXPECT_EQ(bf16_params.reduce_scatter_bytes * 2, fp32.reduce_scatter_bytes);
    // The optimizer steps on fp32 master shards in the mixed modes.
    EXPECT_EQ(bf16_mixed.master_dtype, at::kFloat);
    EXPECT_EQ(bf16_params.master_dtype, at::kFloat);
    // *-true: the master shards are the model's own half dtype (never fp32, as on one device).
    EXPECT_EQ(bf16_true.master_dtype, at::kBFloat16);
  });
}

/// A unit with a BatchNorm (kept out of the mixed-precision policy) and a floating buffer
/// (cast to buffer_dtype while training, fp32 in state dicts).
struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl() : torch::nn::Module("NormBlock") {
    fc = register_module("fc", torch::nn::Linear(13, 13));
    bn = register_module("bn", torch::nn::BatchNorm1d(13));
    scale = register_buffer("scale", at::full({13}, 0.5));
  }
  at::Tensor forward(const at::Tensor& x) { return bn(fc(x)) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(NormBlock);

struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    b1 = register_module("b1", NormBlock());
    head = register_module("head", torch::nn::Linear(13, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return head(sdk::invoke(b1, x)); }
  NormBlock b1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(NormNet);

// keep_low_precision_grads leaves the optimizer's gradients in param_dtype, as PyTorch's FSDP
// casts them, also when reduce_dtype is wider: under bf16-true with reduce_dtype = float32 the
// bf16 parameters were given fp32 gradients and AdamW's step failed in a LibTorch assert.
TEST(MixedPrecisionPolicy, KeptLowPrecisionGradsTakeParamDtypeWhateverTheReduceDtype) {
  run_ranks(2, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    auto comm = core::make_communicator(cluster, c10::kCPU);
    for (const std::string precision : {"precision = \"bf16-true\"\n", "precision = \"bf16-mixed\"\nparam_dtype = \"bfloat16\"\n"}) {
      fsdp_step(precision + "reduce_dtype = \"float32\"\nkeep_low_precision_grads = true\n", comm,
                [&](core::fsdp::ShardedModule& sharded) {
                  std::vector<at::Tensor> params;
                  for (const auto& p : sharded.optimizer_parameters()) {
                    EXPECT_EQ(p.tensor.grad().scalar_type(), at::kBFloat16) << precision << " " << p.name;
                    params.push_back(p.tensor);
                  }
                  const at::Tensor before = params.front().detach().clone();
                  torch::optim::AdamW(params, torch::optim::AdamWOptions(0.1)).step();
                  EXPECT_FALSE(at::equal(params.front(), before)) << precision;
                  EXPECT_TRUE(params.front().isfinite().all().item<bool>()) << precision;
                });
    }
  });
}

// bf16-mixed with param_dtype and buffer_dtype bf16 and keep_low_precision_grads: the
// BatchNorm keeps fp32 parameters (replicated, equal on every rank after steps) and fp32
// running statistics; the other floating buffer is bf16 in the module and fp32 in the state
// dict; the optimizer sees bf16 gradients for the flat units and fp32 ones for the norm.
TEST(MixedPrecisionPolicy, NormLayersStayFp32BuffersCastLowPrecisionGradsKept) {
  run_ranks(2, std::chrono::seconds(90), [&](const sdk::ClusterInfo& cluster) {
    auto comm = core::make_communicator(cluster, c10::kCPU);
    core::PrecisionBase precision(options("precision = \"bf16-mixed\"\nparam_dtype = \"bfloat16\"\n"
                                          "buffer_dtype = \"bfloat16\"\nkeep_low_precision_grads = true\n"),
                                  /*fsdp_policy=*/true);
    torch::manual_seed(0);
    NormNet net;
    core::fsdp::FSDPOptions fsdp_options;
    fsdp_options.unit_classes = {"NormBlock"};
    fsdp_options.rank0_only = false;
    fsdp_options.mixed_precision = precision.mixed_precision_policy();
    core::fsdp::ShardedModule sharded(net.ptr(), fsdp_options, comm, comm);
    EXPECT_EQ(net->b1->bn->weight.scalar_type(), at::kFloat);
    EXPECT_EQ(net->b1->bn->running_mean.scalar_type(), at::kFloat);
    EXPECT_EQ(net->b1->scale.scalar_type(), at::kBFloat16);
    std::vector<at::Tensor> params;
    for (const auto& p : sharded.optimizer_parameters()) params.push_back(p.tensor);
    torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      at::Generator g = at::detail::createCPUGenerator(10 * step + cluster.global_rank);
      sharded.begin_forward(/*training=*/true);
      at::Tensor loss;
      {
        sdk::GuardPtr guard = precision.forward_context();
        loss = precision.convert_output(net->forward(at::randn({6, 13}, g)).pow(2).mean());
      }
      sharded.begin_backward(/*sync=*/true);
      loss.backward();
      sharded.finish_backward();
      EXPECT_TRUE(std::isfinite(sharded.clip_grad_norm(1.0, 2.0)));
      optimizer.step();
      sharded.after_optimizer_step();
    }
    for (const auto& p : sharded.optimizer_parameters()) {
      const bool norm = p.name.find(".bn.") != std::string::npos;
      EXPECT_EQ(p.tensor.scalar_type(), at::kFloat) << p.name;  // fp32 master
      EXPECT_EQ(p.tensor.grad().scalar_type(), norm ? at::kFloat : at::kBFloat16) << p.name;
      if (norm) EXPECT_EQ(p.tensor.numel(), 13) << p.name << " is replicated whole";
    }
    // The replicated norm parameters moved, and identically on every rank.
    at::Tensor weight = net->b1->bn->weight.detach().clone();
    EXPECT_FALSE(at::equal(weight, at::ones({13})));
    at::Tensor spread = weight.clone();
    comm->all_reduce(spread, sdk::ReduceOp::max, "test")->wait();
    EXPECT_TRUE(at::equal(spread, weight)) << "rank " << cluster.global_rank;
    sdk::StateDict state = sharded.full_state_dict();
    EXPECT_EQ(state.find("b1.scale")->scalar_type(), at::kFloat);
    EXPECT_EQ(state.find("b1.bn.running_var")->scalar_type(), at::kFloat);
    EXPECT_FALSE(at::equal(*state.find("b1.bn.running_mean"), at::zeros({13})));
  });
}

constexpr int kGlobalBatch = 12;

struct FitRun {
  std::map<std::int64_t, double> losses;
  std::map<std::string, at::Tensor> state;
};

std::string run_config(const std::string& dir, const std::string& extra) {
  std::ofstream(dir + "/run.toml") << "[trainer]\nmax_steps = 6\nlog_every_n_steps = 1\nseed = 11\n"
                                   << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                   << "[optimizer]\nname = \"sgd\"\nlr = 0.02\nmomentum = 0.9\nschedule = \"constant\"\n"
                                   << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 3\nn_embd = 36\nblock_size = 16\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n"
                                   << extra;
  return dir + "/run.toml";
}

FitRun fit(const std::string& name, int world, const std::string& strategy, const std::string& precision) {
  std::string dir = tessera::testing::fresh_dir(name + "-" + std::to_string(world));
  std::string config = run_config(dir, "[precision]\nplugin = \"fsdp-precision\"\nprecision = \"" + precision + "\"\n");
  auto result = run_tessera("fit --config " + config + " --set launch.devices=" + std::to_string(world) +
                                " --set data.batch_size=" + std::to_string(kGlobalBatch / world) +
                                " --set strategy.plugin=" + strategy + " --set strategy.accelerator=cpu",
                            "", 240);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  return FitRun{metric_series(tessera::testing::run_dir(dir) + "/metrics.csv", "train", "train_loss"),
             tessera::testing::checkpoint_state(tessera::testing::run_dir(dir) + "/checkpoints/last.ckpt")};
}

void expect_close(const FitRun& reference, const FitRun& run, const std::string& what, double loss_tol, double param_tol) {
  ASSERT_EQ(reference.losses.size(), 6u) << what;
  ASSERT_EQ(run.losses.size(), reference.losses.size()) << what;
  for (const auto& [step, loss] : reference.losses)
    EXPECT_NEAR(run.losses.at(step), loss, loss_tol * std::abs(loss)) << what << " step " << step;
  if (param_tol <= 0) return;
  ASSERT_EQ(run.state.size(), reference.state.size()) << what;
  for (const auto& [name, tensor] : reference.state) {
    const at::Tensor& other = run.state.at(name);
    const double diff = (other.to(at::kFloat) - tensor.to(at::kFloat)).abs().max().item<double>();
    EXPECT_LE(diff, param_tol) << what << ": parameter " << name;
  }
}

class Bf16Parity : public ::testing::TestWithParam<std::string> {};

// bf16 FSDP (fsdp and fsdp2) on 2 and 3 ranks tracks the single-device run at the same precision (loose:
// gradients are reduced in bf16 under FSDP), and fp32 in loss: bf16-mixed within 0.5%;
// bf16-true within 3%, since its model itself is rounded to bf16 (0.5% at step 0 already).
TEST_P(Bf16Parity, FSDPTracksSingleDeviceAndFp32) {
  const std::string precision = GetParam();
  const double fp32_tol = precision == "bf16-mixed" ? 0.005 : 0.03;
  FitRun fp32 = fit("fp32-reference", 1, "single_device", "32-true");
  FitRun single = fit(precision + "-single", 1, "single_device", precision);
  expect_close(fp32, single, precision + " single device vs 32-true", fp32_tol, 0);
  for (const std::string strategy : {"fsdp", "fsdp2"})
    for (int world : {2, 3}) {
      const std::string what = precision + " " + strategy + " x" + std::to_string(world);
      FitRun sharded = fit(precision + "-" + strategy, world, strategy, precision);
      expect_close(single, sharded, what + " vs single device", 0.002, 0.02);
      expect_close(fp32, sharded, what + " vs 32-true", fp32_tol, 0);
    }
}

INSTANTIATE_TEST_SUITE_P(Precisions, Bf16Parity, ::testing::Values("bf16-mixed", "bf16-true"),
                         [](const auto& info) { return info.param == "bf16-mixed" ? "bf16_mixed" : "bf16_true"; });

/// The precision_plugin entry of a checkpoint file.
sdk::Checkpoint scaler_state(const std::string& path) {
  auto checkpoint = core::checkpoint_dict(core::load_pickle(path), path);
  return core::checkpoint_dict(core::checkpoint_get(checkpoint, "precision_plugin"), "precision_plugin");
}

// bf16-mixed with a scaler that doubles every 2 steps, FSDP on 2 ranks: a run resumed from
// the step-4 checkpoint continues with the saved scale (not init_scale) and ends with the
// same scale and losses as the uninterrupted run.
TEST(ScalerState, SurvivesCheckpointAndResumeUnderFSDP) {
  const std::string sets =
      " --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=6 --set strategy.accelerator=cpu";
  auto config = [&](const std::string& dir) {
    std::ofstream(dir + "/run.toml")
        << "[trainer]\nmax_steps = 8\nlog_every_n_steps = 1\nseed = 11\ncheckpoint_every_n_steps = 4\n"
        << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
        << "[optimizer]\nname = \"adamw\"\nlr = 0.003\n"
        << "[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 3\nn_embd = 36\nblock_size = 16\n"
        << "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n"
        << "[precision]\nplugin = \"fsdp-precision\"\nprecision = \"bf16-mixed\"\nscaler = true\n"
        << "init_scale = 1024.0\ngrowth_interval = 2\n";
    return dir + "/run.toml";
  };
  std::string full = tessera::testing::fresh_dir("scaler-full");
  auto a = run_tessera("fit --config " + config(full) + sets, "", 240);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  sdk::Checkpoint at_4 = scaler_state(tessera::testing::run_dir(full) + "/checkpoints/step=4.ckpt");
  EXPECT_EQ(at_4.at("scale").toDouble(), 4096.0);  // doubled at steps 2 and 4
  sdk::Checkpoint at_8 = scaler_state(tessera::testing::run_dir(full) + "/checkpoints/last.ckpt");
  EXPECT_EQ(at_8.at("scale").toDouble(), 16384.0);

  std::string resumed = tessera::testing::fresh_dir("scaler-resumed");
  auto b = run_tessera("fit --config " + config(resumed) + " --ckpt-path " + tessera::testing::run_dir(full) + "/checkpoints/step=4.ckpt" + sets,
                       "", 240);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(scaler_state(tessera::testing::run_dir(resumed) + "/checkpoints/last.ckpt").at("scale").toDouble(), 16384.0)
      << "a scaler restarted from init_scale would end at 4096";
  auto full_losses = metric_series(tessera::testing::run_dir(full) + "/metrics.csv", "train", "train_loss");
  auto resumed_losses = metric_series(tessera::testing::run_dir(resumed) + "/metrics.csv", "train", "train_loss");
  for (std::int64_t step = 5; step <= 8; ++step) {
    ASSERT_TRUE(full_losses.count(step) && resumed_losses.count(step)) << "no loss at step " << step;
    EXPECT_NEAR(resumed_losses.at(step), full_losses.at(step), 1e-5) << "step " << step;
  }
}

}  // namespace
