"""Sliced runs (run_all.sh --slice-rows, eagle3_pipeline/slices.py): a run larger than the disk, one slice at a time.

On the miniature (cpu-mini, 1 epoch): the same rows trained unsliced and in 3 slices end with drafts whose validation
loss (the same validation rows) agrees within a stated tolerance; the hidden states on disk, sampled all through the
sliced run, never exceed one slice (+ one file in flight); kill -9 in slice 2 (mid-extraction, mid-training, then
during its deletion) resumes with the same command at that slice; a changed slice size or input is refused in one line naming the field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3_pipeline import slices
from eagle3_pipeline.errors import ContractError
from eagle3_pipeline.manifest import SCHEMA_VERSION
from eagle3_pipeline.plan import format_plan, make_plan

from conftest import run_stage

REPO = Path(__file__).resolve().parent.parent
RUN_ALL = REPO / "eagle3-train" / "run_all.sh"
SAMPLES = REPO / "eagle3-train" / "samples"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
# The sliced draft's validation loss against the unsliced one's, relative. Both see every training row once under one
# lr schedule of (nearly) the same length; what differs is the packing and the order (slices are contiguous rows, the
# unsliced epoch shuffles all of them), which on a handful of optimizer steps moves the loss by a few percent.
VAL_LOSS_TOLERANCE = 0.15


# --- no stage run ---------------------------------------------------------------------------------------

def test_selection_parses_and_refuses_bad_ranges():
    assert slices.parse_rows("0:3,9:10", 10) == [0, 1, 2, 9]
    for bad in ("3:1", "0:11", "0:3,2:5", "a:b", "5"):
        with pytest.raises(Exception, match="--rows"):
            slices.parse_rows(bad, 10)


def test_every_position_holds_its_slice_then_the_validation_rows_and_splits_exactly_there():
    plan = slices.make_plan(rows=15, train_data_ratio=0.9, slice_rows=5, epochs=2)
    assert (plan.val_start, plan.num_slices, plan.positions) == (13, 3, 6)
    assert [plan.selection(g) for g in range(6)] == ["0:5,13:15", "5:10,13:15", "10:13,13:15"] * 2
    for g in range(plan.positions):
        rows = slices.parse_rows(plan.selection(g), plan.rows)
        a, b = plan.train_range(g)
        assert int(len(rows) * plan.train_data_ratio(g)) == b - a  # speculators' ArrowDataset split: train rows first


def test_the_lr_schedule_is_planned_over_every_slice_and_epoch():
    plan = slices.make_plan(rows=40, train_data_ratio=0.9, slice_rows=12, epochs=2)
    steps = slices.planned_steps([100] * 40, plan, total_seq_len=300, world_size=1, seed=0)
    assert steps == [4, 4, 4] * 2  # 12 rows of 100 tokens, 3 per 300-token step; 36 training rows in 3 slices
    argv = slices.sliced_argv(["--data-path", "D", "--epochs", "2", "--train-data-ratio", "0.9"], Path("/v"), 4, 0.9,
                              sum(steps))
    assert argv[:6] == ["--data-path", "/v", "--epochs", "5", "--train-data-ratio", "0.9"]
    assert argv[6:] == ["--scheduler-total-steps", "24", "--scheduler-warmup-steps", "0"]


def test_release_deletes_only_what_stage_02_recorded_and_keeps_its_manifest(tmp_path):
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i in (0, 1, 5, 7):
        (hs / f"hs_{i}.safetensors").write_bytes(b"x" * 10)
    (hs / "notes.txt").write_text("mine")
    (hs / "fingerprints.json").write_text(json.dumps({f"hs_{i}.safetensors": [10, "f", 1] for i in (0, 1, 5)}))
    (hs / "manifest.json").write_text(json.dumps({"stage": "extract", "schema_version": SCHEMA_VERSION, "complete": True,
                                                  "selection": "0:2,5:6", "rows_total": 8, "created": "t"}))
    assert slices.release(hs, keep={5}) == [0, 1]
    assert sorted(p.name for p in hs.glob("hs_*")) == ["hs_5.safetensors", "hs_7.safetensors"]  # 7: not its file
    assert (hs / "notes.txt").exists()
    record = json.loads(next((hs / "slices").glob("*.json")).read_text())
    assert record["selection"] == "0:2,5:6" and "hs_0.safetensors" in record["fingerprint_files"]
    assert json.loads((hs / "manifest.json").read_text())["complete"] is False  # its files are gone
    assert slices.release(hs, keep=set()) == [5]  # a rerun (a kill mid-deletion) finishes the job
    assert (hs / "hs_7.safetensors").exists()


@pytest.mark.reliability
def test_a_truncated_or_foreign_slice_record_is_refused_naming_it_and_nothing_is_deleted(tmp_path):
    """Before: a kept record that could not be read was skipped in silence (its rows' files then never deleted)."""
    hs = tmp_path / "hidden_states"
    (hs / "slices").mkdir(parents=True)
    (hs / "hs_3.safetensors").write_bytes(b"x" * 10)
    good = {"stage": "extract", "schema_version": SCHEMA_VERSION, "complete": True, "selection": "3:4", "rows_total": 8,
            "fingerprint_files": {"hs_3.safetensors": [10, "f", 1]}}
    for name, text in (("cut.json", json.dumps(good)[:40]),
                       ("foreign.json", json.dumps({**good, "mine": 1})),
                       ("old.json", json.dumps({**good, "schema_version": SCHEMA_VERSION - 1}))):
        record = hs / "slices" / name
        record.write_text(text)
        with pytest.raises(ContractError) as refused:
            slices.release(hs, keep=set())
        assert str(refused.value).startswith(f"{record}: not a slice record stage 02 kept (")
        assert "\n" not in str(refused.value) and (hs / "hs_3.safetensors").exists()
        record.unlink()


def _trained_in(tmp_path: Path, records: list[dict]) -> Path:
    """Stage 04's manifest of a sliced run that recorded training on `records`."""
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"stage": "train", "schema_version": SCHEMA_VERSION, "complete": False,
                                                    "slicing": {"slice_rows": 2}, "slices_trained": records}))
    return ckpt


