"""Stage 06: a draft's acceptance in vLLM and the verdict that catches the silent faults.

End to end on the Llama miniature with vLLM's CPU build (it cannot serve EAGLE-3 on the MLA miniature): one
pipeline run (01-05, conftest.llama_run) gives a real draft, and from it two broken ones as users meet them: the same draft with
its d2t scrambled (a lost or regenerated mapping), and a draft trained on all-zero hidden states (the
extraction bug of vLLM #46301; stage 04's input checks switched off to train it). One engine pair for the real
draft, one engine each for the broken ones (--no-baseline). Then fast tests of the verdict, the self-checks,
the per-position arithmetic, the prompt file and the report, which start no engine. Issue 46: what a user can
hand 06 that vLLM cannot serve (a half-written draft, another target's weights, another method, a --max-model-len
above the target's) is refused in one line before any engine starts; an engine that still fails is one line
quoting vLLM; a killed 06 takes its engine with it; a finished report cut short is measured again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_reliability_bad_input import recorded_by_02

from eagle3_pipeline.conversations import to_messages
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
    check_weights,
    verdict,
)

from conftest import LLAMA_EVAL_FLAGS, REPO, SCRIPTS, run_stage

DEFAULT_PROMPTS = REPO / "eagle3-train" / "samples" / "eval_prompts.jsonl"
CATEGORIES = {"chat", "code", "maths", "tool call", "multi-turn"}


# --- the pipeline's draft, and two broken ones made from it -----------------------------------------

def rerecord(draft: Path) -> None:
    """A draft changed on purpose, recorded in its manifest as 05 would have written it (06 refuses a draft whose
    files differ from 05's record, issue 64 O): the broken drafts below stand for drafts 05 itself wrote that way."""
    from eagle3_pipeline.files import output_record

    manifest = json.loads((draft / "manifest.json").read_text())
    manifest["output_files"] = output_record(draft, manifest["output_files"])
    (draft / "manifest.json").write_text(json.dumps(manifest, indent=2))


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
    rerecord(draft)
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
    recorded_by_02(data / "hidden_states")  # as 02's own bytes (a broken extraction): else 04 refuses them as changed
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
    config = json.loads((llama_run["draft"] / "config.json").read_text())
    weights = load_file(str(llama_run["draft"] / "model.safetensors"))
    assert config["fc_norm"] and not config["norm_before_fc"]  # draft_config.json's default: EAGLE 3.1's norms
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(weights) and "input_norm.weight" not in weights
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
        "layer ids": OK, "d2t": PROBLEM, "method": OK, "template": OK, "weights": OK}
    assert report["baseline_tokens_per_s"] is None and not json.loads((out / "manifest.json").read_text())["verdict"]["passed"]


@pytest.mark.vllm
def test_vllm_applies_the_drafts_fc_norm_weights(llama_run, tmp_path):
    """The same draft with its per-layer fc norms zeroed (shapes unchanged, so every self-check passes): if vLLM
    built norms of weight 1 instead of loading the trained ones, or skipped them, this draft would still pass as the
    real one does (test above); loaded and applied, the fc sees zeros and the draft accepts nothing."""
    draft = copy_draft(llama_run, tmp_path)
    weights = load_file(str(draft / "model.safetensors"))
    norms = [name for name in weights if name.startswith("fc_norm.")]
    assert len(norms) == 3
    weights.update({name: torch.zeros_like(weights[name]) for name in norms})
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    rerecord(draft)
    out = tmp_path / "eval"
    result = evaluate(draft, out, "--no-baseline", check=False)
    assert result.returncode == 6, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert not report["verdict"]["passed"] and report["spec_decode"]["mean_acceptance_length"] <= 1.05
    assert {f["status"] for f in report["verdict"]["findings"]} == {OK}  # nothing but the norms differs


@pytest.mark.vllm
def test_a_draft_trained_on_zero_hidden_states_fails_and_names_what_is_left(zero_states_draft, tmp_path):
    result = evaluate(zero_states_draft, tmp_path / "eval", "--no-baseline", check=False)
    assert result.returncode == 6, result.stderr[-3000:]
    line = last_error(result)
    assert line.startswith("error: verdict: FAIL: tau 1.0")
    assert "checked and as trained: layer ids, d2t, method, template, weights" in line and "hidden states" in line


