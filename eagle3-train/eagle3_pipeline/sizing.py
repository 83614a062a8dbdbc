"""The size model: bytes, parameters and optimizer steps of a run, from the target's config and the settings.

Units are decimal (1 TB = 10^12 B), as disks are sold. The hidden-state bytes per token come from
hidden_states.StateFormat; what is checked against these sizes is in preflight.py.
"""

from __future__ import annotations

import json
from pathlib import Path

# Dataset rows on disk: input_ids + loss_mask as int64 (+ arrow offsets, seq_len: small).
PREPARED_BYTES_PER_TOKEN = 16
# Before tokenizing, from the input's size: 16 B per token at >= 2 input bytes per token (the JSON rows' keys and
# quotes included; samples/conversations.jsonl with Kimi's template: 2.9). Was 4 ("~4 bytes of text per token"):
# 21.5 KB promised for that 5.4 KB file, 41 KB written (issue 46).
PREPARED_BYTES_PER_INPUT_BYTE = 8
# Beside the rows, whatever their number: dataset_info.json, state.json, the arrow schema, token_freq.pt, manifest.json.
PREPARED_FIXED_BYTES = 16_000


def prepared_bytes(rows: int, tokens: int) -> int:
    """Stage 01's files once the rows are tokenized: the ids and masks, 3 int64 per row (offsets, seq_len), the rest."""
    return tokens * PREPARED_BYTES_PER_TOKEN + rows * 24 + PREPARED_FIXED_BYTES
# Speculators saves checkpoints in bf16: the model, and the optimizer state per trainable parameter
# (Muon: one momentum buffer; AdamW: two moments).
CHECKPOINT_BYTES = 2
OPTIMIZER_STATES = {"muon": 1, "adamw": 2}
# Training tokens/s per GPU that 04_train's defaults reach at Kimi-K2.5 geometry on an H200, one GPU and
# two under DDP (bench/README.md, "Training throughput"), rounded down: the rate the hidden-state reads
# must keep up with.
TRAIN_TOKENS_PER_S_PER_GPU = 35_000


# Below this many optimizer steps a run is in the regime where steps, not tokens, limit the draft: on the
# SmolLM2 testbed 8K-token steps (4x the steps) trained a better draft than 32K on the same data, and better
# than plain speculators' 8K Muon steps (bench/README.md, "Acceptance length in vLLM";
# bench/results/h200-acceptance-smollm2.json). So a run with few steps packs SMALL_RUN_SEQ_LEN tokens
# (the step-size rule: training.fit_seq_len_to_run).
FEW_OPTIMIZER_STEPS = 1000
SMALL_RUN_SEQ_LEN = 8192


def human_bytes(num_bytes: float) -> str:
    """Decimal units, one decimal: 11,744,051,200,000 -> '11.7 TB'."""
    if abs(num_bytes) < 1000:
        return f"{num_bytes:,.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        num_bytes /= 1000
        if abs(num_bytes) < 1000 or unit == "TB":
            break
    return f"{num_bytes:,.1f} {unit}"


def target_weights_bytes(target_path: str | Path) -> int:
    """Size of the target's weights on disk (the index's total_size, else the shard files)."""
    root = Path(target_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        except (ValueError, OSError):
            pass
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def draft_parameters(hidden_size: int, target_vocab: int, draft_vocab: int, num_layers: int) -> tuple[int, int]:
    """(saved, trainable) parameter counts of an EAGLE-3 draft, roughly (speculators' Eagle3DraftModel).

    Saved: frozen verifier embeddings [V, H] + draft lm_head [Vd, H] + fc [3H -> H] + decoder
    layers taking [embed, hidden] = 2H (attention ~ 2H*H*3 + H*H, MLP 3*H*I). Trainable: all but
    the embeddings.
    """
    h = hidden_size
    inter = int(8 * h / 3)  # the MLP width I of this estimate (draft_config.json has no such key)
    fc = 3 * h * h
    layer = (2 * h * h) * 3 + h * h + 3 * h * inter
    lm_head = draft_vocab * h
    trainable = fc + num_layers * layer + lm_head
    return trainable + target_vocab * h, trainable


def checkpoint_bytes(cfg, draft, target, draft_vocab: int) -> int:
    """One speculators checkpoint on disk: the draft (a DraftConfig) in bf16 + the optimizer state of its
    trainable part."""
    saved, trainable = draft_parameters(target.hidden_size, target.vocab_size, draft_vocab, draft.draft_layers)
    return saved * CHECKPOINT_BYTES + trainable * CHECKPOINT_BYTES * OPTIMIZER_STATES[cfg.optimizer]


def optimizer_steps(cfg, total_tokens: int, train_data_ratio: float) -> tuple[int, int]:
    """(steps per epoch, steps in the run), rows packed up to total_seq_len per rank."""
    per_epoch = max(1, round(total_tokens * train_data_ratio / (cfg.total_seq_len * cfg.nproc * cfg.nnodes)))
    return per_epoch, per_epoch * cfg.epochs
