"""CPU compatibility layer for speculators 0.9.0's trainer (CI, laptops: no accelerator).

speculators' Trainer assumes an accelerator in five places: it moves the model to
`local_rank` (an int, i.e. cuda:0), autocasts with device_type "cuda" when no accelerator
is found, its step timer calls `torch.accelerator.synchronize()` (which raises without
one), its checkpointer maps loads to `get_current_device()` = "cuda:0", and under torchrun
its `maybe_setup_distributed` selects the accelerator's device and backend (NCCL). This
module swaps exactly those for CPU equivalents (gloo for the process group, so
`04_train.py --nproc 2` runs DDP on a CPU: the launch, rank-0 metrics, checkpoints and
resume of the multi-GPU path are tested in CI). Nothing else changes: the same model, loss,
optimizer, data loader, DDP wrapper, checkpoints, resume and metrics run.

It is safe because `apply()` refuses to do anything when an accelerator is present (the
GPU path must run speculators untouched) and checks the speculators version it was
written against. flex_attention has no CPU backward, so the CPU path also selects
`sdpa` attention and the eager loss (training.py does that).
"""

from __future__ import annotations

import os
import time

import torch

from .gate import require_speculators

SUPPORTED_SPECULATORS = ("0.9.0",)
_applied = False


def accelerator_present() -> bool:
    return torch.accelerator.current_accelerator() is not None


def apply() -> bool:
    """Patch speculators' trainer for CPU; returns True if applied, False if an accelerator exists."""
    global _applied
    if accelerator_present():
        return False
    if _applied:
        return True
    require_speculators("cpu_trainer", SUPPORTED_SPECULATORS, "speculators/train/trainer.py (the CPU trainer shim)")
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    class CpuTrainer(trainer.Trainer):
        def setup_trainer(self):
            # Runs first in Trainer.__init__, before the model is moved or autocast is used.
            self.local_rank = "cpu"
            self.device_type = "cpu"
            super().setup_trainer()

    class CpuStepTimer(trainer._StepTimer):
        # Same timings, without torch.accelerator.synchronize() (CPU work is synchronous).
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    import speculators.train.distributed as distributed

    setup_distributed = distributed.maybe_setup_distributed

    def cpu_maybe_setup_distributed(sp_size: int = 1) -> None:
        # speculators' own function, with gloo and no device selection (its first two steps).
        if "LOCAL_RANK" not in os.environ:
            return setup_distributed(sp_size)
        import torch.distributed as dist

        dist.init_process_group("gloo")
        distributed._local_rank = int(os.environ["LOCAL_RANK"])
        distributed._is_distributed = True
        distributed._rank, distributed._world_size = dist.get_rank(), dist.get_world_size()
        distributed._init_sp_process_groups(distributed._rank, distributed._world_size, sp_size)
        return None

    cli.Trainer = CpuTrainer
    cli.maybe_setup_distributed = cpu_maybe_setup_distributed
    trainer._StepTimer = CpuStepTimer
    checkpointer.get_current_device = lambda: "cpu"
    _applied = True
    return True
