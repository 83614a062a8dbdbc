"""One output format and one validator for every extraction backend.

Per dataset row i, the row's file (hidden_states.py: its name and storage) holds (speculators' layout):
- `hidden_states` [T, n_aux + 1, H]: the residual stream after each aux layer, then the
  final decoder layer's output *before* the final norm (speculators applies the frozen
  verifier norm + lm_head to that last slot to get target logits);
- `token_ids` [T]: the row's input_ids, to prove the states belong to that row;
- with `--storage fp8` (speculators' fp8 format, read by its `--hidden-states-backend fp8`):
  `hidden_states` in float8_e4m3fn and `hidden_states_scales` [T, 1, 1] float32, one scale per
  token, quantized by hs-connectors' own function (the one its vLLM fp8 connector uses), so the
  files are bit-compatible with what speculators' FP8Transfer dequantizes.
Backends yield `ExtractedSample`s (tensors, or a file vLLM already wrote into a staging
directory); `land_sample` validates each one and renames it into place atomically.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from ..disk_writes import landing_writeback, start_writeback
from ..errors import InputError
from ..files import COPIED_SINCE, atomic_path, atomic_save_safetensors, changed_fingerprints, remove_path, temp_path_for
from ..files import write_fingerprints as write
from ..hidden_states import DTYPES, dtype_name, hs_file

# Local imports: hs_connectors: imported for fp8 storage only.

FP8 = torch.float8_e4m3fn
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY

log = logging.getLogger("eagle3")


@dataclass
class ExtractedSample:
    index: int
    hidden_states: torch.Tensor | None = None  # [T, n, H]
    token_ids: torch.Tensor | None = None  # [T]
    staged_file: Path | None = None  # a file written by the backend elsewhere
    # For a staged file another process may still be writing: blocks until it is complete, returns
    # why it never will be (or None). Called by land_sample, on stage 02's writer threads.
    ready: Callable[[], str | None] | None = None


class ExtractionBackend(Protocol):
    """Backends take (row index, token ids) pairs and yield one ExtractedSample per row."""

    def extract(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]: ...

    def close(self) -> None: ...


class BadHiddenStates(InputError):
    """A hidden-state file that must not be trained on; the message says why."""


# A layer slot whose values spread less than this (relative to their magnitude, or absolutely below 1)
# is a constant written by a broken backend, not a residual stream: real states of a trained or
# random model spread by O(1) (the miniature's smallest slot spread is > 0.1).
CONSTANT_SLOT_RTOL = 1e-6
# fp8 files: a constant written by a broken backend comes back from per-token quantization within
# e4m3's rounding (3 mantissa bits: half a step is 2^-4 of the value), so "constant" there means a
# spread within twice that; real states spread by more than their own magnitude.
CONSTANT_SLOT_RTOL_FP8 = 2.0**-3


def token_ids_problem(token_ids: list[int], expected_ids: list[int], where: str) -> str | None:
    if token_ids == list(expected_ids):
        return None
    first = next((i for i, (a, b) in enumerate(zip(token_ids, expected_ids)) if a != b),
                 min(len(token_ids), len(expected_ids)))
    return (f"{where}: token_ids do not equal the dataset row's input_ids (first difference at position {first}, "
            f"{len(token_ids)} vs {len(expected_ids)} tokens: the file of another row, or the data was re-prepared)")


def _spelled(dtype) -> str:
    """A dtype as torch spells it, from a torch dtype or a safetensors header name ('BF16' -> 'bfloat16')."""
    text = str(dtype).removeprefix("torch.")
    try:
        return DTYPES[dtype_name(text)].torch
    except ValueError:
        return text


def dtype_problem(found, expected, where: str) -> str | None:
    """The states stored in another dtype than the directory's (torch dtypes or safetensors names), or None."""
    found, expected = _spelled(found), _spelled(expected)
    if found == expected:
        return None
    return f"{where}: hidden_states dtype {found}, the directory's is {expected} (--dtype): files are never mixed"


def shape_problem(shape: list[int], expected_ids: list[int], num_slots: int, hidden_size: int, where: str) -> str | None:
    expected_shape = [len(expected_ids), num_slots, hidden_size]
    if list(shape) == expected_shape:
        return None
    detail = ""
    if len(shape) == 3 and shape[1] == num_slots - 1:
        detail = " (one layer slot short: the final layer is missing, as vLLM before PR #46973 did for DeepSeek backbones)"
    return f"{where}: hidden_states shape {list(shape)} != expected {expected_shape}{detail}"