@pytest.mark.reliability
def test_release_deletes_states_only_once_stage_04_recorded_training_on_exactly_them(tmp_path):
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i in (0, 1, 5):
        (hs / f"hs_{i}.safetensors").write_bytes(b"x" * 10)
    (hs / "fingerprints.json").write_text(json.dumps({f"hs_{i}.safetensors": [10, "f", 1] for i in (0, 1, 5)}))
    (hs / "manifest.json").write_text(json.dumps({"stage": "extract", "schema_version": SCHEMA_VERSION, "complete": True,
                                                  "selection": "0:2,5:6", "rows_total": 8, "content_sha256": "c1"}))
    ckpt = _trained_in(tmp_path, [{"position": 0, "rows": "0:2,5:6", "extract": {"content_sha256": "other"}}])
    with pytest.raises(ContractError, match=r"hidden_states/manifest.json: its states \(rows 0:2,5:6\) are not what"):
        slices.release(hs, keep=set(), trained_in=ckpt)  # the same rows, another extraction of them
    assert len(list(hs.glob("hs_*"))) == 3 and not (hs / "slices").exists()
    shutil.rmtree(ckpt)
    ckpt = _trained_in(tmp_path, [{"position": 0, "rows": "0:2,5:6", "extract": {"content_sha256": "c1"}}])
    assert slices.release(hs, keep={5}, trained_in=ckpt) == [0, 1]


def test_the_plan_picks_the_slice_size_from_the_free_disk(kimi_target, tmp_path):
    per_row = 100 * make_plan(str(kimi_target), "cpu-mini", str(tmp_path), rows=1, tokens_per_row=1).bytes_per_token["bf16"]
    free_gb = 300.5 * per_row / 0.9 / 1e9  # 90% of it (the rest for files in flight) holds 300 rows' states
    plan = make_plan(str(kimi_target), "cpu-mini", str(tmp_path), rows=1000, tokens_per_row=100,
                     extract_tokens_per_s=1000.0, free_disk_gb=free_gb)
    text = format_plan(plan)
    fit = 200  # a slice + the 100 validation rows
    assert f"--slice-rows {fit:,} (the most that fit): {-(-900 // fit):,} slice(s) x 2 epoch(s)" in text
    assert "WARNING:       a sliced run re-extracts every slice each epoch" in text  # 1000 tokens/s extraction


