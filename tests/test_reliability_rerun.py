"""Reruns tell the truth and never lose finished work (issue 15): one rule for "done", deleting only
what a stage wrote, one writer per output, resume refusals, resource errors, the draft config schema,
and batch-invariant HF extraction.

Most cases run a stage's real `main(argv)` in this process on a private copy of the shared finished
Kimi-miniature run (`kimi_run`, copied elsewhere: every case is also a "moved work directory"), and
compare every file's inode, mtime and bytes before and after. Locks are held by a second, real
process (flock is per process), which is then killed with SIGKILL to show the OS releases it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_reliability_bad_input import recorded_by_02, refused, snapshot, stage_module, succeeded

from eagle3_pipeline.extract import run as extract_run

from conftest import SAMPLES

pytestmark = pytest.mark.reliability


# --- helpers ---------------------------------------------------------------------------------------

def state(root: Path) -> dict[str, tuple]:
    """(inode, mtime, size) of every file and link under root: a no-op leaves this equal."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        if path.is_symlink():
            out[path.relative_to(root).as_posix()] = ("->", str(path.readlink()))
        elif path.is_file():
            info = path.stat()
            out[path.relative_to(root).as_posix()] = (info.st_ino, info.st_mtime_ns, info.st_size)
    return out


def manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / "manifest.json").read_text())


@pytest.fixture
def work(kimi_run, tmp_path) -> dict[str, Path]:
    """A private copy of the whole finished run, in another directory than where it was made."""
    root = tmp_path / "moved-work"
    out = {"root": root}
    for name in ("data", "vocab", "checkpoints", "draft"):
        out[name] = root / name
        shutil.copytree(kimi_run[name], out[name], symlinks=True)
    for lock in kimi_run["draft"].parent.glob(".*.eagle3.lock"):  # the export's lock lives beside it
        shutil.copy2(lock, root / lock.name)
    out["hs"] = out["data"] / "hidden_states"
    return out


def args(stage: str, work: dict, target: Path, *extra) -> list:
    base = {
        "prepare": ["--target", target, "--data", SAMPLES / "conversations.jsonl", "--output", work["data"]],
        "extract": ["--target", target, "--data", work["data"]],
        "vocab": ["--data", work["data"], "--output", work["vocab"]],
        "train": ["--target", target, "--data", work["data"], "--vocab", work["vocab"], "--output", work["checkpoints"],
                  "--logger", ""],
        "export": ["--checkpoints", work["checkpoints"], "--output", work["draft"]],
    }[stage]
    return [stage, "--profile", "cpu-mini", *base, *extra]


@pytest.fixture
def logs(caplog):
    """The stage's log lines (logging goes to the real stderr, past capsys)."""
    import logging

    caplog.set_level(logging.INFO, logger="eagle3")
    return caplog


def ran(capsys, logs, *argv) -> str:
    """Run a stage that must succeed; returns its log and output."""
    logs.clear()
    return succeeded(capsys, *argv) + logs.text


def with_slash(path: Path) -> str:
    return str(path) + "/"


@pytest.fixture
def lock_holder():
    """Start a real second process holding an flock on a path; yields start(path, exclusive)."""
    procs = []

    def start(path: Path, exclusive: bool = True) -> subprocess.Popen:
        code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                f"fcntl.flock(fd, fcntl.{'LOCK_EX' if exclusive else 'LOCK_SH'}); print('held', flush=True); "
                "time.sleep(600)")
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


# --- 2. one rule for "done": harmless variations are no-ops -------------------------------------------

def test_every_stage_rerun_with_harmless_variations_is_a_no_op_keeping_every_file(capsys, logs, work, kimi_target):
    """Trailing slashes, absolute vs relative paths, a moved work directory (this copy), validation
    sampling, batching and worker counts: every stage says "nothing to do" and touches no file."""
    before = state(work["root"])
    rel = {k: Path(os.path.relpath(v)) if isinstance(v, Path) else v for k, v in work.items()}
    runs = [
        args("prepare", {**work, "data": with_slash(work["data"])}, with_slash(kimi_target)),
        args("extract", {**work, "data": rel["data"]}, kimi_target, "--validate-sample", "-1", "--max-num-seqs", "3"),
        args("extract", work, kimi_target, "--validate-sample", "0", "--retries", "5", "--device", "cpu"),
        args("vocab", {**work, "data": with_slash(work["data"]), "vocab": rel["vocab"]}, kimi_target),
        args("train", {**work, "checkpoints": with_slash(work["checkpoints"])}, with_slash(kimi_target),
             "--num-workers", "3", "--log-freq", "7", "--prefetch-factor", "4"),
        args("export", {**work, "checkpoints": rel["checkpoints"]}, kimi_target),
        args("export", work, kimi_target, "--checkpoint", manifest(work["draft"])["checkpoint"]),
    ]
    for argv in runs:
        out = ran(capsys, logs, *argv)
        assert "nothing to do" in out, (argv, out[-1500:])
    assert state(work["root"]) == before


def test_a_reformatted_upstream_manifest_is_the_same_input(capsys, logs, work, kimi_target):
    """Downstream stages record an upstream output by the content it describes, not its bytes."""
    path = work["data"] / "manifest.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4) + "\n\n")
    before = state(work["root"])
    for stage in ("vocab", "train"):
        assert "nothing to do" in ran(capsys, logs, *args(stage, work, kimi_target))
    assert state(work["root"]) == before


