"""Conversations in -> token rows out (stage 01's logic).

A row is what the target sees and emits at inference, token for token:

    prompt tokens  = tokenize(template(conversation before turn i, add_generation_prompt=True))
    trained tokens = tokenize(what the model generates for turn i): reasoning, the reasoning close
                     tag, the content, the tool-call section, the end-of-turn token

The two are tokenized separately, as vLLM does (it tokenizes the prompt; the model's tokens
follow it), so a ChatML header's trailing newline never merges with an indented answer.

The prompt is rendered from the history as vLLM's chat path hands it to the template
(`template_messages`: JSON-string tool-call arguments parsed into objects, `name` kept, null content
as vLLM passes it, reasoning as `reasoning` + `reasoning_content`, `--chat-template-kwargs` applied).
The generation text is the template's own rendering of turn i where it continues that prompt. Which
parts of the turn the template renders, and where, is decided exactly, never by searching the data's
text: the turn is rendered a second time with every field (reasoning, content, each call's name, id
and arguments) replaced by a unique marker. A field whose marker is missing from the generated span is
dropped by the template: the row is refused naming file, row, turn and field, except the reasoning,
which templates that strip it (Kimi-K2.5 renders every turn up to the last one without tool calls as
`<think></think>` + content; DeepSeek-R1 renders no think block; DeepSeek-V3.1 renders `</think>` +
content) get put back where the model writes it: right after the generation prompt's `<think>`,
closed by the template's own `</think>` (or `REASONING\n</think>\n\n`, R1's layout, where it renders
none). Any exception a template raises on a row is one line naming the turn. NOTES.md "Stage 01"
states the rule.

Input shapes: OpenAI `messages` (content as text or a list of text parts, `tool_calls`, `tool`
messages with `tool_call_id` / `name`, reasoning as `reasoning_content`, `reasoning` or `thinking`,
or inline `<think>...</think>` in the content), a row-level `tools` list, ShareGPT `conversations`
(`from`/`value`, with hermes-fc / glaive `function_call` and `observation` turns). Rows that are
already tokens (`input_ids` + `loss_mask`, speculators' `regenerate-responses` output) pass
through after validation.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import InputError

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bot": "assistant", "model": "assistant", "tool": "tool", "ipython": "tool",
    "function": "tool", "observation": "tool", "function_call": "function_call",
}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Row:
    conversation: int  # index of the source conversation
    turn: int  # index of the assistant message trained on (-1: every assistant turn)
    input_ids: list[int]
    loss_mask: list[int]


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


def _reasoning_of(turn: dict, content: Any) -> tuple[str, str, Any]:
    """(field, reasoning, content): a reasoning field, or `<think>R</think>` written inline in string content."""
    for key in REASONING_FIELDS:
        value = turn.get(key)
        if isinstance(value, str) and value.strip():
            return key, value, content
    if isinstance(content, str) and THINK_CLOSE in content:
        head, _, tail = content.partition(THINK_CLOSE)
        return "reasoning_content", head.strip().removeprefix(THINK_OPEN).strip(), tail.lstrip("\n")
    return "", "", content


class _CallIds:
    """Ids for tool calls the data gives without one, in Kimi's `functions.NAME:INDEX` form
    (the index counts calls across the conversation, as Kimi-K2.5 numbers them)."""

    def __init__(self) -> None:
        self.count = 0
        self.last: list[str] = []  # ids of the latest assistant turn's calls, for results without an id

    def next(self, name: str) -> str:
        call_id = f"functions.{name}:{self.count}"
        self.count += 1
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
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else ids.next(name)
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    ids.last = [c["id"] for c in calls]
    return calls


def _function_call_turn(value: Any, where: str, t: int, ids: _CallIds) -> list[dict]:
    """ShareGPT `function_call` (hermes-fc / glaive): the value is the call as JSON text or an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InputError(f"{where}: turn {t} (function_call) value is not JSON") from None
    return _tool_calls_of(value if isinstance(value, list) else [value], where, t, ids)


