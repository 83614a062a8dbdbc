"""disk_writes: the disk's durable write rate (the extraction bound at Kimi-K2.5's width) and early writeback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eagle3_pipeline.disk_writes import (
    LANDING_WRITEBACK_ENV,
    landing_writeback,
    measure_write_bandwidth,
    start_writeback,
    writeback_mode,
    writer_writeback,
)
from eagle3_pipeline.errors import ConfigError


def test_write_bandwidth_writes_every_byte_then_leaves_nothing(tmp_path):
    sizes = [3 << 20, 1 << 20, 5 << 20]
    for writeback in (True, False):
        result = measure_write_bandwidth(tmp_path, sizes, threads=2, writeback=writeback)
        assert result["files"] == 3 and result["bytes"] == sum(sizes) and result["writeback"] is writeback
        assert 0 < result["write_s"] <= result["durable_s"]
        # durable comes after written: the device rate is the lower one (the reported times are rounded)
        assert 0 < result["device_gb_per_s"] <= result["page_cache_gb_per_s"] * 1.01
        assert list(tmp_path.iterdir()) == []  # its files are deleted


def test_start_writeback_keeps_the_file_as_it_is(tmp_path):
    path = tmp_path / "row.bin"
    path.write_bytes(b"x" * 100_000)
    start_writeback(path)
    assert path.read_bytes() == b"x" * 100_000


def test_by_default_the_writer_starts_writeback_and_landing_only_where_it_did_not(monkeypatch):
    """`writer` (the default, chosen by the A/B in bench/README.md): our connector's writer starts each file's
    writeback, landing starts it only for a file another writer wrote; `on`: landing, every file; `off`: nobody."""
    for value, landing_ours, landing_other, writer in ((None, False, True, True), ("writer", False, True, True),
                                                       ("on", True, True, False), ("off", False, False, False)):
        writeback_mode.cache_clear()
        if value is None:
            monkeypatch.delenv(LANDING_WRITEBACK_ENV, raising=False)
        else:
            monkeypatch.setenv(LANDING_WRITEBACK_ENV, value)
        assert (landing_writeback(written_by_our_writer=True), landing_writeback(written_by_our_writer=False),
                writer_writeback()) == (landing_ours, landing_other, writer), value
    writeback_mode.cache_clear()
    monkeypatch.setenv(LANDING_WRITEBACK_ENV, "no")
    with pytest.raises(ConfigError, match=f"{LANDING_WRITEBACK_ENV}='no': expected one of on, off, writer"):
        landing_writeback()
    writeback_mode.cache_clear()  # later tests read their own environment


def test_the_command_prints_the_rate_for_the_plan_and_cleans_up(tmp_path):
    done = subprocess.run([sys.executable, "-m", "eagle3_pipeline.disk_writes", "--dir", str(tmp_path), "--gb", "0.02",
                           "--file-mb", "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "run_all.sh --plan --disk-write-gb-s" in done.stdout.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []
