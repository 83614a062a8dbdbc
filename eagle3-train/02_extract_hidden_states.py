#!/usr/bin/env python3
"""Stage 02: run the target and save aux-layer + final hidden states per row.

Writes DATA/hidden_states/hs_{i}.safetensors (`hidden_states` [T, 4, H] = residual stream
after the 3 aux layers and the final layer before the final norm; `token_ids` [T]) in
speculators' layout, each validated (token ids, shape, finite, non-zero) before it is
renamed into place. Backends: vLLM (real targets, tensor parallel) and HF transformers
(small targets, debugging). Resumable: a rerun skips rows whose file is already valid.
Run with --help for flags and an example.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from eagle3_pipeline.config import ExtractConfig, resolve_stage_config
from eagle3_pipeline.contract import input_record, read_manifest, require_equal, write_manifest
from eagle3_pipeline.errors import ContractError
from eagle3_pipeline.extract.common import HS_DIRNAME, partition_indices, validate_all
from eagle3_pipeline.extract.run import (
    ROWS_PER_SLOT, all_rows_landed, fail_rows, plan_extraction, preflight, read_json, run_extraction, validate_sample_of_files,
)
from eagle3_pipeline.files import check_writable_dir, remove_stale_temps
from eagle3_pipeline.prepared import load_rows
from eagle3_pipeline.stage import config_fingerprint, log, stage_main
from eagle3_pipeline.target import extraction_layer_ids, load_target_info

# Settings that change the bytes of every file: mixing them in one directory is refused.
SHAPING_KEYS = ("layer_ids", "dtype", "target_config_sha256")


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(ExtractConfig, argv)
    data_dir = Path(cfg.data)
    hs_dir = data_dir / HS_DIRNAME
    target = load_target_info(cfg.target)
    layer_ids = extraction_layer_ids(target.num_layers, cfg.layer_ids)

    # 2. Contract: stage 01's manifest must come from this target and tokenizer.
    prepared = read_manifest(data_dir, "prepare", "--data")
    hint = "rerun 01_prepare_dataset.py for this target, or pass the --target it was prepared for"
    require_equal("target config", target.config_sha256, prepared["target"]["config_sha256"], prepared, hint)
    require_equal("tokenizer", target.tokenizer_sha256, prepared["target"]["tokenizer_sha256"], prepared, hint)
    max_model_len = cfg.max_model_len or prepared["max_seq_len"] + 1
    if cfg.print_server_cmd:
        from eagle3_pipeline.extract.vllm_backend import server_command

        print(shlex.join(server_command(cfg, target, layer_ids, staging_dir(cfg, hs_dir), max_model_len)))
        return 0
    shaping = {"layer_ids": layer_ids, "dtype": cfg.dtype, "target_config_sha256": target.config_sha256}
    check_same_shaping(hs_dir, shaping)
    check_writable_dir(hs_dir, "--data")
    remove_stale_temps(hs_dir)

    rows = load_rows(data_dir, cfg.max_samples)
    if cfg.validate_only:  # before planning: the plan would drop bad files without saying why
        mine = {i: rows[i] for i in partition_indices(list(range(len(rows))), cfg.world_size, cfg.rank)}
        bad = validate_all(hs_dir, mine, len(layer_ids), target.hidden_size)
        if bad:
            for index in bad:  # a rerun redoes exactly these
                (hs_dir / f"hs_{index}.safetensors").unlink(missing_ok=True)
            (hs_dir / "manifest.json").unlink(missing_ok=True)
            raise fail_rows(bad, hs_dir, "validation")
        log.info("validated %d file(s): all good", len(mine))
        return 0
    fingerprint = config_fingerprint(cfg, ignore=("rank", "world_size", "retries"))
    if finished_extraction(hs_dir, fingerprint, prepared, len(rows)) and not cfg.check:
        # Rewriting the manifest would change its hash and orphan stage 03/04 outputs built on it.
        log.info("%s: already extracted with these settings; nothing to do (--validate re-checks every file)", hs_dir)
        return 0
    plan = plan_extraction(cfg, rows, len(layer_ids), target.hidden_size, hs_dir)
    if plan.counts["stale_removed"]:
        log.warning("removed %d file(s) whose token ids or shape do not match their row; they are redone",
                    plan.counts["stale_removed"])

    # 3. Preflight before any heavy work (prints the estimate even when it passes).
    for line in preflight(cfg, plan, target, hs_dir):
        log.info("preflight %s", line)
    if cfg.check:
        return 0
    # An unfinished manifest records the shaping settings from the first file on.
    write_manifest(hs_dir, "extract", complete=False, **shaping)

    # 4. Work.
    log.info("extracting %d row(s) (%d already done) with the %s backend, layer ids %s",
             len(plan.todo), plan.counts["skipped_done"], cfg.backend, layer_ids)
    if plan.todo:
        backend = make_backend(cfg, target, layer_ids, hs_dir, max_model_len, plan.dtype)
        try:
            failures = run_extraction(backend, plan, hs_dir, cfg.retries, batch_rows=ROWS_PER_SLOT * cfg.max_num_seqs)
        finally:
            backend.close()
        if failures:
            raise fail_rows(failures, hs_dir, "extraction")
    bad = validate_sample_of_files(plan, hs_dir, cfg.validate_sample, seed=cfg.rank)
    if bad:
        for index in bad:
            (hs_dir / f"hs_{index}.safetensors").unlink(missing_ok=True)
        raise fail_rows(bad, hs_dir, "re-validation")

    # 5. Contract last, once every rank's rows are in (with --world-size > 1 the last rank to finish writes it).
    if not all_rows_landed(hs_dir, plan.all_indices):
        log.info("rank %d/%d done; the manifest is written when every rank's rows exist (rerun any rank then)",
                 cfg.rank, cfg.world_size)
        return 0
    (hs_dir / "redo.json").unlink(missing_ok=True)  # every row listed there has been redone
    write_manifest(
        hs_dir, "extract", **shaping,
        config=cfg.model_dump(), config_sha256=fingerprint,
        inputs={"prepare": input_record(prepared)},
        target=target.summary(),
        backend=cfg.backend,
        shapes={"hidden_states": ["T", len(layer_ids), target.hidden_size], "token_ids": ["T"]},
        counts={"rows": len(plan.all_indices), "tokens": sum(len(r) for r in rows), **plan.counts},
    )
    log.info("hidden states for %d rows -> %s", len(plan.all_indices), hs_dir)
    return 0


def staging_dir(cfg: ExtractConfig, hs_dir: Path) -> Path:
    return Path(cfg.staging_dir) if cfg.staging_dir else hs_dir / ".staging"


def finished_extraction(hs_dir: Path, fingerprint: str, prepared: dict, num_rows: int) -> bool:
    """A complete manifest from these settings and this stage-01 output, and every row's file present."""
    existing = read_json(hs_dir / "manifest.json") or {}
    return (bool(existing.get("complete")) and existing.get("config_sha256") == fingerprint
            and existing.get("inputs") == {"prepare": input_record(prepared)}
            and all_rows_landed(hs_dir, list(range(num_rows))))


def check_same_shaping(hs_dir: Path, shaping: dict) -> None:
    """Files from another target/layer ids/dtype must never be mixed into this directory."""
    existing = read_json(hs_dir / "manifest.json")
    if not existing:
        return
    for key in SHAPING_KEYS:
        if existing.get(key) != shaping[key]:
            raise ContractError(
                f"{hs_dir / 'manifest.json'}: existing hidden states have {key}={existing.get(key)}, this run "
                f"{shaping[key]}; move {hs_dir} away (or rerun 01 into a new --output) to extract again"
            )


def make_backend(cfg: ExtractConfig, target, layer_ids, hs_dir: Path, max_model_len: int, dtype):
    if cfg.backend == "hf":
        from eagle3_pipeline.extract.hf import HfBackend

        return HfBackend(target, layer_ids, dtype, cfg.device, cfg.trust_remote_code)
    from eagle3_pipeline.extract.vllm_backend import VllmBackend

    staging = staging_dir(cfg, hs_dir)
    staging.mkdir(parents=True, exist_ok=True)
    return VllmBackend(cfg, target, layer_ids, staging, max_model_len)


if __name__ == "__main__":
    raise SystemExit(main())
