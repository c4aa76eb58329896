#!/usr/bin/env bash
# On the lent GPU machine, after `bash .gpu-deps/build.sh` (see shared/gpu/README.md):
# Tessera's CUDA/NCCL path (world size 1: NCCL cannot put two ranks on one GPU) against
# PyTorch's own FSDP2 on the same GPT, in one run. Writes $OUT/gpu-bench.txt.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
tessera=build-gpu/bin/tessera
steps="${1:-50}"
{
for run in fsdp:32-true fsdp:bf16-mixed fsdp:16-mixed fsdp:16-true fsdp_cpu_offload:32-true; do
  strategy=${run%%:*}; precision=${run#*:}
  dir=/tmp/gpu-$strategy-$precision
  rm -rf "$dir"
  $tessera fit --config configs/gpt-fortunes.toml --set launch.devices=1 --set strategy.accelerator=cuda \
    --set strategy.plugin=$strategy --set precision.precision=$precision --set trainer.max_steps=$steps \
    --set trainer.log_every_n_steps=5 --set trainer.val_check_interval=0 --set trainer.checkpoint_every_n_steps=0 \
    --set trainer.predict_after_fit=false --set trainer.default_root_dir=$dir --set model.n_layer=6 \
    --set model.n_embd=384 --set model.n_head=6 --set data.batch_size=8 --set optimizer.warmup_steps=0 \
    ${FORTUNES:+--set data.path=$FORTUNES} $([ "$precision" = 16-true ] && echo --set optimizer.eps=1e-4) > "$dir.log" 2>&1
  rc=$?
  tps=$(awk -F, '$4=="tokens_per_s" {n++; if (n > 2) {s+=$5; c++}} END {if (c) printf "%.0f", s/c}' "$dir/version_0/metrics.csv" 2>/dev/null)
  loss=$(awk -F, '$4=="train_loss" {l=$5} END {print l}' "$dir/version_0/metrics.csv" 2>/dev/null)
  mem=$(awk -F, '$4=="peak_cuda_mb" {printf "%.0f", $5}' "$dir/version_0/metrics.csv" 2>/dev/null)
  echo "tessera $strategy $precision rc=$rc tokens_per_s=$tps final_loss=$loss peak_cuda_mb=$mem"
  [ $rc -eq 0 ] || tail -5 "$dir.log"
done
for precision in 32-true bf16-mixed; do
  python3 bench/gpu/pytorch_fsdp2_gpt.py --steps "$steps" --precision $precision 2>&1 | tail -1
done
} | tee "$out/gpu-bench.txt"
