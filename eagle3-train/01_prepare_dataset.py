#!/usr/bin/env python3
"""Stage 01: conversations -> target chat template -> input_ids + assistant-only loss_mask.

Reads a HF datasets name, a local .jsonl/.json/.parquet file or a saved dataset folder of OpenAI `messages` or
ShareGPT `conversations`, renders each with the target's chat template, and writes the
dataset speculators' trainer reads (save_to_disk: input_ids, loss_mask, seq_len) plus
token_freq.pt and manifest.json. Rows already tokenized for the target (`input_ids` +
`loss_mask`, e.g. speculators' `regenerate-responses` output) pass through after
validation. Run with --help for flags and an example.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from eagle3_pipeline.chat_rows import ChatTokenizer, build_rows, refuse_too_many_bad, report_check
from eagle3_pipeline.config import PrepareConfig, resolve_stage_config
from eagle3_pipeline.contract import write_manifest
from eagle3_pipeline.conversations import read_records
from eagle3_pipeline.files import check_writable_dir, remove_stale_temps
from eagle3_pipeline.manifest import PrepareCounts, PrepareManifest
from eagle3_pipeline.preflight import hidden_states_estimate_line, preflight_prepare
from eagle3_pipeline.prepared import (
    REJECTED_NAME,
    prepared_outputs,
    previously_written,
    split_rows,
    train_data_ratio,
    write_prepared,
)
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
from eagle3_pipeline.target import load_target_info


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(PrepareConfig, argv)
    with no_empty_output_left(Path(cfg.output)):  # a failed first run leaves no empty --output with a lock file
        return prepare(cfg)


def prepare(cfg: PrepareConfig) -> int:
    out_dir = Path(cfg.output)
    target = load_target_info(cfg.target, cfg.tokenizer)
    fingerprint = config_fingerprint(cfg)
    inputs = {"data": cfg.data, "target_config_sha256": target.config_sha256,
              "tokenizer_sha256": target.tokenizer_sha256}

    # 2. Contract: nothing upstream but the raw data; skip if this exact result exists.
    check_writable_dir(out_dir, "--output")
    chat = ChatTokenizer(cfg.tokenizer or cfg.target, cfg.trust_remote_code, cfg.template_kwargs(),
                         cfg.end_of_turn_tokens)
    identity = stage_identity(cfg, {"data": data_identity(cfg.data), "target_config": target.config_sha256,
                                    "tokenizer": target.tokenizer_sha256},
                              end_of_turn_ids=sorted(chat.stop_ids))  # where each trained turn ends
    refuse_unowned(out_dir, "prepare")  # a user's own save_to_disk dataset there is never replaced
    if finished(out_dir, "prepare", identity, cfg.overwrite, cfg.check, outputs=prepared_outputs(out_dir)):
        log.info("%s: already prepared with these settings; nothing to do", out_dir)
        return 0
    for line in preflight_prepare(cfg.data, cfg.max_samples, cfg.max_seq_len, target, out_dir):
        log.info("preflight %s", line)

    # 3. Work: read, validate, render and tokenize every row (--check: the same, writing nothing).
    records = read_records(cfg.data, cfg.data_split, cfg.data_subset, cfg.trust_remote_code)
    prepared = build_rows(chat, records, rows_per=cfg.rows_per, vocab_size=target.vocab_size,
                          max_samples=cfg.max_samples, max_seq_len=cfg.max_seq_len, on_too_long=cfg.on_too_long,
                          keep_bad=cfg.check or cfg.on_bad_row == "skip",
                          progress=lambda it: tqdm(it, desc="check" if cfg.check else "prepare", unit="row",
                                                   total=cfg.max_samples))
    if cfg.check:
        report_check(prepared, cfg)
    else:
        refuse_too_many_bad(prepared, cfg.max_bad_fraction, cfg.data)
    rows, num_train = split_rows(prepared, cfg.val_ratio, cfg.seed, cfg.data, cfg.max_seq_len)  # --check refuses too
    if cfg.check:
        return 0

    # 4. Outputs (dataset + token_freq.pt, renamed into place).
    remove_stale_temps(out_dir)
    previous = previously_written(read_own_manifest(out_dir))  # an earlier run's files, as its manifest lists them
    retire_manifest(out_dir)  # an old result (--overwrite) stops being finished only now

    def unfinished(names: list[str]) -> None:  # these files are this stage's from here (a rerun deletes only these)
        write_manifest(out_dir, PrepareManifest(complete=False, identity=identity, outputs=names))

    unfinished(previous)
    stats = write_prepared(out_dir, rows, num_train, prepared.bad + prepared.too_long, remove=previous,
                           installing=unfinished)
    for dropped in prepared.too_long[: cfg.report_problems]:
        log.warning("dropped row %s: %s", dropped.where, dropped.reason)
    if prepared.dropped_too_long:
        log.warning("dropped %d row(s) longer than --max-seq-len %d (listed in %s)",
                    prepared.dropped_too_long, cfg.max_seq_len, out_dir / REJECTED_NAME)
    if prepared.truncated_too_long:
        log.warning("truncated %d row(s) to --max-seq-len %d (see manifest counts)",
                    prepared.truncated_too_long, cfg.max_seq_len)

    # 5. Contract last: the directory is finished only once manifest.json exists.
    write_manifest(out_dir, PrepareManifest(
        config=cfg.model_dump(), config_sha256=fingerprint, inputs=inputs, identity=identity, target=target.summary(),
        counts=PrepareCounts(input_rows=prepared.input_rows, conversations=prepared.conversations,
                             pretokenized_rows=prepared.pretokenized, rejected_rows=len(prepared.bad),
                             dropped_too_long=prepared.dropped_too_long,
                             truncated_too_long=prepared.truncated_too_long, **stats),
        train_data_ratio=train_data_ratio(num_train, len(rows)), max_seq_len=cfg.max_seq_len,
    ), outputs=[*prepared_outputs(out_dir), REJECTED_NAME])
    capped = f" (the first {cfg.max_samples}: --max-samples capped the input)" if prepared.capped else ""
    log.info("prepared %d rows (%d train / %d val, %d loss tokens) from %d conversations%s, %d bad row(s) skipped%s -> %s",
             stats["rows"], stats["train_rows"], stats["val_rows"], stats["loss_tokens"], prepared.conversations, capped,
             len(prepared.bad), f" (listed in {out_dir / REJECTED_NAME})" if prepared.bad else "", out_dir)
    log.info("%s", hidden_states_estimate_line(stats["rows"], stats["tokens"], target.hidden_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