def test_a_setting_that_changes_outputs_is_refused_naming_the_field_and_both_values(capsys, work, kimi_target):
    before = state(work["root"])
    code, error = refused(capsys, *args("vocab", work, kimi_target, "--draft-vocab-size", "128"))
    assert (code, error) == (3, f"{work['vocab'] / 'manifest.json'}: {work['vocab']} holds a finished result made with "
                                f"settings.draft_vocab_size = 256 there, 128 in this run; rerun with the old value, "
                                f"choose another --output, or pass --overwrite to replace it")
    code, error = refused(capsys, *args("extract", work, kimi_target, "--dtype", "bfloat16"))
    assert code == 3 and error.endswith(f"settings.dtype = \"float32\" there, \"bfloat16\" in this run; move "
                                        f"{work['hs']} away (or rerun 01 into a new --output) to extract again")
    assert state(work["root"]) == before


def test_new_data_in_stage_01_makes_every_downstream_stage_say_what_changed(capsys, logs, work, kimi_target, tmp_path):
    """Before: run_all.sh skipped 02-05 on `complete` and reported a draft trained on the old data."""
    data = tmp_path / "other.jsonl"
    data.write_text("\n".join((SAMPLES / "conversations.jsonl").read_text().splitlines()[:-1]) + "\n")  # one row fewer
    old_prepare = manifest(work["data"])["content_sha256"]
    checkpoints_before = state(work["checkpoints"])
    succeeded(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--output",
              work["data"], "--overwrite")
    new_prepare = manifest(work["data"])["content_sha256"]
    assert new_prepare != old_prepare
    code, error = refused(capsys, *args("vocab", work, kimi_target))
    assert (code, error) == (3, f"{work['vocab'] / 'manifest.json'}: {work['vocab']} holds a finished result made with "
                                f"inputs.prepare = \"{old_prepare}\" there, \"{new_prepare}\" in this run; rerun with "
                                f"the old value, choose another --output, or pass --overwrite to replace it")
    code, error = refused(capsys, *args("train", work, kimi_target))
    assert code == 3 and "built from a different 'prepare' output" in error
    assert state(work["checkpoints"]) == checkpoints_before
    # 02 alone may follow an input change: it re-checks every file, keeps the rows whose token ids
    # still match, redoes the others and drops the files of rows stage 01 no longer has.
    logs.clear()
    succeeded(capsys, *args("extract", work, kimi_target))
    rows = manifest(work["data"])["counts"]["rows"]
    assert f"an input changed since (inputs.prepare = \"{old_prepare[:20]}" in logs.text
    assert manifest(work["hs"])["complete"] and manifest(work["hs"])["identity"]["inputs"]["prepare"] == new_prepare
    assert sorted(int(p.stem[3:]) for p in work["hs"].glob("hs_*.safetensors")) == list(range(rows))


def test_an_output_of_an_older_schema_is_refused_in_one_line(capsys, work, kimi_target):
    """A manifest of another schema version (an older eagle3-train, before typed manifests) is neither trusted
    as finished nor replaced: one line naming the file and both versions; nothing is touched."""
    path = work["vocab"] / "manifest.json"
    old = {k: v for k, v in manifest(work["vocab"]).items() if k not in ("identity", "content_sha256")}
    path.write_text(json.dumps({**old, "schema_version": 1}, indent=2))
    before = state(work["root"])
    code, error = refused(capsys, *args("vocab", work, kimi_target))
    assert code == 3 and error.startswith(f"{path}: schema version 1, this version reads 2 "), error
    assert state(work["root"]) == before


def test_the_settings_that_shape_a_training_run_are_its_identity():
    from eagle3_pipeline.config import TrainConfig, build_config

    cfg, _ = build_config(TrainConfig, {"target": "t", "data": "d", "vocab": "v", "output": "o"})
    assert {"lr", "epochs", "optimizer", "max_steps", "total_seq_len", "seed"} <= set(cfg.identity_settings())
    assert not {"target", "data", "vocab", "output", "num_workers", "logger"} & set(cfg.identity_settings())


# --- 1. deleting is never a side effect ----------------------------------------------------------------

def test_check_and_print_config_delete_nothing_under_any_flags(capsys, work, kimi_target):
    """Before: `04 --overwrite --check` deleted every checkpoint, the metrics and the manifest, then exited 0."""
    before = state(work["root"])
    for argv in (args("train", work, kimi_target, "--overwrite", "--lr", "1e-5", "--check"),
                 args("vocab", work, kimi_target, "--overwrite", "--draft-vocab-size", "128", "--check"),
                 args("export", work, kimi_target, "--overwrite", "--checkpoint", "0", "--check"),
                 args("prepare", work, kimi_target, "--overwrite", "--max-seq-len", "256", "--check"),
                 args("extract", work, kimi_target, "--check", "--max-samples", "3")):
        succeeded(capsys, *argv)
    for argv in (args("train", work, kimi_target, "--overwrite", "--lr", "1e-5", "--print-config"),
                 args("extract", work, kimi_target, "--print-config")):
        with pytest.raises(SystemExit) as stop:
            stage_module(argv[0]).main([str(a) for a in argv[1:]])
        assert stop.value.code == 0
    assert state(work["root"]) == before


