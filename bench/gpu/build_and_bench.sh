#!/usr/bin/env bash
# One device call: unpack the carried Debian packages, build against the wheel's CUDA
# LibTorch (as shared/gpu/build.sh does), run the fast test suites, then bench/gpu/run.sh.
set -uo pipefail
deps=/tmp/deps; out="${OUT:-/tmp/out}"; mkdir -p "$out" "$deps"
for f in .gpu-deps/*.deb; do dpkg -x "$f" "$deps"; done
torch_prefix="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
nccl_root="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr;$deps/usr/lib/x86_64-linux-gnu/cmake" \
  -DCMAKE_CXX_FLAGS="-isystem $deps/usr/include" ${nccl_root:+-DNCCL_ROOT="$nccl_root"} \
  -DTESSERA_CUDA=ON > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j 16 -- -k 0 > "$out/build.log" 2>&1; echo "build rc=$?"
grep -E "error:|FAILED" "$out/build.log" | head -40
(cd build-gpu && timeout 200 ctest -j 8 -R "PluginLoader|Options|Collectives|Precision" --output-on-failure) > "$out/ctest.log" 2>&1
tail -15 "$out/ctest.log"
# The corpus comes from the carried fortunes packages (the machine has no network).
export FORTUNES=/tmp/deps/usr/share/games/fortunes
timeout 300 bash bench/gpu/run.sh 40
