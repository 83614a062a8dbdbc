#!/usr/bin/env python3
"""Stage 05: a draft directory vLLM loads with --speculative-config, plus the command.

Takes stage 04's best (or chosen) checkpoint, writes a self-contained speculators-format
draft directory (config.json naming the verifier, model.safetensors with d2t/t2d), loads it
back with speculators to verify it, and prints the `vllm serve` command.
Run with --help for flags and an example.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_pipeline.config import DraftConfig, ExportConfig, resolve_stage_config
from eagle3_pipeline.contract import (
    input_record,
    manifest_path,
    read_manifest,
    read_recorded_input,
    require_written_files,
    write_manifest,
)
from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.export import (
    DRAFT_FILES,
    choose_checkpoint,
    require_finite_weights,
    require_unchanged,
    serve_command,
    verify_draft_dir,
    write_draft_dir,
)
from eagle3_pipeline.files import (
    TEMP_MARKER,
    atomic_path,
    atomic_write_text,
    check_writable_dir,
    parse_writer_tag,
    remove_path,
    sha256_file,
)
from eagle3_pipeline.manifest import ExportManifest, TrainManifest, parse_manifest
from eagle3_pipeline.preflight import preflight_export
from eagle3_pipeline.stage import config_fingerprint, finished, lock_output, log, stage_identity, stage_main
from eagle3_pipeline.vocab import D2T_NAME


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(ExportConfig, argv)
    ckpt_dir, out_dir = Path(cfg.checkpoints), Path(cfg.output)

    # 2. Contract: a finished training run, and the vocab mapping it was trained with.
    trained = read_manifest(ckpt_dir, "train", "--checkpoints")
    # 04 trains into this folder under its exclusive lock: while it does, there is nothing safe to export.
    if not cfg.check:
        lock_output(ckpt_dir, exclusive=False)
    checkpoint = choose_checkpoint(ckpt_dir, cfg.checkpoint, trained.best_checkpoint.name)
    require_written_files(trained, [f"{checkpoint.name}/{name}" for name in ("config.json", "model.safetensors")])
    model_sha256 = sha256_file(checkpoint / "model.safetensors")
    target = trained.target
    num_tokens = cfg.num_speculative_tokens or DraftConfig(**trained.draft_config).num_speculative_tokens
    verifier = cfg.verifier_name or target["path"]
    inputs = {"train": input_record(trained), "checkpoint": str(checkpoint.resolve())}
    identity = stage_identity(
        cfg, {"train": trained.content_sha256,
              "checkpoint": {"name": checkpoint.name, "model_sha256": model_sha256}},
        verifier_name=verifier, num_speculative_tokens=num_tokens)
    check_writable_dir(out_dir.parent, "--output")
    refuse_foreign_output(out_dir)
    # The export replaces out_dir as a whole (a rename), so its lock lives beside it.
    if finished(out_dir, "export", identity, cfg.overwrite, cfg.check, lock_file=lock_file_for(out_dir),
                outputs=DRAFT_FILES):
        log.info("%s: already exported from this checkpoint; nothing to do", out_dir)
        print(serve_command(target["path"], out_dir, num_tokens, cfg.tensor_parallel_size, target["is_multimodal_wrapper"]))
        return 0
    refuse_unwritten_entries(out_dir)
    vocab_dir = trained_vocab_dir(trained, cfg.vocab)
    for line in preflight_export(checkpoint, out_dir):
        log.info("preflight %s", line)
    if cfg.check:
        return 0
    remove_stale_exports(out_dir)

    # 3. Work: copy into a temp dir, verify it there, then rename into place.
    d2t = np.load(vocab_dir / D2T_NAME)
    with atomic_path(out_dir) as staging:
        write_draft_dir(checkpoint, staging, verifier, num_tokens)
        require_unchanged(checkpoint / "model.safetensors", staging / "model.safetensors", model_sha256)
        require_finite_weights(staging / "model.safetensors", checkpoint / "model.safetensors")  # never a NaN draft
        check = verify_draft_dir(staging, d2t, trained.aux_layer_ids, target["path"])
        command = serve_command(target["path"], out_dir, num_tokens, cfg.tensor_parallel_size,
                                target["is_multimodal_wrapper"])
        atomic_write_text(staging / "serve_command.txt", command + "\n")
        # 4. Contract (inside the directory before it appears under its final name).
        write_manifest(staging, ExportManifest(
            identity=identity, config=cfg.model_dump(), config_sha256=config_fingerprint(cfg), inputs=inputs,
            target=target, verifier_name=verifier, checkpoint=checkpoint.name, num_speculative_tokens=num_tokens,
            verified=check, serve_command=command),
            outputs=sorted(p.name for p in staging.iterdir() if p.is_file() and not p.name.startswith(".")))
    log.info("exported %s (%s, %d params) -> %s", checkpoint.name, check["class"], check["parameters"], out_dir)
    print(f"draft: {out_dir.resolve()}")
    print(f"serve: {command}")
    return 0


def lock_file_for(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.eagle3.lock"


def trained_vocab_dir(trained: TrainManifest, flag: str | None) -> Path:
    """Stage 03's output that stage 04 trained with: --vocab, else the (resolved) path 04 recorded,
    checked by content either way (a moved work directory needs --vocab, never a guess from the cwd)."""
    vocab = read_recorded_input(trained, "vocab", flag, "--vocab", relation="trained with")
    require_written_files(vocab, [D2T_NAME])
    return vocab.directory


def refuse_foreign_output(out_dir: Path) -> None:
    """The export replaces out_dir as a whole: never a directory this stage did not write."""
    if not out_dir.exists():
        return
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    manifest = manifest_path(out_dir)
    stage = parse_manifest(manifest, hint="choose another --output").stage if manifest.is_file() else None
    if stage != "export":
        raise ConfigError(f"{out_dir}: exists and is not an export made by 05_export.py (it would be replaced "
                          f"as a whole); choose another --output")


def refuse_unwritten_entries(out_dir: Path) -> None:
    """Redoing an export replaces out_dir as a whole: what a user put in it (notes, bench results) would go with
    it, so an entry the export's manifest does not list (`output_files`) is refused, named."""
    manifest = manifest_path(out_dir)
    recorded = parse_manifest(manifest).output_files if manifest.is_file() else None
    if recorded is None:  # nothing there, or no record of what was written to tell a user's file by
        return
    extra = sorted(p.name for p in out_dir.iterdir() if p.name not in recorded and p.name != manifest.name)
    if extra:
        raise ConfigError(f"{out_dir / extra[0]}: not written by 05_export.py ({len(extra)} such entr"
                          f"{'y' if len(extra) == 1 else 'ies'}), and redoing the export replaces {out_dir} as a "
                          f"whole; move them out or choose another --output")


def remove_stale_exports(out_dir: Path) -> None:
    """Temp copies a killed export left beside out_dir (`.NAME.tmp-PID@HOST`, `.NAME.old.tmp-PID@HOST`)."""
    if not out_dir.parent.is_dir():
        return
    for prefix in (f".{out_dir.name}{TEMP_MARKER}", f".{out_dir.name}.old{TEMP_MARKER}"):
        for stale in out_dir.parent.glob(prefix + "*"):
            if parse_writer_tag(stale.name[len(prefix):]) is not None:
                log.info("removing %s, left by an export that was killed", stale)
                remove_path(stale)


if __name__ == "__main__":
    raise SystemExit(main())
