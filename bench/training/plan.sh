#!/usr/bin/env bash
# `tessera plan`'s peak RSS per rank against what `tessera fit` measures (metrics.csv
# peak_rss_mb, the busiest rank), on the GPT of memory.sh (8 layers, 768 wide, ~57M
# parameters, AdamW, 3 steps) under each strategy, 1, 2 and 4 ranks, fp32 and bf16-mixed.
#   bash bench/training/plan.sh [build-dir]        (~6 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
tessera="${1:-build}/bin/tessera"
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
config=bench/training/gpt-57m.toml

printf "%-26s %10s %10s %8s   %s\n" "" "plan MB" "fit MB" "error" "sent per rank per step"
run() {
  local name="$1"; shift
  local dir="$out/$name"
  local json planned measured sent
  json=$($tessera plan --json --config "$config" "$@")
  planned=$(python3 -c 'import json,sys; print(round(json.loads(sys.argv[1])["peak_rss_per_rank_bytes"]/1048576))' "$json")
  sent=$(python3 -c 'import json,sys; print("%.0f MB" % (json.loads(sys.argv[1])["sent_per_step_bytes"]/1048576))' "$json")
  $tessera fit --config "$config" --set trainer.default_root_dir="$dir" "$@" > "$dir.log" 2>&1 \
    || { echo "$name failed:" >&2; tail -20 "$dir.log" >&2; exit 1; }
  measured=$(awk -F, '$4=="peak_rss_mb" {printf "%.0f", $5}' "$dir/version_0/metrics.csv")
  printf "%-26s %10s %10s %+7.1f%%   %s\n" "$name" "$planned" "$measured" \
    "$(python3 -c "print(100*($planned-$measured)/$measured)")" "$sent"
}

run single_device --set data.batch_size=4
run ddp_2 --set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=2
for n in 1 2 4; do
  run "fsdp_full_shard_$n" --set launch.devices=$n --set strategy.plugin=fsdp --set data.batch_size=$((4 / n))
done
run fsdp_shard_grad_op_2 --set launch.devices=2 --set strategy.plugin=fsdp --set strategy.sharding_strategy=SHARD_GRAD_OP \
  --set data.batch_size=2
run fsdp_deferred_init_4 --set launch.devices=4 --set strategy.plugin=fsdp --set strategy.deferred_init=true \
  --set data.batch_size=1
run fsdp2_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=2
run fsdp2_4 --set launch.devices=4 --set strategy.plugin=fsdp2 --set data.batch_size=1
run fsdp2_tp2_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2 \
  --set data.batch_size=4
run fsdp2_dp2_tp2_4 --set launch.devices=4 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2 \
  --set data.batch_size=2
run fsdp_bf16_mixed_2 --set launch.devices=2 --set strategy.plugin=fsdp --set precision.plugin=fsdp-precision \
  --set precision.precision=bf16-mixed --set data.batch_size=2
# Activation checkpointing, at a batch where activations are a third of the peak without it.
run fsdp_checkpointed_2 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=16 \
  --set 'strategy.activation_checkpointing=["Block"]'
run fsdp2_checkpointed_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=16 \
  --set 'strategy.activation_checkpointing=["Block"]'
# accumulate_grad_batches = 4: every unit keeps its unsharded gradient (PyTorch's no_sync), or
# reduce_every_micro_batch reduce-scatters each micro-batch instead.
run fsdp_accumulating_2 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2 \
  --set trainer.accumulate_grad_batches=4
run fsdp_reduce_every_2 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=2 \
  --set trainer.accumulate_grad_batches=4 --set strategy.reduce_every_micro_batch=true
run fsdp2_accumulating_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=2 \
  --set trainer.accumulate_grad_batches=4
# Tensor parallelism with checkpointing: the recomputed blocks all-reduce their activations again.
run fsdp2_tp2_checkpointed_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2 \
  --set data.batch_size=16 --set 'strategy.activation_checkpointing=["Block"]'
