"""Resuming stage 04 safely on top of speculators' checkpoints (speculators 0.9.0).

speculators resumes by itself from the highest-numbered `<save>/<epoch>/` folder, and reads
`training_state.json` there to continue mid-epoch. Three gaps make that unsafe after a crash,
and this module closes them before the trainer starts (`prepare_resume`) and while it runs
(`install_interrupt_progress`):

1. Saves are not atomic. A checkpoint is written file by file (config.json, model.safetensors,
   optimizer_state_dict.pt, scheduler_state_dict.pt, then training_state.json), and sub-epoch
   saves overwrite the same `<epoch>/` folder. A kill -9 during a save leaves a folder that the
   trainer would pick and then fail to load (or load half-new weights from). A folder counts
   as complete only when training_state.json parses and is not older than the weights and
   the optimizer state it describes; incomplete ones are deleted, so the run resumes from the
   previous complete checkpoint.
2. SIGTERM/Ctrl-C saves `<save>/interrupted/`, but speculators never resumes from it (it asks
   for a manual `mv interrupted N`, which then loses the position inside the epoch), and the
   trainer returns normally, so the stage would look finished. We record the epoch and step
   in `interrupted/training_state.json` when it is saved, report the stop as an interruption
   (exit 130), and on the next run move it into place as `<epoch>/`, where speculators resumes
   mid-epoch from exactly that step.
3. Nothing says what a rerun skipped: `latest_progress` reads the global step the trainer
   will resume from, which stage 04 logs and records in its manifest.
"""

from __future__ import annotations

import json
import logging
import os
from importlib import metadata
from pathlib import Path

from .checkpoints import INTERRUPTED, STATE_NAME, incomplete, incomplete_reason, latest_progress, own_outputs, read_state
from .compat.gate import speculators_supported
from .files import TEMP_MARKER, remove_path, writer_tag

# Local imports: speculators: imported where its trainer is patched (heavy; resume planning needs none).

log = logging.getLogger("eagle3")

SUPPORTED_SPECULATORS = ("0.9.0",)

_interrupted = {"requested": False, "saved": False, "state": None}


# --- before the trainer starts ------------------------------------------------------------------

def prepare_resume(out_dir: Path) -> dict:
    """Delete incomplete checkpoints, adopt a newer `interrupted/`; returns what was done."""
    out_dir = Path(out_dir)
    report = {"incomplete_removed": [], "interrupted": None}
    for folder, reason in incomplete(out_dir):
        log.warning("checkpoint %s is incomplete (%s): deleted; resuming from the one before", folder, reason)
        remove_path(folder)
        report["incomplete_removed"].append(folder.name)
    interrupted = out_dir / INTERRUPTED
    if interrupted.is_dir() and interrupted in own_outputs(out_dir):
        report["interrupted"] = _adopt_interrupted(out_dir, interrupted)
    return report


def _adopt_interrupted(out_dir: Path, interrupted: Path) -> str:
    reason = incomplete_reason(interrupted)
    if reason:
        remove_path(interrupted)
        log.warning("%s is incomplete (%s): deleted", interrupted, reason)
        return f"deleted: {reason}"
    state = read_state(interrupted)
    latest = latest_progress(out_dir)
    if latest and latest.get("global_step", -1) >= state["global_step"]:
        remove_path(interrupted)
        return f"deleted: checkpoint {latest['checkpoint']} is as recent (global step {latest['global_step']})"
    epoch, local_step = int(state["epoch"]), int(state["local_step"])
    if local_step == 0:  # stopped before the first step of `epoch`: that is the end of the previous one
        if epoch == 0:
            remove_path(interrupted)
            return "deleted: stopped before the first step"
        epoch -= 1
        (interrupted / STATE_NAME).write_text(json.dumps({**state, "epoch": epoch, "local_step": 0}))
    final = out_dir / str(epoch)
    # A pair of renames (the older folder of this epoch is a sub-epoch save): a kill in between
    # leaves a hidden temp that the next run deletes, and `interrupted/` still in place.
    aside = out_dir / f".{final.name}.old{TEMP_MARKER}{writer_tag()}"
    if final.exists():
        os.replace(final, aside)
    os.replace(interrupted, final)
    remove_path(aside)
    log.info("resuming from the interrupted checkpoint: epoch %d, step %d of it, global step %d (moved to %s)",
             epoch, local_step, state["global_step"], final)
    return f"adopted as {final.name} at global step {state['global_step']}"


# --- while the trainer runs ---------------------------------------------------------------------

def install_interrupt_progress() -> bool:
    """Make speculators' SIGTERM/Ctrl-C checkpoint resumable and visible; False if not applicable."""
    if not speculators_supported(SUPPORTED_SPECULATORS):
        log.warning("speculators %s: interrupted/ checkpoints are not made resumable (written for %s)",
                    metadata.version("speculators"), ", ".join(SUPPORTED_SPECULATORS))
        return False
    import speculators.train.trainer as trainer

    cls = trainer.Trainer
    if getattr(cls, "_eagle3_progress", False):
        return True
    original_train_epoch = cls.train_epoch
    original_save = cls.maybe_save_checkpoint

    def train_epoch(self, epoch, *, step_callback=None):
        resumed = getattr(self, "_resume_local_step", 0) if epoch == getattr(self, "current_epoch", epoch) else 0
        self._eagle3_position = {"epoch": epoch, "local_step": resumed}

        def counted():
            self._eagle3_position["local_step"] += 1
            if step_callback is not None:
                step_callback()

        return original_train_epoch(self, epoch, step_callback=counted)

    def maybe_save_checkpoint(self, epoch, local_step=0):
        if epoch == INTERRUPTED:
            _interrupted["requested"] = True  # before the save: a failed save is still an interruption
        result = original_save(self, epoch, local_step=local_step)
        if epoch == INTERRUPTED:
            position = getattr(self, "_eagle3_position", {"epoch": getattr(self, "current_epoch", 0), "local_step": 0})
            state = {**position, "global_step": self.global_step}
            if getattr(self, "rank", 0) == 0:
                path = self.checkpointer.path / INTERRUPTED / STATE_NAME
                path.write_text(json.dumps(state))  # written last: its presence marks the save complete
            _interrupted.update(saved=True, state=state)
        return result

    cls.train_epoch = train_epoch
    cls.maybe_save_checkpoint = maybe_save_checkpoint
    cls._eagle3_progress = True
    return True


def interruption() -> dict | None:
    """None if this process's trainer was not interrupted; else {"saved": bool, "state": position}."""
    if not _interrupted["requested"]:
        return None
    return {"saved": _interrupted["saved"], "state": _interrupted["state"]}
