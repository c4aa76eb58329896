#!/usr/bin/env bash
# The third-party strategy path: install Tessera into a temporary prefix, check that the
# loader's advice on an ABI mismatch (find_package(TesseraSDK N)) finds the installed SDK,
# build examples/zero1 out of tree against it, and train it with the installed `tessera` on
# 2 and 3 ranks against single device on the same global batch (an MLP whose sizes do not
# divide by 2 or 3), gradients clipped to norm 0.5: same losses, same final parameters, same
# (gathered) optimizer state, and a 2-rank checkpoint resumed on 3 ranks continues exactly as
# single device does.
set -euo pipefail
build_dir="$1"; source_dir="$2"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
tessera="$work/prefix/bin/tessera"

# The loader's advice for a plugin of another ABI, followed literally, finds this SDK; the
# next major does not.
TESSERA_PLUGIN_PATH="$build_dir/tests/loader/toys/wrong_abi" "$tessera" plugins > "$work/refused.txt"
advice=$(grep -o "find_package(TesseraSDK [0-9]*)" "$work/refused.txt" | head -1)
major=$(echo "$advice" | grep -o "[0-9]*)" | tr -d ')')
echo "loader advice: $advice"
[ -n "$major" ]
probe() {  # probe <version>: configure a project that asks for TesseraSDK <version>
  mkdir -p "$work/probe-$1"
  printf 'cmake_minimum_required(VERSION 3.25)\nproject(probe LANGUAGES CXX)\nfind_package(TesseraSDK %s REQUIRED)\n' \
    "$1" > "$work/probe-$1/CMakeLists.txt"
  cmake -S "$work/probe-$1" -B "$work/probe-$1/build" -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/probe-$1.log" 2>&1
}
probe "$major"
if probe "$((major + 1))"; then echo "find_package(TesseraSDK $((major + 1))) accepted an ABI $major SDK"; exit 1; fi
grep -q "TesseraSDK" "$work/probe-$((major + 1)).log"

# The engine's installed headers are exactly the strategy API (core/CMakeLists.txt lists them):
# the internals are not installed, and the installed ones compile together from the prefix alone.
[ -f "$work/prefix/include/tessera/core/strategy_base.hpp" ]
for internal in fsdp/flat_param.hpp fsdp/storage.hpp fsdp/scheduler.hpp fsdp/autograd_seam.hpp fsdp/unit.hpp \
                fsdp/layout.hpp plugin_loader.hpp cluster.hpp data_loader.hpp trace.hpp; do
  if [ -e "$work/prefix/include/tessera/core/$internal" ]; then echo "engine internal installed: $internal"; exit 1; fi
done
# The plugin contract holds no TOML++ type: no installed header names it, and the host's side of
# sdk::Options (sdk/internal/) is not installed.
if grep -rlE "toml\+\+|toml::" "$work/prefix/include/tessera"; then echo "TOML++ in the installed headers"; exit 1; fi
[ ! -e "$work/prefix/include/tessera/sdk/toml_options.hpp" ]
mkdir -p "$work/headers"
(cd "$work/prefix/include" && find tessera/core tessera/sdk -name '*.hpp' | sort | sed 's/.*/#include <&>/') > "$work/headers/all.cpp"
echo "installed SDK and engine headers: $(wc -l < "$work/headers/all.cpp")"
printf 'cmake_minimum_required(VERSION 3.25)\nproject(headers LANGUAGES CXX)\nfind_package(TesseraSDK %s REQUIRED)\nadd_library(headers OBJECT all.cpp)\ntarget_link_libraries(headers PRIVATE tessera::core)\n' \
  "$major" > "$work/headers/CMakeLists.txt"
cmake -S "$work/headers" -B "$work/headers/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/headers/build" >/dev/null

cmake -S "$source_dir/examples/zero1" -B "$work/zero1" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/zero1" >/dev/null
export TESSERA_PLUGIN_PATH="$work/zero1"
"$tessera" plugins | grep "strategy .*zero1 .*1.0.0"

# fit <name> <ranks> <strategy> <steps> [extra arguments]: 12 samples per step in every run.
fit() {
  local dir="$work/$1"; mkdir -p "$dir"
  cat > "$dir/run.toml" <<TOML
[trainer]
max_steps = $4
log_every_n_steps = 1
checkpoint_every_n_steps = 3
gradient_clip_val = 0.5
seed = 3
default_root_dir = "$dir"
enable_progress_bar = false
[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
schedule = "constant"
[launch]
devices = $2
[strategy]
plugin = "$3"
[model]
plugin = "mlp"
hidden_sizes = [13]
[data]
plugin = "fashion_mnist"
batch_size = $((12 / $2))
train_limit = 600
val_size = 60
TOML
  "$tessera" fit --config "$dir/run.toml" "${@:5}" > "$dir/out.txt" 2>&1 || { tail -30 "$dir/out.txt"; exit 1; }
}
fit reference 1 single_device 6
fit zero1-2 2 zero1 3
fit zero1-3 3 zero1 6
fit resumed-3 3 zero1 6 --ckpt-path "$work/zero1-2/version_0/checkpoints/step=3.ckpt"

/usr/bin/python3 - "$work" "$source_dir/tests/support" <<'PY'
import csv, sys, torch
sys.path.insert(0, sys.argv[2])
from safe_torch_load import load
work = sys.argv[1]
def losses(run):
    with open(f"{work}/{run}/version_0/metrics.csv") as f:
        return {int(r["step"]): float(r["value"]) for r in csv.DictReader(f)
                if r["stage"] == "train" and r["metric"] == "train_loss"}
def close(a, b, what):
    if not torch.allclose(a.double(), b.double(), rtol=2e-5, atol=2e-5):
        sys.exit(f"{what} differs by {(a.double() - b.double()).abs().max().item()}")
def compare(run, ckpt, ref_ckpt, steps):
    ref, got = losses("reference"), losses(run)
    for step in steps:
        if abs(ref[step] - got[step]) > 2e-5 * max(1.0, abs(ref[step])):
            sys.exit(f"{run}: loss at step {step} is {got[step]}, single device {ref[step]}")
    a = load(f"{work}/reference/version_0/checkpoints/{ref_ckpt}")
    b = load(f"{work}/{run}/version_0/checkpoints/{ckpt}")
    assert a["state_dict"].keys() == b["state_dict"].keys(), (a["state_dict"].keys(), b["state_dict"].keys())
    for name, tensor in a["state_dict"].items():
        close(b["state_dict"][name], tensor, f"{run}: parameter {name}")
    oa, ob = a["optimizer_states"][0], b["optimizer_states"][0]
    index = {name: i for i, name in enumerate(ob["param_names"])}
    for i, name in enumerate(oa["param_names"]):
        close(ob["state"][index[name]]["momentum_buffer"], oa["state"][i]["momentum_buffer"], f"{run}: momentum of {name}")
    print(f"{run}: losses at steps {steps[0]}-{steps[-1]}, parameters and momentum match single device")
compare("zero1-2", "last.ckpt", "step=3.ckpt", [1, 2, 3])
compare("zero1-3", "last.ckpt", "last.ckpt", [1, 2, 3, 4, 5, 6])
compare("resumed-3", "last.ckpt", "last.ckpt", [4, 5, 6])
PY
