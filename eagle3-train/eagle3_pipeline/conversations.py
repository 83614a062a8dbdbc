"""Conversations in, normalised messages out: the readers and normalisers of stage 01's input.

Input shapes: OpenAI `messages` (content as text or a list of text parts, `tool_calls`, `tool`
messages with `tool_call_id` / `name`, reasoning as `reasoning_content`, `reasoning` or `thinking`,
or inline `<think>...</think>` in the content), a row-level `tools` list, ShareGPT `conversations`
(`from`/`value`, with hermes-fc / glaive `function_call` and `observation` turns). Records that are
already tokens (`input_ids` + `loss_mask`, speculators' `regenerate-responses` output) are
recognised here and validated as rows by chat_rows.py.

`to_messages` turns one record into the message list that chat_rows.py renders with the target's
chat template and tokenizes into rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from .errors import InputError

# Local imports: datasets, pyarrow: imported by the readers of those formats only (heavy; JSONL input needs neither).

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bot": "assistant", "model": "assistant", "tool": "tool", "ipython": "tool",
    "function": "tool", "observation": "tool", "function_call": "function_call",
}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


# --- reading ------------------------------------------------------------------------------

def read_records(source: str, split: str = "train", subset: str | None = None,
                 trust_remote_code: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (where, record) with `where` = 'FILE:LINE' or 'FILE row N' for error messages. A line
    that cannot be read at all comes as an InputError in place of its record (the reader goes on)."""
    path = Path(source)
    if path.is_dir():
        yield from _read_saved_dataset(path, split)
        return
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


def _read_saved_dataset(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    """A `datasets.save_to_disk` folder (a Dataset, or a DatasetDict: --data-split picks the split)."""
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise InputError(f"{path}: a folder, but not a datasets.save_to_disk dataset ({type(exc).__name__}: "
                         f"{first_line(exc)}) (--data)") from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise InputError(f"{path}: saved dataset has no split {split!r} (it has {sorted(dataset)}) (--data-split)")
        dataset, where = dataset[split], f"{path}[{split}]"
    else:
        where = str(path)
    for i, record in enumerate(dataset.with_format(None)):
        yield f"{where} row {i}", record


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM (Windows editors write one)
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, InputError(f"{where}: not valid UTF-8 (byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # so the column points into this line
            except json.JSONDecodeError as exc:
                record = InputError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})")
            yield where, record


def _looks_like_json_array(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"[")


def _read_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        records = json.loads(path.read_bytes().decode("utf-8-sig"))
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

def _text_of(content: Any, where: str, t: int, role: str) -> str | list[dict] | None:
    """Content as the data gives it: a string, null, or a list of OpenAI text parts (kept as a list:
    how parts are joined is the chat path's business, see `template_messages`)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        for p, part in enumerate(content):
            if not isinstance(part, dict):
                raise InputError(f"{where}: turn {t} ({role}) content part {p} is not a {{type, text}} object")
            kind = part.get("type", "text")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InputError(f"{where}: turn {t} ({role}) content part {p} has type {kind!r}: only text parts "
                                 f"are supported (the draft trains on text; drop or caption the other parts)")
        return [{"type": "text", "text": part["text"]} for part in content]
    raise InputError(f"{where}: turn {t} ({role}) content is not text")


def reasoning_field(message: dict) -> tuple[str, str]:
    """(field, text) of an assistant message's reasoning: whichever of the names the data used."""
    for key in REASONING_FIELDS:
        if isinstance(message.get(key), str) and message[key]:
            return key, message[key]
    return "reasoning_content", ""


def plain_text(content: str | list[dict] | None) -> str:
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def _inline_reasoning(content: Any, where: str, t: int) -> tuple[str | None, Any]:
    """(reasoning, the content after it) where the content carries `<think>R</think>` inline (a string, or text
    parts: the block may span parts); (None, content) where it carries none. An open `<think>` never closed is
    refused: the row would train a half block the model never writes."""
    texts = [content] if isinstance(content, str) else [p["text"] for p in content] if isinstance(content, list) else []
    close = next((j for j, text in enumerate(texts) if THINK_CLOSE in text), None)
    if close is None:
        if texts and "".join(texts).lstrip().startswith(THINK_OPEN):
            raise InputError(f"{where}: turn {t} (assistant) content opens {THINK_OPEN} and never closes it "
                             f"(reasoning cut short?)")
        return None, content
    head, _, tail = texts[close].partition(THINK_CLOSE)
    reasoning = ("".join(texts[:close]) + head).strip().removeprefix(THINK_OPEN).strip()
    tail = tail.lstrip("\n")
    if isinstance(content, str):
        return reasoning, tail
    return reasoning, ([{"type": "text", "text": tail}] if tail else []) + content[close + 1:]


def _reasoning_of(turn: dict, content: Any, where: str, t: int) -> tuple[str, str, Any]:
    """(field, reasoning, content): a reasoning field, or `<think>R</think>` written inline in the content.
    Both at once must agree (the inline copy is then dropped from the content): the model writes it once."""
    inline, rest = _inline_reasoning(content, where, t)
    for key in REASONING_FIELDS:
        value = turn.get(key)
        if value is not None and not isinstance(value, str):
            raise InputError(f"{where}: turn {t} (assistant) {key} is a {type(value).__name__}, not text")
        if value and value.strip():
            if inline is not None and inline.strip() != value.strip():
                raise InputError(f"{where}: turn {t} (assistant) gives its reasoning twice, in {key} and as an inline "
                                 f"{THINK_OPEN} block in its content, and they differ")
            return key, value, rest
    if inline is not None:
        return "reasoning_content", inline, rest
    return "", "", content


