"""One output format and one validator for every extraction backend.

Per dataset row i, `hidden_states/hs_{i}.safetensors` holds (speculators' layout):
- `hidden_states` [T, n_aux + 1, H]: the residual stream after each aux layer, then the
  final decoder layer's output *before* the final norm (speculators applies the frozen
  verifier norm + lm_head to that last slot to get target logits);
- `token_ids` [T]: the row's input_ids, to prove the states belong to that row.
Backends yield `ExtractedSample`s (tensors, or a file vLLM already wrote into a staging
directory); `land_sample` validates each one and renames it into place atomically.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch

from ..errors import InputError
from ..files import atomic_path, atomic_save_safetensors, remove_path

HS_DIRNAME = "hidden_states"


def hs_file(hs_dir: Path, index: int) -> Path:
    return Path(hs_dir) / f"hs_{index}.safetensors"


@dataclass
class ExtractedSample:
    index: int
    hidden_states: torch.Tensor | None = None  # [T, n, H]
    token_ids: torch.Tensor | None = None  # [T]
    staged_file: Path | None = None  # a finished file written by the backend elsewhere


class ExtractionBackend(Protocol):
    """Backends take (row index, token ids) pairs and yield one ExtractedSample per row."""

    def extract(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]: ...

    def close(self) -> None: ...


class BadHiddenStates(InputError):
    """A hidden-state file that must not be trained on; the message says why."""


def check_hidden_states(
    hidden_states: torch.Tensor, token_ids: torch.Tensor, expected_ids: list[int],
    num_slots: int, hidden_size: int, where: str,
) -> None:
    """Refuse silently-bad states: wrong ids, wrong shape (e.g. final layer missing), NaN/Inf, zeros."""
    if token_ids.tolist() != list(expected_ids):
        raise BadHiddenStates(f"{where}: token_ids do not equal the dataset row's input_ids")
    expected_shape = (len(expected_ids), num_slots, hidden_size)
    if tuple(hidden_states.shape) != expected_shape:
        detail = ""
        if hidden_states.dim() == 3 and hidden_states.shape[1] == num_slots - 1:
            detail = " (one layer slot short: the final layer is missing, as vLLM before PR #46973 did for DeepSeek backbones)"
        raise BadHiddenStates(
            f"{where}: hidden_states shape {list(hidden_states.shape)} != expected {list(expected_shape)}{detail}"
        )
    if not torch.isfinite(hidden_states).all():
        raise BadHiddenStates(f"{where}: hidden_states contain NaN/Inf")
    flat = hidden_states.reshape(hidden_states.shape[0], num_slots, -1)
    zero_slots = [s for s in range(num_slots) if not flat[:, s].any()]
    if zero_slots:
        raise BadHiddenStates(f"{where}: hidden_states layer slot(s) {zero_slots} are all zero")


def load_hidden_states_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        data = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for truncated/garbled files
        raise BadHiddenStates(f"{path}: unreadable safetensors ({str(exc).splitlines()[0][:120]})") from None
    missing = {"hidden_states", "token_ids"} - data.keys()
    if missing:
        raise BadHiddenStates(f"{path}: missing tensors {sorted(missing)}")
    return data


def validate_file(path: Path, expected_ids: list[int], num_slots: int, hidden_size: int) -> None:
    data = load_hidden_states_file(path)
    check_hidden_states(data["hidden_states"], data["token_ids"], expected_ids, num_slots, hidden_size, str(path))


def land_sample(sample: ExtractedSample, hs_dir: Path, expected_ids: list[int], num_slots: int,
                hidden_size: int, dtype: torch.dtype) -> Path:
    """Validate one backend result and move it to `hs_{i}.safetensors` atomically."""
    final = hs_file(hs_dir, sample.index)
    if sample.staged_file is not None:
        validate_file(sample.staged_file, expected_ids, num_slots, hidden_size)
        with atomic_path(final) as tmp:
            _move_or_copy(sample.staged_file, tmp)
        remove_path(sample.staged_file.with_name(sample.staged_file.name + ".lock"))
        return final
    states = sample.hidden_states.to(dtype).contiguous()
    token_ids = sample.token_ids.to(torch.long).contiguous()
    check_hidden_states(states, token_ids, expected_ids, num_slots, hidden_size, f"row {sample.index}")
    atomic_save_safetensors({"hidden_states": states, "token_ids": token_ids}, final)
    return final


def _move_or_copy(src: Path, dst: Path) -> None:
    try:
        os.replace(src, dst)  # same filesystem: a rename
    except OSError:
        shutil.copyfile(src, dst)  # staging on another disk: copy into the temp, then rename
        src.unlink(missing_ok=True)


def find_done(hs_dir: Path, indices: Iterable[int]) -> set[int]:
    """Rows whose final file exists (a final name is only ever created by a rename)."""
    return {i for i in indices if hs_file(hs_dir, i).is_file()}


def validate_all(hs_dir: Path, rows: dict[int, list[int]], num_slots: int, hidden_size: int,
                 progress: bool = True) -> dict[int, str]:
    """Check every file; returns {row index: reason} for files to redo (missing ones too)."""
    from tqdm import tqdm

    bad: dict[int, str] = {}
    for index, ids in tqdm(sorted(rows.items()), desc="validate hidden states", disable=not progress, unit="file"):
        path = hs_file(hs_dir, index)
        if not path.is_file():
            bad[index] = "missing"
            continue
        try:
            validate_file(path, ids, num_slots, hidden_size)
        except BadHiddenStates as exc:
            bad[index] = str(exc)
    return bad


def partition_indices(indices: list[int], world_size: int, rank: int) -> list[int]:
    """Contiguous, disjoint, near-equal shares for several replicas/nodes (rank in [0, world_size))."""
    if not 0 <= rank < world_size:
        raise InputError(f"--rank {rank} must be in [0, --world-size {world_size})")
    chunk, extra = divmod(len(indices), world_size)
    start = rank * chunk + min(rank, extra)
    return indices[start:start + chunk + (1 if rank < extra else 0)]
