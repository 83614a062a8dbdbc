#!/usr/bin/env python3
"""Stage 06: the exported draft's acceptance in vLLM on the user's prompts, and a verdict on it.

Serves the target with stage 05's draft (method eagle3, k and tensor parallel size from stage 05 unless
given) and, on the same prompts, the target alone. The prompts (a jsonl of OpenAI messages, optional
`category`) are rendered with the chat template and template kwargs stage 01 trained with. Reports tau
(1 + accepted/drafts), acceptance per draft position and tau per category with standard errors, and
output tokens/s with and without the draft (report.json, report.txt, report.png). A tau at or below
--min-tau, a first-position acceptance below --min-first-acceptance, or a draft not served as trained (a d2t
or aux layer ids other than stages 03/04's, whatever its tau) exits 6 with one line naming the likely causes
the stage checked itself (eagle3_pipeline/verdict.py). A draft vLLM cannot serve (its files
cut short, weights that do not fit the target, another method, a --max-model-len above the target's) is
refused in one line before any engine starts; an engine that still fails is one line quoting vLLM's reason.
Run with --help for flags and an example.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle3_pipeline.chat_rows import ChatTokenizer
from eagle3_pipeline.config import EvaluateConfig, resolve_stage_config
from eagle3_pipeline.contract import (
    input_record,
    read_manifest,
    read_recorded_input,
    require_written_files,
    write_manifest,
)
from eagle3_pipeline.errors import ConfigError, ContractError, DraftRejected, PreflightError
from eagle3_pipeline.eval_prompts import render_prompts
from eagle3_pipeline.eval_report import (
    REPORT_JSON,
    REPORT_PNG,
    REPORT_TEXT,
    ViewsDamaged,
    already_evaluated,
    build_report,
    format_report,
    refuse_output_inside,
    update_card,
    views_only,
    write_plot,
)
from eagle3_pipeline.evaluate import VllmSettings, gpu_memory_args, measure_acceptance
from eagle3_pipeline.export import DRAFT_FILES, k_above_training, lock_draft_for_reading
from eagle3_pipeline.files import (
    atomic_write_json,
    atomic_write_text,
    check_writable_dir,
    file_fingerprint,
    remove_stale_temps,
)
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
from eagle3_pipeline.verdict import (
    PROBLEM,
    check_d2t,
    check_layer_ids,
    check_method,
    check_template,
    check_weights,
    read_draft,
    verdict,
)
from eagle3_pipeline.vocab import D2T_NAME

METHOD = "eagle3"  # what vLLM is asked to serve the draft as (the method check compares the draft's config with it)


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
    draft_config, draft_shapes, d2t = read_draft(draft_dir)
    require_written_files(exported, DRAFT_FILES)
    model_limit = max_model_len_limit(target)
    if model_limit is not None and cfg.max_model_len > model_limit:
        raise ConfigError(f"--max-model-len {cfg.max_model_len}: above the target's limit of {model_limit} tokens "
                          f"({Path(target.path) / 'config.json'}); vLLM refuses it: pass at most {model_limit}")
    k = cfg.num_speculative_tokens or draft_speculative_tokens(draft_config) or exported.num_speculative_tokens
    tensor_parallel = cfg.tensor_parallel_size or exported.config["tensor_parallel_size"]
    if note := k_above_training(k, trained.draft_config):
        log.warning("note: %s", note)
    trained_kwargs = json.loads(prepared.config.get("chat_template_kwargs") or "{}")
    template_kwargs = json.loads(cfg.chat_template_kwargs) if cfg.chat_template_kwargs else trained_kwargs

    require_written_files(vocab, [D2T_NAME])  # stage 03's mapping the d2t check compares with: as 03 wrote it
    # The causes of "acceptance ~1" that the files show, checked before any engine starts (verdict.py).
    findings = [
        check_layer_ids(draft_config, target.num_layers, trained.aux_layer_ids),
        check_d2t(d2t, vocab_d2t(vocab.directory), str(vocab.directory / D2T_NAME)),
        check_method(draft_config, METHOD),
        check_template(template_kwargs, trained_kwargs, target.tokenizer_sha256, prepared.target["tokenizer_sha256"]),
        check_weights(draft_config, draft_shapes, target.hidden_size, target.vocab_size),
    ]
    for finding in findings:
        (log.warning if finding.status == "problem" else log.info)("self-check %s: %s: %s", finding.check,
                                                                    finding.status, finding.detail)
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
    # A draft vLLM cannot serve (another method, layer ids outside the target, weights that do not fit) stops
    # here: the engine would end in a traceback, or measure nothing worth a verdict.
    blocking = [f for f in findings if f.blocks and f.status == PROBLEM]
    if blocking:
        if cfg.check:
            print(check_line(findings, len(prompts), "not measured: vLLM cannot serve this draft"))
        first = blocking[0]
        # another method is the verdict's own cause (tau exactly 1 in vLLM): the verdict's exit code, 6
        error = DraftRejected if first.check == "method" else ContractError
        raise error(f"{draft_dir / first.file}: vLLM cannot serve this draft ({first.check}: {first.detail}); "
                    f"no engine was started: export the draft for this target again (05_export.py)")

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
        return measure(cfg, out_dir, draft_dir, identity, findings, prompts, categories, k, tensor_parallel,
                       template_kwargs, target, exported, trained, prepared, vocab)


def measure(cfg, out_dir, draft_dir, identity, findings, prompts, categories, k, tensor_parallel, template_kwargs,
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
    extra = {"tensor_parallel_size": tensor_parallel, "trust_remote_code": cfg.trust_remote_code}
    if target.is_multimodal_wrapper:
        extra["language_model_only"] = True  # Kimi-K2.5: text only, no vision tower (as the serve command)
    if probe_gpus():
        extra.update(gpu_memory_args(cfg.gpu_memory_utilization, cfg.kv_cache_memory_gib))
    settings = VllmSettings(max_tokens=cfg.max_tokens, max_model_len=cfg.max_model_len, dtype=cfg.dtype,
                            max_num_seqs=cfg.max_num_seqs, kv_cache_gib=cfg.cpu_kv_cache_gib, seed=cfg.seed,
                            enforce_eager=cfg.enforce_eager, warmup_prompts=1, temperature=cfg.temperature,
                            extra_engine_args=extra)
    measured = measure_acceptance(target.path, {"draft": str(draft_dir.resolve())}, [p.token_ids for p in prompts],
                                  groups=categories, ks=(k,), settings=settings, log_dir=out_dir / "logs",
                                  log=lambda line: log.info("%s", line), with_baseline=cfg.baseline)
    spec = next(iter(measured["runs"].values()))["spec_decode"]
    judged = verdict(spec, findings, cfg.min_tau, cfg.min_first_acceptance)
    report = build_report(measured, draft=str(draft_dir.resolve()), target=target.path, k=k,
                          tensor_parallel_size=tensor_parallel, prompts_file=str(Path(cfg.prompts).resolve()),
                          categories=categories, template_kwargs=template_kwargs, verdict=judged)

    # 4. Outputs, then 5. the contract (last: the directory is finished only once manifest.json exists).
    atomic_write_json(out_dir / REPORT_JSON, report)
    atomic_write_text(out_dir / REPORT_TEXT, format_report(report) + "\n")
    outputs = [REPORT_JSON, REPORT_TEXT] + ([REPORT_PNG] if write_plot(report, out_dir / REPORT_PNG) else [])
    written = write_manifest(out_dir, EvaluateManifest(
        identity=identity, config=cfg.model_dump(), config_sha256=config_fingerprint(cfg), target=exported.target,
        inputs={"export": input_record(exported), "train": input_record(trained), "prepare": input_record(prepared),
                "vocab": input_record(vocab), "prompts": str(Path(cfg.prompts).resolve())},
        draft=str(draft_dir.resolve()), num_speculative_tokens=k, tensor_parallel_size=tensor_parallel,
        chat_template_kwargs=template_kwargs, prompts=len(prompts), mean_acceptance_length=spec["mean_acceptance_length"],
        mean_acceptance_length_stderr=spec["mean_acceptance_length_stderr"], verdict=judged),
        outputs=outputs)  # output_files: the one record of written files every stage keeps (run_all --status reads it)
    log.info("report -> %s", out_dir)
    update_card(draft_dir, report, written.versions, written.created)  # the draft's card: its measured section
    return report_outcome(report)


def check_line(findings, num_prompts: int, measurement: str) -> str:
    checks = "; ".join(f"{f.check} {f.status}" for f in findings)
    return f"06 --check: ran the self-checks ({checks}) and rendered {num_prompts} prompts; tau in vLLM {measurement}"


def report_outcome(report: dict) -> int:
    """Print the report's screen; a failed verdict is the stage's error line (exit 6)."""
    print(format_report(report))
    if not report["verdict"]["passed"]:
        raise DraftRejected(report["verdict"]["line"])
    return 0


def draft_speculative_tokens(draft_config: dict) -> int | None:
    """k as the draft's config proposes it (speculators_config.proposal_methods, what stage 05 wrote)."""
    methods = (draft_config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return methods[0].get("speculative_tokens")


def vocab_d2t(vocab_dir: Path) -> np.ndarray | None:
    path = vocab_dir / D2T_NAME
    return np.load(path) if path.is_file() else None


if __name__ == "__main__":
    raise SystemExit(main())