@pytest.mark.parametrize("stage", ["vocab", "train", "export"])
def test_overwrite_into_another_stages_directory_is_refused(stage, capsys, work, kimi_target):
    """Before: 03 and 04 suggested --overwrite for the data dir, and with it replaced stage 01's manifest."""
    before = state(work["root"])
    out_flag = {"vocab": "--output", "train": "--output", "export": "--output"}[stage]
    argv = args(stage, work, kimi_target)
    argv[argv.index(out_flag) + 1] = work["data"]
    code, error = refused(capsys, *argv, "--overwrite")
    if stage == "export":
        assert (code, error) == (2, f"{work['data']}: exists and is not an export made by 05_export.py (it would be "
                                    f"replaced as a whole); choose another --output")
    else:
        assert (code, error) == (2, f"{work['data'] / 'manifest.json'}: {work['data']} holds stage 'prepare''s output "
                                    f"(01_prepare_dataset.py); choose another --output (--overwrite never replaces "
                                    f"another stage's output)")
    assert state(work["root"]) == before


def test_a_folder_the_user_made_in_checkpoints_is_never_deleted(capsys, logs, work, kimi_target):
    """Before: `checkpoints/2024/` was deleted as an "incomplete checkpoint"."""
    mine = work["checkpoints"] / "2024"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = state(work["root"])
    assert "nothing to do" in ran(capsys, logs, *args("train", work, kimi_target))  # finished: a no-op still
    for extra in (("--overwrite", "--lr", "1e-5"), ("--overwrite", "--lr", "1e-5", "--check")):
        code, error = refused(capsys, *args("train", work, kimi_target, *extra))
        assert (code, error) == (3, f"{mine}: a folder stage 04 did not write (not a speculators checkpoint) in "
                                    f"--output, and speculators would resume from it; move it out of "
                                    f"{work['checkpoints']} (nothing was deleted)")
    assert state(work["root"]) == before


def test_overwrite_deletes_only_what_stage_04_wrote(work, tmp_path):
    from eagle3_pipeline import checkpoints

    ckpt = work["checkpoints"]
    (ckpt / "my-notes.txt").write_text("keep me")
    (ckpt / "eval").mkdir()
    (ckpt / "eval" / "results.json").write_text("{}")
    names = sorted(p.name for p in checkpoints.own_outputs(ckpt))
    assert "my-notes.txt" not in names and "eval" not in names and {"0", "1", "checkpoint_best", "metrics.jsonl"} <= set(names)
    checkpoints.delete_own(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == [".eagle3.lock", "eval", "my-notes.txt"]


@pytest.mark.parametrize("stage", ["train", "export"])
def test_an_unreadable_checkpoints_manifest_is_one_line(stage, capsys, work, kimi_target):
    path = work["checkpoints"] / "manifest.json"
    path.write_text('{"stage": "train", "complete": tr')
    code, error = refused(capsys, *args(stage, work, kimi_target))
    assert code == 3 and error.startswith(f"{path}: unreadable manifest (")


def test_export_finds_the_vocab_by_content_not_by_the_current_directory(capsys, work, kimi_target, tmp_path):
    """Before: 05 resolved stage 04's recorded relative vocab path against the current directory."""
    trained = manifest(work["checkpoints"])
    assert Path(trained["inputs"]["vocab"]["path"]).is_absolute()
    recorded = tmp_path / "where-it-was" / "vocab"  # as if the work directory had been moved
    trained["inputs"]["vocab"]["path"] = str(recorded)
    (work["checkpoints"] / "manifest.json").write_text(json.dumps(trained, indent=2))
    new_draft = tmp_path / "draft2"
    code, error = refused(capsys, *args("export", {**work, "draft": new_draft}, kimi_target))
    assert (code, error) == (3, f"{recorded}: stage 03's output that {work['checkpoints'] / 'manifest.json'} was "
                                f"trained with is not there (moved?); pass --vocab with its new place")
    succeeded(capsys, *args("export", {**work, "draft": new_draft}, kimi_target, "--vocab", work["vocab"]))
    assert manifest(new_draft)["complete"]


# --- 3. one writer per output ------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["prepare", "extract", "vocab", "train"])
def test_a_second_writer_is_refused_and_a_killed_holder_never_leaves_the_lock_stuck(stage, capsys, logs, work,
                                                                                    kimi_target, lock_holder):
    out = {"prepare": work["data"], "extract": work["hs"], "vocab": work["vocab"], "train": work["checkpoints"]}[stage]
    holder = lock_holder(out / ".eagle3.lock")
    before = state(work["root"])
    code, error = refused(capsys, *args(stage, work, kimi_target))
    assert (code, error) == (75, f"{out}: another process is writing it now (it holds {out / '.eagle3.lock'}); wait for "
                                 f"it to end, or stop it, then rerun")
    assert state(work["root"]) == before
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert "nothing to do" in ran(capsys, logs, *args(stage, work, kimi_target))


def test_the_export_lock_lives_beside_the_directory_it_replaces(capsys, work, kimi_target, lock_holder):
    lock = work["draft"].parent / ".draft.eagle3.lock"
    lock_holder(lock)
    code, error = refused(capsys, *args("export", work, kimi_target))
    assert code == 75 and f"(it holds {lock})" in error


def test_temp_files_of_a_live_writer_are_kept_and_removed_once_it_is_gone(capsys, logs, work, kimi_target, lock_holder):
    """Before: a second 02 run deleted the first's in-flight temp file (which then crashed)."""
    (work["hs"] / "hs_3.safetensors").unlink()
    (work["hs"] / "manifest.json").write_text(json.dumps({**manifest(work["hs"]), "complete": False}))
    in_flight = work["hs"] / ".hs_3.safetensors.tmp-999999"
    in_flight.write_bytes(b"being written")
    holder = lock_holder(work["hs"] / ".eagle3.lock")
    code, _ = refused(capsys, *args("extract", work, kimi_target))
    assert code == 75 and in_flight.read_bytes() == b"being written"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out = ran(capsys, logs, *args("extract", work, kimi_target))
    assert "extracting 1 row(s)" in out and not in_flight.exists() and manifest(work["hs"])["complete"]


def test_ranks_of_one_extraction_share_the_directory_but_not_a_rank(capsys, logs, work, kimi_target, lock_holder):
    lock_holder(work["hs"] / ".eagle3.rank1-of-2.lock")
    code, error = refused(capsys, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "1"))
    assert code == 75 and ".eagle3.rank1-of-2.lock" in error
    assert "nothing to do" in ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))


