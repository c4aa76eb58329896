#!/usr/bin/env bash
# Peak RSS per rank of a ~57M-parameter GPT (8 layers, 768 wide) for a few AdamW steps:
# single device, DDP on 2 ranks, FSDP FULL_SHARD on 1, 2 and 4 ranks, eager and with
# deferred_init (the model never built whole). Model state (fp32 params + grads + Adam) is
# ~0.9 GB unsharded; FSDP's share per rank should fall as 1/N above the process baseline
# (a 1-layer, 48-wide model on one device, measured first).
# The tessera binary links jemalloc as its malloc (host/CMakeLists.txt): with glibc's malloc,
# whose mmap threshold grows to the largest block freed, freed activation and collective
# buffers stayed resident and RSS overstated what is live (2 ranks: 987 MB above the baseline
# instead of ~740); docs/performance.md has the figures of both.
# The last rows show limit_all_gathers with forward prefetch on 4 ranks.
#   bash bench/training/memory.sh [build-dir]        (~3 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
tessera="${1:-build}/bin/tessera"
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
config=bench/training/gpt-57m.toml

peak_rss() {
  local dir="$1"; shift
  $tessera fit --config "$config" --set trainer.default_root_dir="$dir" "$@" > "$dir.log" 2>&1 \
    || { echo "$dir failed:" >&2; tail -20 "$dir.log" >&2; exit 1; }
  awk -F, '$4=="peak_rss_mb" {printf "%.0f", $5}' "$dir/version_0/metrics.csv"
}
base=$(peak_rss "$out/baseline" --set data.batch_size=4 --set model.n_layer=1 --set model.n_embd=48)
echo "process baseline (1-layer 48-wide model, one device): $base MB"
printf "%-28s %10s %12s\n" "" "peak RSS" "above base"
run() {
  local name="$1"; shift
  local a
  a=$(peak_rss "$out/$name" "$@")
  printf "%-28s %7s MB %9s MB\n" "$name" "$a" "$((a - base))"
}

run single_device --set data.batch_size=4
run ddp_2 --set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=2
for n in 1 2 4; do
  run "fsdp_full_shard_$n" --set launch.devices=$n --set strategy.plugin=fsdp --set data.batch_size=$((4 / n))
  run "fsdp_deferred_init_$n" --set launch.devices=$n --set strategy.plugin=fsdp --set strategy.deferred_init=true \
    --set data.batch_size=$((4 / n))
done
for limit in false true; do
  run "fsdp_prefetch_4_limit_$limit" --set launch.devices=4 --set strategy.plugin=fsdp --set data.batch_size=1 \
    --set strategy.forward_prefetch=true --set strategy.limit_all_gathers=$limit
done
