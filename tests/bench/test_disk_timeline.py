"""bench/benchlib/disk_timeline.py: the disk's own writes during stage 02, split into busy and idle time."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from benchlib.disk_timeline import DiskTimeline, sectors_written, split_line, split_window, whole_disks

REPO = Path(__file__).resolve().parents[2]
GB = 10**9


def test_the_window_splits_into_idle_before_busy_idle_between_and_idle_after():
    """A 10 s window on a 1 GB/s disk: nothing for 2 s (the engine's first batch), 4 s at 1 GB/s, 1 s idle, 2 s at
    0.5 GB/s, 1 s of drain with nothing written. Samples every 0.5 s from before the window to after it."""
    rates = {t / 2: 0.0 for t in range(-2, 24)}  # rate in the half second starting at that time (s from the start)
    rates.update({t / 2: 1.0 * GB for t in range(4, 12)})  # 2-6 s
    rates.update({t / 2: 0.5 * GB for t in range(14, 18)})  # 7-9 s
    rates[-1.0] = rates[-0.5] = 1.0 * GB  # writes before the window (another run's) stay out of it
    start = 1_000.0
    series, total = [], 0.0
    for t in sorted(rates):
        series.append((start + t, int(total)))
        total += rates[t] * 0.5
    split = split_window(series, start, start + 10.0, disk_bytes_per_s=1.0 * GB, file_bytes=int(4.5 * GB))
    assert split["window_s"] == 10.0 and split["sampled_share"] == pytest.approx(1.0)
    assert split["device_bytes"] == pytest.approx(5.0 * GB)  # 4 GB + 1 GB inside the window
    assert split["busy_s"] == pytest.approx(6.0) and split["busy_share"] == pytest.approx(0.6)
    assert split["idle_before_first_write_s"] == pytest.approx(2.0)
    assert split["idle_between_writes_s"] == pytest.approx(1.0)
    assert split["idle_after_last_write_s"] == pytest.approx(1.0)
    assert split["busy_gb_per_s"] == pytest.approx(5.0 / 6.0) and split["busy_rate_share"] == pytest.approx(5.0 / 6.0)
    assert split["file_bytes_share"] == pytest.approx(0.9)  # 10% of what the disk wrote was not the files
    # the shares multiply back to the rate the files reached against the disk's: 4.5 GB in 10 s at 1 GB/s
    assert split["busy_share"] * split["busy_rate_share"] * split["file_bytes_share"] == pytest.approx(0.45)
    line = split_line(split)
    assert "disk busy 6.00 s (0.600) at 0.83 GB/s (0.833 of its own 1.00)" in line
    assert "idle 2.00 s before the first write, 1.00 s between, 1.00 s after the last" in line
    assert "files 0.900 of the bytes" in line


def test_a_window_the_disk_wrote_nothing_in_says_so():
    series = [(0.0, 0), (1.0, 0), (2.0, 0)]
    split = split_window(series, 0.0, 2.0, disk_bytes_per_s=GB, file_bytes=100)
    assert split["busy_s"] == 0 and split["idle_before_first_write_s"] == 2.0 and split["file_bytes_share"] is None
    assert split_line(split) == "window 2.00 s: the disk wrote nothing in it"


def test_diskstats_lines_give_sectors_written_of_whole_disks_only():
    text = ("   7       0 loop0 10 0 80 1 5 0 40 0 0 1 1 0 0 0 0\n"
            " 252       0 vda 100 0 800 10 50 3 4096 20 0 30 30 0 0 0 0\n"
            " 252       1 vda1 90 0 700 10 40 3 2048 20 0 30 30 0 0 0 0\n"
            " 259       0 nvme0n1 1 0 8 1 7 0 99 1 0 1 1\n")
    assert sectors_written({"vda", "nvme0n1"}, text) == {"vda": 4096, "nvme0n1": 99}


@pytest.mark.skipif(not whole_disks() or not Path("/proc/diskstats").is_file(),
                    reason="no block devices visible (not Linux, or a sandbox without /sys/block)")
def test_the_timeline_sees_a_flushed_file_on_the_disk_holding_the_checkout():
    """32 MiB written and fsynced beside the checkout (a real disk: tmp dirs can be tmpfs) while sampling: the busiest
    disk wrote at least those bytes, and its series is cumulative from 0."""
    size = 32 << 20
    (REPO / "work").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO / "work") as folder:
        with DiskTimeline(interval_s=0.02) as timeline:
            path = Path(folder) / "states.bin"
            with open(path, "wb") as handle:
                handle.write(os.urandom(size))
                handle.flush()
                os.fsync(handle.fileno())
    disk, series = timeline.busiest()
    assert timeline.available and disk in timeline.disks
    assert series[0][1] == 0 and all(b1 >= b0 for (_, b0), (_, b1) in zip(series, series[1:]))
    assert series[-1][1] >= size
