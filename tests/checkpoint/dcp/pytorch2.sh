#!/usr/bin/env bash
# Runs one of this folder's Python scripts under PyTorch 2.x: Debian bookworm's python3-torch
# (1.13) has no working torch.distributed.checkpoint, so the script runs in a Debian trixie chroot
# (python3-torch 2.6), with this checkout's tests/ beside it and IO_DIR bound at /io.
#   sudo bash tests/checkpoint/dcp/pytorch2.sh IO_DIR SCRIPT.py [ARGS...]   (paths in ARGS: under /io)
#   sudo bash tests/checkpoint/dcp/pytorch2.sh tests/checkpoint/dcp/fixtures make_fixtures.py /io
#     rewrites the fixtures
#   sudo bash tests/checkpoint/dcp/pytorch2.sh DIR check_export.py /io/EXPORTED /io/WEIGHTS.safetensors
#     loads a folder `tessera checkpoint export --format dcp` wrote with torch.distributed.checkpoint
# Needs root, debootstrap and Debian's mirror; the chroot stays in $TESSERA_DCP_CHROOT (default
# /var/tmp/tessera-dcp-trixie) for the next run.
set -euo pipefail
io="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
repo="$(cd "$(dirname "$0")/../../.." && pwd)"
root="${TESSERA_DCP_CHROOT:-/var/tmp/tessera-dcp-trixie}"
if ! chroot "$root" python3 -c "import torch.distributed.checkpoint" 2>/dev/null; then
  command -v debootstrap > /dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
  debootstrap --variant=minbase --include=python3-torch,python3-numpy trixie "$root" http://deb.debian.org/debian
fi
rm -rf "$root/work" && mkdir -p "$root/work" "$root/io" && cp -r "$repo/tests" "$root/work/tests"
unshare -m bash -c '
  set -e
  root=$1 io=$2; shift 2
  mount --bind /proc "$root/proc"; mount --bind /sys "$root/sys"; mount --rbind /dev "$root/dev"
  mount -t tmpfs -o size=1g tmpfs "$root/dev/shm"; chmod 1777 "$root/tmp"; mount --bind "$io" "$root/io"
  script=$1; shift
  chroot "$root" env -i HOME=/root PATH=/usr/bin:/bin LANG=C.UTF-8 OMP_NUM_THREADS=1 \
    python3 "/work/tests/checkpoint/dcp/$script" "$@"
' _ "$root" "$io" "$@"
