#!/usr/bin/env python3
"""PyTorch's own DDP (Gloo, CPU) or FSDP on the same byte-level GPT Tessera trains (or, with
--model llama, the same Llama: Hugging Face's LlamaForCausalLM as Tessera's llama plugin computes
it): the reference Tessera's throughput is compared against in bench/training/run.sh. Prints one line:
  pytorch <strategy> ranks=N tokens_per_s=X peak_rss_mb=Y
Each rank gets the threads Tessera gives it: cores / ranks, LibTorch's pool and OpenBLAS's.
Run with Debian's python3-torch: /usr/bin/python3 pytorch_ddp_gpt.py --ranks 2 --steps 20
"""
import argparse
import math
import os
import resource
import time


def arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    # --model llama: bench/training/llama.toml's shapes (n_layer, n_head and n_embd as above)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--port", type=int, default=29512)
    return p.parse_args()


if __name__ == "__main__":  # imported (bench/gpu reuses GPT), the importer's arguments are not ours
    ARGS = arguments()
    # The threads Tessera gives each rank: cores / ranks, for LibTorch's pool (worker() below)
    # and OpenBLAS's own, which reads this when it loads (so before import torch).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, os.cpu_count() // ARGS.ranks)))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(C, dim=2)
        H, D = self.n_head, C // self.n_head
        q, k, v = (t.view(B, T, H, D).transpose(1, 2).reshape(B * H, T, D) for t in (q, k, v))
        # As Tessera's gpt computes it: the causal mask and the scale inside the scores' GEMM.
        bias = torch.full((T, T), float("-inf"), dtype=q.dtype, device=x.device).triu(1)
        att = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(D)).softmax(-1)
        y = torch.bmm(att, v).view(B, H, T, D).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size):
        super().__init__()
        self.wte = nn.Embedding(256, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        # Tessera's gpt plugin's initialisation (nanoGPT's): LayerNorms 1 and 0, other vectors 0,
        # matrices N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 n_layer)); PyTorch's
        # defaults (N(0, 1) embeddings, tied to the head) would start at a loss of ~30, not ln 256.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln_" in name:
                    continue
                if p.dim() == 1:
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02 / math.sqrt(2 * n_layer) if "proj.weight" in name else 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaLayer(nn.Module):
    """Hugging Face's LlamaDecoderLayer; attention as Tessera's toolkit computes it at 128
    positions (its math path: scale and mask in the scores' GEMM, keys and values repeated)."""

    def __init__(self, n_embd, n_head, kv_heads, intermediate):
        super().__init__()
        self.H, self.Hkv, self.D = n_head, kv_heads, n_embd // n_head
        self.input_layernorm = RMSNorm(n_embd)
        self.q_proj = nn.Linear(n_embd, n_head * self.D, bias=False)
        self.k_proj = nn.Linear(n_embd, kv_heads * self.D, bias=False)
        self.v_proj = nn.Linear(n_embd, kv_heads * self.D, bias=False)
        self.o_proj = nn.Linear(n_head * self.D, n_embd, bias=False)
        self.post_attention_layernorm = RMSNorm(n_embd)
        self.gate_proj = nn.Linear(n_embd, intermediate, bias=False)
        self.up_proj = nn.Linear(n_embd, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, -1, self.D).transpose(1, 2)
        k = self.k_proj(h).view(B, T, -1, self.D).transpose(1, 2)
        v = self.v_proj(h).view(B, T, -1, self.D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        g = self.H // self.Hkv
        k = k[:, :, None].expand(B, self.Hkv, g, T, self.D).reshape(B * self.H, T, self.D)
        v = v[:, :, None].expand(B, self.Hkv, g, T, self.D).reshape(B * self.H, T, self.D)
        bias = torch.full((T, T), float("-inf"), dtype=q.dtype, device=x.device).triu(1)
        att = torch.baddbmm(bias, q.reshape(B * self.H, T, self.D), k.transpose(1, 2),
                            alpha=1.0 / math.sqrt(self.D)).softmax(-1)
        y = torch.bmm(att, v).view(B, self.H, T, self.D).transpose(1, 2).reshape(B, T, C)
        x = x + self.o_proj(y)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """A byte-level LlamaForCausalLM with tied embeddings, initialised as Hugging Face does."""

    def __init__(self, n_layer, n_head, n_embd, kv_heads, intermediate):
        super().__init__()
        self.embed_tokens = nn.Embedding(256, n_embd)
        self.layers = nn.ModuleList(LlamaLayer(n_embd, n_head, kv_heads, intermediate) for _ in range(n_layer))
        self.norm = RMSNorm(n_embd)
        d = n_embd // n_head
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.02)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        freqs = torch.arange(idx.size(1), dtype=torch.float)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.embed_tokens.weight.t()


def worker(rank, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(max(1, os.cpu_count() // args.ranks))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    if args.model == "llama":
        model = Llama(args.n_layer, args.n_head, args.n_embd, args.kv_heads, args.intermediate)
    else:
        model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)
    if args.strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        model = FSDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 256, (args.steps + args.warmup, args.batch_size, args.block_size + 1))
    for step in range(args.steps + args.warmup):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        x, y = data[step, :, :-1], data[step, :, 1:]
        loss = F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.batch_size * args.block_size * args.ranks
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"pytorch {args.strategy} ranks={args.ranks} tokens_per_s={tokens / elapsed:.1f} "
              f"peak_rss_mb={rss.item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(ARGS,), nprocs=ARGS.ranks)
