#!/usr/bin/env bash
# Throughput and memory of Tessera's strategies against each other and against PyTorch's own
# DDP, all measured in this one run on this machine (ratios, never absolute pass/fail).
#   bash bench/training/run.sh [steps] [rounds]  (after .ci/setup; ~10 minutes a round on 2 cores)
# GPT of the issue: 6 layers, 384 wide, 6 heads, 128 tokens, batch 8 per rank, 2 ranks
# (single device: batch 16, the same global batch). With several rounds every row runs once per
# round, the rounds one after another (so a slow spell of this shared machine hits every row
# alike), and the table and ratios take each row's median.
#   PAIRS=n bash bench/training/run.sh [steps]  runs only the issue's four comparisons, each as n
# pairs of back-to-back runs in alternating order (A B, B A, ...: a host that drifts favours
# neither side) and prints every pair's ratio and their median (~2.5 minutes a pair on 2 cores).
# ONLY=regex (with PAIRS) keeps the comparisons whose label matches, e.g. ONLY="PyTorch DDP".
# The llama rows: a byte-level Llama (Hugging Face's LlamaForCausalLM: 8 layers, 384 wide, 6 query
# and 2 key-value heads, SwiGLU 1024, tied embeddings, 12.7M parameters), 128 tokens, batch 8 per
# rank, fsdp2 on 2 ranks against PyTorch's DDP on the same Llama (pytorch_ddp_gpt.py --model llama):
#   PAIRS=3 ONLY=llama bash bench/training/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
steps="${1:-30}"
rounds="${2:-1}"
tessera=build/bin/tessera
out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT
# The run settings both models share, then each model's section.
common() {
  cat <<TOML
[trainer]
max_steps = $steps
log_every_n_steps = 5
enable_progress_bar = false
save_last = false
[optimizer]
lr = 3e-4
schedule = "constant"
[data]
plugin = "text"
block_size = 128
TOML
}
{ common; cat <<TOML; } > "$out/gpt.toml"
[model]
plugin = "gpt"
n_layer = 6
n_head = 6
n_embd = 384
block_size = 128
TOML
{ common; cat <<TOML; } > "$out/llama.toml"
[model]
plugin = "llama"
vocab_size = 256
hidden_size = 384
intermediate_size = 1024
num_hidden_layers = 8
num_attention_heads = 6
num_key_value_heads = 2
rms_norm_eps = 1e-5
tie_word_embeddings = true
TOML

# tokens/s averaged over the logged windows after the first two (warm-up), and peak RSS.
# CONFIG: the run's config (default: the GPT's).
run() {
  local name="$1"; shift
  local dir="$out/$name-$round"
  $tessera fit --config "${CONFIG:-$out/gpt.toml}" --set trainer.default_root_dir="$dir" "$@" > "$dir.log" 2>&1 \
    || { echo "$name failed:"; tail -20 "$dir.log"; exit 1; }
  local tps rss
  tps=$(awk -F, '$4=="tokens_per_s" {n++; if (n > 2) {s+=$5; c++}} END {printf "%.0f", s/c}' "$dir/version_0/metrics.csv")
  rss=$(awk -F, '$4=="peak_rss_mb" {printf "%.0f", $5}' "$dir/version_0/metrics.csv")
  echo "$name $tps $rss $round" >> "$out/results"
  printf "%-28s %10s tokens/s %8s MB peak RSS per rank\n" "$name" "$tps" "$rss"
}

PYTORCH_ENV=""
pytorch() {
  local name="$1"; shift
  local line
  line=$(env $PYTORCH_ENV /usr/bin/python3 bench/training/pytorch_ddp_gpt.py --steps "$steps" --port $((20000 + RANDOM % 20000)) "$@")
  echo "$line"
  echo "$name $(sed -E 's/.*tokens_per_s=([0-9.]+).*/\1/' <<< "$line") $(sed -E 's/.*peak_rss_mb=([0-9.]+).*/\1/' <<< "$line") $round" >> "$out/results"
}

# The rows of the issue's comparisons, run by the rounds below and by PAIRS mode.
single="run single_device --set data.batch_size=16"
# PyTorch given the thread settings tessera runs with (host/train/worker_threads.cpp).
pytorch_tuned="PYTORCH_ENV='GOMP_SPINCOUNT=10000 OPENBLAS_THREAD_TIMEOUT=20' pytorch pytorch_single_tuned --ranks 1 --batch-size 16"
ddp="run ddp_2 --set launch.devices=2 --set strategy.plugin=ddp --set data.batch_size=8"
pytorch_ddp="pytorch pytorch_ddp_2 --ranks 2"
fsdp="run fsdp_full_shard_2 --set launch.devices=2 --set strategy.plugin=fsdp --set data.batch_size=8"
llama_fsdp2="CONFIG=$out/llama.toml run llama_fsdp2_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=8"
pytorch_ddp_llama="pytorch pytorch_ddp_llama_2 --ranks 2 --model llama --n-layer 8"

