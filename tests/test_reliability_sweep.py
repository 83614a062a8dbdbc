"""A sweep over copies of a finished run with one thing changed at a time (issue 40): a stage or run_all.sh is
refused in one line naming the file and field, or redoes what changed, or is an honest no-op; never "finished"
for a run that did nothing needed, never a traceback, and never a deletion or rewrite outside what it redoes.

Each case is (a change to a fresh copy of the session's finished Kimi-miniature run (conftest.kimi_run: five
stages, 2 epochs, unsliced), the command, the outcome classes it may have). The outcome is read from the run itself:
`refused`: non-zero exit, exactly one error line (a stage's `error: ...`, run_all's one stderr line) and no file
changed; `redone`: exit 0 and files changed, all of them under the case's `redoes` (the outputs it remakes);
`no-op`: exit 0 and no file changed but logs and locks. Every copy lives elsewhere than where the run was made,
so every case is also a moved work directory. Single stages run as scripts (a user's command, seconds each);
run_all.sh only where the case is about it.

Then (issue 46) every file stages 01-05 wrote, deleted or cut short one at a time, each stage run in this process:
redone within its own outputs or refused in one line, never "nothing to do", and --status never "finished" over it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from test_reliability_copies import ENV, RUN_ALL, copy_run, run_all

from eagle3_pipeline.checkpoints import is_record

from conftest import SAMPLES, run_stage

pytestmark = pytest.mark.reliability

HS = "data/hidden_states"
ONE_STATE = f"{HS}/hs_3.safetensors"  # one training row's hidden states
# what stage 01 writes in data/ (not hidden_states/ beside it: 02's)
PREPARED = tuple(f"data/{name}" for name in ("data-00000-of-00001.arrow", "dataset_info.json", "state.json",
                                             "token_freq.pt", "manifest.json"))


# --- the run and what it did ------------------------------------------------------------------------------

def stage_args(stage: str, work: Path, target: Path) -> list:
    """The stage's flags as run_all.sh passes them for this WORK."""
    return {
        "prepare": ["--target", target, "--data", SAMPLES / "conversations.jsonl", "--output", work / "data"],
        "extract": ["--target", target, "--data", work / "data"],
        "vocab": ["--data", work / "data", "--output", work / "vocab"],
        "train": ["--target", target, "--data", work / "data", "--vocab", work / "vocab", "--output",
                  work / "checkpoints", "--logger", ""],
        "export": ["--checkpoints", work / "checkpoints", "--vocab", work / "vocab", "--output", work / "draft"],
    }[stage]


def status(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_ALL), "--status", "--work", str(work), "--python", sys.executable],
                          capture_output=True, text=True, env=ENV, timeout=120)


