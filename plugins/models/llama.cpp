// `llama`: Hugging Face's LlamaForCausalLM and its variants Qwen2ForCausalLM (q/k/v biases),
// Qwen3ForCausalLM (q/k RMSNorm per head) and MistralForCausalLM (no biases), with
// Hugging Face's parameter names and config.json keys, so checkpoints move in and out without a
// mapping table. Each LlamaDecoderLayer is an FSDP unit run through sdk::invoke(); parallelize()
// splits heads and the MLP over a tensor-parallel group; predict_step decodes with a KV cache.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "causal_lm.hpp"
#include "llama_config.hpp"
#include "models.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/unit.hpp"
#include "tessera/toolkit/attention.hpp"
#include "tessera/toolkit/fused.hpp"
#include "tessera/toolkit/lora.hpp"
#include "tessera/toolkit/sampling.hpp"
#include "tessera/toolkit/tensor_parallel.hpp"

#define XXH_INLINE_ALL  // header-only: plugins link the SDK alone
#include <xxhash.h>

namespace tessera::models {

using json = nlohmann::json;
using sdk::Batch;

namespace {

/// The Linear modules [model.lora] target_modules may name (PEFT's names for LlamaForCausalLM),
/// and PEFT's default for the llama family (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
const std::vector<std::string> kLlamaLoraTargets{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
const std::vector<std::string> kLlamaLoraDefaultTargets{"q_proj", "v_proj"};

// --- rotary embeddings (modeling_rope_utils.py) ------------------------------------------------

/// inv_freq [head_dim / 2] (float32, computed as Hugging Face computes it, operation for operation:
/// Python's `scalar / tensor` is reciprocal() * scalar).
at::Tensor rope_inv_freq(const LlamaConfig& c) {
  const auto dim = static_cast<double>(c.head_dim);
  at::Tensor exponent = at::arange(0, c.head_dim, 2, at::kLong).to(at::kFloat) / dim;
  at::Tensor inv_freq = at::pow(c.rope_theta, exponent).reciprocal();
  if (!c.rope_scaling || c.rope_scaling->type == "default") return inv_freq;
  const RopeScaling& s = *c.rope_scaling;
  if (s.type == "linear") return inv_freq / s.factor;
  // llama3 (_compute_llama3_parameters)
  const double low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
  const double high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
  at::Tensor wavelen = inv_freq.reciprocal() * (2 * M_PI);
  at::Tensor inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  at::Tensor smooth_factor =
      (wavelen.reciprocal() * s.original_max_position_embeddings - s.low_freq_factor) /
      (s.high_freq_factor - s.low_freq_factor);
  at::Tensor smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama;
  at::Tensor is_medium_freq = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return at::where(is_medium_freq, smoothed_inv_freq, inv_freq_llama);
}

/// rotate_half: the second half of the last dimension, negated, then the first.
at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

/// One layer's keys and values so far, [B, Hkv, capacity, D] filled up to `length`.
struct KVCache {
  at::Tensor k, v;
  std::int64_t length = 0;
  std::int64_t capacity = 0;

  std::pair<at::Tensor, at::Tensor> append(const at::Tensor& k_new, const at::Tensor& v_new) {
    const std::int64_t T = k_new.size(2);
    if (!k.defined()) {
      auto sizes = k_new.sizes().vec();
      sizes[2] = std::max(capacity, T);
      k = at::empty(sizes, k_new.options());
      v = at::empty(sizes, v_new.options());
    }
    TESSERA_CHECK(length + T <= k.size(2), "llama: the KV cache holds ", k.size(2), " positions; ", length + T, " asked");
    k.narrow(2, length, T).copy_(k_new);
    v.narrow(2, length, T).copy_(v_new);
    length += T;
    return {k.narrow(2, 0, length), v.narrow(2, 0, length)};
  }
};

torch::nn::AnyModule make_linear(torch::nn::Module& parent, const std::string& name, std::int64_t in, std::int64_t out,
                                 bool bias) {
  return torch::nn::AnyModule(
      parent.register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias))));
}

/// Replaces `linear` (the child `name` of `parent`) by a LoRA layer over it when [model.lora]
/// targets `name`, noting the match.
void adapt_linear(torch::nn::Module& parent, const std::string& name, torch::nn::AnyModule& linear,
                  const toolkit::LoraOptions& lora, std::vector<std::string>& matched) {
  const auto& targets = lora.target_modules;
  if (std::find(targets.begin(), targets.end(), name) == targets.end()) return;
  linear = torch::nn::AnyModule(
      parent.replace_module(name, toolkit::LoraLinear(linear.get<torch::nn::LinearImpl>(), lora)));
  if (std::find(matched.begin(), matched.end(), name) == matched.end()) matched.push_back(name);
}

