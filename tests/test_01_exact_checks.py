"""Stage 01's third pass (one test per defect found on real templates): rows decided token for token,
never by substring; any exception on one row is one line naming file, row and turn; vLLM's chat-path
normalisation for prompts; --chat-template-kwargs, --end-of-turn-tokens, a saved dataset as --data,
dropped rows named, the --max-samples cap said."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.chat_rows import ChatTokenizer, rows_for_record
from eagle3_pipeline.conversations import to_messages
from eagle3_pipeline.errors import InputError

from conftest import run_stage


def trained(row) -> list[int]:
    return [t for t, m in zip(row.input_ids, row.loss_mask) if m]


def prompt_of(row) -> list[int]:
    return row.input_ids[: row.loss_mask.index(1)]


@pytest.fixture(scope="module")
def kimi(kimi_target):
    return ChatTokenizer(str(kimi_target))


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, llama_target):
    """A tokenizer folder for one of the real templates of tests/fixtures/chat-templates."""
    from test_01_real_templates import FAMILIES, _build

    built = {}

    def build(name: str):
        if name not in built:
            family = next(f for f in FAMILIES if f.name == name)
            built[name] = _build(family, tmp_path_factory.mktemp(name), llama_target)
        return built[name]
    return build


# --- silent loss and corruption -------------------------------------------------------------------------

def test_reasoning_whose_text_recurs_in_the_answer_is_still_trained(kimi):
    record = {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello there. How can I help?", "reasoning_content": "Hello there."}]}
    (row,) = rows_for_record(kimi, record, 0, "turn", 1024, "x")
    assert kimi.decode(trained(row)) == "Hello there.</think>Hello there. How can I help?<|im_end|>"


def test_deepseek_v31_thinking_turns_close_their_reasoning_once(family_dir):
    chat = ChatTokenizer(str(family_dir("deepseek-v3.1")), template_kwargs={"thinking": True})
    record = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                           {"role": "user", "content": "Times 3?"},
                           {"role": "assistant", "content": "12", "reasoning_content": "4 * 3."}]}
    rows = rows_for_record(chat, record, 0, "turn", len(chat.tokenizer), "x")
    assert [chat.decode(trained(r)) for r in rows] == ["Add them.</think>4<｜end▁of▁sentence｜>",
                                                       "4 * 3.</think>12<｜end▁of▁sentence｜>"]
    assert all(chat.decode(prompt_of(r)).endswith("<｜Assistant｜><think>") for r in rows)


def test_prompt_has_the_arguments_as_vllm_renders_them_parsed_from_their_json_string(kimi):
    record = {"messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "cold"},
        {"role": "assistant", "content": "Cold."}]}
    first, second = rows_for_record(kimi, record, 0, "turn", 1024, "x")
    # vLLM parses the string into an object before templating: the template renders it as JSON with spaces
    assert '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>' in kimi.decode(trained(first))
    assert '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>' in kimi.decode(prompt_of(second))


def test_name_on_any_message_is_kept_as_vllm_keeps_it():
    messages = to_messages({"messages": [{"role": "user", "content": "hi", "name": "ana"},
                                         {"role": "assistant", "content": "yo", "name": "bot"}]}, "x")
    assert [m.get("name") for m in messages] == ["ana", "bot"]


@pytest.mark.parametrize("arguments", ["city=Oslo", "[1, 2]"])
def test_arguments_that_are_not_a_json_object_are_refused_in_one_line(kimi, arguments):
    record = {"messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": arguments}}]}]}
    with pytest.raises(InputError) as exc:
        rows_for_record(kimi, record, 0, "turn", 1024, "data.jsonl:3")
    message = str(exc.value)
    assert message.startswith("data.jsonl:3: turn 1 tool_calls[0].function.arguments is ") and "\n" not in message
    assert "vLLM renders" in message


def test_an_assistant_first_conversation_trains_the_later_turns_with_the_greeting_in_their_prompt(kimi):
    record = {"conversations": [{"from": "gpt", "value": "Hi! How can I help?"}, {"from": "human", "value": "2+2?"},
                                {"from": "gpt", "value": "4"}]}
    (row,) = rows_for_record(kimi, record, 0, "turn", 1024, "x")
    assert row.turn == 2 and kimi.decode(trained(row)) == "</think>4<|im_end|>"
    assert "Hi! How can I help?" in kimi.decode(prompt_of(row))
    with pytest.raises(InputError, match="only assistant turn opens it"):
        rows_for_record(kimi, {"conversations": [{"from": "gpt", "value": "Hi!"}]}, 0, "turn", 1024, "y")


# --- every bad row one line, whatever its exception --------------------------------------------------

def _llama_rows(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "description": "x"}}}}}]
    parallel = {"tools": tools, "messages": [
        {"role": "user", "content": "two calls"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "function": {"name": "f", "arguments": {"a": "1"}}},
            {"id": "c1", "function": {"name": "f", "arguments": {"a": "2"}}}]}]}
    good = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
            for w in ("one", "two", "three", "four")]
    assistant_first = {"conversations": [{"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Say five"},
                                         {"from": "gpt", "value": "five"}]}
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [good[0], parallel, good[1], assistant_first, good[2],
                                                             good[3]]))
    return source


@pytest.mark.slow
def test_a_templates_own_exception_is_one_line_per_row_and_follows_on_bad_row(tmp_path, family_dir):
    target = family_dir("llama-3.3")
    source = _llama_rows(tmp_path)
    expected = (f"{source}:2: turn 1: the chat template fails (TemplateError: This model only supports single "
                f"tool-calls at once!)")
    failed = run_stage("prepare", "--target", target, "--data", source, "--output", tmp_path / "fail", check=False)
    assert failed.returncode == 4 and "Traceback" not in failed.stderr
    assert f"error: {expected}" in failed.stderr
    check = run_stage("prepare", "--target", target, "--data", source, "--output", tmp_path / "check", "--check",
                      "--on-bad-row", "skip", "--max-bad-fraction", "0.5", check=False)
    assert check.returncode == 0 and "Traceback" not in check.stderr
    assert f"bad row {expected.replace(f'{source}:2: ', f'{source}:2: ', 1)}" in check.stderr
    assert not (tmp_path / "check").exists() or not any((tmp_path / "check").iterdir())
    out = tmp_path / "skip"
    run_stage("prepare", "--target", target, "--data", source, "--output", out, "--on-bad-row", "skip",
              "--max-bad-fraction", "0.5", "--val-ratio", "0.4")
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["where"], r["reason"]) for r in rejected] == [(f"{source}:2", expected.split(": ", 1)[1])]
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert (counts["rows"], counts["rejected_rows"]) == (5, 1)  # the assistant-first row trains its turn 2


# --- flags -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_chat_template_kwargs_reach_every_rendering_the_identity_and_print_config(tmp_path, family_dir):
    target = family_dir("deepseek-v3.1")
    source = tmp_path / "r1.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}"},
                                                       {"role": "assistant", "content": w, "reasoning_content": "Easy."}]})
                              + "\n" for w in ("one", "two", "three")))
    args = ["--target", target, "--data", source, "--val-ratio", "0.34", "--chat-template-kwargs", '{"thinking": true}']
    shown = run_stage("prepare", *args, "--output", tmp_path / "x", "--print-config")
    assert 'chat_template_kwargs = "{\\"thinking\\": true}"' in shown.stdout
    # without the switch the template has no think block: the reasoning cannot be placed, one line per row
    off = run_stage("prepare", *args[:-2], "--output", tmp_path / "off", check=False)
    assert off.returncode == 4 and "has no <think> block" in off.stderr and "Traceback" not in off.stderr
    run_stage("prepare", *args, "--output", tmp_path / "on")
    manifest = json.loads((tmp_path / "on" / "manifest.json").read_text())
    assert manifest["identity"]["settings"]["chat_template_kwargs"] == '{"thinking": true}'
    import datasets

    chat = ChatTokenizer(str(target), template_kwargs={"thinking": True})
    rows = datasets.load_from_disk(str(tmp_path / "on")).with_format(None)
    texts = sorted(chat.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in zip(rows["input_ids"], rows["loss_mask"]))
    assert texts == sorted(f"Easy.</think>{w}<｜end▁of▁sentence｜>" for w in ("one", "two", "three"))
    bad = run_stage("prepare", *args[:-1], "[1]", "--output", tmp_path / "bad", check=False)
    assert bad.returncode != 0 and "--chat-template-kwargs" in bad.stderr and "Traceback" not in bad.stderr


def test_end_of_turn_tokens_replace_the_eos_ids_and_unknown_ones_are_one_line(family_dir):
    target = family_dir("llama-3.3")
    default = ChatTokenizer(str(target))
    assert default.stop_texts == ["<|eot_id|>", "<|eom_id|>"]  # generation_config.json's eos ids
    only = ChatTokenizer(str(target), end_of_turn_tokens=["<|eom_id|>"])
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(InputError, match=r"turn 1 renders no end-of-turn token \['<\|eom_id\|>'\].*--end-of-turn-tokens"):
        rows_for_record(only, record, 0, "turn", len(only.tokenizer), "x")
    with pytest.raises(InputError, match=r"--end-of-turn-tokens \['<\|user\|>'\] are not tokens of this tokenizer"):
        ChatTokenizer(str(target), end_of_turn_tokens=["<|user|>"])


@pytest.mark.slow
def test_saved_dataset_folder_too_long_rows_named_and_the_max_samples_cap_said(tmp_path, kimi_target):
    import datasets

    records = [{"messages": [{"role": "user", "content": f"Count to {n}"},
                             {"role": "assistant", "content": " ".join(map(str, range(n * 8)))}]} for n in range(1, 7)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(records).save_to_disk(str(folder))
    out = tmp_path / "out"
    result = run_stage("prepare", "--target", kimi_target, "--data", folder, "--output", out, "--max-seq-len", "120",
                       "--max-samples", "5", "--val-ratio", "0.34")
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 1 and all("> --max-seq-len 120 (dropped)" in r["reason"] for r in rejected)
    assert all(r["where"].startswith(f"{folder} row ") for r in rejected)
    assert all(f"dropped row {r['where']}: {r['reason']}" in result.stderr for r in rejected)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["dropped_too_long"] == len(rejected) and counts["conversations"] == 5
    assert "--max-samples capped the input" in result.stderr


@pytest.mark.parametrize("tools, cause", [
    (None, "TypeError"),  # Hermes-3's template iterates `tools` unconditionally
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
     "UndefinedError"),  # ... and reads each tool's description
])
def test_any_exception_a_real_template_raises_is_one_line_naming_the_turn(family_dir, tools, cause):
    chat = ChatTokenizer(str(family_dir("hermes-3")))
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    if tools:
        record["tools"] = tools
    with pytest.raises(InputError) as exc:
        rows_for_record(chat, record, 0, "turn", len(chat.tokenizer), "data.jsonl:9")
    message = str(exc.value)
    assert message.startswith(f"data.jsonl:9: turn 1: the chat template fails ({cause}: ") and "\n" not in message


def test_a_template_that_reads_thinking_gets_the_turns_reasoning_under_that_name(family_dir):
    """gpt-oss reads an assistant turn's reasoning only as `thinking` (its analysis channel); the trained
    turn carries it under that name too, whichever name the data used."""
    from eagle3_pipeline.chat_rows import content_format

    chat = ChatTokenizer(str(family_dir("qwen3")))
    chat.tokenizer.chat_template = (  # gpt-oss's layout for the last assistant turn, reduced
        "{%- for m in messages -%}{%- if m.role == 'user' -%}<|im_start|>{{ m.content }}<|im_end|>"
        "{%- elif loop.last and 'thinking' in m -%}<|im_start|><think>{{ m.thinking }}</think>{{ m.content }}<|im_end|>"
        "{%- else -%}<|im_start|>{{ m.content }}<|im_end|>{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>{%- endif -%}")
    chat.content_format = content_format(chat.tokenizer.chat_template)
    record = {"messages": [{"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]}
    (row,) = rows_for_record(chat, record, 0, "turn", len(chat.tokenizer), "x")
    assert chat.decode(trained(row)) == "<think>Add them.</think>4<|im_end|>"