def tree(root: Path) -> dict[str, tuple]:
    """Every path under root: files by (size, mtime, inode), links by target, folders by being there."""
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = ("->", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir",)
        else:
            info = path.stat()
            out[rel] = (info.st_size, info.st_mtime_ns, info.st_ino)
    return out


def bookkeeping(rel: str) -> bool:
    """run_all's logs and the stages' lock files: written by every run, refused ones too."""
    return rel == "logs" or rel.startswith("logs/") or rel.rsplit("/", 1)[-1].endswith(".lock")


def under(rel: str, roots: tuple[str, ...]) -> bool:
    return any(rel == root or rel.startswith(root + "/") for root in roots)


def error_lines(result: subprocess.CompletedProcess, command: str) -> list[str]:
    """The refusal: run_all's whole stderr (one line), a stage's `error: ` lines (its log lines share stderr)."""
    if command == "run_all":
        return result.stderr.strip().splitlines()
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


# --- the changes ----------------------------------------------------------------------------------------------

def delete(rel: str) -> Callable[[Path, Path], None]:
    def change(work: Path, made: Path) -> None:
        target = work / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return change


def truncate(rel: str, size: int = 100) -> Callable[[Path, Path], None]:
    def change(work: Path, made: Path) -> None:
        os.truncate(work / rel, size)
    return change


def one_finite_value(rel: str) -> Callable[[Path, Path], None]:
    """One float32 value of a hidden-state file changed in place to -4.6e37 (finite: every value check passes), in
    bytes its fingerprint does not sample (issue 64 M: 02 re-validated such a file, kept it and recorded it)."""
    def change(work: Path, made: Path) -> None:
        import struct

        from test_reliability_trust_bytes import _finite_value_offset

        with open(work / rel, "r+b") as handle:
            handle.seek(_finite_value_offset(work / rel))
            handle.write(struct.pack("<f", -4.6e37))
    return change


def delete_logs(work: Path, made: Path) -> None:
    (work / "logs").mkdir()
    (work / "logs" / "04_train.log").write_text("an earlier attempt\n")
    shutil.rmtree(work / "logs")


def made_elsewhere_and_gone(work: Path, made: Path) -> None:
    """The run moved from where it was made, which is gone: every manifest's recorded paths point into nothing."""
    for path in work.rglob("manifest.json"):
        path.write_text(path.read_text().replace(str(made), str(work.parent / "moved-away")))


def rebuild_vocab_with_128_tokens(work: Path, made: Path) -> None:
    """Stage 03 redone with another --draft-vocab-size (and --overwrite): the vocab 04 trained with is gone."""
    run_stage("vocab", "--profile", "cpu-mini", *stage_args("vocab", work, Path()), "--draft-vocab-size", "128",
              "--overwrite")


# --- the cases' own evidence ------------------------------------------------------------------------------------

def same_state_file_again(result, work: Path, made: Path) -> None:
    """02 wrote that row again, the same bytes; its manifest's content is unchanged, so 03-05 stay finished."""
    assert (work / ONE_STATE).read_bytes() == (made / ONE_STATE).read_bytes()
    content = [json.loads((root / HS / "manifest.json").read_text())["content_sha256"] for root in (work, made)]
    assert content[0] == content[1]


def exported_again_here(result, work: Path, made: Path) -> None:
    assert json.loads((work / "draft" / "manifest.json").read_text())["complete"]
    assert f'"model": "{work / "draft"}"' in result.stdout.splitlines()[-1], result.stdout[-2000:]


def serves_this_copy(result, work: Path, made: Path) -> None:
    serve = [line for line in result.stdout.splitlines() if line.startswith("vllm serve ")]
    assert serve and f'"model": "{work / "draft"}"' in serve[-1], serve
    shown = result.stdout + result.stderr
    assert str(made) not in shown and "moved-away" not in shown  # no path a copy carried is printed or read


def every_log_missing(result, work: Path, made: Path) -> None:
    lines = result.stdout.splitlines()
    assert len(lines) == 5, result.stdout
    for line, (num, name) in zip(lines, (("01", "prepare"), ("02", "extract"), ("03", "vocab"), ("04", "train"),
                                         ("05", "export"))):
        assert line.split()[:3] == [num, name, "finished"], line
        assert line.endswith(f"{work / 'logs' / f'{num}_{name}.log'} (missing)"), line


def says_the_manifest_is_unreadable(result, work: Path, made: Path) -> None:
    """Before: `04 train started, not finished`, as if a rerun would resume it (it is refused); and (issue 46 I)
    `05 export finished`, made from a training run nothing can read."""
    states = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert states["04"].split()[2:4] == ["manifest", "unreadable"], states["04"]
    assert states["03"].split()[2] == "finished"
    later_is_stale_naming_04(result, work, made, "manifest unreadable")


def later_is_stale_naming_04(result, work: Path, made: Path, state: str = "") -> None:
    """Issue 46 I: 05 said `finished` while 04's manifest was unreadable, missing or not complete."""
    states = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert states["04"].split()[2] != "finished", states["04"]
    assert states["05"].split()[2] == "stale", states["05"]
    assert f"(its input, 04 train, is {state}" in states["05"] and "; rerun 04)" in states["05"], states["05"]


def not_complete(rel: str) -> Callable[[Path, Path], None]:
    """A manifest as a killed run leaves it: the same record, `complete: false`."""
    def change(work: Path, made: Path) -> None:
        path = work / rel
        path.write_text(json.dumps({**json.loads(path.read_text()), "complete": False}))
    return change


def check_line_of_this_work(result, work: Path, made: Path) -> None:
    """Issue 46 J: 06 found the training run, data and vocab behind the draft in this WORK (run_all passed them),
    not at the paths the moved run's manifests recorded: its self-checks ran on this WORK's vocab."""
    log = (work / "logs" / "06_evaluate.log").read_text()
    assert "self-check d2t: ok" in log and str(work / "vocab" / "d2t.npy") in log, log[-3000:]
    assert "pass --checkpoints" not in log and "pass --data" not in log and "pass --vocab" not in log, log[-3000:]


def slice_rows_of_the_whole_run(work: Path) -> str:
    """2 slices x 1 epoch: no more run positions than the finished run's 2 epoch checkpoints."""
    prepared = json.loads((work / "data" / "manifest.json").read_text())
    return str(math.ceil(int(prepared["counts"]["rows"] * prepared["train_data_ratio"]) / 2))


@dataclass(frozen=True)
class Case:
    command: str  # a stage ("prepare" .. "export"), "run_all" or "status"
    flags: tuple[str, ...] = ()
    change: Callable[[Path, Path], None] | None = None  # (the copy, where the run was made)
    expect: tuple[str, ...] = ("refused",)  # the outcome classes allowed
    redoes: tuple[str, ...] = ()  # paths (from WORK) the run may rewrite or delete: what it redoes
    names: tuple[str, ...] = ()  # what a refusal's line must say ({work}: the copy)
    evidence: Callable | None = None  # (result, work, made): the case's own proof
    args_04: str = "--logger="  # run_all's --args-04


CASES = {
    # settings that shape an output
    "run_all --args-04 --epochs 3": Case(
        "run_all", ("--from", "04"), args_04="--epochs 3 --logger=",
        names=("{work}/checkpoints/manifest.json", "settings.epochs = 2 there, 3 in this run")),
    "04 --lr 5e-4": Case(
        "train", ("--lr", "5e-4"), names=("{work}/checkpoints/manifest.json", "settings.lr = 0.001 there, 0.0005")),
    "01 --val-ratio 0.3": Case(
        "prepare", ("--val-ratio", "0.3"), names=("{work}/data/manifest.json", "settings.val_ratio = 0.1 there, 0.3")),
    "02 --dtype bfloat16": Case(
        "extract", ("--dtype", "bfloat16"),
        names=(f"{{work}}/{HS}/manifest.json", 'settings.dtype = "float32" there, "bfloat16" in this run')),
    "03 --draft-vocab-size 128": Case(
        "vocab", ("--draft-vocab-size", "128"),
        names=("{work}/vocab/manifest.json", "settings.draft_vocab_size = 256 there, 128 in this run")),
    "05 --num-speculative-tokens 2": Case(
        "export", ("--num-speculative-tokens", "2"),
        names=("{work}/draft/manifest.json", "settings.num_speculative_tokens = 3 there, 2 in this run")),
    # an upstream output remade: downstream names it, never trains on its own old copy
    "vocab rebuilt, then 04": Case(
        "train", change=rebuild_vocab_with_128_tokens, names=("{work}/checkpoints/manifest.json", "inputs.vocab = ")),
    # slicing (before: every hidden-state file deleted, then "all five stages finished", exit 0)
    "run_all --slice-rows on the unsliced run": Case(
        "run_all", ("--slice-rows", "{slice_rows}"), args_04="--epochs 1 --logger=",
        names=("run_all.sh: sliced run refused: {work}/checkpoints/manifest.json: holds a finished unsliced training "
               "run", "fresh --work")),
    # files deleted or cut short
    "hidden-state file deleted, then 02": Case(
        "extract", change=delete(ONE_STATE), expect=("redone",), redoes=(HS,), evidence=same_state_file_again),
    "hidden-state file truncated, then 02": Case(
        "extract", change=truncate(ONE_STATE), expect=("redone",), redoes=(HS,), evidence=same_state_file_again),
    "hidden-state file, one finite value changed in place, then 02": Case(
        "extract", change=one_finite_value(ONE_STATE), expect=("redone",), redoes=(HS,),
        evidence=same_state_file_again),
    # issue 64: refused, as a changed d2t.npy or row file of 01 is, finished run or not (before: "nothing to do"; a
    # new or resumed run trained on a file with a value changed in place); 02's rerun redoes it
    "hidden-state file truncated, then 04": Case(
        "train", change=truncate(ONE_STATE),
        names=(f"{{work}}/{ONE_STATE}: changed since 02_extract_hidden_states.py wrote it", "rerun 02_extract")),
    "02's manifest truncated, then 02": Case(
        "extract", change=truncate(f"{HS}/manifest.json", 200),
        names=(f"{{work}}/{HS}/manifest.json: unreadable manifest", f"move {{work}}/{HS} away")),
    "04's manifest truncated, then 04": Case(
        "train", change=truncate("checkpoints/manifest.json", 200),
        names=("{work}/checkpoints/manifest.json: unreadable manifest", "move {work}/checkpoints away")),
    "04's manifest truncated, then 05": Case(
        "export", change=truncate("checkpoints/manifest.json", 200),
        names=("{work}/checkpoints/manifest.json: unreadable manifest",)),
    "04's manifest truncated, then --status": Case(
        "status", change=truncate("checkpoints/manifest.json", 200), expect=("no-op",),
        evidence=says_the_manifest_is_unreadable),
    "04's manifest deleted, then --status": Case(
        "status", change=delete("checkpoints/manifest.json"), expect=("no-op",),
        evidence=lambda result, work, made: later_is_stale_naming_04(result, work, made, "not started")),
    "04's manifest not complete, then --status": Case(
        "status", change=not_complete("checkpoints/manifest.json"), expect=("no-op",),
        evidence=lambda result, work, made: later_is_stale_naming_04(result, work, made, "started, not finished")),
    # issue 46 L: before, "already exported; nothing to do", with and without --overwrite
    "05's model.safetensors cut short, then 05 --overwrite": Case(
        "export", ("--overwrite",), change=truncate("draft/model.safetensors", 4096), expect=("redone",),
        redoes=("draft",), evidence=exported_again_here),
    "draft deleted, then 05": Case(
        "export", change=delete("draft"), expect=("redone",), redoes=("draft",), evidence=exported_again_here),
    "moved (recorded paths gone), then run_all": Case(
        "run_all", change=made_elsewhere_and_gone, expect=("no-op",), evidence=serves_this_copy),
    # issue 46 J: before, refused naming --checkpoints (then --data, then --vocab: flags only --args-06 could pass).
    # 06 --check then stops where this box stops it: vLLM's CPU build cannot serve EAGLE-3 on an MLA target.
    "moved (recorded paths gone), then run_all --eval": Case(
        "run_all", ("--from", "06", "--eval", "--args-06", "--check"), change=made_elsewhere_and_gone,
        names=("06 evaluate failed (exit 5)", "MLA"), evidence=check_line_of_this_work),
    "logs/ deleted, then --status": Case("status", change=delete_logs, expect=("no-op",), evidence=every_log_missing),
    # A file a finished stage wrote, gone: the stage redoes it (stage.finished's `outputs`), never "nothing to do"
    "01's dataset file deleted, then 01": Case(
        "prepare", change=delete("data/data-00000-of-00001.arrow"), expect=("redone",),
        redoes=PREPARED, names=("data-00000-of-00001.arrow",)),
    "03's d2t.npy deleted, then 03": Case(
        "vocab", change=delete("vocab/d2t.npy"), expect=("redone",), redoes=("vocab",),
        names=("d2t.npy",)),
    "05's model.safetensors deleted, then 05": Case(
        "export", change=delete("draft/model.safetensors"), expect=("redone",), redoes=("draft",),
        names=("model.safetensors",)),
}


def run(case: Case, work: Path, target: Path) -> subprocess.CompletedProcess:
    if case.command == "status":
        return status(work)
    if case.command == "run_all":
        flags = [flag.format(slice_rows=slice_rows_of_the_whole_run(work)) for flag in case.flags]
        return run_all(work, target, *flags, args_04=case.args_04)
    return run_stage(case.command, "--profile", "cpu-mini", *stage_args(case.command, work, target), *case.flags,
                     check=False)


@pytest.mark.parametrize("name", [
    name for name in CASES])
def test_a_copy_changed_one_way_is_refused_or_redone_never_finished_for_nothing(name, kimi_run, kimi_target,
                                                                                 tmp_path):
    case, made = CASES[name], kimi_run["data"].parent
    work = copy_run(kimi_run, tmp_path / "work")
    if case.change:
        case.change(work, made)
    before = tree(work)
    result = run(case, work, kimi_target)
    after = tree(work)
    shown = result.stdout + result.stderr
    context = f"{name}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    assert "Traceback" not in shown, context
    deleted = sorted(before.keys() - after.keys())
    assert all(under(rel, case.redoes) for rel in deleted), f"deleted outside {case.redoes}: {deleted}\n{context}"
    changed = sorted(rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel)
                     and not bookkeeping(rel))
    assert all(under(rel, case.redoes) for rel in changed), f"changed outside {case.redoes}: {changed}\n{context}"

    errors = error_lines(result, case.command)
    if result.returncode != 0:
        assert len(errors) == 1, f"a refusal is one line: {errors}\n{context}"
        observed = "refused"
    else:
        observed = "redone" if changed else "no-op"
    assert observed in case.expect, f"{observed}, expected {' or '.join(case.expect)}\n{context}"

    single_stage = case.command not in ("run_all", "status")
    if observed == "refused":
        for part in case.names:
            assert part.format(work=work) in errors[0], f"{part!r} not in {errors[0]!r}"
        assert not changed, changed  # a refused run writes nothing but its log and lock
        # nothing claims the run is done: no "finished", no draft to serve (run_all's earlier no-op stages may say
        # "nothing to do" for themselves; a refused stage may not)
        assert "all five stages finished" not in shown and "vllm serve" not in shown, context
        assert not single_stage or "nothing to do" not in shown, context
    elif observed == "redone":
        assert "nothing to do" not in shown, context  # the stage that redid its output says what it did
    elif single_stage:
        assert "nothing to do" in shown, context  # a no-op says so
    elif case.command == "run_all":
        assert shown.count("nothing to do") == 5 and "all five stages finished" in result.stdout, context
    if case.evidence:
        case.evidence(result, work, made)


