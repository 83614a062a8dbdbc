#!/usr/bin/env python3
"""Stage 05: a draft directory vLLM loads with --speculative-config, plus the command.

Takes stage 04's best (or chosen) checkpoint, writes a self-contained speculators-format
draft directory (config.json naming the verifier, model.safetensors with d2t/t2d), loads it
back with speculators to verify it, writes its model card (README.md, from the run's records:
eagle3_pipeline/model_card.py) and prints the `vllm serve` command. The draft's kind (its config's
speculators_model_type: eagle3, peagle, dflash, dflash2, dspark) sets how vLLM serves it (method, k, P-EAGLE's
parallel drafting: eagle3_pipeline/draft_kinds.py). `--layout sglang` writes the
same weights in the layout SGLang's EAGLE-3 loader reads (eagle3_pipeline/sglang_layout.py), which vLLM
loads too. `--check` on a finished export also checks the folder as a hub user meets it (card, config, every
file's digest). Run with --help for flags and an example.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_pipeline import model_card, sglang_layout
from eagle3_pipeline.config import ExportConfig, build_parser
from eagle3_pipeline.config.resolution import resolve_parsed
from eagle3_pipeline.contract import input_record, manifest_path, read_manifest, require_written_files, write_manifest
from eagle3_pipeline.export import (
    DRAFT_FILES,
    check_published,
    choose_checkpoint,
    followed_output,
    lock_file_for,
    refuse_foreign_output,
    refuse_unwritten_entries,
    remove_stale_exports,
    require_finite_weights,
    require_unchanged,
    serve_command,
    serving_plan,
    trained_vocab,
    verify_draft_dir,
    write_card,
    write_draft_dir,
    write_sglang_layout,
)
from eagle3_pipeline.files import atomic_path, atomic_write_text, check_writable_dir, sha256_file
from eagle3_pipeline.manifest import ExportManifest, parse_manifest
from eagle3_pipeline.preflight import preflight_export
from eagle3_pipeline.stage import config_fingerprint, finished, lock_output, log, stage_identity, stage_main
from eagle3_pipeline.vocab import D2T_NAME


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    parser = build_parser(ExportConfig)
    parser.add_argument("--layout", choices=sglang_layout.LAYOUTS, default="speculators",
                        help="speculators: speculators' format (vLLM); sglang: the layout SGLang's EAGLE-3 loader reads "
                             "(LlamaForCausalLMEagle3, SpecForge's; vLLM loads it too). Default: speculators")
    args = vars(parser.parse_args(argv))
    layout = args.pop("layout")
    cfg, _ = resolve_parsed(ExportConfig, args)
    ckpt_dir, out_dir = Path(cfg.checkpoints), followed_output(Path(cfg.output))

    # 2. Contract: a finished training run, and the vocab mapping it was trained with.
    trained = read_manifest(ckpt_dir, "train", "--checkpoints")
    # 04 trains into this folder under its exclusive lock: while it does, there is nothing safe to export.
    if not cfg.check:
        lock_output(ckpt_dir, exclusive=False)
    checkpoint = choose_checkpoint(ckpt_dir, cfg.checkpoint, trained.best_checkpoint.name)
    require_written_files(trained, [f"{checkpoint.name}/{name}" for name in ("config.json", "model.safetensors")])
    # The draft's kind (its config.json; stage 04's record must agree), k and how vLLM serves it (draft_kinds.py).
    plan = serving_plan(checkpoint, trained, cfg.num_speculative_tokens, out_dir)
    if layout == "sglang":  # what SGLang's loader cannot build is refused before anything is written
        sglang_layout.require_servable(plan.trained_config, str(checkpoint / "config.json"))
    model_sha256 = sha256_file(checkpoint / "model.safetensors")
    target, num_tokens = trained.target, plan.k
    verifier = cfg.verifier_name or target["path"]
    if plan.note:
        log.warning("note: %s", plan.note)
    inputs = {"train": input_record(trained), "checkpoint": str(checkpoint.resolve())}
    identity = stage_identity(
        cfg, {"train": trained.content_sha256,
              "checkpoint": {"name": checkpoint.name, "model_sha256": model_sha256}},
        verifier_name=verifier, num_speculative_tokens=num_tokens,
        **({"layout": layout} if layout != "speculators" else {}))  # the default keeps older exports' identity
    # 03's mapping, as 03 wrote it (its manifest and d2t's digest), before "already exported": the export holds the
    # d2t it was made with, so a mapping changed since makes no rerun a no-op (issue 64's sweep)
    vocab = trained_vocab(trained, cfg.vocab)
    check_writable_dir(out_dir.parent, "--output")
    refuse_foreign_output(out_dir)
    # The export replaces out_dir as a whole (a rename), so its lock lives beside it.
    done = finished(out_dir, "export", identity, cfg.overwrite, cfg.check, lock_file=lock_file_for(out_dir),
                    outputs=DRAFT_FILES)
    if cfg.check and manifest_path(out_dir).is_file() and parse_manifest(manifest_path(out_dir)).complete:
        for line in check_published(out_dir):  # the folder as a hub user meets it (a changed file: one line)
            print(line)
    if done:
        log.info("%s: already exported from this checkpoint; nothing to do", out_dir)
        print(serve_command(target["path"], plan.speculative_config, cfg.tensor_parallel_size,
                            target["is_multimodal_wrapper"]))
        return 0
    refuse_unwritten_entries(out_dir)
    vocab_dir = vocab.directory
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
        check = verify_draft_dir(staging, d2t, trained.aux_layer_ids, target["path"], plan.kind) | plan.record()
        if layout == "sglang":
            check.update(write_sglang_layout(staging, target))
        command = serve_command(target["path"], plan.speculative_config, cfg.tensor_parallel_size,
                                target["is_multimodal_wrapper"])
        atomic_write_text(staging / "serve_command.txt", command + "\n")
        # The model card, from the run's own records (model_card.py); listed in the manifest outside output_files.
        card = write_card(staging, plan=plan, verifier=verifier, layout=layout, checkpoint=checkpoint.name,
                          tensor_parallel_size=cfg.tensor_parallel_size, trained=trained, vocab=vocab,
                          draft_dir=out_dir.resolve())
        # 4. Contract (inside the directory before it appears under its final name).
        write_manifest(staging, ExportManifest(
            identity=identity, config=cfg.model_dump(), config_sha256=config_fingerprint(cfg), inputs=inputs,
            target=target, verifier_name=verifier, checkpoint=checkpoint.name, num_speculative_tokens=num_tokens,
            verified=check, serve_command=command, layout=layout, card=card),
            outputs=sorted(p.name for p in staging.iterdir() if p.is_file() and not p.name.startswith(".")
                           and p.name != model_card.CARD_NAME))
    log.info("exported %s (%s, %d params) -> %s", checkpoint.name, check["class"], check["parameters"], out_dir)
    print(f"draft: {out_dir.resolve()}")
    print(f"card: {out_dir.resolve() / model_card.CARD_NAME}")
    print(f"serve: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