// --- modules (modeling_llama.py) ---------------------------------------------------------------

/// Where one of the toolkit's fused kernels runs ([model] fused_rms_norm, fused_rotary,
/// fused_swiglu); elsewhere the modules run the unfused math Hugging Face's modeling code writes.
/// A key set true or false: everywhere or nowhere. Left out: on the CPU, where each kernel is
/// measured faster than the unfused math (docs/performance.md), not on CUDA, whose kernels have
/// not yet run on a GPU (kernels_cuda_test, issue 63).
enum class KernelUse { nowhere, cpu_only, everywhere };
bool fused_on(KernelUse use, const at::Tensor& x) {
  return use == KernelUse::everywhere || (use == KernelUse::cpu_only && x.is_cpu());
}
struct LlamaKernels {
  KernelUse rms_norm = KernelUse::cpu_only, rotary = KernelUse::cpu_only, swiglu = KernelUse::cpu_only;
};

/// RMSNorm computed in fp32, cast back to the input's dtype before the weight (LlamaRMSNorm,
/// Qwen3RMSNorm).
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  LlamaRMSNormImpl(std::int64_t hidden_size, double eps, KernelUse fused = KernelUse::nowhere)
      : torch::nn::Module("LlamaRMSNorm"), eps_(eps), fused_(fused) {
    weight = register_parameter("weight", at::ones({hidden_size}));
  }
  at::Tensor forward(const at::Tensor& x) {
    // A q/k norm under tensor parallelism sees this rank's heads only: the weight's gradient is
    // the sum over the tp ranks' (forward identity, backward all-reduce).
    const at::Tensor w = tp ? toolkit::copy_to_tensor_parallel_region(weight, tp) : weight;
    if (fused_on(fused_, x)) return toolkit::rms_norm(x, w, eps_);
    at::Tensor h = x.to(at::kFloat);
    at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
    h = h * at::rsqrt(variance + eps_);
    return w * h.to(x.scalar_type());
  }
  /// {x + delta, forward(x + delta)}: the residual add and the norm, one fused node when fused.
  std::pair<at::Tensor, at::Tensor> add_forward(const at::Tensor& x, const at::Tensor& delta) {
    if (fused_on(fused_, x)) return toolkit::add_rms_norm(x, delta, weight, eps_);
    at::Tensor h = x + delta;
    return {h, forward(h)};
  }
  at::Tensor weight;
  std::shared_ptr<sdk::TensorParallelGroup> tp;  // set on a norm of per-head activations (parallelize)

 private:
  double eps_;
  KernelUse fused_;
};
TORCH_MODULE(LlamaRMSNorm);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const LlamaConfig& c, const toolkit::CausalAttentionOptions& attention, KernelUse fused_rotary,
                     KernelUse fused_rms_norm)
      : torch::nn::Module("LlamaAttention"),
        fused_rotary_(fused_rotary),
        heads_(c.num_attention_heads),
        kv_heads_(c.num_key_value_heads),
        head_dim_(c.head_dim),
        attention_(attention) {
    attention_.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));  // head_dim ** -0.5
    q_proj = make_linear(*this, "q_proj", c.hidden_size, heads_ * head_dim_, c.qkv_bias());
    k_proj = make_linear(*this, "k_proj", c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias());
    v_proj = make_linear(*this, "v_proj", c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias());
    o_proj = make_linear(*this, "o_proj", heads_ * head_dim_, c.hidden_size, c.o_bias());
    if (c.qk_norm()) {
      q_norm = register_module("q_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps, fused_rms_norm));
      k_norm = register_module("k_norm", LlamaRMSNorm(head_dim_, c.rms_norm_eps, fused_rms_norm));
    }
  }

  /// x [B, T, hidden]; cos, sin [T, head_dim] for the T positions ([B, 1, T, head_dim] for packed
  /// rows, whose `segments` [B, T] keep attention inside each sample; empty: none); with a cache,
  /// the keys and values of the positions before them are read from it and these are appended.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segments,
                     KVCache* cache) {
    const std::int64_t B = x.size(0), T = x.size(1);
    // Under tensor parallelism this rank holds heads / tp query and kv_heads / tp key-value heads.
    auto heads = [&](const at::Tensor& t) { return t.view({B, T, -1, head_dim_}); };
    at::Tensor q = heads(q_proj.forward<at::Tensor>(x));
    at::Tensor k = heads(k_proj.forward<at::Tensor>(x));
    at::Tensor v = heads(v_proj.forward<at::Tensor>(x)).transpose(1, 2);
    if (q_norm) {  // Qwen3: each query and key head normalised over head_dim, before the rotary embedding
      q = q_norm(q);
      k = k_norm(k);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    if (fused_on(fused_rotary_, q) && cos.dim() == 2) {  // the fused kernel takes one set of positions for every row
      std::tie(q, k) = toolkit::rotary_embedding(q, k, cos, sin);
    } else {
      q = q * cos + rotate_half(q) * sin;
      k = k * cos + rotate_half(k) * sin;
    }
    if (cache != nullptr) std::tie(k, v) = cache->append(k, v);
    at::Tensor y = toolkit::causal_attention(q, k, v, attention_, segments);
    return o_proj.forward<at::Tensor>(y.transpose(1, 2).reshape({B, T, -1}));
  }

  /// q, k, v column-parallel (each split by head), o row-parallel.
  void parallelize(const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    for (auto* p : {&q_proj, &k_proj, &v_proj}) *p = column(*p, tp);
    o_proj = torch::nn::AnyModule(
        replace_module("o_proj", toolkit::RowParallelLinear(o_proj.get<torch::nn::LinearImpl>(), tp)));
    for (auto* norm : {&q_norm, &k_norm})
      if (*norm) (*norm)->tp = tp;  // replicated; each rank normalises its own heads
  }

  /// LoRA on the targeted projections (PEFT's names: q_proj, k_proj, v_proj, o_proj).
  void add_lora(const toolkit::LoraOptions& lora, std::vector<std::string>& matched) {
    adapt_linear(*this, "q_proj", q_proj, lora, matched);
    adapt_linear(*this, "k_proj", k_proj, lora, matched);
    adapt_linear(*this, "v_proj", v_proj, lora, matched);
    adapt_linear(*this, "o_proj", o_proj, lora, matched);
  }

  torch::nn::AnyModule q_proj, k_proj, v_proj, o_proj;
  LlamaRMSNorm q_norm{nullptr}, k_norm{nullptr};  // Qwen3's

 private:
  torch::nn::AnyModule column(torch::nn::AnyModule& linear, const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    std::string name;
    for (const auto& item : named_children())
      if (item.value().get() == linear.ptr().get()) name = item.key();
    return torch::nn::AnyModule(replace_module(name, toolkit::ColumnParallelLinear(linear.get<torch::nn::LinearImpl>(), tp)));
  }

  KernelUse fused_rotary_;
  std::int64_t heads_, kv_heads_, head_dim_;
  toolkit::CausalAttentionOptions attention_;
};
TORCH_MODULE(LlamaAttention);

