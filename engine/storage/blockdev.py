"""Which device lies behind a path, so that two paths on one disk are not counted twice.

Block-backed file systems resolve through ``/sys/dev/block/MAJ:MIN`` to the whole disk (a
partition shares its disk's bandwidth). File systems without a block device (tmpfs, NFS,
Lustre) are named by their type and source from ``/proc/self/mountinfo``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    """Whole-disk block device name as in /proc/diskstats (``vda``, ``nvme0n1``, ``loop3``), or
    ``<fstype>:<source>`` for file systems without one."""
    device_id: str
    """``major:minor`` of the path's ``st_dev``."""
    is_block: bool
    """True when ``name`` appears in /proc/diskstats (psutil per-disk counters)."""


def device_of(path: str) -> DeviceInfo:
    info = os.stat(path)
    major, minor = os.major(info.st_dev), os.minor(info.st_dev)
    dev_id = f"{major}:{minor}"
    sys_link = f"/sys/dev/block/{dev_id}"
    if os.path.exists(sys_link):
        real = os.path.realpath(sys_link)
        if os.path.exists(os.path.join(real, "partition")):
            real = os.path.dirname(real)
        return DeviceInfo(os.path.basename(real), dev_id, True)
    fstype, source = _mount_of(dev_id)
    return DeviceInfo(f"{fstype}:{source}", dev_id, False)


def _mount_of(dev_id: str) -> tuple[str, str]:
    """File system type and source of the mount with device ``dev_id`` (mountinfo field 3)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[2] == dev_id and " - " in line:
                    fstype, source = line.split(" - ", 1)[1].split()[:2]
                    return fstype, source
    except OSError:
        pass
    return "unknown", dev_id
