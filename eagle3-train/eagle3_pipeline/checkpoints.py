"""speculators' checkpoint layout (0.9.0), known in one place: stage 04 resumes and cleans it, 05 reads it.

A save path holds, written by speculators' trainer:
- `<epoch>/` folders (a decimal name) with config.json, model.safetensors, optimizer_state_dict.pt,
  scheduler_state_dict.pt, training_state.json (last), val_metrics.json, config.py, train_command.txt;
- `interrupted/` (SIGTERM/Ctrl-C save), `checkpoint_best` (a relative symlink to the lowest-val-loss
  epoch), descriptive symlinks such as `epoch0_end` / `epoch0_step16`, `run.yaml`, `train_command.txt`,
  `speculators.patch`, `logs/` (tensorboard);
and by stage 04: `metrics.jsonl`, `summary.json`, `summary.txt`, `plots/`, `command.txt`, `manifest.json`,
`hidden_states_cache/` (--hidden-states hybrid).

Ownership is decided by content, never by a name alone: a decimal folder is a checkpoint only when
every file in it is one of speculators' checkpoint files (an empty folder counts: a save cut short
right after its mkdir). A folder a person made there (`checkpoints/2024/` with their notes) is never
deleted, and because speculators would resume from the highest decimal folder, training refuses to
start beside one (`foreign_epoch_folders`).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from .errors import ContractError
from .files import TEMP_MARKER, remove_path, safetensors_problem, sha256_file
from .manifest import MANIFEST_NAME
from .stage import first_difference, read_own_manifest

INTERRUPTED = "interrupted"
BEST_LINK = "checkpoint_best"
STATE_NAME = "training_state.json"
MODEL_NAME = "model.safetensors"
OPTIMIZER_NAME = "optimizer_state_dict.pt"
CHECKPOINT_FILES = frozenset({
    "config.json", MODEL_NAME, OPTIMIZER_NAME, "scheduler_state_dict.pt", STATE_NAME,
    "val_metrics.json", "config.py", "train_command.txt",
})
# Files and folders directly under the save path that stage 04 or speculators' trainer write.
RUN_FILES = (
    BEST_LINK, "run.yaml", "train_command.txt", "speculators.patch", "logs",
    "metrics.jsonl", "summary.json", "summary.txt", "plots", "command.txt",
    "bad_samples.jsonl",  # compat/sample_check.RECORD_NAME: samples the loader refused
    "hidden_states_cache",  # --hidden-states hybrid: the states vLLM generated (online.CACHE_DIRNAME)
    "slice_data",  # --slice-rows: the view of one run position's rows (slices.VIEW_DIRNAME)
)


# What transformers' save_pretrained may add for larger drafts (sharded weights, generation config), and the temp of
# a val_metrics.json compat/epoch_val_metrics.py was writing when a run was killed (files.temp_path_for's name).
CHECKPOINT_PATTERNS = ("model-*-of-*.safetensors", "*.safetensors.index.json", "generation_config.json",
                       f".val_metrics.json{TEMP_MARKER}*")


def _is_checkpoint_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink() and (
        path.name in CHECKPOINT_FILES or any(fnmatch.fnmatch(path.name, p) for p in CHECKPOINT_PATTERNS))


def _is_checkpoint_folder(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and all(_is_checkpoint_file(p) for p in folder.iterdir())


def _decimal_folders(out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    dirs = [p for p in out_dir.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    return sorted(dirs, key=lambda p: int(p.name))


def epoch_folders(out_dir: Path) -> list[Path]:
    """speculators' `<epoch>/` checkpoint folders (complete or not), oldest first."""
    return [p for p in _decimal_folders(out_dir) if _is_checkpoint_folder(p)]


def foreign_epoch_folders(out_dir: Path) -> list[Path]:
    """Decimal folders holding something speculators did not write (never ours to touch)."""
    return [p for p in _decimal_folders(out_dir) if not _is_checkpoint_folder(p)]