if [ "${PAIRS:-0}" -gt 0 ]; then
  comparison=0
  last() { tail -1 "$out/results" | cut -d' ' -f2; }  # tokens/s of the row that ran last
  # $1: label; $2, $3: the two rows' commands (run or pytorch above). Prints a/b per pair, median.
  pairs() {
    local ratios="" i a b
    comparison=$((comparison + 1))
    grep -qE -- "${ONLY:-.}" <<< "$1" || return 0
    for i in $(seq "$PAIRS"); do
      round="p$comparison.$i"  # each run its own folder
      if [ $((i % 2)) = 1 ]; then eval "$2"; a=$(last); eval "$3"; b=$(last)
      else eval "$3"; b=$(last); eval "$2"; a=$(last); fi
      ratios="$ratios $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.2f", a / b}')"
    done
    printf "  %-34s%s  (%sx)\n" "$1" "$ratios" \
      "$(tr ' ' '\n' <<< "$ratios" | grep . | sort -n | awk '{v[NR] = $1} END {print v[int(NR / 2) + 1]}')"
  }
  echo "A B B A pairs, $PAIRS per comparison, $steps steps a run (each pair's ratio, then the median):"
  pairs "tessera single / PyTorch tuned" "$single" "$pytorch_tuned"
  pairs "tessera DDP / PyTorch DDP" "$ddp" "$pytorch_ddp"
  pairs "FSDP FULL_SHARD / tessera DDP" "$fsdp" "$ddp"
  pairs "FSDP FULL_SHARD / PyTorch DDP" "$fsdp" "$pytorch_ddp"
  pairs "llama fsdp2 / PyTorch DDP" "$llama_fsdp2" "$pytorch_ddp_llama"
  exit 0
fi

for round in $(seq "$rounds"); do
[ "$rounds" -gt 1 ] && echo "round $round of $rounds"
# Each PyTorch row right after the tessera row it is compared with: a slow spell hits both.
eval "$single"
eval "$pytorch_tuned"
pytorch pytorch_single --ranks 1 --batch-size 16
eval "$ddp"
eval "$pytorch_ddp"
eval "$fsdp"
run fsdp_full_shard_prefetch_2 --set launch.devices=2 --set strategy.plugin=fsdp --set strategy.forward_prefetch=true \
  --set data.batch_size=8
run fsdp_shard_grad_op_2 --set launch.devices=2 --set strategy.plugin=fsdp \
  --set strategy.sharding_strategy=SHARD_GRAD_OP --set data.batch_size=8
# bf16 matmuls are emulated (~20x slower than fp32) on CPUs without AVX512-BF16/AMX.
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  run fsdp_bf16_mixed_2 --set launch.devices=2 --set strategy.plugin=fsdp --set precision.plugin=fsdp-precision \
    --set precision.precision=bf16-mixed --set data.batch_size=8
else
  echo "fsdp_bf16_mixed_2: not run (this CPU has no native bf16: no avx512_bf16 or amx_bf16 in /proc/cpuinfo)"
fi
run fsdp2_2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set data.batch_size=8
# Tensor parallelism: both ranks read the same 16 samples (the same global batch).
run fsdp2_tp2 --set launch.devices=2 --set strategy.plugin=fsdp2 --set strategy.tensor_parallel_size=2 \
  --set data.batch_size=16
# 4 ranks on this machine's cores (oversubscribed on 2 cores: compare them with each other).
run ddp_4 --set launch.devices=4 --set strategy.plugin=ddp --set data.batch_size=4
run fsdp_4 --set launch.devices=4 --set strategy.plugin=fsdp --set data.batch_size=4
run fsdp2_4 --set launch.devices=4 --set strategy.plugin=fsdp2 --set data.batch_size=4
eval "$llama_fsdp2"
eval "$pytorch_ddp_llama"
done

# Each row's median run by tokens/s over the rounds (the upper middle one of an even count), with its RSS.
sort -k1,1 -k2,2n "$out/results" | awk '
  $1 != name { if (name != "") print name, tps[int(n / 2) + 1], rss[int(n / 2) + 1]; name = $1; n = 0 }
  { n++; tps[n] = $2; rss[n] = $3 }
  END { print name, tps[int(n / 2) + 1], rss[int(n / 2) + 1] }' > "$out/medians"
if [ "$rounds" -gt 1 ]; then
  echo
  echo "medians over $rounds rounds:"
  awk '{printf "  %-28s %10.0f tokens/s %8.0f MB peak RSS per rank\n", $1, $2, $3}' "$out/medians"
fi

