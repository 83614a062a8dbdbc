"""A training process that stops making progress says where it is stuck, and stops: one runtime change.

A rank waiting on a collective another rank never joins, a loader worker stuck on a dead shared
filesystem, or a worker forked while another thread held a lock leaves the GPUs idle with nothing
more in the log, for as long as nobody looks (NCCL's own timeout covers collectives only). One was
seen on an H100: one of five trainings sharing the GPU stopped at its first validation for 20 minutes
(bench/README.md, results index, `h100-hold-2026-12-05b/`).

`apply` wraps four methods of speculators' Trainer: `train_epoch`, `val_epoch` and `maybe_save_checkpoint`
name the phase, `_optimizers_step` (every training step) and `_maybe_val_sync` (every validation batch,
called on one rank too) mark progress. A daemon thread watches the marks from the first training epoch
on. When none comes for the limit, it writes one line (phase, epoch, step, minutes), every thread's Python
stack (faulthandler) and the state of each child process (the loader workers), records the rank's exit
as an error, and ends the process with exit code 75 (`errors.Stalled`): a rerun resumes from the last
checkpoint. At the end of training it logs the longest wait it saw and records it in metrics.jsonl (`stall_watch`:
longest_wait_s, where, limit_s), so a limit can be set from a real run.

Gate: the limit in seconds in EAGLE3_STALL_S (stage 04 --stall-minutes; 0 or unset: off); speculators 0.9.0.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import Stalled
from ..metrics import is_rank_zero, write_record
from .gate import require_speculators

ENV = "EAGLE3_STALL_S"
RECORD_KEY = "stall_watch"
TAG = "stalled: no training step or validation batch"  # opens the line (and the rank's exit record)
SUPPORTED = ("0.9.0",)
log = logging.getLogger("eagle3_pipeline.compat.stall_watch")


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def child_states(pid: int | None = None) -> list[str]:
    """One line per child process of `pid` (default this one): pid, state and what it waits in (Linux /proc)."""
    pid = pid or os.getpid()
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    lines = []
    for child in children:
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            wchan = Path(f"/proc/{child}/wchan").read_text().strip() or "-"
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        lines.append(f"  child {child}: state {fields[0]}, waiting in {wchan}: {cmd}")
    return lines


class StallWatch:
    """Marks of progress and the thread that watches them. `on_stall(cause)` ends the process (tests pass their own)."""

    def __init__(self, limit_s: float, on_stall: Callable[[str], None], poll_s: float | None = None):
        self.limit_s = limit_s
        self.on_stall = on_stall
        self.poll_s = poll_s if poll_s is not None else min(30.0, max(0.05, limit_s / 20))
        self.phase = "starting"
        self.count = 0  # marks in this phase
        self.last = time.monotonic()
        self.longest = (0.0, "")
        self.armed = False
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def mark(self, phase: str | None = None) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.last > self.longest[0]:
                self.longest = (now - self.last, self.where())
            self.last = now
            if phase is not None:
                self.phase, self.count = phase, 0
            else:
                self.count += 1

    def where(self) -> str:
        return f"{self.phase}, {self.count} done" if self.count else self.phase

    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        self.thread = threading.Thread(target=self.watch, name="stall-watch", daemon=True)
        self.thread.start()

    def disarm(self) -> None:
        self.stop.set()
        self.armed = False

    def watch(self) -> None:
        while not self.stop.wait(self.poll_s):
            with self.lock:
                waited, where = time.monotonic() - self.last, self.where()
            if waited > self.limit_s:
                self.on_stall(f"{TAG} for {duration(waited)} (limit {duration(self.limit_s)}; {where})")
                return


def stop_process(save_path: Path | None) -> Callable[[str], None]:
    """What a stall does in a training process: the line, the stacks, the rank's exit record, then exit 75."""

    def stop(cause: str) -> None:
        rank = os.environ.get("RANK", "0")
        print(f"[rank {rank}] {cause}; every thread's stack and the child processes follow; stopping (exit "
              f"{Stalled.exit_code}): rerun the same command to resume from the last checkpoint, or raise 04 "
              f"--stall-minutes if this wait was expected", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print("\n".join(child_states()) or "  no child processes", file=sys.stderr, flush=True)
        if save_path is not None:
            from ..ranks import write_exit

            try:
                write_exit(save_path, "error", cause)  # stage 04's line names the rank and this
            except OSError:
                pass  # the stop matters more than its record (the filesystem may be what hangs)
        sys.stderr.flush()
        os._exit(Stalled.exit_code)  # the main thread is stuck: no exception would reach it

    return stop


WATCH: StallWatch | None = None


def apply(metrics_path: str | Path | None = None) -> bool:
    """Install the watch when EAGLE3_STALL_S holds a limit > 0; returns whether it installed (idempotent).
    `metrics_path`: where rank 0 records the run's longest wait."""
    limit = float(os.environ.get(ENV) or 0)
    if limit <= 0:
        return False
    require_speculators("stall_watch", SUPPORTED, "speculators.train.trainer.Trainer's train_epoch, val_epoch, "
                        "maybe_save_checkpoint, _optimizers_step, _maybe_val_sync and run_training")
    from speculators.train.trainer import Trainer

    if getattr(Trainer.run_training, "_stall_watch", False):
        return True

    def phase_of(method: Callable, name: str, inside: bool = False) -> Callable:
        """`inside`: a phase within another (a checkpoint saved mid-epoch): the outer one is named again after it."""

        @functools.wraps(method)
        def wrapper(self: Any, epoch: Any, *args: Any, **kwargs: Any):
            watch = WATCH
            if watch is None:
                return method(self, epoch, *args, **kwargs)
            outer = (watch.phase, watch.count)
            watch.mark(f"{name} epoch {epoch + 1 if isinstance(epoch, int) else epoch}")
            if name == "training":
                watch.arm()
            result = method(self, epoch, *args, **kwargs)
            if inside:
                watch.mark()
                with watch.lock:
                    watch.phase, watch.count = outer
            return result

        return wrapper

    def progress(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any):
            if WATCH is not None:
                WATCH.mark()
            return method(self, *args, **kwargs)

        return wrapper

    run_training = Trainer.run_training

    @functools.wraps(run_training)
    def watched_training(self: Any, *args: Any, **kwargs: Any):
        global WATCH
        save = getattr(self.config, "save_path", None)
        WATCH = StallWatch(limit, stop_process(Path(save) if save else None))
        try:
            return run_training(self, *args, **kwargs)
        finally:
            WATCH.disarm()
            waited, where = WATCH.longest
            log.info("stall watch: longest wait between progress marks %.0f s (%s); limit %.0f s", waited, where or "-", limit)
            if metrics_path is not None and is_rank_zero():
                write_record(metrics_path, {RECORD_KEY: {"longest_wait_s": round(waited, 3), "where": where,
                                                         "limit_s": limit}})

    watched_training._stall_watch = True  # type: ignore[attr-defined]
    Trainer.train_epoch = phase_of(Trainer.train_epoch, "training")
    Trainer.val_epoch = phase_of(Trainer.val_epoch, "validation")
    Trainer.maybe_save_checkpoint = phase_of(Trainer.maybe_save_checkpoint, "saving the checkpoint of", inside=True)
    Trainer._optimizers_step = progress(Trainer._optimizers_step)
    Trainer._maybe_val_sync = progress(Trainer._maybe_val_sync)
    Trainer.run_training = watched_training
    return True