def slot_checks(hidden_states: torch.Tensor, repeat_rtol: float = 0.0) -> torch.Tensor:
    """What the value checks look at, per layer slot: [3, n] float32 = each slot's max, its min, and 1.0 where
    every token holds the first token's vector (exactly, or within `repeat_rtol` of the slot's magnitude).

    Two passes over the values in their own dtype (max/min of floats are exact, and NaN/Inf show in them) plus one
    comparison with the first token: a few whole-tensor ops, so stage 02 can afford them per row. The same function
    runs on the device inside vLLM (compat/hidden_states_connector.py, before the file is written) and here on a
    file read back: one definition of what is checked."""
    flat = hidden_states.reshape(hidden_states.shape[0], hidden_states.shape[1], -1)
    highs, lows = flat.amax(dim=(0, 2)).float(), flat.amin(dim=(0, 2)).float()
    if repeat_rtol == 0:
        repeated = (flat == flat[:1]).all(dim=2).all(dim=0)
    else:
        scale = torch.maximum(highs.abs(), lows.abs()).clamp(min=1.0)
        repeated = (flat - flat[:1]).abs().amax(dim=(0, 2)).float() <= repeat_rtol * scale
    return torch.stack([highs, lows, repeated.float()])


def judge_slot_checks(checks: list[list[float]], expected_ids: list[int], where: str,
                      rtol: float = CONSTANT_SLOT_RTOL) -> None:
    """Refuse NaN/Inf, all-zero slots, (near-)constant slots and one vector repeated for every token, from
    `slot_checks`' three rows (as lists)."""
    highs, lows, repeated = checks
    if not all(math.isfinite(v) for v in highs + lows):
        raise BadHiddenStates(f"{where}: hidden_states contain NaN/Inf")
    zero_slots = [s for s, (high, low) in enumerate(zip(highs, lows)) if high == 0 and low == 0]
    if zero_slots:
        raise BadHiddenStates(f"{where}: hidden_states layer slot(s) {zero_slots} are all zero")
    constant = [s for s, (high, low) in enumerate(zip(highs, lows)) if high - low <= rtol * max(abs(high), abs(low), 1.0)]
    if constant:
        raise BadHiddenStates(f"{where}: hidden_states layer slot(s) {constant} hold one constant value "
                              f"({highs[constant[0]]:.6g}); not a model's states")
    same = [s for s, flag in enumerate(repeated) if flag]
    if same and len(set(expected_ids)) > 1:  # different tokens never share one state in every layer
        raise BadHiddenStates(f"{where}: hidden_states layer slot(s) {same} are the same for every token "
                              f"(one vector repeated); not a model's states")


def check_hidden_states(
    hidden_states: torch.Tensor, token_ids: torch.Tensor, expected_ids: list[int],
    num_slots: int, hidden_size: int, where: str, dtype: torch.dtype | None = None,
    scales: torch.Tensor | None = None,
) -> None:
    """Refuse silently-bad states: another row's file, wrong shape (e.g. final layer missing), another
    dtype than the directory's, NaN/Inf, zero or (near-)constant slots, every token the same state;
    for fp8 files also a missing, misshapen, non-finite or non-positive scale (checked on the
    dequantized values)."""
    if problem := token_ids_problem(token_ids.tolist(), expected_ids, where):
        raise BadHiddenStates(problem)
    if dtype is not None and (problem := dtype_problem(hidden_states.dtype, dtype, where)):
        raise BadHiddenStates(problem)
    if problem := shape_problem(list(hidden_states.shape), expected_ids, num_slots, hidden_size, where):
        raise BadHiddenStates(problem)
    is_fp8 = hidden_states.dtype == FP8
    # a slot this close to constant, and tokens this close to one repeated vector, are refused
    rtol, repeat_rtol = (CONSTANT_SLOT_RTOL_FP8, CONSTANT_SLOT_RTOL_FP8) if is_fp8 else (CONSTANT_SLOT_RTOL, 0.0)
    if is_fp8:
        hidden_states = dequantize_fp8(hidden_states, scales, where)
    elif scales is not None:
        raise BadHiddenStates(f"{where}: {SCALES_KEY} beside {str(hidden_states.dtype).removeprefix('torch.')} states "
                              f"(only fp8 files carry scales)")
    judge_slot_checks(slot_checks(hidden_states, repeat_rtol).tolist(), expected_ids, where, rtol)


