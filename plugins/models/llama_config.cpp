#include "llama_config.hpp"

#include <algorithm>
#include <fstream>
#include <type_traits>
#include <variant>

namespace tessera::models {

using json = nlohmann::json;

namespace {

const std::vector<std::string> kModelTypes{"llama", "qwen2"};
const std::vector<std::string> kRopeTypes{"default", "linear", "llama3"};

/// A [model] value as JSON (rope_scaling tables, eos_token_id lists).
json to_json(const sdk::Value& value) {
  return std::visit(
      [](const auto& v) -> json {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::monostate>) {
          return nullptr;
        } else if constexpr (std::is_same_v<T, std::vector<sdk::Value>>) {
          json out = json::array();
          for (const sdk::Value& item : v) out.push_back(to_json(item));
          return out;
        } else if constexpr (std::is_same_v<T, std::map<std::string, sdk::Value>>) {
          json out = json::object();
          for (const auto& [key, item] : v) out[key] = to_json(item);
          return out;
        } else {
          return v;
        }
      },
      static_cast<const sdk::Value::variant&>(value));
}

std::optional<std::int64_t> optional_id(const json& value, const std::string& what) {
  if (value.is_null()) return std::nullopt;
  TESSERA_CHECK(value.is_number_integer(), what, " must be a token id, found ", value.dump());
  return value.get<std::int64_t>();
}

}  // namespace

LlamaConfigReader::LlamaConfigReader(const sdk::Options& o) : o_(o) {
  path_ = o.get_string(
      {"config", "a Hugging Face config.json whose keys the model takes; a key set in [model] overrides it"}, "");
  if (path_.empty()) return;
  std::ifstream in(path_);
  TESSERA_CHECK(in.good(), o.locate("config"), " = \"", path_, "\": cannot read it (a Hugging Face config.json)");
  try {
    json_ = json::parse(in);
  } catch (const std::exception& e) {
    TESSERA_FAIL(o.locate("config"), " = \"", path_, "\" is not JSON: ", e.what());
  }
  TESSERA_CHECK(json_.is_object(), o.locate("config"), " = \"", path_, "\" is not a JSON object");
}

json LlamaConfigReader::get_json(const std::string& key) const {
  if (o_.has(key)) {
    o_.mark_used(key);
    return to_json(o_.value(key));
  }
  return json_.contains(key) ? json_.at(key) : json();
}


