# Hugging Face model folders for the hf_checkpoint tests, independent of Tessera's code:
#   write DIR --hidden H --intermediate I --layers L [--vocab V] [--dtype f32|bf16|f16] [--shards N]
#             [--seed S] [--model-type T] [--drop NAME] [--extra NAME]
#       config.json + random weights of the hf_tiny test model as save_pretrained lays them out
#       (model.safetensors, or N files model-0000k-of-0000N.safetensors + model.safetensors.index.json)
#   check DIR      every file's bytes against the safetensors format, field by field, and the index
#   compare A B [--as bf16|f16|f32]
#                  the two folders hold the same tensor names and bitwise equal values (B's
#                  converted to --as first); prints "equal N tensors"
import json, os, struct, sys
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import read_safetensors

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def args_of(argv):
    out, i = {}, 0
    while i < len(argv):
        key = argv[i][2:]
        out.setdefault(key, []).append(argv[i + 1])
        i += 2
    return out


def save_file(path, tensors):
    """The format's own layout: 8-byte little-endian header length, JSON header, raw data."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, t in tensors:
        data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def write(d, a):
    h, i, layers = int(a["hidden"][0]), int(a["intermediate"][0]), int(a["layers"][0])
    vocab = int(a.get("vocab", ["256"])[0])
    dtype = DTYPES[a.get("dtype", ["f32"])[0]]
    shards = int(a.get("shards", ["1"])[0])
    g = torch.Generator().manual_seed(int(a.get("seed", ["0"])[0]))
    shapes = [("model.embed_tokens.weight", [vocab, h])]
    for l in range(layers):
        shapes += [(f"model.layers.{l}.input_layernorm.weight", [h]),
                   (f"model.layers.{l}.mlp.up_proj.weight", [i, h]),
                   (f"model.layers.{l}.mlp.down_proj.weight", [h, i])]
    shapes += [("model.norm.weight", [h]), ("lm_head.weight", [vocab, h])]
    shapes = [(n, s) for n, s in shapes if n not in a.get("drop", [])]
    shapes += [(n, [3]) for n in a.get("extra", [])]
    tensors = [(n, (torch.randn(s, generator=g) * 0.05 + (1.0 if n.endswith("norm.weight") else 0.0)).to(dtype))
               for n, s in shapes]
    os.makedirs(d, exist_ok=True)
    config = {"architectures": ["HfTinyForCausalLM"], "model_type": a.get("model-type", ["tessera_hf_tiny"])[0],
              "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers, "vocab_size": vocab,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": str(dtype).split(".")[1],
              "transformers_version": "4.44.0"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if shards == 1:
        save_file(os.path.join(d, "model.safetensors"), tensors)
        return
    per = (len(tensors) + shards - 1) // shards
    weight_map, total = {}, 0
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = tensors[k * per:(k + 1) * per]
        save_file(os.path.join(d, name), part)
        for n, t in part:
            weight_map[n] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def files_of(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return ["model.safetensors"], None
    with open(index) as f:
        idx = json.load(f)
    return sorted(set(idx["weight_map"].values())), idx


def load(d):
    files, _ = files_of(d)
    out = {}
    for name in files:
        tensors, _ = read_safetensors.load(os.path.join(d, name))
        out.update(tensors)
    return out


def check(d):
    files, index = files_of(d)
    total, held = 0, {}
    for name in files:
        raw = open(os.path.join(d, name), "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        assert 8 + n <= len(raw), f"{name}: header length {n} past the end"
        assert (8 + n) % 8 == 0, f"{name}: data starts at {8 + n}, not 8-byte aligned"
        header = json.loads(raw[8:8 + n])
        assert header.pop("__metadata__") == {"format": "pt"}, f"{name}: __metadata__ is not {{'format': 'pt'}}"
        end = 0
        for t, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            assert set(e) == {"dtype", "shape", "data_offsets"}, f"{name} {t}: fields {sorted(e)}"
            size = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8}[e["dtype"]]
            b, f = e["data_offsets"]
            assert b == end, f"{name} {t}: starts at {b}, the previous tensor ended at {end}"
            assert b % size == 0, f"{name} {t}: offset {b} not aligned to its {size}-byte elements"
            numel = 1
            for s in e["shape"]:
                numel *= s
            assert f - b == numel * size, f"{name} {t}: {f - b} bytes for {numel} elements"
            end = f
            held[t] = name
        assert 8 + n + end == len(raw), f"{name}: {len(raw) - 8 - n - end} bytes after the last tensor"
        total += end
    if index is not None:
        assert index["metadata"]["total_size"] == total, f"index total_size {index['metadata']['total_size']} != {total}"
        assert index["weight_map"] == held, "the index's weight_map is not where the tensors are"
    print(f"ok {len(files)} files {len(held)} tensors {total} bytes")


def compare(a, b, as_dtype):
    x, y = load(a), load(b)
    assert sorted(x) == sorted(y), f"names differ: {sorted(set(x) ^ set(y))}"
    for n in x:
        want = y[n].to(DTYPES[as_dtype]) if as_dtype else y[n]
        assert x[n].dtype == want.dtype, f"{n}: {x[n].dtype} vs {want.dtype}"
        assert x[n].shape == want.shape, f"{n}: {list(x[n].shape)} vs {list(want.shape)}"
        assert torch.equal(x[n].view(torch.uint8) if x[n].numel() else x[n], want.contiguous().view(torch.uint8)
                           if want.numel() else want), f"{n}: values differ"
    print(f"equal {len(x)} tensors")


if __name__ == "__main__":
    command, folder = sys.argv[1], sys.argv[2]
    if command == "write":
        write(folder, args_of(sys.argv[3:]))
    elif command == "check":
        check(folder)
    else:
        rest = args_of(sys.argv[4:])
        compare(folder, sys.argv[3], rest.get("as", [None])[0])