def quantize_fp8(states: torch.Tensor) -> dict[str, torch.Tensor]:
    """speculators' fp8 file tensors: hs-connectors' per-token quantization (bit-compatible with FP8Transfer)."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    fp8, scales = quantize_tensor_to_fp8(states)
    return {"hidden_states": fp8.contiguous(), SCALES_KEY: scales.contiguous()}


def dequantize_fp8(fp8: torch.Tensor, scales: torch.Tensor | None, where: str) -> torch.Tensor:
    """fp8 values x their per-token scale, in float32 (what the value checks look at)."""
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    expected = (fp8.shape[0], 1, 1)
    if scales is None or tuple(scales.shape) != expected or scales.dtype != torch.float32:
        got = "none" if scales is None else f"{str(scales.dtype).removeprefix('torch.')} {list(scales.shape)}"
        raise BadHiddenStates(f"{where}: fp8 hidden_states need {SCALES_KEY} float32 {list(expected)}, found {got}")
    if not (torch.isfinite(scales).all() and (scales > 0).all()):
        raise BadHiddenStates(f"{where}: {SCALES_KEY} hold non-finite or non-positive scales")
    return dequantize_fp8_tensor(fp8, scales, dtype=torch.float32)


def load_hidden_states_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for truncated/garbled files
        raise BadHiddenStates(f"{path}: unreadable safetensors ({str(exc).splitlines()[0][:120]})") from None
    missing = {"hidden_states", "token_ids"} - data.keys()
    if missing:
        raise BadHiddenStates(f"{path}: missing tensors {sorted(missing)}")
    return data


# Our vLLM connector (compat/hidden_states_connector.py) computes `slot_checks` on the device, from the very tensor it
# copies out and writes, and stores them in the file's safetensors header under this key (JSON of the three rows).
SLOT_CHECKS_KEY = "eagle3_slot_checks"
_MAX_HEADER_BYTES = 1 << 24
_TOKEN_IDS_DTYPE = "I64"


def _read_header(handle, path: Path, size: int) -> tuple[dict, int]:
    """A safetensors file's header (8-byte little-endian length, then JSON) and where its data starts."""
    prefix = handle.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
        raise BadHiddenStates(f"{path}: unreadable safetensors (header length {length} in a {size}-byte file)")
    try:
        header = json.loads(handle.read(length))
    except ValueError as exc:
        raise BadHiddenStates(f"{path}: unreadable safetensors header ({exc})") from None
    return header, 8 + length


def land_checked_file(path: Path, expected_ids: list[int], num_slots: int, hidden_size: int, dtype: torch.dtype) -> bool:
    """Check a file our connector wrote without reading its states back: the header (tensor names, dtype, shape, and
    offsets that end exactly at the file's size: a truncated or padded file is refused), the token ids' bytes, an fp8
    file's scales (finite, positive), and the connector's slot checks judged as `check_hidden_states` judges them, in
    the same order. False: the header carries no checks (vLLM's stock connector wrote it), so the caller reads the
    file back (`validate_file`)."""
    where = str(path)
    is_fp8 = dtype == FP8
    names = {"hidden_states", "token_ids"} | ({SCALES_KEY} if is_fp8 else set())
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        header, data_start = _read_header(handle, path, size)
        checks = (header.get("__metadata__") or {}).get(SLOT_CHECKS_KEY)
        if checks is None:
            return False
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        if set(entries) != names:
            raise BadHiddenStates(f"{where}: tensors {sorted(entries)}, expected {sorted(names)}")
        try:
            states, ids = entries["hidden_states"], entries["token_ids"]
            (begin, end), ends = ids["data_offsets"], [int(e["data_offsets"][1]) for e in entries.values()]
            ids_dtype, ids_shape, states_dtype, states_shape = ids["dtype"], ids["shape"], states["dtype"], states["shape"]
            scales = entries.get(SCALES_KEY)
            scales_span = scales and (scales["dtype"], scales["shape"], *map(int, scales["data_offsets"]))
        except (KeyError, TypeError, ValueError):
            raise BadHiddenStates(f"{where}: unreadable safetensors header (malformed tensor entries)") from None
        if data_start + max(ends) != size:
            raise BadHiddenStates(f"{where}: unreadable safetensors ({size} bytes, its header says "
                                  f"{data_start + max(ends)}: truncated or padded)")
        if ids_dtype != _TOKEN_IDS_DTYPE or len(ids_shape) != 1 or end - begin != 8 * ids_shape[0]:
            raise BadHiddenStates(f"{where}: token_ids {ids_dtype} {ids_shape}, expected {_TOKEN_IDS_DTYPE} [T]")
        handle.seek(data_start + begin)
        raw = handle.read(end - begin)
        if scales_span:
            scales_dtype, scales_shape, scales_begin, scales_end = scales_span
            if (scales_dtype != "F32" or scales_shape != [ids_shape[0], 1, 1]
                    or scales_end - scales_begin != 4 * ids_shape[0]):
                raise BadHiddenStates(f"{where}: fp8 hidden_states need {SCALES_KEY} float32 [{ids_shape[0]}, 1, 1], "
                                      f"found {scales_dtype} {scales_shape}")
            handle.seek(data_start + scales_begin)
            scale_values = array("f", handle.read(scales_end - scales_begin))
            if not all(math.isfinite(v) and v > 0 for v in scale_values):
                raise BadHiddenStates(f"{where}: {SCALES_KEY} hold non-finite or non-positive scales")
    if raw != array("q", expected_ids).tobytes():
        raise BadHiddenStates(token_ids_problem(array("q", raw).tolist(), expected_ids, where))
    if problem := dtype_problem(states_dtype, dtype, where):
        raise BadHiddenStates(problem)
    if problem := shape_problem(states_shape, expected_ids, num_slots, hidden_size, where):
        raise BadHiddenStates(problem)
    try:
        rows = json.loads(checks)
        valid = len(rows) == 3 and all(len(row) == num_slots for row in rows)
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise BadHiddenStates(f"{where}: malformed {SLOT_CHECKS_KEY} in the header")
    judge_slot_checks([[float(v) for v in row] for row in rows], expected_ids, where,
                      CONSTANT_SLOT_RTOL_FP8 if is_fp8 else CONSTANT_SLOT_RTOL)
    return True