def test_a_rank_started_with_another_world_size_is_refused_while_that_one_runs(capsys, logs, work, kimi_target,
                                                                              lock_holder):
    """Before: ranks of --world-size 2 and 3 in one folder split the rows two ways (some extracted twice, some never),
    and both exited 0 with no manifest. A lock file of a rank that has ended is no objection."""
    other = lock_holder(work["hs"] / ".eagle3.rank1-of-3.lock")
    code, error = refused(capsys, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))
    assert (code, error) == (2, f"{work['hs'] / '.eagle3.rank1-of-3.lock'}: a rank started with --world-size 3 is "
                                f"extracting into {work['hs']} now; every rank needs the same --world-size (this one: 2)")
    other.kill()
    other.wait()
    assert "nothing to do" in ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))


def test_a_rank_started_with_another_max_samples_is_refused_while_that_one_runs(capsys, logs, work, kimi_target,
                                                                               lock_holder):
    """Issue 64: ranks of one --world-size with --max-samples 5 and none split different row lists (some rows twice,
    some never) and both went on. Each live rank records what its share depends on beside its lock; a rank that has
    ended is no objection."""
    record = work["hs"] / ".eagle3.rank1-of-2.json"
    other = lock_holder(work["hs"] / ".eagle3.rank1-of-2.lock")
    record.write_text(json.dumps({"--max-samples": 5, "--rows": None}))
    before = sorted(p.name for p in work["hs"].iterdir() if not p.name.startswith("."))
    code, error = refused(capsys, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))
    assert (code, error) == (2, f"{record}: rank 1 of 2 is extracting into {work['hs']} now with --max-samples 5, this "
                                f"rank with null; every rank needs the same --max-samples (each splits the same rows), "
                                f"so rerun this rank with that value")
    assert sorted(p.name for p in work["hs"].iterdir() if not p.name.startswith(".")) == before
    assert json.loads((work["hs"] / ".eagle3.rank0-of-2.json").read_text()) == {"--max-samples": None, "--rows": None}
    other.kill()
    other.wait()
    assert "nothing to do" in ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))


def test_the_manifest_of_several_ranks_says_whose_counts_it_holds(capsys, logs, work, kimi_target):
    """Issue 64: with --world-size 2 the rank that finishes last writes the manifest, and its counts (rows_this_rank,
    skipped_done, timings) were its own while rows and tokens are every rank's, with nothing saying so."""
    hs = work["hs"]
    (hs / "manifest.json").write_text(json.dumps({**manifest(hs), "complete": False}))  # rank 1 ended; rank 0 now
    ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))
    counts = manifest(hs)["counts"]
    assert manifest(hs)["complete"] and counts["rows"] == 15 and counts["rows_this_rank"] == 8, counts
    assert counts["counts_of"] == "rank 0 of 2 (rows and tokens: every rank's)", counts
    (hs / "manifest.json").write_text(json.dumps({**manifest(hs), "complete": False}))
    ran(capsys, logs, *args("extract", work, kimi_target))  # one rank: every count is the run's, nothing to say
    assert "counts_of" not in manifest(hs)["counts"] and manifest(hs)["counts"]["rows_this_rank"] == 15


def test_02_deletes_row_files_past_01s_rows_only_where_its_record_lists_them(capsys, logs, work, kimi_target):
    """Issue 64: 02 deleted every hs_N.safetensors with N at or past stage 01's rows, by its name alone. Now only
    those a record of 02 lists (fingerprints.json, its slice records); another is kept, and the log says so."""
    hs = work["hs"]
    for name in ("hs_98.safetensors", "hs_99.safetensors"):
        shutil.copy2(hs / "hs_0.safetensors", hs / name)
    record = json.loads((hs / "fingerprints.json").read_text())
    (hs / "fingerprints.json").write_text(json.dumps({**record, "hs_98.safetensors": record["hs_0.safetensors"]}))
    (hs / "manifest.json").write_text(json.dumps({**manifest(hs), "complete": False}))
    out = ran(capsys, logs, *args("extract", work, kimi_target))
    assert not (hs / "hs_98.safetensors").exists() and (hs / "hs_99.safetensors").is_file(), out
    assert f"kept 1 file(s) past stage 01's 15 rows that no record of this stage lists ({hs / 'hs_99.safetensors'})" in out
    assert manifest(hs)["complete"]


