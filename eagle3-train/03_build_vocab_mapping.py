#!/usr/bin/env python3
"""Stage 03: the draft vocabulary (d2t/t2d) from loss-masked token frequencies.

Uses stage 01's token_freq.pt (counted by speculators over the train rows' loss-masked
tokens) and speculators' build_vocab_mappings_from_distribution; writes d2t.npy, t2d.npy,
coverage.json (fraction of loss-masked train/val tokens the draft vocab covers) and
manifest.json. Run with --help for flags and an example.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config import VocabConfig, load_draft_config, resolve_stage_config
from eagle3_pipeline.contract import input_record, read_manifest, require_written_files, write_manifest
from eagle3_pipeline.files import atomic_numpy_save, atomic_write_json, check_writable_dir, remove_stale_temps
from eagle3_pipeline.manifest import VocabCoverage, VocabManifest
from eagle3_pipeline.preflight import preflight_vocab
from eagle3_pipeline.prepared import TOKEN_FREQ_NAME, load_prepared
from eagle3_pipeline.stage import config_fingerprint, finished, log, retire_manifest, stage_identity, stage_main
from eagle3_pipeline.vocab import (
    D2T_NAME,
    T2D_NAME,
    build_mapping,
    count_loss_tokens,
    coverage,
    coverage_warning,
    load_token_freq,
    resolve_draft_vocab_size,
)

COVERAGE_NAME = "coverage.json"
OUTPUTS = (D2T_NAME, T2D_NAME, COVERAGE_NAME)  # what this stage writes (a finished run missing one is redone)


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(VocabConfig, argv)
    data_dir, out_dir = Path(cfg.data), Path(cfg.output)
    draft_config = load_draft_config(cfg.draft_config)

    # 2. Contract: stage 01's manifest gives the target vocab and the train/val boundary.
    prepared = read_manifest(data_dir, "prepare", "--data")
    require_written_files(prepared, [TOKEN_FREQ_NAME])  # the counts the vocabulary is built from
    target_vocab = prepared.target["vocab_size"]
    draft_vocab, source = resolve_draft_vocab_size(cfg.draft_vocab_size, draft_config.draft_vocab_size, target_vocab)
    inputs = {"prepare": input_record(prepared)}
    fingerprint = config_fingerprint(cfg.model_copy(update={"draft_vocab_size": draft_vocab}), ignore=("output",))
    identity = stage_identity(cfg, {"prepare": prepared.content_sha256}, draft_vocab_size=draft_vocab)
    check_writable_dir(out_dir, "--output")
    if finished(out_dir, "vocab", identity, cfg.overwrite, cfg.check, outputs=OUTPUTS):
        log.info("%s: vocab mapping already built from these inputs; nothing to do", out_dir)
        return 0
    for line in preflight_vocab(target_vocab, draft_vocab, out_dir):
        log.info("preflight %s", line)
    if cfg.check:
        return 0
    remove_stale_temps(out_dir)

    # 3. Work.
    token_freq = load_token_freq(data_dir / TOKEN_FREQ_NAME)
    d2t, t2d = build_mapping(token_freq, draft_vocab, target_vocab)
    dataset = load_prepared(data_dir).with_format(None)
    val = dataset.select(range(prepared.counts.train_rows, len(dataset)))
    val_freq = count_loss_tokens(val["input_ids"], val["loss_mask"], desc="count val tokens")
    report = {
        "draft_vocab_size": draft_vocab, "draft_vocab_size_source": source, "target_vocab_size": target_vocab,
        "distinct_train_tokens": len(token_freq),
        "train_coverage": coverage(token_freq, t2d), "val_coverage": coverage(val_freq, t2d),
    }

    # 4. Outputs (each replaced by a rename: nothing but these three names is ever touched), then 5. the contract.
    retire_manifest(out_dir)  # an old result (--overwrite) stops being finished only now
    atomic_numpy_save(d2t, out_dir / D2T_NAME)
    atomic_numpy_save(t2d, out_dir / T2D_NAME)
    atomic_write_json(out_dir / COVERAGE_NAME, report)
    write_manifest(out_dir, VocabManifest(
        config=cfg.model_dump(), config_sha256=fingerprint, inputs=inputs, identity=identity,
        outputs=list(OUTPUTS), target=prepared.target, draft_vocab_size=draft_vocab,
        target_vocab_size=target_vocab, shapes={"d2t": list(d2t.shape), "t2d": list(t2d.shape)},
        coverage=VocabCoverage(**{k: v for k, v in report.items() if k not in ("draft_vocab_size", "target_vocab_size")}),
    ), outputs=OUTPUTS)
    log.info("draft vocab %d of %d (%s): covers %.1f%% of loss-masked train tokens, %.1f%% of val -> %s",
             draft_vocab, target_vocab, source, 100 * report["train_coverage"], 100 * report["val_coverage"], out_dir)
    warning = coverage_warning(report)
    if warning:
        log.warning("%s", warning)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
