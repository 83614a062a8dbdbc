"""Disk-read measurement: how fast the hidden-state files come off the disk cold.

The files' pages are evicted from the page cache (POSIX_FADV_DONTNEED, no root needed), then read
as the training loader reads them, several readers at a time (preflight's read check, the run plan,
bench/). Where the page cache cannot be emptied (tmpfs) the measurement raises OSError instead of
reporting the cache's speed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .hidden_states import hs_files

# The read probe: at most this much (a few seconds on the H200 machine's disk), and none
# below the floor (hidden states that small live in the page cache).
READ_PROBE_BYTES = 2 * 10**9
READ_PROBE_MIN_TOTAL_BYTES = 10**9


def read_probe_sample(hs_dir: str | Path, probe_bytes: int = READ_PROBE_BYTES) -> tuple[list[Path], int]:
    """(a spread of the hidden-state files of ~probe_bytes in all, the bytes of all of them): what the read
    probes (this module's and the run plan's) read."""
    files = hs_files(hs_dir)
    total = sum(f.stat().st_size for f in files)
    count = max(1, min(len(files), round(probe_bytes * len(files) / max(total, 1))))
    return [files[round(i * len(files) / count)] for i in range(count)] if files else [], total


def measure_cold_read_bandwidth(paths: Sequence[str | Path], *, threads: int = 1, how: str = "evicted") -> dict:
    """Read every file once, `threads` at a time, and report GB/s.

    how="evicted" (the default): the files' pages are dropped from the page cache first
    (POSIX_FADV_DONTNEED, no root needed), then read through it, as the training loader reads them, the
    kernel's read-ahead included; raises OSError where they stay cached (tmpfs). how="direct": O_DIRECT,
    no read-ahead, so it understates what training gets (bench/README.md, "Disk cold reads"); raises
    OSError where the filesystem refuses it. how="buffered": as the cache is.
    """
    files = [Path(p) for p in paths]
    if how not in ("evicted", "direct", "buffered"):
        raise ValueError(f"how={how!r}: evicted, direct or buffered")
    if how == "evicted":
        evict_from_page_cache(files)
        resident = page_cache_resident_fraction(files)
        if resident > 0.05:
            raise OSError(errno.EOPNOTSUPP, f"{resident:.0%} of the files stayed in the page cache after eviction "
                          "(tmpfs?)")
    reader = _read_file_direct if how == "direct" else _read_file_buffered
    work: queue.SimpleQueue[Path] = queue.SimpleQueue()
    for path in files:
        work.put(path)
    totals = [0] * threads
    errors: list[OSError] = []

    def drain(slot: int) -> None:
        while True:
            try:
                path = work.get_nowait()
            except queue.Empty:
                return
            try:
                totals[slot] += reader(path)
            except OSError as exc:  # raised in the caller's thread, below
                errors.append(exc)
                return

    start = time.perf_counter()
    workers = [threading.Thread(target=drain, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    total = sum(totals)
    return {"files": len(files), "bytes": total, "seconds": seconds, "threads": threads,
            "how": how, "gb_per_s": total / seconds / 1e9}


def evict_from_page_cache(paths: Sequence[str | Path]) -> None:
    """Drop these files' pages from the page cache: written back first (dirty pages stay cached),
    then POSIX_FADV_DONTNEED. Pages another process has mapped stay."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache_resident_fraction(paths: Sequence[str | Path]) -> float:
    """The fraction of the files' pages in the page cache now: mincore(2) on a mapping that touches no
    page, so asking does not change the answer."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        pages = -(-size // page)
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vector = ctypes.create_string_buffer(pages)
                if libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                resident += pages - vector.raw[:pages].count(0)
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


def _read_file_direct(path: Path, block: int = 16 << 20) -> int:
    """Read a whole file with O_DIRECT (bypasses the page cache); returns bytes read."""
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total = 0
    try:
        while True:
            got = os.readv(fd, [buffer])
            total += got
            if got < block:
                return total
    finally:
        os.close(fd)
        buffer.close()


def _read_file_buffered(path: Path, block: int = 16 << 20) -> int:
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(block):
            total += len(chunk)
    return total
