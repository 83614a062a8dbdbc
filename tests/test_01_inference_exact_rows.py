"""Stage 01 rows are the tokens the target sees and emits at inference (issue: reasoning, tool calls,
inference-exact tokens, nothing silently dropped).

Templates exercised: the miniature's Kimi-K2.5-faithful template (history reasoning dropped up to
the last plain assistant turn, tool-call section, tool results, tool declarations, content parts),
a ChatML template whose header ends in a newline (SmolLM2 / Qwen style), a `<think>` template that
keeps history reasoning (Qwen3 style), and one that strips reasoning entirely (DeepSeek-R1 style).
Each check is made against the tokenizer itself (`apply_chat_template` + tokenize), not against
the code under test.
"""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.chat_rows import ChatTokenizer, rows_for_record
from eagle3_pipeline.conversations import to_messages, tools_of
from eagle3_pipeline.errors import InputError

from conftest import run_stage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]

# An agentic, thinking conversation: reasoning in several turns, a tool-call chain (arguments as a
# string and as an object, two calls in one turn), tool results with ids and names, content parts,
# a follow-up question, and the final answer.
AGENTIC = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo "}, {"type": "text", "text": "and Paris?"}]},
    {"role": "assistant", "content": "Let me look both up.", "reasoning_content": "Two cities, so two weather calls.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Tokyo\"}"}},
                    {"id": "functions.get_weather:1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "18 C, clear"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "name": "get_weather", "content": "11 C, rain"},
    {"role": "assistant", "content": [{"type": "text", "text": "Tokyo: 18 C and clear. Paris: 11 C and rain."}],
     "reasoning": "Both results are in; summarise them."},
    {"role": "user", "content": "Should I take an umbrella to Paris?"},
    {"role": "assistant", "content": "", "thinking": "Rain in Paris; check the forecast for tomorrow too.",
     "tool_calls": [{"id": "functions.search:2", "type": "function",
                     "function": {"name": "search", "arguments": {"query": "Paris forecast tomorrow"}}}]},
    {"role": "tool", "tool_call_id": "functions.search:2", "content": "Rain all day"},
    {"role": "assistant", "content": "Yes: it will rain all day tomorrow too.",
     "reasoning_content": "The forecast says rain all day, so yes."},
]}


def trained(row) -> list[int]:
    return [t for t, m in zip(row.input_ids, row.loss_mask) if m]


def prompt_of(row) -> list[int]:
    return row.input_ids[: row.loss_mask.index(1)]


def squash(text: str) -> str:
    return "".join(text.split())


@pytest.fixture(scope="module")
def kimi(kimi_target):
    return ChatTokenizer(str(kimi_target))


# --- the Kimi-K2.5-faithful template ------------------------------------------------------------------

