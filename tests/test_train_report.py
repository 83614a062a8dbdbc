"""After training: the curves (plots.py) and the one-screen summary (train_report.py), from a
metrics.jsonl shaped like speculators' (config record, train records per step, val per epoch),
including what a kill and a resume leave in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.plots import read_curves, write_plots
from eagle3_pipeline.train_report import format_summary, summarize, write_summary


def _train(step: int, epoch: int, acc: float) -> dict:
    metrics = {}
    for k in range(3):
        metrics |= {f"loss_{k}": 2.0 - step / 10 + k / 10, f"full_acc_{k}": acc * 0.8 ** k, f"cond_acc_{k}": 0.8}
    metrics["loss"] = sum(metrics[f"loss_{k}"] for k in range(3))
    return {"train": metrics, "profile": {"tokens_per_s": 1000.0 + step, "step_ms": 50.0}, "epoch": epoch,
            "lr": {"Muon": 1e-3}, "global_step": step}


def _val(epoch: int, acc: float, loss: float) -> dict:
    metrics = {}
    for k in range(3):
        metrics |= {f"loss_{k}_epoch": loss / 3, f"full_acc_{k}_epoch": acc * 0.8 ** k, f"cond_acc_{k}_epoch": 0.8}
    return {"val": {**metrics, "loss_epoch": loss}, "epoch": epoch}


@pytest.fixture
def run(tmp_path) -> Path:
    """2 epochs of 4 steps, killed in epoch 1 after step 5 and resumed from checkpoint 0."""
    lines = [json.dumps({"speculator_type": "eagle3", "trainer": {"epochs": 2}})]
    lines += [json.dumps(_train(s, 0, 0.1)) for s in range(4)] + [json.dumps(_val(0, 0.2, 3.0))]
    lines += [json.dumps(_train(s, 1, 0.9)) for s in (4, 5)] + ['{"train": {"loss_0": 1.']  # the kill
    lines += [json.dumps({"speculator_type": "eagle3"})]  # the resumed run logs its config again
    lines += [json.dumps(_train(s, 1, 0.5)) for s in range(4, 8)] + [json.dumps(_val(1, 0.5, 2.0))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "val_metrics.json").write_text(json.dumps(_val(1, 0.5, 2.0)["val"]))
    return tmp_path


def test_curves_keep_the_resumed_record_of_a_redone_step_and_skip_cut_lines(run):
    curves = read_curves(run / "metrics.jsonl")
    assert curves.steps == list(range(8))
    assert curves.train[5]["full_acc_0"] == 0.5  # the resumed run's value, not the killed one's 0.9
    assert sorted(curves.val) == [0, 1] and curves.val[1]["loss"] == 2.0  # "_epoch" dropped
    assert curves.ttt_steps() == 3
    assert (curves.val_step(0), curves.val_step(1)) == (3, 7)  # drawn at each epoch's last step


def test_plots_are_written_as_pngs(run):
    written = write_plots(run / "metrics.jsonl", run / "plots")
    assert [p.name for p in written] == ["loss.png", "accuracy.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert not list((run / "plots").glob("*.tmp"))


def test_no_metrics_no_plots(tmp_path):
    assert write_plots(tmp_path / "metrics.jsonl", tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_summary_reports_best_checkpoint_accuracies_and_expected_accepted_length(run):
    summary = summarize(run / "metrics.jsonl", run / "1", num_speculative_tokens=3)
    assert summary["best_epoch"] == 1 and summary["val_loss"] == 2.0
    assert summary["full_acc"] == pytest.approx([0.5, 0.4, 0.32])
    # tau(k) = 1 + sum of full_acc_0..k-1 (acceptance.expected_accepted_length)
    assert summary["expected_accepted_length"] == pytest.approx({"1": 1.5, "2": 1.9, "3": 2.22})
    assert summary["val_by_epoch"]["0"]["tau"] == pytest.approx(1 + 0.2 + 0.16 + 0.128)
    assert summary["train"]["logged_steps"] == 8 and summary["train"]["epochs"] == 2
    assert summary["train"]["median_tokens_per_s_per_rank"] == pytest.approx(1004.0)  # steps 1..7
    json.dumps(summary)  # it also goes into the manifest


def test_summary_text_fits_one_screen(run):
    write_plots(run / "metrics.jsonl", run / "plots")
    text = write_summary(run, summarize(run / "metrics.jsonl", run / "1", num_speculative_tokens=3))
    assert (run / "summary.txt").read_text().strip() == text
    assert json.loads((run / "summary.json").read_text())["best_epoch"] == 1
    lines = text.splitlines()
    assert len(lines) <= 24 and max(len(line) for line in lines if str(run) not in line) <= 100
    assert "tau(3)=2.22 <- served k" in text and "best checkpoint" in text and "plots" in text
    assert any(line.split()[:2] == ["1", "2.0000*"] for line in lines)  # the epoch table marks the best


def test_summary_without_validation_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_train(0, 0, 0.1)) + "\n")
    (tmp_path / "0").mkdir()
    text = format_summary(summarize(tmp_path / "metrics.jsonl", tmp_path / "0"))
    assert "no validation metrics" in text
