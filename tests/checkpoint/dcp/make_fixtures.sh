#!/usr/bin/env bash
# Rewrites tests/checkpoint/dcp/fixtures/ with PyTorch's own torch.distributed.checkpoint: Debian
# bookworm's python3-torch (1.13) has no working DCP and no fully_shard, so make_fixtures.py runs
# in a Debian trixie chroot (python3-torch 2.6). Needs root, debootstrap and Debian's mirror;
# the chroot stays in $TESSERA_DCP_CHROOT (default /var/tmp/tessera-dcp-trixie) for the next run.
#   sudo bash tests/checkpoint/dcp/make_fixtures.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
root="${TESSERA_DCP_CHROOT:-/var/tmp/tessera-dcp-trixie}"
if [ ! -x "$root/usr/bin/python3" ] || ! chroot "$root" python3 -c "import torch" 2>/dev/null; then
  command -v debootstrap > /dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
  debootstrap --variant=minbase --include=python3-torch,python3-numpy trixie "$root" http://deb.debian.org/debian
fi
rm -rf "$root/work" && mkdir -p "$root/work/tests/checkpoint/dcp" "$root/work/tests/models"
cp "$here/make_fixtures.py" "$root/work/tests/checkpoint/dcp/"
cp "$repo/tests/models/llama_reference.py" "$root/work/tests/models/"
unshare -m bash -c '
  set -e
  root=$1
  mount --bind /proc "$root/proc"; mount --bind /sys "$root/sys"; mount --rbind /dev "$root/dev"
  mount -t tmpfs -o size=1g tmpfs "$root/dev/shm"; chmod 1777 "$root/tmp"
  chroot "$root" env -i HOME=/root PATH=/usr/bin:/bin LANG=C.UTF-8 OMP_NUM_THREADS=1 \
    python3 /work/tests/checkpoint/dcp/make_fixtures.py /work/out
' _ "$root"
rm -rf "$here/fixtures" && cp -r "$root/work/out" "$here/fixtures"
echo "make_fixtures: wrote $here/fixtures (PyTorch $(chroot "$root" python3 -c 'import torch; print(torch.__version__)'))"