class _CallIds:
    """Call ids of one conversation. A call the data gives without an id gets Kimi's `functions.NAME:INDEX`
    (INDEX counts every call of the conversation, given ids included, as Kimi-K2.5 numbers them); a tool
    result without `tool_call_id` answers the latest assistant turn's first call not answered yet."""

    def __init__(self) -> None:
        self.calls = 0
        self.used: set[str] = set()
        self.pending: list[str] = []  # the latest assistant turn's calls no result has answered

    def take(self, given: Any, name: str) -> str:
        if isinstance(given, str) and given:
            call_id = given
        else:
            index = self.calls
            while f"functions.{name}:{index}" in self.used:
                index += 1
            call_id = f"functions.{name}:{index}"
        self.calls += 1
        self.used.add(call_id)
        return call_id

    def answer(self, given: Any) -> str | None:
        call_id = str(given) if given else (self.pending[0] if self.pending else None)
        if call_id in self.pending:
            self.pending.remove(call_id)
        return call_id


def _arguments_of(arguments: Any, where: str, t: int, c: int) -> dict:
    """Tool-call arguments as vLLM's chat path hands them to the template (0.32,
    `_postprocess_messages`): a JSON string is parsed; empty means {}. vLLM renders arguments that are
    not a JSON object as {}: the row would train arguments the data does not hold, so it is refused."""
    if not arguments:
        return {}
    if isinstance(arguments, dict):
        return arguments
    field = f"{where}: turn {t} tool_calls[{c}].function.arguments"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise InputError(f"{field} is not JSON ({arguments[:40]!r}); vLLM renders such arguments as {{}}, "
                             f"so the row cannot be trained as given") from None
    if not isinstance(arguments, dict):
        raise InputError(f"{field} is a JSON {type(arguments).__name__}, not an object; vLLM renders it as {{}}, "
                         f"so the row cannot be trained as given")
    return arguments


def _tool_calls_of(raw: Any, where: str, t: int, ids: _CallIds) -> list[dict]:
    if not isinstance(raw, list):
        raise InputError(f"{where}: turn {t} tool_calls is not a list")
    calls = []
    for c, call in enumerate(raw):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}: turn {t} tool_calls[{c}] has no function name")
        arguments = _arguments_of(function.get("arguments"), where, t, c)
        calls.append({"id": ids.take(call.get("id"), name), "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    ids.pending = [c["id"] for c in calls]
    return calls


def _function_call_turn(value: Any, where: str, t: int, ids: _CallIds) -> list[dict]:
    """ShareGPT `function_call` (hermes-fc / glaive): the value is the call as JSON text or an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InputError(f"{where}: turn {t} (function_call) value is not JSON") from None
    return _tool_calls_of(value if isinstance(value, list) else [value], where, t, ids)


def to_messages(record: Any, where: str, need_answer: bool = True) -> list[dict]:
    """OpenAI `messages` or ShareGPT `conversations` -> validated messages for a chat template:
    {role, content} plus `reasoning_content` and `tool_calls` on assistant turns and `tool_call_id`
    (+ `name`) on tool results. `need_answer`: a training row needs an assistant turn; stage 06's
    prompts (the same rules otherwise) may end before any."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: row is not a JSON object")
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise InputError(f"{where}: row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
    if not isinstance(turns, list):
        raise InputError(f"{where}: {'messages' if role_key == 'role' else 'conversations'} is not a list of turns")
    if not turns:
        raise InputError(f"{where}: conversation is empty")
    messages: list[dict] = []
    ids = _CallIds()
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InputError(f"{where}: turn {t} is not an object")
        raw_role = turn.get(role_key, turn.get("role"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise InputError(f"{where}: turn {t} has unknown role {raw_role!r}")
        raw_content = turn.get(content_key, turn.get("content"))
        if role == "function_call":
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": _function_call_turn(raw_content, where, t, ids)})
            continue
        content = _text_of(raw_content, where, t, role)
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            field, reasoning, content = _reasoning_of(turn, content, where, t)
            message["content"] = content
            if reasoning:
                message[field] = reasoning
            if turn.get("tool_calls"):
                message["tool_calls"] = _tool_calls_of(turn["tool_calls"], where, t, ids)
            if not plain_text(content).strip() and not reasoning and not message.get("tool_calls"):
                raise InputError(f"{where}: turn {t} is an empty assistant turn")
        elif role == "tool":
            call_id = ids.answer(turn.get("tool_call_id"))  # ShareGPT observations answer the calls in order
            if call_id:
                message["tool_call_id"] = str(call_id)
        if isinstance(turn.get("name"), str):  # vLLM keeps `name` on every message (Kimi renders it)
            message["name"] = turn["name"]
        messages.append(message)
    if need_answer and not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{where}: conversation has no assistant turn")
    return messages


def tools_of(record: Any, where: str) -> list[dict] | None:
    """The row's tool declarations (OpenAI `tools`; JSON text as some datasets store it)."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise InputError(f"{where}: tools is not valid JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError(f"{where}: tools is not a list of objects")
    return tools


# --- records that are already tokens ------------------------------------------------------

def is_pretokenized(record: Any) -> bool:
    return isinstance(record, dict) and "input_ids" in record and "loss_mask" in record


def conversation_key(record: Any, where: str) -> str:
    """Rows with one key belong to one conversation (kept on one side of the train/val split):
    speculators' regenerated rows share their conversation's `primary_id`; any other row is
    its own conversation."""
    if is_pretokenized(record) and record.get("primary_id") is not None:
        return f"primary_id:{record['primary_id']}"
    return f"row:{where}"


# --- error text ---------------------------------------------------------------------------

def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:200]
