// libFuzzer: a Hugging Face config.json, as [model] config = "config.json" hands it to the llama
// plugin (loaded as tessera loads it): the plugin reads and range-checks every key; a config it
// accepts that is small enough for a fuzzer's memory is built and runs one forward and backward.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "fuzz_input.hpp"
#include "plugin_loader.hpp"
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace {

tessera::core::PluginLoader& loader() {
  static tessera::core::PluginLoader instance({TESSERA_FUZZ_PLUGIN_DIR});
  return instance;
}

/// The config's element count, from the keys the plugin would read (their defaults where absent);
/// the plugin's own checks decide validity, this only keeps the fuzzer within its memory.
double elements(const nlohmann::json& j) {
  auto get = [&](const char* key, double fallback) {
    return j.contains(key) && j.at(key).is_number() ? j.at(key).get<double>() : fallback;
  };
  const double hidden = get("hidden_size", 4096), vocab = get("vocab_size", 32000);
  const double layers = get("num_hidden_layers", 32), inter = get("intermediate_size", 11008);
  const double positions = get("max_position_embeddings", 2048), head_dim = get("head_dim", 128);
  return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter) + positions * head_dim;
}

}  // namespace

// The plugin is loaded before libFuzzer lists the instrumented modules, so that its code's
// coverage guides the search (a library opened later is run but not measured).
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  namespace sdk = tessera::sdk;
  sdk::Options options = sdk::make_options("model", "fuzz.toml", toml::parse(""));
  (void)loader().create_as<sdk::Module>(sdk::PluginKind::model, "llama", options);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  tessera::fuzz::InputFile file(data, size);
  namespace sdk = tessera::sdk;
  try {
    sdk::Options options =
        sdk::make_options("model", "fuzz.toml", toml::parse("config = \"" + file.path() + "\"\n"));
    auto model = loader().create_as<sdk::Module>(sdk::PluginKind::model, "llama", options);
    const auto j = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(data), size));
    if (elements(j) > 4e6) return 0;
    model->configure_model();
    const std::int64_t vocab = j.contains("vocab_size") && j.at("vocab_size").is_number_integer()
                                   ? j.at("vocab_size").get<std::int64_t>()
                                   : 32000;
    sdk::Batch batch;
    batch.input = at::randint(vocab, {1, 4}, at::kLong);
    batch.target = at::randint(vocab, {1, 4}, at::kLong);
    model->training_step(batch, 0).loss.backward();
  } catch (const std::exception& e) {
    if (std::getenv("TESSERA_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "refused: %s\n", e.what());
  }
  return 0;
}