# --- every stage's own outputs, cut short or deleted one at a time (issue 46) -----------------------------------
# Each file a stage wrote (not its manifest: the cases above cut those short), on a fresh copy, then that stage run
# in this process (its real main(); a second a case, not a Python start-up) and --status read before and after.
# `redone`: the stage remakes its own outputs (and only those), and after it every stage is finished again, its
# content unchanged for the stages made from it; `refused`: one line naming the file, nothing changed. Never
# "nothing to do", and --status never says "finished" for that stage while the file is damaged (before the fix:
# 05 "already exported; nothing to do" over a model.safetensors cut short, --status "finished").
# Not swept: speculators' links (checkpoint_best, epochN_end: pointers, none of them read; 05 exports the checkpoint
# 04's manifest names), 02's row files (the cases above), 04's logs/ (records for people, not recorded by digest).
# 05's card (README.md: outside its digests by design). 04's other records for people (checkpoints.RECORDS:
# metrics.jsonl, summary.txt, command.txt, plots/) damaged: the
# run stays finished, with a warning naming the file (no stage reads them to decide or build anything).

OWN_OUTPUTS = {  # stage -> (its output folder from WORK, what a rerun may rewrite, the outcome over a damaged file)
    "prepare": ("data", PREPARED, "redone"),
    "extract": (HS, (HS,), "redone"),
    "vocab": ("vocab", ("vocab",), "redone"),
    "train": ("checkpoints", (), "refused"),  # a resume has nothing left to redo a finished run's files with
    "export": ("draft", ("draft",), "redone"),
}


