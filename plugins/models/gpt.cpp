// `gpt`: a byte-level decoder-only transformer (nanoGPT's architecture). Each Block is an
// FSDP unit: the network runs it through sdk::invoke(); parallelize() splits its attention heads
// and MLP over a tensor-parallel group (Megatron-style).
#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "causal_lm.hpp"
#include "models.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/tensor_parallel.hpp"
#include "tessera/sdk/unit.hpp"
#include "tessera/toolkit/attention.hpp"
#include "tessera/toolkit/lora.hpp"
#include "tessera/toolkit/sampling.hpp"
#include "tessera/toolkit/tensor_parallel.hpp"

#define XXH_INLINE_ALL  // header-only: plugins link the SDK alone
#include <xxhash.h>

namespace tessera::models {

namespace F = torch::nn::functional;
using sdk::Batch;

namespace {

constexpr std::int64_t kByteVocab = 256;  // the default: bytes (the `text` data plugin)

/// The Linear modules of a Block that [model.lora] target_modules may name: the fused q/k/v
/// projection `attn`, the attention output `proj`, the MLP's `fc` and `fc_proj` (GPT-2's c_attn,
/// c_proj, c_fc, mlp.c_proj); PEFT's default for GPT-2 is its fused c_attn, so `attn` here.
const std::vector<std::string> kGptLoraTargets{"attn", "proj", "fc", "fc_proj"};
const std::vector<std::string> kGptLoraDefaultTargets{"attn"};

struct GPTConfig {
  std::int64_t n_layer, n_head, n_embd, block_size;
  double dropout;
  bool bias, tie_embeddings;
  std::int64_t vocab_size;  // ids 0 .. vocab_size - 1 (a tokenizer's, or bytes)
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& c)
      : torch::nn::Module("Block"),
        n_head_(c.n_head),
        ln_1(register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})))),
        attn(linear("attn", c.n_embd, 3 * c.n_embd, c.bias)),
        proj(linear("proj", c.n_embd, c.n_embd, c.bias)),
        ln_2(register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})))),
        fc(linear("fc", c.n_embd, 4 * c.n_embd, c.bias)),
        fc_proj(linear("fc_proj", 4 * c.n_embd, c.n_embd, c.bias)),
        dropout(register_module("dropout", torch::nn::Dropout(c.dropout))) {}

  /// x [B, T, C]; `segments` [B, T] keep packed samples' attention apart (empty: one per row).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& segments) {
    // Under tensor parallelism this rank computes n_head / tp of the heads; C is the full width.
    const std::int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / n_head_;
    const std::int64_t H = n_head_ / tp_size(), local = H * D;
    auto qkv = attn.forward<at::Tensor>(ln_1(x)).split(local, 2);
    auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, D}).transpose(1, 2); };
    // The toolkit's causal attention (SDPA on LibTorch 2, the query-blocked kernel on 1.13 past
    // 128 positions); attention dropout needs the probabilities, so it takes the math path.
    toolkit::CausalAttentionOptions attention;
    if (dropout->is_training() && dropout->options.p() > 0.0)
      attention.dropout = [this](const at::Tensor& probs) { return attention_dropout(probs); };
    at::Tensor y = toolkit::causal_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), attention, segments);
    y = y.transpose(1, 2).contiguous().view({B, T, local});
    at::Tensor h = x + dropout(proj.forward<at::Tensor>(y));
    return h + dropout(fc_proj.forward<at::Tensor>(F::gelu(fc.forward<at::Tensor>(ln_2(h)))));
  }

  /// LoRA on the targeted Linear modules (kGptLoraTargets' names); `matched` gains each one applied.
  void add_lora(const toolkit::LoraOptions& lora, std::vector<std::string>& matched) {
    for (auto [name, linear] : {std::pair{"attn", &attn}, {"proj", &proj}, {"fc", &fc}, {"fc_proj", &fc_proj}}) {
      const auto& targets = lora.target_modules;
      if (std::find(targets.begin(), targets.end(), name) == targets.end()) continue;
      *linear = replace(name, toolkit::LoraLinear(linear->get<torch::nn::LinearImpl>(), lora));
      if (std::find(matched.begin(), matched.end(), name) == matched.end()) matched.push_back(name);
    }
  }

  /// Megatron's plan: q, k, v and fc column-parallel (q, k and v each split by head: the
  /// fused weight is 3 parts), proj and fc_proj row-parallel; LayerNorms replicated.
  void parallelize(const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    tp_ = tp;
    attn = replace("attn", toolkit::ColumnParallelLinear(attn.get<torch::nn::LinearImpl>(), tp, /*stride=*/3));
    proj = replace("proj", toolkit::RowParallelLinear(proj.get<torch::nn::LinearImpl>(), tp));
    fc = replace("fc", toolkit::ColumnParallelLinear(fc.get<torch::nn::LinearImpl>(), tp));
    fc_proj = replace("fc_proj", toolkit::RowParallelLinear(fc_proj.get<torch::nn::LinearImpl>(), tp));
  }

 private:
  torch::nn::AnyModule linear(const std::string& name, std::int64_t in, std::int64_t out, bool bias) {
    return torch::nn::AnyModule(register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias))));
  }
  template <typename Holder>
  torch::nn::AnyModule replace(const std::string& name, Holder module) {
    return torch::nn::AnyModule(replace_module(name, module));
  }

  std::int64_t tp_size() const { return tp_ ? tp_->size() : 1; }

  // The attention probabilities of this rank's heads. Under tensor parallelism the mask is drawn
  // for all heads and cut, as the single-device model draws it: the generator advances the same
  // on every tp rank (replicated activations need identical masks) and a tp run with dropout
  // equals the single-device run, at the cost of drawing tp times the local mask.
  at::Tensor attention_dropout(const at::Tensor& att) {
    if (tp_size() == 1 || !dropout->is_training() || dropout->options.p() == 0.0) return dropout(att);
    at::Tensor full_shape_mask =
        dropout(at::ones({att.size(0), n_head_, att.size(2), att.size(3)}, att.options()));
    return att * full_shape_mask.narrow(1, tp_->rank() * att.size(1), att.size(1));
  }

  std::int64_t n_head_;
  std::shared_ptr<sdk::TensorParallelGroup> tp_;

 public:
  torch::nn::LayerNorm ln_1;
  torch::nn::AnyModule attn, proj;  // Linear, or its tensor-parallel counterpart after parallelize()
  torch::nn::LayerNorm ln_2;
  torch::nn::AnyModule fc, fc_proj;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(Block);

