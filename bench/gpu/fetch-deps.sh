#!/usr/bin/env bash
# Here, before a device run: download into .gpu-deps/ every Debian package the build needs that
# the GPU machine's image lacks (it has CUDA, CMake, ninja, g++ and the PyTorch wheel, whose
# LibTorch we build against, and no network). Then carry .gpu-deps and run
# `bash bench/gpu/build_and_bench.sh` there. Replaces ../shared/gpu/fetch-deps.sh, which predates
# the allocator, the checkpoint index and the TensorBoard logger (jemalloc, nlohmann-json, xxHash,
# protobuf). The runtime libraries come too: the image has none of them.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dest=.gpu-deps
exclude="$(git rev-parse --git-path info/exclude)"; mkdir -p "$(dirname "$exclude")"
grep -qxF "/$dest/" "$exclude" 2>/dev/null || echo "/$dest/" >> "$exclude"
rm -rf "$dest" && mkdir -p "$dest"
packages=(
  libboost1.74-dev libtomlplusplus-dev libtomlplusplus3 libgloo-dev          # build
  nlohmann-json3-dev libxxhash-dev libxxhash0 libjemalloc-dev libjemalloc2
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 protobuf-compiler libprotoc32 zlib1g-dev
  libsentencepiece-dev libsentencepiece0 libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3  # toolkit: tokenizers
  libicu-dev libicu72                                                        # toolkit: NFC
  googletest libgtest-dev libgmock-dev libbenchmark-dev libbenchmark1debian  # tests, benches
  fortunes fortunes-min                                                      # the shipped corpus
)
(cd "$dest" && apt-get download "${packages[@]}" > /dev/null)
echo "$dest: $(ls "$dest" | wc -l) packages, $(du -sh "$dest" | cut -f1)"