def own_files(work: Path, stage: str) -> list[str]:
    folder = OWN_OUTPUTS[stage][0]
    if stage == "extract":
        return [f"{HS}/fingerprints.json"]
    # 05's model card is outside its digest record by design (06 writes its measured section, users edit it; NOTES
    # "Stage 05/06"): `05 --check` checks that it parses and names its base model (test_05_export.py)
    skip = {"data": ("hidden_states",), "checkpoints": ("logs",), "draft": ("README.md",)}.get(folder, ())
    found = [p for p in (work / folder).rglob("*") if p.is_file() and not p.is_symlink()]
    return sorted(p.relative_to(work).as_posix() for p in found
                  if p.name != "manifest.json" and not p.name.startswith(".")
                  and p.relative_to(work / folder).parts[0] not in skip)


def run_in_process(stage: str, work: Path, target: Path, capsys, caplog, args: list | None = None,
                   ) -> tuple[int, str, list[str]]:
    from loguru import logger
    from test_reliability_bad_input import stage_module

    capsys.readouterr()
    caplog.clear()
    # speculators logs through loguru, whose sink is the sys.stderr of the test that first imported it (pytest's
    # capture of that test, closed since): this test's, or its write fails with a logging traceback
    logger.remove()
    logger.add(sys.stderr, level="INFO")
    args = stage_args(stage, work, target) if args is None else args
    code = stage_module(stage).main([str(a) for a in ("--profile", "cpu-mini", *args)])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    return code, captured.out + captured.err + caplog.text, errors


