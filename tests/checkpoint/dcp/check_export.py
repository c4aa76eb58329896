#!/usr/bin/python3
"""PyTorch's torch.distributed.checkpoint.load on a folder `tessera checkpoint export --format dcp` wrote.

Usage: check_export.py DCP_DIR WEIGHTS.safetensors   (PyTorch >= 2.4: run it through pytorch2.sh)

WEIGHTS is the same checkpoint exported by tessera as safetensors (read here by
read_safetensors.py, an independent reader). dcp.load must give WEIGHTS bitwise into a plain state
dict (the names a model's state_dict() has) and, on 2 Gloo ranks, into Shard(0) DTensors (the
state an FSDP2 job holds); the optimizer moments load through the nesting torchtitan's
OptimizersContainer gives them ({"optimizer": {"state.<name>.exp_avg": ...}}). Prints "ok ...".
"""
import faulthandler
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
import read_safetensors  # noqa: E402


def plain(folder, weights):
    state = {name: torch.empty_like(t) for name, t in weights.items()}
    moments = {f"state.{name}.exp_avg": torch.empty_like(t) for name, t in weights.items()}
    dcp.load({**state, "optimizer": moments}, checkpoint_id=folder)
    for name, t in weights.items():
        assert torch.equal(state[name], t), name
        assert moments[f"state.{name}.exp_avg"].abs().sum() > 0, f"{name}: exp_avg all zero"
    return len(state)


def rank_main(rank, world, folder, weights, port):
    faulthandler.dump_traceback_later(90, exit=True)  # a hung rank says where, and ends
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {name: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for name, t in weights.items()}
    dcp.load(state, checkpoint_id=folder)
    for name, t in weights.items():
        assert torch.equal(state[name].full_tensor(), t), f"rank {rank}: {name}"
    dist.destroy_process_group()


if __name__ == "__main__":
    folder, weights_file = sys.argv[1], sys.argv[2]
    weights, _ = read_safetensors.load(weights_file)
    n = plain(folder, weights)
    mp.spawn(rank_main, args=(2, folder, weights, 29531), nprocs=2, join=True)
    print(f"ok {n} weights bitwise through dcp.load, plain and as Shard(0) DTensors on 2 ranks "
          f"(PyTorch {torch.__version__})")
