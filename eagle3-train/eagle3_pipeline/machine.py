"""Machine probes: free disk, visible GPUs, host memory, installed package versions.

Module functions, so tests can stand in for a machine they are not (the checks in preflight.py
look them up in their own namespace: a test patches `preflight.probe_gpus`; files.py asks
`machine.disk_free`). Heavy optional packages (torch, transformers) are imported inside the probe
that needs them, so preflight and the run plan load neither unless they ask.
"""

from __future__ import annotations

import os
import shutil
from importlib import metadata
from pathlib import Path


def existing_parent(path: Path) -> Path:
    """The nearest directory that exists at or above `path` (its filesystem is where files will go)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path


def disk_free(path: Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def probe_gpus() -> list[int]:
    """Total memory (bytes) of each visible CUDA GPU; [] on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


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
