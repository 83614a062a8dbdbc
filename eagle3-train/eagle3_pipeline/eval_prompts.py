"""Stage 06's prompts: a jsonl of OpenAI `messages` rows read and rendered exactly as stage 01 read and rendered its rows.

A row is `{"messages": [...], "category": "code", "tools": [...]}` (`category` and `tools` optional). Rows are read
and normalised by stage 01's own reader and rules (conversations.py: bytes that are not UTF-8, malformed JSON, an
unknown role such as a typo'd `"sytem"`, content that is not text: each refused the same way, naming the file and
line), except that a prompt needs no assistant turn. The prompt is the conversation up to its last user or tool
message: a final assistant message (a reference answer) is dropped, earlier ones stay (multi-turn context).
Rendering goes through stage 01's `ChatTokenizer` with stage 01's chat-template kwargs, so thinking on/off, content
parts and tools render as the draft saw them in training (random or raw-text prompts overstate tau: outputs loop).
A bad row is one line naming the file and the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .chat_rows import ChatTokenizer
from .conversations import first_line, read_records, to_messages, tools_of
from .errors import InputError

UNCATEGORISED = "uncategorised"


@dataclass(frozen=True)
class PromptRow:
    where: str  # "FILE:LINE", as stage 01 names a row
    category: str
    messages: list[dict]  # normalised by stage 01's rules (conversations.to_messages)
    tools: list[dict] | None


@dataclass(frozen=True)
class EvalPrompt:
    where: str
    category: str
    token_ids: list[int]


def read_prompt_rows(path: Path, max_prompts: int | None = None) -> list[PromptRow]:
    """Each row of the file, read and checked by stage 01's rules (its reader, `to_messages`, `tools_of`)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: prompts file not found (--prompts)")
    rows: list[PromptRow] = []
    for where, record in read_records(str(path)):
        rows.append(prompt_row(where, record))
        if max_prompts is not None and len(rows) >= max_prompts:
            break
    if not rows:
        raise InputError(f"{path}: no prompts (one JSON object with `messages` per line)")
    return rows


def prompt_row(where: str, record) -> PromptRow:
    if isinstance(record, InputError):  # a line stage 01's reader could not read (not UTF-8, not JSON)
        raise record
    messages = to_messages(record, where, need_answer=False)
    tools = tools_of(record, where)
    category = record.get("category", UNCATEGORISED)
    if not (isinstance(category, str) and category):
        raise InputError(f"{where}: `category` must be a non-empty string")
    if prompt_messages(messages)[-1]["role"] not in ("user", "tool"):
        raise InputError(f"{where}: the prompt (messages before a final assistant answer) must end with a user or "
                         f"tool message")
    return PromptRow(where, category, messages, tools)


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation the model answers: without a final assistant message (a reference answer)."""
    return messages[:-1] if len(messages) > 1 and messages[-1]["role"] == "assistant" else messages


def render_prompts(path: Path, chat: ChatTokenizer, max_model_len: int, max_tokens: int,
                   max_prompts: int | None = None, model_limit: int | None = None) -> list[EvalPrompt]:
    """Every row as token ids with the generation prompt appended, as vLLM's chat endpoint would send them.
    `model_limit`: the longest max-model-len the target allows (target.max_model_len_limit), for the advice."""
    prompts = []
    for row in read_prompt_rows(path, max_prompts):
        try:
            ids = chat.encode(prompt_messages(chat.with_call_ids(row.messages, row.where)), add_generation_prompt=True,
                              tools=row.tools)
        except InputError:
            raise
        except Exception as exc:  # the template's own error (a role it refuses, a missing field), one line
            raise InputError(f"{row.where}: the chat template cannot render it "
                             f"({type(exc).__name__}: {first_line(exc)[:160]})") from None
        needed = len(ids) + max_tokens
        if needed > max_model_len:
            # never advise a --max-model-len the target refuses (vLLM would stop with its own traceback)
            advice = (f"shorten it or lower --max-tokens (the target allows at most {model_limit} tokens)"
                      if model_limit is not None and needed > model_limit else
                      f"shorten it or raise --max-model-len to at least {needed}")
            raise InputError(f"{row.where}: {len(ids)} prompt tokens + --max-tokens {max_tokens} exceed "
                             f"--max-model-len {max_model_len}; {advice}")
        prompts.append(EvalPrompt(where=row.where, category=row.category, token_ids=ids))
    return prompts