@pytest.mark.parametrize("damage", ["deleted", "cut short"])
@pytest.mark.parametrize("stage", list(OWN_OUTPUTS))
def test_each_file_a_stage_wrote_damaged_is_redone_or_refused_never_finished(stage, damage, kimi_run, kimi_target,
                                                                             tmp_path, capsys, caplog):
    import logging

    from eagle3_pipeline.status import stage_states

    caplog.set_level(logging.INFO, logger="eagle3")
    folder, redoes, expected = OWN_OUTPUTS[stage]
    names = own_files(kimi_run["data"].parent, stage)
    assert names, stage
    for i, rel in enumerate(names):
        work = copy_run(kimi_run, tmp_path / f"w{i}")
        size = (work / rel).stat().st_size
        if damage == "deleted":
            (work / rel).unlink()
        else:  # a copy or a write cut short: half of it (an empty file for a 1-byte one)
            os.truncate(work / rel, size // 2)
        context = f"{stage}, {rel} {damage}"
        record = stage == "train" and is_record(Path(rel).relative_to(folder).as_posix())
        state = stage_states(work)[stage]
        if not record:
            assert state["state"] != "finished" and rel.rsplit("/", 1)[-1] in state.get("why", ""), (context, state)
        before = tree(work)
        code, shown, errors = run_in_process(stage, work, kimi_target, capsys, caplog)
        after = tree(work)
        changed = sorted(r for r in before.keys() | after.keys() if before.get(r) != after.get(r) and not bookkeeping(r))
        context += f": exit {code}, changed {changed}\n{shown[-3000:]}"
        if record:  # issue 64: 04's records for people (a cut metrics.jsonl) blocked the run for good; said, kept
            assert code == 0 and not changed and f"{work / rel}: " in shown and "a record for people" in shown, context
            assert state["state"] == "finished" == stage_states(work)[stage]["state"], (context, state)
            continue
        assert "Traceback" not in shown and "nothing to do" not in shown, context
        if expected == "refused":
            assert code != 0 and len(errors) == 1 and not changed, context
            # the file, or (the best checkpoint's weights gone) the checkpoint folder the manifest names as the best
            assert errors[0].startswith((f"error: {work / rel}: ", f"error: {(work / rel).parent}: the best ")), context
            assert stage_states(work)[stage]["state"] != "finished", context
            continue
        assert code == 0 and errors == [] and rel in changed, context  # the file is back
        assert all(under(r, redoes) for r in changed), f"changed outside {redoes}: {context}"
        states = stage_states(work)  # its content is what it was: every stage made from it is finished too
        assert all(s["state"] == "finished" for s in states.values()), (context, states)


def test_a_manifest_from_before_the_record_is_still_read_and_a_cut_draft_still_redone(kimi_run, kimi_target, tmp_path,
                                                                                      capsys, caplog):
    """Manifests written before `output_files` (older runs) are read as before: a whole draft is a no-op; one whose
    model.safetensors was cut short is redone, its header giving the size the record would have."""
    import logging

    caplog.set_level(logging.INFO, logger="eagle3")
    work = copy_run(kimi_run, tmp_path / "w")
    path = work / "draft" / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "output_files"}))
    code, shown, errors = run_in_process("export", work, kimi_target, capsys, caplog)
    assert code == 0 and "nothing to do" in shown, shown[-3000:]
    os.truncate(work / "draft" / "model.safetensors", 4096)
    code, shown, errors = run_in_process("export", work, kimi_target, capsys, caplog)
    assert code == 0 and "nothing to do" not in shown and "model.safetensors unreadable safetensors" in shown, shown[-3000:]
    assert "output_files" in json.loads(path.read_text())  # the redone export records them


