"""Bench plumbing shared by the bench scripts: timestamped log lines and one logged child command."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_logged(name: str, cmd: list, log_path: Path, env: dict, cwd: Path, timeout: float) -> tuple[str, float]:
    """Run one command with its output in `log_path`; returns (output, wall s). A failure raises with the log's tail."""
    started = time.monotonic()
    with open(log_path, "w") as handle:
        handle.write("$ " + " ".join(map(str, cmd)) + "\n")
        handle.flush()
        proc = subprocess.run(list(map(str, cmd)), stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                              timeout=timeout)
    wall = time.monotonic() - started
    text = log_path.read_text()
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-25:])
        raise RuntimeError(f"{name} exited {proc.returncode} after {wall:.0f}s (log {log_path}):\n{tail}")
    log(f"{name}: ok in {wall:.1f}s")
    return text, wall


def float_after(text: str, pattern: str) -> float | None:
    """The last match of `pattern`'s first group in `text`, as a float."""
    found = re.findall(pattern, text)
    return float(found[-1]) if found else None
