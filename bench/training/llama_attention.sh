#!/usr/bin/env bash
# The llama's attention, T x T math path against the toolkit's default kernel (the query-blocked
# kernel on LibTorch 1.13, SDPA on 2.x), on a 4-layer byte-level Llama (384 wide, 6 query and 2
# key-value heads, SwiGLU 1024), one sequence per step, one device:
#   - `tessera plan`'s activations and `tessera fit`'s measured peak RSS (2 AdamW steps) for
#     T = 512, 1024, 2048, 4096;
#   - KV-cache decoding: `tessera predict` time per generated token after a prompt of 16 and of
#     1,024 tokens ((time for 129 new tokens - time for 1) / 128: prefill and start-up cancel).
#   bash bench/training/llama_attention.sh [build-dir]        (~5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
tessera="${1:-build}/bin/tessera"
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
cat > "$out/llama.toml" <<TOML
[trainer]
max_steps = 2
log_every_n_steps = 1
enable_progress_bar = false
save_last = false
[optimizer]
lr = 3e-4
[model]
plugin = "llama"
vocab_size = 256
hidden_size = 384
intermediate_size = 1024
num_hidden_layers = 4
num_attention_heads = 6
num_key_value_heads = 2
tie_word_embeddings = true
max_position_embeddings = 4096  # the longest T below (a longer block_size is refused)
[data]
plugin = "text"
batch_size = 1
TOML

mb() { python3 -c "print(round($1 / 1048576))"; }
printf "%-6s %-10s %16s %16s\n" "T" "attention" "plan activations" "fit peak RSS"
for T in 512 1024 2048 4096; do
  for kernel in math automatic; do
    sets="--set data.block_size=$T --set model.attention=$kernel"
    json=$($tessera plan --json --config "$out/llama.toml" $sets)
    act=$(python3 -c 'import json,sys; print(round(json.loads(sys.argv[1])["per_rank_bytes"]["activations"]/1048576))' "$json")
    dir="$out/fit-$T-$kernel"
    $tessera fit --config "$out/llama.toml" --set trainer.default_root_dir="$dir" $sets > "$dir.log" 2>&1 \
      || { echo "fit T=$T $kernel failed:" >&2; tail -20 "$dir.log" >&2; exit 1; }
    rss=$(awk -F, '$4=="peak_rss_mb" {printf "%.0f", $5}' "$dir/version_0/metrics.csv")
    printf "%-6s %-10s %13s MB %13s MB\n" "$T" "$kernel" "$act" "$rss"
  done
done

# Decoding: the weights of one short training run, greedy, no EOS.
$tessera fit --config "$out/llama.toml" --set trainer.default_root_dir="$out/weights" --set trainer.save_last=true \
  --set data.block_size=64 > "$out/weights.log" 2>&1 || { tail -20 "$out/weights.log" >&2; exit 1; }
seconds() {
  local prompt_len="$1" new="$2" start end
  local prompt
  prompt=$(python3 -c "print('x' * $prompt_len)")
  start=$(date +%s.%N)
  $tessera predict --config "$out/llama.toml" --set trainer.default_root_dir="$out/weights" --ckpt-path last \
    --set model.max_new_tokens=$new --set "data.prompt=\"$prompt\"" > "$out/predict.log" 2>&1 \
    || { echo "predict failed:" >&2; tail -20 "$out/predict.log" >&2; exit 1; }
  end=$(date +%s.%N)
  python3 -c "print($end - $start)"
}
echo
printf "%-14s %18s\n" "prompt tokens" "ms per new token"
for P in 16 1024; do
  one=$(seconds "$P" 1)
  many=$(seconds "$P" 129)
  printf "%-14s %18.1f\n" "$P" "$(python3 -c "print(1000 * ($many - $one) / 128)")"
done
