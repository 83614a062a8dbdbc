"""A non-finite training loss stops training before its optimizer step: one Trainer subclass. With
`--on-bad-sample skip`, a step whose every sample was left out (on every rank) takes no optimizer step.

speculators 0.9.0's `Trainer.train_epoch` runs forward, backward, gradient clipping and
`_optimizers_step` whatever the loss is: one NaN loss turns every weight into NaN, the run goes on
with exit 0 and each later checkpoint is a NaN draft. The subclass keeps the training forward's
loss (a forward hook on the model, which returns `(draft_tokens, loss, metrics)`) and checks it in
`_optimizers_step`, before any optimizer steps: a non-finite loss raises one line naming the global
step and the step's samples (the batch sampler's rows for that step: stage 02's row files,
hidden_states.py). Cost: one device-to-host read of the loss per step (bench/train_throughput.py --loader-check
both measures tokens/s with and without every input check).

Gate: stage 04's sample-check settings are set (compat/sample_check.py, same switch) and
speculators is 0.9.0 (private names: `_optimizers_step`, the sampler's `_generate_batches`).
"""

from __future__ import annotations

from ..hidden_states import rows_label
from . import sample_check
from .gate import require_speculators
from .samples_record import packed_batches

SUPPORTED_SPECULATORS = ("0.9.0",)
_applied = False


def apply() -> bool:
    global _applied

    if sample_check.settings() is None:
        return False
    if _applied:
        return True
    require_speculators("finite_loss", SUPPORTED_SPECULATORS, "speculators/train/trainer.py")
    import speculators.train.cli as cli

    cli.Trainer = finite_loss_trainer(cli.Trainer)  # after cpu_trainer, which may have replaced it
    _applied = True
    return True


def finite_loss_trainer(base: type) -> type:
    import torch

    class FiniteLossTrainer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._eagle3_loss = None
            self._eagle3_epoch, self._eagle3_step_in_epoch = 0, 0
            self.model.register_forward_hook(self._eagle3_keep_loss)
            self._eagle3_docs = None
            if (sample_check.settings() or {}).get("on_bad") == "skip":  # only then can a step lose every sample
                self.model.register_forward_pre_hook(self._eagle3_keep_docs, with_kwargs=True)

        def _eagle3_keep_docs(self, _module, _args, kwargs):
            ids = kwargs.get("document_ids")
            if self.model.training and ids is not None:
                self._eagle3_docs = (ids >= 0).any()  # padding is -1: an all-left-out batch has no document

        def _eagle3_keep_loss(self, _module, _inputs, output):
            if self.model.training and isinstance(output, tuple) and len(output) >= 2:
                self._eagle3_loss = output[1]

        def train_epoch(self, epoch, *args, **kwargs):
            self._eagle3_epoch, self._eagle3_step_in_epoch = epoch, 0
            return super().train_epoch(epoch, *args, **kwargs)

        def _optimizers_step(self):
            self._eagle3_step_in_epoch += 1
            loss = self._eagle3_loss
            if loss is not None and not bool(torch.isfinite(loss.detach()).all().item()):
                self._eagle3_stop(loss)
            if self._eagle3_docs is not None and not self._eagle3_any_sample():
                # --on-bad-sample skip left out every sample of this step, on every rank: no optimizer step
                # (AdamW's weight decay and moments would still move the weights, trained on nothing).
                return None
            return super()._optimizers_step()

        def _eagle3_any_sample(self) -> bool:
            """Whether any rank's batch of this step holds a sample (all ranks step alike: one all-reduce)."""
            import torch.distributed as dist

            flag = self._eagle3_docs.to(torch.int32).reshape(1)
            self._eagle3_docs = None
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag)
            return bool(flag.item())

        def _eagle3_rows(self) -> list[int] | None:
            batches = packed_batches(getattr(self.train_loader, "batch_sampler", None), self._eagle3_epoch)
            step = self._eagle3_step_in_epoch - 1
            # a sampler without that API (or a step past its list): the step alone
            return sorted(batches[step]) if batches is not None and 0 <= step < len(batches) else None

        def _eagle3_stop(self, loss):
            rows = self._eagle3_rows()
            problem = (f"non-finite training loss ({loss.detach().float().item()}) at global step {self.global_step}, "
                       f"epoch {self._eagle3_epoch} (rows {rows_label(rows)}); stopped before its optimizer step, so no weight was "
                       f"changed by it")
            config = sample_check.settings() or {}
            sample_check.record(config.get("record"), {"file": None, "rows": rows, "reason": problem, "action": "stop"})
            raise sample_check.BadSample(f"{sample_check.BAD_SAMPLE_TAG}{problem}")

    return FiniteLossTrainer
