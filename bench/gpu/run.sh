#!/usr/bin/env bash
# On the lent GPU machine, after bench/gpu/build.sh: Tessera's CUDA/NCCL path against PyTorch's
# own FSDP2 (`fully_shard`, eager) on the same GPT and batch, all in this one run; prints the
# ratios. World size 1: NCCL cannot put two ranks on one GPU. Writes $OUT/gpu-bench.txt.
#   bash bench/gpu/run.sh [steps]
# Shapes (issue 13 item 5): "small" 6 x 384, batch 8 x 128 tokens (where per-op host overhead
# dominates); "1.3B" 26 x 2048, 16 heads, batch 4 x 512 tokens (1.31B parameters; the GPU
# dominates). ACCELERATOR=cpu SHAPES=small rehearses the whole run on a CPU build, PyTorch's rows
# on Gloo where python3-torch has fully_shard (Debian sid's 2.14 runs it on the CPU; 2.6's records
# events on a CPU stream and fails).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/out}"; mkdir -p "$out"
tessera="${TESSERA:-build-gpu/bin/tessera}"
steps="${1:-40}"
accelerator="${ACCELERATOR:-cuda}"
work="$(mktemp -d)"; trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
# layers, width, heads, tokens per sequence, sequences per step
declare -A dims=([small]="6 384 6 128 8" [1.3B]="26 2048 16 512 4")

# One tessera run: shape, strategy, precision, extra --set arguments. Prints tokens/s (mean of
# the logged windows after the first two), the peak CUDA tensor memory and, for the shapes in
# PLAN_SHAPES (default small: planning the 1.3B traces its forward on the CPU), what
# `tessera plan` predicted for it.
tessera_row() {
  local name="tessera $2 $3" dir="$work/$1-$2-$3" strategy="$2" precision="$3" layers embd heads block batch
  read -r layers embd heads block batch <<< "${dims[$1]}"
  local shape_name="$1"; shift 3
  cat > "$dir.toml" <<TOML
[trainer]
max_steps = $steps
log_every_n_steps = 5
enable_progress_bar = false
save_last = false
default_root_dir = "$dir"
[launch]
devices = 1
[strategy]
plugin = "$strategy"
accelerator = "$accelerator"
[precision]
plugin = "fsdp-precision"
precision = "$precision"
[optimizer]
lr = 3e-4
schedule = "constant"
[model]
plugin = "gpt"
n_layer = $layers
n_head = $heads
n_embd = $embd
block_size = $block
[data]
plugin = "text"
block_size = $block
batch_size = $batch
${FORTUNES:+path = \"$FORTUNES\"}
TOML
  local planned=""
  if [[ " ${PLAN_SHAPES-small} " == *" $shape_name "* ]]; then
    planned=$(timeout 120 "$tessera" plan --json --config "$dir.toml" "$@" 2> /dev/null | python3 -c '
import json, sys
text = sys.stdin.read(); plan = json.loads(text[text.index("{"):])
if plan["cuda"]: print(round(plan["peak_cuda_per_rank_bytes"] / 2**20))' 2> /dev/null)
  fi
  "$tessera" fit --config "$dir.toml" "$@" > "$dir.log" 2>&1
  local rc=$? csv="$dir/version_0/metrics.csv"
  local tps loss mem
  tps=$(awk -F, '$4=="tokens_per_s" {n++; if (n > 2) {s+=$5; c++}} END {if (c) printf "%.0f", s/c}' "$csv" 2>/dev/null)
  loss=$(awk -F, '$4=="train_loss" {l=$5} END {printf "%.3f", l}' "$csv" 2>/dev/null)
  mem=$(awk -F, '$4=="peak_cuda_mb" {printf "%.0f", $5}' "$csv" 2>/dev/null)
  echo "$shape_name | $name | rc=$rc tokens_per_s=${tps:-?} peak_cuda_mb=${mem:-?}${planned:+ planned_cuda_mb=$planned$(
    awk -v p="$planned" -v m="${mem:-0}" 'BEGIN { if (m > 0) printf " (plan/measured %.2f)", p / m }')} loss=${loss:-?}"
  [ $rc -eq 0 ] || tail -5 "$dir.log"
}

pytorch_row() {
  local name="$1" precision="$2" layers embd heads block batch; shift 2
  read -r layers embd heads block batch <<< "${dims[$name]}"
  echo "$name | pytorch fsdp2 $precision$([ $# -gt 0 ] && echo " fused-adamw") | $(PYTHONUNBUFFERED=1 python3 \
    bench/gpu/pytorch_fsdp2_gpt.py --device "$accelerator" --steps "$steps" --precision "$precision" --n-layer "$layers" --n-embd "$embd" \
    --n-head "$heads" --block-size "$block" --batch-size "$batch" "$@" 2>&1 | tail -1)"
}

# tessera / pytorch for one shape and precision: tokens/s and peak CUDA memory, against
# PyTorch's default AdamW (foreach) and, where run, its fused one.
ratios() {
  awk -F' [|] ' -v shape="$1" -v precision="$2" '
    function field(s, k) { return match(s, k "=[0-9.]+") ? substr(s, RSTART + length(k) + 1, RLENGTH - length(k) - 1) : "" }
    $1 == shape && index($2, "pytorch fsdp2 " precision) == 1 { ref[++m] = $2; rtps[m] = field($3, "tokens_per_s"); rmem[m] = field($3, "peak_cuda_mb") }
    $1 == shape && $2 ~ "^tessera .* " precision "$" { name[++n] = $2; tps[n] = field($3, "tokens_per_s"); mem[n] = field($3, "peak_cuda_mb") }
    END { for (j = 1; j <= m; j++) for (i = 1; i <= n; i++) if (rtps[j] > 0 && tps[i] > 0)
            printf "%s | %s / %s: %.2fx tokens/s%s\n", shape, name[i], ref[j], tps[i] / rtps[j],
                   (rmem[j] > 0 && mem[i] > 0 ? sprintf(", %.2fx peak CUDA memory", mem[i] / rmem[j]) : "") }' "$out/gpu-bench.txt"
}

: > "$out/gpu-bench.txt"
for shape in ${SHAPES:-small 1.3B}; do
  if [ "$shape" = small ]; then
    runs="fsdp:32-true fsdp:bf16-mixed fsdp:16-mixed fsdp:16-true fsdp_cpu_offload:32-true fsdp2:32-true fsdp2:bf16-mixed"
  else
    runs="fsdp:bf16-mixed fsdp2:bf16-mixed"
  fi
  for run in $runs; do
    strategy=${run%%:*}; precision=${run#*:}
    tessera_row "$shape" "$strategy" "$precision" $([ "$precision" = 16-true ] && echo --set optimizer.eps=1e-4)
  done | tee -a "$out/gpu-bench.txt"
  if [ "$accelerator" = cuda ] || python3 -c 'from torch.distributed.fsdp import fully_shard' 2> /dev/null; then
    { for precision in $([ "$shape" = small ] && echo 32-true) bf16-mixed; do pytorch_row "$shape" "$precision"; done
      pytorch_row "$shape" bf16-mixed --fused-adamw; } | tee -a "$out/gpu-bench.txt"
  fi
done
for shape in ${SHAPES:-small 1.3B}; do ratios "$shape" bf16-mixed; ratios "$shape" 32-true; done | tee -a "$out/gpu-bench.txt"
