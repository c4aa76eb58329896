#!/usr/bin/env bash
# One device call: build (bench/gpu/build.sh), run the CUDA and precision tests, then
# bench/gpu/run.sh (tessera vs PyTorch FSDP2 on the same GPT).
set -uo pipefail
out="${OUT:-/tmp/out}"
bash bench/gpu/build.sh || exit 1
# The corpus comes from the carried fortunes package (the machine has no network); the
# tests read the text plugin's default path.
export FORTUNES=/tmp/deps/usr/share/games/fortunes
[ -e /usr/share/games/fortunes ] || { mkdir -p /usr/share/games && ln -s "$FORTUNES" /usr/share/games/fortunes; }
(cd build-gpu && timeout 300 ctest -j 4 -R "CUDA|PluginLoader|Options|Collectives|Precision|Policy" --output-on-failure) \
  > "$out/ctest.log" 2>&1
tail -15 "$out/ctest.log"
timeout 300 bash bench/gpu/run.sh 40
