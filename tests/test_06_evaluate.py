"""Stage 06: a draft's acceptance in vLLM and the verdict that catches the silent faults.

End to end on the Llama miniature with vLLM's CPU build (it cannot serve EAGLE-3 on the MLA miniature): one
pipeline run (01-05) gives a real draft, and from it two broken ones as users meet them: the same draft with
its d2t scrambled (a lost or regenerated mapping), and a draft trained on all-zero hidden states (the
extraction bug of vLLM #46301; stage 04's input checks switched off to train it). One engine pair for the real
draft, one engine each for the broken ones (--no-baseline). Then fast tests of the verdict, the self-checks,
the per-position arithmetic, the prompt file and the report, which start no engine.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.errors import InputError, PreflightError
from eagle3_pipeline.eval_prompts import read_prompt_rows, render_prompts
from eagle3_pipeline.eval_report import build_report, format_report, write_plot
from eagle3_pipeline.evaluate import summarize_spec_decode
from eagle3_pipeline.verdict import (
    OK,
    PROBLEM,
    UNCHECKED,
    Finding,
    check_d2t,
    check_layer_ids,
    check_method,
    check_template,
    verdict,
)

from conftest import REPO, run_pipeline, run_stage

DEFAULT_PROMPTS = REPO / "eagle3-train" / "samples" / "eval_prompts.jsonl"
CATEGORIES = {"chat", "code", "maths", "tool call", "multi-turn"}


# --- the pipeline's draft, and two broken ones made from it -----------------------------------------

@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, llama_target) -> dict[str, Path]:
    """Stages 01-05 on the Llama miniature (cpu-mini profile)."""
    return run_pipeline(tmp_path_factory.mktemp("llama-run"), llama_target)


@pytest.fixture(scope="module")
def scrambled_draft(llama_run, tmp_path_factory) -> Path:
    """The real draft with its d2t permuted: every draft token now names another target token."""
    draft = tmp_path_factory.mktemp("scrambled") / "draft"
    shutil.copytree(llama_run["draft"], draft)
    weights = load_file(str(draft / "model.safetensors"))
    d2t = weights["d2t"]
    targets = torch.arange(len(d2t)) + d2t
    shuffled = targets[torch.randperm(len(d2t), generator=torch.Generator().manual_seed(0))]
    weights["d2t"] = shuffled - torch.arange(len(d2t))
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return draft


@pytest.fixture(scope="module")
def zero_states_draft(llama_run, llama_target, tmp_path_factory) -> Path:
    """Stages 04-05 on the same rows with every hidden state zero (stage 04's input checks, which refuse them, off)."""
    work = tmp_path_factory.mktemp("zero-states")
    data = work / "data"
    shutil.copytree(llama_run["data"], data)
    for path in sorted((data / "hidden_states").glob("hs_*.safetensors")):
        tensors = load_file(str(path))
        tensors["hidden_states"] = torch.zeros_like(tensors["hidden_states"])
        save_file(tensors, str(path))
    run_stage("train", "--profile", "cpu-mini", "--target", llama_target, "--data", data, "--vocab", llama_run["vocab"],
              "--output", work / "checkpoints", "--logger", "", env={"EAGLE3_INPUT_CHECKS": "off"})
    run_stage("export", "--profile", "cpu-mini", "--checkpoints", work / "checkpoints", "--output", work / "draft")
    return work / "draft"


def evaluate(draft: Path, out: Path, *flags: str, check: bool = True):
    return run_stage("evaluate", "--profile", "cpu-mini", "--draft", draft, "--output", out, *flags, check=check)


def last_error(result) -> str:
    return result.stderr.strip().splitlines()[-1]


# --- end to end in vLLM (CPU) -----------------------------------------------------------------------

@pytest.mark.vllm
def test_a_draft_trained_by_the_pipeline_passes_and_reports_tau_per_position_and_category(llama_run, tmp_path):
    out = tmp_path / "eval"
    result = evaluate(llama_run["draft"], out)
    report = json.loads((out / "report.json").read_text())
    spec = report["spec_decode"]
    assert spec["mean_acceptance_length"] > 1.05 and report["verdict"]["passed"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    rates = spec["acceptance_rate_per_pos"]
    assert len(rates) == report["num_speculative_tokens"] == 3  # k from stage 05 (draft_config.json)
    assert rates == sorted(rates, reverse=True) and len(spec["acceptance_rate_per_pos_stderr"]) == 3
    assert set(report["by_category"]) == CATEGORIES
    assert sum(row["num_prompts"] for row in report["by_category"].values()) == report["prompts"]["count"] == 10
    assert report["tokens_per_s"] > 0 and report["baseline_tokens_per_s"] > 0
    assert report["agreement_with_baseline"]["identical_fraction"] == 1.0  # greedy fp32: the draft changes no output
    assert report["tensor_parallel_size"] == 1 and report["chat_template_kwargs"] == {}  # stage 05's TP, stage 01's kwargs
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    screen = (out / "report.txt").read_text()
    assert screen.strip() in result.stdout and len(screen.splitlines()) <= 25 and "verdict: ok" in screen
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "evaluate" and manifest["complete"] and manifest["verdict"]["passed"]
    assert manifest["mean_acceptance_length"] == spec["mean_acceptance_length"]
    # the same command again is a no-op: the report again, no engine
    started = time.monotonic()
    again = evaluate(llama_run["draft"], out)
    assert "already evaluated" in again.stderr and "vllm:" not in again.stderr and time.monotonic() - started < 60
    assert screen.strip() in again.stdout


@pytest.mark.vllm
def test_a_draft_whose_d2t_was_scrambled_fails_naming_d2t(scrambled_draft, tmp_path):
    out = tmp_path / "eval"
    result = evaluate(scrambled_draft, out, "--no-baseline", check=False)
    assert result.returncode == 6, result.stderr[-3000:]
    line = last_error(result)
    assert line.startswith("error: verdict: FAIL: tau 1.0") and "likely cause: d2t: the draft's d2t differs from stage 03's" in line
    report = json.loads((out / "report.json").read_text())
    assert {f["check"]: f["status"] for f in report["verdict"]["findings"]} == {
        "layer ids": OK, "d2t": PROBLEM, "method": OK, "template": OK}
    assert report["baseline_tokens_per_s"] is None and not json.loads((out / "manifest.json").read_text())["verdict"]["passed"]


@pytest.mark.vllm
def test_a_draft_trained_on_zero_hidden_states_fails_and_names_what_is_left(zero_states_draft, tmp_path):
    result = evaluate(zero_states_draft, tmp_path / "eval", "--no-baseline", check=False)
    assert result.returncode == 6, result.stderr[-3000:]
    line = last_error(result)
    assert line.startswith("error: verdict: FAIL: tau 1.0")
    assert "checked and as trained: layer ids, d2t, method, template" in line and "hidden states" in line


def test_check_writes_nothing_and_says_what_can_run(llama_run, tmp_path):
    out = tmp_path / "eval"
    result = evaluate(llama_run["draft"], out, "--check")
    assert result.stdout.strip().splitlines()[-1] == (
        "06 --check: ran the self-checks (layer ids ok; d2t ok; method ok; template ok) and rendered 10 prompts; "
        "tau in vLLM can run here")
    assert not out.exists()


def test_another_target_is_refused_in_one_line(llama_run, kimi_target, tmp_path):
    result = evaluate(llama_run["draft"], tmp_path / "eval", "--target", kimi_target, "--check", check=False)
    assert result.returncode == 3
    assert last_error(result) == (f"error: {kimi_target.resolve() / 'config.json'}: not the target {llama_run['draft']} "
                                  f"was trained for (its config differs from the one {llama_run['draft'] / 'manifest.json'} "
                                  f"records); pass --target with that model")


def test_a_missing_export_is_one_line_naming_it(tmp_path):
    result = evaluate(tmp_path / "no-draft", tmp_path / "eval", "--check", check=False)
    assert result.returncode == 3
    assert last_error(result) == f"error: {tmp_path / 'no-draft'}: no such directory (--draft); run 05_export.py first"


def test_an_mla_target_on_the_cpu_is_refused_before_an_engine_starts(kimi_target):
    from eagle3_pipeline.preflight import preflight_evaluate
    from eagle3_pipeline.target import load_target_info

    with pytest.raises(PreflightError, match="cannot serve EAGLE-3 with an MLA target"):
        preflight_evaluate(load_target_info(kimi_target), 1)
    with pytest.raises(PreflightError, match="--tensor-parallel-size 1"):
        preflight_evaluate(load_target_info(kimi_target), 8)


# --- the verdict -------------------------------------------------------------------------------------

def _spec(drafts: int, per_pos: list[int]) -> dict:
    return summarize_spec_decode({"num_drafts": drafts, "num_draft_tokens": drafts * len(per_pos),
                                  "num_accepted_tokens": sum(per_pos), "accepted_per_pos": per_pos})


ALL_OK = [Finding("layer ids", OK, "fine"), Finding("d2t", OK, "fine"), Finding("method", OK, "fine"),
          Finding("template", OK, "fine")]


def test_a_draft_above_both_floors_passes():
    judged = verdict(_spec(100, [60, 40, 20]), ALL_OK, 1.05, 0.05)
    assert judged["passed"] and judged["line"] == "verdict: ok: tau 2.200 ± 0.117, position-1 acceptance 60.0%"


def test_a_failing_draft_names_the_failed_checks():
    findings = [*ALL_OK[:1], Finding("d2t", PROBLEM, "differs from stage 03's"), *ALL_OK[2:]]
    judged = verdict(_spec(100, [1, 0, 0]), findings, 1.05, 0.05)
    assert not judged["passed"]
    assert judged["line"].endswith("(tau <= 1.05, position-1 acceptance < 5%); likely cause: d2t: differs from stage 03's")


def test_a_failing_draft_whose_checks_pass_names_what_cannot_be_checked():
    findings = [*ALL_OK[:3], Finding("template", UNCHECKED, "why")]
    line = verdict(_spec(100, [0, 0, 0]), findings, 1.05, 0.05)["line"]
    assert "checked and as trained: layer ids, d2t, method; not checked: template (why)" in line
    assert "so likely the hidden states it was trained on" in line and "too little training" in line


def test_the_first_position_floor_fails_a_draft_whose_tau_clears_min_tau():
    # tau 1.12 > 1.05, but position 1 accepts only 4%: a draft that is nearly never right
    judged = verdict(_spec(100, [4, 4, 4]), ALL_OK, 1.05, 0.05)
    assert not judged["passed"] and "(position-1 acceptance < 5%)" in judged["line"] and "tau <= " not in judged["line"]


def test_per_position_acceptance_is_the_share_of_drafts_with_their_standard_errors():
    spec = _spec(200, [100, 50, 20])
    assert spec["acceptance_rate_per_pos"] == pytest.approx([0.5, 0.25, 0.1])
    assert spec["acceptance_rate_per_pos_stderr"] == pytest.approx([(p * (1 - p) / 200) ** 0.5 for p in (0.5, 0.25, 0.1)])
    assert spec["mean_acceptance_length"] == pytest.approx(1.85)


# --- the self-checks ---------------------------------------------------------------------------------

def test_layer_ids_outside_the_target_or_not_as_trained_are_problems():
    assert check_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, 6, [2, 3, 4]).status == OK
    assert "not inside the target's 6 layers" in check_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 3, 6]}, 6, None).detail
    shifted = check_layer_ids({"eagle_aux_hidden_state_layer_ids": [3, 4, 5]}, 6, [2, 3, 4])
    assert shifted.status == PROBLEM and "stage 04 trained on [2, 3, 4]" in shifted.detail
    assert check_layer_ids({}, 6, [2, 3, 4]).status == PROBLEM


