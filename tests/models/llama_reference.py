#!/usr/bin/python3
"""Random Hugging Face Llama checkpoints and what Hugging Face's modeling code computes on them.

Usage: llama_reference.py OUT_DIR

For each configuration below, OUT_DIR/NAME/ gets config.json and model.safetensors (fp32, the
files LlamaForCausalLM.save_pretrained writes), and expected.safetensors: fixed token rows
(input_ids, labels), their logits, the mean cross-entropy loss, the loss's gradient for every
parameter (grad.NAME), and greedy generation (prompt, greedy: prompt + 8 tokens; greedy_text: the
same from the bytes of "Q: ").

The model is an independent PyTorch implementation of transformers'
src/transformers/models/llama/modeling_llama.py (LlamaRMSNorm, LlamaRotaryEmbedding with
modeling_rope_utils' default / linear / llama3 inverse frequencies, rotate_half,
apply_rotary_pos_emb, repeat_kv, eager_attention_forward with the additive causal mask,
LlamaMLP, LlamaDecoderLayer, LlamaModel, LlamaForCausalLM) and of its variants, written for
this test: no transformers package is needed. Qwen2 (modeling_qwen2.py): biased q/k/v, unbiased
o_proj. Qwen3 (modeling_qwen3.py): Qwen3RMSNorm of each query and key head (q_norm, k_norm over
head_dim) before the rotary embedding, attention_bias on all four projections, no MLP bias, and
Qwen3Config's head_dim of 128 when config.json has none. Mistral (modeling_mistral.py): no biases;
sliding_window null. Greedy generation
recomputes the whole sequence for every token (no cache), as generate(use_cache=False) would.
"""
import json
import math
import os
import struct
import sys

import torch
from torch import nn
import torch.nn.functional as F

CONFIGS = {
    # grouped-query attention (6 query heads over 2 key-value heads), untied head, rope_theta
    "gqa_untied": dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, rope_theta=500000.0,
                       tie_word_embeddings=False, rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1),
    # tied embeddings, llama3 rope scaling (wavelengths in all three bands for head_dim 12)
    "tied_llama3": dict(vocab_size=290, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=16),
                        max_position_embeddings=64, eos_token_id=[2, 3]),
    # attention_bias (q, k, v and o), explicit head_dim (4 x 16 != 48), a padding token
    "bias_head_dim": dict(vocab_size=270, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                          mlp_bias=True, pad_token_id=0, tie_word_embeddings=False),
    # Qwen2: biased q, k and v, unbiased o_proj
    "qwen2": dict(model_type="qwen2", vocab_size=260, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
                  rms_norm_eps=1e-6),
    # Qwen3: q/k norms, explicit head_dim (4 x 16 != 32), tied; a window present but unused
    "qwen3": dict(model_type="qwen3", vocab_size=280, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  rope_theta=1000000.0, use_sliding_window=False, sliding_window=4096, max_window_layers=2,
                  eos_token_id=2),
    # Qwen3 with attention_bias (q, k, v and o), MQA, no head_dim: Qwen3Config's 128 (2 x 128 != 32)
    "qwen3_bias": dict(model_type="qwen3", vocab_size=264, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, attention_bias=True, rms_norm_eps=1e-5),
    # Mistral: the Llama layout without biases, explicit head_dim (6 x 12 != 48), no sliding window
    "mistral": dict(model_type="mistral", vocab_size=250, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=12, sliding_window=None,
                    bos_token_id=1, eos_token_id=2),
}
ARCHITECTURES = dict(llama="LlamaForCausalLM", qwen2="Qwen2ForCausalLM", qwen3="Qwen3ForCausalLM",
                     mistral="MistralForCausalLM")

DEFAULTS = dict(model_type="llama", hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02,
                rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                attention_dropout=0.0, mlp_bias=False, tie_word_embeddings=False, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)


class Config:
    def __init__(self, d):
        for k, v in {**DEFAULTS, **d}.items():
            setattr(self, k, v)
        if getattr(self, "head_dim", None) is None:  # Qwen3Config's head_dim defaults to 128
            self.head_dim = 128 if self.model_type == "qwen3" else self.hidden_size // self.num_attention_heads