def test_a_rank_removes_the_shared_files_temps_of_this_hosts_killed_ranks_only(capsys, logs, work, kimi_target):
    """Before: a rank removed only its own rows' temps, so a killed rank's `.manifest.json.tmp-PID@HOST` stayed for
    good (a finished rerun says "nothing to do" and cleans nothing). Another host's temps and a live writer's stay."""
    from eagle3_pipeline.files import writer_host

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, live = f"{gone.pid}@{writer_host()}", f"{os.getpid()}@{writer_host()}"
    names = {f".manifest.json.tmp-{dead}": False, f".fingerprints.json.tmp-{dead}": False,
             f".manifest.json.tmp-{gone.pid}@another-node": True, f".manifest.json.tmp-{live}": True}
    for name in names:
        (work["hs"] / name).write_text("half")
    assert "nothing to do" in ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "1"))
    assert {name: (work["hs"] / name).exists() for name in names} == names


def test_two_ranks_into_one_folder_the_last_writes_the_manifest_from_a_listing_that_lags(capsys, logs, work,
                                                                                        kimi_target, kimi_run,
                                                                                        monkeypatch, tmp_path):
    """`02 --world-size 2 --rank R` on two nodes, one --data. Node 0's filesystem client may list node 1's newest
    files only up to a minute late (NFS's cached listing): here rank 1 finishes first, and its files reach rank 0's
    listing 5 s after rank 0's own rows are in. Before, rank 0 looked once, saw rows missing, left the manifest to a
    rank still running, and none was: no manifest. Now it looks again; the files are those of a one-rank run."""
    hs = work["hs"]
    shutil.rmtree(hs)
    monkeypatch.setattr(extract_run, "LISTING_GRACE_S", 0.0)
    assert "rank 1/2 done" in ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "1"))
    assert not manifest(hs)["complete"]
    rank1 = sorted(hs.glob("hs_*.safetensors"))
    late = tmp_path / "not-listed-yet"
    late.mkdir()
    for path in rank1:
        path.rename(late / path.name)
    expected = sorted(p.name for p in (kimi_run["data"] / "hidden_states").glob("hs_*.safetensors"))
    rank0 = [name for name in expected if name not in {p.name for p in rank1}]

    def list_rank1_once_rank0_landed():
        while not all((hs / name).is_file() for name in rank0):
            time.sleep(0.05)
        time.sleep(5)  # the listing's lag (NFS: up to a minute)
        for path in late.iterdir():
            path.rename(hs / path.name)

    monkeypatch.setattr(extract_run, "LISTING_GRACE_S", 120.0)
    monkeypatch.setattr(extract_run, "LISTING_POLL_S", 0.1)
    lister = threading.Thread(target=list_rank1_once_rank0_landed, daemon=True)
    lister.start()
    out = ran(capsys, logs, *args("extract", work, kimi_target, "--world-size", "2", "--rank", "0"))
    lister.join(5)
    assert "rank 0/2 done" not in out and manifest(hs)["complete"] and manifest(hs)["counts"]["rows"] == len(expected)
    assert sorted(p.name for p in hs.glob("hs_*.safetensors")) == expected
    for name in expected:  # the HF extraction is batch-invariant: what one rank would have written
        assert (hs / name).read_bytes() == (kimi_run["data"] / "hidden_states" / name).read_bytes(), name


@pytest.mark.slow
def test_two_real_extractions_into_one_directory_the_second_is_refused_and_the_first_kept(work, kimi_target, tmp_path):
    """Before: both extracted every row, and the second deleted the first's in-flight temp file.
    The first is paused by the crash tests' fault injection with rows 0-4 landed and hs_5's temp
    written; the second, started then, is refused; after a kill -9 of the first, a rerun finishes."""
    from test_reliability_crash import Stage

    from conftest import SCRIPTS, STAGE_SCRIPTS

    for path in work["hs"].glob("hs_*.safetensors"):
        path.unlink()
    (work["hs"] / "manifest.json").unlink()
    (tmp_path / "fault").mkdir()
    from test_reliability_crash import FAULT_SITECUSTOMIZE

    (tmp_path / "fault" / "sitecustomize.py").write_text(FAULT_SITECUSTOMIZE)
    argv = [str(SCRIPTS / STAGE_SCRIPTS["extract"]), *map(str, args("extract", work, kimi_target)[1:])]
    first = Stage(argv, tmp_path / "first.log", fault="replace:*/hidden_states/hs_5.safetensors", fault_dir=tmp_path / "fault")
    in_flight = first.paused_at()
    second = Stage(argv, tmp_path / "second.log")
    assert second.finish() == 75
    assert f"error: {work['hs']}: another process is writing it now" in second.output()
    assert in_flight.exists() and sorted(p.name for p in work["hs"].glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(5)]
    first.kill()
    rerun = Stage(argv, tmp_path / "rerun.log")
    assert rerun.finish() == 0, rerun.output()[-3000:]
    assert "(5 already done)" in rerun.output() and not in_flight.exists() and manifest(work["hs"])["complete"]


# --- 4. resume tells the truth -------------------------------------------------------------------------