def test_d2t_missing_different_or_unchecked():
    d2t = np.array([0, 5, 5, 7])
    assert check_d2t(d2t.copy(), d2t, "v/d2t.npy").status == OK
    differs = check_d2t(np.array([0, 5, 6, 7]), d2t, "v/d2t.npy")
    assert differs.status == PROBLEM and "at 1 of 4 entries" in differs.detail
    assert "shape [3]" in check_d2t(d2t[:3], d2t, "v/d2t.npy").detail
    assert "has no d2t" in check_d2t(None, d2t, "v/d2t.npy").detail
    assert check_d2t(None, np.zeros(4, dtype=int), "v/d2t.npy").status == OK  # draft vocab = target vocab
    assert check_d2t(d2t, None, "v/d2t.npy").status == UNCHECKED


def test_method_and_template_mismatches_are_problems():
    assert check_method({"speculators_model_type": "eagle3"}, "eagle3").status == OK
    assert check_method({"speculators_model_type": "eagle"}, "eagle3").status == PROBLEM
    assert check_template({}, {}, "a", "a").status == OK
    thinking = check_template({"thinking": False}, {"thinking": True}, "a", "a")
    assert thinking.status == PROBLEM and "stage 01 trained with {'thinking': True}" in thinking.detail
    assert "changed since stage 01" in check_template({}, {}, "b", "a").detail


