"""Normalised conversations in -> token rows out (stage 01's logic; the readers are conversations.py).

A row is what the target sees and emits at inference, token for token:

    prompt tokens  = tokenize(template(conversation before turn i, add_generation_prompt=True))
    trained tokens = tokenize(what the model generates for turn i): reasoning, the reasoning close
                     tag, the content, the tool-call section, the end-of-turn token

The two are tokenized separately, as vLLM does (it tokenizes the prompt; the model's tokens
follow it), so a ChatML header's trailing newline never merges with an indented answer.

The prompt is rendered from the history as vLLM's chat path hands it to the template
(`template_messages`: JSON-string tool-call arguments parsed into objects, `name` kept, null content
as vLLM passes it, reasoning as `reasoning` + `reasoning_content`, `--chat-template-kwargs` applied).
The generation text is the template's own rendering of turn i where it continues that prompt (its tool-call
arguments parsed too: the model writes its template's rendering of the object, Kimi's `tojson`, whatever spacing
or escapes a JSON string in the data had, say from another model or a re-serialising exporter). Which
parts of the turn the template renders, and where, is decided exactly, never by searching the data's
text: the turn is rendered a second time with every field (reasoning, content, each call's name, id
and arguments) replaced by a unique marker. A field whose marker is missing from the generated span is
dropped by the template: the row is refused naming file, row, turn and field, except the reasoning,
which templates that strip it (Kimi-K2.5 renders every turn up to the last one without tool calls as
`<think></think>` + content; DeepSeek-R1 renders no think block; DeepSeek-V3.1 renders `</think>` +
content) get put back where the model writes it: right after the generation prompt's `<think>`,
closed by the template's own `</think>` (or `REASONING\n</think>\n\n`, R1's layout, where it renders
none). The turn's content goes in as the text the model wrote, one string, never vLLM's parts list (a
template may print content raw: Kimi-K2's tool-call branch would train the list's repr). A template
that ends a turn only by opening the next message (GLM-4.5) gets that opener, an eos id, as the
turn's stop token. Any exception a template raises on a row is one line naming the turn (with the
remedy where the template joins tool-call arguments as strings, which vLLM cannot render either); a
template that does not compile is refused once, at load. NOTES.md "Stage 01" states the rule.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jinja2
from jinja2 import nodes

from .conversations import (
    REASONING_FIELDS,
    THINK_CLOSE,
    THINK_OPEN,
    conversation_key,
    first_line,
    is_pretokenized,
    plain_text,
    reasoning_field,
    to_messages,
    tools_of,
)
from .errors import InputError

# Local imports: transformers: imported where the tokenizer is loaded (heavy; reading and normalising need none).


@dataclass
class Row:
    conversation: int  # index of the source conversation
    turn: int  # index of the assistant message trained on (-1: every assistant turn)
    input_ids: list[int]
    loss_mask: list[int]


# --- rows that are already tokens ---------------------------------------------------------

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
        _compile_template(self.tokenizer.chat_template, tokenizer_dir)
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

    @functools.cached_property
    def call_ids_rendered(self) -> tuple[bool, bool]:
        """(the template names a call by its id alone, a tool result names the call it answers): Kimi-K2.5
        writes `<|tool_call_begin|>functions.NAME:INDEX` and `## Return of functions.NAME:INDEX`. Decided once,
        by rendering a call, then the call and its result, with markers for the name and the id."""
        name, call_id = MARK.format(0), MARK.format(1)
        call = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": {}}}]}]
        result = {"role": "tool", "tool_call_id": call_id, "content": "r"}
        try:
            called = self.render(template_messages(call, self.content_format), add_generation_prompt=False)
            answered = self.render(template_messages(call + [result], self.content_format), add_generation_prompt=False)
        except Exception:  # a template that takes no calls (or not these) renders none: nothing to name
            return False, False
        return call_id in called and name not in called, answered.count(call_id) > called.count(call_id)

    def with_call_ids(self, messages: list[dict], where: str) -> list[dict]:
        """`messages` with call ids as this template's model writes them. Where the template names a call by
        its id alone (Kimi-K2.5) the model writes `functions.NAME:INDEX` there: an id in another form
        (OpenAI's `call_...`) is renamed so (INDEX counts the conversation's calls) and the results answering
        it follow. Where a result names its call, a result that answers no call before it is refused: the
        prompt would hold a result header the model never sees."""
        by_id, results_name_calls = self.call_ids_rendered
        out, renamed, calls, seen = [], {}, 0, set()
        for t, message in enumerate(messages):
            if message.get("tool_calls"):
                named = []
                for call in message["tool_calls"]:
                    if by_id and not call["id"].startswith(f"functions.{call['function']['name']}:"):
                        renamed[call["id"]] = f"functions.{call['function']['name']}:{calls}"
                        call = {**call, "id": renamed[call["id"]]}
                    named.append(call)
                    seen.add(call["id"])
                    calls += 1
                message = {**message, "tool_calls": named}
            elif message["role"] == "tool":
                answered = renamed.get(message.get("tool_call_id"), message.get("tool_call_id"))
                if results_name_calls and answered not in seen:
                    which = (f"its tool_call_id {answered!r} matches no call before it" if answered else
                             "it has no tool_call_id and no call before it is left unanswered")
                    raise InputError(f"{where}: turn {t} (tool) answers no tool call: {which} (the chat template "
                                     f"names the call in the result)")
                if answered:
                    message = {**message, "tool_call_id": answered}
            out.append(message)
        return out


def _compile_template(chat_template: str | dict, tokenizer_dir: str) -> None:
    """A template that does not compile fails every row alike: refused once, here, in one line."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    templates = chat_template.items() if isinstance(chat_template, dict) else [("", chat_template)]
    for name, template in templates:
        try:
            _compile_jinja_template(template)
        except Exception as exc:  # jinja2's TemplateSyntaxError, or whatever transformers' compiler raises
            which = f"chat template {name!r}" if name else "chat template"
            hint = " (is the file JSON-escaped? write it as plain Jinja)" if "\\n" in template or '\\"' in template else ""
            raise InputError(f"{tokenizer_dir}: the {which} does not compile ({type(exc).__name__}: "
                             f"{first_line(exc)}){hint}") from None


