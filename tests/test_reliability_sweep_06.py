"""Stage 06 in the reliability sweep (issue 46): a copy of a finished evaluation (conftest.llama_eval) and of the draft
it measured, with one file cut short or deleted at a time, then the same command again. Each case is refused in one
line naming the file, redone within 06's own output folder, or an honest no-op ("already evaluated"); never a
traceback, never "already evaluated" over a damaged report, and never a change outside the report's folder.

The outcome is read from the run, as in test_reliability_sweep.py: `refused`: non-zero exit, exactly one `error: `
line, no file changed; `redone`: exit 0, files changed, all under `redoes`; `no-op`: exit 0, nothing changed but
the lock. Only a report.json cut short or deleted needs an engine (the measurement is the record); a damaged
report.txt or report.png is redrawn from report.json, and every refusal comes before any engine starts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from eagle3_pipeline.eval_report import format_report

from conftest import LLAMA_EVAL_FLAGS, REPO, run_stage

pytestmark = pytest.mark.reliability


def tree(root: Path) -> dict[str, tuple]:
    """Every path under root: files by (size, mtime, inode), folders by being there."""
    out = {}
    for path in root.rglob("*"):
        info = path.stat()
        out[path.relative_to(root).as_posix()] = ("dir",) if path.is_dir() else (info.st_size, info.st_mtime_ns,
                                                                                 info.st_ino)
    return out


def under(rel: str, roots: tuple[str, ...]) -> bool:
    return any(rel == root or rel.startswith(root + "/") for root in roots)


def delete(rel: str) -> Callable[[Path], None]:
    def change(work: Path) -> None:
        target = work / rel
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return change


def one_byte(rel: str) -> Callable[[Path], None]:
    """One byte near the end changed (issue 64: a changed byte, not only a cut or a deletion): same size."""
    def change(work: Path) -> None:
        with open(work / rel, "r+b") as handle:
            handle.seek(-3, os.SEEK_END)
            byte = handle.read(1)
            handle.seek(-3, os.SEEK_END)
            handle.write(bytes([byte[0] ^ 0x01]))
    return change


def cut_short(rel: str) -> Callable[[Path], None]:
    def change(work: Path) -> None:
        os.truncate(work / rel, min(100, (work / rel).stat().st_size // 2))
    return change


# --- the cases' own evidence ------------------------------------------------------------------------------

def measured_again(why: str) -> Callable:
    def evidence(result, work: Path, made: Path) -> None:
        assert why in result.stderr, result.stderr[-3000:]  # the log says why it measures again
        assert "vllm: draft-k3: tau" in result.stderr, result.stderr[-3000:]  # an engine ran: the record is remade
        report = json.loads((work / "eval" / "report.json").read_text())
        assert (work / "eval" / "report.txt").read_text() == format_report(report) + "\n"
        assert json.loads((work / "eval" / "manifest.json").read_text())["complete"]
    return evidence


def redrawn(name: str) -> Callable:
    def evidence(result, work: Path, made: Path) -> None:
        assert f"{name} cut short, changed or gone; redrawn from report.json" in result.stderr, result.stderr[-3000:]
        assert "vllm:" not in result.stderr  # no engine: drawn from the record
        assert (work / "eval" / name).read_bytes() == (made / name).read_bytes()
    return evidence


@dataclass(frozen=True)
class Case:
    change: Callable[[Path], None] | None  # on the copy (WORK holds eval/ and draft/)
    expect: str  # "refused", "redone" or "no-op"
    redoes: tuple[str, ...] = ()  # what it may rewrite or delete (from WORK)
    names: tuple[str, ...] = ()  # what a refusal's line must say ({work}: the copy)
    evidence: Callable | None = None  # (result, work, the evaluation it was copied from)


MEASURED = ("eval", "draft/README.md")

REDRAWN = {f"{name} {how}": Case(change(f"eval/{name}"), "redone", redoes=("eval",), evidence=redrawn(name))
           for name in ("report.txt", "report.png")
           for how, change in (("cut short", cut_short), ("deleted", delete), ("one byte changed", one_byte))}

CASES = {
    "nothing changed": Case(None, "no-op"),
    # 06's own outputs: the record measured again, its views redrawn from it, its manifest refused (move it away)
    # (measured again: the draft's model card gets the new measurement in its section, issue 63)
    "report.json cut short": Case(cut_short("eval/report.json"), "redone", redoes=MEASURED, evidence=measured_again(
        "report.json cut short: ")),
    "report.json one byte changed": Case(one_byte("eval/report.json"), "redone", redoes=MEASURED,
                                         evidence=measured_again("report.json same size, other bytes")),
    "report.json deleted": Case(delete("eval/report.json"), "redone", redoes=MEASURED, evidence=measured_again(
        "report.json missing (this stage wrote it); redoing it")),
    **REDRAWN,
    "manifest.json cut short": Case(cut_short("eval/manifest.json"), "refused",
                                    names=("{work}/eval/manifest.json: unreadable manifest", "move {work}/eval away")),
    "manifest.json deleted": Case(delete("eval/manifest.json"), "refused",
                                  names=("{work}/eval: holds files", "no manifest of it", "nothing was deleted")),
    "the engine's logs deleted": Case(delete("eval/logs"), "no-op"),
    "the engine's log cut short": Case(cut_short("eval/logs/vllm-draft-k3.log"), "no-op"),
    # the draft it measured (stage 05's files, 06's input): one line naming the file, before any engine
    "draft's model.safetensors cut short": Case(cut_short("draft/model.safetensors"), "refused",
                                                names=("{work}/draft/model.safetensors: unreadable safetensors",
                                                       "export it again (05_export.py)")),
    "draft's model.safetensors deleted": Case(delete("draft/model.safetensors"), "refused",
                                              names=("{work}/draft/model.safetensors: missing",)),
    "draft's model.safetensors one byte changed": Case(one_byte("draft/model.safetensors"), "refused", names=(
        "{work}/draft/model.safetensors: same size, other bytes since 05_export.py wrote it; rerun 05_export.py",)),
    "draft's config.json one byte changed": Case(one_byte("draft/config.json"), "refused",
                                                 names=("{work}/draft/config.json: ",)),
    "draft's manifest.json one byte changed": Case(one_byte("draft/manifest.json"), "refused",
                                                   names=("{work}/draft/manifest.json: ",)),
    "draft's config.json cut short": Case(cut_short("draft/config.json"), "refused",
                                          names=("{work}/draft/config.json: unreadable JSON",)),
    "draft's config.json deleted": Case(delete("draft/config.json"), "refused",
                                        names=("{work}/draft/config.json: missing",)),
    "draft's manifest.json cut short": Case(cut_short("draft/manifest.json"), "refused",
                                            names=("{work}/draft/manifest.json: unreadable manifest",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_finished_evaluation_with_one_file_damaged_is_refused_redone_or_a_no_op(name, llama_run, llama_eval,
                                                                                  tmp_path):
    case = CASES[name]
    work = tmp_path / "work"
    shutil.copytree(llama_run["draft"], work / "draft")
    shutil.copytree(llama_eval, work / "eval")
    if case.change:
        case.change(work)
    before = tree(work)
    result = run_stage("evaluate", "--profile", "cpu-mini", "--draft", work / "draft", "--output", work / "eval",
                       *LLAMA_EVAL_FLAGS, check=False)
    after = tree(work)
    shown = result.stdout + result.stderr
    context = f"{name}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"

    assert "Traceback" not in shown, context
    changed = sorted(rel for rel in before.keys() | after.keys()
                     if before.get(rel) != after.get(rel) and not rel.endswith(".lock"))
    assert all(under(rel, case.redoes) for rel in changed), f"changed outside {case.redoes}: {changed}\n{context}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if result.returncode != 0:
        assert len(errors) == 1, f"a refusal is one line: {errors}\n{context}"
        observed = "refused"
    else:
        observed = "redone" if changed else "no-op"
    assert observed == case.expect, f"{observed}, expected {case.expect}\n{context}"

    if observed == "refused":
        for part in case.names:
            assert part.format(work=work) in errors[0], f"{part!r} not in {errors[0]!r}"
        assert not changed and "already evaluated" not in shown and "vllm:" not in result.stderr, context
    elif observed == "no-op":
        assert "already evaluated with these settings and inputs" in result.stderr, context
    else:
        assert changed, context
    if case.evidence:
        case.evidence(result, work, llama_eval)


def test_status_calls_an_evaluation_stale_over_a_changed_report(llama_run, llama_eval, tmp_path):
    """Issue 64 P. Before: `run_all.sh --status` said "06 evaluate finished" over a cut or changed report.json (06 kept
    its digests in another manifest field than the one --status reads). Now 06 keeps the record every stage keeps."""
    from eagle3_pipeline.status import stage_states

    work = tmp_path / "work"
    for name in ("data", "vocab", "checkpoints", "draft"):
        shutil.copytree(llama_run[name], work / name, symlinks=True)
    shutil.copytree(llama_eval, work / "eval")
    assert stage_states(work)["evaluate"]["state"] == "finished"
    one_byte("eval/report.json")(work)
    state = stage_states(work)["evaluate"]
    assert state["state"] == "stale" and state["why"] == "report.json same size, other bytes", state
    cut_short("eval/report.json")(work)
    assert stage_states(work)["evaluate"]["why"].startswith("report.json cut short")


def test_a_manifest_written_before_the_one_record_is_still_read(llama_run, llama_eval, tmp_path):
    """Issue 64 P: manifests 06 wrote before it kept `output_files` (its sha256s in `output_sha256`, names in
    `outputs`) stay readable: the same command is a no-op, and a report.txt cut short is redrawn (the record then
    written the one way every stage writes it)."""
    from eagle3_pipeline.files import sha256_file

    work = tmp_path / "work"
    shutil.copytree(llama_run["draft"], work / "draft")
    shutil.copytree(llama_eval, work / "eval")
    manifest = json.loads((work / "eval" / "manifest.json").read_text())
    names = sorted(manifest.pop("output_files"))
    manifest.update(outputs=names, output_sha256={n: sha256_file(work / "eval" / n) for n in names})
    (work / "eval" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    flags = ("--profile", "cpu-mini", "--draft", work / "draft", "--output", work / "eval", *LLAMA_EVAL_FLAGS)
    assert "already evaluated with these settings" in run_stage("evaluate", *flags).stderr
    cut_short("eval/report.txt")(work)
    result = run_stage("evaluate", *flags)
    assert "report.txt cut short, changed or gone; redrawn from report.json" in result.stderr
    rewritten = json.loads((work / "eval" / "manifest.json").read_text())
    assert "output_sha256" not in rewritten and sorted(rewritten["output_files"]) == names


@pytest.mark.parametrize("rel", ["vocab/d2t.npy", "vocab/manifest.json", "checkpoints/manifest.json",
                                 "data/manifest.json", "prompts.jsonl"])
def test_one_byte_changed_in_a_file_06_reads_upstream_is_refused_in_one_line(rel, llama_run, llama_eval, tmp_path):
    """Issue 64's sweep, upstream of 06: one byte of each other file it reads (stage 03's d2t, the manifests of 04,
    03 and 01, the prompts) changed in a copy of the run, the same command again: refused in one line, before any
    engine, nothing changed; never "already evaluated" nor a measured verdict."""
    work = tmp_path / "work"
    for name in ("data", "vocab", "checkpoints", "draft"):
        shutil.copytree(llama_run[name], work / name, symlinks=True)
    shutil.copytree(llama_eval, work / "eval")
    shutil.copyfile(REPO / "eagle3-train" / "samples" / "eval_prompts.jsonl", work / "prompts.jsonl")
    flags = ("--profile", "cpu-mini", "--draft", work / "draft", "--output", work / "eval", "--checkpoints",
             work / "checkpoints", "--data", work / "data", "--vocab", work / "vocab", "--prompts",
             work / "prompts.jsonl", *LLAMA_EVAL_FLAGS)
    one_byte(rel)(work)
    before = tree(work)
    result = run_stage("evaluate", *flags, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "vllm:" not in result.stderr and "already evaluated" not in result.stderr
    if rel != "prompts.jsonl":  # a prompt's byte: its line refused, or another prompts identity (the report's)
        assert str(work / rel) in errors[0], errors[0]
    changed = [r for r in set(before) | set(tree(work)) if before.get(r) != tree(work).get(r) and not r.endswith(".lock")]
    assert not changed, changed
