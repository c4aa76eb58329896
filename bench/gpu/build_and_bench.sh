#!/usr/bin/env bash
# One device call (the machine starts bare each time; keep build, tests and bench together):
#   here:   bash bench/gpu/fetch-deps.sh
#   device: run, carry [".gpu-deps"], command "bash bench/gpu/build_and_bench.sh"
# Builds (bench/gpu/build.sh), runs the CUDA and precision tests, then bench/gpu/run.sh
# (tessera against PyTorch FSDP2 on the same GPT). Logs and results land in $OUT.
set -uo pipefail
out="${OUT:-/tmp/out}"
bash bench/gpu/build.sh || exit 1
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The corpus comes from the carried fortunes package (the machine has no network); the
# tests read the text plugin's default path.
export FORTUNES=/tmp/deps/usr/share/games/fortunes
[ -e /usr/share/games/fortunes ] || { mkdir -p /usr/share/games && ln -s "$FORTUNES" /usr/share/games/fortunes; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
(cd build-gpu && timeout 240 ctest -j 8 -R "CUDA|Cuda|OneDevice|PluginLoader|Options|Collectives|Precision|Policy" --output-on-failure) \
  > "$out/ctest.log" 2>&1
grep -E "tests passed|tests failed|Failed|\(Failed\)|\(Timeout\)" "$out/ctest.log" | head -20
timeout 300 bash bench/gpu/run.sh "${STEPS:-40}"
