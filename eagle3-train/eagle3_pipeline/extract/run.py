"""Stage 02's loop: which rows to do, backend calls, landing, retries, resume, preflight."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from collections import Counter
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config.schema import ExtractConfig
from ..disk_writes import landing_writeback, sync_filesystem
from ..errors import ConfigError, StageError
from ..files import atomic_write_json, lock_held_elsewhere, remove_dead_writers_temps, writer_host
from ..hidden_states import DTYPES, StateFormat, dtype_name, hs_file
from ..preflight import preflight_extract
from ..stage import lock_output
from ..target import TargetInfo
from .common import BadHiddenStates, ExtractionBackend, land_sample, partition_indices, validate_file
from .hf import HfBackend
from .vllm_backend import VllmBackend, engine_staging_owner

log = logging.getLogger("eagle3")

# Rows landed or waiting to land, at most: the backend's loop waits beyond it (a disk slower than the
# engine) instead of holding every row's states in memory (the HF backend yields tensors).
MAX_UNLANDED = 64


@dataclass
class ExtractPlan:
    rows: dict[int, list[int]]  # this rank's rows: index -> input_ids
    all_indices: list[int]  # every rank's rows (for "is the whole job done?")
    todo: list[int]
    num_slots: int
    hidden_size: int
    dtype: torch.dtype  # of the saved files (FP8 with --storage fp8)
    counts: dict = field(default_factory=dict)
    compute_dtype: torch.dtype = torch.bfloat16  # of the backend's forward pass (--dtype)


def quick_file_ok(path: Path, expected_ids: list[int], num_slots: int, hidden_size: int,
                  dtype: torch.dtype | None = None) -> bool:
    """Cheap resume check: header readable, token ids equal, shape and dtype right (reads no hidden states)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            states = handle.get_slice("hidden_states")
            if states.get_shape() != [len(expected_ids), num_slots, hidden_size]:
                return False
            if dtype is not None and states.get_dtype() != DTYPES[dtype_name(str(dtype))].safetensors:
                return False
            return handle.get_tensor("token_ids").tolist() == expected_ids
    except Exception:
        return False


def plan_extraction(cfg: ExtractConfig, rows: list[list[int]], num_slots: int, hidden_size: int, hs_dir: Path,
                    selection: list[int] | None = None) -> ExtractPlan:
    all_indices = list(range(len(rows))) if selection is None else list(selection)  # --rows: one slice
    mine = partition_indices(all_indices, cfg.world_size, cfg.rank)
    by_index = {i: rows[i] for i in mine}
    dtype = StateFormat.from_config(cfg).torch_dtype  # every file the directory holds (never mixed)
    done = [i for i in mine if hs_file(hs_dir, i).is_file()
            and quick_file_ok(hs_file(hs_dir, i), rows[i], num_slots, hidden_size, dtype)]
    stale = [i for i in mine if hs_file(hs_dir, i).is_file() and i not in set(done)]
    for i in stale if not cfg.check else []:  # wrong row/shape (e.g. the data was re-prepared): redo it
        hs_file(hs_dir, i).unlink()
    todo = [i for i in mine if i not in set(done)]
    return ExtractPlan(by_index, all_indices, todo, num_slots, hidden_size, dtype,
                       {"rows_this_rank": len(mine), "skipped_done": len(done), "stale_removed": len(stale)},
                       compute_dtype=StateFormat.from_config(cfg).compute_torch_dtype)


def preflight(cfg: ExtractConfig, plan: ExtractPlan, target: TargetInfo, hs_dir: Path) -> list[str]:
    """Estimate what the rows still to do need (disk, GPUs, memory, vLLM version); see preflight.py."""
    tokens = sum(len(plan.rows[i]) for i in plan.todo)
    return preflight_extract(cfg, target, plan.num_slots, len(plan.todo), tokens, hs_dir)