def read_state(folder: Path) -> dict | None:
    try:
        state = json.loads((Path(folder) / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and "global_step" in state else None


def incomplete_reason(folder: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None if it is complete."""
    folder = Path(folder)
    for name in (MODEL_NAME, OPTIMIZER_NAME):
        if not (folder / name).is_file():
            return f"no {name} (the save was cut short)"
    if read_state(folder) is None:
        return f"no readable {STATE_NAME} (the save was cut short)"
    state_mtime = (folder / STATE_NAME).stat().st_mtime_ns
    for name in (MODEL_NAME, OPTIMIZER_NAME):
        if (folder / name).stat().st_mtime_ns > state_mtime:
            return f"{name} is newer than {STATE_NAME} (an overwrite was cut short)"
    reason = unreadable_weights(folder / MODEL_NAME)  # truncated/garbled
    return f"{MODEL_NAME} {reason}" if reason else None


def unreadable_weights(path: Path) -> str | None:
    """Why a checkpoint's safetensors file cannot be read (truncated, garbled header), or None."""
    return safetensors_problem(path)


def best_gone_message(out_dir: Path, best: str) -> str:
    others = [p.name for p in complete(out_dir)]
    choose = f"export another with 05_export.py --checkpoint {others[-1]}" if others else "no other checkpoint is complete"
    return (f"{Path(out_dir) / best}: the best checkpoint {best!r} that {Path(out_dir) / MANIFEST_NAME} records is gone or "
            f"incomplete; {choose} (complete: {', '.join(others) or 'none'}), or train again into a new --output")


def require_recorded_best(out_dir: Path) -> bool:
    """A finished run's recorded best checkpoint must still be there, whole (else stage 05 would export another)."""
    manifest = read_own_manifest(out_dir)
    if manifest is None or manifest.best_checkpoint is None:
        return True
    best = manifest.best_checkpoint.name
    folder = Path(out_dir) / best
    if not (folder / MODEL_NAME).is_file():
        raise ContractError(best_gone_message(out_dir, best))
    reason = unreadable_weights(folder / MODEL_NAME)
    if reason:
        raise ContractError(f"{folder / MODEL_NAME}: {reason}; the best checkpoint of this finished run is damaged: "
                            f"export another with 05_export.py --checkpoint N, or train again into a new --output")
    return True


# A finished run's records for people (its log, the summary's text, the curves, the command): recorded by their bytes,
# but no stage reads them to decide or build anything, so one cut short or edited since does not undo the run.
RECORDS = ("metrics.jsonl", "summary.txt", "command.txt", "plots/")


def is_record(name: str) -> bool:
    return any(name == record or (record.endswith("/") and name.startswith(record)) for record in RECORDS)


class RecordsChanged(Exception):
    """refuse_damaged: only records (RECORDS) differ from the manifest; the run stays finished. `changed`: {name: how}."""

    def __init__(self, changed: dict[str, str]):
        super().__init__(", ".join(changed))
        self.changed = changed


def refuse_damaged(out_dir: Path, changed: dict[str, str]) -> None:
    """A finished run whose files differ from what its manifest recorded (stage.finished's `damaged`): a resume has
    nothing left to train, so nothing would redo them; refused in one line naming the first (a damaged best
    checkpoint: `require_recorded_best`'s line, which names the checkpoint to export instead). Only records changed
    (a cut metrics.jsonl): RecordsChanged, the run stays finished (before, it blocked the run for good)."""
    require_recorded_best(out_dir)
    if all(is_record(name) for name in changed):
        raise RecordsChanged(changed)
    changed = {name: how for name, how in changed.items() if not is_record(name)}
    name, how = next(iter(changed.items()))
    more = f" (and {len(changed) - 1} other file(s))" if len(changed) > 1 else ""
    raise ContractError(f"{Path(out_dir) / name}: {how} since 04_train.py wrote it (its size and digest are in "
                        f"{Path(out_dir) / MANIFEST_NAME}){more}; a resume does not redo a finished run's files: put it "
                        f"back from a copy, or train again into a new --output (nothing was changed)")


def incomplete(out_dir: Path) -> list[tuple[Path, str]]:
    """Checkpoint folders a killed save left unusable, with the reason."""
    return [(p, reason) for p in epoch_folders(out_dir) if (reason := incomplete_reason(p))]


def complete(out_dir: Path) -> list[Path]:
    """Checkpoints a resume or an export can use, oldest first."""
    return [p for p in epoch_folders(out_dir) if incomplete_reason(p) is None]


def latest(out_dir: Path) -> Path | None:
    found = complete(out_dir)
    return found[-1] if found else None


def best(out_dir: Path) -> Path | None:
    """`checkpoint_best` (the lowest validation loss), else the newest checkpoint."""
    link = Path(out_dir) / BEST_LINK
    if link.exists():
        return link.resolve()
    return latest(out_dir)


def latest_progress(out_dir: Path) -> dict | None:
    """The training state speculators will resume from: its newest epoch folder's, or None."""
    folders = epoch_folders(out_dir)
    if not folders:
        return None
    state = read_state(folders[-1]) or {}
    return {"checkpoint": folders[-1].name, **state}


def own_outputs(out_dir: Path) -> list[Path]:
    """Everything in out_dir that stage 04 or speculators' trainer wrote (what --overwrite may delete): only
    where a stage 04 manifest (finished or not) is, and of the run files only those it lists, never by name alone
    (a work directory's `logs/` is not this stage's because the trainer also writes a `logs/`)."""
    out_dir = Path(out_dir)
    manifest = read_own_manifest(out_dir) if out_dir.is_dir() else None
    if manifest is None or manifest.stage != "train":
        return []
    listed = set(manifest.outputs or ())
    found = list(epoch_folders(out_dir))
    interrupted = out_dir / INTERRUPTED
    if _is_checkpoint_folder(interrupted):
        found.append(interrupted)
    for name in RUN_FILES:
        if name in listed and ((out_dir / name).exists() or (out_dir / name).is_symlink()):
            found.append(out_dir / name)
    # speculators' descriptive symlinks (`epoch0_end`, `epoch1_step16`) point at an epoch folder.
    for link in out_dir.iterdir():
        if link.is_symlink() and link.name.startswith("epoch") and link.readlink().name.isdigit():
            found.append(link)
    return found


# What a finished run's manifest does not record by its bytes (stage 04's `output_files`): the states vLLM generated
# (a cache, checked sample by sample when read), a sliced run's view of one position's rows (links, remade per slice),
# and the trainer's logs (tensorboard, per-rank sample logs: records for people, which other nodes' ranks may write).
UNRECORDED = ("hidden_states_cache", "slice_data", "logs")


def written_files(out_dir: Path) -> list[str]:
    """The files (paths relative to out_dir) stage 04 and speculators' trainer wrote: its finished manifest records
    them by size and digest (contract.write_manifest's `outputs`), so a rerun never calls a damaged run finished."""
    out_dir = Path(out_dir)
    names: list[str] = []
    for item in own_outputs(out_dir):
        if item.is_symlink() or item.name in UNRECORDED:
            continue
        found = [item] if item.is_file() else sorted(p for p in item.rglob("*") if p.is_file() and not p.is_symlink())
        names += [p.relative_to(out_dir).as_posix() for p in found]
    return names


def delete_own(out_dir: Path) -> list[str]:
    """Delete stage 04's outputs (manifest last, so a kill midway leaves an unfinished run); returns names."""
    items = own_outputs(out_dir)
    for item in items:
        remove_path(item)
    remove_path(Path(out_dir) / MANIFEST_NAME)
    return sorted(p.name for p in items)


def delete_checkpoints(out_dir: Path) -> list[str]:
    """Only the checkpoints (epoch folders, interrupted/, the links to them) of stage 04's own outputs; the logs
    stay. For a run that trained on no sample: a rerun must start from the start, not resume from them."""
    logs_and_reports = set(RUN_FILES) - {BEST_LINK}
    items = [p for p in own_outputs(out_dir) if p.name not in logs_and_reports]
    for item in items:
        remove_path(item)
    return sorted(p.name for p in items)


def refuse_foreign_folders(out_dir: Path) -> None:
    """speculators resumes from the highest decimal folder: one a person made there would be "resumed"."""
    foreign = foreign_epoch_folders(out_dir)
    if foreign:
        raise ContractError(f"{foreign[-1]}: a folder stage 04 did not write (not a speculators checkpoint) in --output, "
                            f"and speculators would resume from it; move it out of {out_dir} (nothing was deleted)")


def replaces_other_run(out_dir: Path, identity: dict) -> bool:
    """True when out_dir holds this stage's outputs of another run (identity differs, or no manifest)."""
    manifest = read_own_manifest(out_dir)
    if manifest is None:
        return bool(own_outputs(out_dir))
    return first_difference(manifest.identity, identity) is not None


def checkpoint_content(folder: Path) -> dict:
    """A checkpoint by its weights' bytes (stage 05's input identity)."""
    return {"name": folder.name, "model_sha256": sha256_file(folder / MODEL_NAME)}
