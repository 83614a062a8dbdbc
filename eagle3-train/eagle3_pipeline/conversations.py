"""Conversations in -> token rows out (stage 01's logic).

Input shapes: OpenAI `messages` ([{role, content, reasoning_content?}]) and ShareGPT
`conversations` ([{from, value}]). Rows are tokenized with the *target's* chat template.
Rows that are already tokens (`input_ids` + `loss_mask`, the shape speculators'
`regenerate-responses` writes: one row per regenerated assistant turn, grouped by
`primary_id`) pass through after validation.

The loss mask is computed without trusting `{% generation %}` tags (most templates, Kimi's
included, have none): for assistant turn i, render the conversation up to turn i with the
generation prompt (P) and up to and including turn i (F); the tokens F has beyond P are
the assistant's and get loss 1. P must be a token prefix of F, which is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import InputError

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bot": "assistant", "model": "assistant", "tool": "tool",
}


@dataclass
class Row:
    conversation: int  # index of the source conversation
    turn: int  # index of the assistant message trained on (-1: every assistant turn)
    input_ids: list[int]
    loss_mask: list[int]


# --- reading ------------------------------------------------------------------------------

def read_records(source: str, split: str = "train", subset: str | None = None,
                 trust_remote_code: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) with `where` = 'FILE:LINE' or 'FILE row N' for error messages."""
    path = Path(source)
    if path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise InputError(f"{path}: input file not found (--data)")
        if path.suffix == ".parquet":
            yield from _read_parquet(path)
        elif path.suffix == ".json" and _looks_like_json_array(path):
            yield from _read_json_array(path)
        else:
            yield from _read_jsonl(path)
        return
    if "/" not in source:
        raise InputError(f"{source}: not a file and not a HF datasets name (owner/name) (--data)")
    import datasets

    try:
        dataset = datasets.load_dataset(source, subset, split=split, trust_remote_code=trust_remote_code)
    except Exception as exc:  # hub/network errors come in many types
        raise InputError(f"{source}: cannot load HF dataset ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    for i, record in enumerate(dataset):
        yield f"{source}[{split}] row {i}", record


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not valid UTF-8 (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line.rstrip("\r\n"))  # so the column points into this line
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None


def _looks_like_json_array(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(64).lstrip()
    return head.startswith(b"[")


def _read_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: unreadable JSON ({exc})") from None
    for i, record in enumerate(records):
        yield f"{path} row {i}", record


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise InputError(f"{path}: unreadable parquet ({exc})") from None
    for i, record in enumerate(table.to_pylist()):
        yield f"{path} row {i}", record


# --- normalising --------------------------------------------------------------------------

def to_messages(record: Any, where: str) -> list[dict]:
    """OpenAI `messages` or ShareGPT `conversations` -> validated [{role, content, reasoning_content?}]."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: row is not a JSON object")
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise InputError(f"{where}: row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: conversation is empty")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InputError(f"{where}: turn {t} is not an object")
        raw_role = turn.get(role_key, turn.get("role"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise InputError(f"{where}: turn {t} has unknown role {raw_role!r}")
        content = turn.get(content_key, turn.get("content"))
        if not isinstance(content, str):
            raise InputError(f"{where}: turn {t} ({role}) content is not text")
        message = {"role": role, "content": content}
        reasoning = turn.get("reasoning_content") or turn.get("reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        if role == "assistant" and not content.strip() and not reasoning:
            raise InputError(f"{where}: turn {t} is an empty assistant turn")
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{where}: conversation has no assistant turn")
    return messages


# --- rows that are already tokens ---------------------------------------------------------

def is_pretokenized(record: Any) -> bool:
    return isinstance(record, dict) and "input_ids" in record and "loss_mask" in record


def conversation_key(record: Any, where: str) -> str:
    """Rows with one key belong to one conversation (kept on one side of the train/val split):
    speculators' regenerated rows share their conversation's `primary_id`; any other row is
    its own conversation."""
    if is_pretokenized(record) and record.get("primary_id") is not None:
        return f"primary_id:{record['primary_id']}"
    return f"row:{where}"


def pretokenized_row(record: dict, conversation: int, vocab_size: int, where: str) -> Row:
    """Validate an `input_ids` + `loss_mask` row against the target's vocabulary."""
    ids, mask = record["input_ids"], record["loss_mask"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError(f"{where}: input_ids is not a non-empty list of integers")
    if not isinstance(mask, list) or len(mask) != len(ids):
        raise InputError(f"{where}: loss_mask has {len(mask) if isinstance(mask, list) else 'no'} entries, "
                         f"input_ids {len(ids)}")
    if any(m not in (0, 1) for m in mask):
        raise InputError(f"{where}: loss_mask holds values other than 0/1")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InputError(f"{where}: token id {bad} is outside the target's vocabulary (0..{vocab_size - 1}): "
                         f"tokenized for another model?")
    if not any(mask):
        raise InputError(f"{where}: loss_mask has no 1 (no assistant tokens to train on)")
    return Row(conversation, -1, list(ids), [int(m) for m in mask])


def check_record(record: Any, vocab_size: int, where: str) -> None:
    """Everything about a row that can be checked without tokenizing (stage 01 --check)."""
    if is_pretokenized(record):
        pretokenized_row(record, 0, vocab_size, where)
    else:
        to_messages(record, where)


# --- tokenizing ---------------------------------------------------------------------------

class ChatTokenizer:
    """Renders with the target's chat template and tokenizes the rendered text."""

    def __init__(self, tokenizer_dir: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise InputError(f"{tokenizer_dir}: cannot load tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(f"{tokenizer_dir}: tokenizer has no chat template (chat_template.jinja / tokenizer_config.json)")

    def encode(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_span(chat: ChatTokenizer, messages: list[dict], i: int, where: str) -> tuple[list[int], int, int]:
    """Tokens of messages[:i+1] and the [start, end) span of assistant turn i inside them."""
    prefix = chat.encode(messages[:i], add_generation_prompt=True)
    full = chat.encode(messages[: i + 1], add_generation_prompt=False)
    if full[: len(prefix)] != prefix:
        raise InputError(f"{where}: chat template is not prefix-stable at turn {i} (the prompt rendering is not a prefix of the turn's)")
    if len(full) == len(prefix):
        raise InputError(f"{where}: turn {i} renders to no assistant tokens")
    return full, len(prefix), len(full)


def rows_for_conversation(chat: ChatTokenizer, messages: list[dict], conversation: int,
                          rows_per: str, where: str) -> list[Row]:
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if rows_per == "turn":
        rows = []
        for i in assistant_turns:
            ids, start, end = assistant_span(chat, messages, i, where)
            rows.append(Row(conversation, i, ids, [0] * start + [1] * (end - start)))
        return rows
    full = chat.encode(messages, add_generation_prompt=False)
    mask = [0] * len(full)
    for i in assistant_turns:
        ids, start, end = assistant_span(chat, messages, i, where)
        if full[:end] != ids:
            raise InputError(
                f"{where}: turn {i} renders differently inside the whole conversation (the template rewrites "
                f"history, e.g. drops earlier reasoning); use --rows-per turn"
            )
        mask[start:end] = [1] * (end - start)
    return [Row(conversation, -1, full, mask)]


def rows_for_record(chat: ChatTokenizer, record: Any, conversation: int, rows_per: str,
                    vocab_size: int, where: str) -> list[Row]:
    """Training rows of one input row: tokens as given, or a conversation through the template."""
    if is_pretokenized(record):
        return [pretokenized_row(record, conversation, vocab_size, where)]
    return rows_for_conversation(chat, to_messages(record, where), conversation, rows_per, where)


def fit_length(row: Row, max_seq_len: int, on_too_long: str) -> Row | None:
    """None = drop. Truncation keeps the row only if loss tokens survive."""
    if len(row.input_ids) <= max_seq_len:
        return row
    if on_too_long == "drop":
        return None
    row = Row(row.conversation, row.turn, row.input_ids[:max_seq_len], row.loss_mask[:max_seq_len])
    return row if any(row.loss_mask) else None
