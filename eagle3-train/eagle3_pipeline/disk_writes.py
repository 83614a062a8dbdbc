"""Writing many large files at the disk's pace: early writeback, and the disk's own write rate to compare with.

At Kimi-K2.5's width stage 02 writes 57,344 B per token (28,680 in fp8): at the user's scale it is bound by the disk,
not by the forward pass (bench/README.md "Stage 02 at Kimi-K2.5's width"). Two things live here:
- `start_writeback(path)`: ask the kernel to start writing a finished file's dirty pages now (Linux
  sync_file_range(SYNC_FILE_RANGE_WRITE): asynchronous, returns at once unless the disk's queue is full). Without it
  the kernel waits for its background threshold (10% of RAM by default: tens of GB on a GPU box) and a run's tail
  is one long flush; with it the disk is busy from the first file and the final flush (`sync_filesystem`)
  has little left. Elsewhere (not Linux) it does nothing.
- `measure_write_bandwidth(directory, sizes, threads, writeback)`: the disk's rate for files of those sizes, written
  the way stage 02's connector writes them (buffered, `threads` at a time), timed to the last write (the page cache)
  and to the flush that makes them durable (the device): the bound stage 02 is held to.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from pathlib import Path
from typing import Sequence

_SYNC_FILE_RANGE_WRITE = 2
_CHUNK = 16 << 20  # bytes per write() call


def _sync_file_range():
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE = _sync_file_range()


def start_writeback(path: Path) -> None:
    """Start writing `path`'s dirty pages to the device now, without waiting for them (no-op where unsupported)."""
    if _SYNC_FILE_RANGE is None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure only means the kernel's own pace
    finally:
        os.close(fd)


def sync_filesystem(directory: Path) -> None:
    """Flush every write to the filesystem holding `directory` (Linux syncfs(2), else sync(2)): one call makes
    all the files stage 02 renamed into place durable, where an fsync per file would cost one flush per row."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        syncfs = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
        if syncfs is None or syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def dirty_limits() -> dict:
    """What the page cache may hold before writers wait (the kernel's dirty thresholds), for the record."""
    limits: dict = {}
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        try:
            limits[name] = int(Path(f"/proc/sys/vm/{name}").read_text())
        except (OSError, ValueError):
            pass
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        limits["mem_total_bytes"] = int(meminfo["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    return limits


def measure_write_bandwidth(directory: Path, sizes: Sequence[int], *, threads: int = 8,
                            writeback: bool = True) -> dict:
    """Write one file per size under `directory` (`threads` at a time, buffered, from one reused buffer of random
    bytes), then flush the filesystem; delete them. Rates in GB/s (1e9): to the last write returning
    (`page_cache_gb_per_s`) and to the flush's end (`device_gb_per_s`). `writeback`: each file's writeback is
    started as it is closed (`start_writeback`), as stage 02 lands its files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    sync_filesystem(directory)  # earlier writes are not this measurement's
    block = os.urandom(min(max(sizes, default=0), _CHUNK))
    work: queue.SimpleQueue = queue.SimpleQueue()
    for number, size in enumerate(sizes):
        work.put((directory / f"write-bench-{number}.bin", size))
    errors: list[OSError] = []
    written: list[Path] = []

    def drain() -> None:
        while True:
            try:
                path, size = work.get_nowait()
            except queue.Empty:
                return
            try:
                with open(path, "wb") as handle:
                    left = size
                    while left > 0:
                        left -= handle.write(memoryview(block)[:min(left, len(block))])
                written.append(path)
                if writeback:
                    start_writeback(path)
            except OSError as exc:
                errors.append(exc)
                return

    started = time.monotonic()
    workers = [threading.Thread(target=drain) for _ in range(max(1, threads))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wrote_s = time.monotonic() - started
    sync_filesystem(directory)
    durable_s = time.monotonic() - started
    for path in written:
        path.unlink(missing_ok=True)
    if errors:
        raise errors[0]
    total = sum(sizes)
    return {"files": len(sizes), "bytes": total, "threads": threads, "writeback": writeback,
            "write_s": round(wrote_s, 3), "durable_s": round(durable_s, 3),
            "page_cache_gb_per_s": round(total / wrote_s / 1e9, 3) if wrote_s > 0 else None,
            "device_gb_per_s": round(total / durable_s / 1e9, 3) if durable_s > 0 else None}


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3_pipeline.disk_writes --dir WORK/data`: the data disk's durable write rate for the plan."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description="The disk's durable write rate for hidden-state files (GB/s), "
                                                 "for run_all.sh --plan --disk-write-gb-s. Writes --gb of files in "
                                                 "a temporary folder under --dir and deletes them.")
    parser.add_argument("--dir", required=True, help="a folder on the disk stage 02 will write to (WORK/data)")
    parser.add_argument("--gb", type=float, default=8.0, help="bytes to write; more than the page cache's dirty "
                        "limits for a sustained figure (default 8)")
    parser.add_argument("--file-mb", type=float, default=64.0, help="size of each file (a 1,100-token Kimi-K2.5 "
                        "row in bf16 is ~64 MB)")
    parser.add_argument("--threads", type=int, default=8, help="writers at once (the connector's default)")
    args = parser.parse_args(argv)
    count = max(1, int(args.gb * 1e3 / args.file_mb))
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=".disk-writes-") as tmp:
        result = {how: measure_write_bandwidth(Path(tmp), [int(args.file_mb * 1e6)] * count, threads=args.threads,
                                               writeback=how == "writeback")
                  for how in ("writeback", "kernel_pace")}
    best = max(way["device_gb_per_s"] for way in result.values())
    print(json.dumps({**result, "page_cache": dirty_limits()}, indent=2))
    print(f"durable write rate: {best:.2f} GB/s (run_all.sh --plan --disk-write-gb-s {best:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
