#!/usr/bin/env python3
"""Stage 05: a draft directory vLLM loads with --speculative-config, plus the command.

Takes stage 04's best (or chosen) checkpoint, writes a self-contained speculators-format
draft directory (config.json naming the verifier, model.safetensors with d2t/t2d), loads it
back with speculators to verify it, and prints the `vllm serve` command.
Run with --help for flags and an example.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle3_pipeline.config import ExportConfig, load_draft_config, resolve_stage_config
from eagle3_pipeline.contract import input_record, read_manifest, write_manifest
from eagle3_pipeline.export import choose_checkpoint, serve_command, verify_draft_dir, write_draft_dir
from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.files import TEMP_MARKER, atomic_path, atomic_write_text, check_writable_dir, remove_path
from eagle3_pipeline.preflight import preflight_export
from eagle3_pipeline.stage import config_fingerprint, finished_with_same_inputs, log, stage_main
from eagle3_pipeline.vocab import D2T_NAME


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(ExportConfig, argv)
    ckpt_dir, out_dir = Path(cfg.checkpoints), Path(cfg.output)

    # 2. Contract: a finished training run, and the vocab mapping it was trained with.
    trained = read_manifest(ckpt_dir, "train", "--checkpoints")
    vocab_dir = Path(trained["inputs"]["vocab"]["path"])
    checkpoint = choose_checkpoint(ckpt_dir, cfg.checkpoint)
    target = trained["target"]
    num_tokens = cfg.num_speculative_tokens or trained["draft_config"].get("num_speculative_tokens", 3)
    verifier = cfg.verifier_name or target["path"]
    inputs = {"train": input_record(trained), "checkpoint": str(checkpoint.resolve())}
    check_writable_dir(out_dir.parent, "--output")
    if finished_with_same_inputs(out_dir, config_fingerprint(cfg), inputs, cfg.overwrite):
        log.info("%s: already exported from this checkpoint; nothing to do", out_dir)
        print((out_dir / "serve_command.txt").read_text().strip())
        return 0
    refuse_foreign_output(out_dir)
    for line in preflight_export(checkpoint, out_dir):
        log.info("preflight %s", line)
    if cfg.check:
        return 0
    remove_stale_exports(out_dir)

    # 3. Work: copy into a temp dir, verify it there, then rename into place.
    d2t = np.load(vocab_dir / D2T_NAME)
    with atomic_path(out_dir) as staging:
        write_draft_dir(checkpoint, staging, verifier, num_tokens)
        check = verify_draft_dir(staging, d2t, trained["aux_layer_ids"])
        command = serve_command(target["path"], out_dir, num_tokens, cfg.tensor_parallel_size,
                                target["is_multimodal_wrapper"])
        atomic_write_text(staging / "serve_command.txt", command + "\n")
        # 4. Contract (inside the directory before it appears under its final name).
        write_manifest(staging, "export", config=cfg.model_dump(), config_sha256=config_fingerprint(cfg),
                       inputs=inputs, target=target, verifier_name=verifier, checkpoint=checkpoint.name,
                       num_speculative_tokens=num_tokens, verified=check, serve_command=command)
    log.info("exported %s (%s, %d params) -> %s", checkpoint.name, check["class"], check["parameters"], out_dir)
    print(f"draft: {out_dir.resolve()}")
    print(f"serve: {command}")
    return 0


def refuse_foreign_output(out_dir: Path) -> None:
    """The export replaces out_dir as a whole: never a directory this stage did not write."""
    if not out_dir.exists():
        return
    manifest = out_dir / "manifest.json"
    stage = None
    if manifest.is_file():
        try:
            stage = json.loads(manifest.read_text()).get("stage")
        except ValueError:
            stage = None
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    if stage != "export":
        raise ConfigError(f"{out_dir}: exists and is not an export made by 05_export.py (it would be replaced "
                          f"as a whole); choose another --output")


def remove_stale_exports(out_dir: Path) -> None:
    """Temp copies a killed export left beside out_dir (`.NAME.tmp-PID`, `.NAME.old.tmp-PID`)."""
    if not out_dir.parent.is_dir():
        return
    for prefix in (f".{out_dir.name}{TEMP_MARKER}", f".{out_dir.name}.old{TEMP_MARKER}"):
        for stale in out_dir.parent.glob(prefix + "*"):
            if stale.name[len(prefix):].isdigit():
                log.info("removing %s, left by an export that was killed", stale)
                remove_path(stale)


if __name__ == "__main__":
    raise SystemExit(main())
