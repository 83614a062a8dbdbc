"""Acceptance length tau: the offline estimate from training metrics, and the measurement in vLLM.

tau is the mean number of tokens one target forward pass produces with speculative decoding:
the accepted draft tokens plus the one token the target always contributes (the correction at
the first mismatch, or the bonus token when every draft token was accepted). It is what decides
the speed-up, so it is the figure a draft is judged by.

Two sources:

* offline, from speculators' validation metrics (`offline_estimate`, with stage 04's formula
  `eagle3_pipeline.train_report.expected_accepted_length`): cheap, printed by training, but an
  estimate (see that docstring for the assumptions);
* in vLLM (`measure_acceptance`): the measurement itself lives in the product's library
  (`eagle3_pipeline.evaluate`, which stage 06 runs too: vLLM's spec-decode counters, tau = 1 +
  accepted / drafts, per-position acceptance, standard errors); this module renders the bench's
  prompt files for it and re-exports its names, so the bench and stage 06 measure the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from eagle3_pipeline import evaluate
from eagle3_pipeline.eval_prompts import prompt_messages
from eagle3_pipeline.evaluate import (  # noqa: F401  (re-exported: the bench's scripts and tests import them here)
    SPEC_DECODE_COUNTERS,
    SPEC_DECODE_PER_POS,
    VllmSettings,
    agreement,
    counters_delta,
    in_dependency_order,
    repeated_ngram_fraction,
    run_engine,
    run_engine_isolated,
    spec_decode_counters,
    summarize_spec_decode,
)
from eagle3_pipeline.train_report import expected_accepted_lengths, full_acc_by_step

# ---------------------------------------------------------------------------------------------
# Offline estimate


def read_val_metrics(path: str | os.PathLike) -> dict[str, float]:
    """The validation metrics speculators saved for a checkpoint.

    `path` may be the `val_metrics.json` file, a checkpoint directory holding it
    (`<save-path>/<epoch>/`), or a save path, whose `checkpoint_best` is then used.
    """
    path = Path(path)
    candidates = [path] if path.suffix == ".json" else [
        path / "val_metrics.json",
        path / "checkpoint_best" / "val_metrics.json",
    ]
    for candidate in candidates:
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise FileNotFoundError(f"no val_metrics.json at {path} (looked at {candidates})")


def offline_estimate(val_metrics: Mapping[str, float]) -> dict:
    """full_acc per TTT step and tau(k) for every k it supports, as a JSON-ready dict."""
    full_acc = full_acc_by_step(val_metrics)
    return {
        "full_acc": full_acc,
        "expected_accepted_length": {str(k): v for k, v in expected_accepted_lengths(full_acc).items()},
    }


# ---------------------------------------------------------------------------------------------
# In vLLM: the bench's prompt files, measured by eagle3_pipeline.evaluate


def prompt_token_ids(target_dir: str | os.PathLike, prompts_path: str | os.PathLike,
                     limit: int | None = None) -> list[list[int]]:
    """Held-out prompts (jsonl rows with OpenAI `messages`) rendered with the target's chat
    template, generation prompt appended, as token ids. The prompt is the conversation without a final
    assistant message only (stage 06's rule, `eval_prompts.prompt_messages`): a multi-turn prompt keeps the
    target's own earlier answer. (Until the 06-vs-bench comparison found it, every assistant message was
    dropped here, so multi-turn prompts were measured without their first answer.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    rows = []
    with open(prompts_path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    if limit is not None:
        rows = rows[:limit]
    out = []
    for row in rows:
        messages = prompt_messages(row["messages"])
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def prompt_kinds(prompts_path: str | os.PathLike, limit: int | None = None) -> list[str] | None:
    """The `kind` (or stage 06's `category`) of each held-out prompt row (code, explanation, multi-turn, ...), or
    None if unlabelled."""
    with open(prompts_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:limit] if limit is not None else rows
    kinds = [row.get("kind") or row.get("category") for row in rows]
    return kinds if all(kinds) else None


def measure_acceptance(target_dir, drafts: Mapping[str, str], prompts_path,
                       ks: Sequence[int] = (1, 2, 3), settings: VllmSettings | None = None,
                       num_prompts: int | None = None, log_dir: str | os.PathLike | None = None,
                       log=print, baseline: tuple[dict, list[list[int]]] | None = None, jobs: int = 1) -> dict:
    """`eagle3_pipeline.evaluate.measure_acceptance` on a bench prompt file (jsonl rows with OpenAI
    `messages`, optional `kind`), rendered by `prompt_token_ids`; the result also names the file."""
    prompts = prompt_token_ids(target_dir, prompts_path, num_prompts)
    result = evaluate.measure_acceptance(target_dir, drafts, prompts, groups=prompt_kinds(prompts_path, num_prompts),
                                         ks=ks, settings=settings, log_dir=log_dir, log=log, baseline=baseline,
                                         jobs=jobs)
    return {"target": result.pop("target"), "prompts": str(prompts_path), **result}


def draft_vocab_coverage(token_ids: Sequence[Sequence[int]], t2d) -> float:
    """Fraction of the target's generated tokens that the draft vocabulary contains.

    A token outside it can never be drafted, so 1 - coverage bounds the acceptance at every
    position from above; it is also where the offline estimate is optimistic (see
    `expected_accepted_length`). `t2d` is stage 03's boolean mask over the target vocabulary.
    """
    total = sum(len(t) for t in token_ids)
    inside = sum(bool(t2d[i]) for tokens in token_ids for i in tokens)
    return inside / max(1, total)