LlamaConfig read_llama_config(const LlamaConfigReader& r) {
  const std::string model_type_where = r.where("model_type");
  LlamaConfig c;
  c.model_type = r.get_string(
      {"model_type", "Hugging Face's model_type: llama (LlamaForCausalLM) or qwen2 (Qwen2ForCausalLM: q/k/v biases)"},
      "llama");
  if (std::find(kModelTypes.begin(), kModelTypes.end(), c.model_type) == kModelTypes.end())
    TESSERA_FAIL(model_type_where, ": model_type \"", c.model_type, "\" is not supported; supported: \"llama\" ",
                 "(LlamaForCausalLM), \"qwen2\" (Qwen2ForCausalLM)");
  c.vocab_size = r.get_int({"vocab_size", "Hugging Face's vocab_size: rows of the token embedding"},
                           c.model_type == "qwen2" ? 151936 : 32000);
  c.hidden_size = r.get_int({"hidden_size", "Hugging Face's hidden_size: the residual stream width"}, 4096);
  c.intermediate_size =
      r.get_int({"intermediate_size", "Hugging Face's intermediate_size: the SwiGLU MLP's inner width"},
                c.model_type == "qwen2" ? 22016 : 11008);
  c.num_hidden_layers = r.get_int({"num_hidden_layers", "Hugging Face's num_hidden_layers: decoder layers"}, 32);
  c.num_attention_heads = r.get_int({"num_attention_heads", "Hugging Face's num_attention_heads: query heads"}, 32);
  c.num_key_value_heads = r.get_int(
      {"num_key_value_heads",
       "Hugging Face's num_key_value_heads: key/value heads (fewer than query heads: grouped-query attention)"},
      c.num_attention_heads);
  TESSERA_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, r.where("num_key_value_heads"), " = ",
                c.num_key_value_heads, " must divide num_attention_heads = ", c.num_attention_heads,
                " (each key-value head serves a group of query heads)");
  // head_dim: explicit, or hidden_size / num_attention_heads (null counts as absent, as in HF).
  if (!r.has("head_dim"))
    TESSERA_CHECK(c.hidden_size % c.num_attention_heads == 0, r.where("hidden_size"), " = ", c.hidden_size,
                  " must be divisible by num_attention_heads = ", c.num_attention_heads, " (or set head_dim)");
  c.head_dim = r.get_int({"head_dim", "Hugging Face's head_dim (default hidden_size / num_attention_heads)"},
                         c.hidden_size / c.num_attention_heads);
  TESSERA_CHECK(c.head_dim % 2 == 0, r.where("head_dim"), " = ", c.head_dim, " must be even (rotary embeddings)");
  c.max_position_embeddings =
      r.get_int({"max_position_embeddings", "Hugging Face's max_position_embeddings: the context"},
                c.model_type == "qwen2" ? 32768 : 2048);
  c.rms_norm_eps = r.get_double({"rms_norm_eps", "Hugging Face's rms_norm_eps: RMSNorm's epsilon"}, 1e-6, 0.0);
  c.rope_theta = r.get_double(
      {"rope_theta", "Hugging Face's rope_theta: the base of the rotary embedding's frequencies"}, 10000.0, 1e-300);
  c.initializer_range = r.get_double(
      {"initializer_range", "Hugging Face's initializer_range: the standard deviation of the initial weights"}, 0.02,
      0.0);
  c.tie_word_embeddings = r.get_bool(
      {"tie_word_embeddings", "Hugging Face's tie_word_embeddings: lm_head shares the token embedding's weight"},
      false);
  c.attention_bias =
      r.get_bool({"attention_bias", "Hugging Face's attention_bias: biases in q/k/v/o projections"}, false);
  c.mlp_bias = r.get_bool({"mlp_bias", "Hugging Face's mlp_bias: biases in the MLP's projections"}, false);
  const std::string act =
      r.get_string({"hidden_act", "Hugging Face's hidden_act: the MLP's activation (silu)"}, "silu");
  TESSERA_CHECK(act == "silu", r.where("hidden_act"), " = \"", act, "\" is not supported; supported: \"silu\" (SwiGLU)");
  const double attention_dropout = r.get_double(
      {"attention_dropout", "Hugging Face's attention_dropout (0.0 only, as every released Llama)"}, 0.0, 0.0);
  TESSERA_CHECK(attention_dropout == 0.0, r.where("attention_dropout"), " = ", attention_dropout,
                " is not supported; supported: 0.0 (as every released Llama)");
  if (c.model_type == "qwen2") {
    const bool sliding = r.get_bool({"use_sliding_window", "Qwen2's use_sliding_window (false only)"}, false);
    TESSERA_CHECK(!sliding, r.where("use_sliding_window"), " = true is not supported; supported: false");
  }
  // rope_scaling (transformers 4.x) or rope_parameters (5.x, which carries rope_theta too).
  json scaling = r.get_json("rope_scaling");
  if (scaling.is_null()) {
    scaling = r.file().contains("rope_parameters") ? r.file().at("rope_parameters") : json();
    if (scaling.is_object() && scaling.contains("rope_theta") && !r.file().contains("rope_theta"))
      c.rope_theta = scaling.at("rope_theta").get<double>();
  }
  if (!scaling.is_null()) {
    const std::string where = r.where("rope_scaling");
    TESSERA_CHECK(scaling.is_object(), where, " must be a table (rope_type = \"llama3\", factor = ...), found ",
                  scaling.dump());
    RopeScaling s;
    s.type = scaling.value("rope_type", scaling.value("type", std::string("default")));
    if (std::find(kRopeTypes.begin(), kRopeTypes.end(), s.type) == kRopeTypes.end())
      TESSERA_FAIL(where, ": rope_scaling type \"", s.type, "\" is not supported; supported: \"default\", \"linear\", ",
                   "\"llama3\"");
    auto number = [&](const char* key, double fallback, bool required) {
      if (!scaling.contains(key)) {
        TESSERA_CHECK(!required, where, ": rope_scaling type \"", s.type, "\" needs ", key);
        return fallback;
      }
      TESSERA_CHECK(scaling.at(key).is_number(), where, ": rope_scaling ", key, " must be a number, found ",
                    scaling.at(key).dump());
      return scaling.at(key).get<double>();
    };
    const bool scaled = s.type != "default";
    s.factor = number("factor", 1.0, scaled);
    const bool llama3 = s.type == "llama3";
    s.low_freq_factor = number("low_freq_factor", 1.0, llama3);
    s.high_freq_factor = number("high_freq_factor", 4.0, llama3);
    s.original_max_position_embeddings = number("original_max_position_embeddings", 8192, llama3);
    TESSERA_CHECK(!llama3 || s.high_freq_factor != s.low_freq_factor, where,
                  ": rope_scaling high_freq_factor must differ from low_freq_factor");
    c.rope_scaling = s;
  }
  c.pad_token_id = optional_id(r.get_json("pad_token_id"), r.where("pad_token_id"));
  if (c.pad_token_id)
    TESSERA_CHECK(*c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size, r.where("pad_token_id"), " = ",
                  *c.pad_token_id, " is not a token id below vocab_size = ", c.vocab_size);
  c.bos_token_id = optional_id(r.get_json("bos_token_id"), r.where("bos_token_id"));
  const json eos = r.get_json("eos_token_id");
  if (eos.is_array())
    for (const auto& id : eos) c.eos_token_id.push_back(*optional_id(id, r.where("eos_token_id")));
  else if (auto id = optional_id(eos, r.where("eos_token_id")))
    c.eos_token_id.push_back(*id);
  return c;
}


}  // namespace tessera::models
