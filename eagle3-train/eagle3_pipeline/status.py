"""`run_all.sh --status`: each stage's state in a work directory, by the stages' own rule for "done".

`python -m eagle3_pipeline.status --work WORK` prints one line per stage: `NN name STATE LOG`, the log path
derived from WORK (a log that is not there says so: a copied work dir, or deleted logs/).
A stage is `finished` only as `stage.finished` would find it without its flags: its manifest is
complete, the upstream outputs it recorded (identity.inputs: their `content_sha256`) are the ones
on disk now, every upstream stage is itself finished, and its stage-specific condition holds
(02: every row's file present with the size and fingerprint it recorded; 04: the recorded best
checkpoint whole), and the files it wrote have the sizes and digests its manifest recorded (`output_files`).
A stage made from an upstream output that is unreadable, gone, unfinished or stale is `stale` too, naming it
(`rerun` that one first). A manifest that cannot be read is `manifest unreadable`: the stage refuses it
when run, naming the problem (it is no run to resume). What status cannot know without the flags
is a changed setting: the stage itself says so when run (a finished stage is a no-op there, a stale
one names the field).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .checkpoints import MODEL_NAME, is_record, unreadable_weights
from .errors import ContractError
from .files import (  # torch-free, as this module: run_all's python may have no torch
    changed_fingerprints,
    changed_outputs,
    fingerprints_problem,
)
from .hidden_states import hs_name
from .manifest import MANIFEST_NAME, Manifest, parse_manifest

STAGES = (("01", "prepare", "data"), ("02", "extract", "data/hidden_states"), ("03", "vocab", "vocab"),
          ("04", "train", "checkpoints"), ("05", "export", "draft"), ("06", "evaluate", "eval"))
NUMBERS = {stage: num for num, stage, _ in STAGES}
OPTIONAL = {"evaluate"}  # run_all.sh --eval only: listed once it has a directory or a log


def _manifest(directory: Path) -> Manifest | str | None:
    """The typed manifest; None: none there; a string: one that cannot be read (its one-line problem)."""
    if not (directory / MANIFEST_NAME).is_file():
        return None
    try:
        return parse_manifest(directory / MANIFEST_NAME)
    except ContractError as exc:
        return str(exc)


def _extra_problem(stage: str, directory: Path, manifest: Manifest) -> str | None:
    changed = changed_outputs(directory, manifest.output_files)  # the files it wrote, by the sizes and digests recorded
    if stage == "train":  # 04's records for people (metrics.jsonl, ...) do not undo a run (checkpoints.RECORDS)
        changed = {name: how for name, how in changed.items() if not is_record(name)}
    if changed:
        name, how = next(iter(changed.items()))
        return f"{name} {how}" + (f", and {len(changed) - 1} other file(s)" if len(changed) > 1 else "")
    if stage == "extract":
        if record_problem := fingerprints_problem(directory, manifest.fingerprints):
            return record_problem
        rows = manifest.counts.rows if manifest.counts else 0
        changed = changed_fingerprints(directory, [hs_name(i) for i in range(rows)])
        if changed:
            name, how = next(iter(changed.items()))
            return f"{len(changed)} file(s) changed since written ({name}: {how})"
    if stage == "train":
        best = manifest.best_checkpoint.name if manifest.best_checkpoint else None
        if best and not (directory / best / MODEL_NAME).is_file():
            return f"best checkpoint {best} is gone"
        if best and (reason := unreadable_weights(directory / best / MODEL_NAME)):
            return f"best checkpoint {best}: {reason}"
    return None


def stage_states(work: Path) -> dict[str, dict]:
    work = Path(work)
    states: dict[str, dict] = {}
    contents: dict[str, str | None] = {}
    for num, stage, rel in STAGES:
        directory = work / rel
        log = work / "logs" / f"{num}_{stage}.log"
        if stage in OPTIONAL and not directory.exists() and not log.is_file():
            continue
        manifest = _manifest(directory)
        if manifest is None or (not isinstance(manifest, str) and manifest.stage != stage):
            state = "started, no output yet" if log.is_file() else "not started"
            states[stage] = {"num": num, "state": state, "log": str(log)}
            continue
        if isinstance(manifest, str):  # unreadable, or of another schema: the stage refuses it (never resumes it)
            states[stage] = {"num": num, "state": "manifest unreadable", "log": str(log)}
            continue
        if not manifest.complete:
            states[stage] = {"num": num, "state": "started, not finished", "log": str(log)}
            continue
        contents[stage] = manifest.content_sha256  # what downstream stages recorded of it
        recorded = (manifest.identity or {}).get("inputs") or {}
        why, rerun = None, num
        for upstream, value in recorded.items():
            if upstream not in NUMBERS:
                continue  # not a stage output (a data file, a target hash, a checkpoint)
            # an upstream this stage was made from that is unreadable, gone, unfinished or stale: never "finished"
            # over it (its own rerun refuses it, or makes another output this one was not made from)
            upstream_state = states.get(upstream, {}).get("state", "not started")
            if upstream_state != "finished":
                why = f"its input, {NUMBERS[upstream]} {upstream}, is {upstream_state}"
                rerun = states.get(upstream, {}).get("rerun", NUMBERS[upstream])  # where the chain starts
            elif value != contents[upstream]:
                why = f"made from another {upstream} output than {work / dict((s, r) for _, s, r in STAGES)[upstream]}"
            if why:
                break
        why = why or _extra_problem(stage, directory, manifest)
        states[stage] = {"num": num, "state": "stale" if why else "finished", "log": str(log),
                         **({"why": why, "rerun": rerun} if why else {})}
    return states


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path)
    args = parser.parse_args(argv)
    for stage, info in stage_states(args.work).items():
        state = info["state"] + (f" ({info['why']}; rerun {info['rerun']})" if info.get("why") else "")
        log = info["log"] + ("" if Path(info["log"]).is_file() else
                             " (no log yet)" if info["state"] == "not started" else " (missing)")
        print(f"{info['num']} {stage:<8} {state:<22} {log}")
        for other in sorted(Path(info["log"]).parent.glob(f"{info['num']}_{stage}.*.log")):  # other nodes' and ranks'
            print(f"   {other.name.split('.')[1]:<30} {other}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