def to_messages(record: Any, where: str) -> list[dict]:
    """OpenAI `messages` or ShareGPT `conversations` -> validated messages for a chat template:
    {role, content} plus `reasoning_content` and `tool_calls` on assistant turns and `tool_call_id`
    (+ `name`) on tool results."""
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
            field, reasoning, content = _reasoning_of(turn, content)
            message["content"] = content
            if reasoning:
                message[field] = reasoning
            if turn.get("tool_calls"):
                message["tool_calls"] = _tool_calls_of(turn["tool_calls"], where, t, ids)
            if not plain_text(content).strip() and not reasoning and not message.get("tool_calls"):
                raise InputError(f"{where}: turn {t} is an empty assistant turn")
        elif role == "tool":
            call_id = turn.get("tool_call_id")
            if not call_id and ids.last:  # ShareGPT observations answer the calls in order
                call_id = ids.last.pop(0)
            if call_id:
                message["tool_call_id"] = str(call_id)
        if isinstance(turn.get("name"), str):  # vLLM keeps `name` on every message (Kimi renders it)
            message["name"] = turn["name"]
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
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


# --- tokenizing ---------------------------------------------------------------------------

class ChatTokenizer:
    """Renders with the target's chat template and tokenizes the rendered text as vLLM does for a
    chat prompt (the template's text, no extra special tokens). `template_kwargs` go to every
    rendering (vLLM's `chat_template_kwargs`: enable_thinking, thinking, reasoning_effort, ...);
    `end_of_turn_tokens` replace generation_config.json's eos ids as the tokens a turn ends on."""

    def __init__(self, tokenizer_dir: str, trust_remote_code: bool = False, template_kwargs: dict | None = None,
                 end_of_turn_tokens: list[str] | tuple[str, ...] = ()):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise InputError(f"{tokenizer_dir}: cannot load tokenizer ({type(exc).__name__}: {first_line(exc)})") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(f"{tokenizer_dir}: tokenizer has no chat template (chat_template.jinja / tokenizer_config.json)")
        self.template_kwargs = dict(template_kwargs or {})
        self.content_format = content_format(self.tokenizer.chat_template)
        if end_of_turn_tokens:
            unknown = [t for t in end_of_turn_tokens if t not in self.tokenizer.get_vocab()]
            if unknown:
                raise InputError(f"{tokenizer_dir}: --end-of-turn-tokens {unknown} are not tokens of this tokenizer")
            self.stop_ids = {self.tokenizer.convert_tokens_to_ids(t) for t in end_of_turn_tokens}
        else:
            self.stop_ids = _stop_token_ids(self.tokenizer, Path(tokenizer_dir))
        self.stop_texts = [self.tokenizer.convert_ids_to_tokens(i) for i in sorted(self.stop_ids)]

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        return self.tokenize(self.render(template_messages(messages, self.content_format), add_generation_prompt, tools))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:200]


