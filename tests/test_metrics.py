"""Stage 04's metrics.jsonl (`eagle3_pipeline.metrics`): written per record, read back past a cut line,
one writer under DDP, and the compat record stage 04 puts in its manifest."""

from __future__ import annotations

import json
import logging

from eagle3_pipeline.metrics import COMPAT_KEY, MetricsJsonlHandler, compat_applied, read_metrics, write_record


def _log(handler: logging.Handler, message) -> None:
    handler.emit(logging.LogRecord("speculators.metrics", logging.INFO, __file__, 0, message, None, None))


def test_records_are_appended_with_a_time_stamp_and_read_back_in_order(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    handler = MetricsJsonlHandler(path)  # creates the folder: speculators' save path may not exist yet
    _log(handler, {"train": {"loss": 2.0}, "global_step": 0})
    _log(handler, "text messages are not metric records")
    _log(handler, {"val": {"loss_epoch": 1.5}, "epoch": 0})
    records = read_metrics(path)
    assert [{k: v for k, v in r.items() if k != "time"} for r in records] == [
        {"train": {"loss": 2.0}, "global_step": 0}, {"val": {"loss_epoch": 1.5}, "epoch": 0}]
    assert records[0]["time"] <= records[1]["time"]


def test_a_line_cut_by_a_kill_is_skipped_and_a_missing_file_is_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == []
    write_record(path, {"global_step": 1})
    with open(path, "a") as handle:
        handle.write('{"global_step": 2, "tra')  # the process died mid-line
    assert [r["global_step"] for r in read_metrics(path)] == [1]


def test_only_global_rank_zero_writes_under_ddp(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("RANK", "1")
    _log(MetricsJsonlHandler(path, rank_zero_only=True), {"global_step": 0})
    assert not path.exists()
    _log(MetricsJsonlHandler(path), {"global_step": 0})  # the throughput bench: one file per rank
    monkeypatch.setenv("RANK", "0")
    _log(MetricsJsonlHandler(path, rank_zero_only=True), {"global_step": 0})
    assert len(read_metrics(path)) == 2


def test_tensor_values_are_written_as_numbers(tmp_path):
    import torch

    path = tmp_path / "metrics.jsonl"
    write_record(path, {"train": {"loss": torch.tensor(0.25)}, "global_step": 3})
    assert json.loads(path.read_text())["train"]["loss"] == 0.25


def test_the_last_runs_compat_record_is_the_one_reported(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert compat_applied(path) is None
    write_record(path, {COMPAT_KEY: ["cpu_trainer", "metrics_jsonl"]})
    write_record(path, {"global_step": 0})
    write_record(path, {COMPAT_KEY: ["metrics_jsonl"]})  # a resumed run on another machine
    assert compat_applied(path) == ["metrics_jsonl"]
