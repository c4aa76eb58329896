#!/usr/bin/env python3
"""The strongest eager PyTorch doing Tessera's GPU bench work, one GPU (issue 48). One row per call:

  --mode plain      no FSDP: the model on the GPU, the honest world-size-1 baseline
  --mode fsdp2      fully_shard per block + root, reshard_after_forward=False (world size 1:
                    nothing to re-gather in backward, as Tessera does not)
  --mp autocast     Tessera's bf16-mixed exactly: fp32 parameters (the master weights), compute
                    under torch.autocast(bfloat16), gradients reduced in bf16 (FSDP2's reduce_dtype)
  --mp param        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): FSDP2's own mixed
                    precision (bf16 compute copies of the fp32 shards)
  --optimizer fused (default) or foreach AdamW
  --compile         torch.compile each block (warm-up excluded): reported for information
  --profile         3 more steps under torch.profiler: the kernels by device time

The loop is forward, backward, step, zero_grad(set_to_none=True): no gradient lives through the
next forward. Attention is F.scaled_dot_product_attention(is_causal=True) (flash on the GPU); the
Llama's grouped-query attention passes enable_gqa where the torch has it. Prints one line:
  <label> tokens_per_s=X peak_cuda_mb=Y mfu=Z loss=L
MFU is torchtitan's: (6 x non-embedding parameters + 12 x layers x heads x head_dim x seq) x
tokens/s over the GPU's dense bf16 peak (--peak-tflops, default by GPU name).
--device cpu rehearses the plain row on a CPU torch (no fully_shard, no SDPA below 2.0: the math
path), so the script's API use is checked before device time is spent on it.
"""
import argparse
import math
import os
import platform
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def causal_attention(q, k, v):
    """q [B, H, T, D], k/v [B, KV, T, D] -> [B, H, T, D], causal."""
    if hasattr(F, "scaled_dot_product_attention"):
        if k.shape[1] != q.shape[1]:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except TypeError:  # torch < 2.5: no enable_gqa
                pass
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rep = q.shape[1] // k.shape[1]  # CPU rehearsal on torch 1.13: the math path
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[2]
    mask = torch.full((T, T), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    return ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask).softmax(-1) @ v