echo
echo "ratios (same run$([ "$rounds" -gt 1 ] && echo ", medians over $rounds rounds")):"
awk '{tps[$1]=$2; rss[$1]=$3}
     END {
       printf "  FSDP FULL_SHARD / tessera DDP      %.2fx tokens/s\n", tps["fsdp_full_shard_2"]/tps["ddp_2"];
       printf "  FSDP FULL_SHARD / PyTorch DDP      %.2fx tokens/s\n", tps["fsdp_full_shard_2"]/tps["pytorch_ddp_2"];
       printf "  FSDP FULL_SHARD + forward_prefetch / tessera DDP  %.2fx tokens/s\n", tps["fsdp_full_shard_prefetch_2"]/tps["ddp_2"];
       printf "  FSDP SHARD_GRAD_OP / tessera DDP   %.2fx tokens/s\n", tps["fsdp_shard_grad_op_2"]/tps["ddp_2"];
       printf "  tessera DDP / PyTorch DDP          %.2fx tokens/s\n", tps["ddp_2"]/tps["pytorch_ddp_2"];
       printf "  tessera DDP (2 ranks) / single     %.2fx tokens/s\n", tps["ddp_2"]/tps["single_device"];
       if ("fsdp_bf16_mixed_2" in tps)
         printf "  FSDP bf16-mixed / FSDP 32-true     %.2fx tokens/s, %.2fx peak RSS\n", tps["fsdp_bf16_mixed_2"]/tps["fsdp_full_shard_2"], rss["fsdp_bf16_mixed_2"]/rss["fsdp_full_shard_2"];
       printf "  peak RSS FSDP / DDP                %.2fx\n", rss["fsdp_full_shard_2"]/rss["ddp_2"];
       printf "  tessera single / PyTorch single    %.2fx tokens/s (%.2fx PyTorch with tessera'"'"'s GOMP_SPINCOUNT and OPENBLAS_THREAD_TIMEOUT)\n", tps["single_device"]/tps["pytorch_single"], tps["single_device"]/tps["pytorch_single_tuned"];
       printf "  fsdp2 / fsdp (2 ranks)             %.2fx tokens/s, %.2fx peak RSS\n", tps["fsdp2_2"]/tps["fsdp_full_shard_2"], rss["fsdp2_2"]/rss["fsdp_full_shard_2"];
       printf "  fsdp2 / tessera DDP (2 ranks)      %.2fx tokens/s, %.2fx peak RSS\n", tps["fsdp2_2"]/tps["ddp_2"], rss["fsdp2_2"]/rss["ddp_2"];
       printf "  tp 2 / dp 2 (fsdp2, 2 ranks)       %.2fx tokens/s, %.2fx peak RSS\n", tps["fsdp2_tp2"]/tps["fsdp2_2"], rss["fsdp2_tp2"]/rss["fsdp2_2"];
       printf "  4 ranks: fsdp / ddp                %.2fx tokens/s, %.2fx peak RSS\n", tps["fsdp_4"]/tps["ddp_4"], rss["fsdp_4"]/rss["ddp_4"];
       printf "  4 ranks: fsdp2 / fsdp              %.2fx tokens/s, %.2fx peak RSS\n", tps["fsdp2_4"]/tps["fsdp_4"], rss["fsdp2_4"]/rss["fsdp_4"];
       printf "  llama fsdp2 / PyTorch DDP          %.2fx tokens/s, %.2fx peak RSS\n", tps["llama_fsdp2_2"]/tps["pytorch_ddp_llama_2"], rss["llama_fsdp2_2"]/rss["pytorch_ddp_llama_2"];
     }' "$out/medians"

# The issue's comparisons round by round (the two rows of a pair run one after the other, so a
# slow spell of this shared machine that hits a round hits both) and their median.
if [ "$rounds" -gt 1 ]; then
  echo
  echo "per round (median):"
  awk '{tps[$1, $4] = $2; if ($4 > rounds) rounds = $4}
       function pair(label, a, b,   r, n, v, i, j, t, text) {
         n = 0; text = ""
         for (r = 1; r <= rounds; r++) if (((a, r) in tps) && ((b, r) in tps)) {
           v[++n] = tps[a, r] / tps[b, r]; text = text sprintf(" %.2f", v[n])
         }
         for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j - 1] > v[j]; j--) { t = v[j]; v[j] = v[j - 1]; v[j - 1] = t }
         if (n > 0) printf "  %-34s%s  (%.2fx)\n", label, text, v[int(n / 2) + 1]
       }
       END {
         pair("tessera single / PyTorch tuned", "single_device", "pytorch_single_tuned");
         pair("tessera DDP / PyTorch DDP", "ddp_2", "pytorch_ddp_2");
         pair("FSDP FULL_SHARD / tessera DDP", "fsdp_full_shard_2", "ddp_2");
         pair("FSDP FULL_SHARD / PyTorch DDP", "fsdp_full_shard_2", "pytorch_ddp_2");
       }' "$out/results"
fi
