"""Shared fixtures: the miniature (built once, cached under .cache/) and stage runners.

Every test builds its own tiny models and data through `eagle3_pipeline.miniature`; nothing
is downloaded.

Lanes: tests/bench/ tests the benchmarks' code (marked `bench`). `make test-fast`
(-m "not gpu and not slow and not vllm") runs no stage: a test that uses a stage-running fixture
(STAGE_RUN_FIXTURES, however indirectly) is marked `slow` here, and `run_stage` refuses to run a stage
inside a test that is not `slow`, so the fast lane cannot start one unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from eagle3_pipeline.manifest import STAGES

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "eagle3-train"
SAMPLES = SCRIPTS / "samples"
BENCH_TESTS = REPO / "tests" / "bench"  # tests of bench/ (benchlib, the bench scripts): marked `bench`
STAGE_SCRIPTS = STAGES  # stage name -> script, in pipeline order
TRAINING_STAGES = ("prepare", "extract", "vocab", "train", "export")  # 01-05: data to exported draft (06 measures it)

# Fixtures that run stages (a module's own ones too). pytest's item.fixturenames is the whole closure,
# so a test reaching one through another fixture (`ref`, `work`) is marked as well.
STAGE_RUN_FIXTURES = frozenset({"kimi_run", "fp8_run", "kimi_vllm_run", "llama_vllm_run", "llama_run", "llama_eval"})
# Flags with which a stage script does no work (reads, checks, prints): allowed in the fast lane.
NO_WORK_FLAGS = frozenset({"--check", "--print-config", "--help"})

_current_test: dict[str, pytest.Item | None] = {"item": None}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that uses a stage-running fixture, `bench` every test under tests/bench/
    (tryfirst: before `-m` deselects)."""
    for item in items:
        if STAGE_RUN_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)
        if BENCH_TESTS in item.path.parents:
            item.add_marker(pytest.mark.bench)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current_test["item"] = item  # before any fixture: session fixtures run stages in the first test's setup


def run_stage(stage: str, *args: str, check: bool = True, timeout: float = 600, env: dict | None = None):
    """Run one stage script as a user would; returns the CompletedProcess (text output)."""
    item = _current_test["item"]
    if item is not None and item.get_closest_marker("slow") is None and not NO_WORK_FLAGS.intersection(map(str, args)):
        raise AssertionError(f"{item.nodeid} runs stage {stage} but is not marked slow: mark it "
                             "@pytest.mark.slow (or add its fixture to conftest.STAGE_RUN_FIXTURES)")
    cmd = [sys.executable, str(SCRIPTS / STAGE_SCRIPTS[stage]), *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def descendants(pid: int) -> list[int]:
    """Every process started under `pid` (children, theirs, ...): torchrun starts its ranks in their own sessions,
    so a kill of a node's process group leaves them; a test that plays a machine going down kills these too."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found[1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def http_server(argv: list[str], port: int, log: Path, start_timeout_s: float = 240):
    """Start a server (its own process group), yield its base URL once /health answers, stop it."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {start_timeout_s}s:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def miniature() -> dict[str, Path]:
    from eagle3_pipeline.miniature import build_miniature

    return build_miniature(REPO / ".cache")


@pytest.fixture(scope="session")
def kimi_target(miniature) -> Path:
    return miniature["kimi"]


@pytest.fixture(scope="session")
def llama_target(miniature) -> Path:
    return miniature["llama"]


def run_pipeline(work: Path, target: Path, data: Path = SAMPLES / "conversations.jsonl",
                 profile: str = "cpu-mini", stages: tuple[str, ...] = TRAINING_STAGES) -> dict[str, Path]:
    """The five stages (or a prefix of them) with the cpu-mini profile; returns the output dirs."""
    dirs = {"data": work / "data", "vocab": work / "vocab", "checkpoints": work / "checkpoints", "draft": work / "draft"}
    args = {
        "prepare": ["--target", target, "--data", data, "--output", dirs["data"]],
        "extract": ["--target", target, "--data", dirs["data"]],
        "vocab": ["--data", dirs["data"], "--output", dirs["vocab"]],
        "train": ["--target", target, "--data", dirs["data"], "--vocab", dirs["vocab"], "--output", dirs["checkpoints"],
                  "--logger", ""],
        "export": ["--checkpoints", dirs["checkpoints"], "--output", dirs["draft"]],
    }
    for stage in stages:
        run_stage(stage, "--profile", profile, *args[stage])
    return dirs


@pytest.fixture(scope="session")
def kimi_run(tmp_path_factory, kimi_target) -> dict[str, Path]:
    """One full five-stage run on the Kimi miniature, shared (read-only!) by many tests."""
    return run_pipeline(tmp_path_factory.mktemp("kimi-run"), kimi_target)



@pytest.fixture(scope="session")
def llama_run(tmp_path_factory, llama_target) -> dict[str, Path]:
    """Stages 01-05 on the Llama miniature (cpu-mini profile): the draft vLLM's CPU build serves (stage 06's tests
    and its reliability sweep share it, read-only)."""
    return run_pipeline(tmp_path_factory.mktemp("llama-run"), llama_target)


@pytest.fixture(scope="session")
def llama_eval(tmp_path_factory, llama_run) -> Path:
    """A finished stage 06 evaluation of llama_run's draft (one engine: --no-baseline), shared read-only: copy it to
    change it. The flags it was made with are LLAMA_EVAL_FLAGS."""
    out = tmp_path_factory.mktemp("llama-eval") / "eval"
    run_stage("evaluate", "--profile", "cpu-mini", "--draft", llama_run["draft"], "--output", out, *LLAMA_EVAL_FLAGS)
    return out


LLAMA_EVAL_FLAGS = ("--no-baseline",)
