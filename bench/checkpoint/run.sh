#!/usr/bin/env bash
# Checkpoint save and load of a ~57M-parameter GPT (8 layers, 768 wide; ~0.68 GB of fp32
# parameters + AdamW moments) under FSDP at 1, 2 and 4 ranks: full (.ckpt written by rank 0)
# vs sharded (one safetensors file per rank), and the training time one checkpoint costs,
# sync vs [checkpoint_io] async = true. Save time is what the trainer logs as "training
# paused"; load time what it logs for "restored"; peak RSS is the largest of any process of
# the run (GNU time's %M over the launcher and its ranks: the busiest rank), and "load +MB" what
# the load itself added to the busiest rank's RSS at its peak (the trainer's "load peak").
#   bash bench/checkpoint/run.sh [build-dir]        (~15 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
tessera="$(realpath "${1:-build}")/bin/tessera"
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
cat > "$out/gpt.toml" <<TOML
[trainer]
max_steps = 1
log_every_n_steps = 1
enable_progress_bar = false
save_last = false
checkpoint_every_n_steps = 1
[optimizer]
name = "adamw"
lr = 3e-4
schedule = "constant"
[strategy]
plugin = "fsdp"
[model]
plugin = "gpt"
n_layer = 8
n_head = 12
n_embd = 768
block_size = 64
[data]
plugin = "text"
block_size = 64
batch_size = 1
TOML

seconds() { grep -o "$1 [0-9.]* s" "$2" | tail -1 | awk '{print $(NF-1)}'; }
printf "%-8s %-8s %10s %14s %10s %14s %10s %10s\n" ranks format "save s" "save peak MB" "load s" "load peak MB" "load +MB" \
  "MB on disk"
for n in 1 2 4; do
  for format in full sharded; do
    io=torch; [ "$format" = sharded ] && io=distributed
    dir="$out/$format-$n"
    sets=(--set trainer.default_root_dir="$dir" --set launch.devices=$n --set strategy.state_dict_type=$format
          --set checkpoint_io.plugin=$io)
    /usr/bin/time -f %M -o "$dir.save.rss" "$tessera" fit --config "$out/gpt.toml" "${sets[@]}" > "$dir.save.log" 2>&1 \
      || { tail -20 "$dir.save.log"; exit 1; }
    # Load: resume and train no further step (max_steps = 1 is already reached).
    /usr/bin/time -f %M -o "$dir.load.rss" "$tessera" fit --config "$out/gpt.toml" "${sets[@]}" \
      --set trainer.checkpoint_every_n_steps=0 --ckpt-path "$dir/version_0/checkpoints/last" > "$dir.load.log" 2>&1 \
      || { tail -20 "$dir.load.log"; exit 1; }
    printf "%-8s %-8s %10s %14s %10s %14s %10s %10s\n" $n $format "$(seconds paused "$dir.save.log")" \
      "$(( $(tail -1 "$dir.save.rss") / 1024 ))" "$(seconds in "$dir.load.log")" "$(( $(tail -1 "$dir.load.rss") / 1024 ))" \
      "$(grep -o "load peak +[0-9]*" "$dir.load.log" | tail -1 | grep -o "[0-9]*$")" \
      "$(du -sm "$(readlink -f "$dir/version_0/checkpoints/last")" | cut -f1)"
  done
done

# Training time lost per checkpoint: 2 ranks, sharded, a checkpoint every step vs none.
echo
for mode in none sync async; do
  dir="$out/time-$mode"
  sets=(--set trainer.default_root_dir="$dir" --set launch.devices=2 --set strategy.state_dict_type=sharded
        --set checkpoint_io.plugin=distributed --set trainer.max_steps=6 --set checkpoint_io.keep_last_k=1)
  [ "$mode" = none ] && sets+=(--set trainer.checkpoint_every_n_steps=0)
  [ "$mode" = async ] && sets+=(--set checkpoint_io.async=true)
  start=$(date +%s.%N)
  "$tessera" fit --config "$out/gpt.toml" "${sets[@]}" > "$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
  end=$(date +%s.%N)
  paused=$({ grep -o "paused [0-9.]* s" "$dir.log" || true; } | awk '{s += $2; n++} END {if (n) printf "%.2f s over %d saves", s, n}')
  printf "%-6s wall %6.1f s   training paused by saves: %s\n" $mode "$(echo "$end - $start" | bc)" "${paused:-none}"
done