class GPTBlock(nn.Module):
    """Tessera's gpt block (pre-LayerNorm, fused qkv, GELU MLP)."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.fc, self.fc_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.attn(self.ln_1(x)).split(C, dim=2))
        x = x + self.proj(causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(a.vocab_size, a.n_embd), nn.Embedding(a.seq, a.n_embd)
        self.blocks = nn.ModuleList(GPTBlock(a.n_embd, a.n_head) for _ in range(a.n_layer))
        self.ln_f = nn.LayerNorm(a.n_embd)
        self.head = nn.Linear(a.n_embd, a.vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):  # Hugging Face's LlamaRMSNorm: computed in fp32
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaLayer(nn.Module):
    """Hugging Face's LlamaDecoderLayer (rotary embeddings, GQA, SwiGLU)."""

    def __init__(self, a):
        super().__init__()
        D = a.n_embd // a.n_head
        self.H, self.KV, self.D = a.n_head, a.n_kv_head, D
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(a.n_embd, 1e-5), RMSNorm(a.n_embd, 1e-5)
        self.q_proj = nn.Linear(a.n_embd, self.H * D, bias=False)
        self.k_proj = nn.Linear(a.n_embd, self.KV * D, bias=False)
        self.v_proj = nn.Linear(a.n_embd, self.KV * D, bias=False)
        self.o_proj = nn.Linear(self.H * D, a.n_embd, bias=False)
        self.gate_proj = nn.Linear(a.n_embd, a.intermediate, bias=False)
        self.up_proj = nn.Linear(a.n_embd, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, a.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.KV, self.D).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.KV, self.D).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        x = x + self.o_proj(causal_attention(q, k, v).transpose(1, 2).reshape(B, T, self.H * self.D))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.n_embd)
        self.layers = nn.ModuleList(LlamaLayer(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.n_embd, 1e-5)
        self.lm_head = nn.Linear(a.n_embd, a.vocab_size, bias=False)
        D = a.n_embd // a.n_head
        inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def blocks(self):
        return self.layers

    def forward(self, idx):
        freqs = torch.outer(torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def train_step(model, opt, x, y, a, autocast):
    with torch.autocast(a.device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, a.vocab_size), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def profile_steps(a, cuda, step, steps=3):
    """Where `steps` steps go: the device's kernels by time (the host's operators on the CPU),
    as tessera's `[trainer] profiler = "pytorch"` reports its own."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    averages = prof.key_averages()
    key = next((k for k in ("self_device_time_total", "self_cuda_time_total") if hasattr(averages[0], k)), None) if cuda else None
    if key:
        kernels = sum(getattr(e, key) for e in averages) / 1e3 / steps
        print(f"profile: {wall_ms:.1f} ms per step, device kernels {kernels:.1f} ms per step ({100 * kernels / wall_ms:.0f}%)")
    print(averages.table(sort_by=key or "cpu_time_total", row_limit=20), flush=True)


def flops_per_token(model, a):
    """torchtitan's: 6 x non-embedding parameters + 12 x layers x heads x head_dim x seq."""
    embedding = model.wte.weight.numel() + model.wpe.weight.numel() if a.model == "gpt" else model.embed_tokens.weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    return 6 * params + 12 * a.n_layer * a.n_head * (a.n_embd // a.n_head) * a.seq


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["gpt", "llama"], default="llama")
    p.add_argument("--mode", choices=["plain", "fsdp2"], default="fsdp2")
    p.add_argument("--mp", choices=["autocast", "param", "none"], default="autocast")
    p.add_argument("--optimizer", choices=["fused", "foreach"], default="fused")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=2048)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--n-kv-head", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--versions", action="store_true", help="print torch/CUDA/GPU/CPU and exit")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, 3 more under torch.profiler: print where they went (kernels by device time)")
    a = p.parse_args()
    cuda = a.device == "cuda"
    gpu = torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "none"
    if a.versions:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
        print(f"torch {torch.__version__} cuda {torch.version.cuda} gpu {gpu} cpu {cpu}")
        return
    label = f"pytorch {a.mode}" + (f" mp={a.mp}" if a.mp != "none" else "") + f" {a.optimizer}-adamw" + (" compiled" if a.compile else "")
    if a.mode == "fsdp2":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    with torch.device(a.device) if hasattr(torch, "device") and hasattr(torch.device, "__enter__") else _nullcontext():
        model = (GPT if a.model == "gpt" else Llama)(a).to(a.device)
    flops = flops_per_token(model, a)
    autocast = a.mp == "autocast"
    if a.mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if a.mp == "param"
              else MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if autocast else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    elif a.mp == "param":
        model = model.to(torch.bfloat16)  # no FSDP: bf16 parameters are the only "param" policy there is
    if a.compile:
        for block in model.blocks:
            block.compile()
    opt_kw = {"fused": True} if a.optimizer == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **opt_kw)
    data = torch.randint(0, 256, (a.batch, a.seq + 1), device=a.device)
    x, y = data[:, :-1], data[:, 1:]
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        loss = train_step(model, opt, x, y, a, autocast)
    sync()
    elapsed = time.perf_counter() - start
    if a.profile:
        profile_steps(a, cuda, lambda: train_step(model, opt, x, y, a, autocast))
    tps = a.steps * a.batch * a.seq / elapsed
    peak = a.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), 0.0)
    print(f"{label} tokens_per_s={tps:.0f} "
          + (f"peak_cuda_mb={torch.cuda.max_memory_allocated() / 2**20:.0f} " if cuda else "")
          + (f"mfu={flops * tps / (peak * 1e12):.3f} " if peak else "")
          + f"flops_per_token={flops} loss={loss.item():.3f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
