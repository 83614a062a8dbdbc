#!/usr/bin/env python3
"""Stage 06: the exported draft's acceptance in vLLM on the user's prompts, and a verdict on it.

Serves the target with stage 05's draft (the speculative_config its kind needs: eagle3, peagle, dflash, and on a
GPU dflash2 and dspark, eagle3_pipeline/draft_kinds.py; k and tensor parallel size from stage 05 unless given)
and, on the same prompts, the target alone. The prompts (a jsonl of OpenAI messages, optional `category`) are
rendered with the chat template and template kwargs stage 01 trained with. Reports tau (1 + accepted/drafts),
acceptance per draft position 1..k (positions the draft never trained marked) and tau per category with standard
errors, and output tokens/s with and without the draft (report.json, report.txt, report.png). A tau at or below
--min-tau, a first-position acceptance below --min-first-acceptance, or a draft not served as trained (a d2t
or aux layer ids other than stages 03/04's, whatever its tau) exits 6 with one line naming the likely causes
the stage checked itself (eagle3_pipeline/verdict.py). A draft vLLM cannot serve (its files cut short, weights
that do not fit the target, another method, a kind the installed vLLM cannot serve, a --max-model-len above the
target's) is refused in one line before any engine starts; an engine that still fails is one line quoting vLLM's
reason.
Run with --help for flags and an example.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.chat_rows import ChatTokenizer
from eagle3_pipeline.config import EvaluateConfig, resolve_stage_config
from eagle3_pipeline.contract import (
    input_record,
    read_manifest,
    read_recorded_input,
    require_written_files,
    write_manifest,
)
from eagle3_pipeline.errors import ConfigError, ContractError, PreflightError
from eagle3_pipeline.eval_prompts import render_prompts
from eagle3_pipeline.eval_report import (
    REPORT_JSON,
    ViewsDamaged,
    already_evaluated,
    build_report,
    refuse_output_inside,
    report_outcome,
    update_card,
    views_only,
    write_report_files,
)
from eagle3_pipeline.evaluate import measure_acceptance, stage_settings
from eagle3_pipeline.export import DRAFT_FILES, evaluation_plan, lock_draft_for_reading
from eagle3_pipeline.files import check_writable_dir, file_fingerprint, remove_stale_temps
from eagle3_pipeline.machine import probe_gpus
from eagle3_pipeline.manifest import EvaluateManifest
from eagle3_pipeline.preflight import preflight_evaluate
from eagle3_pipeline.stage import (
    config_fingerprint,
    data_identity,
    finished,
    log,
    no_empty_output_left,
    read_own_manifest,
    refuse_unowned,
    retire_manifest,
    stage_identity,
    stage_main,
)
from eagle3_pipeline.target import load_target_info, max_model_len_limit
from eagle3_pipeline.verdict import check_line, read_draft, refuse_blocking, self_checks, verdict
from eagle3_pipeline.vocab import D2T_NAME


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(EvaluateConfig, argv)
    draft_dir, out_dir = Path(cfg.draft), Path(cfg.output)

    # 2. Contracts: stage 05's export, the training run it came from, and stage 01's and 03's outputs that run used.
    exported = read_manifest(draft_dir, "export", "--draft")
    trained = read_recorded_input(exported, "train", cfg.checkpoints, "--checkpoints", relation="exported from")
    prepared = read_recorded_input(trained, "prepare", cfg.data, "--data", relation="trained on")
    vocab = read_recorded_input(trained, "vocab", cfg.vocab, "--vocab", relation="trained with")
    tokenizer_dir = prepared.config.get("tokenizer")  # stage 01's own --tokenizer, if it had one
    target = load_target_info(cfg.target or exported.target["path"], tokenizer_dir)
    if target.config_sha256 != exported.target["config_sha256"]:
        raise ContractError(f"{Path(target.path) / 'config.json'}: not the target {draft_dir} was trained for (its "
                            f"config differs from the one {exported.path} records); pass --target with that model")
    # 05 re-exporting this draft while it is measured would swap the files under vLLM: a shared lock on the
    # export's own lock (05 takes it exclusively) for as long as 06 runs (--check takes none).
    if not cfg.check:
        lock_draft_for_reading(draft_dir)
    # The draft's two files, whole (a half-written export is one line naming the file), the bytes 05 wrote (its
    # manifest's sizes and digests: one byte changed since is refused, naming the file), and the limit vLLM
    # would enforce on --max-model-len: all refused here, before any engine starts.
    draft = read_draft(draft_dir)
    require_written_files(exported, DRAFT_FILES)
    # The draft's kind, how the vLLM here serves it (a kind it cannot serve: one line) and k (export.py).
    plan = evaluation_plan(draft_dir, draft[0], trained, exported, cfg.num_speculative_tokens, bool(probe_gpus()))
    log.info("%s", plan.line)
    model_limit = max_model_len_limit(target)
    if model_limit is not None and cfg.max_model_len > model_limit:
        raise ConfigError(f"--max-model-len {cfg.max_model_len}: above the target's limit of {model_limit} tokens "
                          f"({Path(target.path) / 'config.json'}); vLLM refuses it: pass at most {model_limit}")
    k, tensor_parallel = plan.k, cfg.tensor_parallel_size or exported.config["tensor_parallel_size"]
    if plan.note:
        log.warning("note: %s", plan.note)
    trained_kwargs = json.loads(prepared.config.get("chat_template_kwargs") or "{}")
    template_kwargs = json.loads(cfg.chat_template_kwargs) if cfg.chat_template_kwargs else trained_kwargs

    require_written_files(vocab, [D2T_NAME])  # stage 03's mapping the d2t check compares with: as 03 wrote it
    # The causes of "acceptance ~1" that the files show, checked before any engine starts (verdict.py).
    findings = self_checks(draft, plan, target, trained, vocab, prepared, template_kwargs, trained_kwargs)
    # Rendered as stage 01 rendered its rows: its tokenizer, end-of-turn tokens and (unless given) template kwargs.
    chat = ChatTokenizer(tokenizer_dir or target.path, cfg.trust_remote_code, template_kwargs,
                         prepared.config.get("end_of_turn_tokens") or [])
    prompts = render_prompts(Path(cfg.prompts), chat, cfg.max_model_len, cfg.max_tokens, cfg.max_prompts, model_limit)
    categories = [p.category for p in prompts]
    log.info("%d prompts from %s (%s), chat_template_kwargs %s", len(prompts), cfg.prompts,
             ", ".join(f"{c} {categories.count(c)}" for c in sorted(set(categories))), template_kwargs)

    identity = stage_identity(
        cfg, {"export": exported.content_sha256, "prompts": data_identity(cfg.prompts),
              "target_config": target.config_sha256,
              # the draft's own bytes (cheap fingerprints): a draft edited in place is another input
              "draft_files": {name: file_fingerprint(draft_dir / name) for name in DRAFT_FILES}},
        num_speculative_tokens=k, tensor_parallel_size=tensor_parallel, chat_template_kwargs=template_kwargs)
    refuse_blocking(findings, draft_dir, cfg.check, len(prompts))  # what vLLM cannot serve: no engine

    # The report is never written inside an input's folder: rerunning that stage with --overwrite deletes it.
    refuse_output_inside(out_dir, {"--draft": (draft_dir, "stage 05's output"),
                                   "--checkpoints": (trained.directory, "stage 04's output"),
                                   "--data": (prepared.directory, "stage 01's output"),
                                   "--vocab": (vocab.directory, "stage 03's output"),
                                   "--target": (Path(target.path), "the target model's folder")})
    check_writable_dir(out_dir, "--output")
    refuse_unowned(out_dir, "evaluate")
    with no_empty_output_left(out_dir):  # a refused or failed first run leaves no empty --output behind
        try:
            done = finished(out_dir, "evaluate", identity, cfg.overwrite, cfg.check, outputs=(REPORT_JSON,),
                            damaged=views_only)
            views = []
        except ViewsDamaged as damaged:  # report.json as written, only a view of it damaged: drawn again, no engine
            done, views = True, damaged.names
        if done:
            report = already_evaluated(out_dir, cfg.check, views)
            if report is not None:
                if not cfg.check:  # the card's section as this report says (a card restored or edited since)
                    done_manifest = read_own_manifest(out_dir)
                    update_card(draft_dir, report, done_manifest.versions, done_manifest.created)
                return report_outcome(report)
        return measure(cfg, out_dir, draft_dir, identity, findings, prompts, categories, plan, tensor_parallel,
                       template_kwargs, target, exported, trained, prepared, vocab)


def measure(cfg, out_dir, draft_dir, identity, findings, prompts, categories, plan, tensor_parallel, template_kwargs,
            target, exported, trained, prepared, vocab) -> int:
    try:
        preflight = preflight_evaluate(target, tensor_parallel)
    except PreflightError as exc:
        if cfg.check:  # what ran and what cannot run here, in one line (make smoke prints it)
            print(check_line(findings, len(prompts), f"skipped: {getattr(exc, 'why', '') or exc}"))
        raise
    for line in preflight:
        log.info("preflight %s", line)
    if cfg.check:
        print(check_line(findings, len(prompts), "can run here"))
        return 0

    # 3. Work: the target with the draft, then alone (each engine in its own process: vLLM's counters are global).
    remove_stale_temps(out_dir)
    retire_manifest(out_dir)  # an old report (--overwrite) stops being finished only now
    written = write_manifest(out_dir, EvaluateManifest(complete=False, identity=identity))  # logs/ is this stage's from here
    settings = stage_settings(cfg, target, tensor_parallel, bool(probe_gpus()))
    measured = measure_acceptance(target.path, {"draft": str(draft_dir.resolve())}, [p.token_ids for p in prompts],
                                  groups=categories, ks=(plan.k,), settings=settings, log_dir=out_dir / "logs",
                                  log=lambda line: log.info("%s", line), with_baseline=cfg.baseline,
                                  speculative_config=plan.speculative_config)
    spec = next(iter(measured["runs"].values()))["spec_decode"]
    judged = verdict(spec, findings, cfg.min_tau, cfg.min_first_acceptance, plan.positions)
    report = build_report(measured, draft=str(draft_dir.resolve()), target=target.path, k=plan.k,
                          tensor_parallel_size=tensor_parallel, prompts_file=str(Path(cfg.prompts).resolve()),
                          categories=categories, template_kwargs=template_kwargs, verdict=judged, kind=plan.kind.name)

    # 4. Outputs, then 5. the contract (last: the directory is finished only once manifest.json exists).
    outputs = write_report_files(out_dir, report)
    written = write_manifest(out_dir, EvaluateManifest(
        identity=identity, config=cfg.model_dump(), config_sha256=config_fingerprint(cfg), target=exported.target,
        inputs={"export": input_record(exported), "train": input_record(trained), "prepare": input_record(prepared),
                "vocab": input_record(vocab), "prompts": str(Path(cfg.prompts).resolve())},
        draft=str(draft_dir.resolve()), num_speculative_tokens=plan.k, tensor_parallel_size=tensor_parallel,
        chat_template_kwargs=template_kwargs, prompts=len(prompts), mean_acceptance_length=spec["mean_acceptance_length"],
        mean_acceptance_length_stderr=spec["mean_acceptance_length_stderr"], verdict=judged),
        outputs=outputs)  # output_files: the one record of written files every stage keeps (run_all --status reads it)
    log.info("report -> %s", out_dir)
    update_card(draft_dir, report, written.versions, written.created)  # the draft's card: its measured section
    return report_outcome(report)


if __name__ == "__main__":
    raise SystemExit(main())
