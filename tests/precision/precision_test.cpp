// Lightning's precision strings through the `precision` and `fsdp-precision` plugins and
// core::PrecisionBase: parsing, the CPU fp16 refusal, casts, autocast, the init dtype, the
// FSDP mixed-precision policy, and the grad scaler (skips, growth/backoff, state).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "multiprocess.hpp"
#include "tessera/sdk/autocast.hpp"
#include "tessera/core/checkpoint.hpp"
#include "plugin_loader.hpp"
#include "tessera/core/precision_base.hpp"
#include "tessera/core/strategy_base.hpp"
#include "tessera/sdk/error.hpp"
#include "errors.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

namespace core = tessera::core;
namespace sdk = tessera::sdk;

using tessera::testing::error_of;

sdk::Options options(const std::string& toml_text) {
  toml::table table = toml::parse(toml_text);
  return sdk::make_options("precision", "run.toml", std::move(table));
}

std::shared_ptr<sdk::Precision> plugin(const std::string& name, const std::string& toml_text) {
  static core::PluginLoader loader({tessera::testing::plugin_dir()});
  return loader.create_as<sdk::Precision>(sdk::PluginKind::precision, name, options(toml_text));
}

std::string precision_key(const std::string& precision) { return "precision = \"" + precision + "\"\n"; }

/// A one-rank CPU strategy: what the scaler reduces its found-inf flag through.
class LocalStrategy final : public core::StrategyBase {
 public:
  LocalStrategy() : StrategyBase(cpu_options()) { setup_environment(sdk::ClusterInfo{}); }

 private:
  static sdk::Options cpu_options() {
    toml::table table = toml::parse("accelerator = \"cpu\"\n");
    return sdk::make_options("strategy", "test.toml", std::move(table));
  }
};

TEST(PrecisionStrings, EveryLightningStringIsAcceptedByBothPlugins) {
  for (const std::string& name : {"precision", "fsdp-precision"})
    for (const std::string& precision : core::PrecisionBase::precisions())
      EXPECT_EQ(plugin(name, precision_key(precision))->precision(), precision) << name;
  EXPECT_EQ(plugin("precision", "")->precision(), "32-true");
  EXPECT_EQ(core::PrecisionBase::precisions(),
            (std::vector<std::string>{"32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"}));
}

TEST(PrecisionStrings, OthersAreRejectedListingTheFiveAndNamingTheKey) {
  for (const std::string& bad : {"bf16", "16", "fp32", "64-true"}) {
    std::string message = error_of([&] { plugin("fsdp-precision", precision_key(bad)); });
    EXPECT_NE(message.find("32-true, 16-true, bf16-true, 16-mixed, bf16-mixed"), std::string::npos) << message;
    EXPECT_NE(message.find("[precision] precision"), std::string::npos) << message;
  }
}