# --- one byte changed in each file a stage reads (issue 64) -------------------------------------------------------
# The file keeps its size (a truncation or a deletion shows by size alone: the sweeps above): one byte of it changed
# in place, then the stage that reads it run in this process over a copy of the finished run. Allowed: a refusal in
# one line naming the file (01: the data identity that changed), nothing written. Never "nothing to do" and never a
# trained or exported result. 04 and 05 also with a new --output (they would train / export: the reads come first, so
# these cases stop at the refusal in about a second; before the fix 04 trained on a hidden-state file with a value
# changed in place). A manifest: one hex digit of its recorded content_sha256 (a byte of its timestamp or versions
# changes nothing a stage reads). Not here: 02's and 04's own files (the sweeps above), 06's reads
# (test_reliability_sweep_06.py).

CONVERSATIONS = "conversations.jsonl"  # a copy, in WORK, of the file the finished run's 01 prepared
READS = {  # stage -> the files (from WORK) it reads, each with the --output it is run with: "rerun" (the finished
    # run's: what a rerun or run_all does) and/or "new" (04, 05: one holding nothing, so the stage would train / export)
    "prepare": {CONVERSATIONS: ("rerun",)},
    "extract": dict.fromkeys(PREPARED, ("rerun",)),
    "vocab": dict.fromkeys(("data/token_freq.pt", "data/manifest.json"), ("rerun",)),
    "train": {**dict.fromkeys(("data/data-00000-of-00001.arrow", "data/state.json", "data/dataset_info.json",
                               "data/manifest.json", f"{HS}/manifest.json", "vocab/manifest.json"), ("rerun",)),
              **dict.fromkeys((ONE_STATE, f"{HS}/hs_0.safetensors", f"{HS}/fingerprints.json", "vocab/d2t.npy",
                               "vocab/t2d.npy"), ("rerun", "new"))},
    "export": {**dict.fromkeys(("checkpoints/{best}/config.json", "checkpoints/{best}/model.safetensors",
                                "checkpoints/manifest.json"), ("rerun",)),
               **dict.fromkeys(("vocab/d2t.npy", "vocab/manifest.json"), ("rerun", "new"))},
}
FRESH_OUTPUT = {"train": "checkpoints-new", "export": "draft-new"}


