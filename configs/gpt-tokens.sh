#!/usr/bin/env bash
# The real pipeline, end to end (configs/gpt-tokens.toml): a BPE tokenizer trained on the shipped
# fortunes corpus, the corpus prepared into token shards, the GPT trained on them with fsdp2 on 2
# ranks, and a sample. Usage: bash configs/gpt-tokens.sh [--set section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
tessera=${TESSERA:-build/bin/tessera}
out=runs/gpt-tokens
start=$(date +%s)
[ -f "$out/tokenizer/tokenizer.model" ] ||
  "$tessera" tokenizer train --input /usr/share/games/fortunes --vocab-size 2000 --type bpe --output "$out/tokenizer"
"$tessera" data prepare --tokenizer "$out/tokenizer/tokenizer.model" --input /usr/share/games/fortunes \
  --split percent --output "$out/data"
"$tessera" fit --config configs/gpt-tokens.toml "$@"
echo "gpt-tokens: tokenizer, prepare, fit and sample in $(( $(date +%s) - start )) s"
