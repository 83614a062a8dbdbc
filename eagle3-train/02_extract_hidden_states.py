#!/usr/bin/env python3
"""Stage 02: run the target and save aux-layer + final hidden states per row.

Writes one file per row into DATA/hidden_states/ (eagle3_pipeline/hidden_states.py; `hidden_states` [T, 4, H] = residual stream
after the 3 aux layers and the final layer before the final norm; `token_ids` [T]) in
speculators' layout (or its fp8 format with --storage fp8), each validated (token ids,
shape, finite, non-constant) before it is renamed into place. Backends: vLLM (real targets, tensor parallel) and HF transformers
(small targets, debugging). Resumable: a rerun skips rows whose file is already valid.
Run with --help for flags and an example.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from eagle3_pipeline.config import ExtractConfig, resolve_stage_config
from eagle3_pipeline.contract import (
    input_record,
    manifest_path,
    read_manifest,
    require_equal,
    require_written_files,
    write_manifest,
)
from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.extract.common import write_fingerprints
from eagle3_pipeline.extract.run import (
    RANK_SHARED,
    all_rows_landed,
    every_ranks_rows_landed,
    lock_extraction,
    plan_extraction,
    preflight,
    rank_counts,
    staging_dir,
)
from eagle3_pipeline.extract.upkeep import (
    extract_rows,
    tidy_before_extracting,
    unchanged_since_written,
    validate_existing,
)
from eagle3_pipeline.files import check_writable_dir
from eagle3_pipeline.hidden_states import HS_DIRNAME
from eagle3_pipeline.manifest import ExtractCounts, ExtractManifest
from eagle3_pipeline.plan import check_plan_lines
from eagle3_pipeline.prepared import load_rows, prepared_outputs
from eagle3_pipeline.slices import parse_rows, release
from eagle3_pipeline.stage import config_fingerprint, finished, log, read_own_manifest, stage_identity, stage_main
from eagle3_pipeline.target import extraction_layer_ids, load_target_info


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, sources = resolve_stage_config(ExtractConfig, argv)
    data_dir = Path(cfg.data)
    hs_dir = data_dir / HS_DIRNAME
    target = load_target_info(cfg.target)
    layer_ids = extraction_layer_ids(target.num_layers, cfg.layer_ids)

    # 2. Contract: stage 01's manifest must come from this target and tokenizer.
    prepared = read_manifest(data_dir, "prepare", "--data")
    require_written_files(prepared, prepared_outputs(data_dir))  # the rows this stage feeds the target
    hint = "rerun 01_prepare_dataset.py for this target, or pass the --target it was prepared for"
    require_equal("target config", target.config_sha256, prepared.target["config_sha256"], prepared, hint)
    require_equal("tokenizer", target.tokenizer_sha256, prepared.target["tokenizer_sha256"], prepared, hint)
    max_model_len = cfg.max_model_len or prepared.max_seq_len + 1
    if cfg.print_server_cmd:
        from eagle3_pipeline.extract.vllm_backend import server_command

        print(shlex.join(server_command(cfg, target, layer_ids, staging_dir(cfg, hs_dir), max_model_len)))
        return 0
    # One identity rule (stage.finished): a change of stage 01's output re-checks every file (rows whose
    # token ids still match are kept); a change of target, layer ids or dtype is refused (never mixed).
    identity = stage_identity(cfg, {"prepare": prepared.content_sha256}, layer_ids=layer_ids,
                              target_config_sha256=target.config_sha256)
    check_writable_dir(hs_dir, "--data")
    if not cfg.check:
        lock_extraction(hs_dir, cfg.world_size, cfg.rank, {flag: getattr(cfg, name) for flag, name in RANK_SHARED.items()})
    total_rows = prepared.counts.rows
    rows = load_rows(data_dir, cfg.max_samples)
    # --rows: one slice of a sliced run (eagle3_pipeline/slices.py); the manifest records it as `selection`
    selection = parse_rows(cfg.rows, len(rows)) if cfg.rows else None
    wanted = selection if selection is not None else list(range(total_rows))
    if cfg.validate_only:
        validate_existing(cfg, hs_dir, rows, selection, len(layer_ids), target.hidden_size)
        return 0
    remedy = f"move {hs_dir} away (or rerun 01 into a new --output) to extract again"
    same_selection = getattr(read_own_manifest(hs_dir), "selection", None) == cfg.rows
    if finished(hs_dir, "extract", identity, check=cfg.check, input_change_redoes=True, remedy=remedy,
                extra_done=same_selection and all_rows_landed(hs_dir, wanted)) and not cfg.check:
        # The manifest says finished; its files must still be what this stage wrote (else they are redone).
        if unchanged_since_written(cfg, hs_dir, wanted, rows, len(layer_ids), target.hidden_size):
            # Nothing to redo, and the manifest is left as it is (stages 03/04 recorded its content).
            log.info("%s: already extracted with these settings; nothing to do (--validate re-checks every file)", hs_dir)
            return 0
    if selection is not None and (own := read_own_manifest(hs_dir)) and own.complete and not own.selection:
        raise ConfigError(f"{manifest_path(hs_dir)}: a finished extraction of every row is there; --rows (a sliced run) "
                          f"would delete most of it: train on it unsliced, or move {hs_dir} away first")
    if selection is not None and not cfg.check:  # the previous slice's files go first: one slice on disk at a time
        if released := release(hs_dir, keep=set(selection)):
            log.info("--rows %s: deleted %d file(s) of rows outside it that this stage wrote (manifest kept in %s)",
                     cfg.rows, len(released), hs_dir / "slices")
    plan = plan_extraction(cfg, rows, len(layer_ids), target.hidden_size, hs_dir, selection)
    if plan.counts["stale_removed"]:
        log.warning("removed %d file(s) whose token ids or shape do not match their row; they are redone",
                    plan.counts["stale_removed"])

    # 3. Preflight before any heavy work (prints the estimate even when it passes).
    for line in preflight(cfg, plan, target, hs_dir):
        log.info("preflight %s", line)
    if cfg.check:  # and the whole run's plan: bytes per format, disk, reads, hours (the profile's training)
        for line in check_plan_lines(cfg.target, data_dir, sources.profile):
            log.info("%s", line)
        return 0
    tidy_before_extracting(cfg, hs_dir, plan, total_rows)
    # An unfinished manifest records the identity from the first file on (a rerun with another dtype
    # or layer ids is then refused instead of mixing files).
    write_manifest(hs_dir, ExtractManifest(complete=False, identity=identity, layer_ids=layer_ids, dtype=cfg.dtype,
                                           storage=cfg.storage, selection=cfg.rows, rows_total=total_rows))

    # 4. Work.
    log.info("extracting %d row(s) (%d already done) with the %s backend, layer ids %s",
             len(plan.todo), plan.counts["skipped_done"], cfg.backend, layer_ids)
    extract_rows(cfg, target, layer_ids, hs_dir, max_model_len, plan)

    # 5. Contract last, once every rank's rows are in (with --world-size > 1 the last rank to finish writes it).
    if not every_ranks_rows_landed(hs_dir, plan.all_indices, cfg.world_size):
        log.info("rank %d/%d done; the rank that finishes last writes the manifest (if none did: rerun any rank)",
                 cfg.rank, cfg.world_size)
        return 0
    for listed in hs_dir.glob("redo*.json"):  # every row listed there (by any rank) has been redone
        listed.unlink(missing_ok=True)
    fingerprints = write_fingerprints(hs_dir, plan.all_indices)  # what a rerun compares with the disk
    covered = len(plan.all_indices)
    tokens = sum(len(rows[i]) for i in plan.all_indices)
    if covered < total_rows and selection is None:
        log.warning("%d of stage 01's %d rows extracted (--max-samples %d): the manifest says complete: false, so "
                    "stage 04 refuses these states until a run without --max-samples adds the rest",
                    covered, total_rows, cfg.max_samples)
    write_manifest(hs_dir, ExtractManifest(
        complete=covered == total_rows or selection is not None, identity=identity,
        layer_ids=layer_ids, dtype=cfg.dtype, storage=cfg.storage, target_config_sha256=target.config_sha256,
        config=cfg.model_dump(), config_sha256=config_fingerprint(cfg), inputs={"prepare": input_record(prepared)},
        target=target.summary(), backend=cfg.backend, fingerprints=fingerprints,
        shapes={"hidden_states": ["T", len(layer_ids), target.hidden_size], "token_ids": ["T"]},
        counts=ExtractCounts(rows=covered, tokens=tokens, **plan.counts, **rank_counts(cfg.world_size, cfg.rank)),
        selection=cfg.rows, rows_total=total_rows,
    ))
    log.info("hidden states for %d rows -> %s", covered, hs_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