/// SwiGLU: down(silu(gate(x)) * up(x)).
class LlamaMLPImpl : public torch::nn::Module {
 public:
  LlamaMLPImpl(const LlamaConfig& c, KernelUse fused_swiglu) : torch::nn::Module("LlamaMLP"), fused_swiglu_(fused_swiglu) {
    gate_proj = make_linear(*this, "gate_proj", c.hidden_size, c.intermediate_size, c.mlp_bias);
    up_proj = make_linear(*this, "up_proj", c.hidden_size, c.intermediate_size, c.mlp_bias);
    down_proj = make_linear(*this, "down_proj", c.intermediate_size, c.hidden_size, c.mlp_bias);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor gate = gate_proj.forward<at::Tensor>(x), up = up_proj.forward<at::Tensor>(x);
    return down_proj.forward<at::Tensor>(fused_on(fused_swiglu_, gate) ? toolkit::swiglu(gate, up) : at::silu(gate) * up);
  }
  /// gate and up column-parallel, down row-parallel.
  void parallelize(const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    gate_proj = torch::nn::AnyModule(
        replace_module("gate_proj", toolkit::ColumnParallelLinear(gate_proj.get<torch::nn::LinearImpl>(), tp)));
    up_proj = torch::nn::AnyModule(
        replace_module("up_proj", toolkit::ColumnParallelLinear(up_proj.get<torch::nn::LinearImpl>(), tp)));
    down_proj = torch::nn::AnyModule(
        replace_module("down_proj", toolkit::RowParallelLinear(down_proj.get<torch::nn::LinearImpl>(), tp)));
  }
  /// LoRA on the targeted projections (gate_proj, up_proj, down_proj).
  void add_lora(const toolkit::LoraOptions& lora, std::vector<std::string>& matched) {
    adapt_linear(*this, "gate_proj", gate_proj, lora, matched);
    adapt_linear(*this, "up_proj", up_proj, lora, matched);
    adapt_linear(*this, "down_proj", down_proj, lora, matched);
  }
  torch::nn::AnyModule gate_proj, up_proj, down_proj;

