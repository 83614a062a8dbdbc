"""Stage 04's run, in the order 04_train.py calls it: what it trains on and its identity (`plan_run`), whether a
finished run makes it a no-op (`already_done`), the trainer's launch and how it ended (`run_trainer`), and the report
and manifest it ends with (`finish_run`). The script stays the recipe; training.py builds the trainer's flags.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import checkpoints, draft_kinds, nodes, online, slices
from .compat import stall_watch
from .config.schema import DraftConfig, TrainConfig
from .contract import input_record, write_manifest
from .errors import Interrupted, StageError, Stalled
from .files import held_lock_fds
from .hidden_states import StateFormat
from .manifest import MANIFEST_NAME, CheckpointRef, TrainManifest
from .metrics import METRICS_FILE, compat_applied
from .plots import PLOTS_DIRNAME, write_plots
from .ranks import clear_own, stopped_line
from .resume import INTERRUPTED
from .sizing import checkpoint_bytes
from .stage import config_fingerprint, finished, refuse_unowned, stage_identity
from .target import extraction_layer_ids
from .train_report import choose_checkpoint, summarize, write_summary
from .training import (
    bad_sample_error,
    endpoint_down_error,
    export_compat_settings,
    launch_env,
    require_trained,
    run_in_process,
    skipped_samples,
    stopped_on,
    ttt_steps,
)

log = logging.getLogger("eagle3")

# A resume restores the old optimizer and lr schedule: what 04 says when a setting changed under a run.
RESUME_REMEDY = ("a resume restores the old optimizer and lr schedule from the checkpoints, so it cannot change a run; "
                 "rerun with the old value, choose another --output, or pass --overwrite to train anew (deletes only "
                 "this stage's checkpoints and logs)")


@dataclass
class RunPlan:
    """What one invocation trains on: the layer ids, the inputs' records, its identity, the sliced run's record."""

    layer_ids: list[int]
    inputs: dict[str, Any]
    identity: dict
    source: dict = field(default_factory=dict)  # online/hybrid: where the states come from
    slicing: dict = field(default_factory=dict)

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.layer_ids[:-1]


def plan_run(cfg: TrainConfig, draft: DraftConfig, target, upstream: dict, sliced, mask_token_id: int) -> RunPlan:
    """The layer ids (stage 02's, or online/hybrid the kind's / --layer-ids), the inputs and the identity.

    The one rule for "done" (stage.finished). A resume restores speculators' optimizer AND its lr scheduler (built
    for the old lr, epochs and steps), so every setting that shapes the run is part of the identity: changing one
    mid-run is refused, never recorded as if it had happened. Settings added since runs were made enter it only
    where they are not what those runs did, so their resumes are not refused: feature noise when on, the kind and its
    mask token when not eagle3 (draft_kinds.identity_extra, DraftConfig.identity_settings)."""
    upstream = dict(upstream)
    extracted = upstream["extract"]
    if extracted is not None:
        layer_ids, source = list(extracted.layer_ids), {}
    else:  # online/hybrid: the states a vLLM server computes (checked once the run is not a no-op)
        online.require_endpoint(cfg)
        layer_ids = extraction_layer_ids(target.num_layers, cfg.layer_ids or draft_kinds.layer_ids(
            draft.speculator_type, target.num_layers))
        source = {"hidden_states_source": "vllm", "layer_ids": layer_ids}
        del upstream["extract"]
    inputs = {name: input_record(m) for name, m in upstream.items()}
    identity_inputs = {name: m.content_sha256 for name, m in upstream.items()}
    slicing = {}
    if sliced:  # the slices are the run's input one after another: its identity is the plan over stage 01's rows
        identity_inputs, source, slicing = slices.run_identity(sliced, upstream["prepare"], identity_inputs,
                                                               Path(cfg.output))
    identity = stage_identity(
        cfg, identity_inputs,
        target_config_sha256=target.config_sha256, draft_config=draft.identity_settings(),
        **draft_kinds.identity_extra(draft.speculator_type, ttt_steps(cfg, draft), mask_token_id),
        world_size=cfg.nproc * cfg.nnodes, **source,
        # feature noise changes what is trained, yet a run without it keeps the identity it had before the flag
        **({"noise_std": cfg.noise_std} if cfg.noise_std > 0 else {}),
    )
    return RunPlan(layer_ids, inputs, identity, source, slicing)


def already_done(cfg: TrainConfig, out_dir: Path, identity: dict) -> bool:
    """A finished run of this identity with its best checkpoint recorded: nothing to do (rerunning would train extra
    steps and rewrite the manifest stage 05 was built on). Refuses another identity, and a folder not ours."""
    refuse_unowned(out_dir, "train")  # before anything is locked, deleted or trained: only ours, by our manifest
    try:
        done = finished(out_dir, "train", identity, cfg.overwrite, cfg.check, remedy=RESUME_REMEDY,
                        damaged=lambda changed: checkpoints.refuse_damaged(out_dir, changed))
    except checkpoints.RecordsChanged as records:  # a log cut short or edited: the checkpoints are as written
        name, how = next(iter(records.changed.items()))
        log.warning("%s: %s since 04_train.py wrote it (a record for people, %d file(s) such); the checkpoints are as "
                    "written, so the run stays finished", out_dir / name, how, len(records.changed))
        done = True
    return done and checkpoints.require_recorded_best(out_dir)


def run_trainer(cfg: TrainConfig, spec_argv: list[str], launch: list[str] | None, run: RunPlan, draft: DraftConfig,
                target, vocab, prepared, extracted, server: dict | None, here) -> None:
    """speculators' trainer, in this process or under the launcher (it resumes from the newest checkpoint by itself).
    Every sample is checked as the loader reads it (compat/sample_check.py): stage 02's storage, or vLLM's states.
    How a launched run ended: interrupted (resumable), the endpoint down, a bad sample or loss, a stall, or which
    rank or node stopped first."""
    out_dir = Path(cfg.output)
    stored = StateFormat.from_manifest(extracted) if extracted else None
    sample_spec = {"slots": len(run.layer_ids), "hidden": target.hidden_size, "samples": prepared.counts.rows,
                   "dtype": stored.dtype if stored and not stored.is_fp8 else None,
                   "storage": stored.storage if stored else "any"}
    export_compat_settings(cfg, sample_spec, draft, run.identity)
    if launch is None:
        run_in_process(spec_argv, out_dir / METRICS_FILE, checkpoint_bytes(cfg, draft, target, vocab.draft_vocab_size))
        return
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


def finish_run(cfg: TrainConfig, run: RunPlan, draft: DraftConfig, target, vocab, prepared, resume: dict,
               server: dict | None, mask_token_id: int) -> None:
    """The report (plots/*.png, summary.txt), then the contract: a run that trained on nothing gets neither.
    The manifest records the kind (speculator_type, and the draft config it trained) and its mask token."""
    out_dir = Path(cfg.output)
    trained = require_trained(cfg, prepared.counts.rows, out_dir)
    best, choice = choose_checkpoint(out_dir, draft.num_speculative_tokens)  # by offline tau at the served k
    if best is None:
        raise StageError(f"{out_dir}: training finished without a checkpoint")
    try:
        write_plots(out_dir / METRICS_FILE, out_dir / PLOTS_DIRNAME)
    except Exception as exc:  # curves are a convenience: never fail a finished training on them
        log.warning("plots not written (%s: %s); retry with python -m eagle3_pipeline.plots %s", type(exc).__name__, exc, out_dir)
    summary = {**summarize(out_dir / METRICS_FILE, best, draft.num_speculative_tokens), "checkpoint_choice": choice,
               "speculator_type": draft.speculator_type}
    if choice.get("lowest_val_loss") not in (None, choice["chosen"]):
        log.info("checkpoint_best: epoch folder %s (offline tau at k=%d), not %s (lowest validation loss)",
                 choice["chosen"], draft.num_speculative_tokens, choice["lowest_val_loss"])
    print(write_summary(out_dir, summary), flush=True)
    written = sorted(p.name for p in checkpoints.own_outputs(out_dir)) + [MANIFEST_NAME]
    write_manifest(out_dir, TrainManifest(
        identity=run.identity, best_checkpoint=CheckpointRef(**checkpoints.checkpoint_content(best)),
        epochs=[p.name for p in checkpoints.complete(out_dir)], outputs=written, inputs=run.inputs, target=target.summary(),
        config=cfg.model_dump(), draft_config=draft.model_dump(), speculator_type=draft.speculator_type,
        mask_token_id=mask_token_id, aux_layer_ids=run.aux_layer_ids, draft_vocab_size=vocab.draft_vocab_size,
        summary=summary, config_sha256=config_fingerprint(cfg), resume=resume,
        compat_applied=compat_applied(out_dir / METRICS_FILE),
        hidden_states=server or {"mode": "files", "from": run.inputs["extract"]["path"]},
        bad_samples=skipped_samples(out_dir), trained=trained, **run.slicing,
    ), outputs=checkpoints.written_files(out_dir))