class GPTNetImpl : public torch::nn::Module {
 public:
  GPTNetImpl(const GPTConfig& c, std::uint64_t init_seed, const std::optional<toolkit::LoraOptions>& lora = {})
      : torch::nn::Module("GPT"), config(c) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
    wpe = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
    drop = register_module("drop", torch::nn::Dropout(c.dropout));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.n_layer; ++i) {
      units.emplace_back(c);
      blocks->push_back(units.back());
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
    if (!c.tie_embeddings)
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, c.vocab_size).bias(false)));
    if (lora) {  // before the draws: the adapters are initialised with the rest
      std::vector<std::string> matched;
      for (auto& block : units) block->add_lora(*lora, matched);
      toolkit::check_lora_targets_matched(*lora, matched, kGptLoraTargets);
      toolkit::mark_only_lora_as_trainable(*this);
    }
    for (auto& item : named_parameters()) init_parameter(item.key(), item.value(), c.n_layer, init_seed);
  }

  at::Tensor forward(const at::Tensor& idx, const at::Tensor& position_ids = {}) {
    at::Tensor x = hidden_states(idx, position_ids);
    // Tied: the output head is the token embedding itself (one parameter).
    return lm_head ? lm_head(x) : at::matmul(x, wte->weight.t());
  }
  /// The output head's weight [vocab, n_embd]: lm_head's, or the token embedding's when tied.
  at::Tensor output_weight() { return lm_head ? lm_head->weight : wte->weight; }

  /// ln_f's output [B, T, n_embd], which the output head maps to the logits. `position_ids`
  /// (packed rows) restart the positional table and the attention at each sample.
  at::Tensor hidden_states(const at::Tensor& idx, const at::Tensor& position_ids = {}) {
    const std::int64_t T = idx.size(1);
    TESSERA_CHECK(!position_ids.defined() || position_ids.sizes() == idx.sizes(), "gpt: position_ids ",
                  position_ids.defined() ? position_ids.sizes() : at::IntArrayRef{}, " must be shaped as the ids ",
                  idx.sizes());
    // A packed row is longer than its samples: its positions are what must fit the table (read
    // where the batch is on the host; on a device the lookup itself refuses).
    const std::int64_t span = !position_ids.defined() ? T
                              : position_ids.is_cpu() && position_ids.numel() > 0 ? position_ids.max().item<std::int64_t>() + 1
                                                                                  : 0;
    TESSERA_CHECK(span <= config.block_size, "gpt: a sequence of ", span, " tokens exceeds [model] block_size = ",
                  config.block_size, " (the positional table's length); set [data] block_size to at most that");
    at::Tensor pos = at::arange(T, at::TensorOptions().dtype(at::kLong).device(idx.device()));
    at::Tensor segments = at::empty({0}, pos.options());  // empty: one sample per row
    if (position_ids.defined()) {
      pos = position_ids.to(idx.device(), at::kLong);
      segments = toolkit::segments_from_positions(pos);
    }
    at::Tensor x = drop(wte(idx) + wpe(pos));
    for (auto& block : units) x = sdk::invoke(block, x, segments);
    return ln_f(x);
  }

  /// One parameter's initialisation, by its name in the network (nanoGPT's): LayerNorms keep
  /// their 1 and 0 (returns false), other vectors 0, matrices N(0, 0.02), the residual
  /// projections N(0, 0.02 / sqrt(2 n_layer)). Each matrix draws from its own generator, seeded
  /// by the run's seed and its name, so that a deferred build (unit by unit, in another order)
  /// holds the eager build's values, not only their distribution.
  static bool init_parameter(const std::string& name, at::Tensor& p, std::int64_t n_layer, std::uint64_t seed) {
    if (name.find("ln_") != std::string::npos) return false;
    torch::NoGradGuard no_grad;
    if (p.dim() == 1) {
      p.zero_();
      return true;
    }
    const std::string key = name.rfind('.', 0) == 0 ? name.substr(1) : name;  // a root unit's path is ""
    if (toolkit::init_lora_parameter(key, p, seed)) return true;  // PEFT's: lora_A kaiming uniform, lora_B zeros
    // Drawn on the CPU whatever the device: CUDA's Philox would give a GPU build other values.
    at::Generator generator = at::detail::createCPUGenerator(XXH64(key.data(), key.size(), seed));
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layer));
    at::Tensor values = p.device().is_cpu() ? p : at::empty(p.sizes(), p.options().device(at::kCPU));
    values.normal_(0.0, key.find("proj.weight") != std::string::npos ? residual_std : 0.02, generator);
    if (!values.is_same(p)) p.copy_(values);
    return true;
  }

  /// Tensor parallelism inside every block; embeddings, ln_f and lm_head stay replicated.
  void parallelize(const std::shared_ptr<sdk::TensorParallelGroup>& tp) {
    for (auto& block : units) block->parallelize(tp);
  }

  GPTConfig config;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<Block> units;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(GPTNet);

