#!/usr/bin/env bash
# Supervised fine-tuning end to end (docs/fine-tuning.md), on files Debian ships:
#  1. a Hugging Face tokenizer folder (byte-level BPE, ChatML chat template) and the fortunes'
#     riddles as conversations (configs/sft/chat_folder.py);
#  2. a base Llama pre-trained on the fortunes (configs/llama-sft-base.toml), exported as a
#     Hugging Face folder;
#  3. the conversations prepared with a loss mask on the answers, then LoRA fine-tuning of the
#     base with packing (configs/llama-sft.toml);
#  4. a chat reply, the PEFT adapter folder, and the merged Hugging Face folder.
# Usage: bash configs/llama-sft.sh [--set section.key=value ...]   (applied to the LoRA fit)
set -euo pipefail
cd "$(dirname "$0")/.."
tessera=${TESSERA:-build/bin/tessera}
out=runs/llama-sft
base_steps=${SFT_BASE_STEPS:-300}
start=$(date +%s)
mkdir -p "$out"
python3 configs/sft/chat_folder.py "$out"
if [ ! -f "$out/base/config.json" ]; then
  [ -f "$out/fortunes/manifest.json" ] ||
    "$tessera" data prepare --tokenizer "$out/tokenizer" --input /usr/share/games/fortunes --split percent \
      --output "$out/fortunes"
  "$tessera" fit --config configs/llama-sft-base.toml --set trainer.max_steps="$base_steps"
  "$tessera" checkpoint export "$out/pretrain" --to "$out/base" --format hf
fi
[ -f "$out/chat/manifest.json" ] ||
  "$tessera" data prepare --format chat --tokenizer "$out/tokenizer" --input "$out/riddles.jsonl" \
    --output "$out/chat" --max-length 256
"$tessera" fit --config configs/llama-sft.toml "$@"
echo '{"messages": [{"role": "user", "content": "What is the name of the world'"'"'s oldest kamikaze pilot?"}]}' \
  > "$out/question.json"
"$tessera" predict --config configs/llama-sft.toml "$@" --messages "$out/question.json" --ckpt-path last
rm -rf "$out/adapter" "$out/merged"
"$tessera" checkpoint export "$out/sft" --to "$out/adapter" --format peft
"$tessera" checkpoint export "$out/sft" --to "$out/merged" --format hf
echo "llama-sft: tokenizer, base, chat data, LoRA fit, reply, adapter and merged folder in $(( $(date +%s) - start )) s"
