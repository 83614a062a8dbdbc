"""The miniature is shaped like Kimi-K2.5 where it matters to the pipeline and to vLLM."""

import json

from safetensors import safe_open

from eagle3_pipeline.miniature import KIMI_SPECIAL_TOKENS, build_miniature, miniature_key
from eagle3_pipeline.target import load_target_info, weight_map


def test_kimi_miniature_has_kimi_k25_wrapper_config(kimi_target):
    config = json.loads((kimi_target / "config.json").read_text())
    assert config["model_type"] == "kimi_k25"
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["tie_word_embeddings"] is False
    text = config["text_config"]
    assert text["model_type"] == "deepseek_v3"
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576  # the only MLA size vLLM's CPU kernel takes
    assert text["topk_method"] == "noaux_tc"
    assert 4 <= text["num_hidden_layers"] <= 6
    assert text["n_routed_experts"] > text["num_experts_per_tok"] >= 2
    assert (kimi_target / "preprocessor_config.json").is_file() and "vision_config" in config


def test_kimi_miniature_weights_live_under_language_model(kimi_target):
    names = weight_map(kimi_target)
    for key in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                "language_model.model.norm.weight", "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert key in names
    assert all(name.startswith("language_model.") for name in names)
    with safe_open(str(kimi_target / names["language_model.lm_head.weight"]), "pt") as handle:
        assert handle.get_slice("language_model.lm_head.weight").get_shape() == [1024, 128]


def test_tokenizer_carries_kimi_special_tokens_and_chat_format(kimi_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kimi_target)
    for token in KIMI_SPECIAL_TOKENS:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, f"{token} is not a single special token"
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    assert prompt.startswith("<|im_system|>system<|im_middle|>")
    no_think = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    assert no_think.endswith("<think></think>")


def test_earlier_reasoning_is_dropped_when_history_is_rendered(kimi_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kimi_target)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
                {"role": "user", "content": "c"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<think></think>b<|im_end|>" in text and ">r<" not in text


def test_template_renders_like_kimi_k25s_history_tool_chain_results_declarations_and_parts(kimi_target):
    """The behaviours of Kimi-K2.5's real template that decide a training row (KNOWLEDGE.md)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kimi_target)
    tools = [{"type": "function", "function": {"name": "f"}}]
    call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "u1"}, {"type": "text", "text": "+"}]},
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2", "reasoning_content": "r2", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "functions.f:0", "name": "f", "content": "out"},
                {"role": "assistant", "content": "", "reasoning_content": "r3", "tool_calls": [call]}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools) + "<|im_end|><|im_system|>system")
    assert "<|im_user|>user<|im_middle|>u1+<|im_end|>" in text  # text parts joined
    # up to and including the last assistant turn without tool calls: history, reasoning dropped
    assert "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>" in text
    # the tool-call chain after it keeps its reasoning; calls follow the content
    section = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
               '{"x": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    assert f"<think>r2</think>a2{section}" in text and text.endswith(f"<think>r3</think>{section}")
    assert "<|im_system|>f<|im_middle|>## Return of functions.f:0\nout<|im_end|>" in text
    # a final plain answer moves the history boundary to it: every reasoning dropped
    final = tokenizer.apply_chat_template(messages + [{"role": "tool", "tool_call_id": "functions.f:0", "content": "o"},
                                                      {"role": "assistant", "content": "done", "reasoning_content": "r4"}],
                                          tools=tools, tokenize=False)
    assert not any(f"r{k}" in final for k in range(1, 5)) and "<|im_system|>tool<|im_middle|>## Return of" in final


def test_miniature_is_deterministic_and_cached(tmp_path, kimi_target):
    again = build_miniature(kimi_target.parent.parent)
    assert again["kimi"] == kimi_target
    assert kimi_target.parent.name == f"miniature-{miniature_key()}"


def test_llama_miniature_is_a_plain_causal_lm(llama_target):
    info = load_target_info(llama_target)
    assert info.model_type == "llama" and not info.is_multimodal_wrapper and info.weight_prefix == ""
    assert info.num_layers == 6


def test_kimi_width_target_writes_kimi_k25s_bytes_per_token_with_the_miniatures_shape(kimi_target):
    """The extraction bench's byte-bound target: Kimi-K2.5's hidden size (57,344 B per token in bf16, 4 slots), the
    miniature's wrapper, MLA and MoE, its tokenizer; few layers, so the forward stays cheap."""
    from eagle3_pipeline.hidden_states import StateFormat
    from eagle3_pipeline.miniature import build_kimi_width
    from eagle3_pipeline.target import extraction_layer_ids

    wide = build_kimi_width(kimi_target.parent.parent)
    assert build_kimi_width(kimi_target.parent.parent) == wide  # cached
    info = load_target_info(wide)
    assert info.model_type == "kimi_k25" and info.text_model_type == "deepseek_v3" and info.weight_prefix == "language_model."
    assert info.hidden_size == 7168 and len(extraction_layer_ids(info.num_layers, None)) == 4
    assert StateFormat().bytes_per_token(info.hidden_size) == 57_344
    mini, text = load_target_info(kimi_target).text_config, info.text_config
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576 and text["topk_method"] == "noaux_tc"
    assert {k: text[k] for k in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace")} == \
        {k: mini[k] for k in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace")}
    assert (wide / "tokenizer.json").read_bytes() == (kimi_target / "tokenizer.json").read_bytes()
    assert json.loads((wide / "config.json").read_text())["architectures"] == ["KimiK25ForConditionalGeneration"]
