"""Writing many large files at the disk's pace: early writeback, and the disk's own write rate to compare with.

At Kimi-K2.5's width stage 02 writes 57,344 B per token (28,680 in fp8): at the user's scale it is bound by the disk,
not by the forward pass (bench/README.md "Stage 02 at Kimi-K2.5's width"). Two things live here:
- `start_writeback(path)`: ask the kernel to start writing a finished file's dirty pages now (Linux
  sync_file_range(SYNC_FILE_RANGE_WRITE): asynchronous, returns at once unless the disk's queue is full). Without it
  the kernel waits for its background threshold (10% of RAM by default: tens of GB on a GPU box) and a run's tail
  is one long flush; with it the disk is busy from the first file and the final flush (`sync_filesystem`)
  has little left. Elsewhere (not Linux) it does nothing. By default our connector's writer threads start it as
  each file is written, stage 02's landing for files no writer of ours wrote (EAGLE3_LANDING_WRITEBACK, `writeback_mode`:
  `writer`; the bench's A/B, `extraction_vs_prefill.py --writeback on off writer`, chose it: bench/README.md).
- `write_safetensors(tensors, path, metadata)`: `safetensors.torch.save_file`'s file, byte for byte, written by one
  `os.writev` of the header and each tensor's own memory (the connector's writer with EAGLE3_CONNECTOR_WRITER=raw).
- `measure_write_bandwidth(directory, sizes, threads, writeback)`: the disk's rate for files of those sizes, written
  the way stage 02's connector writes them (buffered, `threads` at a time), timed to the last write (the page cache)
  and to the flush that makes them durable (the device): the bound stage 02 is held to.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Sequence

from .errors import ConfigError

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

LANDING_WRITEBACK_ENV = "EAGLE3_LANDING_WRITEBACK"


# Who starts a stage 02 file's writeback (EAGLE3_LANDING_WRITEBACK): `writer` (the default) our connector's writer
# thread right after writing it (earlier by the wait for the landing, and off the landing loop: sync_file_range blocks
# while the disk's queue is full), stage 02's landing for a file our writer did not write (vLLM's stock connector);
# `on` stage 02 when it lands every file; `off` nobody (the kernel's pace). Chosen by the same-run A/B at Kimi-K2.5's
# width (bench/README.md "Stage 02 at Kimi-K2.5's width", bench/extraction_vs_prefill.py `--writeback on off writer`).
WRITEBACK_MODES = ("on", "off", "writer")
DEFAULT_WRITEBACK_MODE = "writer"


@functools.cache
def writeback_mode() -> str:
    """EAGLE3_LANDING_WRITEBACK (default `writer`), checked; read once per process."""
    value = os.environ.get(LANDING_WRITEBACK_ENV, DEFAULT_WRITEBACK_MODE)
    if value not in WRITEBACK_MODES:
        raise ConfigError(f"{LANDING_WRITEBACK_ENV}={value!r}: expected one of {', '.join(WRITEBACK_MODES)}")
    return value


def landing_writeback(written_by_our_writer: bool = False) -> bool:
    """Whether stage 02 starts a landed file's writeback (`start_writeback`) as it lands it: always with `on`; with
    `writer` only where our connector's writer did not (`written_by_our_writer`: it already has); never with `off`."""
    mode = writeback_mode()
    return mode == "on" or (mode == "writer" and not written_by_our_writer)


def writer_writeback() -> bool:
    """Whether our connector's writer threads start each file's writeback right after writing it."""
    return writeback_mode() == "writer"


def start_writeback(path: Path) -> None:
    """Start writing `path`'s dirty pages to the device now, without waiting for them (no-op where unsupported)."""
    if _SYNC_FILE_RANGE is None:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure only means the kernel's own pace
    finally:
        os.close(fd)


# safetensors' dtype names in the order of its `Dtype` enum (safetensors/src/tensor.rs: increasing alignment): a
# file's tensors are laid out by that order, descending, then by name. Keys: str(torch dtype), so no torch import.
_SAFETENSORS_DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
                            "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
                            "F64", "I64", "U64")
_SAFETENSORS_DTYPES = {"torch.bool": "BOOL", "torch.uint8": "U8", "torch.int8": "I8", "torch.float8_e5m2": "F8_E5M2",
                       "torch.float8_e4m3fn": "F8_E4M3", "torch.int16": "I16", "torch.float16": "F16",
                       "torch.bfloat16": "BF16", "torch.int32": "I32", "torch.float32": "F32",
                       "torch.float64": "F64", "torch.int64": "I64"}

_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 16  # buffers per call


def safetensors_header(tensors: dict, metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The bytes `safetensors.torch.save_file` writes before the data (8-byte little-endian length, then the compact
    JSON header padded with spaces to a multiple of 8) and the order its tensors' data follows. One metadata key
    gives the same bytes; with several, safetensors writes them in its hash map's order (this: insertion order)."""
    names = {name: _SAFETENSORS_DTYPES.get(str(tensor.dtype)) for name, tensor in tensors.items()}
    if unknown := [name for name, dtype in names.items() if dtype is None]:
        raise ValueError(f"write_safetensors: no safetensors dtype for {unknown}")
    order = sorted(tensors, key=lambda name: (-_SAFETENSORS_DTYPE_ORDER.index(names[name]), name))
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in order:
        size = tensors[name].numel() * tensors[name].element_size()
        header[name] = {"dtype": names[name], "shape": list(tensors[name].shape), "data_offsets": [offset, offset + size]}
        offset += size
    # serde_json's compact form, which escapes what Python's json does and leaves other characters as UTF-8
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors(tensors: dict, filename, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file(tensors, filename, metadata)`'s file, byte for byte, written from each tensor's
    own memory: the header and every tensor's bytes in one `os.writev` (repeated only for what a call leaves
    unwritten), the GIL released meanwhile. Tensors: on the CPU (pinned or not), contiguous."""
    import torch  # here: this module's command (the disk's rate) needs no torch

    header, order = safetensors_header(tensors, metadata)
    buffers = [memoryview(header)]
    for name in order:
        tensor = tensors[name]
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{filename}: tensor {name!r} must be contiguous and on the CPU")
        if tensor.numel():
            # bf16 and fp8 have no numpy dtype: the same memory as bytes, no copy
            buffers.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B"))
    fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # as open(..., "wb") and safetensors
    try:
        while buffers:
            written = os.writev(fd, buffers[:_IOV_MAX])
            while buffers and written >= len(buffers[0]):
                written -= len(buffers.pop(0))
            if written:
                buffers[0] = buffers[0][written:]
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
