"""Every saved epoch keeps its own validation metrics: one wrapper of `Trainer.maybe_update_best`.

speculators 0.9.0 writes `<epoch>/val_metrics.json` only when that epoch's validation loss is a new lowest
(`maybe_update_best` returns before `save_val_metrics` otherwise). A checkpoint whose loss rose is then
indistinguishable from one killed before its validation: stage 04's choice by offline tau
(train_report.choose_checkpoint) left it out as "not validated" though its tau may be the highest (the loss and
tau part ways: DeepSpec issue #84), stage 05 exported it without its figures, and the bench's screen stopped at it.
Seen on the CPU: a Qwen2.5 testbed screen whose no-fc-norm run's second epoch (tau 1.06 against 1.00) had a higher
validation loss than its first.

The wrapper runs speculators' own method unchanged (its `checkpoint_best` and best loss stay by loss), then writes the
epoch's metrics, exactly as speculators would, into the epoch's folder when that folder was saved and holds none yet:
rank 0 only, atomically (temp + rename). No learning changes. Gate: speculators 0.9.0 (the method read from it).
"""

from __future__ import annotations

import json

from ..files import atomic_write_text
from .gate import require_speculators

SUPPORTED_SPECULATORS = ("0.9.0",)
_applied = False


def apply() -> bool:
    global _applied

    if _applied:
        return True
    require_speculators("epoch_val_metrics", SUPPORTED_SPECULATORS, "speculators/train/trainer.py maybe_update_best")
    import torch.distributed as dist
    from speculators.train import trainer

    original = trainer.Trainer.maybe_update_best

    def maybe_update_best(self, epoch: int, val_metrics: dict | None):
        original(self, epoch, val_metrics)
        if not val_metrics or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
            return
        path = self.checkpointer.val_metrics_path(epoch)
        if path.parent.is_dir() and not path.exists():  # an epoch checkpoint_freq did not save has no folder
            atomic_write_text(path, json.dumps(val_metrics))

    maybe_update_best._eagle3_epoch_val_metrics = True  # what tests/test_compat.py looks for
    trainer.Trainer.maybe_update_best = maybe_update_best
    _applied = True
    return True
