"""The disk's own writes while stage 02 runs, so the gap between stage 02's rate and the disk's bound can be split.

At Kimi-K2.5's width stage 02 is bound by the disk (bench/README.md "Stage 02 at Kimi-K2.5's width") yet reaches
only part of the disk's measured rate. Two different causes leave the same ratio: the disk sitting idle part of the
time (nothing handed to it yet at the start, gaps while the engine computes, a drain at the end), or the disk busy
all the time at a lower rate than it reaches alone (other writes beside the states, seeks between many files). The
block layer's own counters tell them apart: `DiskTimeline` samples the sectors written of every whole disk
(/proc/diskstats) in a thread, and `busiest` picks the disk that wrote the most; `split_window` takes that disk's
series over stage 02's window (its manifest's `extract_started_at`, `extract_s` and `sync_s`) and returns the seconds
it was busy and idle (before its first write, between writes, after its last) and its rate while busy, as shares of
the window and of the disk's own rate:  stage 02's rate to the device ~= bound x busy_share x busy_rate_share x
file_bytes_share.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own sector size
DISKSTATS = Path("/proc/diskstats")
SYS_BLOCK = Path("/sys/block")
NOT_DISKS = ("loop", "ram", "zram")  # kernel-backed devices: their writes never reach a disk


def whole_disks(sys_block: Path = SYS_BLOCK) -> set[str]:
    """Names of the whole block devices that can hold a filesystem (partitions are not under /sys/block)."""
    if not sys_block.is_dir():
        return set()
    return {entry.name for entry in sys_block.iterdir() if not entry.name.startswith(NOT_DISKS)}


def sectors_written(disks: set[str], text: str | None = None) -> dict[str, int]:
    """Sectors written so far per disk in `disks` (field 10 of /proc/diskstats, counted since boot)."""
    text = DISKSTATS.read_text() if text is None else text
    written = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 10 and fields[2] in disks:
            written[fields[2]] = int(fields[9])
    return written


class DiskTimeline:
    """Samples every whole disk's bytes written, every `interval_s`, while the `with` block runs.

    `samples` is [(time.time(), {disk: bytes written since the first sample})]; `available` is False where the
    machine has no /proc/diskstats or no whole disk (nothing is sampled; the bench records why instead of figures)."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.disks = whole_disks() if DISKSTATS.is_file() else set()
        self.available = bool(self.disks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-timeline", daemon=True)
        self._base: dict[str, int] = {}

    def _sample(self) -> None:
        now, written = time.time(), sectors_written(self.disks)
        if not self._base:
            self._base = written
        self.samples.append((now, {disk: (count - self._base.get(disk, count)) * SECTOR_BYTES
                                   for disk, count in written.items()}))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                self._sample()  # the last point after the block ended
                return

    def __enter__(self) -> DiskTimeline:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.available:
            self._stop.set()
            self._thread.join()

    def busiest(self) -> tuple[str | None, list[tuple[float, int]]]:
        """The disk that wrote the most while sampled, and its series [(time, cumulative bytes)]."""
        if not self.samples:
            return None, []
        last = self.samples[-1][1]
        disk = max(last, key=last.get, default=None)
        return disk, [(when, written.get(disk, 0)) for when, written in self.samples]


def split_window(series: list[tuple[float, int]], start: float, end: float, disk_bytes_per_s: float,
                 file_bytes: int, busy_threshold: float = 0.1) -> dict:
    """Where a window's seconds went on the disk that took the writes.

    `series`: [(time, cumulative bytes written)] sampled at a fixed interval; the window [start, end] is stage 02's
    (extraction and its final flush); `disk_bytes_per_s`: the disk's own rate for the same files (the bench's (d));
    `file_bytes`: what stage 02 wrote. An interval is busy when the disk wrote at >= `busy_threshold` of its own rate
    in it; idle time is reported before the first busy interval, between busy ones and after the last."""
    intervals = []  # (t0, t1, bytes) clipped to the window, bytes pro rata
    for (t0, b0), (t1, b1) in zip(series, series[1:]):
        lo, hi = max(t0, start), min(t1, end)
        if hi <= lo or t1 <= t0:
            continue
        intervals.append((lo, hi, (b1 - b0) * (hi - lo) / (t1 - t0)))
    window_s = end - start
    covered = sum(hi - lo for lo, hi, _ in intervals)
    busy = [(lo, hi, written) for lo, hi, written in intervals if written / (hi - lo) >= busy_threshold * disk_bytes_per_s]
    busy_s = sum(hi - lo for lo, hi, _ in busy)
    device_bytes = sum(written for _, _, written in intervals)
    busy_bytes = sum(written for _, _, written in busy)
    first, last = (busy[0][0], busy[-1][1]) if busy else (end, end)
    before, after = first - start, end - last
    busy_rate = busy_bytes / busy_s if busy_s else 0.0
    return {
        "window_s": window_s, "sampled_share": covered / window_s if window_s else 0.0,
        "device_bytes": device_bytes, "file_bytes": file_bytes,
        "file_bytes_share": file_bytes / device_bytes if device_bytes else None,  # < 1: other writes beside the files
        "busy_s": busy_s, "idle_before_first_write_s": before, "idle_after_last_write_s": after,
        "idle_between_writes_s": max(window_s - busy_s - before - after, 0.0),
        "busy_share": busy_s / window_s if window_s else 0.0,
        "busy_gb_per_s": busy_rate / 1e9, "disk_gb_per_s": disk_bytes_per_s / 1e9,
        "busy_rate_share": busy_rate / disk_bytes_per_s if disk_bytes_per_s else None,
        "busy_threshold": busy_threshold,
    }


def split_line(split: dict) -> str:
    """One log line of `split_window`'s figures."""
    return (f"window {split['window_s']:.2f} s: disk busy {split['busy_s']:.2f} s ({split['busy_share']:.3f}) at "
            f"{split['busy_gb_per_s']:.2f} GB/s ({split['busy_rate_share']:.3f} of its own {split['disk_gb_per_s']:.2f}); "
            f"idle {split['idle_before_first_write_s']:.2f} s before the first write, "
            f"{split['idle_between_writes_s']:.2f} s between, {split['idle_after_last_write_s']:.2f} s after the last; "
            f"files {split['file_bytes_share']:.3f} of the bytes the disk wrote" if split['file_bytes_share'] is not None
            else f"window {split['window_s']:.2f} s: the disk wrote nothing in it")
