#!/usr/bin/python3
"""Writes the DCP fixtures of dcp_test: folders saved by PyTorch's own torch.distributed.checkpoint.

Usage (PyTorch >= 2.4, with DTensor; Debian bookworm's 1.13 has no working DCP):
    sudo bash tests/checkpoint/dcp/pytorch2.sh tests/checkpoint/dcp/fixtures make_fixtures.py /io
    (pytorch2.sh runs it under Debian trixie's PyTorch 2.6 in a chroot; or: python3 make_fixtures.py OUT_DIR)

A 2-rank Gloo job takes one AdamW step of a tiny Llama, every rank on the same row, and saves the
state an FSDP2 job holds (each parameter and moment a DTensor, Shard(0) over a 1-D mesh of the 2
ranks: fully_shard itself needs CUDA streams in PyTorch 2.6, so the step runs on whole tensors on
every rank and distribute_tensor shards the result) twice through dcp.save:
  OUT_DIR/fsdp2/       {"model": ..., "optim": ...} as get_model_state_dict / get_optimizer_state_dict
                       give them: Hugging Face names (model.layers.0.self_attn.q_proj.weight)
  OUT_DIR/torchtitan/  the same model under torchtitan's Llama names (tok_embeddings,
                       layers.N.attention.wq, feed_forward.w1, ...) with q/k rows in its interleaved
                       rotary layout, model keys at the top level, "optimizer.state.<fqn>.<moment>" as
                       its OptimizersContainer flattens them, and "train_state.step"
Then it takes a second AdamW step on the same row and records in OUT_DIR/expected.json the loss
before that step (what a run resumed from either folder must log) and, in expected.safetensors, the
weights after it (Hugging Face names and layout).

The row is the text data plugin's window of a text whose period is the block size, so that every
window, on every rank, is the same row: tessera's shuffled batches are then that row, whatever
their order. The Llama is tests/models/llama_reference.py (Hugging Face's modeling code, written
for the tests); torchtitan's model is the same network with its rotary pairs interleaved, built
here by permuting the weights as torchtitan's Hugging Face converter does (_permute).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "models"))
import llama_reference as ref  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              max_position_embeddings=64)
BLOCK = 16
PATTERN = b"DCP rows agree! "  # BLOCK distinct-enough bytes; the text is this, repeated
ADAMW = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

TORCHTITAN = {
    "model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
TORCHTITAN_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight", "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def torchtitan_name(hf):
    if hf in TORCHTITAN:
        return TORCHTITAN[hf]
    _, _, index, rest = hf.split(".", 3)
    return f"layers.{index}.{TORCHTITAN_LAYER[rest]}"


def heads_of(hf):
    """How many heads torchtitan's converter permutes a weight's rows by (0: not permuted)."""
    if hf.endswith("q_proj.weight"):
        return CONFIG["num_attention_heads"]
    if hf.endswith("k_proj.weight"):
        return CONFIG["num_key_value_heads"]
    return 0


def to_torchtitan_layout(w, heads):
    """The inverse of torchtitan's _permute (which maps its layout to Hugging Face's)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def row():
    ids = torch.tensor(list(PATTERN), dtype=torch.long)
    return ids[None, :], torch.roll(ids, -1)[None, :]


def loss_of(model):
    inputs, labels = row()
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, CONFIG["vocab_size"]), labels.reshape(-1))


def rank_main(rank, world, out_dir, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")  # Debian builds without libuv
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1234)
    model = ref.LlamaForCausalLM(ref.Config(CONFIG)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False, **ADAMW)
    loss_of(model).backward()  # step 1: the moments the folders hold
    optimizer.step()
    optimizer.zero_grad()

    # What an FSDP2 job holds: each parameter and moment a DTensor, Shard(0) over the ranks.
    shard = lambda t: distribute_tensor(t.detach().clone(), mesh, [Shard(0)])  # noqa: E731
    names = {p: n for n, p in model.named_parameters()}
    model_sd = {n: shard(p) for n, p in model.named_parameters()}
    state = {names[p]: {"step": s["step"].clone(), "exp_avg": shard(s["exp_avg"]), "exp_avg_sq": shard(s["exp_avg_sq"])}
             for p, s in optimizer.state.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in optimizer.param_groups]
    dcp.save({"model": model_sd, "optim": {"state": state, "param_groups": groups}},
             checkpoint_id=os.path.join(out_dir, "fsdp2"))

    # torchtitan: the same DTensors renamed, q/k rows (and their moments) in its rotary layout,
    # the optimizer flattened as its OptimizersContainer does (flatten_optimizer_state_dict).
    titan = {}
    for name, value in model_sd.items():
        h = heads_of(name)
        titan[torchtitan_name(name)] = value if h == 0 else shard(to_torchtitan_layout(value.full_tensor(), h))
    for name, moments in state.items():
        h = heads_of(name)
        for moment, value in moments.items():
            if moment != "step" and h != 0:
                value = shard(to_torchtitan_layout(value.full_tensor(), h))
            titan[f"optimizer.state.{torchtitan_name(name)}.{moment}"] = value
    titan["train_state.step"] = torch.tensor(1, dtype=torch.int32)
    dcp.save(titan, checkpoint_id=os.path.join(out_dir, "torchtitan"))

    loss = loss_of(model)  # what the resumed run logs at its first step
    loss.backward()
    optimizer.step()
    if rank == 0:
        ref.write_safetensors(os.path.join(out_dir, "expected.safetensors"),
                              {n: p.detach().clone() for n, p in model.named_parameters()})
        config = {**ref.DEFAULTS, **CONFIG, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
        with open(os.path.join(out_dir, "expected.json"), "w") as f:
            json.dump({"torch_version": torch.__version__, "world_size": world, "block_size": BLOCK,
                       "pattern": PATTERN.decode(), "adamw": ADAMW, "loss_before_step_2": loss.item(),
                       "config": config}, f, indent=1)
            f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    mp.spawn(rank_main, args=(2, out, 29517), nprocs=2, join=True)
