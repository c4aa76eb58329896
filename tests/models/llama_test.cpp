// The `llama` model against an independent implementation: llama_reference.py writes random
// Hugging Face checkpoints (GQA, tied and untied, llama3 rope scaling, attention and MLP biases,
// explicit head_dim, Qwen2, Qwen3 with and without attention biases, Mistral) with what Hugging
// Face's modeling code computes on them (a PyTorch transcription of modeling_llama.py and its
// Qwen2, Qwen3 and Mistral variants in the script). Tessera loads each config.json and
// model.safetensors under Hugging Face's own names, and its logits, loss, every gradient and
// its greedy tokens (KV cache) must equal the reference's, with each attention kernel. Also:
// the toolkit's causal attention (blocked vs math, forward and backward, GQA, KV-cache offsets),
// config.json refusals (sliding windows among them), the tensor-parallel size check and
// hf_config_json's round trip.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <limits>
#include <string>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "multiprocess.hpp"
#include "tessera/core/checkpoint.hpp"
#include "plugin_loader.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/toml_options.hpp"
#include "tessera/toolkit/attention.hpp"

namespace {

using tessera::core::PluginLoader;
namespace sdk = tessera::sdk;
namespace toolkit = tessera::toolkit;
using Tensors = std::map<std::string, at::Tensor>;

PluginLoader& loader() {
  static PluginLoader instance({tessera::testing::plugin_dir()});
  return instance;
}

std::shared_ptr<sdk::Module> make_model(const std::string& toml_text) {
  sdk::Options options = sdk::make_options("model", "test.toml", toml::parse(toml_text));
  auto model = loader().create_as<sdk::Module>(sdk::PluginKind::model, "llama", options);
  options.check_all_used();
  model->configure_model();
  return model;
}

/// The reference checkpoints, written once per test binary run.
const std::string& reference_dir() {
  static const std::string dir = [] {
    const std::string out = tessera::testing::fresh_dir("llama-reference");
    const auto r = tessera::testing::run_command("/usr/bin/python3 " TESSERA_SOURCE_DIR
                                                 "/tests/models/llama_reference.py " + out + " 2>&1");
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

/// Copies the Hugging Face state dict into the network: every name must exist on both sides.
void load_hf_weights(torch::nn::Module& net, const Tensors& weights) {
  torch::NoGradGuard no_grad;
  auto params = net.named_parameters();
  ASSERT_EQ(params.size(), weights.size()) << "the network's parameters are not the checkpoint's";
  for (const auto& [name, tensor] : weights) {
    ASSERT_TRUE(params.contains(name)) << "no parameter named " << name;
    ASSERT_EQ(params[name].sizes(), tensor.sizes()) << name;
    params[name].copy_(tensor);
  }
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

const char* const kConfigs[] = {"gqa_untied", "tied_llama3", "bias_head_dim", "qwen2",
                                "qwen3",      "qwen3_bias",  "mistral"};

/// One configuration with one attention kernel: logits, loss, gradients and greedy tokens.
void check_against_reference(const std::string& name, const std::string& extra) {
  SCOPED_TRACE(name + " " + extra);
  const std::string dir = reference_dir() + "/" + name;
  const Tensors expected = read_tensors(dir + "/expected.safetensors");
  auto scorer = make_model("config = \"" + dir + "/config.json\"\npredict = \"logits\"\n" + extra);
  load_hf_weights(*scorer->network(), read_tensors(dir + "/model.safetensors"));
  const at::Tensor ids = expected.at("input_ids"), labels = expected.at("labels");
  const at::Tensor logits = scorer->predict_step(sdk::Batch{ids, {}}, 0);
  EXPECT_EQ(logits.sizes(), expected.at("logits").sizes());
  EXPECT_LE(max_diff(logits, expected.at("logits")), 1e-5);

  auto out = scorer->training_step(sdk::Batch{ids, labels}, 0);
  EXPECT_NEAR(out.loss.item<double>(), expected.at("loss").item<double>(), 1e-5);
  out.loss.backward();
  std::size_t grads = 0;
  for (const auto& item : scorer->network()->named_parameters()) {
    const at::Tensor& want = expected.at("grad." + item.key());
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_LE(max_diff(item.value().grad(), want), 1e-5 * std::max(1.0, want.abs().max().item<double>()))
        << "gradient of " << item.key();
    ++grads;
  }
  EXPECT_EQ(grads, scorer->network()->named_parameters().size());

  auto generator = make_model("config = \"" + dir + "/config.json\"\nmax_new_tokens = 8\ntemperature = 0\n" + extra);
  load_hf_weights(*generator->network(), read_tensors(dir + "/model.safetensors"));
  const at::Tensor tokens = generator->predict_step(sdk::Batch{expected.at("prompt"), {}}, 0);
  EXPECT_TRUE(tokens.equal(expected.at("greedy"))) << tokens << "\nexpected\n" << expected.at("greedy");
}

TEST(LlamaReference, EqualsHuggingFaceModelingCode) {
  for (const char* name : kConfigs) check_against_reference(name, "");
}

// The toolkit's fused RMSNorm (with the residual add), rotary embedding and SwiGLU: the same
// logits, loss, gradients and greedy tokens as Hugging Face's chains of ops.
TEST(LlamaReference, EqualsWithTheFusedKernels) {
  for (const char* name : kConfigs)
    check_against_reference(name, "fused_rms_norm = true\nfused_rotary = true\nfused_swiglu = true\n");
}

TEST(LlamaReference, EqualsWithTheMathAndBlockedKernels) {
  // 13 positions in query blocks of 4: four blocks, the last one partial.
  for (const char* name : {"gqa_untied", "bias_head_dim", "qwen3"}) {
    check_against_reference(name, "attention = \"math\"\n");
    check_against_reference(name, "attention = \"blocked\"\nattention_query_block = 4\n");
  }
}

// `tessera predict` from the Python-written checkpoint (init_from its model.safetensors): the
// KV-cache decoder under each strategy gives Hugging Face's greedy tokens for the prompt "Q: ".
TEST(LlamaPredict, GreedyTokensUnderEveryStrategy) {
  const std::string ref = reference_dir() + "/gqa_untied";
  const at::Tensor want = read_tensors(ref + "/expected.safetensors").at("greedy_text");
  const std::vector<std::pair<std::string, std::string>> strategies{
      {"single_device", "--set strategy.plugin=single_device"},
      {"ddp-2", "--set launch.devices=2 --set strategy.plugin=ddp"},
      {"fsdp-2", "--set launch.devices=2 --set strategy.plugin=fsdp"},
      {"fsdp2-tp2", "--set launch.devices=2 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2"}};
  for (const auto& [label, sets] : strategies) {
    SCOPED_TRACE(label);
    const std::string dir = tessera::testing::fresh_dir("llama-predict-" + label);
    std::ofstream(dir + "/run.toml") << "[trainer]\ndefault_root_dir = \"" << dir << "\"\nenable_progress_bar = false\n"
                                     << "init_from = \"" << ref << "/model.safetensors\"\n"
                                     << "predict_output = \"" << dir << "/predictions.pt\"\n"
                                     << "[model]\nplugin = \"llama\"\nconfig = \"" << ref << "/config.json\"\n"
                                     << "max_new_tokens = 8\ntemperature = 0\n"
                                     << "[data]\nplugin = \"text\"\nprompt = \"Q: \"\n";
    const auto r = tessera::testing::run_tessera("predict --config " + dir + "/run.toml " + sets, "", 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::string path = dir + "/predictions.pt";  // {"predictions", "indices"}: a plain pickle, no checkpoint
    const auto file = tessera::core::checkpoint_dict(tessera::core::load_pickle(path), path);
    const at::Tensor got = tessera::core::checkpoint_get(file, "predictions").toTensor();
    EXPECT_TRUE(got.equal(want)) << got << "\nexpected\n" << want;
  }
}

TEST(LlamaReference, HuggingFaceNamesAndTiedHead) {
  auto tied = make_model("config = \"" + reference_dir() + "/tied_llama3/config.json\"\n");
  auto names = tied->network()->named_parameters().keys();
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.1.self_attn.q_proj.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "model.layers.0.post_attention_layernorm.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "model.norm.weight"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "lm_head.weight"), names.end()) << "tied: one parameter";
  auto untied = make_model("config = \"" + reference_dir() + "/tied_llama3/config.json\"\ntie_word_embeddings = false\n");
  names = untied->network()->named_parameters().keys();
  EXPECT_NE(std::find(names.begin(), names.end(), "lm_head.weight"), names.end()) << "the TOML key overrides config.json";
}

TEST(LlamaConfig, HfConfigJsonRoundTrips) {
  for (const char* name : kConfigs) {
    auto model = make_model("config = \"" + reference_dir() + "/" + name + "/config.json\"\n");
    auto* hf = dynamic_cast<sdk::HuggingFaceModel*>(model.get());
    ASSERT_NE(hf, nullptr);
    const std::string text = hf->hf_config_json();
    const auto written = nlohmann::json::parse(text);
    std::ifstream in(reference_dir() + "/" + name + "/config.json");
    const auto original = nlohmann::json::parse(in);
    for (const char* key : {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "attention_bias",
                            "rms_norm_eps", "rope_theta", "eos_token_id", "pad_token_id", "architectures"})
      EXPECT_EQ(written.at(key), original.at(key)) << name << " " << key;
    for (const char* key : {"head_dim", "sliding_window", "use_sliding_window", "max_window_layers"})
      if (original.contains(key)) EXPECT_EQ(written.at(key), original.at(key)) << name << " " << key;
    if (std::string(name) == "qwen3_bias") EXPECT_EQ(written.at("head_dim"), 128) << "Qwen3Config's default";
    if (!original.at("rope_scaling").is_null())
      for (const auto& [key, value] : original.at("rope_scaling").items())
        EXPECT_EQ(written.at("rope_scaling").at(key), value) << name << " rope_scaling." << key;
    // config.json written by the model builds the same model again
    const std::string again = tessera::testing::fresh_dir(std::string("llama-config-") + name) + "/config.json";
    std::ofstream(again) << text;
    auto rebuilt = make_model("config = \"" + again + "\"\n");
    EXPECT_EQ(dynamic_cast<sdk::HuggingFaceModel*>(rebuilt.get())->hf_config_json(), text);
  }
}

std::string error_of(const std::string& toml_text) {
  try {
    make_model(toml_text);
  } catch (const sdk::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(LlamaConfig, RefusalsNameWhatIsSupported) {
  const std::string dir = tessera::testing::fresh_dir("llama-refusals");
  std::ofstream(dir + "/gemma.json") << R"({"model_type": "gemma", "hidden_size": 16})";
  std::string e = error_of("config = \"" + dir + "/gemma.json\"\n");
  EXPECT_NE(e.find("model_type \"gemma\" is not supported; supported: \"llama\" (LlamaForCausalLM), \"qwen2\" "
                   "(Qwen2ForCausalLM: q/k/v biases), \"qwen3\" (Qwen3ForCausalLM: q/k RMSNorm per head), \"mistral\" "
                   "(MistralForCausalLM: no biases)"),
            std::string::npos) << e;
  std::ofstream(dir + "/yarn.json")
      << R"({"model_type": "llama", "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "vocab_size": 8, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})";
  e = error_of("config = \"" + dir + "/yarn.json\"\n");
  EXPECT_NE(e.find("rope_scaling type \"yarn\" is not supported; supported: \"default\", \"linear\", \"llama3\""),
            std::string::npos) << e;
  e = error_of("hidden_size = 16\nintermediate_size = 8\nnum_hidden_layers = 1\nnum_attention_heads = 4\n"
               "num_key_value_heads = 3\nvocab_size = 8\n");
  EXPECT_NE(e.find("num_key_value_heads = 3 must divide num_attention_heads = 4"), std::string::npos) << e;
  e = error_of("hidden_size = 16\nintermediate_size = 8\nnum_hidden_layers = 1\nnum_attention_heads = 2\n"
               "vocab_size = 8\nrope_scaling = { rope_type = \"llama3\", factor = 8.0 }\n");
  EXPECT_NE(e.find("needs low_freq_factor"), std::string::npos) << e;
  e = error_of("config = \"" + dir + "/none.json\"\n");
  EXPECT_NE(e.find("none.json\": cannot read it"), std::string::npos) << e;
  e = error_of("hidden_size = 16\nintermediate_size = 8\nnum_hidden_layers = 1\nnum_attention_heads = 2\n"
               "vocab_size = 8\nhidden_act = \"gelu\"\n");
  EXPECT_NE(e.find("hidden_act = \"gelu\" is not supported; supported: \"silu\""), std::string::npos) << e;
}

// Issue 60.2: no attention kernel here slides a window. Mistral's sliding_window is refused unless
// no position can leave it (null, or at least max_position_embeddings, which [data] block_size may
// not exceed, and predict refuses a position past it); Qwen's use_sliding_window = true is
// refused; biases a model type does not have are refused. Each message names the key, where it
// was set (config.json, [model], or the config class's default) and what is valid.
TEST(LlamaConfig, SlidingWindowRefusedUnlessNoPositionLeavesIt) {
  const std::string dir = tessera::testing::fresh_dir("llama-sliding-window");
  auto write = [&](const std::string& name, const std::string& keys) {
    const std::string path = dir + "/" + name + ".json";
    std::ofstream(path) << R"({"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, )" << keys << "}";
    return path;
  };
  const auto npos = std::string::npos;
  const std::string mistral = write("mistral", R"("model_type": "mistral", "sliding_window": 32)");
  const std::string refused = " is not supported: sliding-window attention is not implemented; valid: null or 0 (no "
                              "window; config.json's \"sliding_window\": null, as Mistral v0.2 and later), or a window "
                              "of at least max_position_embeddings = 64, which no position leaves";
  std::string e = error_of("config = \"" + mistral + "\"\n");
  EXPECT_NE(e.find("\"" + mistral + "\": sliding_window = 32" + refused), npos) << e;
  e = error_of("config = \"" + mistral + "\"\nsliding_window = 48\n");
  EXPECT_NE(e.find("test.toml:2: [model] sliding_window = 48" + refused), npos) << e;
  // Neither says: MistralConfig's 4096, against its max_position_embeddings of 131072.
  e = error_of("model_type = \"mistral\"\nvocab_size = 64\nhidden_size = 16\nintermediate_size = 32\n"
               "num_hidden_layers = 1\nnum_attention_heads = 8\n");
  EXPECT_NE(e.find("test.toml: [model] sliding_window = 4096 is not supported"), npos) << e;
  EXPECT_NE(e.find("max_position_embeddings = 131072"), npos) << e;
  e = error_of("config = \"" + mistral + "\"\nsliding_window = 64\nattention_bias = true\n");
  EXPECT_NE(e.find("[model] attention_bias = true is not supported: MistralForCausalLM has no attention biases; "
                   "valid: false"), npos) << e;

  // A window of max_position_embeddings is accepted: 57 prompt tokens and 8 generated need
  // positions 0 to 63; one more prompt token would reach position 64, which is refused.
  auto generator =
      make_model("config = \"" + mistral + "\"\nsliding_window = 64\nmax_new_tokens = 8\ntemperature = 0\n");
  EXPECT_EQ(generator->predict_step(sdk::Batch{at::ones({1, 57}, at::kLong), {}}, 0).size(1), 65);
  try {
    generator->predict_step(sdk::Batch{at::ones({1, 58}, at::kLong), {}}, 0);
    ADD_FAILURE() << "position 64 attended to a window of 64";
  } catch (const sdk::Error& error) {
    EXPECT_NE(std::string(error.what()).find("llama: position 64 is outside sliding_window = 64 (MistralForCausalLM)"),
              npos) << error.what();
  }

  const std::string qwen3 =
      write("qwen3", R"("model_type": "qwen3", "head_dim": 8, "use_sliding_window": true, "sliding_window": 16)");
  e = error_of("config = \"" + qwen3 + "\"\n");
  EXPECT_NE(e.find("\"" + qwen3 + "\": use_sliding_window = true is not supported (no attention kernel here slides a "
                   "window); supported: false"), npos) << e;
  // use_sliding_window = false (Qwen3's default) beside a window: accepted, the window unused.
  EXPECT_NE(make_model("config = \"" + qwen3 + "\"\nuse_sliding_window = false\n"), nullptr);
  e = error_of("config = \"" + qwen3 + "\"\nuse_sliding_window = false\nmlp_bias = true\n");
  EXPECT_NE(e.find("[model] mlp_bias = true is not supported: Qwen3ForCausalLM's MLP has no biases; valid: false"),
            npos) << e;
  // A Llama has no window; 0 says none where null cannot be written (a [model] table).
  const std::string llama = "vocab_size = 64\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\n"
                            "num_attention_heads = 2\n";
  e = error_of(llama + "sliding_window = 16\n");
  EXPECT_NE(e.find("test.toml:6: [model] sliding_window = 16 is not supported: LlamaForCausalLM has no sliding window; "
                   "valid: 0 or null (none)"), npos) << e;
  EXPECT_NE(make_model(llama + "sliding_window = 0\n"), nullptr);
  e = error_of("config = \"" + mistral + "\"\nsliding_window = -1\n");
  EXPECT_NE(e.find("test.toml:2: [model] sliding_window = -1 is out of range; valid: an integer >= 0"), npos) << e;
  auto unwindowed = make_model("config = \"" + mistral + "\"\nsliding_window = 0\n");
  EXPECT_TRUE(nlohmann::json::parse(dynamic_cast<sdk::HuggingFaceModel*>(unwindowed.get())->hf_config_json())
                  .at("sliding_window").is_null()) << "0 is written back as null";

  // Through the binary: fit refuses config.json's window before any rank starts.
  std::ofstream(dir + "/run.toml") << "[trainer]\ndefault_root_dir = \"" << dir << "\"\nmax_steps = 1\n"
                                   << "[model]\nplugin = \"llama\"\nconfig = \"" << mistral << "\"\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 8\n";
  const auto r = tessera::testing::run_tessera("fit --config " + dir + "/run.toml", "", 60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("\"" + mistral + "\": sliding_window = 32" + refused), npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/version_0")) << "a run started: " << r.output;
}

// Issue 59.1-2: one range check serves a config.json key and its TOML twin (the same message
// after where the value came from); each refusal names the key and what is valid.
TEST(LlamaConfig, ConfigJsonAndTomlShareOneRangeCheck) {
  const std::string dir = tessera::testing::fresh_dir("llama-ranges");
  const nlohmann::json base = nlohmann::json::parse(
      R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})");
  struct Case {
    std::string key, value, expected;  // value as JSON; expected after "<where> key"
    bool toml_twin = true;             // the same value in TOML (JSON-only syntax: no)
  };
  const std::vector<Case> cases{
      {"num_attention_heads", "0", " = 0 is out of range; valid: an integer >= 1"},
      {"num_hidden_layers", "0", " = 0 is out of range; valid: an integer >= 1"},
      {"hidden_size", "-64", " = -64 is out of range; valid: an integer >= 1"},
      {"vocab_size", "0", " = 0 is out of range; valid: an integer >= 1"},
      {"intermediate_size", "0", " = 0 is out of range; valid: an integer >= 1"},
      {"num_key_value_heads", "3", " = 3 is out of range; valid: an integer from 1 to 2"},
      {"hidden_size", "64.5", " = 64.5 is not an integer; valid: an integer >= 1", false},
      {"vocab_size", "1e12", " = 1000000000000.0 is not an integer; valid: an integer >= 1", false},
      {"vocab_size", "1000000000000",
       " = 1000000000000 with hidden_size = 16 makes model.embed_tokens.weight [1000000000000, 16]: 64000000000000 "
       "bytes in fp32, more than this machine's memory"},
      {"rope_theta", "-5", " = -5 is out of range; valid: a finite number > 0"},
      {"rms_norm_eps", "-1", " = -1 is out of range; valid: a finite number > 0"},
      {"rms_norm_eps", "0", " = 0 is out of range; valid: a finite number > 0"},
      {"eos_token_id", "256", " = 256 is not a token id; valid: an integer from 0 to 255 (below vocab_size = 256)"},
      {"bos_token_id", "-1", " = -1 is not a token id; valid: an integer from 0 to 255"},
      {"eos_token_id", "[1, 300]", " = 300 is not a token id; valid: an integer from 0 to 255", false},
      {"rope_scaling", R"({"rope_type": "linear", "factor": -1})",
       ": rope_scaling factor = -1 is out of range; valid: a finite number > 0", false},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.key + " = " + c.value);
    nlohmann::json config = base;
    config[c.key] = nlohmann::json::parse(c.value);
    const std::string path = dir + "/config" + std::to_string(i) + ".json";
    std::ofstream(path) << config.dump();
    const std::string from_json = error_of("config = \"" + path + "\"\n");
    EXPECT_NE(from_json.find("\"" + path + "\": " + c.key + c.expected), std::string::npos) << from_json;
    if (!c.toml_twin) continue;
    const std::string from_toml = error_of("config = \"" + path + "\"\n" + c.key + " = " + c.value + "\n");
    EXPECT_NE(from_toml.find("test.toml:2: [model] " + c.key + c.expected), std::string::npos) << from_toml;
  }
  // Through the binary: config.json's num_attention_heads = 0 divided by zero (SIGFPE, nothing
  // printed); now fit stops with the message before any rank starts.
  nlohmann::json zero = base;
  zero["num_attention_heads"] = 0;
  std::ofstream(dir + "/zero.json") << zero.dump();
  std::ofstream(dir + "/run.toml") << "[trainer]\ndefault_root_dir = \"" << dir << "\"\nmax_steps = 1\n"
                                   << "[model]\nplugin = \"llama\"\nconfig = \"" << dir << "/zero.json\"\n"
                                   << "[data]\nplugin = \"text\"\nblock_size = 8\n";
  const auto r = tessera::testing::run_tessera("fit --config " + dir + "/run.toml", "", 60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("\"" + dir + "/zero.json\": num_attention_heads = 0 is out of range; valid: an integer >= 1"),
            std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/version_0")) << "a run started: " << r.output;
}

// Issue 59.4 and 59.7: a weight stored as an integer (value-converted into garbage before) or
// holding a NaN (trained to a NaN loss before) is refused at load, naming the file, the tensor
// and what is valid, before any step: under single_device (each rank copies whole tensors) and
// fsdp (each rank checks the piece it copied, the ranks agree in one collective).
TEST(LlamaConfig, InitFromRefusesIntegerAndNonFiniteWeights) {
  const std::string dir = tessera::testing::fresh_dir("llama-bad-weights");
  const std::string model = "vocab_size = 256\nhidden_size = 16\nintermediate_size = 32\nnum_hidden_layers = 1\n"
                            "num_attention_heads = 2\n";
  std::vector<std::pair<std::string, at::Tensor>> weights;
  for (const auto& item : make_model(model)->network()->named_parameters())
    weights.emplace_back(item.key(), item.value().detach().clone());
  struct Case {
    std::string file, strategy, tensor;
    std::function<at::Tensor(const at::Tensor&)> damage;
    std::string expected;
  };
  const std::vector<Case> cases{
      {"int32.safetensors", "single_device", "model.layers.0.mlp.up_proj.weight",
       [](const at::Tensor& t) { return (t * 1000).to(at::kInt); },
       "checkpoint state_dict['model.layers.0.mlp.up_proj.weight'] is stored as I32 (Int), which is not a weight's "
       "dtype: loading it would convert integers into the Float parameter; valid: F32, BF16, F16 or F64"},
      {"nan.safetensors", "fsdp", "model.layers.0.self_attn.k_proj.weight",
       [](const at::Tensor& t) {
         at::Tensor out = t.clone();
         out[3][5] = std::nan("");
         return out;
       },
       "checkpoint state_dict['model.layers.0.self_attn.k_proj.weight'] holds NaN at element 53 of 256: a weight must "
       "be finite"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file);
    auto damaged = weights;
    for (auto& [name, tensor] : damaged)
      if (name == c.tensor) tensor = c.damage(tensor);
    const std::string path = dir + "/" + c.file, root = dir + "/" + c.strategy;
    tessera::core::write_safetensors(path, damaged, {});
    std::filesystem::create_directories(root);
    std::ofstream(root + "/run.toml") << "[trainer]\ndefault_root_dir = \"" << root << "\"\nmax_steps = 1\n"
                                      << "init_from = \"" << path << "\"\n[strategy]\nplugin = \"" << c.strategy
                                      << "\"\n[model]\nplugin = \"llama\"\n" << model
                                      << "[data]\nplugin = \"text\"\nblock_size = 8\n";
    const auto r = tessera::testing::run_tessera("fit --config " + root + "/run.toml", "", 120);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("[trainer] init_from = \"" + path + "\": " + c.expected), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("weights initialized from"), std::string::npos) << r.output;
    for (const auto& e : std::filesystem::recursive_directory_iterator(root))
      EXPECT_NE(e.path().filename(), "checkpoints") << "a run saved before the refusal: " << r.output;
  }
  // A 150 MB header inside a 200 MB (sparse) file fits the file: the refusal is the reader's cap,
  // named as such, not "does not fit" (issue 59.9).
  const std::string big = dir + "/big-header.safetensors";
  {
    std::ofstream out(big, std::ios::binary);
    const std::uint64_t length = 150'000'000;
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << "{}";
  }
  std::filesystem::resize_file(big, 200'000'000);
  const auto r = tessera::testing::run_tessera("checkpoint inspect " + big, "", 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(big + ": its header is 150000000 bytes, more than this reader's limit of 100000000 bytes "
                                "(kMaxSafetensorsHeader"),
            std::string::npos) << r.output;
}

class PlaceOnlyGroup final : public sdk::TensorParallelGroup {
 public:
  PlaceOnlyGroup(std::int64_t rank, std::int64_t size) : rank_(rank), size_(size) {}
  std::int64_t rank() const override { return rank_; }
  std::int64_t size() const override { return size_; }
  void all_reduce_sum(at::Tensor&) override { ADD_FAILURE() << "unexpected all_reduce_sum"; }
  at::Tensor all_gather(const at::Tensor& t, std::int64_t) override {
    ADD_FAILURE() << "unexpected all_gather";
    return t;
  }

 private:
  std::int64_t rank_, size_;
};

TEST(LlamaTensorParallel, PlanSplitsHeadsAndRefusesATpNotDividingKeyValueHeads) {
  const std::string toml = "hidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 1\nnum_attention_heads = 8\n"
                           "num_key_value_heads = 2\nvocab_size = 64\n";
  auto model = make_model(toml);
  try {
    model->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(0, 4)});
    FAIL() << "2 key-value heads over tp 4";
  } catch (const sdk::Error& e) {
    const std::string message = e.what();
    for (const char* part : {"test.toml", "[model] num_key_value_heads = 2", "tensor_parallel_size = 4",
                             "valid tensor_parallel_size: 1, 2"})
      EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in: " << message;
  }
  EXPECT_TRUE(sdk::tensor_parallel_placements(*model->network()).empty()) << "nothing changed";
  model->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(1, 2)});
  const auto placements = sdk::tensor_parallel_placements(*model->network());
  for (const char* name : {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
    EXPECT_EQ(placements.at(std::string("model.layers.0.") + (name[0] == 'g' || name[0] == 'u' ? "mlp." : "self_attn.") +
                            name + ".weight").dim, 0) << name;
  EXPECT_EQ(placements.at("model.layers.0.self_attn.o_proj.weight").dim, 1);
  EXPECT_EQ(placements.at("model.layers.0.mlp.down_proj.weight").dim, 1);
  EXPECT_EQ(model->network()->named_parameters()["model.layers.0.self_attn.k_proj.weight"].sizes(),
            (at::IntArrayRef{4, 32})) << "one of two key-value heads of 4";
  // Qwen3's q/k norms act on head_dim: replicated, whole on each tp rank (their gradients summed).
  auto qwen3 = make_model(toml + "model_type = \"qwen3\"\nhead_dim = 4\n");
  qwen3->parallelize(sdk::ParallelContext{std::make_shared<PlaceOnlyGroup>(1, 2)});
  EXPECT_EQ(sdk::tensor_parallel_placements(*qwen3->network()).count("model.layers.0.self_attn.q_norm.weight"), 0u);
  EXPECT_EQ(qwen3->network()->named_parameters()["model.layers.0.self_attn.k_norm.weight"].sizes(),
            (at::IntArrayRef{4}));
}

TEST(LlamaTensorParallel, FitRefusesBeforeAnyRankStarts) {
  const std::string dir = tessera::testing::fresh_dir("llama-tp-refused");
  std::ofstream(dir + "/run.toml") << "[trainer]\ndefault_root_dir = \"" << dir << "\"\nmax_steps = 1\n"
                                   << "[model]\nplugin = \"llama\"\nvocab_size = 256\nhidden_size = 32\n"
                                   << "intermediate_size = 48\nnum_hidden_layers = 1\nnum_attention_heads = 4\n"
                                   << "num_key_value_heads = 2\n[data]\nplugin = \"text\"\nblock_size = 8\n";
  const auto r = tessera::testing::run_tessera("fit --config " + dir + "/run.toml --set launch.devices=4 "
                                               "--set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=4", "", 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[model] num_key_value_heads = 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("valid tensor_parallel_size: 1, 2"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/version_0")) << "a run started: " << r.output;
}

// --- the toolkit's causal attention --------------------------------------------------------------

struct Grads {
  at::Tensor out, dq, dk, dv;
};

Grads run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
          const toolkit::CausalAttentionOptions& options) {
  at::Tensor q_ = q.clone().requires_grad_(true), k_ = k.clone().requires_grad_(true), v_ = v.clone().requires_grad_(true);
  at::Tensor out = toolkit::causal_attention(q_, k_, v_, options);
  out.backward(dout);
  return {out.detach(), q_.grad(), k_.grad(), v_.grad()};
}

/// `kernel` against the math path, forward and backward within 1e-5, for each (heads, kv heads,
/// queries, keys).
void expect_equals_math(const toolkit::CausalAttentionOptions& kernel,
                        const std::vector<std::array<std::int64_t, 4>>& shapes) {
  for (auto [H, Hkv, Tq, Tk] : shapes) {
    SCOPED_TRACE("H " + std::to_string(H) + " Hkv " + std::to_string(Hkv) + " Tq " + std::to_string(Tq) + " Tk " +
                 std::to_string(Tk));
    at::Tensor q = at::randn({2, H, Tq, 8}), k = at::randn({2, Hkv, Tk, 8}), v = at::randn({2, Hkv, Tk, 8});
    at::Tensor dout = at::randn({2, H, Tq, 8});
    toolkit::CausalAttentionOptions math;
    math.kernel = toolkit::AttentionKernel::math;
    ASSERT_EQ(toolkit::causal_attention_kernel(q, k, kernel), kernel.kernel);
    const Grads a = run(q, k, v, dout, math), b = run(q, k, v, dout, kernel);
    EXPECT_LE(max_diff(a.out, b.out), 1e-5);
    EXPECT_LE(max_diff(a.dq, b.dq), 1e-5);
    EXPECT_LE(max_diff(a.dk, b.dk), 1e-5);
    EXPECT_LE(max_diff(a.dv, b.dv), 1e-5);
    // The math path is causal: the first query reads the first visible key's value only.
    if (Tq == Tk) EXPECT_LE(max_diff(a.out.select(2, 0), at::repeat_interleave(v.select(2, 0), H / Hkv, 1)), 1e-6);
  }
}

TEST(CausalAttention, BlockedEqualsMathForwardAndBackward) {
  at::manual_seed(3);
  toolkit::CausalAttentionOptions blocked;
  blocked.kernel = toolkit::AttentionKernel::blocked;
  blocked.query_block = 8;
  // MHA, GQA, and queries after a cache of 9 positions.
  expect_equals_math(blocked, {{4, 4, 37, 37}, {6, 2, 37, 37}, {6, 3, 21, 30}});
}

// Packed rows (segments): the blocked kernel equals the math path's block-diagonal mask, rows
// whose samples start at different positions in one batch, MHA and GQA; so does the automatic
// choice (the blocked kernel for packed rows on the CPU). A block reads no key before its first
// query's sample: keys and values of the first sample set to NaN leave the later samples finite
// and equal to those samples run alone.
TEST(CausalAttention, PackedBlockedReadsOnlyEachSamplesKeys) {
  at::manual_seed(5);
  const at::Tensor segments = at::stack({at::cat({at::zeros({5}), at::ones({19}), at::full({13}, 2.0)}),
                                         at::cat({at::zeros({30}), at::ones({7})})})
                                  .to(at::kLong);
  for (auto [H, Hkv] : {std::pair<std::int64_t, std::int64_t>{4, 4}, {6, 2}}) {
    SCOPED_TRACE("H " + std::to_string(H) + " Hkv " + std::to_string(Hkv));
    at::Tensor q = at::randn({2, H, 37, 8}), k = at::randn({2, Hkv, 37, 8}), v = at::randn({2, Hkv, 37, 8});
    at::Tensor dout = at::randn({2, H, 37, 8});
    auto run_packed = [&](toolkit::AttentionKernel kernel) {
      toolkit::CausalAttentionOptions o;
      o.kernel = kernel;
      o.query_block = 8;
      at::Tensor q_ = q.clone().requires_grad_(true), k_ = k.clone().requires_grad_(true), v_ = v.clone().requires_grad_(true);
      at::Tensor out = toolkit::causal_attention(q_, k_, v_, o, segments);
      out.backward(dout);
      return Grads{out.detach(), q_.grad(), k_.grad(), v_.grad()};
    };
    const Grads math = run_packed(toolkit::AttentionKernel::math);
    for (auto kernel : {toolkit::AttentionKernel::blocked, toolkit::AttentionKernel::automatic}) {
      const Grads b = run_packed(kernel);
      EXPECT_LE(max_diff(math.out, b.out), 1e-5);
      EXPECT_LE(max_diff(math.dq, b.dq), 1e-5);
      EXPECT_LE(max_diff(math.dk, b.dk), 1e-5);
      EXPECT_LE(max_diff(math.dv, b.dv), 1e-5);
    }
  }
  // One row: a sample of 16 positions (two blocks of 8), then one of 21.
  const at::Tensor one = at::cat({at::zeros({16}), at::ones({21})}).to(at::kLong).unsqueeze(0);
  at::Tensor q = at::randn({1, 4, 37, 8}), k = at::randn({1, 2, 37, 8}), v = at::randn({1, 2, 37, 8});
  k.narrow(2, 0, 16).fill_(std::numeric_limits<float>::quiet_NaN());
  v.narrow(2, 0, 16).fill_(std::numeric_limits<float>::quiet_NaN());
  toolkit::CausalAttentionOptions blocked;
  blocked.kernel = toolkit::AttentionKernel::blocked;
  blocked.query_block = 8;
  const at::Tensor packed = toolkit::causal_attention(q, k, v, blocked, one).narrow(2, 16, 21);
  const at::Tensor alone = toolkit::causal_attention(q.narrow(2, 16, 21), k.narrow(2, 16, 21), v.narrow(2, 16, 21), blocked);
  ASSERT_TRUE(at::isfinite(packed).all().item<bool>()) << "a block read the keys of an earlier sample";
  EXPECT_LE(max_diff(packed, alone), 1e-5);
}

// LibTorch 2.x's SDPA (the default kernel there) computes the math path within 1e-5, forward and
// backward: MHA, GQA (keys and values repeated on the CPU, enable_gqa on CUDA), queries after a
// cache (an explicit bottom-right mask) and one decoding query. On LibTorch 1.13 there is no SDPA.
TEST(CausalAttention, SdpaEqualsMathWhereLibTorchHasIt) {
  try {
    (void)toolkit::parse_attention_kernel("sdpa", "[model] attention");
  } catch (const sdk::Error& e) {
    GTEST_SKIP() << "SKIPPED: " << e.what();
  }
  at::manual_seed(4);
  toolkit::CausalAttentionOptions sdpa;
  sdpa.kernel = toolkit::AttentionKernel::sdpa;
  expect_equals_math(sdpa, {{4, 4, 37, 37}, {6, 2, 37, 37}, {6, 3, 21, 30}, {6, 2, 1, 30}});
}

TEST(CausalAttention, RefusesMismatchedShapes) {
  at::Tensor q = at::randn({1, 4, 5, 8});
  EXPECT_THROW(toolkit::causal_attention(q, at::randn({1, 3, 5, 8}), at::randn({1, 3, 5, 8})), sdk::Error);
  EXPECT_THROW(toolkit::causal_attention(q, at::randn({1, 2, 4, 8}), at::randn({1, 2, 4, 8})), sdk::Error);
  EXPECT_THROW(toolkit::parse_attention_kernel("flash", "[model] attention"), sdk::Error);
}

}  // namespace
