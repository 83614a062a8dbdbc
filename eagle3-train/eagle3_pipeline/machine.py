"""Machine probes: free disk, visible GPUs, host memory, installed package versions.

Module functions, so tests can stand in for a machine they are not (the checks in preflight.py
look them up in their own namespace: a test patches `preflight.probe_gpus`; files.py asks
`machine.disk_free`). Heavy optional packages (torch, transformers) are imported inside the probe
that needs them, so preflight and the run plan load neither unless they ask.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path


def existing_parent(path: Path) -> Path:
    """The nearest directory that exists at or above `path` (its filesystem is where files will go)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path


# Filesystems whose clients may list a file another machine wrote late (directory listings cached: NFS's acdirmax) or
# that several nodes share: where waiting for a late listing can help.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "beegfs", "gpfs", "ceph", "cephfs", "fuse.cephfs", "glusterfs",
    "fuse.glusterfs", "fuse.sshfs", "afs", "9p", "panfs", "wekafs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse",
})


def filesystem_type(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The type of the filesystem holding `path` (its nearest existing parent), from the mount table; None where
    that cannot be read."""
    target = existing_parent(Path(path)).resolve()
    best, fstype = -1, None
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]))  # \040: a space
        if (target == point or point in target.parents) and len(point.parts) > best:
            best, fstype = len(point.parts), right.split()[0]
    return fstype


def on_network_filesystem(path: Path) -> bool:
    """Whether `path` lies on a network filesystem (NETWORK_FILESYSTEMS); True where the mount table cannot tell."""
    fstype = filesystem_type(path)
    return fstype is None or fstype in NETWORK_FILESYSTEMS


def disk_free(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def probe_gpus() -> list[int]:
    """Total memory (bytes) of each visible CUDA GPU; [] on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def cuda_capabilities() -> list[tuple[int, int]]:
    """(major, minor) compute capability of each GPU the CUDA runtime would show this process, asked of the
    driver (nvidia-smi) instead of torch, for `--print-config` (which must answer without importing torch);
    [] without a driver. CUDA_VISIBLE_DEVICES narrows and orders the list as CUDA does: indices or GPU-UUID
    prefixes, up to the first entry that names no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if listed.returncode != 0:
        return []
    gpus = []
    for line in listed.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and parts[2].count(".") == 1 and parts[2].replace(".", "").isdigit():
            major, minor = parts[2].split(".")
            gpus.append((parts[0], parts[1], (int(major), int(minor))))
    if visible is None:
        return [capability for _, _, capability in gpus]
    shown = []
    for entry in visible.split(","):
        entry = entry.strip()
        match = [gpu for gpu in gpus if gpu[0] == entry or (entry.startswith("GPU-") and gpu[1].startswith(entry))]
        if not match:
            break
        shown.append(match[0][2])
    return shown


def host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def transformers_knows(model_type: str) -> bool:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING_NAMES
