#!/usr/bin/env bash
# Installs Tessera into a temporary prefix, builds examples/softmax_regression (a model) and
# examples/stop_on_loss (a callback) out of tree against the installed SDK
# (find_package(TesseraSDK)), and trains with the installed `tessera` binary, which finds
# them through TESSERA_PLUGIN_PATH.
set -euo pipefail
build_dir="$1"; source_dir="$2"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$source_dir/examples/softmax_regression" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
cmake -S "$source_dir/examples/stop_on_loss" -B "$work/build-callback" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build-callback" >/dev/null
export TESSERA_PLUGIN_PATH="$work/build:$work/build-callback"
"$work/prefix/bin/tessera" plugins | tee "$work/plugins.txt"
grep -q "model .*softmax_regression .*1.0.0" "$work/plugins.txt"
grep -q "callback .*stop_on_loss .*1.0.0" "$work/plugins.txt"
grep -q "$work/prefix/lib/tessera/plugins/libtessera_fsdp.so" "$work/plugins.txt"  # the installed plugins
cat > "$work/run.toml" <<TOML
[trainer]
max_steps = 60
log_every_n_steps = 20
val_check_interval = 60
limit_val_batches = 5
default_root_dir = "$work/run"
enable_progress_bar = false
[launch]
devices = 2
[strategy]
plugin = "fsdp"
[model]
plugin = "softmax_regression"
[data]
plugin = "fashion_mnist"
batch_size = 32
train_limit = 4000
TOML
"$work/prefix/bin/tessera" fit --config "$work/run.toml" | tee "$work/fit.txt"
accuracy=$(grep -o "val_acc [0-9.]*" "$work/fit.txt" | tail -1 | cut -d' ' -f2)
echo "validation accuracy of the out-of-tree model: $accuracy"
awk -v a="$accuracy" 'BEGIN { exit !(a > 0.6) }'

# The callback stops the same run once the loss is below 1.2 (it starts near ln 10 = 2.3).
cat >> "$work/run.toml" <<TOML
[callbacks.stop_on_loss]
threshold = 1.2
TOML
"$work/prefix/bin/tessera" fit --config "$work/run.toml" --set trainer.default_root_dir="$work/run-cb" \
  --set trainer.max_steps=400 | tee "$work/fit-cb.txt"
grep -q "stop_on_loss: train_loss .* < 1.2" "$work/fit-cb.txt"
stop_step=$(awk -F, '$4=="steps_to_threshold" {print $1}' "$work/run-cb/version_0/metrics.csv")
last_step=$(awk -F, '$4=="peak_rss_mb" {print $1}' "$work/run-cb/version_0/metrics.csv")
echo "the out-of-tree callback stopped the run at step $stop_step (last step trained: $last_step)"
[ -n "$stop_step" ] && [ "$stop_step" = "$last_step" ] && [ "$stop_step" -lt 400 ]