class GPT final : public CausalLM<GPTNet> {
 public:
  explicit GPT(const sdk::Options& o)
      : CausalLM("gpt"),
        config_{o.get_int({"n_layer", "transformer blocks (nanoGPT's n_layer)"}, 4, 1),
                o.get_int({"n_head", "attention heads per block; must divide n_embd"}, 4, 1),
                o.get_int({"n_embd", "the embedding (residual stream) width"}, 128, 1),
                o.get_int({"block_size", "the context: the longest sequence the model takes"}, 128, 1),
                o.get_double({"dropout", "nanoGPT's dropout probability, applied while training"}, 0.0, 0.0,
                             1.0),
                o.get_bool({"bias", "biases in the linear layers and LayerNorms (nanoGPT's bias)"}, true),
                o.get_bool({"tie_embeddings", "the output projection shares the token embedding's weight"}, true),
                o.get_int({"vocab_size", "token ids the model embeds (256: bytes)"}, kByteVocab, 1, INT32_MAX)},
        max_new_tokens_(o.get_int({"max_new_tokens", "tokens predict generates after the prompt"}, 200, 1, 65536)),
        temperature_(o.get_double({"temperature", "predict's sampling temperature"}, 0.8, 1e-6)),
        top_k_(o.get_int({"top_k", "predict samples from the k likeliest tokens; 0: all"}, 40, 0, config_.vocab_size)),
        weight_decay_norms_and_biases_(
            o.get_bool({"weight_decay_norms_and_biases",
                        "false: nanoGPT's two param groups, no weight decay for biases and LayerNorm weights"},
                       true)),
        n_head_key_(o.locate("n_head")) {
    read_loss_options(o);
    read_lora(o, kGptLoraTargets, kGptLoraDefaultTargets);
    TESSERA_CHECK(config_.n_embd % config_.n_head == 0, o.locate("n_embd"), " = ", config_.n_embd,
                  " must be divisible by n_head = ", config_.n_head, " (",
                  o.locate("n_head"), ")");
  }

