#!/usr/bin/env bash
# On the lent GPU machine: unpack the carried Debian packages (.gpu-deps/, from
# bench/gpu/fetch-deps.sh) and build against the wheel's CUDA LibTorch into build-gpu/.
# TORCH_PREFIX, TESSERA_CUDA and BUILD_DIR override the defaults (a CPU rehearsal here uses them).
set -uo pipefail
deps=/tmp/deps; out="${OUT:-/tmp/out}"; build="${BUILD_DIR:-build-gpu}"; mkdir -p "$out" "$deps"
ls .gpu-deps/*.deb > /dev/null 2>&1 || { echo "no .gpu-deps/*.deb: run bash bench/gpu/fetch-deps.sh here and carry .gpu-deps"; exit 1; }
for f in .gpu-deps/*.deb; do dpkg -x "$f" "$deps"; done
libs="$deps/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # protoc, and the carried runtime libraries
torch_prefix="${TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}"
# The protobuf headers in a folder of their own: CMake drops $deps/usr/include from include
# lists (the compiler's flags make it implicit), so it could not put them before LibTorch's.
mkdir -p "$deps/protobuf/include" && ln -sfn "$deps/usr/include/google" "$deps/protobuf/include/google"
# zlib1g-dev's libz.so points at /lib/x86_64-linux-gnu/libz.so.1.2.13, which the image lacks
# (CMake then took the static libz.a, which a plugin cannot link): link the image's own libz.
zlib="$(ls /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 2> /dev/null | head -1)"
nccl_root="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr;$libs/cmake" \
  -DCMAKE_CXX_FLAGS="-isystem $deps/usr/include" ${nccl_root:+-DNCCL_ROOT="$nccl_root"} ${zlib:+-DZLIB_LIBRARY="$zlib"} \
  -DProtobuf_PROTOC_EXECUTABLE="$deps/usr/bin/protoc" -DProtobuf_INCLUDE_DIR="$deps/protobuf/include" \
  -DProtobuf_LIBRARY="$libs/libprotobuf.so" -DCMAKE_BUILD_RPATH="$libs" \
  -DTESSERA_CUDA="${TESSERA_CUDA:-ON}" > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
# What the configure found, so a failure there reads at a glance.
grep -E "^(JEMALLOC_LIBRARY|TESSERA_XXHASH_LIBRARY|Protobuf_PROTOC_EXECUTABLE|Protobuf_LIBRARY|nlohmann_json_DIR|Torch_DIR|tomlplusplus_DIR)[:=]" \
  "$build/CMakeCache.txt" | sed 's/:[A-Z]*=/ = /'
cmake --build "$build" -j "$(nproc)" -- -k 0 ${BUILD_TARGETS:-} > "$out/build.log" 2>&1
rc=$?
echo "build rc=$rc"
grep -E "error:|FAILED" "$out/build.log" | head -40
exit $rc
