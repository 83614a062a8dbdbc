"""Conversations in -> token rows out (stage 01's logic).

A row is what the target sees and emits at inference, token for token:

    prompt tokens  = tokenize(template(conversation before turn i, add_generation_prompt=True))
    trained tokens = tokenize(what the model generates for turn i): reasoning, the reasoning close
                     tag, the content, the tool-call section, the end-of-turn token

The two are tokenized separately, as vLLM does (it tokenizes the prompt; the model's tokens
follow it), so a ChatML header's trailing newline never merges with an indented answer.

The generation text is taken from the template's own rendering of turn i (the conversation up to
and including it): the turn's body after the role header, minus what the generation prompt already
holds. Templates that drop the turn's reasoning (Kimi-K2.5 renders every turn up to the last one
without tool calls as history, `<think></think>` + content; DeepSeek-R1 strips it) get it put back
where the model writes it: between the generation prompt's open tag and the close tag the template
left, or, when the template leaves no think block at all, as `REASONING\\n</think>\\n\\n` before the
body (DeepSeek-R1's layout). Every row is then checked: each non-empty assistant text of the turn
(reasoning, content, every tool call's name and arguments) must appear in the decoded trained tokens,
or the row is refused naming file, row, turn and field. NOTES.md "Stage 01" states the rule.

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

def _text_of(content: Any, where: str, t: int, role: str) -> str:
    """Content as text: a string, null, or a list of OpenAI text parts (joined as the templates do)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for p, part in enumerate(content):
            if not isinstance(part, dict):
                raise InputError(f"{where}: turn {t} ({role}) content part {p} is not a {{type, text}} object")
            kind = part.get("type", "text")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InputError(f"{where}: turn {t} ({role}) content part {p} has type {kind!r}: only text parts "
                                 f"are supported (the draft trains on text; drop or caption the other parts)")
            texts.append(part["text"])
        return "".join(texts)
    raise InputError(f"{where}: turn {t} ({role}) content is not text")


def _reasoning_of(turn: dict, content: str) -> tuple[str, str]:
    """(reasoning, content): a reasoning field, or `<think>R</think>` written inline in the content."""
    for key in REASONING_FIELDS:
        value = turn.get(key)
        if isinstance(value, str) and value.strip():
            return value, content
    if THINK_CLOSE in content:
        head, _, tail = content.partition(THINK_CLOSE)
        return head.strip().removeprefix(THINK_OPEN).strip(), tail.lstrip("\n")
    return "", content


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