def test_resume_refuses_what_it_cannot_change_and_the_manifest_records_what_ran(capsys, work, kimi_target):
    """Before: `--lr 1e-5 --epochs 3` on a finished run resumed the old scheduler while the manifest said lr 1e-05."""
    ckpt = work["checkpoints"]
    before = state(work["root"])
    code, error = refused(capsys, *args("train", work, kimi_target, "--lr", "1e-5", "--epochs", "3"))
    assert code == 3 and error.startswith(f"{ckpt / 'manifest.json'}: {ckpt} holds a finished result made with "
                                          f"settings.epochs = 2 there, 3 in this run; a resume restores the old "
                                          f"optimizer and lr schedule")
    # An unfinished run (killed mid-training) is refused the same way: its checkpoints hold the old schedule.
    (ckpt / "manifest.json").write_text(json.dumps({**manifest(ckpt), "complete": False}))
    before = state(work["root"])
    code, error = refused(capsys, *args("train", work, kimi_target, "--lr", "1e-5"))
    assert code == 3 and "holds an unfinished run made with settings.lr = 0.001 there, 1e-05 in this run" in error
    assert state(work["root"]) == before
    recorded = json.loads((work["checkpoints"] / "manifest.json").read_text())
    assert recorded["identity"]["settings"]["lr"] == recorded["config"]["lr"] == 0.001


# --- 5. hidden states: partial extractions are not complete ----------------------------------------------

def test_a_partial_extraction_is_not_complete_and_the_rerun_adds_only_the_rest(capsys, logs, work, kimi_target):
    rows = manifest(work["data"])["counts"]["rows"]
    shutil.rmtree(work["hs"])
    out = ran(capsys, logs, *args("extract", work, kimi_target, "--max-samples", "3"))
    assert f"3 of stage 01's {rows} rows extracted (--max-samples 3)" in out
    assert manifest(work["hs"])["complete"] is False
    code, error = refused(capsys, *args("train", work, kimi_target))
    assert (code, error) == (3, f"{work['hs'] / 'manifest.json'}: stage 'extract' did not finish; "
                                f"rerun 02_extract_hidden_states.py")
    out = ran(capsys, logs, *args("extract", work, kimi_target))
    assert f"extracting {rows - 3} row(s) (3 already done)" in out and manifest(work["hs"])["complete"]


# --- 6. resource errors ---------------------------------------------------------------------------------

def test_a_gpu_profile_without_a_visible_gpu_is_refused_before_any_rank_starts(capsys, work, kimi_target, monkeypatch):
    import eagle3_pipeline.preflight as preflight

    monkeypatch.setattr(preflight, "probe_gpus", lambda: [])  # this machine, said out loud
    argv = args("train", {**work, "checkpoints": work["root"] / "new"}, kimi_target)
    argv[argv.index("cpu-mini")] = "h200-8x"
    code, error = refused(capsys, *argv)
    assert (code, error) == (5, "gpus: none visible, --nproc 8 (profile:h200-8x) needs 8: refusing (a GPU profile on a "
                                "machine without a visible GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES, or pass "
                                "--nproc 1 to train on the CPU)")
    assert [p.name for p in (work["root"] / "new").iterdir()] == [".eagle3.lock"]  # only the lock it held


def test_resume_preflight_asks_disk_only_for_the_epochs_left(capsys, caplog, work, kimi_target, monkeypatch):
    import logging


    caplog.set_level(logging.INFO, logger="eagle3")
    ckpt = work["checkpoints"]
    (ckpt / "manifest.json").write_text(json.dumps({**manifest(ckpt), "complete": False}))  # killed after epoch 1
    succeeded(capsys, *args("train", work, kimi_target, "--check"))
    assert "preflight disk: ~" in caplog.text and "1 checkpoint(s) x " in caplog.text
    assert "(2 of 2 epochs already saved)" in caplog.text


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int):
    """A real filesystem of `size_bytes` mounted at `path` (tmpfs; needs root): real ENOSPC from the kernel."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()[:100]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def disk_fills_after_preflight(monkeypatch):
    """The preflight saw room (another job filled the disk after it); the writes meet the real full disk."""
    import eagle3_pipeline.machine as machine
    import eagle3_pipeline.preflight as preflight

    monkeypatch.setattr(preflight, "disk_free", lambda path: 10**15)  # what the checks ask
    monkeypatch.setattr(machine, "disk_free", lambda path: 10**15)  # what files.py asks

def fill_disk(filler: Path) -> None:
    """Take every free block of the filesystem `filler` is on (another job's file)."""
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 4096)



def test_disk_full_while_writing_hidden_states_is_one_line_with_the_numbers(capsys, work, kimi_target, tmp_path,
                                                                            monkeypatch):
    """Before: a raw `SafetensorError` traceback."""
    disk_fills_after_preflight(monkeypatch)
    kept = tmp_path / "kept-states"
    shutil.move(work["hs"], kept)
    for index in (3, 4):
        (kept / f"hs_{index}.safetensors").unlink()
    (kept / "manifest.json").write_text(json.dumps({**manifest(kept), "complete": False}))
    used = sum(p.stat().st_size for p in kept.iterdir())
    with small_disk(work["hs"], used + 64 * 1024):  # room for what is there and a manifest, not a row
        for item in kept.iterdir():
            shutil.copy2(item, work["hs"] / item.name)
        code, error = refused(capsys, *args("extract", work, kimi_target))
        left = [p.name for p in work["hs"].iterdir() if ".tmp-" in p.name]
    assert code == 1 and error.startswith(f"{work['hs'] / 'hs_3.safetensors'}: disk full (") and " B free at " in error
    assert "; the 2 row(s) left need ~" in error and error.endswith("; free space, then rerun (finished files are kept)")
    assert left == []


