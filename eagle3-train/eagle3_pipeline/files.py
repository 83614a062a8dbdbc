"""Safe file writes and small file helpers shared by every stage.

Every output a stage writes goes through here: it is written to a hidden temp file
beside its final name (`.NAME.tmp-PID@HOST`) and renamed into place with `os.replace`, so a
killed run leaves either the old file, the new file, or a temp file that no reader
trusts (readers only ever look at final names) and that the next run deletes, only
while it holds the directory's lock (`hold_lock`: no writer of that temp is alive then).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import struct
from pathlib import Path
from typing import Any, Iterator

from . import machine
from .errors import PathError, StageError

# Local imports: safetensors.torch, numpy: imported by the writers that need them (this module stays
# torch-free: run_all's python may have no torch).

TEMP_MARKER = ".tmp-"


def writer_host() -> str:
    """This host's name in file names: its first label where that is at most 32 of [A-Za-z0-9-]; else its first 23
    such characters and 8 hex digits of the whole name's sha256, so hosts whose names share a long prefix (pods
    `...-extract-worker-0`, `-1`) never share a tag (one would remove the other's live temps and engine folders)."""
    name = socket.gethostname()
    label = name.split(".")[0]
    if re.fullmatch(r"[A-Za-z0-9-]{1,32}", label):
        return label
    return re.sub(r"[^A-Za-z0-9-]", "-", label)[:23] + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def writer_tag() -> str:
    """This process among every node writing a shared folder: `PID@HOST`. Nodes write one folder on a shared
    filesystem, and containers give their processes the same pids: a temp named by the pid alone was one file for
    two writers (stage 02's ranks on two nodes both write its manifest)."""
    return f"{os.getpid()}@{writer_host()}"


def parse_writer_tag(tag: str) -> tuple[int, str] | None:
    """`PID@HOST` -> (pid, host); None for anything else."""
    pid, at, host = tag.partition("@")
    return (int(pid), host) if pid.isdigit() and at and re.fullmatch(r"[A-Za-z0-9-]+", host) else None


def temp_path_for(final: Path) -> Path:
    """Hidden sibling of `final`, this writer's own; hidden so globs like `hs_*.safetensors` never see it."""
    final = Path(final)
    return final.with_name(f".{final.name}{TEMP_MARKER}{writer_tag()}")


def is_temp_path(path: Path) -> bool:
    return path.name.startswith(".") and TEMP_MARKER in path.name


class DiskFull(StageError):
    """A write ran out of space; the message names the file, what was being written (`what`, e.g. "the loader
    recorded a bad sample ...") and the free bytes (stages add what the rest needs)."""

    def __init__(self, path: Path, where: Path, what: str = ""):
        self.path, self.free = Path(path), _free_bytes(where)
        super().__init__(f"{path}: disk full{f' while {what}' if what else ''} ({self.free:,} B free at {where})")


def disk_full_line(text: str) -> str | None:
    """The one line of a DiskFull raised in another process, from the text that carries it there: a DataLoader
    worker's traceback, which torch re-raises in the trainer as text (the exception object itself is lost)."""
    marker = f"{DiskFull.__module__}.{DiskFull.__qualname__}: "
    if marker not in text:
        return None
    return text.rsplit(marker, 1)[1].splitlines()[0].strip()


def append_line(path: str | Path, line: str, what: str) -> None:
    """Append one line (a JSONL record) to `path`. A full disk is DiskFull naming the file and `what` was being
    written, with the file cut back to its size before, so no half line is left for the next record to be glued
    to (earlier lines are kept). Opened per line: several processes append (O_APPEND keeps short lines whole)."""
    path = Path(path)
    size = path.stat().st_size if path.is_file() else 0
    try:
        with open(path, "a") as handle:
            handle.write(line + "\n")
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise DiskFull(path, path.parent, what) from None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT however the library reports it (OSError; safetensors' `StorageFull`; torch.save's
    `unexpected pos` / `file write failed` from its zip writer)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return any(m in text for m in ("No space left on device", "StorageFull", "Disk quota exceeded",
                                   "unexpected pos", "file write failed"))


def _free_bytes(where: Path) -> int:
    try:
        return machine.disk_free(where)  # the one free-space probe (tests stand in for it there)
    except OSError:
        return 0


@contextlib.contextmanager
def path_operation(operation: str, path: Path | None = None) -> Iterator[None]:
    """An OSError inside is `PathError` (one line: the path, `operation`, the system's reason), e.g.
    `with path_operation("creating the directory"): d.mkdir()`. `path`: the one to name (default: the error's)."""
    try:
        yield
    except OSError as exc:
        raise PathError.of(exc, operation, path) from None


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temp path to write; on success rename it to `final` (file or directory).
    A full disk while writing is `DiskFull` (one line), never a library traceback; so is any other OSError
    on the temp or `final` (`PathError`: a read-only or immutable path, a name too long): the old `final`
    is then kept as it was."""
    final = Path(final)
    with path_operation("creating the directory"):
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(final)
    remove_path(tmp)
    try:
        try:
            yield tmp
            with path_operation(f"writing it (as its temp file {tmp.name})", final):
                _fsync_path(tmp)
        except DiskFull:
            raise
        except Exception as exc:
            if is_disk_full(exc):
                remove_path(tmp)  # give the space back before reporting it
                raise DiskFull(final, final.parent) from None
            if isinstance(exc, OSError) and str(exc.filename or "").startswith(str(tmp)):  # the temp, not an input
                raise PathError.of(exc, f"writing it (as its temp file {tmp.name})", final) from None
            raise
        if final.is_dir() and not final.is_symlink():
            # os.replace cannot replace a non-empty directory: move the old one
            # aside first so the swap is still a pair of renames, never a copy.
            old = final.with_name(f".{final.name}.old{TEMP_MARKER}{writer_tag()}")
            with path_operation(f"moving the old one aside (renaming it to {old.name})", final):
                os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError as exc:
                os.replace(old, final)  # the old one back: never neither
                raise PathError.of(exc, f"renaming the new one ({tmp.name}) into place", final) from None
            remove_path(old)
        else:
            with path_operation(f"renaming the new one ({tmp.name}) into place", final):
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
        with path_operation("deleting it"):
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
        tmp.touch()  # a file that cannot be created is an OSError naming it (safetensors' own error is not one)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def atomic_numpy_save(array: Any, final: Path) -> None:
    import numpy as np

    with atomic_path(final) as tmp:
        with open(tmp, "wb") as handle:
            np.save(handle, array)


def remove_stale_temps(directory: Path, owned=None) -> int:
    """Delete temp files a killed run left behind; returns how many.

    Call it only while holding the directory's exclusive lock (`hold_lock`): the lock proves no
    writer of those temps is alive (a live writer, or a child it started, would hold it). With
    `owned` (a predicate on the temp's final name), only matching temps are removed: stage 02's
    ranks share a directory and each removes only the temps of its own rows.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    stale = [p for p in directory.iterdir() if is_temp_path(p) and (owned is None or owned(final_name_of(p)))]
    for path in stale:
        remove_path(path)
    return len(stale)


def remove_dead_writers_temps(directory: Path) -> int:
    """Delete the temps in `directory` whose writer (`PID@HOST`) was a process of this host that is gone; returns how
    many. Needs no exclusive lock, so ranks sharing a folder use it for the files any rank may write (the manifest):
    a tag names its host, and another host's pids mean nothing here."""
    directory = Path(directory)
    removed = 0
    for path in directory.iterdir() if directory.is_dir() else ():
        writer = parse_writer_tag(path.name.rpartition(TEMP_MARKER)[2]) if is_temp_path(path) else None
        if writer is None or writer[1] != writer_host() or writer[0] == os.getpid():
            continue
        try:
            os.kill(writer[0], 0)
            continue  # alive (or another process reusing its pid): it may still be writing
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        remove_path(path)
        removed += 1
    return removed


def final_name_of(temp: Path) -> str:
    """`.hs_5.safetensors.tmp-123` -> `hs_5.safetensors` (the file the temp was going to become)."""
    name = Path(temp).name
    return name[1:name.index(TEMP_MARKER)] if is_temp_path(Path(temp)) else name


# --- one writer per output directory ----------------------------------------------------------

LOCK_NAME = ".eagle3.lock"
_held_locks: dict[str, int] = {}


class LockedError(Exception):
    """Another live process holds the lock (StageError subclass in stage.py wraps the message)."""


def hold_lock(lock_file: Path, exclusive: bool = True) -> int:
    """flock `lock_file` for the rest of this stage (released by `release_locks` or by the OS on death).

    The lock file is empty and never deleted (deleting it would let two writers lock two different
    files). The fd is inheritable, so training processes started by stage 04 keep the lock while
    they live: a stage killed with -9 whose children still write is not "gone" yet.
    """
    lock_file = Path(lock_file)
    key = str(lock_file.resolve())
    if key in _held_locks:
        return _held_locks[key]
    with path_operation("creating the directory"):
        lock_file.parent.mkdir(parents=True, exist_ok=True)
    with path_operation("creating the lock file", lock_file):
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(str(lock_file)) from None
    except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: a filesystem (or mount) without flock
        os.close(fd)
        raise PathError(f"{lock_file}: locking it failed ({exc.strerror or exc}): its filesystem does not take flock "
                        f"locks, which keep two runs from writing one folder; mount it with them (Lustre: -o flock; "
                        f"NFS: not nolock) or choose a folder on a filesystem that has them, then rerun") from None
    os.set_inheritable(fd, True)
    _held_locks[key] = fd
    return fd


def lock_held_elsewhere(lock_file: Path) -> bool | None:
    """Whether a process holds `lock_file` now: a probe (shared, non-blocking, released at once); False when no
    process does, None when it cannot tell (no such file; a filesystem without locks)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # ENOLCK: nothing proves it free or held
        return None
    finally:
        os.close(fd)  # releases the probe's own lock at once
    return False


def held_lock_fds() -> tuple[int, ...]:
    return tuple(_held_locks.values())


def release_locks() -> None:
    """End of a stage run in this process (tests call several stages' main() in one process)."""
    while _held_locks:
        _, fd = _held_locks.popitem()
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def check_writable_dir(directory: Path, flag: str) -> None:
    """Fail before any work when the output directory cannot be written; writes nothing (--check)."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        reason = "Not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = "Read-only file system" if _read_only_fs(existing) else "Permission denied"
    else:
        return
    # PathError (exit 74) as the same cause found while writing (README: "a path a stage cannot write ... exit 74"):
    # one code for one cause, whether the preflight or the write finds it.
    raise PathError(f"{directory}: output directory is not writable ({reason}); fix {flag}")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# --- what a stage wrote, by size and a cheap fingerprint (stage 02's hidden states; run_all --status) ------

FINGERPRINTS_NAME = "fingerprints.json"
FINGERPRINT_BLOCKS = 8  # 4 KiB blocks spread over the file, plus its safetensors header: ~36 KiB read per file
FINGERPRINT_BLOCK = 4096


def file_fingerprint(path: Path) -> str:
    """sha256 of the size, the safetensors header and 8 blocks spread evenly over the file: cheap enough for
    every file on every rerun; a truncation, a swap, or a rewrite with another header or other bytes in those
    blocks shows. Not every byte: the training loader checks each sample's values as it reads them."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        head = handle.read(8)
        digest.update(head)
        if len(head) == 8:
            digest.update(handle.read(min(struct.unpack("<Q", head)[0], 1 << 20)))
        for k in range(FINGERPRINT_BLOCKS):
            handle.seek(size * k // FINGERPRINT_BLOCKS)
            digest.update(handle.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()[:32]


# How changed_fingerprints names files whose size and sampled bytes are as recorded but whose modification time is not,
# when that holds for every file recorded: the whole directory was copied without its mtimes (cp -r); the bytes cannot
# be told from the record. One file or some with a new mtime alone were rewritten or replaced since: changed.
COPIED_SINCE = "same size and sampled bytes, another modification time, as every file's: copied without mtimes?"


def write_fingerprints(directory: Path, names: list[str]) -> dict:
    """{name: [size, fingerprint, mtime_ns]} beside the files; returns the manifest's record of it. A file
    rewritten in place gets a new mtime even where the sampled blocks miss the bytes that changed; a copy
    that keeps mtimes (mv, cp -p, rsync -a) is unchanged; a whole directory copied without them is COPIED_SINCE."""
    directory = Path(directory)
    record = {name: [(directory / name).stat().st_size, file_fingerprint(directory / name),
                     (directory / name).stat().st_mtime_ns] for name in names}
    path = directory / FINGERPRINTS_NAME
    atomic_write_json(path, record)
    return {"file": FINGERPRINTS_NAME, "sha256": sha256_file(path), "files": len(record)}


def changed_fingerprints(directory: Path, names: list[str]) -> dict[str, str] | None:
    """Files that differ from their record (size first, then fingerprint), with how; None: no record
    (written by a version before fingerprints)."""
    directory = Path(directory)
    try:
        recorded = json.loads((directory / FINGERPRINTS_NAME).read_text())
    except (OSError, ValueError):
        return None
    changed: dict[str, str] = {}
    for name in names:
        path = directory / name
        size, fingerprint, mtime = (list(recorded.get(name) or ()) + [None, None, None])[:3]
        if not path.is_file():
            changed[name] = "missing"
        elif path.stat().st_size != size:
            changed[name] = f"size {path.stat().st_size:,} B, recorded {'none' if size is None else f'{size:,} B'}"
        elif file_fingerprint(path) != fingerprint:
            changed[name] = "same size, other bytes (fingerprint)"
        elif mtime is not None and path.stat().st_mtime_ns != mtime:
            changed[name] = "same size, rewritten since (modification time)"
    by_mtime = [name for name, how in changed.items() if how == "same size, rewritten since (modification time)"]
    if by_mtime and len(by_mtime) == len(names):
        changed.update(dict.fromkeys(by_mtime, COPIED_SINCE))
    return changed


def fingerprints_problem(directory: Path, recorded: dict | None) -> str | None:
    """Why the fingerprints file a manifest recorded (`write_fingerprints`' record: its sha256) cannot be trusted now
    (gone, cut short, edited), or None; None too for a manifest that records none (written before fingerprints)."""
    if not recorded:
        return None
    path = Path(directory) / recorded.get("file", FINGERPRINTS_NAME)
    if not path.is_file():
        return f"{path.name} (the record of the files' fingerprints) is missing"
    if sha256_file(path) != recorded.get("sha256"):
        return f"{path.name} (the record of the files' fingerprints) differs from what the manifest recorded of it"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read (truncated, garbled header), or None; reads only its header."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"unreadable safetensors (only {size} B)"
            header_len = int.from_bytes(head, "little")
            if header_len > size - 8:
                return f"unreadable safetensors (header of {header_len:,} B in a {size:,} B file: truncated?)"
            header = json.loads(handle.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable safetensors ({str(exc).splitlines()[0][:80] or type(exc).__name__})"
    if 8 + header_len + end != size:
        return f"unreadable safetensors (the header says {8 + header_len + end:,} B, the file has {size:,} B: truncated?)"
    return None


# --- a finished stage's own files, by the bytes it wrote (manifest `output_files`; stage.finished, --status) ----

# Why two digests: a finished stage checks its files on every rerun (the no-op that says "nothing to do", run_all's
# every stage, --status), and Kimi's are large: a 4 GB draft, GBs of optimizer state, a dataset of GBs. A full
# sha256 reads all of it each time (tens of seconds on a network filesystem, for a no-op); the sampled fingerprint
# (file_fingerprint: the size, the safetensors header, 8 blocks of 4 KiB) reads ~36 KiB and still shows a file cut
# short, deleted, swapped for another or rewritten with another header. So: every byte of a file up to
# FULL_DIGEST_MAX_BYTES (configs, reports, d2t/t2d, token counts, metrics: the ones edited by hand or half-written),
# the sampled fingerprint above it (weights, optimizer state, the dataset's arrow file), whose contents the stages that
# read them check again (05 loads and checks the draft's tensors, 04's loader each sample). The kind is recorded with
# the digest, so a record stays checkable if the threshold changes.
FULL_DIGEST_MAX_BYTES = 64 << 20


def output_digest(path: Path, kind: str | None = None) -> str:
    """`sha256:<hex>` (every byte) or `sampled:<fingerprint>`; `kind` forces one (a record's own kind)."""
    path = Path(path)
    kind = kind or ("sha256" if path.stat().st_size <= FULL_DIGEST_MAX_BYTES else "sampled")
    return f"{kind}:" + (sha256_file(path) if kind == "sha256" else file_fingerprint(path))


def output_record(directory: Path, names) -> dict[str, list]:
    """{name: [size, digest]} of the files `names` (relative to directory) that are there now: what a stage wrote."""
    directory = Path(directory)
    record = {}
    for name in names:
        path = directory / name
        if path.is_file() and not path.is_symlink():
            record[str(name)] = [path.stat().st_size, output_digest(path)]
    return record


def changed_outputs(directory: Path, record: dict | None) -> dict[str, str]:
    """The recorded files (manifest `output_files`) that are gone or differ now, with how ("missing", "cut short:
    1,234 B, 5,678 B written", "same size, other bytes"); {} when every one is as written, or nothing was recorded."""
    directory = Path(directory)
    changed: dict[str, str] = {}
    for name, (size, digest) in (record or {}).items():
        path = directory / name
        if not path.is_file():
            changed[name] = "missing"
            continue
        now = path.stat().st_size
        if now != size:
            changed[name] = f"{'cut short' if now < size else 'grown'}: {now:,} B, {size:,} B written"
        elif output_digest(path, str(digest).split(":", 1)[0]) != digest:
            changed[name] = "same size, other bytes"
    return changed
