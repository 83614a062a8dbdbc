#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft with speculators' own trainer.

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

import time
from pathlib import Path

from eagle3_pipeline import checkpoints, nodes, online, slices
from eagle3_pipeline.compat import stall_watch
from eagle3_pipeline.config import TrainConfig, load_draft_config, resolve_stage_config
from eagle3_pipeline.contract import input_record, write_manifest
from eagle3_pipeline.errors import Interrupted, StageError, Stalled
from eagle3_pipeline.files import check_writable_dir, held_lock_fds, remove_stale_temps
from eagle3_pipeline.hidden_states import StateFormat
from eagle3_pipeline.manifest import MANIFEST_NAME, CheckpointRef, TrainManifest
from eagle3_pipeline.metrics import METRICS_FILE, compat_applied
from eagle3_pipeline.plan import check_plan_lines
from eagle3_pipeline.plots import PLOTS_DIRNAME, write_plots
from eagle3_pipeline.preflight import preflight_train
from eagle3_pipeline.ranks import clear_own, stopped_line
from eagle3_pipeline.resume import INTERRUPTED, prepare_resume
from eagle3_pipeline.sizing import checkpoint_bytes
from eagle3_pipeline.stage import (
    config_fingerprint,
    finished,
    lock_output,
    log,
    refuse_unowned,
    stage_identity,
    stage_main,
)
from eagle3_pipeline.target import extraction_layer_ids, load_target_info
from eagle3_pipeline.train_report import choose_checkpoint, summarize, write_summary
from eagle3_pipeline.training import (
    bad_sample_error,
    endpoint_down_error,
    export_compat_settings,
    fit_seq_len_to_run,
    fit_val_ttt_steps,
    forget_redone_samples,
    launch_command,
    launch_env,
    read_upstream,
    require_trained,
    resolved_for_print_config,
    run_in_process,
    skipped_samples,
    speculators_argv,
    stopped_on,
    ttt_steps,
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
    draft = load_draft_config(cfg.draft_config)
    target = load_target_info(cfg.target)

    # 2. Contracts: one target, one prepared dataset, states and vocab both built from it.
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
    upstream = {"prepare": prepared, "extract": extracted, "vocab": vocab}
    if extracted is not None:
        layer_ids, source = extracted.layer_ids, {}
    else:  # online/hybrid: the states a vLLM server computes (checked below, once the run is not a no-op)
        online.require_endpoint(cfg)
        layer_ids = extraction_layer_ids(target.num_layers, cfg.layer_ids)
        source = {"hidden_states_source": "vllm", "layer_ids": layer_ids}
        del upstream["extract"]
    aux_layer_ids = layer_ids[:-1]
    inputs = {name: input_record(m) for name, m in upstream.items()}
    identity_inputs = {name: m.content_sha256 for name, m in upstream.items()}
    slicing = {}
    if sliced:  # the slices are the run's input one after another: its identity is the plan over stage 01's rows
        identity_inputs, source, slicing = slices.run_identity(sliced, prepared, identity_inputs, out_dir)
    # The one rule for "done" (stage.finished). A resume restores speculators' optimizer AND its lr
    # scheduler (built for the old lr, epochs and steps), so every setting that shapes the run is
    # part of the identity: changing one mid-run is refused, never recorded as if it had happened.
    identity = stage_identity(
        cfg, identity_inputs,
        target_config_sha256=target.config_sha256, draft_config=draft.identity_settings(),
        ttt_steps=ttt_steps(cfg, draft), world_size=cfg.nproc * cfg.nnodes, **source,
        # feature noise changes what is trained, yet a run without it keeps the identity it had before the flag
        **({"noise_std": cfg.noise_std} if cfg.noise_std > 0 else {}),
    )
    check_writable_dir(out_dir, "--output")
    if cfg.nnodes > 1 and not cfg.check:  # nodes share --output (node 0 writes it): one process per node
        lock_output(out_dir, exclusive=False)
        lock_output(out_dir, lock_file=nodes.lock_path(out_dir, cfg.node_rank, cfg.nnodes))
    remedy = ("a resume restores the old optimizer and lr schedule from the checkpoints, so it cannot change a run; "
              "rerun with the old value, choose another --output, or pass --overwrite to train anew (deletes only "
              "this stage's checkpoints and logs)")
    refuse_unowned(out_dir, "train")  # before anything is locked, deleted or trained: only ours, by our manifest
    try:
        done = finished(out_dir, "train", identity, cfg.overwrite, cfg.check, remedy=remedy,
                        damaged=lambda changed: checkpoints.refuse_damaged(out_dir, changed))
    except checkpoints.RecordsChanged as records:  # a log cut short or edited: the checkpoints are as written
        name, how = next(iter(records.changed.items()))
        log.warning("%s: %s since 04_train.py wrote it (a record for people, %d file(s) such); the checkpoints are as "
                    "written, so the run stays finished", out_dir / name, how, len(records.changed))
        done = True
    if done and checkpoints.require_recorded_best(out_dir):
        # Rerunning would train extra steps (--max-steps) and rewrite the manifest stage 05 was built on.
        log.info("%s: already trained with these settings and inputs; nothing to do", out_dir)
        return 0
    checkpoints.refuse_foreign_folders(out_dir)
    replace = checkpoints.replaces_other_run(out_dir, identity)
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
        server = online.preflight(cfg, target, prepared, layer_ids, layer_ids_stated=sources.stated("layer_ids"))
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
        cfg, draft, target.path, aux_layer_ids, vocab.draft_vocab_size, prepared.train_data_ratio,
        mask_token_id=target.text_config.get("pad_token_id") or 0,
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
        write_manifest(out_dir, TrainManifest(complete=False, identity=identity, outputs=list(checkpoints.RUN_FILES),
                                              **slicing))
    write_command_file(out_dir, spec_argv, launch, () if server is None else (online.command_note(cfg),),
                       node_rank=cfg.node_rank)

    # 3. Work: speculators' trainer (it resumes from the newest checkpoint by itself).
    log.info("training with speculators (%s, hidden states %s); command in %s", "in-process" if launch is None else launch[0],
             "from stage 02's files" if server is None else f"{cfg.hidden_states} from {server['endpoint']}",
             out_dir / "command.txt" if cfg.node_rank == 0 else "the line above (node 0 writes command.txt)")
    # Every sample is checked as the loader reads it (compat/sample_check.py): stage 02's storage, or vLLM's states.
    stored = StateFormat.from_manifest(extracted) if extracted else None
    sample_spec = {"slots": len(layer_ids), "hidden": target.hidden_size, "samples": prepared.counts.rows,
                   "dtype": stored.dtype if stored and not stored.is_fp8 else None,
                   "storage": stored.storage if stored else "any"}
    export_compat_settings(cfg, sample_spec, draft, identity)
    if trained_already:
        log.info("run position %d already trained; %s", position, "writing the run's report and manifest"
                 if position == plan.positions - 1 else "recording it in the manifest")
    elif launch is None:
        run_in_process(spec_argv, out_dir / METRICS_FILE, checkpoint_bytes(cfg, draft, target, vocab.draft_vocab_size))
    else:
        clear_own(out_dir, cfg.nproc, cfg.node_rank)
        launched_at = time.time()
        returncode = nodes.run_launch(launch, env=launch_env(), pass_fds=held_lock_fds(),  # ranks hold the output lock too
                                      here=here, world=cfg.nproc * cfg.nnodes, save_path=out_dir)
        if returncode == Interrupted.exit_code:
            raise Interrupted(f"training interrupted; checkpoint saved in {out_dir / INTERRUPTED} if the save finished; "
                              f"rerun the same command to resume")
        if returncode != 0 and server is not None and (problem := online.endpoint_problem(server["endpoint"])):
            raise endpoint_down_error(problem, out_dir)
        if returncode != 0 and (problem := stopped_on(out_dir)):  # a rank stopped on a bad sample or loss
            raise bad_sample_error(problem, out_dir)
        if returncode != 0:  # which rank or node stopped first, and where the rerun resumes
            line = stopped_line(out_dir, nproc=cfg.nproc, nnodes=cfg.nnodes, node_rank=cfg.node_rank,
                                since=launched_at, returncode=returncode)
            raise (Stalled if stall_watch.TAG in line else StageError)(line)  # a stall exits 75 on one rank too
    if cfg.dry_run:
        log.info("dry run: initialised draft written to %s", out_dir)
        return 0

    if sliced:
        slicing["slices_trained"].append(slices.position_record(position, plan, extracted, steps[position]))
        if position < plan.positions - 1:
            if cfg.node_rank == 0:  # the one writer of the shared manifest
                write_manifest(out_dir, TrainManifest(complete=False, identity=identity,
                                                      outputs=list(checkpoints.RUN_FILES), inputs=inputs, **slicing))
            log.info("run position %d of %d trained; the next slice continues this run", position + 1, plan.positions)
            return 0

    if cfg.nnodes > 1 and cfg.launcher == "torchrun" and cfg.node_rank > 0:
        log.info("node %d/%d done; node 0 (global rank 0) writes the checkpoints' report and manifest", cfg.node_rank, cfg.nnodes)
        return 0

    # 4. Report (plots/*.png, summary.txt), then 5. the contract; a run that trained on nothing gets neither.
    trained = require_trained(cfg, prepared.counts.rows, out_dir)
    best, choice = choose_checkpoint(out_dir, draft.num_speculative_tokens)  # by offline tau at the served k
    if best is None:
        raise StageError(f"{out_dir}: training finished without a checkpoint")
    try:
        write_plots(out_dir / METRICS_FILE, out_dir / PLOTS_DIRNAME)
    except Exception as exc:  # curves are a convenience: never fail a finished training on them
        log.warning("plots not written (%s: %s); retry with python -m eagle3_pipeline.plots %s", type(exc).__name__, exc, out_dir)
    summary = {**summarize(out_dir / METRICS_FILE, best, draft.num_speculative_tokens), "checkpoint_choice": choice}
    if choice.get("lowest_val_loss") not in (None, choice["chosen"]):
        log.info("checkpoint_best: epoch folder %s (offline tau at k=%d), not %s (lowest validation loss)",
                 choice["chosen"], draft.num_speculative_tokens, choice["lowest_val_loss"])
    print(write_summary(out_dir, summary), flush=True)
    written = sorted(p.name for p in checkpoints.own_outputs(out_dir)) + [MANIFEST_NAME]
    write_manifest(out_dir, TrainManifest(
        identity=identity, best_checkpoint=CheckpointRef(**checkpoints.checkpoint_content(best)),
        epochs=[p.name for p in checkpoints.complete(out_dir)], outputs=written, inputs=inputs, target=target.summary(),
        config=cfg.model_dump(), draft_config=draft.model_dump(), aux_layer_ids=aux_layer_ids, draft_vocab_size=vocab.draft_vocab_size,
        summary=summary, config_sha256=config_fingerprint(cfg), resume=resume,
        compat_applied=compat_applied(out_dir / METRICS_FILE),
        hidden_states=server or {"mode": "files", "from": inputs["extract"]["path"]},
        bad_samples=skipped_samples(out_dir), trained=trained, **slicing,
    ), outputs=checkpoints.written_files(out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