# --- the miniature, unsliced and sliced -----------------------------------------------------------------

def run_all(work: Path, *extra: str, data: Path = SAMPLES / "conversations.jsonl") -> list[str]:
    return ["bash", str(RUN_ALL), "--profile", "cpu-mini", "--target", str(_target()), "--data", str(data),
            "--work", str(work), "--python", sys.executable, "--args-04", "--epochs 1 --logger=", *extra]


_TARGET: dict[str, Path] = {}


def _target() -> Path:
    return _TARGET["kimi"]


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _states_bytes(hs_dir: Path) -> int:
    """Every hidden-state file there now, landed or in flight (hidden temp names too); not the kept records."""
    total = 0
    for path in list(hs_dir.glob("*hs_*")) if hs_dir.is_dir() else []:
        try:
            total += path.stat().st_size
        except OSError:  # renamed or deleted between the listing and the stat
            pass
    return total


class DiskSampler:
    """The peak of _states_bytes, sampled every 20 ms while a run goes on."""

    def __init__(self, hs_dir: Path):
        self.hs_dir, self.peak, self.samples, self._stop = hs_dir, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _states_bytes(self.hs_dir))
            self.samples += 1
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _wait(predicate, proc, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {what}: {proc.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _kill_run(proc, work: Path):
    """kill -9 the driver and the stage it runs (a crash): both process groups."""
    stage_pg = int((work / "logs" / "current_stage").read_text().split()[1])
    os.killpg(proc.pid, signal.SIGKILL)
    os.killpg(stage_pg, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(stage_pg, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            return
    raise AssertionError("killed stage still running")


def _current(work: Path) -> str:
    try:
        return (work / "logs" / "current_stage").read_text().split()[0]
    except (OSError, IndexError):
        return ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, kimi_target):
    """The unsliced run (1 epoch), then the sliced run over the same rows: 3 slices, killed twice in slice 2."""
    _TARGET["kimi"] = kimi_target
    base = tmp_path_factory.mktemp("unsliced")
    data, vocab = base / "data", base / "vocab"
    run_stage("prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", SAMPLES / "conversations.jsonl",
              "--output", data)
    run_stage("extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", data)
    run_stage("vocab", "--profile", "cpu-mini", "--data", data, "--output", vocab)
    run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--vocab", vocab,
              "--output", base / "checkpoints", "--epochs", "1", "--logger", "")
    prepared = _manifest(data)
    val_start = int(prepared["counts"]["rows"] * prepared["train_data_ratio"])
    slice_rows = -(-val_start // 3)
    assert -(-val_start // slice_rows) == 3

    work = tmp_path_factory.mktemp("sliced")
    # the same prepared rows and vocab (stages 01 and 03 are then no-ops in the sliced run: same inputs, same settings)
    shutil.copytree(data, work / "data", ignore=lambda d, names: ["hidden_states"] if Path(d) == data else [])
    shutil.copytree(vocab, work / "vocab")
    hs_dir = work / "data" / "hidden_states"
    cmd = run_all(work, "--slice-rows", str(slice_rows))
    started = time.monotonic()
    with DiskSampler(hs_dir) as disk:
        # kill -9 in slice 2: first while it extracts (a file of it landed), then while it trains (after its 04 began)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO,
                                start_new_session=True)
        first, last = (hs_dir / f"hs_{row}.safetensors" for row in (slice_rows, 2 * slice_rows - 1))
        _wait(lambda: first.exists() and not last.exists(), proc, 600, "slice 2's extraction (~200 ms a row)")
        _kill_run(proc, work)
        killed_extracting = sorted(p.name for p in hs_dir.glob("hs_*.safetensors"))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=REPO,
                                start_new_session=True)
        log = work / "logs" / "04_train.log"
        _wait(lambda: _current(work) == "04" and "Training epoch 2/2 started" in log.read_text().split(
            "run_all attempt:")[-1], proc, 600, "slice 2's training (speculators' epoch 2 of the run so far)")
        _kill_run(proc, work)
        # then kill -9 of the run (driver + `slices release`, one process group) during slice 2's deletion: at
        # its second hidden-state unlink, exactly (an audit hook in the release process; no hook in the product)
        slice2 = [hs_dir / f"hs_{row}.safetensors" for row in range(slice_rows, 2 * slice_rows)]
        killed = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900,
                                env={**ENV, "PYTHONPATH": f"{_kill_hook(tmp_path_factory)}:{ENV.get('PYTHONPATH', '')}"},
                                start_new_session=True)
        killed_deleting = [p.exists() for p in slice2]
        rerun = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-2000:]
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-2000:]
    print(f"sliced run with two kills and reruns: {time.monotonic() - started:.0f} s; {disk.samples} disk samples")
    return {"base": base, "work": work, "cmd": cmd, "slice_rows": slice_rows, "peak": disk.peak,
            "killed_extracting": killed_extracting, "killed_deleting": killed_deleting, "slice2": slice2}


