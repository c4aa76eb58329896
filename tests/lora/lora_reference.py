#!/usr/bin/python3
"""PEFT's LoRA on the independent Llama of tests/models/llama_reference.py, for tests/lora.

Usage:
  lora_reference.py reference OUT_DIR
      OUT_DIR/base/: a random Hugging Face Llama folder (config.json, model.safetensors);
      OUT_DIR/adapter/: a PEFT adapter for it (adapter_model.safetensors, adapter_config.json) with
      random lora_B (PEFT initialises it to zeros; random here so that lora_A's gradient is not zero);
      OUT_DIR/expected.safetensors: token rows (input_ids, labels), the mean cross-entropy loss of the
      adapted model and the loss's gradient of every adapter (grad.NAME, Tessera's names: PEFT's
      without "base_model.model."), and each adapted weight merged (merged.NAME: W + alpha / r B A).
  lora_reference.py merge ADAPTER_DIR BASE_DIR HF_DIR
      Merges ADAPTER_DIR (a PEFT folder) into BASE_DIR's weights as PEFT's merge_and_unload does and
      prints, as JSON, how far HF_DIR's model.safetensors is from the result: {"tensors": n,
      "max_diff": d, "missing": [...], "extra": [...]}.

PEFT's LoRA is written here from peft/tuners/lora/layer.py (Linear.forward: result + lora_B(lora_A(
dropout(x))) * scaling, scaling = lora_alpha / r; merge: W + (B @ A) * scaling) and its state-dict
names (get_peft_model_state_dict: "base_model.model." + the module path + ".lora_A.weight", the
adapter name "default" removed): no peft package is needed.
"""
import json
import math
import os
import struct
import sys

import torch
from torch import nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
import llama_reference as ref  # noqa: E402

CONFIG = dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False, rms_norm_eps=1e-5,
              eos_token_id=2, bos_token_id=1)
R, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PREFIX = "base_model.model."


class LoraLinear(nn.Module):
    """peft.tuners.lora.layer.Linear (one adapter, lora_dropout 0: nn.Identity)."""

    def __init__(self, base_layer, r, lora_alpha):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False)
        self.scaling = lora_alpha / r
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # reset_lora_parameters, init_lora_weights=True
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        result = self.base_layer(x)
        return result + self.lora_B(self.lora_A(x)) * self.scaling

    def merged_weight(self):
        return self.base_layer.weight + (self.lora_B.weight @ self.lora_A.weight) * self.scaling


def add_lora(model, targets, r, alpha):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                setattr(module, child_name, LoraLinear(child, r, alpha))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def tessera_name(peft_module_name):
    """PEFT's module path holds the wrapped layer as base_layer; its state dict (and Tessera) do not."""
    return peft_module_name.replace(".base_layer", "")


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[begin:end])
        if info["dtype"] == "F32":
            t = torch.frombuffer(raw, dtype=torch.float32)
        elif info["dtype"] == "BF16":
            t = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).float()
        elif info["dtype"] == "I64":
            t = torch.frombuffer(raw, dtype=torch.int64)
        else:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}")
        out[name] = t.reshape(info["shape"]).clone()
    return out


def reference(out_dir):
    torch.manual_seed(2024)
    config = ref.Config(CONFIG)
    model = ref.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" not in pname else 0.2) + (1.0 if "norm" in pname else 0.0))
    base = os.path.join(out_dir, "base")
    os.makedirs(base, exist_ok=True)
    cfg = {**ref.DEFAULTS, **CONFIG, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32",
           "transformers_version": "4.48.0"}
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    ref.write_safetensors(os.path.join(base, "model.safetensors"), dict(model.state_dict()))

    add_lora(model, TARGETS, R, ALPHA)
    with torch.no_grad():  # a trained adapter's B, not PEFT's zeros: A's gradient is then not zero
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn_like(p) * 0.1)
    adapter = os.path.join(out_dir, "adapter")
    os.makedirs(adapter, exist_ok=True)
    adapters = {PREFIX + tessera_name(n): p for n, p in model.named_parameters() if "lora_" in n}
    ref.write_safetensors(os.path.join(adapter, "adapter_model.safetensors"), adapters)
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.0,
                   "target_modules": TARGETS, "bias": "none", "base_model_name_or_path": base,
                   "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True}, f, indent=2)

    input_ids = torch.randint(0, config.vocab_size, (3, 13))
    labels = torch.randint(0, config.vocab_size, (3, 13))
    logits = model(input_ids)
    loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), labels.reshape(-1))
    loss.backward()
    expected = {"input_ids": input_ids, "labels": labels, "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        if "lora_" in name:
            expected["grad." + tessera_name(name)] = p.grad
        else:
            assert p.grad is None, name
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            expected["merged." + name + ".weight"] = module.merged_weight().detach()
    ref.write_safetensors(os.path.join(out_dir, "expected.safetensors"), expected)


def merge(adapter_dir, base_dir, hf_dir):
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    assert adapter_config["peft_type"] == "LORA", adapter_config
    scaling = adapter_config["lora_alpha"] / adapter_config["r"]
    adapters = read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
    merged = read_safetensors(os.path.join(base_dir, "model.safetensors"))
    for name, a in adapters.items():
        assert name.startswith(PREFIX) and (name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight")), name
        if not name.endswith(".lora_A.weight"):
            continue
        module = name[len(PREFIX):-len(".lora_A.weight")]
        assert module.split(".")[-1] in adapter_config["target_modules"], module
        b = adapters[PREFIX + module + ".lora_B.weight"]
        merged[module + ".weight"] = merged[module + ".weight"] + (b @ a) * scaling
    exported = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    max_diff = max((exported[k] - merged[k]).abs().max().item() for k in merged if k in exported)
    print(json.dumps({"tensors": len(merged), "max_diff": max_diff, "adapters": len(adapters),
                      "missing": sorted(set(merged) - set(exported)), "extra": sorted(set(exported) - set(merged))}))


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        reference(sys.argv[2])
    elif sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(__doc__)
