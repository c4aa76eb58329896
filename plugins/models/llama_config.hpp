#pragma once
// The llama plugin's configuration: Hugging Face's config.json keys (the defaults of the
// model_type's config class: LlamaConfig, Qwen2Config, Qwen3Config or MistralConfig), from
// [model] TOML keys over the file [model] config names.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/options.hpp"

namespace tessera::models {

/// rope_scaling (Hugging Face's rope_type, or the older "type").
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192;
};

/// config.json's keys; the member defaults are LlamaConfig's (read_llama_config applies the
/// model_type's own).
struct LlamaConfig {
  std::string model_type = "llama";
  std::int64_t vocab_size = 32000, hidden_size = 4096, intermediate_size = 11008, num_hidden_layers = 32,
               num_attention_heads = 32, num_key_value_heads = 32, head_dim = 128, max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0, initializer_range = 0.02;
  bool tie_word_embeddings = false, attention_bias = false, mlp_bias = false;
  std::optional<RopeScaling> rope_scaling;
  std::optional<std::int64_t> pad_token_id, bos_token_id;
  std::vector<std::int64_t> eos_token_id;
  /// As read (none: 0 or null), written back to config.json: Mistral's window (accepted only where
  /// no position can leave it), Qwen2/Qwen3's (unused: use_sliding_window = true is refused).
  std::optional<std::int64_t> sliding_window;
  std::int64_t max_window_layers = 28;  // Qwen2/Qwen3's
  /// Qwen2 biases q, k and v but not o; Llama's and Qwen3's attention_bias bias all four
  /// (Mistral's is refused: it has no biases).
  bool qkv_bias() const { return model_type == "qwen2" || attention_bias; }
  bool o_bias() const { return model_type != "qwen2" && attention_bias; }
  /// Qwen3: RMSNorm of each query and key head (q_norm, k_norm over head_dim) before the rotary embedding.
  bool qk_norm() const { return model_type == "qwen3"; }
  /// The transformers class of model_type ("LlamaForCausalLM", "Qwen3ForCausalLM", ...).
  std::string architecture() const;
  /// The window Mistral's attention would slide (accepted only when no position reaches past it).
  std::optional<std::int64_t> attention_window() const {
    return model_type == "mistral" ? sliding_window : std::nullopt;
  }
};

/// The configuration: config.json's values (when [model] config names one) under the TOML keys.
class LlamaConfigReader {
 public:
  explicit LlamaConfigReader(const sdk::Options& o);

  /// Where a value came from, for messages.
  std::string where(const std::string& key) const {
    return o_.has(key) || path_.empty() || !json_.contains(key) ? o_.locate(key)
                                                                 : "\"" + path_ + "\": " + key;
  }

  // The range checks below serve a TOML key and its config.json twin alike (one check, one
  // message naming where the value came from and what is valid): the two can never drift.
  /// An integer in [min, max]; a config.json number that is not an integer (64.5, 1e12) is refused.
  std::int64_t get_int(const sdk::Key& key, std::int64_t fallback, std::int64_t min = 1,
                       std::int64_t max = INT64_MAX) const;
  /// A finite number, at least `min` (or above it, when `exclusive`).
  double get_double(const sdk::Key& key, double fallback, double min, bool exclusive = false) const;
  bool get_bool(const sdk::Key& key, bool fallback) const {
    return o_.get_bool(key, from_json<bool>(key.name, fallback));
  }
  std::string get_string(const sdk::Key& key, const std::string& fallback) const {
    return o_.get_string(key, from_json<std::string>(key.name, fallback));
  }
  /// The TOML value if set (a table, an array or a scalar), else config.json's; null when neither.
  nlohmann::json get_json(const std::string& key) const;
  /// Set in the TOML or (not null) in config.json.
  bool has(const std::string& key) const {
    return o_.has(key) || (json_.contains(key) && !json_.at(key).is_null());
  }
  const nlohmann::json& file() const { return json_; }
  const std::string& path() const { return path_; }

 private:
  /// config.json's integer (nullopt when absent or null), refused when it is not one or does not
  /// fit an int64 (nlohmann's get<std::int64_t> would truncate 64.5 and wrap 2^64 silently).
  std::optional<std::int64_t> json_int(const std::string& key, std::int64_t min, std::int64_t max) const;
  template <typename T>
  T from_json(const std::string& key, T fallback) const {
    if (!json_.contains(key) || json_.at(key).is_null()) return fallback;
    try {
      return json_.at(key).get<T>();
    } catch (const std::exception&) {
      TESSERA_FAIL("\"", path_, "\": ", key, " = ", json_.at(key).dump(), " has the wrong type");
    }
  }

  const sdk::Options& o_;
  std::string path_;
  nlohmann::json json_;
};

/// The whole configuration, checked: an unknown model_type or rope type, a value out of its range,
/// values that do not fit together (heads, head_dim, token ids) or a tensor too large for this
/// machine's memory are refused naming the key and where it was set, before anything is allocated.
LlamaConfig read_llama_config(const LlamaConfigReader& r);

}  // namespace tessera::models