def validate_file(path: Path, expected_ids: list[int], num_slots: int, hidden_size: int,
                  dtype: torch.dtype | None = None) -> None:
    data = load_hidden_states_file(path)
    check_hidden_states(data["hidden_states"], data["token_ids"], expected_ids, num_slots, hidden_size, str(path), dtype,
                        data.get(SCALES_KEY))


# How `land_sample` landed a row (`hows`; stage 02's manifest counts them): our connector's file from its header
# alone, a file read back in full, a bf16 file read back and quantized to fp8 here, tensors from the HF backend.
LANDED_FROM_HEADER, LANDED_READ_BACK, LANDED_QUANTIZED_HERE, LANDED_TENSORS = "header", "read_back", "quantized_here", "tensors"


def land_sample(sample: ExtractedSample, hs_dir: Path, expected_ids: list[int], num_slots: int,
                hidden_size: int, dtype: torch.dtype, hows: list[str] | None = None) -> Path:
    """Validate one backend result and move it to its row's file (`hs_file`) atomically; appends how to `hows`."""
    final = hs_file(hs_dir, sample.index)
    hows = [] if hows is None else hows  # list.append: safe from the landing threads
    if sample.ready is not None and (problem := sample.ready()):
        raise BadHiddenStates(problem)
    if sample.staged_file is not None and land_checked_file(sample.staged_file, expected_ids, num_slots, hidden_size,
                                                            dtype):
        hows.append(LANDED_FROM_HEADER)  # our connector's file, fp8 quantized on the device too
        return _land_staged(sample.staged_file, final, written_by_our_writer=True)
    if sample.staged_file is not None and dtype != FP8:  # the stock connector's file: read back in full
        validate_file(sample.staged_file, expected_ids, num_slots, hidden_size, dtype)
        hows.append(LANDED_READ_BACK)
        return _land_staged(sample.staged_file, final, written_by_our_writer=False)
    hows.append(LANDED_TENSORS if sample.staged_file is None else LANDED_QUANTIZED_HERE)
    if sample.staged_file is not None:  # fp8 from the stock connector: its bf16 file checked, then quantized here
        validate_file(sample.staged_file, expected_ids, num_slots, hidden_size)
        staged = load_hidden_states_file(sample.staged_file)
        sample = ExtractedSample(sample.index, staged["hidden_states"], staged["token_ids"], sample.staged_file)
    token_ids = sample.token_ids.to(torch.long).contiguous()
    tensors = quantize_fp8(sample.hidden_states) if dtype == FP8 else {"hidden_states": sample.hidden_states.to(dtype).contiguous()}
    check_hidden_states(tensors["hidden_states"], token_ids, expected_ids, num_slots, hidden_size, f"row {sample.index}", dtype,
                        tensors.get(SCALES_KEY))
    atomic_save_safetensors({**tensors, "token_ids": token_ids}, final)
    if sample.staged_file is not None:
        remove_path(sample.staged_file)
        remove_path(sample.staged_file.with_name(sample.staged_file.name + ".lock"))
    return final