# --- prompts and report -------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "problem"), [
    ("{not json", "not JSON"),
    ('["a list"]', "not a JSON object"),
    ('{"category": "x"}', "no `messages` list"),
    ('{"messages": [{"content": "hi"}]}', "messages[0] has no `role`"),
    ('{"messages": [{"role": "user", "content": "hi"}], "category": 3}', "`category` must be a non-empty string"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}', "must end with a user"),
])
def test_a_bad_prompt_row_is_one_line_naming_the_file_and_the_row(tmp_path, line, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n\n' + line + "\n")
    with pytest.raises(InputError) as info:
        read_prompt_rows(path)
    assert str(info.value).startswith(f"{path}: row 3: ") and problem in str(info.value)


def test_the_default_prompts_render_with_stage_01s_tokenizer_without_their_reference_answers(llama_target):
    from eagle3_pipeline.chat_rows import ChatTokenizer

    chat = ChatTokenizer(str(llama_target))
    prompts = render_prompts(DEFAULT_PROMPTS, chat, 4096, 32)
    assert {p.category for p in prompts} == CATEGORIES and len(prompts) == 10
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()]
    for prompt, row in zip(prompts, rows):  # each ends with the generation prompt, as vLLM's chat endpoint sends it
        assert prompt.token_ids == chat.encode(row["messages"], add_generation_prompt=True, tools=row.get("tools"))
    answered = DEFAULT_PROMPTS.parent / "conversations.jsonl"  # full conversations: the last answer is dropped
    first = json.loads(answered.read_text().splitlines()[0])["messages"]
    assert render_prompts(answered, chat, 4096, 32, max_prompts=1)[0].token_ids == chat.encode(
        first[:-1], add_generation_prompt=True)
    with pytest.raises(InputError, match=r"row 1: \d+ prompt tokens \+ --max-tokens 32 exceed --max-model-len 40"):
        render_prompts(DEFAULT_PROMPTS, chat, 40, 32)


