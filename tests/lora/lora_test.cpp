// LoRA (issue 62 part 4) against PEFT's math and names. lora_reference.py writes a random Hugging
// Face Llama (q/k/v/o biases, GQA), a PEFT adapter on all seven of its Linear modules, and what
// PEFT's LoRA computes on fixed rows: Tessera's llama with [model.lora] must give the same loss and
// adapter gradients (1e-5), keep every base parameter frozen, and merge to the same weights.
// Deferred init draws the eager build's adapters; the [model.lora] refusals name the key and the
// valid names. Through the binary: a LoRA run from the Hugging Face base folder trains alike under
// single_device, ddp and fsdp2 on the same global batch (only the adapters move or hold optimizer
// state), fsdp's answer for frozen and trained parameters in one unit, a bitwise resume, and the
// `--format peft` folder merged in Python equal to `--format hf`'s merged export.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "multiprocess.hpp"
#include "plugin_loader.hpp"
#include "sanitizers.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/toml_options.hpp"
#include "tessera/toolkit/lora.hpp"

namespace {

namespace fs = std::filesystem;
namespace sdk = tessera::sdk;
using tessera::core::PluginLoader;
using tessera::testing::run_command;
using tessera::testing::run_tessera;
using Tensors = std::map<std::string, at::Tensor>;

const std::string kReference = "/usr/bin/python3 " TESSERA_SOURCE_DIR "/tests/lora/lora_reference.py";
const std::string kPeftPrefix = "base_model.model.";

PluginLoader& loader() {
  static PluginLoader instance({tessera::testing::plugin_dir()});
  return instance;
}

std::shared_ptr<sdk::Module> make_model(const std::string& plugin, const std::string& toml_text) {
  sdk::Options options = sdk::make_options("model", "test.toml", toml::parse(toml_text));
  auto model = loader().create_as<sdk::Module>(sdk::PluginKind::model, plugin, options);
  options.check_all_used();
  model->configure_model();
  return model;
}

/// The message of what `make` throws ("" if nothing).
template <typename F>
std::string error_of(F&& make) {
  try {
    make();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

/// lora_reference.py's folders, written once per test binary run.
const std::string& reference_dir() {
  static const std::string dir = [] {
    const std::string out = tessera::testing::fresh_dir("lora-reference");
    const auto r = run_command(kReference + " reference " + out + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return out;
  }();
  return dir;
}

Tensors read_tensors(const std::string& path) {
  Tensors out;
  auto checkpoint = tessera::core::load_checkpoint_file(path);
  for (const auto& item : checkpoint.at("state_dict").toGenericDict())
    out[item.key().toStringRef()] = item.value().toTensor().clone();
  return out;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

const std::string kLoraTable = "[lora]\nr = 4\nalpha = 8\ntarget_modules = \"all-linear\"\n";

/// The reference's llama with LoRA on every Linear, holding the base's and the adapter's weights.
std::shared_ptr<sdk::Module> reference_model() {
  const std::string dir = reference_dir();
  auto model = make_model("llama", "config = \"" + dir + "/base/config.json\"\n" + kLoraTable);
  torch::NoGradGuard no_grad;
  auto params = model->network()->named_parameters();
  std::size_t loaded = 0;
  for (const auto& [name, t] : read_tensors(dir + "/base/model.safetensors")) {
    EXPECT_TRUE(params.contains(name)) << name;
    params[name].copy_(t);
    ++loaded;
  }
  for (const auto& [name, t] : read_tensors(dir + "/adapter/adapter_model.safetensors")) {
    EXPECT_EQ(name.rfind(kPeftPrefix, 0), 0u) << name;
    const std::string own = name.substr(kPeftPrefix.size());  // PEFT's names, less PeftModel's prefix
    EXPECT_TRUE(params.contains(own)) << own;
    params[own].copy_(t);
    ++loaded;
  }
  EXPECT_EQ(loaded, params.size()) << "every parameter is the base's or the adapter's";
  return model;
}

TEST(LoraReference, LossAndAdapterGradientsEqualPeft) {
  const Tensors expected = read_tensors(reference_dir() + "/expected.safetensors");
  auto model = reference_model();
  auto out = model->training_step(sdk::Batch{expected.at("input_ids"), expected.at("labels")}, 0);
  EXPECT_NEAR(out.loss.item<double>(), expected.at("loss").item<double>(), 1e-5);
  out.loss.backward();
  std::size_t adapters = 0;
  for (const auto& item : model->network()->named_parameters()) {
    const std::string& name = item.key();
    if (!tessera::toolkit::is_lora_parameter(name)) {
      EXPECT_FALSE(item.value().requires_grad()) << name << ": the base is frozen";
      EXPECT_FALSE(item.value().grad().defined()) << name;
      continue;
    }
    ++adapters;
    ASSERT_TRUE(item.value().requires_grad()) << name;
    const at::Tensor& want = expected.at("grad." + name);
    ASSERT_TRUE(item.value().grad().defined()) << name;
    EXPECT_LE(max_diff(item.value().grad(), want), 1e-5 * std::max(1.0, want.abs().max().item<double>()))
        << "gradient of " << name;
  }
  EXPECT_EQ(adapters, 2u * 7u * 2u) << "A and B of 7 modules in 2 layers";
}

TEST(LoraReference, MergedWeightsEqualPeftsMerge) {
  const Tensors expected = read_tensors(reference_dir() + "/expected.safetensors");
  auto model = reference_model();
  std::size_t merged = 0;
  for (const auto& item : model->network()->named_modules("", /*include_self=*/false)) {
    const auto* lora = dynamic_cast<const tessera::toolkit::LoraLinearImpl*>(item.value().get());
    if (lora == nullptr) continue;
    const at::Tensor& want = expected.at("merged." + item.key() + ".weight");
    EXPECT_LE(max_diff(lora->merged_weight(), want), 1e-6) << item.key();
    ++merged;
  }
  EXPECT_EQ(merged, 14u);
}

// PEFT's initialisation (lora_A U(-1/sqrt(in), 1/sqrt(in)), lora_B zeros), and a deferred build
// (each module's parameters drawn by the model's init_parameters, as fsdp/fsdp2 call it) holding
// the eager build's values, for the llama and the gpt.
TEST(LoraInit, DeferredInitDrawsTheEagerAdapters) {
  for (const auto& [plugin, toml] : std::vector<std::pair<std::string, std::string>>{
           {"llama", "config = \"" + reference_dir() + "/base/config.json\"\n" + kLoraTable},
           {"gpt", "n_layer = 2\nn_head = 2\nn_embd = 16\nblock_size = 8\n[lora]\nr = 2\n"
                   "target_modules = [\"attn\", \"proj\", \"fc\", \"fc_proj\"]\n"}}) {
    SCOPED_TRACE(plugin);
    auto model = make_model(plugin, toml);
    Tensors eager;
    std::size_t adapters = 0;
    for (const auto& item : model->network()->named_parameters()) {
      eager[item.key()] = item.value().detach().clone();
      if (!tessera::toolkit::is_lora_parameter(item.key())) continue;
      ++adapters;
      const at::Tensor& w = item.value();
      if (item.key().find("lora_B") != std::string::npos) {
        EXPECT_EQ(w.abs().max().item<double>(), 0.0) << item.key();
      } else {
        const double bound = 1.0 / std::sqrt(static_cast<double>(w.size(1)));
        EXPECT_LE(w.abs().max().item<double>(), bound) << item.key();
        EXPECT_GT(w.std().item<double>(), bound / 3) << item.key() << ": drawn, not left at zero";
      }
    }
    EXPECT_GT(adapters, 0u);
    torch::NoGradGuard no_grad;
    for (const auto& item : model->network()->named_modules()) {
      if (item.value()->parameters(/*recurse=*/false).empty()) continue;
      for (auto& p : item.value()->parameters(/*recurse=*/false)) p.fill_(7.0);
      model->init_parameters(item.key(), *item.value());
    }
    for (const auto& item : model->network()->named_parameters())
      if (item.key().find("ln_") == std::string::npos)  // LayerNorms: reset by LibTorch's initialiser
        EXPECT_TRUE(item.value().equal(eager.at(item.key()))) << item.key() << " differs from the eager build";
  }
}

TEST(LoraConfig, RefusalsNameTheKeyAndTheValidNames) {
  const std::string llama = "config = \"" + reference_dir() + "/base/config.json\"\n";
  std::string e = error_of([&] { make_model("llama", llama + "[lora]\ntarget_modules = [\"q_proj\", \"qproj\"]\n"); });
  EXPECT_NE(e.find("[model.lora] target_modules: \"qproj\" names no Linear module of this model (did you mean "
                   "'q_proj'?); valid: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or \"all-linear\""),
            std::string::npos)
      << e;
  e = error_of([&] { make_model("gpt", "[lora]\ntarget_modules = \"q_proj\"\n"); });
  EXPECT_NE(e.find("\"q_proj\" names no Linear module of this model"), std::string::npos) << e;
  EXPECT_NE(e.find("valid: attn, proj, fc, fc_proj or \"all-linear\""), std::string::npos) << e;
  e = error_of([&] { make_model("llama", llama + "[lora]\nr = -2\n"); });
  EXPECT_NE(e.find("[model.lora] r"), std::string::npos) << e;
  // r turns LoRA on (0, the default, leaves it off): another key set without it is refused.
  e = error_of([&] { make_model("llama", llama + "[lora]\nalpha = 16\n"); });
  EXPECT_NE(e.find("[model.lora] r = 0 leaves LoRA off, but [model.lora] sets alpha: set r (PEFT's default is 8)"),
            std::string::npos) << e;
  e = error_of([&] { make_model("llama", llama + "[lora]\ndropout = 1.0\n"); });
  EXPECT_NE(e.find("[model.lora] dropout = 1 would drop every input of the adapters"), std::string::npos) << e;
  e = error_of([&] { make_model("llama", llama + "[lora]\nr = 4\ntarget_modules = []\n"); });
  EXPECT_NE(e.find("target_modules is empty: LoRA would train nothing"), std::string::npos) << e;
  e = error_of([&] { make_model("llama", llama + "[lora]\nrank = 4\n"); });
  EXPECT_NE(e.find("rank"), std::string::npos) << e;
  // Without r (the table absent, or listing only defaults): no adapter, nothing frozen; with r and
  // no target_modules: PEFT's q_proj, v_proj.
  for (const std::string& off : {std::string(), std::string("[lora]\nalpha = 8.0\ndropout = 0.0\n")}) {
    auto plain = make_model("llama", llama + off);
    for (const auto& item : plain->network()->named_parameters()) EXPECT_TRUE(item.value().requires_grad()) << item.key();
  }
  auto defaults = make_model("llama", llama + "[lora]\nr = 8\n");
  std::set<std::string> adapted;
  for (const auto& item : defaults->network()->named_parameters())
    if (tessera::toolkit::is_lora_parameter(item.key()))
      adapted.insert(item.key().substr(item.key().rfind('.', item.key().size() - 15) + 1));
  EXPECT_EQ(adapted, (std::set<std::string>{"q_proj.lora_A.weight", "q_proj.lora_B.weight", "v_proj.lora_A.weight",
                                            "v_proj.lora_B.weight"}));
}

// --- through the binary ------------------------------------------------------------------------

constexpr int kGlobalBatch = 4;  // global micro-batch, the same for 1 and 2 ranks

std::string run_config(const std::string& dir, int steps, const std::string& extra_model = "") {
  const std::string base = reference_dir() + "/base";
  const std::string path = dir + "/run.toml";
  std::ofstream(path) << "[trainer]\nmax_steps = " << steps << "\nlog_every_n_steps = 1\nseed = 7\n"
                      << "default_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                      << "init_from = \"" << base << "\"\n"
                      << "[optimizer]\nname = \"sgd\"\nlr = 0.5\nmomentum = 0.9\nschedule = \"constant\"\n"
                      << "[model]\nplugin = \"llama\"\nconfig = \"" << base << "/config.json\"\n" << extra_model
                      << "[model.lora]\nr = 4\nalpha = 8\ntarget_modules = \"all-linear\"\n"
                      << "[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n";
  return path;
}

struct FitRun {
  std::string dir, output;
  std::map<std::int64_t, double> losses;
  Tensors state;
};

FitRun fit(const std::string& name, int world, const std::string& sets, int steps = 4) {
  FitRun run;
  run.dir = tessera::testing::fresh_dir("lora-" + name);
  const auto r = run_tessera("fit --config " + run_config(run.dir, steps) + " --set launch.devices=" +
                                 std::to_string(world) + " --set data.batch_size=" + std::to_string(kGlobalBatch / world) +
                                 " " + sets + " 2>&1",
                             "", 240);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  run.output = r.output;
  if (r.exit_code != 0) return run;
  const std::string folder = tessera::testing::run_dir(run.dir);
  run.losses = tessera::testing::metric_series(folder + "/metrics.csv", "train", "train_loss");
  run.state = tessera::testing::checkpoint_state(folder + "/checkpoints/last.ckpt");
  return run;
}

/// The single-device run, once per test process.
const FitRun& single_device() {
  static const FitRun run = fit("single", 1, "--set strategy.plugin=single_device");
  return run;
}

void expect_same(const FitRun& reference, const FitRun& run, const std::string& what, double tol) {
  ASSERT_EQ(reference.losses.size(), 4u) << what;
  ASSERT_EQ(run.losses.size(), reference.losses.size()) << what;
  for (const auto& [step, loss] : reference.losses)
    EXPECT_NEAR(run.losses.at(step), loss, tol * std::max(1.0, std::abs(loss))) << what << " step " << step;
  ASSERT_EQ(run.state.size(), reference.state.size()) << what;
  for (const auto& [name, tensor] : reference.state) {
    ASSERT_TRUE(run.state.count(name)) << what << ": missing " << name;
    EXPECT_TRUE(at::allclose(run.state.at(name), tensor, tol, tol))
        << what << ": " << name << " differs by " << (run.state.at(name) - tensor).abs().max().item<double>();
  }
}

/// The base's tensors bitwise as the folder holds them; every adapter moved (lora_B from zeros).
void expect_only_adapters_trained(const FitRun& run) {
  const Tensors base = read_tensors(reference_dir() + "/base/model.safetensors");
  std::size_t adapters = 0;
  for (const auto& [name, t] : run.state) {
    if (tessera::toolkit::is_lora_parameter(name)) {
      ++adapters;
      if (name.find("lora_B") != std::string::npos) EXPECT_GT(t.abs().max().item<double>(), 0.0) << name;
      continue;
    }
    ASSERT_TRUE(base.count(name)) << name;
    EXPECT_TRUE(t.equal(base.at(name))) << name << ": a frozen base tensor changed";
  }
  EXPECT_EQ(adapters, 28u);
  EXPECT_EQ(run.state.size(), base.size() + adapters);
}

/// The optimizer holds state for the adapters only (AdamW's moments / SGD's momentum buffers).
std::size_t optimizer_parameters(const std::string& checkpoint) {
  const auto file = tessera::core::load_checkpoint_file(checkpoint);
  const auto states = tessera::core::checkpoint_get(file, "optimizer_states").toListRef();
  const auto optimizer = states.at(0).toGenericDict();
  std::size_t params = 0;
  for (const auto& group : optimizer.at("param_groups").toListRef())
    params += group.toGenericDict().at("params").toListRef().size();
  return params;
}

TEST(LoraFit, SingleDeviceTrainsTheAdaptersOnly) {
  const FitRun& run = single_device();
  ASSERT_FALSE(run.state.empty()) << run.output;
  EXPECT_NE(run.output.find("the base of the LoRA model ([model.lora]); its adapters start from PEFT's"),
            std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("M trainable (the model froze the rest: LoRA's base)"), std::string::npos) << run.output;
  expect_only_adapters_trained(run);
  const std::string last = tessera::testing::run_dir(run.dir) + "/checkpoints/last.ckpt";
  EXPECT_EQ(optimizer_parameters(last), 28u);
  // The base's identity in hyper_parameters: the init_from folder and a digest of its files.
  const auto file = tessera::core::load_checkpoint_file(last);
  const auto h = tessera::core::checkpoint_get(file, "hyper_parameters").toGenericDict();
  EXPECT_EQ(h.at("lora_base_model_name_or_path").toStringRef(), fs::path(reference_dir() + "/base").lexically_normal().string());
  EXPECT_EQ(h.at("lora_base_hash").toStringRef().rfind("xxh64:", 0), 0u);
  EXPECT_EQ(h.at("lora_r").toInt(), 4);
  EXPECT_EQ(h.at("lora_target_modules").toStringRef(), "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj");
}

TEST(LoraFit, DDPMatchesSingleDevice) {
  const FitRun run = fit("ddp", 2, "--set strategy.plugin=ddp");
  expect_same(single_device(), run, "ddp x2", 2e-5);
  expect_only_adapters_trained(run);
}

TEST(LoraFit, FSDP2MatchesSingleDeviceAndShardsOnlyAdapterState) {
  const FitRun run = fit("fsdp2", 2, "--set strategy.plugin=fsdp2 --set strategy.deferred_init=true");
  expect_same(single_device(), run, "fsdp2 dp 2", 2e-5);
  expect_only_adapters_trained(run);
  EXPECT_EQ(optimizer_parameters(tessera::testing::run_dir(run.dir) + "/checkpoints/last.ckpt"), 28u);
}

// FSDP1: each LlamaDecoderLayer's flat parameter holds frozen base weights and trained adapters
// (as PyTorch's use_orig_params = True allows); the flat gradient is zero over the frozen part, and
// the unit's post-backward waits for its input gradient, which still needs the frozen weights.
TEST(LoraFit, FSDPFlatUnitsOfFrozenAndTrainedParametersMatchSingleDevice) {
  const FitRun run = fit("fsdp", 2, "--set strategy.plugin=fsdp --set strategy.activation_checkpointing=LlamaDecoderLayer");
  expect_same(single_device(), run, "fsdp x2", 2e-5);
  expect_only_adapters_trained(run);
  EXPECT_EQ(optimizer_parameters(tessera::testing::run_dir(run.dir) + "/checkpoints/last.ckpt"), 28u);
}

// The gpt's LoRA (its own Linear names) under fsdp2 equals one device too.
TEST(LoraFit, GPTUnderFSDP2MatchesSingleDevice) {
  auto gpt_fit = [](const std::string& name, int world, const std::string& sets) {
    FitRun run;
    run.dir = tessera::testing::fresh_dir("lora-gpt-" + name);
    std::ofstream(run.dir + "/run.toml")
        << "[trainer]\nmax_steps = 4\nlog_every_n_steps = 1\nseed = 7\ndefault_root_dir = \"" << run.dir
        << "\"\nenable_progress_bar = false\n[optimizer]\nname = \"sgd\"\nlr = 0.5\nmomentum = 0.9\n"
        << "schedule = \"constant\"\n[model]\nplugin = \"gpt\"\nn_layer = 2\nn_head = 3\nn_embd = 36\nblock_size = 16\n"
        << "[model.lora]\nr = 2\ntarget_modules = \"all-linear\"\n[data]\nplugin = \"text\"\nblock_size = 16\nstride = 61\n";
    const auto r = run_tessera("fit --config " + run.dir + "/run.toml --set launch.devices=" + std::to_string(world) +
                                   " --set data.batch_size=" + std::to_string(kGlobalBatch / world) + " " + sets + " 2>&1",
                               "", 240);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (r.exit_code != 0) return run;
    const std::string folder = tessera::testing::run_dir(run.dir);
    run.losses = tessera::testing::metric_series(folder + "/metrics.csv", "train", "train_loss");
    run.state = tessera::testing::checkpoint_state(folder + "/checkpoints/last.ckpt");
    return run;
  };
  const FitRun one = gpt_fit("single", 1, "--set strategy.plugin=single_device");
  const FitRun two = gpt_fit("fsdp2", 2, "--set strategy.plugin=fsdp2");
  expect_same(one, two, "gpt fsdp2 dp 2", 2e-5);
  std::size_t adapters = 0;
  for (const auto& [name, t] : one.state) adapters += tessera::toolkit::is_lora_parameter(name) ? 1 : 0;
  EXPECT_EQ(adapters, 2u * 4u * 2u) << "A and B of attn, proj, fc, fc_proj in 2 blocks";
}

// The adapters are not split over a tensor-parallel group: refused at setup, before any step.
TEST(LoraFit, TensorParallelIsRefusedBeforeAnyStep) {
  const std::string dir = tessera::testing::fresh_dir("lora-tp");
  const auto r = run_tessera("fit --config " + run_config(dir, 1) + " --set launch.devices=2 --set strategy.plugin=fsdp2 "
                             "--set strategy.tensor_parallel_size=2 --set data.batch_size=2 2>&1",
                             "", 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[model.lora] with tensor_parallel_size = 2: LoRA adapters are not split over a "
                          "tensor-parallel group yet"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("epoch 0 step 1"), std::string::npos) << r.output;
}

TEST(LoraFit, ResumeIsBitwise) {
  const FitRun& whole = single_device();
  const std::string dir = tessera::testing::fresh_dir("lora-resume");
  const std::string config = run_config(dir, 4);
  auto r = run_tessera("fit --config " + config + " --set trainer.max_steps=2 --set launch.devices=1 --set "
                       "strategy.plugin=single_device --set data.batch_size=4 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_tessera("fit --config " + config + " --ckpt-path last --set launch.devices=1 --set "
                  "strategy.plugin=single_device --set data.batch_size=4 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming at step 2"), std::string::npos) << r.output;
  const std::string last = tessera::testing::run_dir(dir) + "/checkpoints/last.ckpt";
  const Tensors resumed = tessera::testing::checkpoint_state(last);
  ASSERT_EQ(resumed.size(), whole.state.size());
  for (const auto& [name, t] : whole.state) EXPECT_TRUE(resumed.at(name).equal(t)) << name << " is not bitwise equal";
  const auto h = tessera::core::checkpoint_get(tessera::core::load_checkpoint_file(last), "hyper_parameters").toGenericDict();
  EXPECT_TRUE(h.contains("lora_base_hash")) << "a resumed run keeps its base's identity";
}

// init_from a PEFT folder: its base (base_model_name_or_path) and then its adapter; with lr 0 the
// checkpoint holds both as the folders do, bitwise. An adapter of another rank is refused first.
TEST(LoraFit, InitFromAPeftFolderContinuesItsAdapter) {
  const std::string dir = tessera::testing::fresh_dir("lora-from-peft");
  const std::string adapter = reference_dir() + "/adapter";
  const std::string sets = " --set trainer.init_from=" + adapter + " --set trainer.max_steps=1 --set optimizer.lr=0 "
                           "--set launch.devices=1 --set strategy.plugin=single_device --set data.batch_size=4 2>&1";
  const std::string config = run_config(dir, 1);
  auto r = run_tessera("fit --config " + config + " --set model.lora.r=8" + sets);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the adapter does not fit [model.lora]: r: the adapter's 4, [model.lora] 8"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir + "/version_0/checkpoints")) << "refused before any step";
  r = run_tessera("fit --config " + config + sets);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the PEFT adapter (r 4, lora_alpha 8.0) on its base"), std::string::npos) << r.output;
  const Tensors state = tessera::testing::checkpoint_state(tessera::testing::run_dir(dir) + "/checkpoints/last.ckpt");
  const Tensors base = read_tensors(reference_dir() + "/base/model.safetensors");
  const Tensors peft = read_tensors(adapter + "/adapter_model.safetensors");
  EXPECT_EQ(state.size(), base.size() + peft.size());
  for (const auto& [name, t] : base) EXPECT_TRUE(state.at(name).equal(t)) << name;
  for (const auto& [name, t] : peft) EXPECT_TRUE(state.at(name.substr(kPeftPrefix.size())).equal(t)) << name;
}

TEST(LoraExport, PeftFolderMergedInPythonEqualsTheMergedHfExport) {
  const FitRun& run = single_device();
  ASSERT_FALSE(run.state.empty());
  const std::string out = tessera::testing::fresh_dir("lora-export");
  auto r = run_tessera("checkpoint export " + run.dir + " --to " + out + "/peft --format peft 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("PEFT LoRA adapter: 28 tensors, r 4, lora_alpha 8"), std::string::npos) << r.output;
  r = run_tessera("checkpoint export " + run.dir + " --to " + out + "/hf --format hf 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("14 with their LoRA adapters merged"), std::string::npos) << r.output;

  std::ifstream in(out + "/peft/adapter_config.json");
  const auto config = nlohmann::json::parse(in);
  EXPECT_EQ(config.at("peft_type"), "LORA");
  EXPECT_EQ(config.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(config.at("bias"), "none");
  EXPECT_EQ(config.at("r"), 4);
  EXPECT_EQ(config.at("lora_alpha"), 8.0);
  EXPECT_EQ(config.at("lora_dropout"), 0.0);
  EXPECT_EQ(config.at("target_modules"), nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                         "down_proj"}));
  EXPECT_EQ(config.at("base_model_name_or_path"), fs::path(reference_dir() + "/base").lexically_normal().string());
  const Tensors adapter = read_tensors(out + "/peft/adapter_model.safetensors");
  EXPECT_EQ(adapter.size(), 28u);
  EXPECT_TRUE(adapter.count("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(adapter.count("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  for (const auto& [name, t] : adapter) EXPECT_TRUE(t.equal(run.state.at(name.substr(kPeftPrefix.size())))) << name;

  // The merged folder: the base's names only, and what PEFT's merge of the adapter into the base gives.
  const Tensors merged = read_tensors(out + "/hf/model.safetensors");
  for (const auto& [name, t] : merged) EXPECT_FALSE(tessera::toolkit::is_lora_parameter(name)) << name;
  r = run_command(kReference + " merge " + out + "/peft " + reference_dir() + "/base " + out + "/hf 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto report = nlohmann::json::parse(r.output);
  EXPECT_EQ(report.at("missing"), nlohmann::json::array()) << r.output;
  EXPECT_EQ(report.at("extra"), nlohmann::json::array()) << r.output;
  EXPECT_EQ(report.at("adapters"), 28);
  EXPECT_LE(report.at("max_diff").get<double>(), 1e-6) << r.output;

  // A run without LoRA has no adapter to export.
  r = run_tessera("checkpoint export " + out + "/hf/model.safetensors --to " + out + "/none --format peft 2>&1");
  EXPECT_NE(r.exit_code, 0) << r.output;
}

// Issue 62.4's memory goal: per rank the frozen base's shard, the adapters and activations, as
// `tessera plan` says within 15%: a 45M-parameter llama (vocab 32000, 4 layers of 512) with LoRA
// on every Linear under fsdp2 on 2 ranks, AdamW, 2 steps (planned ~589 MB, measured ~571 MB; the
// same run fully fine-tuned measures ~1,118 MB).
TEST(LoraMemory, PlanWithinFifteenPercentOfTheMeasuredPeak) {
  TESSERA_SKIP_IF_ADDRESS_SANITIZER();
  const std::string dir = tessera::testing::fresh_dir("lora-memory");
  std::ofstream(dir + "/run.toml")
      << "[trainer]\nmax_steps = 2\nlog_every_n_steps = 1\nnum_sanity_val_steps = 0\nlimit_val_batches = 0\n"
      << "seed = 1234\nenable_progress_bar = false\nsave_last = false\ndefault_root_dir = \"" << dir << "/runs\"\n"
      << "[optimizer]\nname = \"adamw\"\nlr = 1e-3\n[launch]\ndevices = 2\n[strategy]\nplugin = \"fsdp2\"\n"
      << "[model]\nplugin = \"llama\"\nvocab_size = 32000\nhidden_size = 512\nintermediate_size = 1376\n"
      << "num_hidden_layers = 4\nnum_attention_heads = 8\nnum_key_value_heads = 8\nmax_position_embeddings = 256\n"
      << "[model.lora]\nr = 8\nalpha = 16\ntarget_modules = \"all-linear\"\n"
      << "[data]\nplugin = \"text\"\nblock_size = 256\nbatch_size = 2\n";
  const auto plan = run_tessera("plan --json --config " + dir + "/run.toml 2>&1");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto json = nlohmann::json::parse(plan.output.substr(plan.output.find('{')));
  const double planned_mb = json.at("peak_rss_per_rank_bytes").get<double>() / 1048576.0;
  // 4 layers x 7 modules x r (in + out), halved over the 2 ranks: the adapters' gradients only.
  const double adapters = 4 * 8 * (4 * (512 + 512) + 2 * (512 + 1376) + (1376 + 512));
  EXPECT_EQ(json.at("per_rank_bytes").at("gradients").get<double>(), 4 * adapters / 2) << plan.output;
  const auto fit = run_tessera("fit --config " + dir + "/run.toml 2>&1", "", 300);
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  const auto peaks = tessera::testing::metric_series(tessera::testing::run_dir(dir + "/runs") + "/metrics.csv", "train",
                                                     "peak_rss_mb");
  ASSERT_FALSE(peaks.empty()) << fit.output;
  const double measured_mb = peaks.rbegin()->second;
  std::printf("[ plan ] LoRA fsdp2 x2: planned %.0f MB, measured %.0f MB (%+.1f%%)\n", planned_mb, measured_mb,
              100.0 * (planned_mb - measured_mb) / measured_mb);
  EXPECT_NEAR(planned_mb, measured_mb, 0.15 * measured_mb) << plan.output;
}

}  // namespace
