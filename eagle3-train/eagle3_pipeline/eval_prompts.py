"""Stage 06's prompts: a jsonl of OpenAI `messages` rows rendered exactly as stage 01 rendered its rows.

A row is `{"messages": [...], "category": "code", "tools": [...]}` (`category` and `tools` optional). The
prompt is the conversation up to its last user or tool message: a final assistant message (a reference
answer) is dropped, earlier ones stay (multi-turn context). Rendering goes through stage 01's
`ChatTokenizer` with stage 01's chat-template kwargs, so thinking on/off, content parts and tools render as
the draft saw them in training (random or raw-text prompts overstate tau: outputs loop). A bad row is one
line naming the file and the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .chat_rows import ChatTokenizer
from .errors import InputError

UNCATEGORISED = "uncategorised"


@dataclass(frozen=True)
class EvalPrompt:
    row: int  # 1-based line number in the file
    category: str
    token_ids: list[int]


def read_prompt_rows(path: Path, max_prompts: int | None = None) -> list[tuple[int, dict]]:
    """(line number, row) for each non-empty line; a line that is not a JSON object with `messages` is refused."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: prompts file not found (--prompts)")
    rows: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}: row {number}: not JSON ({exc.msg} at column {exc.colno})") from None
            problem = row_problem(row)
            if problem:
                raise InputError(f"{path}: row {number}: {problem}")
            rows.append((number, row))
            if max_prompts is not None and len(rows) >= max_prompts:
                break
    if not rows:
        raise InputError(f"{path}: no prompts (one JSON object with `messages` per line)")
    return rows


def row_problem(row) -> str | None:
    """Why a prompt row cannot be used, or None."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a JSON object with `messages`"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no `messages` list (OpenAI chat format: [{\"role\": \"user\", \"content\": ...}, ...])"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"messages[{i}] has no `role`"
    if "category" in row and not (isinstance(row["category"], str) and row["category"]):
        return "`category` must be a non-empty string"
    if "tools" in row and not isinstance(row["tools"], list):
        return "`tools` must be a list of tool declarations"
    if prompt_messages(messages)[-1]["role"] not in ("user", "tool"):
        return "the prompt (messages before a final assistant answer) must end with a user or tool message"
    return None


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation the model answers: without a final assistant message (a reference answer)."""
    return messages[:-1] if len(messages) > 1 and messages[-1]["role"] == "assistant" else messages


def render_prompts(path: Path, chat: ChatTokenizer, max_model_len: int, max_tokens: int,
                   max_prompts: int | None = None) -> list[EvalPrompt]:
    """Every row as token ids with the generation prompt appended, as vLLM's chat endpoint would send them."""
    prompts = []
    for number, row in read_prompt_rows(path, max_prompts):
        try:
            ids = chat.encode(prompt_messages(row["messages"]), add_generation_prompt=True, tools=row.get("tools"))
        except Exception as exc:  # the template's own error (a role it refuses, a missing field), one line
            raise InputError(f"{path}: row {number}: the chat template cannot render it "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})") from None
        if len(ids) + max_tokens > max_model_len:
            raise InputError(f"{path}: row {number}: {len(ids)} prompt tokens + --max-tokens {max_tokens} exceed "
                             f"--max-model-len {max_model_len}; shorten it or raise --max-model-len")
        prompts.append(EvalPrompt(row=number, category=row.get("category") or UNCATEGORISED, token_ids=ids))
    return prompts
