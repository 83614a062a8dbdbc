"""Safe file writes and small file helpers shared by every stage.

Every output a stage writes goes through here: it is written to a hidden temp file
beside its final name (`.NAME.tmp-PID`) and renamed into place with `os.replace`, so a
killed run leaves either the old file, the new file, or a temp file that no reader
trusts (readers only ever look at final names) and that the next run deletes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

TEMP_MARKER = ".tmp-"


def temp_path_for(final: Path) -> Path:
    """Hidden sibling of `final`; hidden so globs like `hs_*.safetensors` never see it."""
    final = Path(final)
    return final.with_name(f".{final.name}{TEMP_MARKER}{os.getpid()}")


def is_temp_path(path: Path) -> bool:
    return path.name.startswith(".") and TEMP_MARKER in path.name


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path to write; on success rename it to `final` (file or directory)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(final)
    remove_path(tmp)
    try:
        yield tmp
        _fsync_path(tmp)
        if final.is_dir() and not final.is_symlink():
            # os.replace cannot replace a non-empty directory: move the old one
            # aside first so the swap is still a pair of renames, never a copy.
            old = final.with_name(f".{final.name}.old{TEMP_MARKER}{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            remove_path(old)
        else:
            os.replace(tmp, final)
    finally:
        remove_path(tmp)


def _fsync_path(path: Path) -> None:
    if path.is_file():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def remove_path(path: Path) -> None:
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def atomic_write_bytes(final: Path, data: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: Path, text: str) -> None:
    atomic_write_bytes(final, text.encode("utf-8"))


def atomic_write_json(final: Path, obj: Any) -> None:
    atomic_write_text(final, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_save_safetensors(tensors: dict, final: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(final) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def atomic_torch_save(obj: Any, final: Path) -> None:
    import torch

    with atomic_path(final) as tmp:
        torch.save(obj, tmp)


def atomic_numpy_save(array: Any, final: Path) -> None:
    import numpy as np

    with atomic_path(final) as tmp:
        with open(tmp, "wb") as handle:
            np.save(handle, array)


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files a killed run left behind; returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if is_temp_path(p)]
    for path in stale:
        remove_path(path)
    return len(stale)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def dir_size_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def check_writable_dir(directory: Path, flag: str) -> None:
    """Fail before any work when the output directory cannot be written."""
    from .errors import StageError

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe{TEMP_MARKER}{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StageError(f"{directory}: output directory is not writable ({exc.strerror}); fix {flag}") from None
