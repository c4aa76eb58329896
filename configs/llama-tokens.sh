#!/usr/bin/env bash
# The main job, end to end (configs/llama-tokens.toml): a BPE tokenizer trained on the shipped
# fortunes corpus, the corpus prepared into token shards, a small Llama trained on them with fsdp2
# on 2 ranks, and a sample. Usage: bash configs/llama-tokens.sh [--set section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
tessera=${TESSERA:-build/bin/tessera}
out=runs/llama-tokens
start=$(date +%s)
[ -f "$out/tokenizer/tokenizer.model" ] ||
  "$tessera" tokenizer train --input /usr/share/games/fortunes --vocab-size 2000 --type bpe --output "$out/tokenizer"
"$tessera" data prepare --tokenizer "$out/tokenizer/tokenizer.model" --input /usr/share/games/fortunes \
  --split percent --output "$out/data"
"$tessera" fit --config configs/llama-tokens.toml "$@"
echo "llama-tokens: tokenizer, prepare, fit and sample in $(( $(date +%s) - start )) s"