def content_format(chat_template: str) -> str:
    """'openai' when the template loops over a message's content (it takes a list of parts), else
    'string': the rule vLLM's chat path uses to decide how it passes content (simplified: any
    `for x in <name>.content` / `<name>['content']` / `content` loop)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateError:
        return "string"

    def is_content(node) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)):
            node = node.node
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and isinstance(node.node, nodes.Name)
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content" and isinstance(node.node, nodes.Name)
        return isinstance(node, nodes.Name) and node.name == "content"

    return "openai" if any(is_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"


def template_messages(messages: list[dict], fmt: str, trained: int | None = None) -> list[dict]:
    """The messages as vLLM's chat path hands them to the template (0.32, `parse_chat_messages`):
    null content becomes '' ('string' format) or [] ('openai'), text parts are joined with '\n'
    ('string') or kept as parts, reasoning goes in as `reasoning` and `reasoning_content`, `name`,
    `tool_call_id` and parsed tool-call arguments are kept. Message `trained` (the turn being
    rendered as the model writes it) also carries its reasoning as `thinking`, for templates that
    read that name (gpt-oss)."""
    out = []
    for k, message in enumerate(messages):
        m = {key: value for key, value in message.items() if key not in REASONING_FIELDS}
        content = message.get("content")
        if fmt == "string":
            m["content"] = "\n".join(p["text"] for p in content) if isinstance(content, list) else (content or "")
        else:
            m["content"] = content if isinstance(content, list) else [] if content is None else [{"type": "text", "text": content}]
            if message["role"] == "tool":  # vLLM joins a tool result's text parts in both formats
                m["content"] = "\n".join(p["text"] for p in m["content"])
        _, reasoning = reasoning_field(message) if message["role"] == "assistant" else ("", "")
        if reasoning:
            m["reasoning"] = m["reasoning_content"] = reasoning
            if k == trained:
                m["thinking"] = reasoning
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": dict(c["function"])} for c in m["tool_calls"]]
            if not m["tool_calls"]:
                del m["tool_calls"]
        out.append(m)
    return out


def _stop_token_ids(tokenizer, directory: Path) -> set[int]:
    """End-of-turn tokens: generation_config.json's eos ids (what vLLM stops on), else the tokenizer's eos."""
    ids: set[int] = set()
    config = directory / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# --- the trained span of one turn ---------------------------------------------------------------

MARK = "e3mark{}x"  # ASCII, no white space, no tag characters: no template strips, escapes or splits it


def _marked_turn(message: dict, taken: str) -> tuple[dict, dict[str, str]]:
    """Turn `message` with every non-empty text the model writes replaced by a unique marker, and
    {field: marker}. Rendering it shows exactly where (and whether) the template puts each field."""
    markers: dict[str, str] = {}

    def mark(field: str) -> str:
        n = len(markers)
        while MARK.format(n) in taken:
            n += 1000
        markers[field] = MARK.format(n)
        return markers[field]

    marked = {key: value for key, value in message.items() if key not in REASONING_FIELDS}
    if reasoning_field(message)[1]:
        marked["reasoning"] = mark("reasoning")
    if plain_text(message.get("content")).strip():
        marked["content"] = mark("content")
    calls = []
    for c, call in enumerate(message.get("tool_calls") or []):
        function = {"name": mark(f"tool_calls[{c}].function.name"), "arguments": call["function"]["arguments"]}
        if call["function"]["arguments"]:
            function["arguments"] = {mark(f"tool_calls[{c}].function.arguments"): "v"}
        calls.append({**call, "id": mark(f"tool_calls[{c}].id"), "function": function})
    if calls:
        marked["tool_calls"] = calls
    return marked, markers


def _split_prompt(chat: ChatTokenizer, history: list[dict], tools, prompt: str, rendered: str,
                  where: str, i: int) -> tuple[str, str]:
    """(what the prompt holds of the turn, the turn's rendering from that point): the rendering after
    the whole prompt; or, where the finished turn has no think-open tag (DeepSeek-R1/V3.1 write
    `<think>` only in the generation prompt) or the template re-renders history once the turn is added
    (Kimi-K2.5 drops the chain's reasoning), the rendering after the turn's role header (the generation
    prompt minus its think-open tag), taken at its last occurrence."""
    if rendered.startswith(prompt):
        return "", rendered[len(prompt):]
    head = chat.render(history, add_generation_prompt=False, tools=tools)
    if not prompt.startswith(head):
        raise InputError(f"{where}: turn {i}: the chat template's generation prompt is not appended to the "
                         f"conversation (cannot find where the model's turn starts)")
    gen_prompt = prompt[len(head):]  # e.g. '<|im_assistant|>assistant<|im_middle|><think>', '<|Assistant|><think>\n'
    cut = gen_prompt.rfind(THINK_OPEN)
    header = gen_prompt[:cut] if cut >= 0 and not gen_prompt[cut + len(THINK_OPEN):].strip() else gen_prompt
    start = rendered.rfind(header) if header else -1
    if start < 0:
        raise InputError(f"{where}: turn {i}: the chat template renders the assistant turn without its "
                         f"generation-prompt header {header!r}")
    return gen_prompt[len(header):], rendered[start + len(header):]


def _text_before_stop(chat: ChatTokenizer, text: str) -> str:
    ends = [k for k in (text.find(stop) for stop in chat.stop_texts) if k >= 0]
    return text[: min(ends)] if ends else text


def generation_text(chat: ChatTokenizer, messages: list[dict], i: int, tools: list[dict] | None,
                    where: str, prompt: str) -> str:
    """What the model generates for assistant turn i after `prompt`: the template's own rendering of
    the turn where it continues the prompt; where the template drops the turn's reasoning, the
    reasoning put back where the model writes it (after the prompt's `<think>`, before `</think>`).
    Every decision is exact: a marker per field shows where the template renders it."""
    fmt = chat.content_format
    history = template_messages(messages[:i], fmt)
    message = messages[i]
    real = template_messages(messages[: i + 1], fmt, trained=i)[i]
    rendered = chat.render(history + [real], add_generation_prompt=False, tools=tools)
    marked_message, markers = _marked_turn(message, rendered)
    marked = template_messages(messages[:i] + [marked_message], fmt, trained=i)[i]
    rendered_marked = chat.render(history + [marked], add_generation_prompt=False, tools=tools)
    in_prompt, body = _split_prompt(chat, history, tools, prompt, rendered, where, i)
    in_prompt_marked, body_marked = _split_prompt(chat, history, tools, prompt, rendered_marked, where, i)
    if in_prompt != in_prompt_marked:
        raise InputError(f"{where}: turn {i}: the template lays the turn out differently for different texts")
    spoken = _text_before_stop(chat, body_marked)  # what the model writes, as the template renders it

    def shown(field: str) -> bool:
        return field in markers and spoken.count(markers[field]) == 1

    for c, call in enumerate(message.get("tool_calls") or []):
        name, call_id = call["function"]["name"], call["id"]
        carried_by_id = shown(f"tool_calls[{c}].id") and call_id.startswith(f"functions.{name}:")
        if not shown(f"tool_calls[{c}].function.name") and not carried_by_id:
            hint = (" (the template renders the call's id, not its name: give ids as functions.NAME:INDEX, Kimi's "
                    "format)") if shown(f"tool_calls[{c}].id") else ""
            raise InputError(f"{where}: turn {i} field tool_calls[{c}].function.name: the chat template drops it from "
                             f"the trained tokens{hint}")
        if call["function"]["arguments"] and not shown(f"tool_calls[{c}].function.arguments"):
            raise InputError(f"{where}: turn {i} field tool_calls[{c}].function.arguments: the chat template drops it "
                             f"from the trained tokens")
    if "content" in markers and not shown("content"):
        raise InputError(f"{where}: turn {i} field content: the chat template drops it from the trained tokens")
    field, reasoning = reasoning_field(message)
    if shown("reasoning"):  # the template keeps it: its layout is the model's
        if not body.startswith(in_prompt):
            raise InputError(f"{where}: turn {i}: the template renders the turn with {body[:len(in_prompt)]!r} where "
                             f"its generation prompt ends with {in_prompt!r}")
        return body[len(in_prompt):]
    if "reasoning" in markers and markers["reasoning"] in rendered_marked:
        raise InputError(f"{where}: turn {i} field {field}: the template renders it outside the turn's "
                         f"generated text")
    # The template drops (or the data has no) reasoning: the model writes it right after the prompt's
    # open tag and closes the block itself.
    opens_thinking = prompt.rstrip().endswith(THINK_OPEN)
    if not opens_thinking:
        if reasoning:
            raise InputError(f"{where}: turn {i} field {field}: the chat template has no {THINK_OPEN} block to "
                             f"put it in (the model would never generate it; a thinking switch in "
                             f"--chat-template-kwargs may turn it on)")
        if not body.startswith(in_prompt):
            raise InputError(f"{where}: turn {i}: the template renders the turn with {body[:len(in_prompt)]!r} where "
                             f"its generation prompt ends with {in_prompt!r}")
        return body[len(in_prompt):]
    if not in_prompt:  # Kimi-K2.5: the prompt ends `<think>`, the turn renders `</think>` + content
        if not body.lstrip().startswith(THINK_CLOSE):
            raise InputError(f"{where}: turn {i}: the template's generation prompt opens {THINK_OPEN} but the turn "
                             f"renders no {THINK_CLOSE} after it")
        return reasoning + body
    if body.startswith(THINK_OPEN):  # an empty block `<think>GAP</think>` where the prompt has `<think>WS`
        gap, _, after = body[len(THINK_OPEN):].partition(THINK_CLOSE)
        if gap.strip() or THINK_CLOSE not in body:
            raise InputError(f"{where}: turn {i}: the template renders a think block the data does not hold")
        return reasoning + gap.removeprefix(in_prompt[len(THINK_OPEN):]) + THINK_CLOSE + after
    if body.startswith(THINK_CLOSE):  # DeepSeek-V3.1: the finished turn renders `</think>` + content
        return reasoning + body
    separator = "\n" if in_prompt.endswith("\n") else ""  # DeepSeek-R1 writes `<think>\nR\n</think>\n\nA`
    return reasoning + separator + THINK_CLOSE + separator * 2 + body


def cut_at_end_of_turn(chat: ChatTokenizer, ids: list[int], i: int, where: str) -> list[int]:
    """The model stops at its end-of-turn token; what a template renders after it is not generated."""
    end = next((k for k, t in enumerate(ids) if t in chat.stop_ids), None)
    if end is None:
        raise InputError(f"{where}: turn {i} renders no end-of-turn token {chat.stop_texts}: the template ends "
                         f"assistant turns some other way (GLM-4.5 starts the next message instead); pass the "
                         f"tokens its turns end on with --end-of-turn-tokens, or use another template")
    if chat.decode(ids[end + 1:]).strip():
        raise InputError(f"{where}: turn {i}: the template renders text after the end-of-turn token")
    return ids[: end + 1]


def turn_row(chat: ChatTokenizer, messages: list[dict], i: int, tools: list[dict] | None,
             where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of assistant turn i: the row is their concatenation. Any failure of
    the template (its own raise_exception, a TypeError, an undefined name) is one line naming the turn."""
    try:
        prompt = chat.render(template_messages(messages[:i], chat.content_format), add_generation_prompt=True,
                             tools=tools)
        generated = chat.tokenize(generation_text(chat, messages, i, tools, where, prompt))
        return chat.tokenize(prompt), cut_at_end_of_turn(chat, generated, i, where)
    except InputError:
        raise
    except Exception as exc:  # templates fail in many types; one bad row must not stop the run
        raise InputError(f"{where}: turn {i}: the chat template fails ({type(exc).__name__}: {first_line(exc)})") from None


def trained_turns(messages: list[dict]) -> list[int]:
    """Assistant turns the model generates: every one after at least one message (an assistant turn
    that opens the conversation answers nothing; it stays as context of the later turns)."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]


def rows_for_conversation(chat: ChatTokenizer, messages: list[dict], conversation: int,
                          rows_per: str, where: str, tools: list[dict] | None = None) -> list[Row]:
    assistant_turns = trained_turns(messages)
    if not assistant_turns:
        raise InputError(f"{where}: the conversation's only assistant turn opens it (nothing before it to answer)")
    turns = [(i, *turn_row(chat, messages, i, tools, where)) for i in assistant_turns]
    if rows_per == "turn":
        return [Row(conversation, i, prompt + gen, [0] * len(prompt) + [1] * len(gen)) for i, prompt, gen in turns]
    # One row: the last turn's, with every earlier turn's generated tokens trained where the
    # conversation holds them token for token (a template that re-renders history cannot).
    _, prompt, gen = turns[-1]
    ids, mask = prompt + gen, [0] * len(prompt) + [1] * len(gen)
    for i, earlier_prompt, earlier_gen in turns[:-1]:
        start, end = len(earlier_prompt), len(earlier_prompt) + len(earlier_gen)
        if ids[:end] != earlier_prompt + earlier_gen:
            raise InputError(
                f"{where}: turn {i} renders differently inside the whole conversation (the template rewrites "
                f"history, e.g. drops earlier reasoning); use --rows-per turn")
        mask[start:end] = [1] * (end - start)
    return [Row(conversation, -1, ids, mask)]


def rows_for_record(chat: ChatTokenizer, record: Any, conversation: int, rows_per: str,
                    vocab_size: int, where: str) -> list[Row]:
    """Training rows of one input row: tokens as given, or a conversation through the template."""
    if is_pretokenized(record):
        return [pretokenized_row(record, conversation, vocab_size, where)]
    return rows_for_conversation(chat, to_messages(record, where), conversation, rows_per, where,
                                 tools_of(record, where))


@dataclass
class BadRow:
    where: str
    reason: str
    record: Any  # None where the line could not be read

    def as_json(self) -> str:
        return json.dumps({"where": self.where, "reason": self.reason, "row": self.record}, ensure_ascii=False)


@dataclass
class PreparedRows:
    rows: list[Row]
    bad: list[BadRow]
    input_rows: int = 0  # rows read from the input (bad ones included)
    conversations: int = 0
    pretokenized: int = 0
    dropped_too_long: int = 0
    truncated_too_long: int = 0
    too_long: list[BadRow] | None = None  # the rows dropped as longer than max_seq_len (where, which turn)
    capped: bool = False  # max_samples stopped the reading before the input's end


def build_rows(chat: ChatTokenizer, records: Iterator[tuple[str, Any]], *, rows_per: str, vocab_size: int,
               max_samples: int | None, max_seq_len: int, on_too_long: str, keep_bad: bool,
               progress=lambda it: it) -> PreparedRows:
    """Every training row of the input. keep_bad=False raises the first bad row's InputError;
    True collects bad rows (file, row, reason) and goes on. Any exception on one row, whatever its
    type, becomes that row's one-line reason."""
    out = PreparedRows(rows=[], bad=[], too_long=[])
    conversation_of: dict[str, int] = {}  # conversation key -> index (the split is by conversation)
    for where, record in progress(records):
        key = conversation_key(record, where)
        if key not in conversation_of and max_samples is not None and len(conversation_of) >= max_samples:
            out.capped = True
            break
        out.input_rows += 1
        try:
            if isinstance(record, InputError):
                raise record
            try:
                rows = rows_for_record(chat, record, conversation_of.get(key, len(conversation_of)), rows_per,
                                       vocab_size, where)
            except InputError:
                raise
            except Exception as exc:  # a bug's or a library's exception still names the row, on one line
                raise InputError(f"{where}: {type(exc).__name__}: {first_line(exc)}") from None
        except InputError as exc:
            if not keep_bad:
                raise
            reason = str(exc).removeprefix(f"{where}: ")
            out.bad.append(BadRow(where, reason, None if isinstance(record, InputError) else record))
            continue
        conversation_of.setdefault(key, len(conversation_of))
        out.pretokenized += is_pretokenized(record)
        for row in rows:
            fitted = fit_length(row, max_seq_len, on_too_long)
            if fitted is None:
                out.dropped_too_long += 1
                turn = f" turn {row.turn}" if row.turn >= 0 else ""
                out.too_long.append(BadRow(where, f"{len(row.input_ids)} tokens{turn} > --max-seq-len {max_seq_len} "
                                           f"(dropped)", record))
            else:
                out.truncated_too_long += len(fitted.input_ids) < len(row.input_ids)
                out.rows.append(fitted)
    out.conversations = len(conversation_of)
    return out


def refuse_too_many_bad(prepared: PreparedRows, max_bad_fraction: float, source: str) -> None:
    """--on-bad-row skip tolerates up to max_bad_fraction of the input's rows (more means the data or
    the template is wrong, not a few rows)."""
    bad, total = len(prepared.bad), max(prepared.input_rows, 1)
    if bad / total > max_bad_fraction:
        first = prepared.bad[0]
        raise InputError(f"{source}: {bad} of {prepared.input_rows} rows are bad ({bad / total:.1%} > "
                         f"--max-bad-fraction {max_bad_fraction:.1%}); first: {first.where}: {first.reason} "
                         f"(--check lists them)")


def report_check(prepared: PreparedRows, cfg) -> int:
    """--check: list the first cfg.report_problems bad rows; refuse as the real run would."""
    log = logging.getLogger("eagle3")
    for bad in prepared.bad[: cfg.report_problems]:
        log.warning("bad row %s: %s", bad.where, bad.reason)
    for dropped in (prepared.too_long or [])[: cfg.report_problems]:
        log.warning("dropped row %s: %s", dropped.where, dropped.reason)
    capped = f" (--max-samples {cfg.max_samples} capped the input)" if prepared.capped else ""
    log.info("preflight rows: %d row(s) read%s, %d training row(s) from %d conversation(s), %d bad, "
             "%d longer than --max-seq-len", prepared.input_rows, capped, len(prepared.rows), prepared.conversations,
             len(prepared.bad), prepared.dropped_too_long + prepared.truncated_too_long)
    if prepared.bad and cfg.on_bad_row == "fail":
        first = prepared.bad[0]
        raise InputError(f"{first.where}: {first.reason} ({len(prepared.bad)} bad row(s) in all, listed above; "
                         f"fix them or pass --on-bad-row skip)")
    if prepared.bad:
        refuse_too_many_bad(prepared, cfg.max_bad_fraction, cfg.data)
    return 0


def fit_length(row: Row, max_seq_len: int, on_too_long: str) -> Row | None:
    """None = drop. Truncation keeps the row only if loss tokens survive."""
    if len(row.input_ids) <= max_seq_len:
        return row
    if on_too_long == "drop":
        return None
    row = Row(row.conversation, row.turn, row.input_ids[:max_seq_len], row.loss_mask[:max_seq_len])
    return row if any(row.loss_mask) else None
