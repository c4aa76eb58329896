#!/usr/bin/env bash
# On the lent GPU machine (it starts bare each time):
#   here:   bash bench/gpu/fetch-deps.sh
#   device: run, carry [".gpu-deps"], command "bash bench/gpu/build_and_bench.sh [stages]"
# Stages (default all three): build (bench/gpu/build.sh), test (the CUDA, one-device parity
# and precision tests), bench (bench/gpu/run.sh: tessera against the strongest eager PyTorch on
# the same model, issue 48). The build took ~90 s on the H200 (16 cores). The bench runs 7 rows
# twice per shape (A B ... B A): give it a call of its own (`build_and_bench.sh bench`, the build
# folder is kept between calls on a warm machine) with SHAPES=llama-1b or SHAPES=gpt-1.3b.
# "build bench" builds only the binary and the plugins the bench runs (BUILD_TARGETS names others).
# PROFILE=1 makes the bench stage say where a step goes instead (bench/gpu/run.sh): tessera's
# `[trainer] profiler = "pytorch"` and torch.profiler, the kernels by device time, per row.
# What the 2026-11-28 H200 calls ran, and what to run next: docs/performance.md.
# Logs and results land in $OUT.
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out"
stages="${*:-build test bench}"
export LD_LIBRARY_PATH="/tmp/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The corpus comes from the carried fortunes package (the machine has no network); the
# tests read the text plugin's default path.
export FORTUNES=/tmp/deps/usr/share/games/fortunes
if [[ " $stages " == *" build "* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # Only what the bench and the CUDA tests run (the other tests are most of the build);
  # BUILD_TARGETS=all builds everything.
  if [ -z "${BUILD_TARGETS:-}" ]; then
    export BUILD_TARGETS="tessera tessera_single_device tessera_ddp tessera_fsdp tessera_fsdp2 tessera_precision
      tessera_fsdp_precision tessera_checkpoint_io tessera_models tessera_data"
    [[ " $stages " != *" test "* ]] || BUILD_TARGETS+=" fsdp_test precision_test"
  fi
  [ "$BUILD_TARGETS" != all ] || unset BUILD_TARGETS
  bash bench/gpu/build.sh || exit 1
fi
[ -e /usr/share/games/fortunes ] || { mkdir -p /usr/share/games && ln -s "$FORTUNES" /usr/share/games/fortunes; }
if [[ " $stages " == *" test "* ]]; then
  # The tests that use the GPU (each skips without one, so CI reports them skipped).
  (cd build-gpu && timeout "${TEST_TIMEOUT:-240}" ctest -j 4 -R "${TESTS:-CUDA\.|OneDevice|GradScaler\.Cuda}" \
    --output-on-failure) > "$out/ctest.log" 2>&1
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\(Skipped\)" "$out/ctest.log" | head -20
fi
if [[ " $stages " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-570}" bash bench/gpu/run.sh "${STEPS:-20}"
fi
