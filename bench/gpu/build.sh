#!/usr/bin/env bash
# On the lent GPU machine: unpack the carried Debian packages (.gpu-deps/, see
# shared/gpu/README.md) and build against the wheel's CUDA LibTorch into build-gpu/.
set -uo pipefail
deps=/tmp/deps; out="${OUT:-/tmp/out}"; mkdir -p "$out" "$deps"
for f in .gpu-deps/*.deb; do dpkg -x "$f" "$deps"; done
torch_prefix="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
nccl_root="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr;$deps/usr/lib/x86_64-linux-gnu/cmake" \
  -DCMAKE_CXX_FLAGS="-isystem $deps/usr/include" ${nccl_root:+-DNCCL_ROOT="$nccl_root"} \
  -DTESSERA_CUDA=ON > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j 16 -- -k 0 > "$out/build.log" 2>&1
rc=$?
echo "build rc=$rc"
grep -E "error:|FAILED" "$out/build.log" | head -40
exit $rc