def _land_staged(staged: Path, final: Path, written_by_our_writer: bool) -> Path:
    _rename_into_place(staged, final)
    remove_path(staged.with_name(staged.name + ".lock"))
    if landing_writeback(written_by_our_writer):
        start_writeback(final)  # the disk starts on it now, not at the kernel's threshold (disk_writes.py)
    return final


def _rename_into_place(src: Path, final: Path) -> None:
    """A validated, complete staged file becomes `final` by renames only: into the temp name every writer here
    uses (a kill before the last rename leaves a temp the rerun removes), then onto `final`. No fsync per file
    (on a virtual disk each costs milliseconds, and from many landing threads they queue: the largest per-row
    cost stage 02 had, bench/README.md): `sync_filesystem` makes all landed files durable with one call before
    stage 02's manifest says they are there; a crash (not a power loss) loses nothing a rename already did.
    Staging on another disk: copied into the temp (`atomic_path`, which flushes that copy)."""
    tmp = temp_path_for(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(src, tmp)  # same filesystem: a rename
    except OSError:
        with atomic_path(final) as copy:
            shutil.copyfile(src, copy)
        src.unlink(missing_ok=True)
        return
    try:
        os.replace(tmp, final)
    except BaseException:
        remove_path(tmp)
        raise


def validate_all(hs_dir: Path, rows: dict[int, list[int]], num_slots: int, hidden_size: int,
                 progress: bool = True, dtype: torch.dtype | None = None) -> dict[int, str]:
    """Check every file; returns {row index: reason} for files to redo (missing ones too)."""
    bad: dict[int, str] = {}
    for index, ids in tqdm(sorted(rows.items()), desc="validate hidden states", disable=not progress, unit="file"):
        path = hs_file(hs_dir, index)
        if not path.is_file():
            bad[index] = "missing"
            continue
        try:
            validate_file(path, ids, num_slots, hidden_size, dtype)
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



# --- what stage 02 wrote, by size and a cheap fingerprint (files.py; a rerun compares them with the disk) ---

def write_fingerprints(hs_dir: Path, indices: Iterable[int]) -> dict:
    return write(hs_dir, [hs_file(hs_dir, i).name for i in indices])


def changed_files(hs_dir: Path, indices: Iterable[int]) -> dict[int, str] | None:
    """Rows whose file differs from what stage 02 recorded (size, then fingerprint), with how; None: no record."""
    by_name = {hs_file(hs_dir, i).name: i for i in indices}
    changed = changed_fingerprints(hs_dir, list(by_name))
    return None if changed is None else {by_name[name]: how for name, how in changed.items()}


def redo_changed_files(hs_dir: Path, changed: dict[int, str], rows: list[list[int]], num_slots: int, hidden_size: int,
                       dtype: torch.dtype | None = None, recheck_all: bool = False) -> tuple[list[int], list[int]]:
    """A finished 02's rerun over files that differ from its record (changed_files): a file whose size, sampled bytes
    or in-place modification time differ is deleted (the rerun extracts it again: a value changed to another finite
    one passes every check, so it is never re-validated and kept); one only copied since (COPIED_SINCE: its bytes
    cannot be told from the record) or every file, when the record itself cannot be trusted (`recheck_all`), is
    re-validated and deleted if bad. Returns (redone, re-checked) row indices."""
    redo = {i: how for i, how in changed.items() if not recheck_all and how != COPIED_SINCE}
    recheck = {i: rows[i] for i in changed if i not in redo and i < len(rows)}
    bad = validate_all(hs_dir, recheck, num_slots, hidden_size, progress=False, dtype=dtype)
    lines = [f"{hs_file(hs_dir, i)}: changed since stage 02 wrote it ({how})" for i, how in redo.items()] + list(bad.values())
    for line in lines[:5]:
        log.warning("%s; redoing it", line)  # each line names the file
    if len(lines) > 5:
        log.warning("... and %d other file(s) redone", len(lines) - 5)
    for index in [*redo, *bad]:
        hs_file(hs_dir, index).unlink(missing_ok=True)
    return sorted([*redo, *bad]), sorted(recheck)