KILL_HOOK = """
import os, signal, sys
if "release" in sys.argv and "--keep" in sys.argv:  # `python -m eagle3_pipeline.slices release ...` only
    removed = []
    def _kill_at_second_state_unlink(event, args):
        if event == "os.remove" and "hs_" in os.path.basename(str(args[0])):
            removed.append(args[0])
            if len(removed) == 2:  # the first file is gone, this one and the rest are not
                os.killpg(os.getpgid(0), signal.SIGKILL)
    sys.addaudithook(_kill_at_second_state_unlink)
"""


def _kill_hook(tmp_path_factory) -> Path:
    """A folder whose sitecustomize.py kills the run's process group in `slices release` (test-only)."""
    folder = tmp_path_factory.mktemp("kill-during-release")
    (folder / "sitecustomize.py").write_text(KILL_HOOK)
    return folder


def _summary(work: Path) -> dict:
    return json.loads((work / "checkpoints" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.reliability
def test_sliced_run_ends_near_the_unsliced_validation_loss(runs):
    sliced, unsliced = _summary(runs["work"]), _summary(runs["base"])
    trained = _manifest(runs["work"] / "checkpoints")
    assert trained["complete"] and trained["slicing"]["num_slices"] == 3
    assert [r["position"] for r in trained["slices_trained"]] == [0, 1, 2]
    # one lr schedule over the whole run: the lr falls step by step across the slices (no restart at a slice)
    records = [json.loads(line) for line in (runs["work"] / "checkpoints" / "metrics.jsonl").read_text().splitlines()
               if line.endswith("}")]
    lrs = {r["global_step"]: r["lr"] for r in records if "train" in r}
    assert [lrs[s] for s in sorted(lrs)] == sorted(lrs.values(), reverse=True) and len(lrs) >= 3
    assert sum(r["optimizer_steps"] for r in trained["slices_trained"]) == len(lrs)
    assert _manifest(runs["work"] / "draft")["complete"]  # stage 05 exported the sliced run's best checkpoint
    print(f"val loss: sliced {sliced['val_loss']:.5f}, unsliced {unsliced['val_loss']:.5f}")
    assert abs(sliced["val_loss"] - unsliced["val_loss"]) <= VAL_LOSS_TOLERANCE * unsliced["val_loss"]


@pytest.mark.slow
@pytest.mark.reliability
def test_disk_never_holds_more_than_one_slice_of_states(runs):
    """The peak sampled all through the run against the largest position's files (sizes from the kept records) plus
    one file in flight; and far below the unsliced run's states."""
    records = [json.loads(p.read_text()) for p in (runs["work"] / "data" / "hidden_states" / "slices").glob("*.json")]
    assert sorted(r["selection"] for r in records) == sorted(
        r["rows"] for r in _manifest(runs["work"] / "checkpoints")["slices_trained"])
    per_slice = [sum(size for size, *_ in r["fingerprint_files"].values()) for r in records]
    largest_file = max(size for r in records for size, *_ in r["fingerprint_files"].values())
    unsliced = _states_bytes(runs["base"] / "data" / "hidden_states")
    print(f"peak states on disk {runs['peak']:,} B; largest slice {max(per_slice):,} B; unsliced {unsliced:,} B")
    assert 0 < runs["peak"] <= max(per_slice) + largest_file
    assert runs["peak"] < unsliced
    assert _states_bytes(runs["work"] / "data" / "hidden_states") == 0  # the last slice's states are gone too


@pytest.mark.slow
@pytest.mark.reliability
def test_kill_in_slice_2_resumes_there_with_the_same_command(runs):
    work, slice_rows = runs["work"], runs["slice_rows"]
    assert f"hs_{slice_rows}.safetensors" in runs["killed_extracting"]  # killed mid-extraction of slice 2:
    assert f"hs_{2 * slice_rows - 1}.safetensors" not in runs["killed_extracting"]  # its first row landed, its last not
    assert "hs_0.safetensors" not in runs["killed_extracting"]  # slice 1's states were already deleted
    extract_log = (work / "logs" / "02_extract.log").read_text()
    assert extract_log.count(f"--rows 0:{slice_rows},") == 1  # slice 1 extracted once: never redone after the kills
    attempts = extract_log.split("run_all attempt:")
    slice2 = [a for a in attempts if f"--rows {slice_rows}:" in a.splitlines()[0]]
    kept = re.search(r"\((\d+) already done\)", slice2[1])
    plan = _manifest(work / "checkpoints")["slicing"]
    assert kept and int(kept.group(1)) >= plan["rows"] - plan["val_start"] + 1  # validation rows + what had landed
    train_attempts = (work / "logs" / "04_train.log").read_text().split("run_all attempt:")
    position2 = [a for a in train_attempts if "--slice-index 1" in a.splitlines()[0]]
    assert len(position2) == 2  # killed once mid-training, then the rerun
    assert "resuming from checkpoint 0" in position2[-1]  # speculators' state after slice 1, not a fresh start
    # killed during slice 2's deletion: its first file gone, the rest still there; the rerun finished the deletion
    # without training or extracting slice 2 again (the counts above include that rerun)
    assert runs["killed_deleting"][0] is False and all(runs["killed_deleting"][1:])
    assert not any(p.exists() for p in runs["slice2"])


@pytest.mark.slow
@pytest.mark.reliability
def test_a_truncated_kept_slice_record_is_noticed_on_rerun(runs, tmp_path):
    """Before: the rerun of a finished sliced run skipped a cut-short record in silence and ended "finished". (Before
    the next test, which reruns stage 01 of `runs` with another input.)"""
    work = tmp_path / "work"
    shutil.copytree(runs["work"], work, symlinks=True)
    record = sorted((work / "data" / "hidden_states" / "slices").glob("*.json"))[0]
    record.write_bytes(record.read_bytes()[:len(record.read_bytes()) // 2])
    cmd = runs["cmd"][:runs["cmd"].index("--work") + 1] + [str(work)] + runs["cmd"][runs["cmd"].index("--work") + 2:]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert result.returncode != 0, result.stdout[-3000:]
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and f"not released: {record}: not a slice record stage 02 kept (unreadable" in error[0], error


@pytest.mark.slow
@pytest.mark.reliability
def test_changed_slice_size_or_input_is_refused_in_one_line(runs):
    work = runs["work"]
    before = sorted(p.name for p in (work / "checkpoints").iterdir())
    changed = runs["cmd"][:-1] + [str(runs["slice_rows"] - 1)]
    refused = subprocess.run(changed, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert refused.returncode != 0
    error = refused.stderr.strip().splitlines()
    assert len(error) == 1 and "slice_rows = " in error[0] and "run_all.sh: sliced run refused" in error[0], error
    other_input = runs["cmd"] + ["--args-01", "--max-samples 9 --overwrite"]
    refused = subprocess.run(other_input, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert refused.returncode != 0
    error = refused.stderr.strip().splitlines()
    assert len(error) == 1 and "another input: prepare" in error[0], error
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == before  # nothing of the run was touched


@pytest.mark.slow
def test_rows_never_slices_over_a_finished_extraction_of_every_row(runs):
    hs_dir = runs["base"] / "data" / "hidden_states"
    before = sorted(p.name for p in hs_dir.iterdir())
    refused = subprocess.run([sys.executable, str(REPO / "eagle3-train" / "02_extract_hidden_states.py"), "--profile",
                              "cpu-mini", "--target", str(_target()), "--data", str(runs["base"] / "data"), "--rows", "0:3"],
                             capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].startswith(f"error: {hs_dir / 'manifest.json'}: a finished extraction")
    assert sorted(p.name for p in hs_dir.iterdir()) == before
