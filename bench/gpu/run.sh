#!/usr/bin/env bash
# On the lent GPU machine, after bench/gpu/build.sh: Tessera's CUDA path against the strongest
# eager PyTorch doing the same work (issue 48), in this one run. Writes $OUT/gpu-bench.txt.
#   bash bench/gpu/run.sh [steps]
# Shapes (GPU-bound: 16K tokens per step): "llama-1b" (16 layers, 2048 wide, 16 heads, 8 KV heads,
# SwiGLU 5632, vocabulary 32000, sequence 2048) and "gpt-1.3b" (26 x 2048, 16 heads, sequence
# 2048). BATCH_<shape> overrides the batch (default 8 sequences). Every row runs twice, in the
# order A B ... B A, and each row's figure is the median of its runs: a drift of the machine
# during the call weighs on both sides alike.
# PyTorch rows (bench/gpu/pytorch_baseline.py): plain (no FSDP, the honest world-size-1 row),
# FSDP2 with Tessera's bf16-mixed (autocast, fp32 master, bf16 reduce), FSDP2 with
# MixedPrecisionPolicy(param_dtype=bf16), fused AdamW (foreach as an extra row), SDPA flash
# attention, and torch.compile of each block (for information; not an "eager" row). Tessera rows:
# fsdp and fsdp2 in bf16-mixed (PyTorch's autocast recipe), and fsdp2-param (fsdp2 with
# [strategy.mp_policy] param_dtype = reduce_dtype = bfloat16: PyTorch's param_dtype row's recipe).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/out}"; mkdir -p "$out"
tessera="${TESSERA:-build-gpu/bin/tessera}"
steps="${1:-20}"
work="$(mktemp -d)"; trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
python=${PYTHON:-python3}
# model layers width heads kv_heads intermediate vocab seq
# "tiny" rehearses the script on the CPU: ACCELERATOR=cpu SHAPES=tiny (fused AdamW needs a GPU there:
# --optimizer foreach rows only).
declare -A dims=([llama-1b]="llama 16 2048 16 8 5632 32000 2048" [gpt-1.3b]="gpt 26 2048 16 16 8192 256 2048"
  [tiny]="llama 2 64 4 2 128 256 64")
accelerator="${ACCELERATOR:-cuda}"

