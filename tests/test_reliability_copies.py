"""A finished work directory copied, moved or rerun with other run settings (issue 40): run_all.sh never takes another
run's training as this one's, and never prints or reads a path that a copy carried over from where it was made.

On private copies of the session's finished Kimi-miniature run (conftest.kimi_run: five stages, the profile's 2
epochs, unsliced; a copy is cheap). The sliced-run counterparts (a kept slice record cut short) are in
tests/test_slices.py, on its finished sliced run; the sweep of one change at a time (--slice-rows over this unsliced
run among them) in tests/test_reliability_sweep.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SAMPLES

pytestmark = pytest.mark.reliability

RUN_ALL = REPO / "eagle3-train" / "run_all.sh"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def copy_run(kimi_run: dict[str, Path], root: Path) -> Path:
    """The whole finished run in another directory (as `cp -a` would copy it)."""
    for name in ("data", "vocab", "checkpoints", "draft"):
        shutil.copytree(kimi_run[name], root / name, symlinks=True)
    return root


def run_all(work: Path, target: Path, *extra: str, args_04: str = "--logger=") -> subprocess.CompletedProcess:
    """run_all.sh as conftest.run_pipeline ran the five stages (so a finished run's stages are no-ops)."""
    cmd = ["bash", str(RUN_ALL), "--profile", "cpu-mini", "--target", str(target), "--data",
           str(SAMPLES / "conversations.jsonl"), "--work", str(work), "--python", sys.executable, "--args-04", args_04,
           *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)


def test_a_moved_work_dir_exports_from_its_own_vocab_and_serves_its_own_draft(kimi_run, kimi_target, tmp_path):
    """The run moved away from where it was made (the paths its manifests recorded are gone), its draft deleted: 05
    re-exports it from this work dir's vocab (run_all passes --vocab), and the serve line names this draft."""
    work = copy_run(kimi_run, tmp_path / "work")
    trained = json.loads((work / "checkpoints" / "manifest.json").read_text())
    made_at = str(kimi_run["data"].parent.resolve())
    # where the copy was made no longer exists: its recorded paths point into a folder that is gone
    text = json.dumps(trained).replace(made_at, str(tmp_path / "moved-away"))
    (work / "checkpoints" / "manifest.json").write_text(text)
    shutil.rmtree(work / "draft")
    result = run_all(work, kimi_target)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    serve = [line for line in result.stdout.splitlines() if line.startswith("vllm serve ")]
    assert serve and f'"model": "{work / "draft"}"' in serve[-1], serve
    assert json.loads((work / "draft" / "manifest.json").read_text())["complete"]


def test_status_says_which_logs_are_missing(kimi_run, tmp_path):
    """Before: five log paths under WORK/logs/ printed as if they were there after logs/ was deleted (or a copy
    without them)."""
    work = copy_run(kimi_run, tmp_path / "work")
    (work / "logs").mkdir()
    (work / "logs" / "01_prepare.log").write_text("kept\n")
    result = subprocess.run(["bash", str(RUN_ALL), "--status", "--work", str(work), "--python", sys.executable],
                            capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert lines["01"].endswith(str(work / "logs" / "01_prepare.log"))
    for num, name in (("02", "extract"), ("03", "vocab"), ("04", "train"), ("05", "export")):
        assert " finished " in lines[num] and lines[num].endswith(f"{work / 'logs' / f'{num}_{name}.log'} (missing)")


def test_status_of_a_copy_taken_mid_run_says_nothing_runs(tmp_path):
    """A work dir copied while its run was going carries logs/current_stage; the process id in it may be alive as some
    other process here. Before: --status said `running: stage 04` on the strength of that id alone."""
    logs = tmp_path / "work" / "logs"
    logs.mkdir(parents=True)
    (logs / ".run_all.lock").write_text("")  # no driver holds it
    (logs / "current_stage").write_text(f"04 {os.getpid()}\n")  # a live process, not a stage of this work dir
    result = subprocess.run(["bash", str(RUN_ALL), "--status", "--work", str(tmp_path / "work"), "--python",
                             sys.executable], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "nothing running (last started: stage 04)", result.stdout