def run_extraction(backend: ExtractionBackend, plan: ExtractPlan, hs_dir: Path, retries: int) -> dict[int, str]:
    """Extract plan.todo; each failed row is retried `retries` times. Returns {row: reason} of rows that never passed.

    Every pending row goes to the backend in one call (it orders and feeds them itself); each sample it yields is
    landed on the backend's `landing_threads` writer threads (1 if it names none: rows then land in the order they
    come). Adds the rate of the work to plan.counts (`extract_s`, `extracted_tokens`, `extract_tokens_per_s`:
    engine start excluded, landing included).
    """
    landing_writeback()  # a bad EAGLE3_LANDING_WRITEBACK stops the run here, not in the first landing
    pending = list(plan.todo)
    failures: dict[int, str] = {}
    started, started_at, landed_tokens, hows = time.monotonic(), time.time(), 0, []
    writers = int(getattr(backend, "landing_threads", 1))
    with tqdm(total=len(plan.todo), desc="extract", unit="row") as bar:
        for attempt in range(retries + 1):
            failures = {}
            unlanded: dict[Future, int] = {}  # in submission order

            def collect(block: str | None = None) -> None:
                """Take the finished landings in submission order (the first error raised is the first row's)."""
                nonlocal landed_tokens
                if block:
                    wait(unlanded, return_when=block)
                for future in [f for f in unlanded if f.done()]:
                    index = unlanded.pop(future)
                    try:
                        future.result()  # DiskFull and any other error end the run here
                    except BadHiddenStates as exc:
                        failures[index] = str(exc)
                        continue
                    landed_tokens += len(plan.rows[index])
                    bar.update(1)

            pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="land")
            samples = backend.extract([(i, plan.rows[i]) for i in pending])
            try:
                for sample in samples:
                    unlanded[pool.submit(land_sample, sample, hs_dir, plan.rows[sample.index], plan.num_slots,
                                         plan.hidden_size, plan.dtype, hows)] = sample.index
                    collect(FIRST_COMPLETED if len(unlanded) >= MAX_UNLANDED else None)
                collect(ALL_COMPLETED)
            finally:
                for future in unlanded:  # an error or a signal: rows not started stay unlanded (a rerun does them)
                    future.cancel()
                pool.shutdown(wait=True)
                close = getattr(samples, "close", None)
                if close is not None:  # a generator stopped early: the backend stops its requests
                    close()
            missing = [i for i in pending if i not in failures and not hs_file(hs_dir, i).is_file()]
            reasons = getattr(backend, "failed", {})  # a backend may say why it skipped a row
            failures.update({i: reasons.get(i, "backend returned no file") for i in missing})
            bar.set_postfix(failed=len(failures), attempt=attempt + 1)
            if not failures:
                break
            log.warning("attempt %d: %d row(s) failed validation, e.g. %s", attempt + 1, len(failures), next(iter(failures.values())))
            pending = sorted(failures)
    seconds = time.monotonic() - started
    # The files were renamed into place without an fsync each (common._rename_into_place): one flush of the
    # filesystem makes them durable before the manifest is written. Timed on its own: the kernel writes most
    # bytes back during a long run anyway; at the end of a short one this is the disk's write time.
    synced = time.monotonic()
    sync_filesystem(hs_dir)
    plan.counts.update(extract_s=round(seconds, 3), extracted_tokens=landed_tokens,
                       extract_tokens_per_s=round(landed_tokens / seconds, 1) if seconds > 0 else None,
                       sync_s=round(time.monotonic() - synced, 3), landed=dict(Counter(hows)),
                       extract_started_at=round(started_at, 3))
    log.info("extracted %d token(s) in %.1fs: %.0f tokens/s (engine start excluded); flushed to disk in %.1fs",
             landed_tokens, seconds, landed_tokens / seconds if seconds > 0 else 0.0, plan.counts["sync_s"])
    return failures


def validate_sample_of_files(plan: ExtractPlan, hs_dir: Path, count: int, seed: int = 0) -> dict[int, str]:
    indices = sorted(plan.rows)
    if count >= 0:
        indices = sorted(random.Random(seed).sample(indices, min(count, len(indices))))
    bad = {}
    for i in tqdm(indices, desc="re-validate", unit="file"):
        try:
            validate_file(hs_file(hs_dir, i), plan.rows[i], plan.num_slots, plan.hidden_size, plan.dtype)
        except BadHiddenStates as exc:
            bad[i] = str(exc)
    return bad


def redo_list_path(hs_dir: Path, world_size: int = 1, rank: int = 0) -> Path:
    """The rows a rerun redoes; one list per rank (ranks on two nodes fail rows at once)."""
    return hs_dir / ("redo.json" if world_size == 1 else f"redo.rank{rank}-of-{world_size}.json")


def write_redo_list(hs_dir: Path, bad: dict[int, str], world_size: int = 1, rank: int = 0) -> Path:
    path = redo_list_path(hs_dir, world_size, rank)
    atomic_write_json(path, {"rows": sorted(bad), "reasons": {str(k): v for k, v in sorted(bad.items())}})
    return path


def all_rows_landed(hs_dir: Path, indices: list[int]) -> bool:
    return all(hs_file(hs_dir, i).is_file() for i in indices)


# NFS clients cache a directory's listing and its absent names until its attributes are read again (acdirmax, 60 s
# by default), so a file another node landed a moment ago can look missing here for that long.
LISTING_GRACE_S = 75.0
LISTING_POLL_S = 5.0


def every_ranks_rows_landed(hs_dir: Path, indices: list[int], world_size: int) -> bool:
    """Whether every row's file is in hs_dir once this rank's are. With --world-size > 1 the rank that finds them all
    writes the manifest; ranks on two nodes that finish within a minute of each other could each miss the other's
    newest files (the listing above) and leave no manifest, so one that sees rows missing looks again, from a fresh
    listing, for LISTING_GRACE_S before it leaves the manifest to a rank still running."""
    deadline = time.monotonic() + (LISTING_GRACE_S if world_size > 1 else 0.0)
    names = [hs_file(hs_dir, i).name for i in indices]
    while True:
        listed = set(os.listdir(hs_dir))
        if all(name in listed for name in names):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(LISTING_POLL_S)


