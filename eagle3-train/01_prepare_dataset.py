#!/usr/bin/env python3
"""Stage 01: conversations -> target chat template -> input_ids + assistant-only loss_mask.

Reads a HF datasets name or a local .jsonl/.json/.parquet file of OpenAI `messages` or
ShareGPT `conversations`, renders each with the target's chat template, and writes the
dataset speculators' trainer reads (save_to_disk: input_ids, loss_mask, seq_len) plus
token_freq.pt and manifest.json. Rows already tokenized for the target (`input_ids` +
`loss_mask`, e.g. speculators' `regenerate-responses` output) pass through after
validation. Run with --help for flags and an example.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from eagle3_pipeline.config import PrepareConfig, resolve_stage_config
from eagle3_pipeline.contract import write_manifest
from eagle3_pipeline.errors import InputError
from eagle3_pipeline.conversations import (
    ChatTokenizer, check_record, conversation_key, fit_length, is_pretokenized, read_records, rows_for_record,
)
from eagle3_pipeline.files import check_writable_dir, remove_stale_temps
from eagle3_pipeline.preflight import hidden_states_estimate_line, preflight_prepare
from eagle3_pipeline.prepared import order_rows, split_conversations, train_data_ratio, write_prepared
from eagle3_pipeline.stage import config_fingerprint, finished_with_same_inputs, log, retire_manifest, stage_main
from eagle3_pipeline.target import load_target_info


@stage_main
def main(argv: list[str] | None = None) -> int:
    # 1. Config.
    cfg, _ = resolve_stage_config(PrepareConfig, argv)
    out_dir = Path(cfg.output)
    target = load_target_info(cfg.target, cfg.tokenizer)
    fingerprint = config_fingerprint(cfg)
    inputs = {"data": cfg.data, "target_config_sha256": target.config_sha256,
              "tokenizer_sha256": target.tokenizer_sha256}

    # 2. Contract: nothing upstream but the raw data; skip if this exact result exists.
    check_writable_dir(out_dir, "--output")
    if finished_with_same_inputs(out_dir, fingerprint, inputs, cfg.overwrite):
        log.info("%s: already prepared with these settings; nothing to do", out_dir)
        return 0
    chat = ChatTokenizer(cfg.tokenizer or cfg.target, cfg.trust_remote_code)
    for line in preflight_prepare(cfg.data, cfg.max_samples, cfg.max_seq_len, target, out_dir):
        log.info("preflight %s", line)
    if cfg.check:  # also read every local row once: bad rows are refused in seconds, not after tokenizing
        if Path(cfg.data).is_file():
            checked = 0
            for where, record in read_records(cfg.data):
                if cfg.max_samples is not None and checked >= cfg.max_samples:
                    break
                check_record(record, target.vocab_size, where)
                checked += 1
            log.info("preflight rows: %d conversation(s) in %s are well-formed", checked, cfg.data)
        return 0
    remove_stale_temps(out_dir)

    # 3. Work: read, validate and tokenize every conversation.
    rows, dropped_too_long, truncated_too_long, pretokenized = [], 0, 0, 0
    conversation_of: dict[str, int] = {}  # conversation key -> index (the split is by conversation)
    records = read_records(cfg.data, cfg.data_split, cfg.data_subset, cfg.trust_remote_code)
    for where, record in tqdm(records, desc="prepare", unit="row", total=cfg.max_samples):
        key = conversation_key(record, where)
        if key not in conversation_of:
            if cfg.max_samples is not None and len(conversation_of) >= cfg.max_samples:
                break
            conversation_of[key] = len(conversation_of)
        pretokenized += is_pretokenized(record)
        for row in rows_for_record(chat, record, conversation_of[key], cfg.rows_per, target.vocab_size, where):
            fitted = fit_length(row, cfg.max_seq_len, cfg.on_too_long)
            if fitted is None:
                dropped_too_long += 1
            else:
                truncated_too_long += len(fitted.input_ids) < len(row.input_ids)
                rows.append(fitted)
    conversations = len(conversation_of)
    if not rows:
        raise InputError(f"{cfg.data}: no rows left from {conversations} conversation(s) "
                         f"({dropped_too_long} longer than --max-seq-len {cfg.max_seq_len})")
    train_convs, val_convs = split_conversations(conversations, cfg.val_ratio, cfg.seed)
    rows, num_train = order_rows(rows, train_convs, val_convs)
    if num_train == 0 or num_train == len(rows):
        raise InputError(f"{cfg.data}: {conversations} conversation(s) cannot be split into train and val "
                         f"(--val-ratio {cfg.val_ratio}); give at least 2 conversations")

    # 4. Outputs (dataset + token_freq.pt, renamed into place).
    retire_manifest(out_dir)  # an old result (--overwrite) stops being finished only now
    stats = write_prepared(out_dir, rows, num_train)
    if dropped_too_long:
        log.warning("dropped %d row(s) longer than --max-seq-len %d (see manifest counts)", dropped_too_long, cfg.max_seq_len)
    if truncated_too_long:
        log.warning("truncated %d row(s) to --max-seq-len %d (see manifest counts)", truncated_too_long, cfg.max_seq_len)

    # 5. Contract last: the directory is finished only once manifest.json exists.
    write_manifest(
        out_dir, "prepare",
        config=cfg.model_dump(), config_sha256=fingerprint, inputs=inputs,
        target=target.summary(),
        counts={"conversations": conversations, "pretokenized_rows": pretokenized, "dropped_too_long": dropped_too_long,
                "truncated_too_long": truncated_too_long, **stats},
        train_data_ratio=train_data_ratio(num_train, len(rows)),
        max_seq_len=cfg.max_seq_len,
    )
    log.info("prepared %d rows (%d train / %d val, %d loss tokens) from %d conversations -> %s",
             stats["rows"], stats["train_rows"], stats["val_rows"], stats["loss_tokens"], conversations, out_dir)
    log.info("%s", hidden_states_estimate_line(stats["rows"], stats["tokens"], target.hidden_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
