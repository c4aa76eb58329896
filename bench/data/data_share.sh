#!/usr/bin/env bash
# The data share of the step (issue 44: under 1%): the bench GPT (6 layers, 384 wide, 128 tokens,
# batch 8 per rank) trained with fsdp2 on 2 ranks from token shards of the fortunes corpus (a
# 2,000-piece BPE tokenizer trained here), under [trainer] profiler = "simple". Prints the
# profiler's `[DataLoader]next` row (the time a rank waits for its next batch) against the run.
#   bash bench/data/data_share.sh [steps=30]
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-30}
tessera=${TESSERA:-$PWD/build/bin/tessera}
work=$(mktemp -d /tmp/tessera-data-share.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$tessera" tokenizer train --input /usr/share/games/fortunes --vocab-size 2000 --type bpe --output tok > /dev/null 2>&1
"$tessera" data prepare --tokenizer tok/tokenizer.model --input /usr/share/games/fortunes --split percent \
  --output data > /dev/null 2>&1
cat > fit.toml <<TOML
[trainer]
max_steps = $steps
enable_progress_bar = false
save_last = false
num_sanity_val_steps = 0
limit_val_batches = 0
profiler = "simple"
default_root_dir = "runs"
[optimizer]
lr = 3e-4
schedule = "constant"
[launch]
devices = 2
[strategy]
plugin = "fsdp2"
[model]
plugin = "gpt"
vocab_size = 2000
n_layer = 6
n_head = 6
n_embd = 384
block_size = 128
[data]
plugin = "tokens"
path = "data"
tokenizer = "tok/tokenizer.model"
block_size = 128
batch_size = 8
TOML
"$tessera" fit --config fit.toml > fit.log 2>&1 || { cat fit.log; exit 1; }
grep -E "Profiler report|Action|\[Strategy\]|\[DataLoader\]next" fit.log
python3 - fit.log <<'PY'
import re, sys
text = open(sys.argv[1]).read()
recorded = float(re.search(r"Profiler report \(simple\): ([0-9.]+) s recorded", text).group(1))
row = re.search(r"\[DataLoader\]next\s*\|\s*([0-9.]+)\s*\|\s*(\d+)\s*\|\s*([0-9.]+)", text)
mean_ms, calls, total = float(row.group(1)), int(row.group(2)), float(row.group(3))
print(f"data share of the run: {100 * total / recorded:.3f}% ({mean_ms:.3f} ms per batch over {calls} "
      f"steps; {1000 * recorded / calls:.0f} ms per step)")
PY
