"""The training loader copies the next batch to the GPU while this step computes: one runtime change.

speculators' trainer copies each batch (Kimi-K2.5: ~1.9 GB at 32K tokens) with
`.to(device, non_blocking=True)` on the compute stream right before the forward, so the copy
and the wait for the loader sit between steps. `DevicePrefetchLoader` takes batches from the
loader in a thread as soon as they are ready and issues their copies on a side stream; the
trainer's own `.to(device)` then finds them on the device already (measured on an H200:
bench/README.md, "Levers, one at a time"). `install` wraps `speculators.train.cli.create_train_val_loaders`
so the training loader is wrapped; the validation loader is left as it is.

A batch check can ride along (`batch_check`, set by compat/sample_check.py): it is launched on the
copy stream right after the batch's copy, and the producer thread waits for its small result before
it hands the batch on. The thread runs ahead of the trainer, so that wait costs the training loop
nothing while the loader keeps up, and a batch that fails the check never reaches the trainer (the
check's exception ends the epoch in the training thread, like a loader error).

Gate: only with CUDA (there is no copy to hide on the CPU).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from .samples_record import packed_batches


class DevicePrefetchLoader:
    """Wraps a training DataLoader: batch i+1 is copied to the GPU while step i computes.

    The consumer waits on the copy's event (on the GPU, not the host) and `record_stream`
    keeps the allocator from reusing the memory before the compute stream is done with it.
    Everything else (len, batch_sampler, set_epoch) is the wrapped loader's.
    """

    # Per-step numbers the trainer turns into device tensors with `torch.tensor(x,
    # device=...)`: from a Python int that is a blocking host-to-device copy, which makes the
    # host wait for the backward pass every step, so the GPU idles while the host then
    # launches the optimizer and the next forward. Staged here as device tensors, the same
    # call becomes a device-side copy and the host stays a step ahead.
    DEVICE_SCALARS = ("error_records",)

    def __init__(self, loader: Any, device: Any, depth: int = 2):
        self.loader = loader
        self.device = device
        self.depth = depth
        # compat/sample_check.DeviceBatchCheck: launch(cpu batch, device batch) -> pending, on the copy
        # stream; verdict(pending, the batch's dataset indices or None) raises for a bad batch
        self.batch_check: Any = None

    def planned_batches(self) -> list | None:
        """The dataset indices of each batch this iter() will yield, in order (speculators' packing
        sampler; after a mid-epoch resume its cache holds the epoch's remaining batches), or None."""
        sampler = getattr(self.loader, "batch_sampler", None)
        # None (another sampler): the check names no rows on a hit that no file explains
        return packed_batches(sampler, sampler.epoch) if hasattr(sampler, "epoch") else None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self):
        import torch

        device = torch.device(self.device)
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        done = object()

        def offer(item: Any) -> bool:
            """Queue `item` unless the consumer has gone (then give up without blocking)."""
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        check = self.batch_check
        planned = self.planned_batches() if check is not None else None  # before the loader's iter()

        def produce() -> None:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            try:
                for position, batch in enumerate(self.loader):
                    with torch.cuda.stream(stream):
                        moved = {k: v.to(device, non_blocking=True)
                                 if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                        for key in self.DEVICE_SCALARS:
                            if isinstance(moved.get(key), (int, float)):
                                moved[key] = torch.tensor(moved[key], device=device)
                        pending = check.launch(batch, moved) if check is not None else None
                        event = torch.cuda.Event()
                        event.record(stream)
                    if check is not None:
                        event.synchronize()  # this thread only: the trainer's stream never waits on it
                        rows = planned[position] if planned is not None and position < len(planned) else None
                        check.verdict(pending, rows)
                    if not offer((moved, event)):
                        return
                offer(done)
            except BaseException as error:  # hand loader errors to the training thread
                offer(error)

        thread = threading.Thread(target=produce, daemon=True, name="device-prefetch")
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                moved, event = item
                compute = torch.cuda.current_stream(device)
                compute.wait_event(event)
                for value in moved.values():
                    if isinstance(value, torch.Tensor):
                        value.record_stream(compute)
                yield moved
        finally:
            # A loader with persistent workers hands the next epoch's iter() the same worker
            # iterator: the producer must be gone before the trainer starts another epoch
            # (after an early break, e.g. --max-steps, it may still be fetching a batch).
            stop.set()
            thread.join(timeout=120)


def apply() -> bool:
    """Wrap speculators' training loader in `DevicePrefetchLoader`; only with CUDA.

    Returns whether it installed (idempotent). Call before `speculators.train.cli.main`.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    import speculators.train.cli as train_cli

    create_loaders = train_cli.create_train_val_loaders
    if getattr(create_loaders, "_device_prefetch", False):
        return True

    def create_with_prefetch(*args: Any, **kwargs: Any):
        from speculators.train.distributed import get_local_rank

        train_loader, val_loader = create_loaders(*args, **kwargs)
        return DevicePrefetchLoader(train_loader, torch.device("cuda", get_local_rank())), val_loader

    create_with_prefetch._device_prefetch = True  # type: ignore[attr-defined]
    train_cli.create_train_val_loaders = create_with_prefetch
    return True