def test_the_report_fits_one_screen_and_draws_its_png(tmp_path):
    spec = _spec(100, [60, 40, 20])
    groups = {"chat": {"num_prompts": 2, "generated_tokens": 64, "generate_s": 1.0, "tokens_per_s": 64.0, "spec_decode": spec},
              "code": {"num_prompts": 1, "generated_tokens": 32, "generate_s": 1.0, "tokens_per_s": 32.0, "spec_decode": None}}
    run = {"spec_decode": spec, "tokens_per_s": 96.0, "by_group": groups, "speedup_tokens_per_s": 1.5,
           "agreement_with_baseline": {"identical_fraction": 1.0}, "repeated_4gram_fraction": 0.1, "engine_start_s": 20.0}
    baseline = {"tokens_per_s": 64.0, "engine_start_s": 19.0,
                "by_group": {"chat": {"tokens_per_s": 40.0}, "code": {"tokens_per_s": 24.0}}}
    measured = {"settings": {"temperature": 0.0, "max_tokens": 32}, "baseline": baseline, "runs": {"draft-k3": run}}
    report = build_report(measured, draft="/d", target="/t", k=3, tensor_parallel_size=1, prompts_file="/p.jsonl",
                          categories=["chat", "chat", "code"], template_kwargs={},
                          verdict=verdict(spec, ALL_OK, 1.05, 0.05))
    assert report["prompts"]["categories"] == {"chat": 2, "code": 1}
    assert report["by_category"]["code"]["mean_acceptance_length"] is None  # a category that verified no draft
    text = format_report(report)
    assert len(text.splitlines()) <= 25 and max(map(len, text.splitlines())) <= 160
    assert "tau (mean acceptance length, 1 + accepted/drafts): 2.200 ± 0.117 over 100 drafts" in text
    assert "1: 60.0% ± 4.9%" in text and "x1.50" in text and text.endswith(report["verdict"]["line"])
    assert write_plot(report, tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_on_the_mla_miniature_check_says_in_one_line_what_ran_and_what_is_skipped(kimi_run, tmp_path):
    # what `make smoke` prints after the five stages: vLLM's CPU build cannot serve EAGLE-3 on an MLA target
    result = evaluate(kimi_run["draft"], tmp_path / "eval", "--check", check=False)
    assert result.returncode == 5
    assert result.stdout.strip().splitlines()[-1] == (
        "06 --check: ran the self-checks (layer ids ok; d2t ok; method ok; template ok) and rendered 10 prompts; "
        "tau in vLLM skipped: vLLM's CPU build cannot serve EAGLE-3 with an MLA target (\"No common block size for "
        "16\"): measure it on a GPU box; on a CPU stage 06 measures Llama-style targets")
    assert not (tmp_path / "eval").exists()
