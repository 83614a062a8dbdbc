#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft with speculators' own trainer.

Checks stages 01-03 (same target, same prepared data, mapping built from this data),
builds the `speculators train` flags from draft_config.json + profile + flags, and runs
speculators' trainer in-process (one GPU or the CPU) or under torchrun/DeepSpeed
(--nproc/--nnodes). Checkpoints, resume (automatic: rerun the same command), SIGTERM
saves and validation metrics are speculators'. Run with --help for flags and an example.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from eagle3_pipeline.config import TrainConfig, load_draft_config, resolve_stage_config
from eagle3_pipeline.contract import input_record, read_manifest, require_equal, require_upstream, write_manifest
from eagle3_pipeline.errors import ConfigError, ContractError, Interrupted, StageError
from eagle3_pipeline.extract.common import HS_DIRNAME
from eagle3_pipeline.files import check_writable_dir, remove_stale_temps
from eagle3_pipeline.preflight import preflight_train
from eagle3_pipeline.resume import INTERRUPTED, epoch_folders, latest_progress, prepare_resume
from eagle3_pipeline.stage import config_fingerprint, log, stage_main
from eagle3_pipeline.target import load_target_info
from eagle3_pipeline.training import (
    METRICS_FILE, best_checkpoint, export_compat_settings, launch_command, launch_env, run_in_process,
    speculators_argv, write_command_file,
)
from eagle3_pipeline.plots import PLOTS_DIRNAME, write_plots
from eagle3_pipeline.train_report import summarize, write_summary


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(TrainConfig, argv)
    out_dir = Path(cfg.output)
    draft = load_draft_config(cfg.draft_config)
    target = load_target_info(cfg.target)

    # 2. Contracts: one target, one prepared dataset, states and vocab both built from it.
    prepared = read_manifest(cfg.data, "prepare", "--data")
    extracted = read_manifest(Path(cfg.data) / HS_DIRNAME, "extract", "--data")
    vocab = read_manifest(cfg.vocab, "vocab", "--vocab")
    hint = "all stages must use the same --target"
    for manifest in (prepared, extracted, vocab):
        require_equal("target config", target.config_sha256, manifest["target"]["config_sha256"], manifest, hint)
    require_upstream(extracted, "prepare", prepared)
    require_upstream(vocab, "prepare", prepared)
    for key, value in (("hidden_size", target.hidden_size), ("target_vocab_size", target.vocab_size)):
        if draft.get(key) not in (None, value):
            raise ConfigError(f"{cfg.draft_config}: {key} {draft[key]} does not match the target's {value} ({cfg.target}/config.json)")
    aux_layer_ids = extracted["layer_ids"][:-1]
    inputs = {name: input_record(m) for name, m in (("prepare", prepared), ("extract", extracted), ("vocab", vocab))}
    # What a resume must not change: the draft, its inputs, and the optimizer (its saved state
    # only loads into the same optimizer). lr, epochs, steps may change between runs.
    run_identity = {"draft_config": draft, "inputs": inputs, "target_config_sha256": target.config_sha256,
                    "optimizer": cfg.optimizer}
    check_writable_dir(out_dir, "--output")
    check_same_run(out_dir, run_identity, cfg.overwrite)
    fingerprint = config_fingerprint(cfg)
    if finished_training(out_dir, run_identity, fingerprint):
        # Rerunning would train extra steps (--max-steps) and rewrite the manifest stage 05 was built on.
        log.info("%s: already trained with these settings and inputs; nothing to do", out_dir)
        return 0
    for line in preflight_train(cfg, draft, target, vocab["draft_vocab_size"], out_dir,
                                prepared.get("counts", {}).get("tokens", 0)):  # synthetic bench data: none
        log.info("preflight %s", line)
    if cfg.check:
        return 0
    remove_stale_temps(out_dir)
    # speculators resumes from the newest <epoch>/ by itself; make sure that one is whole.
    # One node tidies the (shared) checkpoint folder; the others must not race it.
    resume = prepare_resume(out_dir) if cfg.node_rank == 0 else {"incomplete_removed": [], "interrupted": None}
    resume["from"] = latest_progress(out_dir)
    if resume["from"]:
        log.info("resuming from checkpoint %s (global step %s); the steps before it are not redone",
                 resume["from"]["checkpoint"], resume["from"].get("global_step", "?"))

    spec_argv = speculators_argv(
        cfg, draft, target.path, aux_layer_ids, vocab["draft_vocab_size"], prepared["train_data_ratio"],
        mask_token_id=target.text_config.get("pad_token_id") or 0,
    )
    launch = launch_command(cfg, spec_argv)
    write_command_file(out_dir, spec_argv, launch)
    write_manifest(out_dir, "train", complete=False, run_identity=run_identity)

    # 3. Work: speculators' trainer (it resumes from the newest checkpoint by itself).
    log.info("training with speculators (%s); command in %s", "in-process" if launch is None else launch[0], out_dir / "command.txt")
    export_compat_settings(cfg)
    if launch is None:
        run_in_process(spec_argv, out_dir / METRICS_FILE)
    else:
        result = subprocess.run(launch, env=launch_env())
        if result.returncode == Interrupted.exit_code:
            raise Interrupted(f"training interrupted; checkpoint saved in {out_dir / INTERRUPTED} if the save finished; "
                              f"rerun the same command to resume")
        if result.returncode != 0:
            raise StageError(f"training processes exited with code {result.returncode} (see their log above); rerun to resume")
    if cfg.dry_run:
        log.info("dry run: initialised draft written to %s", out_dir)
        return 0

    if cfg.nnodes > 1 and cfg.launcher == "torchrun" and cfg.node_rank > 0:
        log.info("node %d/%d done; node 0 (global rank 0) writes the checkpoints' report and manifest", cfg.node_rank, cfg.nnodes)
        return 0

    # 4. Report (plots/*.png, summary.txt), then 5. the contract.
    best = best_checkpoint(out_dir)
    if best is None:
        raise StageError(f"{out_dir}: training finished without a checkpoint")
    try:
        write_plots(out_dir / METRICS_FILE, out_dir / PLOTS_DIRNAME)
    except Exception as exc:  # curves are a convenience: never fail a finished training on them
        log.warning("plots not written (%s: %s); retry with python -m eagle3_pipeline.plots %s", type(exc).__name__, exc, out_dir)
    summary = summarize(out_dir / METRICS_FILE, best, draft.get("num_speculative_tokens"))
    print(write_summary(out_dir, summary), flush=True)
    write_manifest(
        out_dir, "train", run_identity=run_identity, inputs=inputs, target=target.summary(),
        config=cfg.model_dump(), draft_config=draft, aux_layer_ids=aux_layer_ids,
        draft_vocab_size=vocab["draft_vocab_size"], best_checkpoint=best.name, summary=summary,
        config_sha256=fingerprint, resume=resume,
    )
    return 0


def finished_training(out_dir: Path, identity: dict, fingerprint: str) -> bool:
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(manifest.get("complete")) and manifest.get("run_identity") == identity \
        and manifest.get("config_sha256") == fingerprint


def check_same_run(out_dir: Path, identity: dict, overwrite: bool) -> None:
    """Resuming is only safe into checkpoints of the same draft config and inputs."""
    path = out_dir / "manifest.json"
    if not path.is_file():
        return
    previous = json.loads(path.read_text()).get("run_identity")
    if previous == identity:
        return
    if not overwrite:
        what = next((name for key, name in (("draft_config", "draft config"), ("optimizer", "optimizer"))
                     if previous and previous.get(key) != identity[key]), "inputs")
        raise ContractError(f"{path}: checkpoints here come from another {what}; choose another --output or pass --overwrite")
    from eagle3_pipeline.training import checkpoint_dirs
    from eagle3_pipeline.files import remove_path

    for item in checkpoint_dirs(out_dir) + epoch_folders(out_dir) + [
            out_dir / INTERRUPTED, out_dir / "checkpoint_best", out_dir / METRICS_FILE, path]:
        remove_path(item)


if __name__ == "__main__":
    raise SystemExit(main())
