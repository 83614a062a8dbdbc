"""Stage 02 and the files already in DATA/hidden_states/: `--validate` (check every file, drop bad ones), a finished
extraction whose files changed since (redo them), the tidying before a run (stale temps, files past stage 01's rows),
and the extraction itself with its disk-full line. The script calls these in its order; each keeps its reason here.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config.schema import ExtractConfig
from ..contract import manifest_path
from ..errors import StageError
from ..files import DiskFull, fingerprints_problem, remove_stale_temps
from ..hidden_states import StateFormat, hs_file, row_of, rows_label
from ..sizing import human_bytes
from ..slices import files_past_rows
from ..stage import read_own_manifest
from ..target import TargetInfo
from .common import changed_files, partition_indices, redo_changed_files, validate_all
from .run import ExtractPlan, fail_rows, make_backend, run_extraction, validate_sample_of_files

log = logging.getLogger("eagle3")


def validate_existing(cfg: ExtractConfig, hs_dir: Path, rows: list[list[int]], selection: list[int] | None,
                      num_slots: int, hidden_size: int) -> None:
    """--validate: every file of this rank's rows checked in full; bad ones deleted (with the manifest) and listed in
    the redo list, raised as one line; a rerun redoes exactly those. Before planning: the plan would drop bad files
    without saying why."""
    mine = {i: rows[i] for i in partition_indices(selection or list(range(len(rows))), cfg.world_size, cfg.rank)}
    bad = validate_all(hs_dir, mine, num_slots, hidden_size, dtype=StateFormat.from_config(cfg).torch_dtype)
    if bad:
        for index in bad:
            hs_file(hs_dir, index).unlink(missing_ok=True)
        manifest_path(hs_dir).unlink(missing_ok=True)
        raise fail_rows(bad, hs_dir, "validation", cfg.world_size, cfg.rank)
    log.info("validated %d file(s): all good", len(mine))


def unchanged_since_written(cfg: ExtractConfig, hs_dir: Path, wanted: list[int], rows: list[list[int]],
                            num_slots: int, hidden_size: int) -> bool:
    """A finished extraction: True when its files are still what this stage wrote (size, fingerprint), by a record
    that is itself what this stage wrote; else the changed files are redone (gone or damaged record: every file is
    re-checked, and the record rewritten) and False (the run goes on to land them)."""
    changed = changed_files(hs_dir, wanted)
    if record_problem := fingerprints_problem(hs_dir, read_own_manifest(hs_dir).fingerprints):
        changed = dict.fromkeys(wanted, record_problem)
    if not changed:
        return True
    first = next(iter(changed.items()))
    log.warning("%d file(s) changed since stage 02 wrote them (first: %s: %s); changed ones are redone, copied "
                "ones re-checked", len(changed), hs_file(hs_dir, first[0]), first[1])
    redo_changed_files(hs_dir, changed, rows, num_slots, hidden_size,
                       dtype=StateFormat.from_config(cfg).torch_dtype, recheck_all=bool(record_problem))
    return False


def tidy_before_extracting(cfg: ExtractConfig, hs_dir: Path, plan: ExtractPlan, total_rows: int) -> None:
    """Temps a killed run left (a rank: only its own rows'), and row files past stage 01's rows (it was redone on
    other data): deleted only where a record of this stage lists them; a file by its name alone is never deleted."""
    remove_stale_temps(hs_dir, owned=None if cfg.world_size == 1 else lambda name: row_of(name) in plan.rows)
    past, unlisted = files_past_rows(hs_dir, total_rows)
    for extra in past:
        extra.unlink(missing_ok=True)
    if unlisted:
        log.warning("kept %d file(s) past stage 01's %d rows that no record of this stage lists (%s): not deleted by "
                    "name; move them away if they are not yours", len(unlisted), total_rows, unlisted[0])
    if past:
        log.warning("deleted %d row file(s) past stage 01's %d rows (it was redone since): %s", len(past), total_rows,
                    rows_label(sorted(row_of(path.name) for path in past)))


def extract_rows(cfg: ExtractConfig, target: TargetInfo, layer_ids: list[int], hs_dir: Path, max_model_len: int,
                 plan: ExtractPlan) -> None:
    """The plan's rows through the backend, then a sample of every file re-validated; rows that failed, a full disk
    (with the bytes the rows left need) and bad files are each one line (finished files are kept)."""
    if plan.todo:
        backend = make_backend(cfg, target, layer_ids, hs_dir, max_model_len, plan.compute_dtype)
        try:
            failures = run_extraction(backend, plan, hs_dir, cfg.retries)
        except DiskFull as exc:
            left = [i for i in plan.todo if not hs_file(hs_dir, i).is_file()]
            need = sum(len(plan.rows[i]) for i in left) * StateFormat.from_config(cfg).bytes_per_token(
                target.hidden_size, len(layer_ids))
            raise StageError(f"{exc}; the {len(left)} row(s) left need ~{human_bytes(need)} ({need:,} B); free space, "
                             f"then rerun (finished files are kept)") from None
        finally:
            backend.close()
        if failures:
            raise fail_rows(failures, hs_dir, "extraction", cfg.world_size, cfg.rank)
    bad = validate_sample_of_files(plan, hs_dir, cfg.validate_sample, seed=cfg.rank)
    if bad:
        for index in bad:
            hs_file(hs_dir, index).unlink(missing_ok=True)
        raise fail_rows(bad, hs_dir, "re-validation", cfg.world_size, cfg.rank)
