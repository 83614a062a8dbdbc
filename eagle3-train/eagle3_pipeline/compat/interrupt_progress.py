"""speculators' SIGTERM/Ctrl-C checkpoint made resumable: one runtime change (two methods).

`speculators.train.trainer.Trainer.train_epoch` and `.maybe_save_checkpoint` are wrapped so an
`interrupted/` save records the epoch and step it stopped at, and the stop is remembered for
stage 04 to report as an interruption (exit 130) instead of a finished run. The wrappers and
the resume logic that uses them live in `eagle3_pipeline.resume` (its docstring, gap 2); this
module is their entry in the compat layer.

Gate: speculators 0.9.0 only (the version the wrapped methods were read from); elsewhere a
warning and no change (the run still trains; an interrupt then needs a manual resume).
"""

from __future__ import annotations

from .. import resume


def apply() -> bool:
    """The compat-layer interface: True if the two methods were wrapped."""
    return resume.install_interrupt_progress()