def test_check_writes_nothing_and_says_what_can_run(llama_run, tmp_path):
    out = tmp_path / "eval"
    result = evaluate(llama_run["draft"], out, "--check")
    assert result.stdout.strip().splitlines()[-1] == (
        "06 --check: ran the self-checks (layer ids ok; d2t ok; method ok; template ok; weights ok) and rendered 10 "
        "prompts; tau in vLLM can run here")
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


# --- what vLLM cannot serve, refused before any engine (issue 46) -------------------------------------

def copy_draft(llama_run, tmp_path) -> Path:
    draft = tmp_path / "draft"
    shutil.copytree(llama_run["draft"], draft)
    return draft


def cut_short(path: Path) -> None:
    os.truncate(path, min(100, path.stat().st_size // 2))


def widen(draft: Path) -> None:
    """The weights of a draft trained for a target twice as wide, copied over this draft's (its config stays)."""
    hidden = json.loads((draft / "config.json").read_text())["transformer_layer_config"]["hidden_size"]
    weights = load_file(str(draft / "model.safetensors"))
    save_file({name: torch.zeros([2 * d if d == hidden else d for d in t.shape], dtype=t.dtype)
               if t.is_floating_point() else t for name, t in weights.items()},
              str(draft / "model.safetensors"), metadata={"format": "pt"})


def set_method(draft: Path, model_type: str) -> None:
    config = json.loads((draft / "config.json").read_text())
    config["speculators_model_type"] = model_type
    (draft / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("damage", ["model.safetensors cut short", "model.safetensors deleted", "config.json cut short"])
def test_a_half_written_draft_is_one_line_naming_the_file(llama_run, tmp_path, damage):
    """Before: a SafetensorError / FileNotFoundError / JSONDecodeError traceback."""
    draft = copy_draft(llama_run, tmp_path)
    name, how = damage.split(" ", 1)
    (draft / name).unlink() if how == "deleted" else cut_short(draft / name)
    out = tmp_path / "eval"
    result = evaluate(draft, out, check=False)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = last_error(result)
    assert line.startswith(f"error: {draft / name}: ") and line.endswith("export it again (05_export.py)"), line
    assert not out.exists()


def drop_fc_norm(draft: Path) -> None:
    """The weights without their per-layer fc norms (a draft trained before EAGLE 3.1's norms), under a config
    that still says fc_norm."""
    weights = load_file(str(draft / "model.safetensors"))
    save_file({name: t for name, t in weights.items() if not name.startswith("fc_norm.")},
              str(draft / "model.safetensors"), metadata={"format": "pt"})


def set_config(draft: Path, **keys) -> None:
    config = json.loads((draft / "config.json").read_text())
    config.update(keys)
    (draft / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize("case", ["weights of a wider target's draft", "method eagle", "--max-model-len 8192",
                                  "fc_norm config without its weights", "fc_norm weights without the config",
                                  "num_hidden_layers 2 over one layer's weights"])
def test_a_draft_or_setting_vllm_cannot_serve_is_refused_before_an_engine_starts(llama_run, llama_target, tmp_path,
                                                                                  case):
    """Before: `--check` said "tau in vLLM can run here" (the method self-check found its problem and the engine
    was started anyway), then the engine's traceback."""
    draft, flags = copy_draft(llama_run, tmp_path), []
    if case.startswith("weights"):
        widen(draft)
        expected = (3, f"error: {draft / 'model.safetensors'}: vLLM cannot serve this draft (weights: the draft's "
                       f"weights do not fit its config and the target: fc.weight [512, 768], its config and the target "
                       f"say [256, 768]")
    elif case.startswith("fc_norm"):
        drop_fc_norm(draft) if case.endswith("without its weights") else set_config(draft, fc_norm=False)
        found = ("config.json says fc_norm but the weights have no fc_norm.0.weight, fc_norm.1.weight, "
                 "fc_norm.2.weight" if case.endswith("without its weights") else
                 "the weights hold fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight but config.json has no fc_norm")
        expected = (3, f"error: {draft / 'model.safetensors'}: vLLM cannot serve this draft (weights: the draft's "
                       f"weights do not fit its config and the target: {found} (a config edited apart from its "
                       f"weights?)")
    elif case.startswith("method"):
        set_method(draft, "eagle")  # issue 64: exit 6, the verdict's code (it exited 3)
        expected = (6, f"error: {draft / 'config.json'}: vLLM cannot serve this draft (method: draft config "
                       f"speculators_model_type 'eagle', served with method 'eagle3'")
    elif case.startswith("num_hidden_layers"):  # issue 64 Q: before, --check said "can run here", vLLM then failed
        config = json.loads((draft / "config.json").read_text())
        config["transformer_layer_config"]["num_hidden_layers"] = 2
        (draft / "config.json").write_text(json.dumps(config, indent=2))
        expected = (3, f"error: {draft / 'model.safetensors'}: vLLM cannot serve this draft (weights: the draft's "
                       f"weights do not fit its config and the target: config.json says num_hidden_layers 2, the "
                       f"weights hold 1 decoder layer (layers.0) (a config edited apart from its weights?)")
    else:
        flags = case.split()  # what 06's own long-prompt refusal advised ("raise --max-model-len")
        expected = (2, f"error: --max-model-len 8192: above the target's limit of 4096 tokens "
                       f"({llama_target.resolve() / 'config.json'}); vLLM refuses it: pass at most 4096")
    rerecord(draft)  # as if 05 had written it so: the self-checks, not the digest record, must refuse it
    out = tmp_path / "eval"
    checked = evaluate(draft, out, *flags, "--check", check=False)
    assert checked.returncode == expected[0] and last_error(checked).startswith(expected[1]), checked.stderr[-3000:]
    assert "can run here" not in checked.stdout
    if not flags:
        assert checked.stdout.strip().splitlines()[-1].endswith("tau in vLLM not measured: vLLM cannot serve this draft")
    result = evaluate(draft, out, *flags, check=False)
    assert result.returncode == expected[0] and last_error(result).startswith(expected[1])
    assert "Traceback" not in result.stderr and "vllm:" not in result.stderr and not out.exists()  # no engine


def flip_one_byte(path: Path) -> None:
    """One byte near the end (tensor data, not the header): same size, other bytes."""
    with open(path, "r+b") as handle:
        handle.seek(-3, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-3, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_draft_file_changed_since_05_wrote_it_is_refused_in_one_line(llama_run, tmp_path, name):
    """Issue 64 O. Before: one byte of model.safetensors changed, `--check` said all was well and the run measured
    it to "verdict: ok", exit 0. Now 06 checks the draft's files against 05's size/digest record, run and --check."""
    draft = copy_draft(llama_run, tmp_path)
    if name == "config.json":  # a value changed, the JSON still valid (a hand edit)
        set_config(draft, sliding_window=1024)
    else:
        flip_one_byte(draft / name)
    out = tmp_path / "eval"
    for flags in (("--check",), ()):
        result = evaluate(draft, out, *flags, check=False)
        assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert last_error(result).startswith(f"error: {draft / name}: ") and "since 05_export.py wrote it; rerun " \
            "05_export.py" in last_error(result), last_error(result)
        assert "can run here" not in result.stdout and "vllm:" not in result.stderr and not out.exists()


def test_a_refused_evaluation_leaves_no_empty_output(kimi_run, tmp_path):
    """Issue 64: a 06 refused after taking its lock (here: vLLM's CPU build and an MLA target) left an empty
    --output (its lock file only) behind."""
    out = tmp_path / "eval"
    result = evaluate(kimi_run["draft"], out, check=False)
    assert result.returncode == 5 and not out.exists(), result.stderr[-2000:]


def test_an_export_running_on_the_draft_stops_06_in_one_line(llama_run, tmp_path):
    """Issue 64: 06 took no lock on --draft, so 05 could re-export it mid-measurement. 06 now holds 05's lock
    shared: while 05 holds it (simulated: this process holds it exclusively), 06 stops with exit 75."""
    from eagle3_pipeline.export import lock_file_for
    from eagle3_pipeline.files import hold_lock, release_locks

    draft = copy_draft(llama_run, tmp_path)
    hold_lock(lock_file_for(draft), exclusive=True)
    try:
        result = evaluate(draft, tmp_path / "eval", check=False)
    finally:
        release_locks()
    assert result.returncode == 75, result.stderr[-2000:]
    assert last_error(result).startswith(f"error: {draft}: 05_export.py is writing this draft now")


def test_k_above_the_trained_ttt_steps_is_noted(llama_run, tmp_path):
    """Issue 64: a draft served at k above its TTT steps passed 05/06 with no note."""
    result = evaluate(llama_run["draft"], tmp_path / "eval", "--check", "--num-speculative-tokens", "5")
    assert "note: served at k=5 draft tokens per step, above the 3 TTT steps it was trained with" in result.stderr


@pytest.mark.parametrize("inside", ["draft", "vocab"])
def test_an_output_inside_an_inputs_folder_is_refused(llama_run, tmp_path, inside):
    """Before: accepted; a later `05 --overwrite` (or 03's) deleted the report with the folder."""
    out = llama_run[inside] / "eval"
    result = evaluate(llama_run["draft"], out, "--check", check=False)
    assert result.returncode == 2 and not out.exists()
    flag, stage = {"draft": ("--draft", "05"), "vocab": ("--vocab", "03")}[inside]
    assert last_error(result) == (
        f"error: {out}: --output is inside stage {stage}'s output {llama_run[inside].resolve()} ({flag}); rerunning "
        f"that stage with --overwrite would delete the report with it: choose an --output outside it (nothing was "
        f"written)")


def test_help_names_the_exit_code_a_failing_verdict_has():
    result = run_stage("evaluate", "--help")
    text = " ".join(result.stdout.split())
    assert "fails (exit 6)" in text and "(exit 1)" not in text


@pytest.mark.vllm
def test_an_engine_that_refuses_is_one_line_quoting_vllms_reason_and_its_log(llama_run, tmp_path):
    """Before: `RuntimeError: vLLM engine ... exited 1; see ...` with a traceback and no reason. (A --dtype vLLM does
    not know: the checks before the engine leave it to vLLM, so the engine itself refuses.)"""
    out = tmp_path / "eval"
    result = evaluate(llama_run["draft"], out, "--no-baseline", "--dtype", "float8", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = last_error(result)
    assert line.startswith(f"error: vLLM's engine (draft {llama_run['draft'].resolve()}, k=3) exited 1: ValidationError: ")
    assert "Input should be 'auto'" in line and line.endswith(f"; see {out / 'logs' / 'vllm-draft-k3.log'}"), line


def test_an_engine_failure_reads_as_vllms_own_reason_not_its_wrappers():
    from eagle3_pipeline.evaluate import engine_failure_reason

    log = ("(EngineCore_DP0 pid=4242) Traceback (most recent call last):\n"
           "(EngineCore_DP0 pid=4242) ValueError: the draft's hidden size 512 differs from the target's 256\n"
           "Traceback (most recent call last):\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert engine_failure_reason(log) == "ValueError: the draft's hidden size 512 differs from the target's 256"
    assert engine_failure_reason("INFO started\nKilled\n") is None


def test_vllms_memory_profiling_failure_on_a_shared_gpu_names_the_remedy_and_the_flag_fixes_the_kv_cache():
    """The H200 hold of 2026-12-05: 06 started beside another job's engines and vLLM stopped in its memory profiling
    (these lines are that log's); the one-line error now says what to do, and --kv-cache-memory-gib (02 and 06 alike)
    gives vLLM a fixed KV cache, which it does not size by profiling."""
    from eagle3_pipeline.config import EvaluateConfig
    from eagle3_pipeline.evaluate import engine_failure_reason, failure_remedy, gpu_memory_args

    log = ("(EngineCore pid=6938) AssertionError: Error in memory profiling. Initial free memory 115.98 GiB, current "
           "free memory 118.51 GiB. This happens when other processes sharing the same container release GPU memory "
           "while vLLM is profiling during initialization. To fix this, ensure consistent GPU memory allocation or "
           "isolate vLLM in its own container.\nTraceback (most recent call last):\n    raise RuntimeError(\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    reason = engine_failure_reason(log)
    assert reason.startswith("AssertionError: Error in memory profiling. Initial free memory 115.98 GiB")
    assert "--kv-cache-memory-gib" in failure_remedy(reason) and failure_remedy("ValueError: other") is None
    assert gpu_memory_args(0.15, None) == {"gpu_memory_utilization": 0.15}
    assert gpu_memory_args(0.9, 4) == {"gpu_memory_utilization": 0.9, "kv_cache_memory_bytes": 4 * 2**30}
    assert EvaluateConfig.model_fields["kv_cache_memory_gib"].default is None


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _descendants(pid: int) -> list[int]:
    parents = {int(p.name): _parent_of(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


@pytest.mark.vllm
@pytest.mark.reliability
def test_a_killed_evaluation_takes_its_engine_with_it(llama_run, tmp_path):
    """Before: kill -9 of 06 left its vLLM engine running without the output's lock (a rerun started a second one
    beside it); the orphan went on to the end of its measurement. Now the engine dies with 06: it never finishes."""
    out = tmp_path / "eval"
    cmd = [sys.executable, str(SCRIPTS / "06_evaluate.py"), "--profile", "cpu-mini", "--draft", str(llama_run["draft"]),
           "--output", str(out), "--no-baseline"]
    with open(tmp_path / "06.log", "wb") as log:
        stage = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    engine: list[int] = []
    result_file = None
    try:
        # the engine is running once vLLM's engine-core process is up under it (a bound for a stuck start, not a timing)
        deadline = time.monotonic() + 600
        while not any("spawn_main" in _command_line(pid) for pid in engine):
            assert stage.poll() is None, (tmp_path / "06.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM's engine-core process never started"
            time.sleep(0.5)
            engine = _descendants(stage.pid)  # the engine's process and vLLM's processes under it
        args = next(_command_line(pid) for pid in engine if "--child" in _command_line(pid)).split("\0")
        result_file = Path(args[args.index("--child") + 2])  # where the engine writes its measurement at its end
        stage.send_signal(signal.SIGKILL)
        stage.wait()
        while [pid for pid in engine if _running(pid)]:  # gone, killed or (before the fix) done measuring
            assert time.monotonic() < deadline, f"engine processes outlived 06: {engine}"
            time.sleep(0.5)
        assert not result_file.exists(), "the engine measured on after 06 was killed"
        assert not result_file.parent.exists()  # nor is the killed 06's scratch folder (the request) left behind
    finally:  # on the code before the fix: end what this test started, by its pids, and the killed 06's temp folder
        if stage.poll() is None:
            stage.kill()
        for pid in engine:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if result_file is not None:
            shutil.rmtree(result_file.parent, ignore_errors=True)


@pytest.mark.vllm
def test_check_on_a_finished_report_cut_short_says_it_is_measured_again(llama_run, llama_eval, tmp_path):
    """Before: every rerun ended in a JSONDecodeError traceback. report.json is 06's own output: --check says the
    measurement can run (the run itself measuring again: tests/test_reliability_sweep_06.py)."""
    out = tmp_path / "eval"
    shutil.copytree(llama_eval, out)
    cut_short(out / "report.json")
    checked = evaluate(llama_run["draft"], out, *LLAMA_EVAL_FLAGS, "--check")
    assert "Traceback" not in checked.stderr and "tau in vLLM can run here" in checked.stdout


# --- the verdict -------------------------------------------------------------------------------------

def _spec(drafts: int, per_pos: list[int]) -> dict:
    return summarize_spec_decode({"num_drafts": drafts, "num_draft_tokens": drafts * len(per_pos),
                                  "num_accepted_tokens": sum(per_pos), "accepted_per_pos": per_pos})


ALL_OK = [Finding("layer ids", OK, "fine"), Finding("d2t", OK, "fine"), Finding("method", OK, "fine"),
          Finding("template", OK, "fine")]


def test_a_draft_above_both_floors_passes():
    judged = verdict(_spec(100, [60, 40, 20]), ALL_OK, 1.05, 0.05)
    assert judged["passed"] and judged["line"] == "verdict: ok: tau 2.200 ± 0.117, position-1 acceptance 60.0%"


def test_a_draft_not_served_as_trained_fails_above_the_floors_and_a_chosen_template_is_only_named():
    # the H200 case: aux layer ids one deeper than trained kept 98% of tau, above every floor
    shifted = [Finding("layer ids", PROBLEM, "aux layer ids [3, 4, 5] in the draft config, stage 04 trained on [2, 3, 4]"),
               *ALL_OK[1:]]
    judged = verdict(_spec(100, [60, 40, 20]), shifted, 1.05, 0.05)
    assert not judged["passed"]
    assert judged["line"].startswith("verdict: FAIL: tau 2.200")
    assert "not served as trained: layer ids: aux layer ids [3, 4, 5]" in judged["line"]
    thinking_off = [*ALL_OK[:3], Finding("template", PROBLEM, "prompts rendered with chat_template_kwargs {}")]
    judged = verdict(_spec(100, [60, 40, 20]), thinking_off, 1.05, 0.05)
    assert judged["passed"] and "(but template: prompts rendered" in judged["line"]


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


def draft_shapes(hidden: int = 8, vocab: int = 32, draft_vocab: int = 16, fc_norm: bool = True,
                 norm_before_fc: bool = False) -> tuple[dict, dict[str, list[int]]]:
    """A draft's config.json (the keys check_weights reads, as speculators saves them) and the tensor shapes
    speculators 0.9.0 saves for it: fc_norm.{i}.weight per aux layer, input_norm.weight over the concatenation."""
    config = {"transformer_layer_config": {"hidden_size": hidden, "vocab_size": vocab}, "draft_vocab_size": draft_vocab,
              "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "fc_norm": fc_norm, "norm_before_fc": norm_before_fc}
    shapes = {"fc.weight": [hidden, 3 * hidden], "lm_head.weight": [draft_vocab, hidden], "norm.weight": [hidden],
              "layers.0.self_attn.q_proj.weight": [hidden, 2 * hidden], "d2t": [draft_vocab], "t2d": [vocab]}
    if fc_norm:
        shapes.update({f"fc_norm.{i}.weight": [hidden] for i in range(3)})
    if norm_before_fc:
        shapes["input_norm.weight"] = [3 * hidden]
    return config, shapes


def test_the_weight_check_accepts_either_norm_before_fc_and_refuses_a_config_apart_from_its_weights():
    """Before: an fc_norm config over weights without fc_norm.* passed (vLLM then serves untrained norms of weight
    1), and fc_norm.* weights under a config without fc_norm passed (vLLM's loader stops with a traceback)."""
    for fc_norm, norm_before_fc in ((True, False), (False, True), (False, False)):
        config, shapes = draft_shapes(fc_norm=fc_norm, norm_before_fc=norm_before_fc)
        assert check_weights(config, shapes, 8, 32).status == OK, (fc_norm, norm_before_fc)
    config, shapes = draft_shapes()
    del shapes["fc_norm.2.weight"]
    missing = check_weights(config, shapes, 8, 32)
    assert missing.status == PROBLEM and missing.blocks and missing.file == "model.safetensors"
    assert "config.json says fc_norm but the weights have no fc_norm.2.weight" in missing.detail
    config, shapes = draft_shapes()
    shapes["fc_norm.1.weight"] = [16]
    assert "fc_norm.1.weight [16], its config and the target say [8]" in check_weights(config, shapes, 8, 32).detail
    config, shapes = draft_shapes()
    config["fc_norm"] = False
    assert "the weights hold fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight but config.json has no fc_norm" in (
        check_weights(config, shapes, 8, 32).detail)
    config, shapes = draft_shapes(fc_norm=False, norm_before_fc=True)
    config["norm_before_fc"] = False  # vLLM would drop the trained input_norm silently
    assert "the weights hold input_norm.weight but config.json has no norm_before_fc" in (
        check_weights(config, shapes, 8, 32).detail)
    config, shapes = draft_shapes(fc_norm=False, norm_before_fc=False)
    config["norm_before_fc"] = True
    edited = check_weights(config, shapes, 8, 32)
    assert edited.status == PROBLEM and edited.detail.endswith("(a config edited apart from its weights?)")


def test_the_weight_check_counts_the_decoder_layers_the_config_names():
    """Issue 64 Q: a config saying num_hidden_layers 2 over one layer's weights passed (vLLM then failed)."""
    config, shapes = draft_shapes()
    config["transformer_layer_config"]["num_hidden_layers"] = 1
    assert check_weights(config, shapes, 8, 32).status == OK
    config["transformer_layer_config"]["num_hidden_layers"] = 2
    found = check_weights(config, shapes, 8, 32)
    assert found.status == PROBLEM and found.blocks
    assert "config.json says num_hidden_layers 2, the weights hold 1 decoder layer (layers.0)" in found.detail
    shapes["layers.1.self_attn.q_proj.weight"] = [8, 16]
    assert check_weights(config, shapes, 8, 32).status == OK


def test_method_and_template_mismatches_are_problems():
    assert check_method({"speculators_model_type": "eagle3"}, "eagle3").status == OK
    assert check_method({"speculators_model_type": "eagle"}, "eagle3").status == PROBLEM
    assert check_template({}, {}, "a", "a").status == OK
    thinking = check_template({"thinking": False}, {"thinking": True}, "a", "a")
    assert thinking.status == PROBLEM and "stage 01 trained with {'thinking': True}" in thinking.detail
    assert "changed since stage 01" in check_template({}, {}, "b", "a").detail


# --- prompts and report -------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "problem"), [
    (b"{not json", "malformed JSON"),
    (b'["a list"]', "row is not a JSON object"),
    (b'{"category": "x"}', "row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)"),
    (b'{"messages": [{"content": "hi"}]}', "turn 0 has unknown role None"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "category": 3}', "`category` must be a non-empty string"),
    (b'{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}', "must end with a user"),
    # issue 46: a UnicodeDecodeError traceback before; and a role typo the template dropped without a word
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8 (byte 46)"),
    (b'{"messages": [{"role": "sytem", "content": "be brief"}, {"role": "user", "content": "hi"}]}',
     "turn 0 has unknown role 'sytem'"),
])
def test_a_bad_prompt_row_is_one_line_naming_the_file_and_the_row(tmp_path, line, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "fine"}]}\n\n' + line + b"\n")
    with pytest.raises(InputError) as info:
        read_prompt_rows(path)
    assert str(info.value).startswith(f"{path}:3: ") and problem in str(info.value)


def test_prompt_rows_are_read_by_stage_01s_rules_in_its_words(tmp_path):
    """Before (issue 46): 06 let `"sytem"` through, the template dropped the message and --check said "template ok";
    stage 01 refuses the same row. Now it is stage 01's reader and rules, and stage 01's line."""
    record = {"messages": [{"role": "sytem", "content": "be brief"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(InputError) as ours:
        read_prompt_rows(path)
    with pytest.raises(InputError) as stage_01s:
        to_messages(record, f"{path}:1")
    assert str(ours.value) == str(stage_01s.value) == f"{path}:1: turn 0 has unknown role 'sytem'"


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
    with pytest.raises(InputError, match=r"jsonl:1: \d+ prompt tokens \+ --max-tokens 32 exceed --max-model-len 40; "
                                         r"shorten it or raise --max-model-len to at least \d+$"):
        render_prompts(DEFAULT_PROMPTS, chat, 40, 32)
    # never advice the target refuses (issue 46: raising --max-model-len past the target's limit ended in a traceback)
    with pytest.raises(InputError, match=r"shorten it or lower --max-tokens \(the target allows at most 4096 tokens\)$"):
        render_prompts(DEFAULT_PROMPTS, chat, 4096, 4090, model_limit=4096)


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
        "06 --check: ran the self-checks (layer ids ok; d2t ok; method ok; template ok; weights ok) and rendered 10 "
        "prompts; tau in vLLM skipped: vLLM's CPU build cannot serve EAGLE-3 with an MLA target (\"No common block size for "
        "16\"): measure it on a GPU box; on a CPU stage 06 measures Llama-style targets")
    assert not (tmp_path / "eval").exists()


# --- issue 63: SGLang's layout, served by vLLM; the card's measured section ------------------------------------

@pytest.fixture(scope="module")
def sglang_servable(llama_run, llama_target, tmp_path_factory) -> dict[str, Path]:
    """04-05 on llama_run's rows with a draft SGLang's loader builds (no fc_norm / norm_before_fc, residual before
    hidden_norm, pre-norm output), exported in both layouts from the same checkpoint."""
    work = tmp_path_factory.mktemp("sglang-servable")
    draft_config = json.loads((REPO / "draft_config.json").read_text())
    draft_config.update(fc_norm=False, norm_before_fc=False, norm_before_residual=False)
    (work / "draft_config.json").write_text(json.dumps(draft_config))
    run_stage("train", "--profile", "cpu-mini", "--target", llama_target, "--data", llama_run["data"], "--vocab",
              llama_run["vocab"], "--output", work / "checkpoints", "--logger", "", "--draft-config",
              work / "draft_config.json", "--extra-args=--no-norm-output")
    for layout in ("speculators", "sglang"):
        run_stage("export", "--profile", "cpu-mini", "--checkpoints", work / "checkpoints", "--output",
                  work / layout, "--layout", layout)
    return {"speculators": work / "speculators", "sglang": work / "sglang"}


@pytest.mark.vllm
def test_the_sglang_layout_serves_in_vllm_with_the_same_tau_and_06_writes_the_cards_section(sglang_servable,
                                                                                             tmp_path):
    """Issue 63.3: the same weights in SGLang's layout (LlamaForCausalLMEagle3: midlayer.*, eagle_config's aux ids in
    SGLang's numbering) load in vLLM and accept exactly as the speculators-format export on the same prompts.
    Issue 63.2: 06 writes its measured section into the draft's card; a rerun rewrites that section only."""
    sglang = sglang_servable["sglang"]
    config = json.loads((sglang / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM's numbering, which vLLM reads first
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # SGLang's: layer k's output
    from safetensors import safe_open

    with safe_open(str(sglang / "model.safetensors"), framework="np") as weights:
        names = set(weights.keys())
    assert "midlayer.self_attn.q_proj.weight" in names and "midlayer.hidden_norm.weight" in names
    assert not any(n.startswith(("layers.", "fc_norm.")) for n in names) and {"fc.weight", "d2t", "t2d"} <= names
    taus = {}
    for layout, draft in sglang_servable.items():
        evaluate(draft, tmp_path / layout, "--no-baseline")
        report = json.loads((tmp_path / layout / "report.json").read_text())
        taus[layout] = (report["spec_decode"]["mean_acceptance_length"], report["spec_decode"]["accepted_per_pos"])
    assert taus["sglang"] == taus["speculators"] and taus["sglang"][0] > 1.0, taus
    # the card: 05's, with 06's section between the markers; a user's edit elsewhere survives a rerun, which puts
    # the section back as the report says
    from eagle3_pipeline.model_card import MEASURED_BEGIN, MEASURED_END

    card_path = sglang / "README.md"
    card = card_path.read_text()
    section = card[card.index(MEASURED_BEGIN):card.index(MEASURED_END)]
    assert "## Measured in vLLM" in section and f"{taus['sglang'][0]:.3f} ±" in section and "k=3" in section
    assert "vLLM 0.32.0" in section and "10 prompts from `eval_prompts.jsonl`" in section
    for category in CATEGORIES:
        assert f"| {category} |" in section
    edited = card.replace("## Serve", "## Serve\n\nOur team's note.").replace(section, section.replace("±", "+/-"))
    card_path.write_text(edited)
    again = evaluate(sglang, tmp_path / "sglang", "--no-baseline")
    assert "already evaluated" in again.stderr
    assert card_path.read_text() == card.replace("## Serve", "## Serve\n\nOur team's note.")
    checked = run_stage("export", "--profile", "cpu-mini", "--checkpoints", sglang.parent / "checkpoints", "--output",
                        sglang, "--layout", "sglang", "--check")  # the card 06 wrote into still passes 05's checks
    assert "05 --check: " in checked.stdout and "loads (LlamaConfig)" in checked.stdout
