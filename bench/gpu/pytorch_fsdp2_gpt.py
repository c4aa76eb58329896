#!/usr/bin/env python3
"""PyTorch's own FSDP2 (fully_shard) on the same GPT as Tessera's bench, one GPU, NCCL world
size 1: the reference for Tessera's CUDA path. Prints tokens/s and peak CUDA memory.
--device cpu (Gloo) rehearses it where there is no GPU, with a python3-torch whose fully_shard runs on
the CPU (Debian sid's 2.14; not trixie's 2.6): its API is checked before device time is spent on it."""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "training"))
from pytorch_ddp_gpt import GPT  # noqa: E402  (same architecture as Tessera's gpt plugin)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) instead of the default (foreach)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()
    cuda = a.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    with torch.device(a.device):
        model = GPT(a.n_layer, a.n_head, a.n_embd, a.block_size)
    dtype = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[a.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True if a.fused_adamw else None)
    data = torch.randint(0, 256, (a.steps + 5, a.batch_size, a.block_size + 1), device=a.device)
    for step in range(a.steps + 5):
        if step == 5:
            sync()
            start = time.perf_counter()
        x, y = data[step, :, :-1], data[step, :, 1:]
        loss = F.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync()
    elapsed = time.perf_counter() - start
    print(f"pytorch fsdp2 {a.precision}{' fused-adamw' if a.fused_adamw else ''} tokens_per_s={a.steps * a.batch_size * a.block_size / elapsed:.0f} "
          + (f"peak_cuda_mb={torch.cuda.max_memory_allocated() / 2**20:.0f} " if cuda else "") + f"loss={loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
