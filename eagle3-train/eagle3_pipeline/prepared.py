"""The prepared dataset directory (stage 01's output, speculators' training layout).

    DATA/
      data-*.arrow, dataset_info.json, state.json   datasets.save_to_disk: input_ids, loss_mask, seq_len (int64)
      token_freq.pt                                  {token_id: count} over loss-masked tokens of the train rows
      rejected.jsonl                                 --on-bad-row skip: each refused input row, where and why
      manifest.json                                  stage 01's contract (written last)
      hidden_states/ (one file per row, hidden_states.py) + manifest.json   stage 02

Rows are ordered train first, then validation: speculators takes the last
(1 - train_data_ratio) of rows as its val split, so the manifest records the ratio that
reproduces exactly our split, and stage 04 passes it on.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from .chat_rows import BadRow, PreparedRows, Row
from .errors import InputError, StageError
from .files import DiskFull, is_disk_full, remove_path, temp_path_for
from .sizing import human_bytes, prepared_bytes

# Local imports: datasets, speculators: imported where the dataset is read or written (heavy; importers that only name paths need none).

TOKEN_FREQ_NAME = "token_freq.pt"
REJECTED_NAME = "rejected.jsonl"


def split_conversations(num_conversations: int, val_ratio: float, seed: int) -> tuple[list[int], list[int]]:
    """Shuffle conversation indices (seeded) and hold out the last val_ratio of them.

    Splitting by conversation, not by row, keeps every turn of one conversation on one
    side, so per-turn rows never leak a validation answer into training.
    """
    order = list(range(num_conversations))
    random.Random(seed).shuffle(order)
    num_val = max(1, round(num_conversations * val_ratio)) if num_conversations > 1 else 0
    return order[: num_conversations - num_val], order[num_conversations - num_val:]


def order_rows(rows: list[Row], train_convs: list[int], val_convs: list[int]) -> tuple[list[Row], int]:
    by_conv: dict[int, list[Row]] = {}
    for row in rows:
        by_conv.setdefault(row.conversation, []).append(row)
    train = [r for c in train_convs for r in by_conv.get(c, [])]
    val = [r for c in val_convs for r in by_conv.get(c, [])]
    return train + val, len(train)


def split_rows(prepared: PreparedRows, val_ratio: float, seed: int, source: str,
               max_seq_len: int) -> tuple[list[Row], int]:
    """(rows, train rows): the rows ordered train conversations first. No rows left, or conversations that
    cannot be split into both sides, are refused (stage 01 and its --check alike)."""
    if not prepared.rows:
        raise InputError(f"{source}: no rows left from {prepared.conversations} conversation(s) "
                         f"({prepared.dropped_too_long} longer than --max-seq-len {max_seq_len})")
    train_convs, val_convs = split_conversations(prepared.conversations, val_ratio, seed)
    rows, num_train = order_rows(prepared.rows, train_convs, val_convs)
    if num_train == 0 or num_train == len(rows):
        raise InputError(f"{source}: {prepared.conversations} conversation(s) cannot be split into train and val "
                         f"(--val-ratio {val_ratio}); give at least 2 conversations")
    return rows, num_train


def train_data_ratio(num_train: int, num_rows: int) -> float:
    """A ratio for which speculators' int(num_rows * ratio) is exactly num_train."""
    return (num_train + 0.5) / num_rows


def write_prepared(out_dir: Path, rows: list[Row], num_train: int, bad: list[BadRow] = (), remove: Sequence[str] = (),
                   installing: Callable[[list[str]], None] | None = None) -> dict:
    """Write the dataset + token_freq.pt (+ rejected.jsonl) into out_dir (files renamed into place); returns stats.
    `remove`: the earlier run's files (previously_written: by its manifest, never by name pattern), deleted where this
    run writes no file of that name. `installing(names)`: called with every name about to be replaced or deleted, before
    the first is (the unfinished manifest lists them, so a kill in between leaves nothing unlisted)."""
    import datasets
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
    })
    table = {
        "input_ids": [r.input_ids for r in rows],
        "loss_mask": [r.loss_mask for r in rows],
        "seq_len": [len(r.input_ids) for r in rows],
    }
    # speculators' ArrowDataset compares tensors: the torch format is saved in state.json.
    dataset = datasets.Dataset.from_dict(table, features=features).with_format("torch")
    staging = temp_path_for(out_dir / "prepare")
    remove_path(staging)
    try:
        dataset.save_to_disk(str(staging))
        # speculators' own counter (loss-masked tokens only), over the train rows only.
        save_token_frequency_distribution(
            dataset.select(range(num_train)), staging / TOKEN_FREQ_NAME
        )
        if bad:
            (staging / REJECTED_NAME).write_text("".join(b.as_json() + "\n" for b in bad), encoding="utf-8")
        staged = sorted(item.name for item in staging.iterdir())
        if installing is not None:
            installing(sorted(set(staged) | set(remove)))
        for name in remove:
            if name not in staged:
                remove_path(out_dir / name)
        for name in staged:
            os.replace(staging / name, out_dir / name)
    except Exception as exc:  # the disk filled after the preflight: one line (datasets/pyarrow raise OSError, torch text)
        if not is_disk_full(exc):
            raise
        remove_path(staging)  # the space back before the free bytes are measured
        need = prepared_bytes(len(rows), sum(table["seq_len"]))
        raise StageError(f"{DiskFull(out_dir, out_dir)}; the prepared dataset needs ~{human_bytes(need)} ({need:,} B); "
                         f"free space, then rerun") from None
    finally:
        remove_path(staging)
    return {
        "rows": len(rows),
        "train_rows": num_train,
        "val_rows": len(rows) - num_train,
        "tokens": sum(table["seq_len"]),
        "loss_tokens": sum(sum(r.loss_mask) for r in rows),
        "max_row_tokens": max(table["seq_len"]) if rows else 0,
    }


def prepared_outputs(out_dir: Path) -> list[str]:
    """The files stage 01 wrote into out_dir (its `finished` checks they are all there): the dataset's state and info,
    the data files its state.json names, token_freq.pt."""
    names = ["state.json", "dataset_info.json", TOKEN_FREQ_NAME]
    try:
        names += [entry["filename"] for entry in json.loads((Path(out_dir) / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # state.json gone or unreadable: its own name is already listed as missing
    return names


def previously_written(manifest) -> list[str]:
    """The files of out_dir that its stage-01 manifest (read_own_manifest; None: none) says an earlier run wrote: a
    finished run's `output_files`; an unfinished one's `outputs` (what it was installing when it stopped); a manifest
    from before those records: the files its state.json names, token_freq.pt, rejected.jsonl (prepared_outputs). A
    rerun deletes only these (issue 64: before, whatever matched data-*.arrow and the like), never 02's hidden_states/
    beside them, a hidden file or a user's."""
    if manifest is None:
        return []
    names = list(manifest.output_files or manifest.outputs or ())
    if not names and manifest.output_files is None and manifest.outputs is None:
        names = [*prepared_outputs(manifest.directory), REJECTED_NAME]
    return [name for name in names if Path(name).name == name and not name.startswith(".") and name != "manifest.json"]


def load_prepared(data_dir: Path):
    import datasets

    return datasets.load_from_disk(str(data_dir))


def load_rows(data_dir: Path, max_rows: int | None = None) -> list[list[int]]:
    """input_ids of every row (or the first max_rows), as plain lists."""
    dataset = load_prepared(data_dir).with_format(None)
    if max_rows is not None:
        dataset = dataset.select(range(min(max_rows, len(dataset))))
    return [list(ids) for ids in dataset["input_ids"]]