def fail_rows(bad: dict[int, str], hs_dir: Path, what: str, world_size: int = 1, rank: int = 0) -> StageError:
    path = write_redo_list(hs_dir, bad, world_size, rank)
    first = next(iter(sorted(bad.items())))
    return StageError(f"{what}: {len(bad)} row(s) bad (listed in {path}), first: row {first[0]}: {first[1]}; rerun to redo them")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def staging_dir(cfg: ExtractConfig, hs_dir: Path) -> Path:
    return Path(cfg.staging_dir) if cfg.staging_dir else hs_dir / ".staging"


# The settings every rank must share to split the same rows (flag -> ExtractConfig field): each one changes the list of
# rows the ranks partition (extract.common.partition_indices), so a rank with another value extracts some rows twice and
# leaves some to no rank.
RANK_SHARED = {"--max-samples": "max_samples", "--rows": "rows"}


def rank_counts(world_size: int, rank: int) -> dict:
    """What the manifest's counts say of whose they are (manifest.ExtractCounts.counts_of): with several ranks, all
    but rows and tokens are the writing rank's."""
    return {"counts_of": f"rank {rank} of {world_size} (rows and tokens: every rank's)"} if world_size > 1 else {}


def rank_record_path(hs_dir: Path, world_size: int, rank: int) -> Path:
    """A live rank's record of the settings its share of the rows depends on (RANK_SHARED), beside its lock."""
    return hs_dir / f".eagle3.rank{rank}-of-{world_size}.json"


def lock_extraction(hs_dir: Path, world_size: int, rank: int, shared: dict | None = None) -> None:
    """One writer per directory; --world-size > 1: ranks share it, one process per rank. `shared`: this rank's values
    of RANK_SHARED (by flag), recorded beside its lock and compared with every other live rank's record."""
    if world_size == 1:
        lock_output(hs_dir)
        return
    lock_output(hs_dir, exclusive=False)
    lock_output(hs_dir, lock_file=hs_dir / f".eagle3.rank{rank}-of-{world_size}.lock")
    if shared is not None:  # written before the others' are read: of two ranks starting at once, one sees the other's
        atomic_write_json(rank_record_path(hs_dir, world_size, rank), shared)
        for other in range(world_size):
            lock = hs_dir / f".eagle3.rank{other}-of-{world_size}.lock"
            if other == rank or not lock.is_file() or not lock_held_elsewhere(lock):
                continue  # a rank that has ended is no objection (a rerun may change --max-samples for all)
            try:
                theirs = json.loads(rank_record_path(hs_dir, world_size, other).read_text())
            except (OSError, ValueError):
                continue  # not written yet: that rank reads this one's record when it gets there
            for flag, value in shared.items():
                if flag in theirs and theirs[flag] != value:
                    raise ConfigError(f"{rank_record_path(hs_dir, world_size, other)}: rank {other} of {world_size} is "
                                      f"extracting into {hs_dir} now with {flag} {json.dumps(theirs[flag])}, this rank "
                                      f"with {json.dumps(value)}; every rank needs the same {flag} (each splits the "
                                      f"same rows), so rerun this rank with that value")
    # Ranks split the rows by --world-size: one started with another would extract some rows twice and some never.
    for lock in sorted(hs_dir.glob(".eagle3.rank*-of-*.lock")):
        other = re.fullmatch(r"\.eagle3\.rank\d+-of-(\d+)\.lock", lock.name)
        if other and int(other[1]) != world_size and lock_held_elsewhere(lock):
            raise ConfigError(f"{lock}: a rank started with --world-size {other[1]} is extracting into {hs_dir} now; "
                              f"every rank needs the same --world-size (this one: {world_size})")
    remove_dead_writers_temps(hs_dir)  # the shared files' temps (manifest, fingerprints) of this host's killed ranks


def make_backend(cfg: ExtractConfig, target, layer_ids, hs_dir: Path, max_model_len: int, dtype):
    if cfg.backend == "hf":
        return HfBackend(target, layer_ids, dtype, cfg.device, cfg.trust_remote_code)

    staging = staging_dir(cfg, hs_dir)
    staging.mkdir(parents=True, exist_ok=True)
    if not cfg.endpoint:
        remove_dead_engines_staging(staging)
    return VllmBackend(cfg, target, layer_ids, staging, max_model_len)


def remove_dead_engines_staging(staging: Path) -> list[Path]:
    """The staging folders of this host's in-process engines killed with -9 (every request's states, never
    landed): removed once that pid is gone here. Another host's folders are left alone: ranks on other nodes
    share the staging directory, and their pids mean nothing on this one."""
    removed = []
    host = writer_host()
    for folder in staging.iterdir():
        owner = engine_staging_owner(folder)
        if owner is None or owner[1] != host or owner[0] == os.getpid() or not folder.is_dir():
            continue
        try:
            os.kill(owner[0], 0)
            continue  # alive: another extraction's engine on this machine
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.info("removed %d staging folder(s) of vLLM engines that were killed (%s)", len(removed), removed[0])
    return removed