def test_every_row_trains_all_reasoning_content_and_tool_calls_of_its_turn_and_its_prompt_is_the_templates(kimi):
    tok = kimi.tokenizer
    # vLLM's chat path hands reasoning to the template as `reasoning_content` whichever name the data used
    messages = [{("reasoning_content" if k in ("reasoning", "thinking") else k): v for k, v in m.items()}
                for m in to_messages(AGENTIC, "agentic")]
    rows = rows_for_record(kimi, AGENTIC, 0, "turn", 1024, "agentic")
    assert [r.turn for r in rows] == [2, 5, 7, 9]
    for row in rows:
        source = AGENTIC["messages"][row.turn]
        # the prompt is exactly what the template + tokenizer give for the conversation before the turn
        expected_prompt = tok(tok.apply_chat_template(messages[: row.turn], tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        assert prompt_of(row) == expected_prompt
        assert tok.convert_ids_to_tokens(expected_prompt[-1]) == "<think>"  # thinking on at inference
        text = tok.decode(trained(row), skip_special_tokens=False)
        reasoning = source.get("reasoning_content") or source.get("reasoning") or source.get("thinking")
        content = source["content"] if isinstance(source["content"], str) else "".join(p["text"] for p in source["content"])
        assert text.startswith(reasoning + "</think>" + content)  # what the model writes after `<think>`
        for call in source.get("tool_calls", []):
            args = call["function"]["arguments"]
            assert f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>" in text
            assert squash(args if isinstance(args, str) else json.dumps(args)) in squash(text)
        assert text.endswith("<|im_end|>")
        assert ("<|tool_calls_section_end|><|im_end|>" in text) == bool(source.get("tool_calls"))


def test_kimi_rows_match_the_hand_built_tokens_of_a_tool_chain(kimi):
    """The current tool-call chain keeps its reasoning in the prompt; history before the last plain
    answer does not; tools are declared first; results render as `## Return of ID`."""
    tok = kimi.tokenizer
    record = {"tools": TOOLS[:1], "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
        {"role": "user", "content": "Tokyo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Report it."}]}
    declare = "<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS[:1]) + "<|im_end|>"
    head = (declare + "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
            "<|im_user|>user<|im_middle|>Hi<|im_end|>")
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    expected = [
        (head + "<|im_assistant|>assistant<|im_middle|><think>", "Greet.</think>Hello.<|im_end|>"),
        (head + "<|im_assistant|>assistant<|im_middle|><think></think>Hello.<|im_end|>"
         "<|im_user|>user<|im_middle|>Tokyo?<|im_end|><|im_assistant|>assistant<|im_middle|><think>",
         "Call the tool.</think>" + call),
        (head + "<|im_assistant|>assistant<|im_middle|><think></think>Hello.<|im_end|>"
         "<|im_user|>user<|im_middle|>Tokyo?<|im_end|><|im_assistant|>assistant<|im_middle|><think>Call the tool.</think>"
         + call + "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
         "<|im_assistant|>assistant<|im_middle|><think>", "Report it.</think>Sunny.<|im_end|>"),
    ]
    rows = rows_for_record(kimi, record, 0, "turn", 1024, "chain")
    for row, (prompt, generated) in zip(rows, expected, strict=True):
        assert prompt_of(row) == tok(prompt, add_special_tokens=False)["input_ids"]
        assert trained(row) == tok(generated, add_special_tokens=False)["input_ids"]


def test_openai_call_ids_become_kimis_functions_name_index_ids_in_the_call_and_its_result(kimi):
    """Kimi writes `functions.NAME:INDEX` where other models' data says `call_...` (OpenAI's form): such ids are
    renamed (INDEX counts the conversation's calls) and the results answering them follow, token for token."""
    def chain(first: str, second: str) -> dict:
        return {"messages": [
            {"role": "user", "content": "Tokyo, then Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": first, "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]},
            {"role": "tool", "tool_call_id": first, "content": "sunny"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": second, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": second, "content": "rain"},
            {"role": "assistant", "content": "Tokyo sunny, Paris rain."}]}
    openai = rows_for_record(kimi, chain("call_8f2", "call_a91"), 0, "turn", 1024, "x")
    kimis = rows_for_record(kimi, chain("functions.get_weather:0", "functions.get_weather:1"), 0, "turn", 1024, "x")
    assert [r.input_ids for r in openai] == [r.input_ids for r in kimis]
    assert [r.loss_mask for r in openai] == [r.loss_mask for r in kimis]
    assert "## Return of functions.get_weather:1\nrain" in kimi.decode(openai[-1].input_ids)


def test_calls_given_ids_and_calls_without_are_numbered_across_the_conversation_and_results_answer_in_order(kimi):
    record = {"messages": [
        {"role": "user", "content": "Paris, Rome, Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "20"}, {"role": "tool", "content": "25"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "Paris 20, Rome 25, Oslo 3."}]}
    messages = to_messages(record, "x")
    assert [c["id"] for c in messages[1]["tool_calls"] + messages[4]["tool_calls"]] == [
        "functions.get_weather:0", "functions.get_weather:1", "functions.get_weather:2"]
    assert [messages[k]["tool_call_id"] for k in (2, 3, 5)] == [
        "functions.get_weather:0", "functions.get_weather:1", "functions.get_weather:2"]
    prompt = kimi.decode(prompt_of(rows_for_record(kimi, record, 0, "turn", 1024, "x")[-1]))
    assert ("## Return of functions.get_weather:0\n20" in prompt and "## Return of functions.get_weather:1\n25" in prompt
            and "## Return of functions.get_weather:2\n3" in prompt)


@pytest.mark.parametrize("given", ["parts", "parts-split", "field-and-inline"])
def test_inline_think_in_content_parts_or_beside_an_equal_reasoning_field_trains_as_the_plain_string_does(kimi, given):
    def record(answer: dict) -> dict:
        return {"messages": [{"role": "user", "content": "Greet me"}, {"role": "assistant", **answer},
                             {"role": "user", "content": "again"}, {"role": "assistant", "content": "Hi again"}]}
    plain = rows_for_record(kimi, record({"content": "<think>plan a greeting</think>Hello there"}), 0, "turn", 1024, "x")
    answer = {"parts": {"content": [{"type": "text", "text": "<think>plan a greeting</think>Hello there"}]},
              "parts-split": {"content": [{"type": "text", "text": "<think>plan a "},
                                          {"type": "text", "text": "greeting</think>"}, {"type": "text", "text": "Hello there"}]},
              "field-and-inline": {"reasoning_content": "plan a greeting",
                                   "content": "<think>plan a greeting</think>Hello there"}}[given]
    rows = rows_for_record(kimi, record(answer), 0, "turn", 1024, "x")
    assert [r.input_ids for r in rows] == [r.input_ids for r in plain]
    assert [r.loss_mask for r in rows] == [r.loss_mask for r in plain]
    assert kimi.decode(trained(rows[0])) == "plan a greeting</think>Hello there<|im_end|>"
    assert "<think></think>Hello there<|im_end|>" in kimi.decode(prompt_of(rows[1]))  # history drops it, once


def test_tool_calls_without_ids_get_kimis_functions_name_index_ids_and_results_follow_them(kimi):
    record = {"messages": [{"role": "user", "content": "Two searches"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"function": {"name": "search", "arguments": {"q": "a"}}},
                               {"function": {"name": "search", "arguments": {"q": "b"}}}]},
                           {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"},
                           {"role": "assistant", "content": "Done."}]}
    messages = to_messages(record, "x")
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["functions.search:0", "functions.search:1"]
    assert [m.get("tool_call_id") for m in messages[2:4]] == ["functions.search:0", "functions.search:1"]
    assert len(rows_for_record(kimi, record, 0, "turn", 1024, "x")) == 2


# --- input shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking", "inline"])
def test_reasoning_field_names_and_inline_think_tags_all_reach_the_trained_tokens(kimi, field):
    answer = {"role": "assistant", "content": "Four."}
    if field == "inline":
        answer["content"] = "<think>Add them.</think>\n\nFour."
    else:
        answer[field] = "Add them."
    (row,) = rows_for_record(kimi, {"messages": [{"role": "user", "content": "2+2?"}, answer]}, 0, "turn", 1024, "x")
    assert kimi.decode(trained(row)) == "Add them.</think>Four.<|im_end|>"


def test_sharegpt_function_call_and_observation_turns_become_a_tool_chain(kimi):
    record = {"conversations": [
        {"from": "human", "value": "3 miles in km?"},
        {"from": "function_call", "value": "{\"name\": \"convert\", \"arguments\": {\"value\": 3}}"},
        {"from": "observation", "value": "{\"km\": 4.83}"},
        {"from": "gpt", "value": "About 4.83 km."}],
        "tools": json.dumps([{"type": "function", "function": {"name": "convert"}}])}
    messages = to_messages(record, "x")
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.convert:0", "type": "function", "function": {"name": "convert", "arguments": {"value": 3}}}]}
    assert messages[2] == {"role": "tool", "content": "{\"km\": 4.83}", "tool_call_id": "functions.convert:0"}
    assert tools_of(record, "x") == [{"type": "function", "function": {"name": "convert"}}]
    first, _ = rows_for_record(kimi, record, 0, "turn", 1024, "x")
    assert "<|tool_call_begin|>functions.convert:0<|tool_call_argument_begin|>{\"value\": 3}" in kimi.decode(trained(first))
    assert "tool_declare" in kimi.decode(prompt_of(first))


@pytest.mark.parametrize("content, message", [
    ([{"type": "image_url", "image_url": {"url": "x.png"}}], "content part 0 has type 'image_url': only text parts"),
    (["hi"], "content part 0 is not a {type, text} object"),
    (42, "content is not text"),
])
def test_content_parts_other_than_text_are_refused_with_turn_and_part(content, message):
    with pytest.raises(InputError, match=message):
        to_messages({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A"}]}, "x")


@pytest.mark.slow
def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_accepted(tmp_path, kimi_target):
    source = tmp_path / "bom.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
            for w in ("yes", "no", "maybe")]
    source.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    run_stage("prepare", "--target", kimi_target, "--data", source, "--output", tmp_path / "out", "--val-ratio", "0.34")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]["rows"] == 3


# --- other template families ---------------------------------------------------------------------------

CHATML = (  # SmolLM2 / Qwen style: the header ends with a newline, turns end with `<|im_end|>\n`
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
THINK_KEEPS_HISTORY = (  # Qwen3 style layout, keeping every turn's reasoning
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') -%}"
    "{{ '<think>\n' + m['reasoning_content'] + '\n</think>\n\n' }}{%- endif -%}"
    "{{ m['content'] + '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
R1_STRIPS = (  # DeepSeek-R1 style: reasoning never rendered; the generation prompt opens `<think>\n`
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{ '<|User|>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<|Assistant|>' + m['content'] + '<|end|>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|Assistant|><think>\n' }}{%- endif -%}")
INDENTED = {"messages": [{"role": "user", "content": "Write a function that doubles x."},
                         {"role": "assistant", "content": "    return x * 2\n    # done"}]}


@pytest.fixture(scope="module")
def template_dirs(tmp_path_factory):
    """A byte-level BPE that learned newline+indent merges (as every code-trained BPE has), saved with
    each template; eos = the template's end-of-turn token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["def f(x):\n    return x * 2\n    # done", "Write a function that doubles x.", "reasoning about x"] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    dirs = {}
    for name, template, eos in (("chatml", CHATML, "<|im_end|>"), ("think", THINK_KEEPS_HISTORY, "<|im_end|>"),
                                ("r1", R1_STRIPS, "<|end|>")):
        fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, additional_special_tokens=[
            "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|User|>", "<|Assistant|>", "<|end|>"])
        fast.chat_template = template
        dirs[name] = tmp_path_factory.mktemp(name)
        fast.save_pretrained(dirs[name])
    return dirs


def test_chatml_answer_starting_with_indentation_is_prompt_ids_plus_its_own_ids(template_dirs):
    chat = ChatTokenizer(str(template_dirs["chatml"]))
    tok = chat.tokenizer
    prompt = tok.apply_chat_template(INDENTED["messages"][:1], tokenize=False, add_generation_prompt=True)
    answer = INDENTED["messages"][1]["content"] + "<|im_end|>"
    prompt_ids, answer_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, answer))
    # The case exists: tokenized as one string, the header's newline merges into the indentation.
    assert tok(prompt + answer, add_special_tokens=False)["input_ids"][: len(prompt_ids)] != prompt_ids
    (row,) = rows_for_record(chat, INDENTED, 0, "turn", len(tok), "x")
    assert row.input_ids == prompt_ids + answer_ids  # the template's "\n" after <|im_end|> is not generated
    assert row.loss_mask == [0] * len(prompt_ids) + [1] * len(answer_ids)


def test_chatml_template_refuses_reasoning_it_has_no_place_for(template_dirs):
    chat = ChatTokenizer(str(template_dirs["chatml"]))
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "R"}]}
    with pytest.raises(InputError, match="turn 1 field reasoning_content: the chat template has no <think> block"):
        rows_for_record(chat, record, 0, "turn", len(chat.tokenizer), "x")


def test_think_template_that_keeps_history_trains_its_own_layout_and_whole_conversation_rows(template_dirs):
    chat = ChatTokenizer(str(template_dirs["think"]))
    record = {"messages": [{"role": "user", "content": "Write a function that doubles x."},
                           {"role": "assistant", "content": "def f(x):", "reasoning_content": "reasoning about x"},
                           {"role": "user", "content": "Again"},
                           {"role": "assistant", "content": "    return x * 2", "reasoning_content": "x again"}]}
    first, second = rows_for_record(chat, record, 0, "turn", len(chat.tokenizer), "x")
    assert chat.decode(trained(first)) == "<think>\nreasoning about x\n</think>\n\ndef f(x):<|im_end|>"
    assert "reasoning about x" in chat.decode(prompt_of(second))  # history keeps it, as this template renders it
    (whole,) = rows_for_record(chat, record, 0, "conversation", len(chat.tokenizer), "x")
    assert whole.input_ids == second.input_ids
    assert squash(chat.decode(trained(whole))) == squash(chat.decode(trained(first)) + chat.decode(trained(second)))


def test_r1_style_template_that_strips_reasoning_gets_it_back_where_the_model_writes_it(template_dirs):
    chat = ChatTokenizer(str(template_dirs["r1"]))
    record = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Add."}]}
    (row,) = rows_for_record(chat, record, 0, "turn", len(chat.tokenizer), "x")
    assert chat.decode(prompt_of(row)).endswith("<|Assistant|><think>\n")
    assert chat.decode(trained(row)) == "Add.\n</think>\n\n4<|end|>"


# --- bad rows at scale -------------------------------------------------------------------------------

FIVE_BAD = [  # (line, the reason rejected.jsonl gives)
    ('{"messages": [{"role": "user", "content": "hi"}', "malformed JSON"),
    ('{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}', "unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, {"role": "assistant", "content": "A"}]}',
     "content part 0 has type 'image_url'"),
    ('{"messages": [{"role": "user", "content": "Tokyo?"}, {"role": "tool", "content": "sunny"}, '
     '{"role": "assistant", "content": "Sunny."}]}', "turn 1 (tool) answers no tool call"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}', "turn 1 is an empty assistant turn"),
]


def _mixed_file(tmp_path):
    good = [json.dumps({"messages": [{"role": "user", "content": f"Count to {n}"},
                                     {"role": "assistant", "content": " ".join(map(str, range(n))), "reasoning_content": "Easy."}]})
            for n in range(2, 8)]
    lines = [good[0], FIVE_BAD[0][0], good[1], FIVE_BAD[1][0], good[2], FIVE_BAD[2][0], good[3], FIVE_BAD[3][0],
             good[4], FIVE_BAD[4][0], good[5]]
    source = tmp_path / "mixed.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return source


@pytest.mark.slow
def test_on_bad_row_skip_lists_every_bad_row_in_rejected_jsonl_and_counts_them(tmp_path, kimi_target):
    source = _mixed_file(tmp_path)
    out = tmp_path / "out"
    result = run_stage("prepare", "--target", kimi_target, "--data", source, "--output", out, "--on-bad-row", "skip",
                       "--max-bad-fraction", "0.5", "--val-ratio", "0.34")
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["where"] for r in rejected] == [f"{source}:{n}" for n in (2, 4, 6, 8, 10)]
    for entry, (line, reason) in zip(rejected, FIVE_BAD):
        assert reason in entry["reason"]
        assert entry["row"] == (None if reason == "malformed JSON" else json.loads(line))
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["input_rows"], counts["rejected_rows"], counts["conversations"], counts["rows"]) == (11, 5, 6, 6)
    assert "5 bad row(s) skipped" in result.stderr
    # the default 1% limit refuses the same file, naming the first bad row; nothing is written
    strict = run_stage("prepare", "--target", kimi_target, "--data", source, "--output", tmp_path / "strict",
                       "--on-bad-row", "skip", check=False)
    assert strict.returncode == 4
    assert f"error: {source}: 5 of 11 rows are bad (45.5% > --max-bad-fraction 1.0%); first: {source}:2: malformed JSON" in strict.stderr
    assert not (tmp_path / "strict" / "manifest.json").exists()


@pytest.mark.slow
def test_check_renders_every_row_lists_the_problems_and_writes_nothing(tmp_path, kimi_target):
    source = _mixed_file(tmp_path)
    out = tmp_path / "out"
    result = run_stage("prepare", "--target", kimi_target, "--data", source, "--output", out, "--check", check=False)
    assert result.returncode == 4
    listed = [line.split("bad row ", 1)[1] for line in result.stderr.splitlines() if "bad row " in line]
    assert [entry.split(": ", 1)[0] for entry in listed] == [f"{source}:{n}" for n in (2, 4, 6, 8, 10)]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {source}:2: malformed JSON (Expecting ',' delimiter at column 48) (5 bad row(s) in all, "
                      f"listed above; fix them or pass --on-bad-row skip)"]
    assert not out.exists() or not any(out.iterdir())


# --- a real template no one here wrote: SmolLM2-135M-Instruct's (tests/fixtures, provenance.json) -----

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2's tokenizer folder (config + tokenizer + ChatML template; no weights): enough for stage 01."""
    import gzip
    import shutil

    from conftest import REPO

    source = REPO / "tests" / "fixtures" / "smollm2-135m-instruct-tokenizer"
    target = tmp_path_factory.mktemp("smollm2")
    for item in source.iterdir():
        if item.name == "tokenizer.json.gz":
            (target / "tokenizer.json").write_bytes(gzip.decompress(item.read_bytes()))
        else:
            shutil.copy(item, target / item.name)
    return target


def test_smollm2_real_template_indented_answers_train_exactly_the_answer_tokens(smollm2):
    chat = ChatTokenizer(str(smollm2))
    tok = chat.tokenizer
    record = {"messages": [{"role": "user", "content": "Write a function that doubles x."},
                           {"role": "assistant", "content": "    return x * 2"},
                           {"role": "user", "content": "And a docstring?"},
                           {"role": "assistant", "content": '  """Double x."""\n    return x * 2'}]}
    rows = rows_for_record(chat, record, 0, "turn", len(tok), "x")
    for row in rows:
        messages = record["messages"][: row.turn]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        answer = record["messages"][row.turn]["content"] + "<|im_end|>"
        prompt_ids, answer_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, answer))
        assert tok(prompt + answer, add_special_tokens=False)["input_ids"][: len(prompt_ids)] != prompt_ids  # merges
        assert row.input_ids == prompt_ids + answer_ids
        assert trained(row) == answer_ids and tok.convert_ids_to_tokens(answer_ids[-1]) == "<|im_end|>"


@pytest.mark.slow
def test_smollm2_template_drops_tool_calls_so_such_rows_are_refused_and_skippable(tmp_path, smollm2):
    source = tmp_path / "agentic.jsonl"
    good = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"    {w}"}]}
            for w in ("one", "two", "three")]
    agentic = {"messages": [{"role": "user", "content": "Tokyo?"}, {"role": "assistant", "content": "Checking.",
                            "tool_calls": [{"id": "functions.get_weather:0",
                                            "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]}]}
    source.write_text("".join(json.dumps(r) + "\n" for r in good[:2] + [agentic] + good[2:]))
    refused = run_stage("prepare", "--target", smollm2, "--data", source, "--output", tmp_path / "out", check=False)
    assert refused.returncode == 4
    assert f"error: {source}:3: turn 1 field tool_calls[0].function.name: the chat template drops it" in refused.stderr
    run_stage("prepare", "--target", smollm2, "--data", source, "--output", tmp_path / "out", "--on-bad-row", "skip",
              "--max-bad-fraction", "0.3", "--val-ratio", "0.34")
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert (counts["rows"], counts["rejected_rows"]) == (3, 1)