@pytest.mark.slow
def test_disk_full_while_saving_a_checkpoint_is_one_line_with_the_numbers(capsys, work, kimi_target, monkeypatch):
    """Before: `RuntimeError: [enforce fail at inline_container.cc] unexpected pos` and a traceback."""
    disk_fills_after_preflight(monkeypatch)
    out = work["root"] / "fresh-checkpoints"
    with small_disk(out, 2 * 1024 * 1024):  # less than one checkpoint (draft + AdamW state)
        code, error = refused(capsys, *args("train", {**work, "checkpoints": out}, kimi_target, "--epochs", "1"))
    assert code == 1 and error.startswith(f"{out}/") and ": disk full while speculators saved a checkpoint (" in error
    assert " B free at " in error and "; one checkpoint needs ~" in error and error.endswith(
        "; free space, then rerun (training resumes from the last complete checkpoint)")


def test_disk_full_while_writing_the_prepared_dataset_is_one_line(capsys, work, kimi_target, tmp_path, monkeypatch):
    """Issue 46, H: stage 01 ended in an ENOSPC traceback from the dataset writer; 02, 03, 05, 06 give one line."""
    disk_fills_after_preflight(monkeypatch)
    out = tmp_path / "data"
    with small_disk(out, 16 * 1024):  # less than the dataset (~40 KB)
        code, error = refused(capsys, *args("prepare", {**work, "data": out}, kimi_target))
        left = sorted(p.name for p in out.iterdir())
        unfinished = not manifest(out)["complete"]
    assert code == 1 and error.startswith(f"{out}: disk full (") and " B free at " in error, error
    assert "; the prepared dataset needs ~" in error and error.endswith("; free space, then rerun"), error
    assert left == [".eagle3.lock", "manifest.json"] and unfinished  # the staging folder's space given back


def test_stage_01s_disk_estimates_cover_what_it_writes(work, kimi_target, monkeypatch):
    """Issue 46, H: the preflight promised 21.5 KB (4 x the 5.4 KB input) for the 41 KB stage 01 writes."""
    import eagle3_pipeline.preflight as preflight
    from eagle3_pipeline.errors import PreflightError
    from eagle3_pipeline.target import load_target_info

    written = sum(p.stat().st_size for p in work["data"].iterdir() if p.is_file())  # manifest included
    monkeypatch.setattr(preflight, "disk_free", lambda path: written - 1)  # a byte short of what 01 wrote
    with pytest.raises(PreflightError, match="the prepared dataset"):
        preflight.preflight_prepare(str(SAMPLES / "conversations.jsonl"), None, 4096, load_target_info(kimi_target),
                                    work["data"])
    from eagle3_pipeline.sizing import prepared_bytes  # the figure 01's disk-full line gives, once it has tokenized

    counts = manifest(work["data"])["counts"]
    assert written <= prepared_bytes(counts["rows"], counts["tokens"]) <= 2 * written


def test_disk_full_while_appending_training_metrics_is_one_line(capsys, work, kimi_target, tmp_path, monkeypatch):
    """Issue 46, H: the disk filled (another job) after stage 04 wrote its manifest and command: its first metrics
    record ended in an ENOSPC traceback."""
    disk_fills_after_preflight(monkeypatch)
    from eagle3_pipeline import train_run

    stage = stage_module("train")
    out = tmp_path / "ckpt"
    settings = train_run.export_compat_settings

    def then_the_disk_fills(*a, **k):  # right before training: every later write meets a full disk
        settings(*a, **k)
        fill_disk(out / "filler")

    monkeypatch.setattr(train_run, "export_compat_settings", then_the_disk_fills)
    with small_disk(out, 1024 * 1024):
        capsys.readouterr()
        code = stage.main([str(a) for a in args("train", {**work, "checkpoints": out}, kimi_target, "--epochs", "1")[1:]])
        err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    error = errors[0].removeprefix("error: ")
    assert error.startswith(f"{out / 'metrics.jsonl'}: disk full while appending a record to the training metrics "
                            f"log (") and " B free at " in error, error
    assert error.endswith("; free space, then rerun (training resumes from the last complete checkpoint)"), error



