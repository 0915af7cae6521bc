#!/usr/bin/env bash
# Emulated storage tiers with fixed bandwidths, so that benchmark ratios are reproducible on a
# machine with one (host-cached, noisy) disk. Each tier is ext4 on its own loop device; a blkio
# cgroup (v1) throttles that device's O_DIRECT read and write bandwidth for the processes it runs.
# Needs root. Buffered I/O is not throttled (offloadctl uses O_DIRECT).
#
#   bench/tiers.sh up nvme:4:400:400 pfs:4:200:200   # NAME:SIZE_GB:READ_MBps:WRITE_MBps -> $ROOT/NAME
#   bench/tiers.sh run CMD [ARGS...]                  # run CMD (and children) under the throttles
#   bench/tiers.sh status
#   bench/tiers.sh down                               # unmount, detach, remove the cgroup
set -euo pipefail
ROOT=${OFFLOADCTL_TIERS_ROOT:-/mnt/offloadctl-tiers}
IMG=${OFFLOADCTL_TIERS_IMG:-/var/tmp/offloadctl-tiers}
# Distinct ROOT, IMG and CGROUP let several emulations coexist on one machine.
CG=/sys/fs/cgroup/blkio/${OFFLOADCTL_TIERS_CGROUP:-offloadctl-tiers}

die() { echo "tiers: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (loop devices, mounts, cgroups); run the benchmark on the raw path instead"
[ -d /sys/fs/cgroup/blkio ] || die "no blkio cgroup (v1) on this machine; run the benchmark on the raw path instead"

up() {
  [ $# -gt 0 ] || die "usage: tiers.sh up NAME:SIZE_GB:READ_MBps:WRITE_MBps ..."
  mkdir -p "$ROOT" "$IMG" "$CG"
  for spec in "$@"; do
    IFS=: read -r name size rd wr <<<"$spec"
    [[ $name =~ ^[a-z0-9_-]+$ && $size =~ ^[0-9]+$ && $rd =~ ^[0-9]+$ && $wr =~ ^[0-9]+$ ]] || die "bad tier spec '$spec' (NAME:SIZE_GB:READ_MBps:WRITE_MBps)"
    mnt=$ROOT/$name
    if ! mountpoint -q "$mnt"; then
      truncate -s "${size}G" "$IMG/$name.img"
      dev=$(losetup -f --show "$IMG/$name.img")
      mkfs.ext4 -q -F "$dev"
      mkdir -p "$mnt"; mount "$dev" "$mnt"; chmod 1777 "$mnt"
    fi
    dev=$(findmnt -no SOURCE "$mnt")
    mm=$(lsblk -no MAJ:MIN "$dev" | tr -d ' ')
    echo "$mm $((rd * 1000000))" > "$CG/blkio.throttle.read_bps_device"
    echo "$mm $((wr * 1000000))" > "$CG/blkio.throttle.write_bps_device"
    echo "$name $mnt $dev read=${rd}MB/s write=${wr}MB/s"
  done
}
run() { [ $# -gt 0 ] || die "usage: tiers.sh run CMD [ARGS...]"; [ -d "$CG" ] || die "no tiers are up (tiers.sh up ...)"; echo $$ > "$CG/cgroup.procs"; exec "$@"; }
status() {
  local n=0
  for mnt in "$ROOT"/*; do
    if [ -d "$mnt" ] && mountpoint -q "$mnt"; then echo "$(basename "$mnt") $mnt $(findmnt -no SOURCE "$mnt")"; n=$((n + 1)); fi
  done
  [ $n -gt 0 ] || { echo "no tiers are up"; return 0; }
  if [ -d "$CG" ]; then echo "read limits:"; cat "$CG/blkio.throttle.read_bps_device"; echo "write limits:"; cat "$CG/blkio.throttle.write_bps_device"; fi
}
down() {
  if [ -d "$ROOT" ]; then
    for mnt in "$ROOT"/*; do
      [ -d "$mnt" ] || continue
      if mountpoint -q "$mnt"; then dev=$(findmnt -no SOURCE "$mnt"); umount "$mnt"; losetup -d "$dev" 2>/dev/null || true; fi
      rmdir "$mnt" 2>/dev/null || true
      rm -f "$IMG/$(basename "$mnt").img"
    done
  fi
  if [ -d "$CG" ]; then
    while read -r p; do echo "$p" > /sys/fs/cgroup/blkio/cgroup.procs 2>/dev/null || true; done < "$CG/cgroup.procs"
    rmdir "$CG" 2>/dev/null || true
  fi
  echo "tiers down"
}
cmd=${1:-status}; shift || true
case $cmd in up|run|status|down) "$cmd" "$@";; *) die "unknown command '$cmd' (up, run, status, down)";; esac
