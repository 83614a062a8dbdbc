"""After training: a one-screen summary from speculators' metrics."""

from __future__ import annotations

from pathlib import Path

from .files import atomic_write_json
from .training import read_metrics


def summarize(metrics_path: Path, best: Path) -> dict:
    records = read_metrics(metrics_path)
    return {"best_checkpoint": str(best), "records": len(records), "last": records[-1] if records else None}


def write_summary(out_dir: Path, summary: dict) -> None:
    atomic_write_json(Path(out_dir) / "summary.json", summary)
