"""Which training samples each rank trained on: one JSON line per optimizer step, per rank.

speculators' sampler (`MultipackDistributedBatchSamplerV2`) gives every rank its own share of
each global batch and drops the last few rows of an epoch when fewer than world-size remain;
nothing records the split. `Trainer.train_epoch` is wrapped so that after each optimizer step
the rank appends {"epoch", "local_step", "global_step", "rank", "samples", "left_out"} to
`<save-path>/logs/samples/rank-<R>.jsonl`: the train-split row indices of the batch that step
trained on, read from the sampler's own batch list for that epoch (the one its resume skip
slices), and how many of them the loader left out of it (`--on-bad-sample skip`: the batch's own
`error_records`, so `trained` counts what the step really trained on). It runs after the step, so
a killed rank's file ends at its last finished step; a resume redoes the steps after its checkpoint
and appends them again, so the record of a step is the last line with its (epoch, local_step)
(`samples_per_epoch`, `trained`).

Gate: speculators 0.9.0 (the sampler's `_generate_batches` and the trainer's resume fields were
read from it); elsewhere nothing is recorded and training is unchanged.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..files import append_line
from .gate import speculators_supported

SUPPORTED_SPECULATORS = ("0.9.0",)
SAMPLES_DIRNAME = "samples"  # under <save-path>/logs/


def packed_batches(sampler, epoch: int) -> list[list[int]] | None:
    """The dataset indices of each batch of `epoch`, in order, from speculators' packing sampler (its
    cache after a mid-epoch resume), or None for a sampler without that private API. The one reader of
    `_generate_batches` (this record, device_prefetch's planned batches, finite_loss's step rows)."""
    generate = getattr(sampler, "_generate_batches", None)
    if generate is None:
        return None
    return [[int(i) for i in batch] for batch in generate(epoch)]  # noqa: SLF001


def record_dir(save_path: str | Path) -> Path:
    return Path(save_path) / "logs" / SAMPLES_DIRNAME


def apply() -> bool:
    if not speculators_supported(SUPPORTED_SPECULATORS):
        return False
    import speculators.train.trainer as trainer

    cls = trainer.Trainer
    if getattr(cls, "_eagle3_samples_record", False):
        return True
    original_train_epoch = cls.train_epoch

    def train_epoch(self, epoch, *, step_callback=None):
        sampler = self.train_loader.batch_sampler
        if getattr(sampler, "_generate_batches", None) is None:
            return original_train_epoch(self, epoch, step_callback=step_callback)
        # Read before speculators clears it: the steps of this epoch a resume skips.
        skipped = getattr(self, "_resume_local_step", 0) if epoch == getattr(self, "current_epoch", epoch) else 0
        sampler.set_epoch(epoch)
        batches = packed_batches(sampler, epoch)
        rank = int(getattr(self, "rank", 0) or 0)
        path = record_dir(self.checkpointer.path) / f"rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        position = {"local_step": skipped}
        loader = self.train_loader
        counter = self.train_loader = _LeftOutCounter(loader)  # for this epoch's loop; every attribute is the loader's

        def recorded():
            position["local_step"] += 1
            step = position["local_step"]
            entry = {"epoch": epoch, "local_step": step, "global_step": self.global_step - 1, "rank": rank,  # as in metrics.jsonl
                     "samples": batches[step - 1] if step <= len(batches) else None,
                     "left_out": counter.last_left_out}
            append_line(path, json.dumps(entry), f"recording which samples global step {entry['global_step']} trained on")
            if step_callback is not None:
                step_callback()

        try:
            return original_train_epoch(self, epoch, step_callback=recorded)
        finally:
            self.train_loader = loader

    cls.train_epoch = train_epoch
    cls._eagle3_samples_record = True
    return True


class _LeftOutCounter:
    """The training loader as the epoch's loop sees it, noting each batch's `error_records` (the samples
    speculators' collate left out of it: unavailable or skipped) as the loop takes the batch: the step
    callback, which runs after that batch's optimizer step, reads it (an int in the batch: no device sync)."""

    def __init__(self, loader):
        self.loader = loader
        self.last_left_out = 0

    def __getattr__(self, name: str):
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            left_out = batch.get("error_records", 0) if isinstance(batch, dict) else 0
            self.last_left_out = int(left_out.item() if hasattr(left_out, "item") else left_out)
            yield batch


def read_records(save_path: str | Path) -> list[dict]:
    """Every rank's records, in file order (a line cut by a kill is skipped)."""
    out = []
    folder = record_dir(save_path)
    for path in sorted(folder.glob("rank-*.jsonl")) if folder.is_dir() else ():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def samples_per_epoch(save_path: str | Path) -> dict[int, list[int]]:
    """{epoch: every sample index trained on in it, over all ranks}, with each (epoch, step, rank)
    counted once: its last record (a resume redoes the steps after its checkpoint)."""
    last: dict[tuple[int, int, int], list[int]] = {}
    for entry in read_records(save_path):
        last[(entry["epoch"], entry["local_step"], entry["rank"])] = entry["samples"] or []
    epochs: dict[int, list[int]] = defaultdict(list)
    for (epoch, _step, _rank), samples in sorted(last.items()):
        epochs[epoch].extend(samples)
    return dict(epochs)


def trained(save_path: str | Path) -> dict[str, int]:
    """{"optimizer_steps", "samples"}: the run's optimizer steps, and the samples its steps trained on (a
    sample once per epoch that trained on it, over all ranks; those the loader left out not counted), each
    step counted once (its last record: a resume redoes the steps after its checkpoint)."""
    last: dict[tuple[int, int, int], dict] = {}
    for entry in read_records(save_path):
        last[(entry["epoch"], entry["local_step"], entry["rank"])] = entry
    trained_on = {key: max(0, len(entry.get("samples") or ()) - int(entry.get("left_out") or 0)) for key, entry in last.items()}
    # a step whose every sample was left out, on every rank, took no optimizer step (compat/finite_loss.py)
    steps = {(epoch, step) for (epoch, step, _rank), count in trained_on.items() if count}
    return {"optimizer_steps": len(steps), "samples": sum(trained_on.values())}


def world_size_of(save_path: str | Path) -> int:
    """How many ranks left a record (for a check that every rank did)."""
    folder = record_dir(save_path)
    return len(list(folder.glob("rank-*.jsonl"))) if folder.is_dir() else 0