TEST(CheckDevice, Fp16OnCpuIsRefusedNamingPrecisionDeviceAndAlternatives) {
  for (const std::string& precision : {"16-mixed", "16-true"}) {
    std::string message = error_of([&] { plugin("precision", precision_key(precision))->check_device(c10::kCPU); });
    EXPECT_NE(message.find("precision \"" + precision + "\" needs a CUDA device, but this run's device is cpu"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("On CPU use \"bf16-mixed\", \"bf16-true\" or \"32-true\""), std::string::npos) << message;
  }
  for (const std::string& precision : {"32-true", "bf16-true", "bf16-mixed"})
    EXPECT_NO_THROW(plugin("fsdp-precision", precision_key(precision))->check_device(c10::kCPU));
  std::string message = error_of(
      [&] { plugin("fsdp-precision", precision_key("32-true") + "param_dtype = \"float16\"\n")->check_device(c10::kCPU); });
  EXPECT_NE(message.find("param_dtype = \"float16\" needs a CUDA device"), std::string::npos) << message;
}

TEST(Policy, PrecisionPluginLeavesEveryDtypeUnset) {
  for (const std::string& precision : core::PrecisionBase::precisions()) {
    sdk::MixedPrecisionPolicy policy = plugin("precision", precision_key(precision))->mixed_precision_policy();
    EXPECT_FALSE(policy.param_dtype || policy.reduce_dtype || policy.buffer_dtype) << precision;
  }
}

TEST(Policy, FSDPPrecisionFollowsLightning) {
  struct Row {
    std::string precision;
    at::ScalarType param, reduce, buffer;
  };
  for (const Row& row : std::vector<Row>{{"32-true", at::kFloat, at::kFloat, at::kFloat},
                                         {"16-true", at::kHalf, at::kHalf, at::kHalf},
                                         {"bf16-true", at::kBFloat16, at::kBFloat16, at::kBFloat16},
                                         {"16-mixed", at::kFloat, at::kHalf, at::kHalf},
                                         {"bf16-mixed", at::kFloat, at::kBFloat16, at::kBFloat16}}) {
    sdk::MixedPrecisionPolicy policy = plugin("fsdp-precision", precision_key(row.precision))->mixed_precision_policy();
    EXPECT_EQ(policy.param_dtype, row.param) << row.precision;
    EXPECT_EQ(policy.reduce_dtype, row.reduce) << row.precision;
    EXPECT_EQ(policy.buffer_dtype, row.buffer) << row.precision;
    EXPECT_FALSE(policy.keep_low_precision_grads);
  }
}

TEST(Policy, FSDPPrecisionDtypesCanBeOverriddenOnlyThere) {
  auto policy = plugin("fsdp-precision", precision_key("bf16-mixed") +
                                             "param_dtype = \"bfloat16\"\nreduce_dtype = \"float32\"\n"
                                             "keep_low_precision_grads = true\n")
                    ->mixed_precision_policy();
  EXPECT_EQ(policy.param_dtype, at::kBFloat16);
  EXPECT_EQ(policy.reduce_dtype, at::kFloat);
  EXPECT_EQ(policy.buffer_dtype, at::kBFloat16);
  EXPECT_TRUE(policy.keep_low_precision_grads);
  std::string message =
      error_of([&] { plugin("fsdp-precision", precision_key("bf16-mixed") + "param_dtype = \"bf16\"\n"); });
  EXPECT_NE(message.find("float32, bfloat16, float16"), std::string::npos) << message;
  // The plain plugin has no policy keys: the host's unknown-key check rejects them.
  sdk::Options plain = options(precision_key("bf16-mixed") + "param_dtype = \"bfloat16\"\n");
  core::PrecisionBase precision(plain, /*fsdp_policy=*/false);
  EXPECT_THROW(plain.check_all_used({"plugin"}), sdk::Error);
}

TEST(ModuleInitContext, Bf16TrueCreatesParametersInBf16Directly) {
  auto precision = plugin("fsdp-precision", precision_key("bf16-true"));
  {
    sdk::GuardPtr guard = precision->module_init_context();
    ASSERT_TRUE(guard);
    torch::nn::Linear linear(5, 3);
    EXPECT_EQ(linear->weight.scalar_type(), at::kBFloat16);
    EXPECT_EQ(linear->bias.scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(c10::get_default_dtype(), caffe2::TypeMeta::Make<float>()) << "the default dtype is restored";
  EXPECT_EQ(plugin("precision", precision_key("bf16-mixed"))->module_init_context(), nullptr);
  EXPECT_EQ(plugin("precision", precision_key("32-true"))->module_init_context(), nullptr);
}

TEST(ForwardContext, Bf16MixedRunsMatmulsInBf16WhileParametersStayFp32) {
  auto precision = plugin("precision", precision_key("bf16-mixed"));
  precision->check_device(c10::kCPU);
  torch::nn::Linear linear(8, 4);
  at::Tensor x = at::randn({2, 8});
  {
    sdk::GuardPtr outer = precision->forward_context();
    EXPECT_TRUE(sdk::autocast_enabled(/*cuda=*/false));
    EXPECT_EQ(linear(x).scalar_type(), at::kBFloat16);
    EXPECT_EQ(at::matmul(x, x.t()).scalar_type(), at::kBFloat16);
    {
      sdk::GuardPtr inner = precision->forward_context();  // nested steps restore, not clear
    }
    EXPECT_TRUE(sdk::autocast_enabled(/*cuda=*/false));
    EXPECT_EQ(linear->weight.scalar_type(), at::kFloat);
    at::Tensor loss = precision->convert_output(linear(x).sum());
    EXPECT_EQ(loss.scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(sdk::autocast_enabled(/*cuda=*/false));
  EXPECT_EQ(linear(x).scalar_type(), at::kFloat);
}

TEST(ForwardContext, TruePrecisionCreatesForwardTensorsInItsDtype) {
  auto precision = plugin("precision", precision_key("bf16-true"));
  {
    sdk::GuardPtr guard = precision->forward_context();
    EXPECT_EQ(at::zeros({2}).scalar_type(), at::kBFloat16);
    EXPECT_FALSE(sdk::autocast_enabled(/*cuda=*/false));
  }
  EXPECT_EQ(at::zeros({2}).scalar_type(), at::kFloat);
  EXPECT_EQ(plugin("precision", precision_key("32-true"))->forward_context(), nullptr);
}

TEST(ConvertModule, TruePrecisionsCastParametersAndBuffersMixedLeavesThem) {
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
  plugin("precision", precision_key("bf16-mixed"))->convert_module(*net.ptr());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  plugin("fsdp-precision", precision_key("bf16-true"))->convert_module(*net.ptr());
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
  for (const auto& b : net->named_buffers())
    if (b.value().is_floating_point()) EXPECT_EQ(b.value().scalar_type(), at::kBFloat16) << b.key();
}

TEST(ConvertIO, FloatingInputsToTheComputeDtypeOutputsToFp32) {
  auto bf16_true = plugin("precision", precision_key("bf16-true"));
  EXPECT_EQ(bf16_true->convert_input(at::ones({2})).scalar_type(), at::kBFloat16);
  EXPECT_EQ(bf16_true->convert_input(at::ones({2}, at::kLong)).scalar_type(), at::kLong);
  EXPECT_EQ(bf16_true->convert_output(at::ones({2}, at::kBFloat16)).scalar_type(), at::kFloat);
  auto mixed = plugin("precision", precision_key("bf16-mixed"));
  EXPECT_EQ(mixed->convert_input(at::ones({2}, at::kDouble)).scalar_type(), at::kFloat);
  EXPECT_EQ(mixed->convert_input(at::ones({2})).scalar_type(), at::kFloat);
}

TEST(GradScaler, OnByDefaultFor16MixedOnlyAndRefusedForTruePrecisions) {
  EXPECT_EQ(plugin("precision", precision_key("16-mixed"))->state_dict().at("scale").toDouble(), 65536.0);
  EXPECT_EQ(plugin("precision", precision_key("bf16-mixed"))->state_dict().size(), 0u);
  EXPECT_EQ(plugin("precision", precision_key("32-true"))->state_dict().size(), 0u);
  EXPECT_EQ(plugin("precision", precision_key("bf16-mixed") + "scaler = true\ninit_scale = 8\n")
                ->state_dict()
                .at("scale")
                .toDouble(),
            8.0);
  std::string message = error_of([&] { plugin("fsdp-precision", precision_key("bf16-true") + "scaler = true\n"); });
  EXPECT_NE(message.find("a grad scaler needs fp32 master weights"), std::string::npos) << message;
  message = error_of([&] { plugin("precision", precision_key("16-mixed") + "backoff_factor = 2.0\n"); });
  EXPECT_NE(message.find("backoff_factor"), std::string::npos) << message;
}

struct ScalerRun {
  std::vector<bool> stepped;
  std::vector<double> scales;
};

/// Steps a one-parameter SGD through `precision`, injecting inf into the gradient at the
/// `inf_steps`; checks each taken step used the unscaled gradient and each skipped one left
/// the parameter as it was.
ScalerRun run_scaler(core::PrecisionBase& precision, const std::set<int>& inf_steps, int steps) {
  LocalStrategy strategy;
  at::Tensor w = at::full({3}, 1.0).requires_grad_();
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(0.1));
  const at::Tensor x = at::tensor({1.0f, -2.0f, 0.5f});
  ScalerRun run;
  for (int step = 0; step < steps; ++step) {
    at::Tensor before = w.detach().clone();
    at::Tensor loss = (w * x).sum();
    precision.pre_backward(loss).backward();
    EXPECT_TRUE(at::allclose(w.grad(), x * precision.scale())) << "the backward ran on the scaled loss";
    if (inf_steps.count(step)) {
      torch::NoGradGuard no_grad;
      w.mutable_grad()[1] = std::numeric_limits<double>::infinity();
    }
    bool stepped = precision.optimizer_step(optimizer, strategy);
    optimizer.zero_grad();
    run.stepped.push_back(stepped);
    run.scales.push_back(precision.scale());
    if (stepped) EXPECT_TRUE(at::allclose(w.detach(), before - 0.1 * x)) << "step " << step;
    else EXPECT_TRUE(at::equal(w.detach(), before)) << "step " << step << " must leave the parameter untouched";
  }
  return run;
}

TEST(GradScaler, SkipsExactlyTheInfStepsAndGrowsOrBacksOffPerSettings) {
  core::PrecisionBase precision(
      options(precision_key("bf16-mixed") +
              "scaler = true\ninit_scale = 1024.0\ngrowth_interval = 2\ngrowth_factor = 4.0\nbackoff_factor = 0.25\n"),
      false);
  ScalerRun run = run_scaler(precision, {1, 4}, 7);
  EXPECT_EQ(run.stepped, (std::vector<bool>{true, false, true, true, false, true, true}));
  EXPECT_EQ(run.scales, (std::vector<double>{1024, 256, 256, 1024, 256, 256, 1024}));
}

TEST(GradScaler, UnscalesOncePerStepSoClippingSeesTrueGradients) {
  core::PrecisionBase precision(options(precision_key("bf16-mixed") + "scaler = true\ninit_scale = 64.0\n"), false);
  LocalStrategy strategy;
  at::Tensor w = at::ones({2}).requires_grad_();
  torch::optim::SGD optimizer({w}, torch::optim::SGDOptions(0.1));
  precision.pre_backward((w * at::tensor({3.0f, 4.0f})).sum()).backward();
  precision.unscale_gradients(optimizer, strategy);
  precision.unscale_gradients(optimizer, strategy);
  EXPECT_TRUE(at::allclose(w.grad(), at::tensor({3.0f, 4.0f})));
  EXPECT_TRUE(precision.optimizer_step(optimizer, strategy));
  EXPECT_TRUE(at::allclose(w.detach(), at::tensor({0.7f, 0.6f})));
}

TEST(GradScaler, StateSurvivesACheckpointFile) {
  const std::string settings = precision_key("bf16-mixed") + "scaler = true\ninit_scale = 512.0\ngrowth_interval = 3\n";
  core::PrecisionBase precision(options(settings), false);
  run_scaler(precision, {0}, 3);  // scale 256, two good steps since
  sdk::Checkpoint state = precision.state_dict();
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    EXPECT_TRUE(state.contains(key)) << key << " (PyTorch GradScaler.state_dict keys)";
  const std::string path = ::testing::TempDir() + "tessera-scaler-" + std::to_string(::getpid()) + ".ckpt";
  sdk::Checkpoint checkpoint = sdk::make_checkpoint();
  checkpoint.insert("precision_plugin", state);
  core::save_pickle(checkpoint, path);
  sdk::Checkpoint loaded = core::checkpoint_dict(core::load_pickle(path), path);
  std::remove(path.c_str());

  core::PrecisionBase resumed(options(settings), false);
  resumed.load_state_dict(core::checkpoint_dict(loaded.at("precision_plugin"), "precision_plugin"));
  EXPECT_EQ(resumed.scale(), 256.0);
  EXPECT_EQ(resumed.growth_tracker(), 2);
  // Both continue identically: the next good step grows the scale in each.
  ScalerRun a = run_scaler(precision, {}, 1), b = run_scaler(resumed, {}, 1);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(b.scales[0], 512.0);

  std::string message = error_of([&] { resumed.load_state_dict(sdk::make_checkpoint()); });
  EXPECT_NE(message.find("has no grad scaler 'scale'"), std::string::npos) << message;
  core::PrecisionBase scalerless(options(precision_key("bf16-mixed")), false);
  EXPECT_NO_THROW(scalerless.load_state_dict(state));
  EXPECT_EQ(scalerless.scale(), 1.0);
}

TEST(GradScaler, CudaGradientsUseTheFusedUnscaleAndStillSkipOnInf) {
  if (!at::hasCUDA()) GTEST_SKIP() << "SKIPPED: no CUDA device (the fused unscale kernel is CUDA-only here)";
  core::PrecisionBase precision(options(precision_key("16-mixed") + "init_scale = 8.0\n"), false);
  precision.check_device(c10::Device(c10::kCUDA, 0));
  LocalStrategy strategy;
  const auto cuda = at::TensorOptions().device(c10::Device(c10::kCUDA, 0));
  at::Tensor a = at::ones({3}, cuda).requires_grad_(), b = at::ones({2}, cuda.dtype(at::kHalf)).requires_grad_();
  torch::optim::SGD optimizer({a, b}, torch::optim::SGDOptions(0.5));
  a.mutable_grad() = at::full({3}, 8.0, cuda);
  b.mutable_grad() = at::full({2}, 16.0, cuda.dtype(at::kHalf));
  precision.unscale_gradients(optimizer, strategy);
  EXPECT_TRUE(at::allclose(a.grad().cpu(), at::ones({3})));
  EXPECT_TRUE(at::allclose(b.grad().cpu().to(at::kFloat), at::full({2}, 2.0)));
  EXPECT_TRUE(precision.optimizer_step(optimizer, strategy));
  EXPECT_TRUE(at::allclose(a.detach().cpu(), at::full({3}, 0.5)));
  a.mutable_grad() = at::full({3}, 8.0, cuda);
  b.mutable_grad() = at::full({2}, std::numeric_limits<double>::infinity(), cuda.dtype(at::kHalf));
  EXPECT_FALSE(precision.optimizer_step(optimizer, strategy));
  EXPECT_TRUE(at::allclose(a.detach().cpu(), at::full({3}, 0.5))) << "skipped: untouched";
  EXPECT_EQ(precision.scale(), 4.0);
}

TEST(OptimizerStep, AdamEpsThatIsZeroInFloat16IsRefusedUnder16True) {
  core::PrecisionBase precision(options(precision_key("16-true")), false);
  LocalStrategy strategy;
  at::Tensor w = at::ones({2}, at::kHalf).requires_grad_();
  w.mutable_grad() = at::ones({2}, at::kHalf);
  torch::optim::AdamW tiny_eps({w}, torch::optim::AdamWOptions(0.1).eps(1e-8));
  std::string message = error_of([&] { precision.optimizer_step(tiny_eps, strategy); });
  EXPECT_NE(message.find("[optimizer] eps = 1e-08 is 0 in float16"), std::string::npos) << message;
  EXPECT_TRUE(at::equal(w.detach(), at::ones({2}, at::kHalf))) << "nothing was stepped";
  core::PrecisionBase fine(options(precision_key("16-true")), false);
  torch::optim::AdamW big_eps({w}, torch::optim::AdamWOptions(0.1).eps(1e-4));
  try {
    fine.optimizer_step(big_eps, strategy);
  } catch (const sdk::Error& e) {
    ADD_FAILURE() << "eps = 1e-4 was refused: " << e.what();
  } catch (const c10::Error&) {
    // Past the check: LibTorch 1.13 has no CPU fp16 AdamW kernel (CUDA does).
  }
}

}  // namespace