 private:
  KernelUse fused_swiglu_;
};
TORCH_MODULE(LlamaMLP);

/// The FSDP unit: pre-norm attention and pre-norm MLP, each added to the residual.
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  LlamaDecoderLayerImpl(const LlamaConfig& c, const toolkit::CausalAttentionOptions& attention, const LlamaKernels& k)
      : torch::nn::Module("LlamaDecoderLayer"),
        self_attn(register_module("self_attn", LlamaAttention(c, attention, k.rotary, k.rms_norm))),
        mlp(register_module("mlp", LlamaMLP(c, k.swiglu))),
        input_layernorm(register_module("input_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, k.rms_norm))),
        post_attention_layernorm(register_module("post_attention_layernorm",
                                                 LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, k.rms_norm))) {}

  /// h = x + attention(norm(x)); h + mlp(norm(h)), the first add fused into the second norm.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& segments,
                     KVCache* cache) {
    auto [h, normed] =
        post_attention_layernorm->add_forward(x, self_attn(input_layernorm(x), cos, sin, segments, cache));
    return h + mlp(normed);
  }

  LlamaAttention self_attn;
  LlamaMLP mlp;
  LlamaRMSNorm input_layernorm, post_attention_layernorm;
};
TORCH_MODULE(LlamaDecoderLayer);