def content_format(chat_template: str) -> str:
    """'openai' when the template loops over a message's content (it takes a list of parts), else
    'string': the rule vLLM's chat path uses to decide how it passes content (simplified: any
    `for x in <name>.content` / `<name>['content']` / `content` loop)."""
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


def template_messages(messages: list[dict], fmt: str, trained: int | None = None,
                      trained_as_parts: bool = False) -> list[dict]:
    """The messages as vLLM's chat path hands them to the template (0.32, `parse_chat_messages`):
    null content becomes '' ('string' format) or [] ('openai'), text parts are joined with '\n'
    ('string') or kept as parts, reasoning goes in as `reasoning` and `reasoning_content`, `name`,
    `tool_call_id` and parsed tool-call arguments are kept. Message `trained` (the turn being
    rendered as the model writes it) also carries its reasoning as `thinking`, for templates that
    read that name (gpt-oss), and in the 'openai' format its content as the text the model wrote,
    one string (parts only with `trained_as_parts`, for templates that read nothing else): a
    template may print content raw in one branch (Kimi-K2 does for turns with tool calls), where a
    parts list would render as its Python repr, which the model never writes."""
    out = []
    for k, message in enumerate(messages):
        m = {key: value for key, value in message.items() if key not in REASONING_FIELDS}
        content = message.get("content")
        if fmt == "string":
            m["content"] = "\n".join(p["text"] for p in content) if isinstance(content, list) else (content or "")
        elif k == trained and not trained_as_parts and message["role"] == "assistant":
            m["content"] = plain_text(content)
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

    def rendered_turn(as_parts: bool) -> tuple[str, str, str, dict[str, str], str]:
        real = template_messages(messages[: i + 1], fmt, trained=i, trained_as_parts=as_parts)[i]
        rendered = chat.render(history + [real], add_generation_prompt=False, tools=tools)
        marked_message, markers = _marked_turn(message, rendered)
        marked = template_messages(messages[:i] + [marked_message], fmt, trained=i, trained_as_parts=as_parts)[i]
        rendered_marked = chat.render(history + [marked], add_generation_prompt=False, tools=tools)
        in_prompt, body = _split_prompt(chat, history, tools, prompt, rendered, where, i)
        in_prompt_marked, body_marked = _split_prompt(chat, history, tools, prompt, rendered_marked, where, i)
        if in_prompt != in_prompt_marked:
            raise InputError(f"{where}: turn {i}: the template lays the turn out differently for different texts")
        # what the model writes, as the template renders it
        return in_prompt, body, rendered_marked, markers, _text_before_stop(chat, body_marked)

    # The turn's content goes in as the text the model wrote; as parts only where the template renders
    # no string content (it reads parts alone).
    try:
        in_prompt, body, rendered_marked, markers, spoken = turn = rendered_turn(as_parts=False)
    except Exception:
        if fmt != "openai":
            raise
        turn = None
    if fmt == "openai" and (turn is None or ("content" in markers and spoken.count(markers["content"]) != 1)):
        in_prompt, body, rendered_marked, markers, spoken = rendered_turn(as_parts=True)

    def shown(field: str) -> bool:
        return field in markers and spoken.count(markers[field]) == 1

    for c, call in enumerate(message.get("tool_calls") or []):
        name, call_id = call["function"]["name"], call["id"]
        carried_by_id = shown(f"tool_calls[{c}].id") and call_id.startswith(f"functions.{name}:")
        if not shown(f"tool_calls[{c}].function.name") and not carried_by_id:  # (Kimi's ids: with_call_ids)
            raise InputError(f"{where}: turn {i} field tool_calls[{c}].function.name: the chat template drops it from "
                             f"the trained tokens")
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