def change_one_byte(path: Path) -> None:
    """One byte of the file changed in place (same size). A manifest: a hex digit of its content_sha256. Any other
    file: the byte at 9/16 of it, xor 1 (outside the blocks a fingerprint samples in a file over 64 KiB: a hidden-state
    file then differs from 02's record only by its modification time, as after issue 64 M's change)."""
    data = bytearray(path.read_bytes())
    if path.name == "manifest.json":
        at = data.index(b'"content_sha256": "') + len(b'"content_sha256": "')
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    else:
        data[len(data) * 9 // 16] ^= 1
    with open(path, "r+b") as handle:  # in place: same inode, as an editor or a bit flip on disk would leave it
        handle.write(bytes(data))


def reads_cases() -> list:
    cases = []
    for stage, files in READS.items():
        for rel, modes in files.items():
            for mode in modes:  # a finished 05 over 03's files changed since said "nothing to do" before b250fd0
                cases.append(pytest.param(stage, rel, mode == "new", id=f"{stage}:{rel}:{mode}"))
    return cases


@pytest.mark.parametrize(("stage", "rel", "fresh"), reads_cases())
def test_one_byte_changed_in_a_file_a_stage_reads_is_refused_in_one_line(stage, rel, fresh, kimi_run, kimi_target,
                                                                         tmp_path, capsys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="eagle3")
    work = copy_run(kimi_run, tmp_path / "w")
    shutil.copy2(SAMPLES / CONVERSATIONS, work / CONVERSATIONS)
    rel = rel.format(best=json.loads((work / "checkpoints" / "manifest.json").read_text())["best_checkpoint"]["name"])
    args = stage_args(stage, work, kimi_target)
    if stage == "prepare":
        args[args.index("--data") + 1] = work / CONVERSATIONS
    if fresh:
        args[args.index("--output") + 1] = work / FRESH_OUTPUT[stage]
    change_one_byte(work / rel)
    before = tree(work)
    code, shown, errors = run_in_process(stage, work, kimi_target, capsys, caplog, args=args)
    changed = sorted(r for r, v in tree(work).items() if before.get(r) != v and not bookkeeping(r))
    changed += sorted(before.keys() - tree(work).keys())
    context = f"{stage}, one byte of {rel} changed: exit {code}, changed {changed}\n{shown[-3000:]}"
    assert "Traceback" not in shown and "nothing to do" not in shown, context
    assert code != 0 and len(errors) == 1, context
    named = "inputs.data = " if stage == "prepare" else f"{work / rel}: "
    assert named in errors[0], context
    assert not changed, context  # nothing written, nothing deleted: not even the new --output
    assert not (fresh and (work / FRESH_OUTPUT[stage]).exists()), context