/// LlamaModel: embed_tokens, layers, norm.
class LlamaModelImpl : public torch::nn::Module {
 public:
  LlamaModelImpl(const LlamaConfig& c, const toolkit::CausalAttentionOptions& attention, const LlamaKernels& kernels)
      : torch::nn::Module("LlamaModel") {
    auto embedding = torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size);
    if (c.pad_token_id) embedding.padding_idx(*c.pad_token_id);
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(embedding));
    layers = register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
      units.emplace_back(c, attention, kernels);
      layers->push_back(units.back());
    }
    norm = register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps, kernels.rms_norm));
  }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<LlamaDecoderLayer> units;
  LlamaRMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  LlamaForCausalLMImpl(const LlamaConfig& c, const toolkit::CausalAttentionOptions& attention, std::uint64_t seed,
                       const LlamaKernels& kernels = {}, const std::optional<toolkit::LoraOptions>& lora = {})
      : torch::nn::Module(c.architecture()), config(c) {
    model = register_module("model", LlamaModel(c, attention, kernels));
    if (!c.tie_word_embeddings)
      lm_head = register_module("lm_head",
                                torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
    if (lora) {  // before the draws: the adapters are initialised with the rest
      std::vector<std::string> matched;
      for (auto& layer : model->units) {
        layer->self_attn->add_lora(*lora, matched);
        layer->mlp->add_lora(*lora, matched);
      }
      toolkit::check_lora_targets_matched(*lora, matched, kLlamaLoraTargets);
      toolkit::mark_only_lora_as_trainable(*this);
    }
    for (auto& item : named_parameters()) init_parameter(item.key(), item.value(), c, seed);
  }

  /// Logits [B, T, vocab] of `ids` [B, T] at positions offset .. offset + T - 1; with caches (one
  /// per layer), the earlier positions' keys and values come from them.
  at::Tensor forward(const at::Tensor& ids, std::vector<KVCache>* caches = nullptr, std::int64_t offset = 0) {
    return logits(hidden_states(ids, {}, caches, offset));
  }
  /// The same for packed rows: `position_ids` [B, T] (sdk::Batch's; undefined: 0 .. T-1).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& position_ids) {
    return logits(hidden_states(ids, position_ids));
  }
  at::Tensor logits(const at::Tensor& x) {
    // Tied: the output head is the token embedding itself (one parameter).
    return lm_head ? lm_head(x) : at::matmul(x, model->embed_tokens->weight.t());
  }
  /// The output head's weight [vocab, hidden]: lm_head's, or the token embedding's when tied.
  at::Tensor output_weight() { return lm_head ? lm_head->weight : model->embed_tokens->weight; }

  /// The final norm's output [B, T, hidden], which lm_head maps to the logits. `position_ids`
  /// (packed rows) restart the rotary positions and the attention at each sample.
  at::Tensor hidden_states(const at::Tensor& ids, const at::Tensor& position_ids = {},
                           std::vector<KVCache>* caches = nullptr, std::int64_t offset = 0) {
    TESSERA_CHECK(!position_ids.defined() || (caches == nullptr && position_ids.sizes() == ids.sizes()),
                  "llama: position_ids ", position_ids.defined() ? position_ids.sizes() : at::IntArrayRef{},
                  " must be shaped as the ids ", ids.sizes(), " (and packed rows take no KV cache)");
    // Mistral's sliding window is accepted only where no position can leave it (llama_config.cpp):
    // a longer generation would need the mask it does not apply.
    const auto window = config.attention_window();
    // A packed row ([1, its samples' tokens]) spans what its longest sample does.
    const std::int64_t span = window && position_ids.defined() && position_ids.numel() > 0
                                  ? position_ids.max().item<std::int64_t>() + 1
                                  : offset + ids.size(1);
    TESSERA_CHECK(!window || span <= *window, "llama: position ", span - 1,
                  " is outside sliding_window = ", *window, " (", config.architecture(),
                  "), whose banded attention mask is not implemented; valid: sequences of at most ", *window,
                  " positions, prompt and generated tokens together");
    at::Tensor x = model->embed_tokens(ids);
    // cos and sin in float32 (position * inv_freq, both halves), then in the activations' dtype.
    at::Tensor positions = at::arange(offset, offset + ids.size(1), at::TensorOptions().dtype(at::kFloat).device(x.device()));
    // Made at the first forward, not in the constructor: under deferred init every tensor made
    // while the model is built is scratch memory.
    if (!inv_freq_.defined()) inv_freq_ = rope_inv_freq(config);
    if (inv_freq_.device() != x.device()) inv_freq_ = inv_freq_.to(x.device());
    at::Tensor freqs = positions.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [T, head_dim / 2]
    at::Tensor segments = at::empty({0}, ids.options().dtype(at::kLong));  // empty: one sample per row
    if (position_ids.defined()) {  // [B, 1, T, head_dim / 2]: each row's own positions, broadcast over heads
      freqs = (position_ids.to(x.device(), at::kFloat).unsqueeze(-1) * inv_freq_).unsqueeze(1);
      segments = toolkit::segments_from_positions(position_ids.to(x.device()));
    }
    at::Tensor emb = at::cat({freqs, freqs}, -1);
    at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
    for (std::size_t i = 0; i < model->units.size(); ++i)
      x = sdk::invoke(model->units[i], x, cos, sin, segments,
                      caches != nullptr ? &(*caches)[i] : static_cast<KVCache*>(nullptr));
    return model->norm(x);
  }

  /// One parameter's initialisation by its Hugging Face name (_init_weights): norms 1, biases 0,
  /// every matrix and the embedding N(0, initializer_range), the embedding's padding row 0. Each
  /// draws from its own generator seeded by the run's seed and its name, so a deferred build
  /// (unit by unit) holds the eager build's values.
  static bool init_parameter(const std::string& name, at::Tensor& p, const LlamaConfig& c, std::uint64_t seed) {
    torch::NoGradGuard no_grad;
    const std::string key = name.rfind('.', 0) == 0 ? name.substr(1) : name;  // a root unit's path is ""
    if (toolkit::init_lora_parameter(key, p, seed)) return true;  // PEFT's: lora_A kaiming uniform, lora_B zeros
    auto ends_with = [&](const std::string& tail) {
      return key.size() >= tail.size() && key.compare(key.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (ends_with("norm.weight")) {
      p.fill_(1.0);
      return true;
    }
    if (ends_with(".bias")) {
      p.zero_();
      return true;
    }
    // Drawn on the CPU whatever the device: CUDA's Philox would give a GPU build other values.
    at::Generator generator = at::detail::createCPUGenerator(XXH64(key.data(), key.size(), seed));
    at::Tensor values = p.device().is_cpu() ? p : at::empty(p.sizes(), p.options().device(at::kCPU));
    values.normal_(0.0, c.initializer_range, generator);
    if (ends_with("embed_tokens.weight") && c.pad_token_id && *c.pad_token_id < values.size(0))
      values[*c.pad_token_id].zero_();
    if (!values.is_same(p)) p.copy_(values);
    return true;
  }

  void parallelize(const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    for (auto& layer : model->units) {
      layer->self_attn->parallelize(tp);
      layer->mlp->parallelize(tp);
    }
  }

  LlamaConfig config;
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  at::Tensor inv_freq_;  // not a buffer: neither checkpointed nor sharded (Hugging Face's is non-persistent)
};
TORCH_MODULE(LlamaForCausalLM);

class Llama final : public CausalLM<LlamaForCausalLM>, public sdk::HuggingFaceModel {
 public:
  explicit Llama(const sdk::Options& o) : CausalLM("llama") {
    const LlamaConfigReader reader(o);
    config_ = read_llama_config(reader);
    attention_.kernel = toolkit::parse_attention_kernel(
        o.get_string({"attention",
                      "the attention kernel: automatic (SDPA where LibTorch has it, else blocked), sdpa, blocked "
                      "(memory linear in the sequence) or math (T^2 scores)"},
                     "automatic"),
        o.locate("attention"));
    attention_.query_block = o.get_int(
        {"attention_query_block", "queries per block of the blocked attention kernel (memory linear in the sequence)"},
        128, 1);
    predict_logits_ =
        o.get_choice(
            {"predict",
             "generate: predict continues the prompt; logits: predict returns the logits of every position (scoring)"},
            "generate", {"generate", "logits"}) == "logits";
    max_new_tokens_ = o.get_int({"max_new_tokens", "tokens predict generates after the prompt"}, 64, 1, 1 << 20);
    temperature_ = o.get_double({"temperature", "predict's sampling temperature; 0: greedy"}, 0.0, 0.0);
    top_k_ = o.get_int({"top_k", "predict samples from the k likeliest tokens; 0: all"}, 50, 0, config_.vocab_size);
    top_p_ = o.get_double(
        {"top_p", "predict samples from the smallest set of tokens whose probability reaches p (nucleus sampling)"},
        1.0, 0.0, 1.0);
    TESSERA_CHECK(top_p_ > 0.0, o.locate("top_p"), " must be in (0, 1]");
    heads_key_ = reader.where("num_key_value_heads");
    stop_ids_ = generation_eos_ids(reader.path());
    read_loss_options(o);
    read_lora(o, kLlamaLoraTargets, kLlamaLoraDefaultTargets);
    // Each key's default is documented as true (it runs where measured faster: the CPU); see KernelUse.
    auto kernel = [&](const char* key, const char* doc) {
      const bool on = o.get_bool({key, doc}, true);
      return !o.has(key) ? KernelUse::cpu_only : on ? KernelUse::everywhere : KernelUse::nowhere;
    };
    kernels_.rms_norm = kernel("fused_rms_norm",
                               "RMSNorm as toolkit::rms_norm (one pass a row; the residual add before "
                               "post_attention_layernorm fused in); false: Hugging Face's chain of ops. Left out: "
                               "fused on the CPU, not on CUDA (its kernels not yet run on a GPU)");
    kernels_.rotary = kernel("fused_rotary",
                             "the rotary embedding of q and k as toolkit::rotary_embedding (one pass); false: "
                             "rotate_half. Left out: fused on the CPU, not on CUDA");
    kernels_.swiglu = kernel("fused_swiglu",
                             "the MLP's silu(gate) * up as toolkit::swiglu (one pass, gate and up kept); false: two "
                             "ops. Left out: fused on the CPU, not on CUDA");
  }

  /// [model] predict = "logits": the logits [B, T, vocab_size] (fp32) of the prompts.
  /// Otherwise generation with a KV cache: the prompt's keys and values once (prefill), then one position
  /// per token. Rows that produced an EOS get pad tokens after it; the output is always
  /// [B, T + max_new_tokens] (predict_output's rows stack). Without sharded or tensor-parallel
  /// layers it stops as soon as every row ended; with them every rank decodes max_new_tokens
  /// positions, since each position is a collective over the ranks.
  at::Tensor predict_step(const Batch& batch, std::int64_t) override {
    at::Tensor prompt = prompts(batch);
    torch::NoGradGuard no_grad;
    if (predict_logits_) return net_->forward(prompt).to(at::kFloat);  // [predict] = "logits": scoring
    const std::int64_t B = prompt.size(0), T = prompt.size(1);
    TESSERA_CHECK(prompt.min().item<std::int64_t>() >= 0 && prompt.max().item<std::int64_t>() < config_.vocab_size,
                  "llama: a prompt token is outside [0, vocab_size = ", config_.vocab_size, ")");
    std::vector<KVCache> caches(net_->model->units.size());
    for (auto& cache : caches) cache.capacity = T + max_new_tokens_;
    const std::int64_t pad = config_.pad_token_id ? *config_.pad_token_id
                                                  : (config_.eos_token_id.empty() ? 0 : config_.eos_token_id[0]);
    at::Tensor eos = at::tensor(stop_ids_, at::kLong).to(prompt.device());
    at::Tensor out = at::full({B, T + max_new_tokens_}, pad, prompt.options());
    out.narrow(1, 0, T).copy_(prompt);
    at::Tensor finished = at::zeros({B}, prompt.options().dtype(at::kBool));
    at::Tensor logits = net_->forward(prompt, &caches, 0).select(1, T - 1);
    for (std::int64_t i = 0; i < max_new_tokens_; ++i) {
      at::Tensor next = next_token(logits.to(at::kFloat));
      // Tensor-parallel ranks compute the same row: they must feed the same token on (a draw
      // from each rank's own generator could differ), so all take tp rank 0's.
      if (tp_ && temperature_ != 0.0) next = tp_->all_gather(next.contiguous(), 0).narrow(0, 0, B);
      next = at::where(finished, at::full_like(next, pad), next);
      out.select(1, T + i).copy_(next);
      if (eos.numel() > 0) finished = finished.logical_or(at::isin(next, eos));
      if (i + 1 == max_new_tokens_ || (can_stop_early() && finished.all().item<bool>())) break;
      logits = net_->forward(next.unsqueeze(1), &caches, T + i).select(1, 0);
    }
    return out;
  }

  std::vector<std::string> fsdp_unit_classes() const override { return {"LlamaDecoderLayer"}; }

  /// What ends a generated row, as transformers' generate() has it: config.json's eos_token_id and
  /// those of the generation_config.json beside it (a chat model lists its end-of-turn token there).
  std::vector<std::int64_t> generation_eos_ids(const std::string& config_path) const {
    std::vector<std::int64_t> ids = config_.eos_token_id;
    if (config_path.empty()) return ids;
    const std::filesystem::path file = std::filesystem::path(config_path).parent_path() / "generation_config.json";
    std::ifstream in(file);
    if (!in) return ids;
    nlohmann::json generation;
    try {
      generation = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      TESSERA_FAIL(file.string(), " is not JSON: ", e.what());
    }
    const nlohmann::json eos = generation.is_object() ? generation.value("eos_token_id", nlohmann::json()) : nlohmann::json();
    for (const auto& id : eos.is_array() ? eos : nlohmann::json::array({eos})) {
      if (id.is_null()) continue;
      TESSERA_CHECK(id.is_number_integer() && id.get<std::int64_t>() >= 0 && id.get<std::int64_t>() < config_.vocab_size,
                    file.string(), ": eos_token_id ", id.dump(), " is not a token id below vocab_size = ",
                    config_.vocab_size);
      if (std::find(ids.begin(), ids.end(), id.get<std::int64_t>()) == ids.end()) ids.push_back(id.get<std::int64_t>());
    }
    return ids;
  }

  /// Each tp rank takes num_attention_heads / tp query heads, num_key_value_heads / tp key-value
  /// heads and intermediate_size / tp MLP units.
  void check_splits(std::int64_t tp) const override {
    auto splits = [&](std::int64_t d) {
      return config_.num_key_value_heads % d == 0 && config_.num_attention_heads % d == 0 &&
             config_.intermediate_size % d == 0;
    };
    if (!splits(tp)) {
      std::vector<std::string> valid;
      for (std::int64_t d = 1; d <= config_.num_key_value_heads; ++d)
        if (splits(d)) valid.push_back(std::to_string(d));
      TESSERA_FAIL(heads_key_, " = ", config_.num_key_value_heads, " (with num_attention_heads = ",
                   config_.num_attention_heads, ", intermediate_size = ", config_.intermediate_size,
                   ") does not split over tensor_parallel_size = ", tp,
                   ": each tp rank takes num_key_value_heads / tp key-value heads, their query heads and "
                   "intermediate_size / tp MLP units; valid tensor_parallel_size: ",
                   sdk::join(valid));
    }
  }

  sdk::Checkpoint hyper_parameters() const override {
    sdk::Checkpoint h = sdk::make_checkpoint();
    h.insert("hf_config_json", hf_config_json());
    h.insert("attention", toolkit::to_string(attention_.kernel));
    h.insert("predict", std::string(predict_logits_ ? "logits" : "generate"));
    h.insert("max_new_tokens", max_new_tokens_);
    h.insert("temperature", temperature_);
    h.insert("top_k", top_k_);
    h.insert("top_p", top_p_);
    h.insert("vocab_size", config_.vocab_size);
    insert_lora_hyper_parameters(h);
    return h;
  }

  std::string hf_config_json() const override {
    const LlamaConfig& c = config_;
    json j;
    j["architectures"] = {c.architecture()};
    j["model_type"] = c.model_type;
    j["vocab_size"] = c.vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.intermediate_size;
    j["num_hidden_layers"] = c.num_hidden_layers;
    j["num_attention_heads"] = c.num_attention_heads;
    j["num_key_value_heads"] = c.num_key_value_heads;
    j["head_dim"] = c.head_dim;
    j["hidden_act"] = "silu";
    j["max_position_embeddings"] = c.max_position_embeddings;
    j["initializer_range"] = c.initializer_range;
    j["rms_norm_eps"] = c.rms_norm_eps;
    j["rope_theta"] = c.rope_theta;
    if (c.rope_scaling) {
      json s;
      s["rope_type"] = c.rope_scaling->type;
      if (c.rope_scaling->type != "default") s["factor"] = c.rope_scaling->factor;
      if (c.rope_scaling->type == "llama3") {
        s["low_freq_factor"] = c.rope_scaling->low_freq_factor;
        s["high_freq_factor"] = c.rope_scaling->high_freq_factor;
        s["original_max_position_embeddings"] = static_cast<std::int64_t>(c.rope_scaling->original_max_position_embeddings);
      }
      j["rope_scaling"] = s;
    } else {
      j["rope_scaling"] = nullptr;
    }
    j["tie_word_embeddings"] = c.tie_word_embeddings;
    j["attention_bias"] = c.attention_bias;
    j["attention_dropout"] = 0.0;
    if (c.model_type == "llama") j["mlp_bias"] = c.mlp_bias;
    if (c.model_type != "llama") j["sliding_window"] = c.sliding_window ? json(*c.sliding_window) : json();
    if (c.model_type == "qwen2" || c.model_type == "qwen3") {
      j["use_sliding_window"] = false;
      j["max_window_layers"] = c.max_window_layers;
    }
    j["use_cache"] = true;
    j["pad_token_id"] = c.pad_token_id ? json(*c.pad_token_id) : json();
    j["bos_token_id"] = c.bos_token_id ? json(*c.bos_token_id) : json();
    if (c.eos_token_id.size() == 1) j["eos_token_id"] = c.eos_token_id[0];
    else if (!c.eos_token_id.empty()) j["eos_token_id"] = c.eos_token_id;
    else j["eos_token_id"] = nullptr;
    return j.dump(2);
  }

 private:
  LlamaForCausalLM make_network(std::uint64_t seed) const override {
    return LlamaForCausalLM(config_, attention_, seed, kernels_, lora_);
  }
  bool init_parameter(const std::string& name, at::Tensor& parameter) const override {
    return LlamaForCausalLMImpl::init_parameter(name, parameter, config_, init_seed_);
  }

  at::Tensor next_token(const at::Tensor& logits) const {
    return toolkit::sample_next_token(logits, {temperature_, top_k_, top_p_});
  }

  /// Whether this rank may stop decoding on its own: no layer runs collectives.
  bool can_stop_early() const {
    if (tp_) return false;
    for (const auto& layer : net_->model->units)
      if (sdk::unit_runner(*layer) != nullptr) return false;
    return sdk::unit_runner(*net_) == nullptr;
  }

  LlamaConfig config_;
  toolkit::CausalAttentionOptions attention_;
  LlamaKernels kernels_;
  bool predict_logits_ = false;
  std::int64_t max_new_tokens_ = 64;
  double temperature_ = 0.0;
  std::int64_t top_k_ = 50;
  double top_p_ = 1.0;
  std::string heads_key_;  // where num_key_value_heads came from, for the tensor-parallel size error
  std::vector<std::int64_t> stop_ids_;  // eos_token_id of config.json and generation_config.json
};

}  // namespace

sdk::PluginEntry llama_entry() {
  return sdk::plugin_entry<Llama>(
      "llama",
      "Hugging Face's LlamaForCausalLM (and Qwen2, Qwen3, Mistral): HF names and config.json; LlamaDecoderLayers are "
      "FSDP units");
}

}  // namespace tessera::models