tessera_config() {  # shape row -> a config on stdout; row: a strategy, or fsdp2-param
  local model layers embd heads kv inter vocab seq batch_var="BATCH_${1//[-.]/_}"
  read -r model layers embd heads kv inter vocab seq <<< "${dims[$1]}"
  local batch="${!batch_var:-8}" strategy="${2%-param}" precision=bf16-mixed mp_policy=""
  # fsdp2-param: PyTorch's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) row's recipe
  # (bf16 compute copies of the fp32 shards, no autocast).
  if [ "$2" = fsdp2-param ]; then
    precision=32-true
    mp_policy=$'[strategy.mp_policy]\nparam_dtype = "bfloat16"\nreduce_dtype = "bfloat16"'
  fi
  cat <<TOML
[trainer]
max_steps = $((steps + 5))
log_every_n_steps = 5
enable_progress_bar = false
enable_checkpointing = false
num_sanity_val_steps = 0
limit_val_batches = 0
default_root_dir = "$work/$1-$2"
[launch]
devices = 1
[strategy]
plugin = "$strategy"
accelerator = "$accelerator"
$mp_policy
[precision]
plugin = "fsdp-precision"
precision = "$precision"
[optimizer]
lr = 3e-4
schedule = "constant"
[data]
plugin = "text"
block_size = $seq
batch_size = $batch
${FORTUNES:+path = \"$FORTUNES\"}
TOML
  if [ "$model" = llama ]; then
    cat <<TOML
[model]
plugin = "llama"
num_hidden_layers = $layers
hidden_size = $embd
num_attention_heads = $heads
num_key_value_heads = $kv
intermediate_size = $inter
vocab_size = $vocab
max_position_embeddings = $seq
TOML
  else
    cat <<TOML
[model]
plugin = "gpt"
n_layer = $layers
n_embd = $embd
n_head = $heads
block_size = $seq
TOML
  fi
}

tessera_row() {  # shape strategy: tokens/s over the logged windows after the first (warm-up)
  local dir="$work/$1-$2"; rm -rf "$dir"
  tessera_config "$1" "$2" > "$dir.toml"
  timeout 300 "$tessera" fit --config "$dir.toml" ${TESSERA_SETS:-} > "$dir.log" 2>&1
  local rc=$? csv; csv=$(ls "$dir"/version_*/metrics.csv 2> /dev/null | tail -1)
  local tps mem
  tps=$(awk -F, '$4=="tokens_per_s" {n++; if (n > 1) {s+=$5; c++}} END {if (c) printf "%.0f", s/c}' "$csv" 2>/dev/null)
  mem=$(awk -F, '$4=="peak_cuda_mb" {printf "%.0f", $5}' "$csv" 2>/dev/null)
  echo "$1 | tessera $2$([ "$2" = fsdp2-param ] || echo ' bf16-mixed') | rc=$rc tokens_per_s=${tps:-?} peak_cuda_mb=${mem:-?}"
  [ $rc -eq 0 ] || tail -5 "$dir.log" >&2
}

pytorch_args() {  # shape -> pytorch_baseline.py's model arguments
  local model layers embd heads kv inter vocab seq batch_var="BATCH_${1//[-.]/_}"
  read -r model layers embd heads kv inter vocab seq <<< "${dims[$1]}"
  echo --model "$model" --n-layer "$layers" --n-embd "$embd" --n-head "$heads" --n-kv-head "$kv" \
    --intermediate "$inter" --vocab-size "$vocab" --seq "$seq" --batch "${!batch_var:-8}" --device "$accelerator"
}

pytorch_row() {  # shape label args...
  local shape="$1" line; shift
  line=$(PYTHONUNBUFFERED=1 timeout 300 $python bench/gpu/pytorch_baseline.py $(pytorch_args "$shape") --steps "$steps" \
    "$@" 2>&1 | tail -1)
  echo "$shape | ${line%% tokens_per_s=*} | tokens_per_s=${line#* tokens_per_s=}"
}

rows=(
  "tessera fsdp" "tessera fsdp2" "tessera fsdp2-param"
  "pytorch --mode plain --mp autocast" "pytorch --mode fsdp2 --mp autocast" "pytorch --mode fsdp2 --mp param"
  "pytorch --mode fsdp2 --mp autocast --optimizer foreach" "pytorch --mode plain --mp autocast --compile"
)
# ROWS="row|row|..." runs those rows only (a call with little device time left).
[ -z "${ROWS:-}" ] || IFS='|' read -ra rows <<< "$ROWS"
run_row() {  # shape row
  read -r who rest <<< "$2"
  if [ "$who" = tessera ]; then tessera_row "$1" "$rest"; else pytorch_row "$1" $rest; fi
}

# PROFILE=1: where a step goes instead of the timed rows: tessera's `[trainer] profiler = "pytorch"`
# (training steps 3-5) and PyTorch's torch.profiler (3 steps after the timed ones) for each row,
# each table in $OUT/profile-<shape>-<row>.txt: the kernels by device time, the device's busy share.
if [ -n "${PROFILE:-}" ]; then
  for shape in ${SHAPES:-llama-1b}; do
    for row in "${rows[@]}"; do
      name="$shape-$(tr -c 'A-Za-z0-9_\n-' _ <<< "$row" | head -c 60)"
      read -r who rest <<< "$row"
      if [ "$who" = tessera ]; then
        steps=1 TESSERA_SETS="--set trainer.profiler=pytorch" tessera_row "$shape" "$rest"
        sed -n '/Profiler report (pytorch)/,/^trace written/p' "$work/$shape-$rest.log" > "$out/profile-$name.txt"
      else
        PYTHONUNBUFFERED=1 timeout 300 $python bench/gpu/pytorch_baseline.py $(pytorch_args "$shape") --steps 3 $rest \
          --profile > "$out/profile-$name.txt" 2>&1
      fi
      echo "$shape | $row | profile: $(head -2 "$out/profile-$name.txt" | tail -1)"
    done
  done
  exit 0
fi

{ $python bench/gpu/pytorch_baseline.py --versions; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } \
  | tee "$out/gpu-bench.txt"
for shape in ${SHAPES:-llama-1b gpt-1.3b}; do
  for ((i = 0; i < ${#rows[@]}; i++)); do run_row "$shape" "${rows[$i]}"; done
  for ((i = ${#rows[@]} - 1; i >= 0; i--)); do run_row "$shape" "${rows[$i]}"; done
done | tee -a "$out/gpu-bench.txt"

# Medians per row, MFU for Tessera's rows (the same model, so PyTorch's flops_per_token), and
# Tessera against every PyTorch row and the strongest eager one.
$python - "$out/gpu-bench.txt" <<'PY' | tee -a "$out/gpu-bench.txt"
import re, statistics, sys
from collections import defaultdict
runs, flops = defaultdict(list), {}
gpu = open(sys.argv[1]).readline()
peak = next((v for k, v in {"H100": 989.0, "H200": 989.0, "A100": 312.0}.items() if k in gpu), 0.0)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split("|")]
    if len(parts) != 3:
        continue
    fields = dict(re.findall(r"(\w+)=([0-9.]+)", parts[2]))
    if "tokens_per_s" in fields:
        runs[(parts[0], parts[1])].append(fields)
    if "flops_per_token" in fields:
        flops[parts[0]] = float(fields["flops_per_token"])
for shape in dict.fromkeys(s for s, _ in runs):
    med = {}
    for (s, row), rs in runs.items():
        if s == shape:
            med[row] = {k: statistics.median(float(r[k]) for r in rs if k in r) for k in ("tokens_per_s", "peak_cuda_mb") if any(k in r for r in rs)}
    for row, m in med.items():
        mfu = flops.get(shape, 0) * m.get("tokens_per_s", 0) / (peak * 1e12) if peak else 0
        print(f"{shape} | median {row} | tokens_per_s={m.get('tokens_per_s', 0):.0f} peak_cuda_mb={m.get('peak_cuda_mb', 0):.0f} mfu={mfu:.3f}")
    eager = {r: m for r, m in med.items() if r.startswith("pytorch") and "compiled" not in r and m.get("tokens_per_s")}
    strongest = max(eager, key=lambda r: eager[r]["tokens_per_s"], default=None)
    for t in (r for r in med if r.startswith("tessera") and med[r].get("tokens_per_s")):
        for r, m in med.items():
            if r.startswith("pytorch") and m.get("tokens_per_s"):
                mem = (f", {med[t]['peak_cuda_mb'] / m['peak_cuda_mb']:.2f}x peak" if m.get("peak_cuda_mb") and med[t].get("peak_cuda_mb") else "")
                tag = " (strongest eager)" if r == strongest else ""
                print(f"{shape} | {t} / {r}{tag}: {med[t]['tokens_per_s'] / m['tokens_per_s']:.2f}x tokens/s{mem}")
PY