def next_message_opener(chat: ChatTokenizer, messages: list[dict], i: int, tools: list[dict] | None,
                        prompt: str) -> int | None:
    """The end-of-turn token of a template that ends an assistant turn only by opening the next message
    (GLM-4.5: `...answer<|user|>`, `...</tool_call><|observation|>`; its eos ids are those openers): the
    model emits it as its stop token and vLLM's output ends on it. The next message is the turn's natural
    one: a tool result after tool calls, a user message otherwise (rendered with a marker as its text);
    the opener is the last end-of-turn token before that text, after the turn's own role header. None
    where there is no such token."""
    fmt = chat.content_format
    rendered = chat.render(template_messages(messages[: i + 1], fmt), add_generation_prompt=False, tools=tools)
    n = 0
    while MARK.format(n) in rendered:
        n += 1000
    marker = MARK.format(n)
    calls = messages[i].get("tool_calls") or []
    following = ({"role": "tool", "tool_call_id": calls[0]["id"], "content": marker} if calls
                 else {"role": "user", "content": marker})
    text = chat.render(template_messages(messages[: i + 1] + [following], fmt), add_generation_prompt=False,
                       tools=tools)
    before = text[: text.find(marker)] if marker in text else ""
    at, stop = max(((before.rfind(s), s) for s in chat.stop_texts), default=(-1, ""))
    head = chat.render(template_messages(messages[:i], fmt), add_generation_prompt=False, tools=tools)
    header = prompt[len(head):] if prompt.startswith(head) else ""  # the turn's role header
    if at < 0 or not header.strip() or header in before[at:]:
        return None  # no end-of-turn token opens the next message after this turn
    return chat.tokenizer.convert_tokens_to_ids(stop)


def cut_at_end_of_turn(chat: ChatTokenizer, ids: list[int], i: int, where: str) -> list[int]:
    """The model stops at its end-of-turn token; what a template renders after it is not generated."""
    end = next((k for k, t in enumerate(ids) if t in chat.stop_ids), None)
    if end is None:
        raise InputError(f"{where}: turn {i} renders no end-of-turn token {chat.stop_texts}, and the next message "
                         f"does not open with one either: the template ends assistant turns some other way; pass "
                         f"the tokens its turns end on with --end-of-turn-tokens, or use another template")
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
        if not chat.stop_ids.intersection(generated):  # GLM-4.5: the turn ends where the next message opens
            opener = next_message_opener(chat, messages, i, tools, prompt)
            generated += [] if opener is None else [opener]
        return chat.tokenize(prompt), cut_at_end_of_turn(chat, generated, i, where)
    except InputError:
        raise
    except Exception as exc:  # templates fail in many types; one bad row must not stop the run
        reason = f"the chat template fails ({type(exc).__name__}: {first_line(exc)})"
        if isinstance(exc, TypeError) and _renders_with_text_arguments(chat, messages[: i + 1], tools):
            reason += (": it joins tool-call arguments as text, but vLLM hands them to templates as objects (parsed "
                       "from the JSON), so vLLM cannot serve this conversation with this template either; prepare "
                       "and serve with one that renders object arguments (`arguments | tojson`, as vLLM's "
                       "examples/tool_chat_template_deepseekv31.jinja does): chat_template.jinja of a --tokenizer "
                       "folder, vLLM's --chat-template")
        raise InputError(f"{where}: turn {i}: {reason}") from None


def _renders_with_text_arguments(chat: ChatTokenizer, messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether the template renders these messages once tool-call arguments are JSON text: it joins
    them as strings (DeepSeek-V3.1's and R1's own templates), where vLLM hands them over parsed."""
    as_text = template_messages(messages, chat.content_format)
    if not any(m.get("tool_calls") for m in as_text):
        return False
    for m in as_text:
        for call in m.get("tool_calls") or []:  # template_messages copied each call's function
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    try:
        chat.render(as_text, add_generation_prompt=False, tools=tools)
    except Exception:
        return False
    return True


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
                f"history, e.g. drops earlier reasoning or prints earlier content as vLLM's parts list, where the "
                f"model wrote text); use --rows-per turn")
        mask[start:end] = [1] * (end - start)
    return [Row(conversation, -1, ids, mask)]


def rows_for_record(chat: ChatTokenizer, record: Any, conversation: int, rows_per: str,
                    vocab_size: int, where: str) -> list[Row]:
    """Training rows of one input row: tokens as given, or a conversation through the template."""
    if is_pretokenized(record):
        return [pretokenized_row(record, conversation, vocab_size, where)]
    return rows_for_conversation(chat, chat.with_call_ids(to_messages(record, where), where), conversation,
                                 rows_per, where, tools_of(record, where))


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