@pytest.mark.parametrize("workers", [0, 1])
def test_disk_full_while_recording_a_left_out_sample_names_bad_samples_jsonl(workers, capsys, work, kimi_target,
                                                                              monkeypatch):
    """Before: `<newest file>: disk full while speculators saved a checkpoint (...; one checkpoint needs ~N B)`, though
    the write that met the full disk was the loader's bad-sample record (--on-bad-sample skip), appended in a
    DataLoader worker process (workers=1) or in the trainer's (workers=0). A resumed run: checkpoint 0 is kept."""
    import eagle3_pipeline.compat.sample_check as checks

    disk_fills_after_preflight(monkeypatch)
    for hs_file in work["hs"].glob("hs_*.safetensors"):  # every sample bad: the first one read is recorded
        hs_file.write_bytes(b"garbage")
    recorded_by_02(work["hs"])  # as 02's own bytes: else refused before training (changed since 02 wrote them)
    out = work["root"] / "small-disk-checkpoints"
    on_device = checks.check_values_on_device

    def then_the_disk_fills(*a, **k):  # the loaders exist, none has read a sample: the next new block is refused
        result = on_device(*a, **k)
        fill_disk(out / "filler")
        return result

    monkeypatch.setattr(checks, "check_values_on_device", then_the_disk_fills)
    used = sum(p.stat().st_size for p in work["checkpoints"].rglob("*") if p.is_file() and not p.is_symlink())
    with small_disk(out, used + 1024 * 1024):
        for item in work["checkpoints"].iterdir():  # killed while it saved epoch 1: resumes from checkpoint 0
            if item.is_dir() and not item.is_symlink() and item.name != "1":
                shutil.copytree(item, out / item.name, symlinks=True)
            elif item.name != "1":
                shutil.copy2(item, out / item.name, follow_symlinks=False)
        (out / "manifest.json").write_text(json.dumps({**manifest(out), "complete": False}))
        kept = {name: digest for name, digest in snapshot(out).items() if name.startswith("0/")}
        metrics_before = (out / "metrics.jsonl").read_text()
        code, error = refused(capsys, *args("train", {**work, "checkpoints": out}, kimi_target, "--on-bad-sample",
                                            "skip", "--max-bad-fraction", "1", "--num-workers", workers))
        after = snapshot(out)
        metrics_after = (out / "metrics.jsonl").read_text()
        record = (out / "bad_samples.jsonl").read_bytes() if (out / "bad_samples.jsonl").exists() else b""
    head = f"{out / 'bad_samples.jsonl'}: disk full while the loader recorded bad sample {work['hs']}/hs_"
    assert code == 1 and error.startswith(head) and "unreadable safetensors (" in error, error
    assert "checkpoint needs" not in error and " B free at " in error, error
    assert error.endswith("; free space, then rerun (training resumes from the last complete checkpoint)"), error
    assert kept and {name: after.get(name) for name in kept} == kept  # checkpoint 0, byte for byte
    assert metrics_after.startswith(metrics_before) and all(json.loads(line) for line in metrics_after.splitlines())
    assert record == b""  # no half line for the rerun's record to be glued to


# --- 7. draft_config.json is a typed schema -----------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    ({"num_layers": -1}, "num_layers: Input should be greater than or equal to 1 (got -1)"),
    ({"ttt_steps": 0}, "ttt_steps: Input should be greater than or equal to 1 (got 0)"),
    ({"num_layers": "2"}, "num_layers: Input should be a valid integer (got \"2\")"),
    ({"draft_vocab_size": 1.5}, "draft_vocab_size: Input should be a valid integer (got 1.5)"),
    ({"norm_before_residual": "yes"}, "norm_before_residual: Input should be a valid boolean (got \"yes\")"),
    ({"full_attention_indices": [1]}, "full_attention_indices: Value error, [1] are not layer indices of a "
                                      "1-layer draft (got [1])"),
    ({"draft_arch": "gpt2"}, "draft_arch: Input should be 'llama' or 'qwen3' (got \"gpt2\")"),
    ({"fc_norm": 1}, "fc_norm: Input should be a valid boolean (got 1)"),
    ({"norm_before_fc": True}, "fc_norm and norm_before_fc are both true: choose one norm before the fc projection "
                               "(fc_norm: one per aux hidden state, the default; norm_before_fc: one over their "
                               "concatenation)"),
])
def test_bad_draft_config_values_are_refused_with_the_key_named(change, message, capsys, work, kimi_target, tmp_path):
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG

    path = tmp_path / "draft_config.json"
    path.write_text(json.dumps({**json.loads(DEFAULT_DRAFT_CONFIG.read_text()), **change}))
    code, error = refused(capsys, *args("train", work, kimi_target, "--draft-config", path))
    assert (code, error) == (2, f"{path}: {message}")


def test_the_draft_config_defaults_live_in_one_place(tmp_path):
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG, DraftConfig, load_draft_config

    minimal = tmp_path / "draft.json"
    minimal.write_text("{}")
    assert load_draft_config(minimal) == DraftConfig()
    shipped = load_draft_config(DEFAULT_DRAFT_CONFIG)
    assert shipped.model_dump(exclude={"description"}) == DraftConfig().model_dump(exclude={"description"})


# --- the flaky test's cause: extraction does not depend on batching or threads -------------------------------

def test_hf_extraction_is_the_same_bytes_however_rows_are_batched_and_whatever_the_thread_count(kimi_run, kimi_target):
    """tests/test_reliability_crash.py redoes 2 rows and compares bytes with a run that did all rows.
    Each row is its own forward, and CPU forwards use one thread: without that, 1, 2 and 3 threads gave
    different fp32 states (up to 2e-7) for 5 of the miniature's 12 rows."""
    import torch
    from safetensors.torch import load_file

    from eagle3_pipeline.extract.hf import HfBackend
    from eagle3_pipeline.prepared import load_rows
    from eagle3_pipeline.target import extraction_layer_ids, load_target_info

    target = load_target_info(str(kimi_target))
    backend = HfBackend(target, extraction_layer_ids(target.num_layers, None), torch.float32, "cpu")
    rows = load_rows(kimi_run["data"])
    threads = torch.get_num_threads()
    try:
        for num_threads, order in ((1, [5, 0]), (3, [0, 5, 9]), (2, list(reversed(range(len(rows)))))):
            torch.set_num_threads(num_threads)
            for sample in backend.extract([(i, rows[i]) for i in order]):
                saved = load_file(str(kimi_run["data"] / "hidden_states" / f"hs_{sample.index}.safetensors"))
                assert torch.equal(sample.hidden_states, saved["hidden_states"]), (num_threads, sample.index)
    finally:
        torch.set_num_threads(threads)
        backend.close()
