#!/usr/bin/env bash
# The real pipeline, end to end (configs/gpt-tokens.toml): a BPE tokenizer trained on the shipped
# fortunes corpus, the corpus prepared into token shards, the GPT trained on them with fsdp2 on 2
# ranks, and a sample. Usage: bash configs/gpt-tokens.sh [--set section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
tessera=${TESSERA:-build/bin/tessera}
out=runs/gpt-tokens
start=$(date +%s)
if [ ! -f "$out/tokenizer/tokenizer.model" ]; then
  if "$tessera" tokenizer --help > /dev/null 2>&1; then
    "$tessera" tokenizer train --input /usr/share/games/fortunes --vocab-size 2000 --type bpe --output "$out/tokenizer"
  else  # a tessera without `tokenizer train`: SentencePiece's own trainer (Debian's sentencepiece), the same model
    mkdir -p "$out/tokenizer"
    for f in /usr/share/games/fortunes/*; do [ -L "$f" ] || [[ "$f" == *.dat ]] || cat "$f"; done > "$out/tokenizer/corpus.txt"
    spm_train --input="$out/tokenizer/corpus.txt" --model_prefix="$out/tokenizer/tokenizer" --vocab_size=2000 \
      --model_type=bpe --minloglevel=2
  fi
fi
"$tessera" data prepare --tokenizer "$out/tokenizer/tokenizer.model" --input /usr/share/games/fortunes \
  --split percent --output "$out/data"
"$tessera" fit --config configs/gpt-tokens.toml "$@"
echo "gpt-tokens: tokenizer, prepare, fit and sample in $(( $(date +%s) - start )) s"
