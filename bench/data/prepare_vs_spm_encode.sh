#!/usr/bin/env bash
# `tessera data prepare` against SentencePiece's own `spm_encode` (Debian package sentencepiece)
# on the same input, the same tokenizer and the same cores: the fortunes corpus repeated COPIES
# times, one document per line (spm_encode's unit), and a BPE model of 2,000 pieces.
# spm_encode is single-threaded: it gets the input cut into JOBS parts, one process each, run
# at once. Prints each side's seconds and MB/s and the ratio (prepare throughput / spm_encode's).
# Usage: bash bench/data/prepare_vs_spm_encode.sh [COPIES=20] [JOBS=nproc]
set -euo pipefail
cd "$(dirname "$0")/../.."
copies=${1:-20}
jobs=${2:-$(nproc)}
tessera=${TESSERA:-build/bin/tessera}
work=$(mktemp -d /tmp/tessera-prepare-bench.XXXXXX)
trap 'rm -rf "$work"' EXIT

corpus=$work/corpus.txt
for f in /usr/share/games/fortunes/*; do
  [ -L "$f" ] || [[ "$f" == *.dat ]] || cat "$f"
done | grep -v '^%$' | grep -v '^[[:space:]]*$' > "$work/once.txt"
for _ in $(seq "$copies"); do cat "$work/once.txt"; done > "$corpus"
bytes=$(stat -c %s "$corpus")
spm_train --input="$work/once.txt" --model_prefix="$work/tok" --vocab_size=2000 --model_type=bpe \
  --minloglevel=2 > /dev/null 2>&1

# spm_encode: JOBS processes over JOBS line-aligned parts.
split -n "l/$jobs" "$corpus" "$work/part."
cat "$corpus" > /dev/null  # both sides start from the page cache
# Wall seconds and CPU seconds (user + system) of each side: on a shared machine the CPU time is
# the steadier figure.
TIMEFORMAT='%R %U %S'
spm_times=$( { time {
  for part in "$work"/part.*; do
    spm_encode --model="$work/tok.model" --output_format=id --input="$part" --output="$part.ids" &
  done
  wait
} ; } 2>&1 )
our_times=$( { time "$tessera" data prepare --tokenizer "$work/tok.model" --input "$corpus" --split line \
  --jobs "$jobs" --output "$work/prepared" > "$work/prepare.log" 2>&1 ; } 2>&1 ) || { cat "$work/prepare.log"; exit 1; }
read -r spm spm_user spm_sys <<< "$spm_times"
read -r ours our_user our_sys <<< "$our_times"

spm_tokens=$(cat "$work"/part.*.ids | wc -w)
our_tokens=$(python3 -c "import json; m=json.load(open('$work/prepared/manifest.json')); print(m['total_tokens'] - m['total_documents'])")
mb=$(echo "$bytes / 1000000" | bc -l)
printf 'input: %.1f MB (%d copies of the fortunes, one document per line), %d cores\n' "$mb" "$copies" "$jobs"
printf 'spm_encode x%d:         %6.2f s wall  %6.2f MB/s  %6.2f CPU s  %d tokens\n' "$jobs" "$spm" \
  "$(echo "$mb / $spm" | bc -l)" "$(echo "$spm_user + $spm_sys" | bc -l)" "$spm_tokens"
printf 'tessera data prepare:  %6.2f s wall  %6.2f MB/s  %6.2f CPU s  %d tokens (+1 EOS per document)\n' "$ours" \
  "$(echo "$mb / $ours" | bc -l)" "$(echo "$our_user + $our_sys" | bc -l)" "$our_tokens"
printf 'ratio, prepare / spm_encode: %.2fx by wall time, %.2fx by CPU time\n' "$(echo "$spm / $ours" | bc -l)" \
  "$(echo "($spm_user + $spm_sys) / ($our_user + $our_sys)" | bc -l)"
