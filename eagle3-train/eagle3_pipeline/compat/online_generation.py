"""speculators' on-demand hidden-state generation (online/hybrid training): one gated subclass.

What speculators 0.9.0 does (train/data.py `ArrowDataset._get_raw_data`, train/recovery.py): a
sample whose states are neither cached nor generated after all retries is *dropped* from its batch,
and only 20 drops in a row in one loader worker stop the run. When the vLLM server dies that means
minutes of optimizer steps on partial or empty batches (every sample retries with backoff first),
then a circuit-breaker traceback. And `--on-generate cache` is gone (deprecated, no effect): it has
no way to keep what it generated.

The change, for stage 04's --hidden-states online/hybrid only:
- a sample that failed after speculators' own retries asks the server /v1/models once: when it does
  not answer, the sample is marked fatal with one line naming the endpoint (and every later sample
  of that worker fails at once), so speculators' recovery coordinator stops the run at that batch,
  before its optimizer step; the coordinator synchronises every step (not every 50), so DDP ranks
  stop at the same step. A sample that fails while the server answers keeps speculators' behaviour;
- hybrid: a sample generated (not read from the cache) and validated by speculators is written to
  its row file in `OUTPUT/hidden_states_cache/` (hidden_states.py; atomically: temp + rename), the name speculators'
  `get_cached` reads first (`--hidden-states-path`), as [T, n, H] + token_ids, exactly the file vLLM wrote.

It swaps `speculators.train.dataloader.ArrowDataset` for a subclass defined here: loader workers are
spawned and unpickle the dataset by its class's module, so a patched method would be lost there and
a subclass is not. Settings come from the environment (`online.MODE_ENV`, `online.CACHE_ENV`), which
every rank and worker inherits. Gate: the mode variable is set (files mode is untouched) and
speculators is 0.9.0 (the private method names); another speculators version raises.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..files import atomic_save_safetensors
from ..hidden_states import hs_file
from ..online import CACHE_ENV, ENDPOINT_DOWN_TAG, MODE_ENV, endpoint_problem
from .gate import require_speculators
from .sample_check import BAD_SAMPLE_TAG, generated_bad

SUPPORTED_SPECULATORS = ("0.9.0",)
_applied = False


def enabled() -> str | None:
    mode = os.environ.get(MODE_ENV)
    return mode if mode in ("online", "hybrid") else None


def apply() -> bool:
    global _applied
    if not enabled():
        return False
    if _applied:
        return True
    require_speculators("online_generation", SUPPORTED_SPECULATORS, "speculators/train/data.py before training online")
    import speculators.train.dataloader as dataloader
    import speculators.train.trainer as trainer

    dataloader.ArrowDataset = OnlineArrowDataset
    trainer._RECOVERY_SYNC_INTERVAL = 1  # a fatal sample stops every DDP rank at its own step
    _applied = True
    return True


def _base_class():
    from speculators.train.data import ArrowDataset

    return ArrowDataset


class OnlineArrowDataset(_base_class()):
    """ArrowDataset that stops on a dead endpoint and (hybrid) keeps what it generated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eagle3_mode = enabled()
        cache = os.environ.get(CACHE_ENV)
        self.eagle3_cache = Path(cache) if cache and self.eagle3_mode == "hybrid" else None
        self.eagle3_down: str | None = None

    def _get_raw_data(self, index):
        from speculators.train.recovery import SampleUnavailable

        if self.eagle3_down:
            return SampleUnavailable(reason=self.eagle3_down, counts_as_failure=True, fatal=True)
        file_idx = self._map_to_file_idx(index)
        cache_file = hs_file(self.eagle3_cache, file_idx) if self.eagle3_cache else None
        was_cached = cache_file is not None and cache_file.is_file()
        data = super()._get_raw_data(index)
        if isinstance(data, SampleUnavailable):
            if data.counts_as_failure and not data.fatal and BAD_SAMPLE_TAG in data.reason:
                return generated_bad(data.reason, file_idx)  # the server answers; the sample is bad
            if data.counts_as_failure and not data.fatal:  # generation failed after speculators' retries
                problem = endpoint_problem(self.vllm_endpoint)
                if problem:
                    self.eagle3_down = f"{ENDPOINT_DOWN_TAG}{problem} (dataset row {file_idx})"
                    return SampleUnavailable(reason=self.eagle3_down, counts_as_failure=True,
                                             consecutive_failures=data.consecutive_failures, fatal=True)
            return data
        if cache_file is not None and not was_cached:
            _keep(data, cache_file)
        return data


def _keep(data: dict, path: Path) -> None:
    """The generated sample as the file vLLM wrote: hidden_states [T, n_aux + 1, H], token_ids [T]."""
    import torch

    last = data["verifier_last_hidden_states"]  # [T, H]
    aux = data["hidden_states"]  # [T, n_aux * H]
    tokens, hidden = last.shape
    states = torch.cat([aux.reshape(tokens, -1, hidden), last.unsqueeze(1)], dim=1)
    atomic_save_safetensors({"hidden_states": states, "token_ids": data["input_ids"].to(torch.long)}, path)