  at::Tensor predict_step(const Batch& batch, std::int64_t) override {
    at::Tensor idx = prompts(batch);
    torch::NoGradGuard no_grad;
    for (std::int64_t i = 0; i < max_new_tokens_; ++i) {
      at::Tensor context = idx.size(1) <= config_.block_size ? idx : idx.narrow(1, idx.size(1) - config_.block_size,
                                                                              config_.block_size);
      at::Tensor logits = net_->forward(context).select(1, context.size(1) - 1).to(at::kFloat);
      idx = at::cat({idx, toolkit::sample_next_token(logits, {temperature_, top_k_}).unsqueeze(1)}, 1);
    }
    return idx;
  }

  std::vector<std::string> fsdp_unit_classes() const override { return {"Block"}; }

  /// Each tp rank takes n_head / tp heads (and 4 n_embd / tp of the MLP's hidden units).
  void check_splits(std::int64_t tp) const override {
    if (config_.n_head % tp != 0 || (4 * config_.n_embd) % tp != 0) {
      std::vector<std::string> valid;
      for (std::int64_t d = 1; d <= config_.n_head; ++d)
        if (config_.n_head % d == 0 && (4 * config_.n_embd) % d == 0) valid.push_back(std::to_string(d));
      TESSERA_FAIL(n_head_key_, " = ", config_.n_head, " (with n_embd = ", config_.n_embd,
                   ") does not split over tensor_parallel_size = ", tp,
                   ": each tp rank takes n_head / tp heads and 4 n_embd / tp MLP units; valid tensor_parallel_size: ",
                   sdk::join(valid), " (or change n_head)");
    }
  }

  /// nanoGPT's and Megatron's grouping when weight_decay_norms_and_biases = false: weight decay
  /// for the matrices and embeddings, none for biases and LayerNorm weights (a second group).
  std::unique_ptr<torch::optim::Optimizer> configure_optimizers(const std::vector<sdk::NamedParameter>& params,
                                                                const sdk::OptimizerSettings& settings) override {
    std::vector<sdk::NamedParameter> decayed, not_decayed;
    for (const auto& p : params) {
      const bool norm_or_bias = p.name.find("ln_") != std::string::npos ||
                                (p.name.size() >= 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0);
      (norm_or_bias && !weight_decay_norms_and_biases_ ? not_decayed : decayed).push_back(p);
    }
    if (not_decayed.empty() || decayed.empty()) return sdk::make_optimizer(params, settings);
    auto optimizer = sdk::make_optimizer(decayed, settings);
    sdk::OptimizerSettings no_decay = settings;
    no_decay.weight_decay = 0.0;
    auto options = sdk::make_optimizer(not_decayed, no_decay)->param_groups()[0].options().clone();
    std::vector<at::Tensor> tensors;
    for (const auto& p : not_decayed) tensors.push_back(p.tensor);
    optimizer->add_param_group(torch::optim::OptimizerParamGroup(tensors, std::move(options)));
    return optimizer;
  }

  sdk::Checkpoint hyper_parameters() const override {
    sdk::Checkpoint h = sdk::make_checkpoint();
    h.insert("n_layer", config_.n_layer);
    h.insert("n_head", config_.n_head);
    h.insert("n_embd", config_.n_embd);
    h.insert("block_size", config_.block_size);
    h.insert("dropout", config_.dropout);
    h.insert("bias", config_.bias);
    h.insert("tie_embeddings", config_.tie_embeddings);
    h.insert("max_new_tokens", max_new_tokens_);
    h.insert("temperature", temperature_);
    h.insert("top_k", top_k_);
    h.insert("weight_decay_norms_and_biases", weight_decay_norms_and_biases_);
    h.insert("vocab_size", config_.vocab_size);
    insert_lora_hyper_parameters(h);
    return h;
  }

 private:
  GPTNet make_network(std::uint64_t seed) const override { return GPTNet(config_, seed, lora_); }
  bool init_parameter(const std::string& name, at::Tensor& parameter) const override {
    return GPTNetImpl::init_parameter(name, parameter, config_.n_layer, init_seed_);
  }

  GPTConfig config_;
  std::int64_t max_new_tokens_;
  double temperature_;
  std::int64_t top_k_;
  bool weight_decay_norms_and_biases_;
  std::string n_head_key_;  // "file:line: [model] n_head", for the tensor-parallel size error
};

}  // namespace

sdk::PluginEntry gpt_entry() {
  return sdk::plugin_entry<GPT>("gpt", "decoder-only transformer over vocab_size ids (bytes by default); its Blocks are FSDP units");
}

}  // namespace tessera::models
