"""Stage 04's `metrics.jsonl`: speculators' metric dicts as JSON lines, written and read back.

speculators' trainer logs dicts on the `speculators.metrics` logger: one run-config record at
the start, {"train": ..., "profile": {fetch_ms, fwd_ms, bwd_ms, opt_ms, ...}, "epoch": E,
"global_step": S} every `log_freq` steps (right after a device synchronize), {"val": ...,
"epoch": E} per epoch. `MetricsJsonlHandler` appends each as one JSON line, stamped with the
wall clock; `compat.metrics_jsonl` attaches it to that logger. Besides speculators' records the
file holds one {"compat_applied": [...]} record per training run (`write_record`): the runtime
fixes that process installed. The file is appended to, so a resumed run continues it;
`read_metrics` skips a line cut by a kill.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .files import append_line

# Local imports: torch, where a record gets GPU memory (train_report reads metrics without torch).

METRICS_FILE = "metrics.jsonl"
COMPAT_KEY = "compat_applied"


class MetricsJsonlHandler(logging.Handler):
    """Appends speculators' metric dicts (run config, per-step train, per-epoch val) as JSON lines.

    The "time" stamp is the wall clock (comparable across processes); with CUDA, per-step
    records also get the peak memory so far. With `rank_zero_only` the other DDP ranks write
    nothing (every rank logs the same step); the throughput bench writes one file per rank.
    """

    def __init__(self, path: str | Path, *, rank_zero_only: bool = False):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.silent = rank_zero_only and not is_rank_zero()

    def emit(self, record: logging.LogRecord) -> None:
        if self.silent or not isinstance(record.msg, Mapping):
            return
        entry = dict(record.msg)
        try:
            import torch

            if torch.cuda.is_available() and "global_step" in entry:
                entry["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                entry["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        except ImportError:
            pass
        write_record(self.path, entry)


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def write_record(path: str | Path, record: Mapping[str, Any]) -> None:
    """Append one record, stamped with "time". Opened per record: speculators' dictConfig closes
    every handler that exists when it runs, and a line per step is cheap next to a training step."""
    entry = {"time": time.time(), **record}
    # A full disk mid-training: one line naming this file (DiskFull), no cut line left in it.
    append_line(path, json.dumps(entry, default=_json_scalar), "appending a record to the training metrics log")


def _json_scalar(value: Any) -> Any:
    """Tensors and numpy scalars in metric dicts as plain numbers; anything else as text."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, in order; [] if there is no file."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def compat_applied(path: str | Path) -> list[str] | None:
    """The runtime fixes the last training run installed (its compat record), or None."""
    found = [r[COMPAT_KEY] for r in read_metrics(path) if isinstance(r.get(COMPAT_KEY), list)]
    return found[-1] if found else None
