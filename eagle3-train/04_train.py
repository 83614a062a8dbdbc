#!/usr/bin/env python3
"""Stage 04: train the draft (EAGLE-3, or the kind draft_config.json / --speculator-type names) with speculators'
own trainer.

Checks stages 01-03 (same target, same prepared data, mapping built from this data),
builds the `speculators train` flags from draft_config.json + profile + flags, and runs
speculators' trainer in-process (one GPU or the CPU) or under torchrun/DeepSpeed
(--nproc/--nnodes). Checkpoints, resume (automatic: rerun the same command), SIGTERM
saves and validation metrics are speculators'. With --hidden-states online/hybrid there is no
stage 02: a running vLLM (`python -m eagle3_pipeline.serve_target`) computes each sample's
states when the trainer needs them, checked first (eagle3_pipeline/online.py).
Run with --help for flags and an example.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline import checkpoints, nodes, online, slices
from eagle3_pipeline.config import TrainConfig, resolve_stage_config
from eagle3_pipeline.contract import write_manifest
from eagle3_pipeline.files import check_writable_dir, remove_stale_temps
from eagle3_pipeline.hidden_states import StateFormat
from eagle3_pipeline.manifest import TrainManifest
from eagle3_pipeline.plan import check_plan_lines
from eagle3_pipeline.preflight import preflight_train
from eagle3_pipeline.resume import prepare_resume
from eagle3_pipeline.stage import lock_output, log, stage_main
from eagle3_pipeline.target import load_target_info
from eagle3_pipeline.train_run import already_done, finish_run, plan_run, run_trainer
from eagle3_pipeline.training import (
    draft_for_run,
    fit_seq_len_to_run,
    fit_val_ttt_steps,
    forget_redone_samples,
    launch_command,
    mask_token,
    read_upstream,
    resolved_for_print_config,
    speculators_argv,
    write_command_file,
)


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, sources = resolve_stage_config(TrainConfig, argv, run_time_notes=resolved_for_print_config)
    if cfg.nnodes > 1 and cfg.launcher == "torchrun" and not cfg.check:
        # Nodes share --output: each records how it ended, so a node that stops before the rendezvous
        # stops the others in seconds, not at torchrun's rendezvous timeout (eagle3_pipeline/nodes.py).
        # Its node lock first: only the node's one live stage 04 may write its record.
        check_writable_dir(Path(cfg.output), "--output")
        lock_output(Path(cfg.output), exclusive=False)
        lock_output(Path(cfg.output), lock_file=nodes.lock_path(Path(cfg.output), cfg.node_rank, cfg.nnodes))
        with nodes.presence(Path(cfg.output), cfg.node_rank, cfg.nnodes, cfg.rdzv_endpoint or "") as here:
            return train(cfg, sources, here)
    return train(cfg, sources, None)


def train(cfg: TrainConfig, sources, here: nodes.Presence | None) -> int:
    """The stage; `here`: this node's presence record (several nodes with torchrun), else None."""
    out_dir = Path(cfg.output)
    draft = draft_for_run(cfg)  # the kind: draft_config.json or --speculator-type
    target = load_target_info(cfg.target)

    # 2. Contracts: one target, one prepared dataset, states and vocab both built from it. Every kind trains on the
    # aux layers 02 extracted (speculators' --target-layer-ids): one extraction serves every kind (draft_kinds.layer_ids).
    prepared, extracted, vocab = read_upstream(cfg, target, draft)
    # --slice-rows: this invocation trains one run position of a sliced run (eagle3_pipeline/slices.py)
    sliced = slices.check_position(cfg, prepared, extracted) if cfg.slice_rows is not None else None
    # Few optimizer steps: smaller steps (NOTES.md, "Acceptance length"). Before the identity, which records it.
    cfg, packing_note = fit_seq_len_to_run(cfg, sources, prepared.counts.model_dump(exclude_none=True),
                                           prepared.train_data_ratio)
    if packing_note:
        log.info("%s", packing_note)
    cfg, depth_note = fit_val_ttt_steps(cfg, sources, draft)  # recorded as run (the manifest's config), said here
    if depth_note:
        log.warning("%s", depth_note)
    mask_token_id = mask_token(cfg, draft, target)  # the kind's mask token: --mask-token-id or the target tokenizer's
    run = plan_run(cfg, draft, target, {"prepare": prepared, "extract": extracted, "vocab": vocab}, sliced, mask_token_id)
    check_writable_dir(out_dir, "--output")
    if cfg.nnodes > 1 and not cfg.check:  # nodes share --output (node 0 writes it): one process per node
        lock_output(out_dir, exclusive=False)
        lock_output(out_dir, lock_file=nodes.lock_path(out_dir, cfg.node_rank, cfg.nnodes))
    if already_done(cfg, out_dir, run.identity):
        log.info("%s: already trained with these settings and inputs; nothing to do", out_dir)
        return 0
    checkpoints.refuse_foreign_folders(out_dir)
    replace = checkpoints.replaces_other_run(out_dir, run.identity)
    epochs_done = 0 if replace else len(checkpoints.complete(out_dir))
    trained_already = bool(sliced) and slices.already_trained(out_dir, sliced, replace)
    if sliced:
        plan, position = sliced
        # a checkpoint saved but not yet recorded (killed in between): record it below, or its states are never released
        if trained_already and position < plan.positions - 1 and slices.recorded_position(out_dir, position):
            log.info("%s: run position %d (rows %s) already trained; nothing to do", out_dir, position,
                     plan.selection(position))
            return 0
    for line in preflight_train(cfg, draft, target, vocab.draft_vocab_size, out_dir, prepared.counts.tokens,
                                epochs_done=epochs_done, nproc_given=sources.given("nproc"), nproc_source=sources["nproc"],
                                train_data_ratio=prepared.train_data_ratio):
        log.info("preflight %s", line)
    server = None
    if extracted is None:  # the server must feed exactly what stage 02 would have written, before any training
        server = online.preflight(cfg, target, prepared, run.layer_ids, layer_ids_stated=sources.stated("layer_ids"))
    if cfg.check:  # and the whole run's plan: bytes per format, disk, reads, hours
        for line in check_plan_lines(cfg.target, cfg.data, sources.profile, gpus=cfg.nproc * cfg.nnodes,
                                     epochs=cfg.epochs):
            log.info("%s", line)
        return 0
    # One node tidies the (shared) folder. No other node's temp can be in flight there: node 0 alone writes
    # in it, and the other nodes' ranks start after this, once node 0's torchrun is up (eagle3_pipeline/nodes.py).
    if cfg.node_rank == 0:
        if replace:
            removed = checkpoints.delete_own(out_dir)
            log.info("--overwrite: deleted this stage's outputs from another run: %s", ", ".join(removed) or "none")
        remove_stale_temps(out_dir)
        remove_stale_temps(online.cache_dir(out_dir))  # hybrid samples a killed run was writing
        forget_redone_samples(out_dir)  # --on-bad-sample skip: files redone since they were left out count no more
    # speculators resumes from the newest <epoch>/ by itself; make sure that one is whole.
    # One node tidies the (shared) checkpoint folder; the others must not race it.
    resume = prepare_resume(out_dir) if cfg.node_rank == 0 else {"incomplete_removed": [], "interrupted": None}
    resume["from"] = checkpoints.latest_progress(out_dir)
    if resume["from"]:
        log.info("resuming from checkpoint %s (global step %s); the steps before it are not redone",
                 resume["from"]["checkpoint"], resume["from"].get("global_step", "?"))

    spec_argv = speculators_argv(
        cfg, draft, target.path, run.aux_layer_ids, vocab.draft_vocab_size, prepared.train_data_ratio,
        mask_token_id=mask_token_id,
        hidden_states_storage=StateFormat.from_manifest(extracted).storage if extracted else "dtype",
    )
    if sliced:  # the view of this position's rows, its epoch in the run, one lr schedule over every position
        spec_argv, steps = slices.position_argv(cfg, sliced, spec_argv, out_dir, build=cfg.node_rank == 0)
        log.info("sliced run: position %d of %d (epoch %d, slice %d of %d, rows %s): %d optimizer step(s) of the %d the "
                 "lr schedule is planned over", position + 1, plan.positions, position // plan.num_slices + 1,
                 position % plan.num_slices + 1, plan.num_slices, plan.selection(position), steps[position], sum(steps))
    launch = launch_command(cfg, spec_argv)
    # First of this run's writes: what it may write is listed (a later --overwrite deletes only those).
    # Several nodes: node 0 alone writes the shared files (one writer per file); the others log their command.
    if cfg.node_rank == 0:
        write_manifest(out_dir, TrainManifest(complete=False, identity=run.identity, outputs=list(checkpoints.RUN_FILES),
                                              **run.slicing))
    write_command_file(out_dir, spec_argv, launch, () if server is None else (online.command_note(cfg),),
                       node_rank=cfg.node_rank)

    # 3. Work: speculators' trainer (it resumes from the newest checkpoint by itself).
    log.info("training with speculators (%s draft, %s, hidden states %s); command in %s", draft.speculator_type,
             "in-process" if launch is None else launch[0],
             "from stage 02's files" if server is None else f"{cfg.hidden_states} from {server['endpoint']}",
             out_dir / "command.txt" if cfg.node_rank == 0 else "the line above (node 0 writes command.txt)")
    if trained_already:
        log.info("run position %d already trained; %s", position, "writing the run's report and manifest"
                 if position == plan.positions - 1 else "recording it in the manifest")
    else:
        run_trainer(cfg, spec_argv, launch, run, draft, target, vocab, prepared, extracted, server, here)
    if cfg.dry_run:
        log.info("dry run: initialised draft written to %s", out_dir)
        return 0

    if sliced:
        run.slicing["slices_trained"].append(slices.position_record(position, plan, extracted, steps[position]))
        if position < plan.positions - 1:
            if cfg.node_rank == 0:  # the one writer of the shared manifest
                write_manifest(out_dir, TrainManifest(complete=False, identity=run.identity, outputs=list(
                    checkpoints.RUN_FILES), inputs=run.inputs, **run.slicing))
            log.info("run position %d of %d trained; the next slice continues this run", position + 1, plan.positions)
            return 0

    if cfg.nnodes > 1 and cfg.launcher == "torchrun" and cfg.node_rank > 0:
        log.info("node %d/%d done; node 0 (global rank 0) writes the checkpoints' report and manifest", cfg.node_rank, cfg.nnodes)
        return 0
    # 4. Report (plots/*.png, summary.txt), then 5. the contract; a run that trained on nothing gets neither.
    finish_run(cfg, run, draft, target, vocab, prepared, resume, server, mask_token_id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