# --- modeling_rope_utils.py ---------------------------------------------------------------------
def rope_inv_freq(config):
    base, dim = config.rope_theta, config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    assert rope_type == "llama3"
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


# --- modeling_llama.py ------------------------------------------------------------------------
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        # Qwen2: q/k/v always biased, o never; Llama, Qwen3: attention_bias on all four; Mistral: none
        qkv_bias = config.model_type == "qwen2" or (config.attention_bias and config.model_type != "mistral")
        o_bias = config.attention_bias and config.model_type in ("llama", "qwen3")
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:  # Qwen3RMSNorm is LlamaRMSNorm, over head_dim only
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.qk_norm:  # Qwen3Attention: normalised per head before the transpose and the rotary embedding
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output = eager_attention_forward(self, query_states, key_states, value_states, attention_mask,
                                              self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        position_ids = torch.arange(seq).unsqueeze(0)
        # _update_causal_mask / create_causal_mask (eager): dtype's min above the diagonal
        min_dtype = torch.finfo(inputs_embeds.dtype).min
        causal_mask = torch.full((seq, seq), fill_value=min_dtype, dtype=inputs_embeds.dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)[None, None, :, :]
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def write_safetensors(path, tensors):
    """The safetensors format: 8-byte little-endian header length, JSON header, raw data."""
    kinds = {torch.float32: "F32", torch.int64: "I64"}
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, t in tensors.items():
        data = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": kinds[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main(out_dir):
    for index, (name, overrides) in enumerate(CONFIGS.items()):
        torch.manual_seed(1000 + index)
        config = Config(overrides)
        model = LlamaForCausalLM(config).float()
        with torch.no_grad():  # random weights large enough that the logits spread out
            for pname, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.1 if "norm" not in pname else 0.2) + (1.0 if "norm" in pname else 0.0))
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        cfg = {k: v for k, v in {**DEFAULTS, **overrides}.items()}
        cfg["architectures"] = [ARCHITECTURES[config.model_type]]
        cfg["torch_dtype"] = "float32"
        cfg["transformers_version"] = "4.48.0"
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        # save_pretrained leaves the tied head out
        state = {k: v for k, v in model.state_dict().items()
                 if not (config.tie_word_embeddings and k == "lm_head.weight")}
        write_safetensors(os.path.join(d, "model.safetensors"), state)

        input_ids = torch.randint(0, config.vocab_size, (3, 13))
        labels = torch.randint(0, config.vocab_size, (3, 13))
        logits = model(input_ids)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), labels.reshape(-1))
        loss.backward()
        expected = {"input_ids": input_ids, "labels": labels, "logits": logits.detach(), "loss": loss.detach().reshape(1)}
        for pname, p in model.named_parameters():  # the tied weight once, under its embedding name
            expected["grad." + pname] = p.grad
        prompt = torch.randint(3, config.vocab_size, (2, 5))
        # generate(do_sample=False): after a row's EOS its tokens are the pad token (pad_token_id,
        # else the first EOS); kept at full length here, as Tessera's predict returns it.
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else \
            ([] if config.eos_token_id is None else [config.eos_token_id])
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        def greedy(prompt):
            tokens, unfinished = prompt, torch.ones(prompt.shape[0], dtype=torch.bool)
            with torch.no_grad():
                for _ in range(8):
                    nxt = model(tokens)[:, -1].argmax(-1)
                    nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
                    tokens = torch.cat([tokens, nxt[:, None]], 1)
                    unfinished &= ~torch.isin(nxt, torch.tensor(eos, dtype=torch.long))
            return tokens

        tokens = greedy(prompt)
        # the text data plugin's default prompt "Q: " as byte ids (tessera predict's end-to-end test)
        expected["greedy_text"] = greedy(torch.tensor([list(b"Q: ")], dtype=torch.long))
        expected["prompt"] = prompt
        expected["greedy"] = tokens
        write_safetensors(os.path.join(d, "expected.safetensors"), expected)


if __name__ == "__main__":
    main(sys.argv[1])
