"""torch.load as PyTorch 2.6 and later do by default (weights_only=True: plain containers,
tensors and a few torch types, nothing else runs), on whichever torch is installed. Every
global the file's pickle names is first checked against that safe unpickler's allowlist, so
the check holds on Debian bookworm's torch 1.13 too, whose safe unpickler cannot read floats
(protocol 2's BINFLOAT) and is therefore not used there."""
import pickletools
import zipfile

import torch


def _allowed(module, name):
    return ((module, name) in {("collections", "OrderedDict"), ("torch", "device"), ("torch", "Size"),
                               ("builtins", "set"), ("builtins", "complex"), ("_codecs", "encode")}
            or (module == "torch" and name.endswith("Storage"))
            or (module == "torch._utils" and name.startswith("_rebuild_")))


def pickle_globals(path):
    """(module, name) of every GLOBAL opcode in the archive's data.pkl."""
    with zipfile.ZipFile(path) as archive:
        pickle = next(n for n in archive.namelist() if n.split("/")[-1] == "data.pkl")
        ops = list(pickletools.genops(archive.read(pickle)))
    return [tuple(arg.split(" ", 1)) for op, arg, _ in ops if op.name == "GLOBAL"]


def load(path):
    refused = sorted({g for g in pickle_globals(path) if not _allowed(*g)})
    assert not refused, f"{path}: torch.load(weights_only=True) would refuse {refused}"
    return torch.load(path, weights_only=int(torch.__version__.split(".")[0]) >= 2)
