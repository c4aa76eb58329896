#include "llama_config.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <type_traits>
#include <variant>

namespace tessera::models {

using json = nlohmann::json;

namespace {

/// Each model_type: its transformers class and the defaults its config class gives the keys that
/// differ between them when config.json (or [model]) leaves them out.
struct ModelType {
  const char* name;
  const char* architecture;
  const char* what;  // for the list of supported types
  std::int64_t vocab_size, intermediate_size, max_position_embeddings;
  std::int64_t num_key_value_heads;  // 0: num_attention_heads
  std::int64_t head_dim;             // 0: hidden_size / num_attention_heads
  std::int64_t sliding_window;       // 0: none (LlamaConfig has no window)
};
const ModelType kModelTypes[] = {
    {"llama", "LlamaForCausalLM", "", 32000, 11008, 2048, 0, 0, 0},
    {"qwen2", "Qwen2ForCausalLM", "q/k/v biases", 151936, 22016, 32768, 0, 0, 4096},
    {"qwen3", "Qwen3ForCausalLM", "q/k RMSNorm per head", 151936, 22016, 32768, 0, 128, 4096},
    {"mistral", "MistralForCausalLM", "no biases", 32000, 14336, 131072, 8, 0, 4096},
};

const ModelType* find_model_type(const std::string& name) {
  for (const ModelType& t : kModelTypes)
    if (name == t.name) return &t;
  return nullptr;
}

std::string supported_model_types() {
  std::vector<std::string> out;
  for (const ModelType& t : kModelTypes)
    out.push_back("\"" + std::string(t.name) + "\" (" + t.architecture + (*t.what ? std::string(": ") + t.what : "") +
                  ")");
  return sdk::join(out);
}

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

/// What get_int accepts, for messages: "an integer >= 1", "an integer from 0 to 7".
std::string int_range(std::int64_t min, std::int64_t max) {
  if (max == INT64_MAX) return "an integer >= " + std::to_string(min);
  return "an integer from " + std::to_string(min) + " to " + std::to_string(max);
}

/// A token id (null: none) below vocab_size.
std::optional<std::int64_t> optional_id(const json& value, const std::string& what, std::int64_t vocab_size) {
  if (value.is_null()) return std::nullopt;
  const bool fits = value.is_number_integer() && !(value.is_number_unsigned() && value.get<std::uint64_t>() > INT64_MAX);
  const std::int64_t id = fits ? value.get<std::int64_t>() : -1;
  TESSERA_CHECK(fits && id >= 0 && id < vocab_size, what, " = ", value.dump(), " is not a token id; valid: ",
                int_range(0, vocab_size - 1), " (below vocab_size = ", vocab_size, ")");
  return id;
}

/// The machine's memory: no one tensor of the model may be larger, since each is allocated whole
/// on one process (deferred initialisation too materialises a unit's tensors before sharding).
std::int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : INT64_MAX;
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

std::optional<std::int64_t> LlamaConfigReader::json_int(const std::string& key, std::int64_t min,
                                                       std::int64_t max) const {
  if (!json_.contains(key) || json_.at(key).is_null()) return std::nullopt;
  const json& value = json_.at(key);
  const bool fits = value.is_number_integer() && !(value.is_number_unsigned() && value.get<std::uint64_t>() > INT64_MAX);
  TESSERA_CHECK(fits, "\"", path_, "\": ", key, " = ", value.dump(),
                value.is_number_integer() ? " is out of range" : " is not an integer", "; valid: ", int_range(min, max));
  return value.get<std::int64_t>();
}

std::int64_t LlamaConfigReader::get_int(const sdk::Key& key, std::int64_t fallback, std::int64_t min,
                                        std::int64_t max) const {
  const std::int64_t value = o_.get_int(key, json_int(key.name, min, max).value_or(fallback));
  TESSERA_CHECK(value >= min && value <= max, where(key.name), " = ", value, " is out of range; valid: ",
                int_range(min, max));
  return value;
}

double LlamaConfigReader::get_double(const sdk::Key& key, double fallback, double min, bool exclusive) const {
  constexpr double kInf = std::numeric_limits<double>::infinity();  // an infinity gets the message below
  const double value = o_.get_double(key, from_json<double>(key.name, fallback), -kInf, kInf);
  TESSERA_CHECK(std::isfinite(value) && (exclusive ? value > min : value >= min), where(key.name), " = ", value,
                " is out of range; valid: a finite number ", exclusive ? "> " : ">= ", min);
  return value;
}

json LlamaConfigReader::get_json(const std::string& key) const {
  if (o_.has(key)) {
    o_.mark_used(key);
    return to_json(o_.value(key));
  }
  return json_.contains(key) ? json_.at(key) : json();
}


namespace {

/// Before anything is allocated: every tensor the configuration makes fits this machine's memory
/// (in fp32, as the model is built), and no product of its dimensions overflows.
void check_allocatable(const LlamaConfig& c, const LlamaConfigReader& r) {
  std::int64_t q_width = 0, kv_width = 0;
  TESSERA_CHECK(!__builtin_mul_overflow(c.num_attention_heads, c.head_dim, &q_width) &&
                    !__builtin_mul_overflow(c.num_key_value_heads, c.head_dim, &kv_width),
                r.where("head_dim"), " = ", c.head_dim, " times num_attention_heads = ", c.num_attention_heads,
                " overflows a 64-bit size");
  struct Matrix {
    const char* name;
    std::int64_t rows, cols;
    const char* key;  // the key that sets rows (cols is hidden_size)
    std::int64_t value, copies;  // the key's value; matrices of this shape (per layer, or in all)
    bool per_layer;
  };
  const std::vector<Matrix> matrices{
      {"model.embed_tokens.weight", c.vocab_size, c.hidden_size, "vocab_size", c.vocab_size,
       c.tie_word_embeddings ? 1 : 2, false},
      {"self_attn.q_proj.weight", q_width, c.hidden_size, "num_attention_heads", c.num_attention_heads, 2, true},
      {"self_attn.k_proj.weight", kv_width, c.hidden_size, "num_key_value_heads", c.num_key_value_heads, 2, true},
      {"mlp.gate_proj.weight", c.intermediate_size, c.hidden_size, "intermediate_size", c.intermediate_size, 3, true}};
  const std::int64_t memory = physical_memory_bytes();
  std::int64_t per_layer = 0, once = 0;
  bool overflow = false;
  for (const Matrix& m : matrices) {
    std::int64_t elements = 0, bytes = 0;
    const bool too_many =
        __builtin_mul_overflow(m.rows, m.cols, &elements) || __builtin_mul_overflow(elements, std::int64_t{4}, &bytes);
    TESSERA_CHECK(!too_many && bytes <= memory, r.where(m.key), " = ", m.value, " with hidden_size = ", c.hidden_size,
                  " makes ", m.name, " [", m.rows, ", ", m.cols, "]: ",
                  too_many ? std::string("more bytes than a 64-bit size counts") : std::to_string(bytes) + " bytes in fp32",
                  ", more than this machine's memory (", memory, " bytes); valid: sizes whose tensors fit in memory");
    std::int64_t& sum = m.per_layer ? per_layer : once;
    overflow = overflow || __builtin_mul_overflow(elements, m.copies, &elements) ||
               __builtin_add_overflow(sum, elements, &sum);
  }
  std::int64_t total = 0;
  overflow = overflow || __builtin_mul_overflow(per_layer, c.num_hidden_layers, &total) ||
             __builtin_add_overflow(total, once, &total) || __builtin_mul_overflow(total, std::int64_t{4}, &total);
  TESSERA_CHECK(!overflow, r.where("num_hidden_layers"), " = ", c.num_hidden_layers,
                " makes a model whose size in bytes overflows a 64-bit integer; valid: a model that fits in memory");
}

/// The sliding window of Mistral (and of Qwen2/Qwen3 with use_sliding_window), which no attention
/// kernel here implements: refused wherever it could mask a key, kept (and written back) elsewhere.
void read_sliding_window(const LlamaConfigReader& r, const ModelType& type, LlamaConfig& c) {
  const std::string key = "sliding_window";
  // 0, or null in config.json, is no window (a [model] table cannot say null); absent, the
  // config class's default.
  const bool null = !r.has(key) && r.file().contains(key);
  const std::int64_t window = r.get_int(
      {key,
       "Hugging Face's sliding_window (mistral; qwen2/qwen3 with use_sliding_window), 0: none; not implemented: "
       "mistral's must be none or at least max_position_embeddings (no position leaves it), llama has none"},
      null ? 0 : type.sliding_window, 0);
  if (window > 0) c.sliding_window = window;
  const bool sliding = r.get_bool({"use_sliding_window", "Qwen2's and Qwen3's use_sliding_window (false only)"}, false);
  TESSERA_CHECK(!sliding, r.where("use_sliding_window"),
                " = true is not supported (no attention kernel here slides a window); supported: false");
  c.max_window_layers = r.get_int({"max_window_layers",
                                   "Qwen2's and Qwen3's max_window_layers (the layers from it on would slide; unused, "
                                   "as use_sliding_window is false)"},
                                  28, 0);
  TESSERA_CHECK(!c.sliding_window || c.model_type != "llama", r.where(key), " = ", window,
                " is not supported: LlamaForCausalLM has no sliding window; valid: 0 or null (none)");
  // A window of at least max_position_embeddings never masks a key: [data] block_size may not
  // exceed max_position_embeddings, and a position past the window is refused (hidden_states).
  TESSERA_CHECK(
      !c.sliding_window || c.model_type != "mistral" || window >= c.max_position_embeddings, r.where(key), " = ",
      window, " is not supported: sliding-window attention is not implemented; valid: ",
      "null or 0 (no window; config.json's \"sliding_window\": null, as Mistral v0.2 and later), or a window ",
      "of at least max_position_embeddings = ", c.max_position_embeddings, ", which no position leaves");
}

}  // namespace

std::string LlamaConfig::architecture() const {
  const ModelType* type = find_model_type(model_type);
  TESSERA_CHECK(type != nullptr, "llama: model_type \"", model_type, "\" is not supported");
  return type->architecture;
}

LlamaConfig read_llama_config(const LlamaConfigReader& r) {
  const std::string model_type_where = r.where("model_type");
  LlamaConfig c;
  c.model_type = r.get_string(
      {"model_type",
       "Hugging Face's model_type: llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM: q/k/v "
       "biases), qwen3 (Qwen3ForCausalLM: q/k RMSNorm per head) or mistral (MistralForCausalLM: no biases)"},
      "llama");
  const ModelType* type = find_model_type(c.model_type);
  if (type == nullptr)
    TESSERA_FAIL(model_type_where, ": model_type \"", c.model_type,
                 "\" is not supported; supported: ", supported_model_types());
  c.vocab_size = r.get_int({"vocab_size", "Hugging Face's vocab_size: rows of the token embedding"}, type->vocab_size);
  c.hidden_size = r.get_int({"hidden_size", "Hugging Face's hidden_size: the residual stream width"}, 4096);
  c.intermediate_size = r.get_int(
      {"intermediate_size", "Hugging Face's intermediate_size: the SwiGLU MLP's inner width"}, type->intermediate_size);
  c.num_hidden_layers = r.get_int({"num_hidden_layers", "Hugging Face's num_hidden_layers: decoder layers"}, 32);
  c.num_attention_heads = r.get_int({"num_attention_heads", "Hugging Face's num_attention_heads: query heads"}, 32);
  c.num_key_value_heads = r.get_int(
      {"num_key_value_heads",
       "Hugging Face's num_key_value_heads: key/value heads (fewer than query heads: grouped-query attention)"},
      type->num_key_value_heads > 0 ? type->num_key_value_heads : c.num_attention_heads, 1, c.num_attention_heads);
  TESSERA_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, r.where("num_key_value_heads"), " = ",
                c.num_key_value_heads, " must divide num_attention_heads = ", c.num_attention_heads,
                " (each key-value head serves a group of query heads)");
  // head_dim: explicit, else the model type's (Qwen3Config's 128), else hidden_size /
  // num_attention_heads (null counts as absent, as in HF).
  if (!r.has("head_dim") && type->head_dim == 0)
    TESSERA_CHECK(c.hidden_size % c.num_attention_heads == 0, r.where("hidden_size"), " = ", c.hidden_size,
                  " must be divisible by num_attention_heads = ", c.num_attention_heads, " (or set head_dim)");
  c.head_dim = r.get_int(
      {"head_dim", "Hugging Face's head_dim (default hidden_size / num_attention_heads; qwen3: 128, as Qwen3Config)"},
      type->head_dim > 0 ? type->head_dim : c.hidden_size / c.num_attention_heads, 2);
  TESSERA_CHECK(c.head_dim % 2 == 0, r.where("head_dim"), " = ", c.head_dim, " must be even (rotary embeddings)");
  c.max_position_embeddings =
      r.get_int({"max_position_embeddings", "Hugging Face's max_position_embeddings: the context"},
                type->max_position_embeddings);
  c.rms_norm_eps =
      r.get_double({"rms_norm_eps", "Hugging Face's rms_norm_eps: RMSNorm's epsilon"}, 1e-6, 0.0, /*exclusive=*/true);
  c.rope_theta = r.get_double(
      {"rope_theta", "Hugging Face's rope_theta: the base of the rotary embedding's frequencies"}, 10000.0, 0.0,
      /*exclusive=*/true);
  c.initializer_range = r.get_double(
      {"initializer_range", "Hugging Face's initializer_range: the standard deviation of the initial weights"}, 0.02,
      0.0);
  c.tie_word_embeddings = r.get_bool(
      {"tie_word_embeddings", "Hugging Face's tie_word_embeddings: lm_head shares the token embedding's weight"},
      false);
  c.attention_bias = r.get_bool(
      {"attention_bias",
       "Hugging Face's attention_bias: biases in q/k/v/o projections (llama, qwen3; qwen2 biases q/k/v always; "
       "mistral: false only)"},
      false);
  c.mlp_bias = r.get_bool(
      {"mlp_bias", "Hugging Face's mlp_bias: biases in the MLP's projections (llama; the others: false only)"}, false);
  // Where transformers' modeling code writes no bias it ignores the key: true would build
  // parameters the class has not, so it is refused.
  TESSERA_CHECK(!c.attention_bias || c.model_type != "mistral", r.where("attention_bias"),
                " = true is not supported: ", type->architecture, " has no attention biases; valid: false");
  TESSERA_CHECK(!c.mlp_bias || c.model_type == "llama", r.where("mlp_bias"),
                " = true is not supported: ", type->architecture, "'s MLP has no biases; valid: false");
  const std::string act =
      r.get_string({"hidden_act", "Hugging Face's hidden_act: the MLP's activation (silu)"}, "silu");
  TESSERA_CHECK(act == "silu", r.where("hidden_act"), " = \"", act, "\" is not supported; supported: \"silu\" (SwiGLU)");
  const double attention_dropout = r.get_double(
      {"attention_dropout", "Hugging Face's attention_dropout (0.0 only, as every released Llama)"}, 0.0, 0.0);
  TESSERA_CHECK(attention_dropout == 0.0, r.where("attention_dropout"), " = ", attention_dropout,
                " is not supported; supported: 0.0 (as every released Llama)");
  read_sliding_window(r, *type, c);
  // rope_scaling (transformers 4.x) or rope_parameters (5.x, which carries rope_theta too).
  json scaling = r.get_json("rope_scaling");
  if (scaling.is_null()) {
    scaling = r.file().contains("rope_parameters") ? r.file().at("rope_parameters") : json();
    if (scaling.is_object() && scaling.contains("rope_theta") && !r.file().contains("rope_theta")) {
      const json& theta = scaling.at("rope_theta");
      TESSERA_CHECK(theta.is_number() && theta.get<double>() > 0, "\"", r.path(), "\": rope_parameters.rope_theta = ",
                    theta.dump(), " is out of range; valid: a finite number > 0");
      c.rope_theta = theta.get<double>();
    }
  }
  if (!scaling.is_null()) {
    const std::string where = r.where("rope_scaling");
    TESSERA_CHECK(scaling.is_object(), where, " must be a table (rope_type = \"llama3\", factor = ...), found ",
                  scaling.dump());
    RopeScaling s;
    const json type = scaling.value("rope_type", scaling.value("type", json("default")));
    TESSERA_CHECK(type.is_string(), where, ": rope_scaling rope_type must be a string, found ", type.dump());
    s.type = type.get<std::string>();
    if (std::find(kRopeTypes.begin(), kRopeTypes.end(), s.type) == kRopeTypes.end())
      TESSERA_FAIL(where, ": rope_scaling type \"", s.type, "\" is not supported; supported: \"default\", \"linear\", ",
                   "\"llama3\"");
    // Each is a divisor of the frequencies or wavelengths: a finite number > 0.
    auto number = [&](const char* key, double fallback, bool required) {
      if (!scaling.contains(key)) {
        TESSERA_CHECK(!required, where, ": rope_scaling type \"", s.type, "\" needs ", key);
        return fallback;
      }
      const json& value = scaling.at(key);
      TESSERA_CHECK(value.is_number() && value.get<double>() > 0, where, ": rope_scaling ", key, " = ", value.dump(),
                    " is out of range; valid: a finite number > 0");
      return value.get<double>();
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
  c.pad_token_id = optional_id(r.get_json("pad_token_id"), r.where("pad_token_id"), c.vocab_size);
  c.bos_token_id = optional_id(r.get_json("bos_token_id"), r.where("bos_token_id"), c.vocab_size);
  const json eos = r.get_json("eos_token_id");
  if (eos.is_array())
    for (const auto& id : eos) {
      TESSERA_CHECK(!id.is_null(), r.where("eos_token_id"), " lists null; valid: token ids below vocab_size = ",
                    c.vocab_size);
      c.eos_token_id.push_back(*optional_id(id, r.where("eos_token_id"), c.vocab_size));
    }
  else if (auto id = optional_id(eos, r.where("eos_token_id"), c.vocab_size))
    c.eos_token_id.push_back(*id);
  check_allocatable(c, r);
  return c;
}


}  // namespace tessera::models