def _tool_calls_of(raw: Any, where: str, t: int, ids: _CallIds) -> list[dict]:
    if not isinstance(raw, list):
        raise InputError(f"{where}: turn {t} tool_calls is not a list")
    calls = []
    for c, call in enumerate(raw):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}: turn {t} tool_calls[{c}] has no function name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str) and arguments.strip()[:1] in ("{", "["):
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                raise InputError(f"{where}: turn {t} tool_calls[{c}].function.arguments is not valid JSON") from None
        elif not isinstance(arguments, (str, dict, list)):
            raise InputError(f"{where}: turn {t} tool_calls[{c}].function.arguments is neither a string nor an object")
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
            reasoning, content = _reasoning_of(turn, content)
            message["content"] = content
            if reasoning:
                message["reasoning_content"] = reasoning
            if turn.get("tool_calls"):
                message["tool_calls"] = _tool_calls_of(turn["tool_calls"], where, t, ids)
            if not content.strip() and not reasoning and not message.get("tool_calls"):
                raise InputError(f"{where}: turn {t} is an empty assistant turn")
        elif role == "tool":
            call_id = turn.get("tool_call_id")
            if not call_id and ids.last:  # ShareGPT observations answer the calls in order
                call_id = ids.last.pop(0)
            if call_id:
                message["tool_call_id"] = str(call_id)
            if isinstance(turn.get("name"), str):
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
    chat prompt (the template's text, no extra special tokens)."""

    def __init__(self, tokenizer_dir: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise InputError(f"{tokenizer_dir}: cannot load tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(f"{tokenizer_dir}: tokenizer has no chat template (chat_template.jinja / tokenizer_config.json)")
        self.stop_ids = _stop_token_ids(self.tokenizer, Path(tokenizer_dir))

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        return self.tokenize(self.render(messages, add_generation_prompt, tools))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


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


def generation_text(chat: ChatTokenizer, messages: list[dict], i: int, tools: list[dict] | None,
                    where: str, prompt: str) -> str:
    """What the model generates for assistant turn i after `prompt` (the template's rendering of
    messages[:i] with the generation prompt), reasoning included."""
    head = chat.render(messages[:i], add_generation_prompt=False, tools=tools)
    if not prompt.startswith(head):
        raise InputError(f"{where}: turn {i}: the chat template's generation prompt is not appended to the "
                         f"conversation (cannot find where the model's turn starts)")
    gen_prompt = prompt[len(head):]  # e.g. '<|im_assistant|>assistant<|im_middle|><think>', '<|im_start|>assistant\n'
    opens_thinking = gen_prompt.rstrip().endswith(THINK_OPEN)
    role_header = gen_prompt[: gen_prompt.rstrip().rfind(THINK_OPEN)] if opens_thinking else gen_prompt
    rendered = chat.render(messages[: i + 1], add_generation_prompt=False, tools=tools)
    start = rendered.rfind(role_header) if role_header else -1
    if start < 0:
        raise InputError(f"{where}: turn {i}: the chat template renders the assistant turn without its "
                         f"generation-prompt header {role_header!r}")
    body = rendered[start + len(role_header):]
    tail = gen_prompt[len(role_header):]  # what the prompt already holds of the body: the open tag
    reasoning = messages[i].get("reasoning_content", "")
    if reasoning and _squash(reasoning) in _squash(body):  # the template keeps it: its layout is the model's
        if not body.startswith(tail):
            raise InputError(f"{where}: turn {i}: the template renders the turn with {body[:len(tail)]!r} where "
                             f"its generation prompt ends with {tail!r}")
        return body[len(tail):]
    if not opens_thinking:
        if reasoning:  # a template without thinking: the model never writes reasoning
            raise InputError(f"{where}: turn {i} field reasoning_content: the chat template has no "
                             f"{THINK_OPEN} block to put it in (the model would never generate it)")
        if not body.startswith(tail):
            raise InputError(f"{where}: turn {i}: the template renders the turn with {body[:len(tail)]!r} where "
                             f"its generation prompt ends with {tail!r}")
        return body[len(tail):]
    # A thinking template that dropped (or never had) this turn's reasoning.
    stripped = body.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:  # an empty block: `<think></think>`
        gap, _, after = stripped[len(THINK_OPEN):].partition(THINK_CLOSE)
        if gap.strip():
            raise InputError(f"{where}: turn {i}: the template renders reasoning the data does not hold")
        in_prompt = tail[tail.rfind(THINK_OPEN) + len(THINK_OPEN):]  # white space the prompt already ends with
        return reasoning + gap.removeprefix(in_prompt) + THINK_CLOSE + after
    separator = "\n" if tail.endswith("\n") else ""  # DeepSeek-R1 writes `<think>\nR\n</think>\n\nA`
    return reasoning + separator + THINK_CLOSE + separator * 2 + body


def _squash(text: str) -> str:
    """Text with all white space removed: templates strip and re-space, and that loses nothing."""
    return "".join(text.split())


def cut_at_end_of_turn(chat: ChatTokenizer, ids: list[int], i: int, where: str) -> list[int]:
    """The model stops at its end-of-turn token; what a template renders after it is not generated."""
    end = next((k for k, t in enumerate(ids) if t in chat.stop_ids), None)
    if end is None:
        raise InputError(f"{where}: turn {i} renders no end-of-turn token "
                         f"({sorted(chat.tokenizer.convert_ids_to_tokens(sorted(chat.stop_ids)))})")
    if chat.decode(ids[end + 1:]).strip():
        raise InputError(f"{where}: turn {i}: the template renders text after the end-of-turn token")
    return ids[: end + 1]


def assistant_texts(message: dict) -> list[tuple[str, str]]:
    """(field, text) of everything the model writes in an assistant turn: what a row must keep."""
    fields = [("reasoning_content", message.get("reasoning_content", "")), ("content", message.get("content", ""))]
    for c, call in enumerate(message.get("tool_calls", [])):
        arguments = call["function"]["arguments"]
        fields.append((f"tool_calls[{c}].function.name", call["function"]["name"]))
        fields.append((f"tool_calls[{c}].function.arguments",
                       arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)))
    return [(field, text) for field, text in fields if text.strip()]


def check_nothing_dropped(chat: ChatTokenizer, message: dict, trained_ids: list[int], i: int, where: str) -> None:
    """Refuse the row unless every assistant text of turn i is among its trained tokens."""
    trained = _squash(chat.decode(trained_ids))
    for field, text in assistant_texts(message):
        if _squash(text) not in trained:
            hint = (" (the template renders the call's id, not its name: give ids as functions.NAME:INDEX, "
                    "Kimi's format)") if field.endswith(".name") else ""
            raise InputError(f"{where}: turn {i} field {field}: the chat template drops it from the trained "
                             f"tokens{hint}")


def turn_row(chat: ChatTokenizer, messages: list[dict], i: int, tools: list[dict] | None,
             where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of assistant turn i: the row is their concatenation."""
    prompt = chat.render(messages[:i], add_generation_prompt=True, tools=tools)
    generated = chat.tokenize(generation_text(chat, messages, i, tools, where, prompt))
    generated = cut_at_end_of_turn(chat, generated, i, where)
    check_nothing_dropped(chat, messages[i], generated, i, where)
    return chat.tokenize(prompt), generated


def rows_for_conversation(chat: ChatTokenizer, messages: list[dict], conversation: int,
                          rows_per: str, where: str, tools: list[dict] | None = None) -> list[Row]:
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
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


def build_rows(chat: ChatTokenizer, records: Iterator[tuple[str, Any]], *, rows_per: str, vocab_size: int,
               max_samples: int | None, max_seq_len: int, on_too_long: str, keep_bad: bool,
               progress=lambda it: it) -> PreparedRows:
    """Every training row of the input. keep_bad=False raises the first bad row's InputError;
    True collects bad rows (file, row, reason) and goes on."""
    out = PreparedRows(rows=[], bad=[])
    conversation_of: dict[str, int] = {}  # conversation key -> index (the split is by conversation)
    for where, record in progress(records):
        key = conversation_key(record, where)
        if key not in conversation_of and max_samples is not None and len(conversation_of) >= max_samples:
            break
        out.input_rows += 1
        try:
            if isinstance(record, InputError):
                raise record
            rows = rows_for_record(chat, record, conversation_of.get(key, len(conversation_of)), rows_per,
                                   vocab_size, where)
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
    log.info("preflight rows: %d row(s) read, %d training row(s) from %d conversation(s), %d bad, "
             "%d longer than --max-seq-len", prepared.input_rows, len(prepared.rows), prepared.conversations,
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
