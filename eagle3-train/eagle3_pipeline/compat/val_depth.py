"""Validation unrolls as many TTT steps as the draft will be served with: one wrapper of Eagle3's trainer kwargs.

speculators 0.9.0 validates with the training `--ttt-steps`, so a draft trained 3 steps deep and served at k = 5
has no held-out accuracy for positions 4-5: its offline acceptance length (train_report.expected_accepted_length)
stops at k = 3, and a recipe screen cannot compare drafts trained at different depths at the k they serve.
`Eagle3DraftModel.get_trainer_kwargs` returns (train kwargs, val kwargs); the wrapper raises the val kwargs'
`ttt_steps` to stage 04's `--val-ttt-steps` (never lowers it). Training is unchanged; validation's loss then also
covers the extra steps (with the run's `--ttt-step-loss-decay`), which is what speculators' own best-by-loss compares
(stage 04 then picks the exported checkpoint by offline tau: train_report.choose_checkpoint).

Gate: stage 04 set `EAGLE3_VAL_TTT_STEPS` (training.export_compat_settings) deeper than training; speculators
0.9.0 (the method's name and its (train, val) return).
"""

from __future__ import annotations

import os

from .gate import require_speculators

SUPPORTED_SPECULATORS = ("0.9.0",)
ENV = "EAGLE3_VAL_TTT_STEPS"
_applied = False


def depth() -> int | None:
    value = os.environ.get(ENV)
    return int(value) if value else None


def apply() -> bool:
    global _applied

    if depth() is None:
        return False
    if _applied:
        return True
    require_speculators("val_depth", SUPPORTED_SPECULATORS, "speculators/models/eagle3/core.py get_trainer_kwargs")
    from speculators.models.eagle3 import core

    original = core.Eagle3DraftModel.get_trainer_kwargs

    def get_trainer_kwargs(**kwargs):
        train_kwargs, val_kwargs = original(**kwargs)
        val_kwargs = {**val_kwargs, "ttt_steps": max(int(val_kwargs["ttt_steps"]), depth())}
        return train_kwargs, val_kwargs

    get_trainer_kwargs._eagle3_val_depth = True  # what tests/test_compat.py looks for
    core.Eagle3DraftModel.get_trainer_kwargs = staticmethod(get_trainer_kwargs)
    _applied = True
    return True
