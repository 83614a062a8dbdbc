"""Draft vocabulary: a thin layer over speculators' frequency -> mapping functions.

speculators' convention (what its trainer and vLLM read): `d2t` [draft_vocab] int64
offsets, target_id = draft_idx + d2t[draft_idx]; `t2d` [target_vocab] bool mask of the
target ids that are in the draft vocab. Saved as d2t.npy / t2d.npy (its `--d2t-path`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .errors import ConfigError, InputError

D2T_NAME, T2D_NAME = "d2t.npy", "t2d.npy"


def resolve_draft_vocab_size(requested: int | None, draft_config_default: int, target_vocab: int) -> tuple[int, str]:
    """An explicit size larger than the target vocab is an error; the default is clipped."""
    if requested is not None:
        if requested > target_vocab:
            raise ConfigError(f"--draft-vocab-size {requested} is larger than the target vocab ({target_vocab})")
        return requested, "flag"
    if draft_config_default > target_vocab:
        return target_vocab, f"draft_config.json's {draft_config_default} clipped to the target vocab"
    return draft_config_default, "draft_config.json"


def load_token_freq(path: Path) -> dict[int, int]:
    if not Path(path).is_file():
        raise InputError(f"{path}: token frequencies missing; rerun 01_prepare_dataset.py")
    freq = torch.load(path, weights_only=True)
    return {int(k): int(v) for k, v in freq.items()}


def build_mapping(token_freq: dict[int, int], draft_vocab_size: int, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    out_of_range = [t for t in token_freq if not 0 <= t < target_vocab]
    if out_of_range:
        raise InputError(f"token ids {out_of_range[:5]} in token_freq.pt are outside the target vocab ({target_vocab})")
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq, draft_vocab_size, target_vocab)
    return d2t.numpy().astype(np.int64), t2d.numpy().astype(bool)


def coverage(token_freq: dict[int, int], t2d: np.ndarray) -> float:
    total = sum(token_freq.values())
    covered = sum(c for t, c in token_freq.items() if t2d[t])
    return covered / total if total else 0.0


def count_loss_tokens(rows_input_ids, rows_loss_mask, desc: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ids, mask in tqdm(zip(rows_input_ids, rows_loss_mask), desc=desc, unit="row", total=len(rows_input_ids)):
        for token, m in zip(ids, mask):
            if m:
                counts[token] = counts.get(token, 0) + 1
    return counts


def mapping_sha256(directory: Path) -> str:
    from .files import sha256_json, sha256_file

    return sha256_json({name: sha256_file(Path(directory) / name) for name in (D2T_NAME, T2D_NAME)})
