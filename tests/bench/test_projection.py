"""The decode speed-up projection at Kimi-K2.5 (benchlib/projection.py, `bench/draft_forward.py project`): the
arithmetic on hand-made inputs, and the reading of a screen results file shaped as bench/acceptance.py writes it."""

from __future__ import annotations

import json

import pytest

from benchlib import curves as lc
from benchlib import projection


def test_speedup_is_tau_over_one_plus_draft_time_over_target_step():
    assert projection.speedup(3.0, 2.0, 20.0) == pytest.approx(3.0 / 1.1)
    assert projection.speedup(2.0, 0.0, 40.0) == 2.0  # a free draft: tau itself
    with pytest.raises(ValueError, match="target step"):
        projection.speedup(2.0, 1.0, 0.0)


# EAGLE-3 at k 3 (tau 2.5, 4 ms) and k 5 (tau 3.0, 8 ms); dflash at its block (tau 5.0, 10 ms); the target steps
# 20, 40, 80 ms. By hand: eagle3 k3 2.5/1.2, 2.5/1.1, 2.5/1.05; k5 3/1.4, 3/1.2, 3/1.1 (k5 is EAGLE-3's best at every
# step); dflash 5/1.5, 5/1.25, 5/1.125; dflash over EAGLE-3's best: 14/9, 8/5, 44/27.
ENTRIES = [
    {"recipe": "ours", "kind": "eagle3", "k": 3, "tau": 2.5},
    {"recipe": "ours", "kind": "eagle3", "k": 5, "tau": 3.0},
    {"recipe": "dflash", "kind": "dflash", "k": 15, "tau": 5.0},
]
TIMES = {("eagle3", 3): 4.0, ("eagle3", 5): 8.0, ("dflash", 15): 10.0}


def test_projection_of_hand_made_inputs_gives_the_hand_counted_numbers():
    result = projection.project(ENTRIES, TIMES)
    rows = {(r["recipe"], r["k"]): r for r in result["rows"]}
    assert rows[("ours", 3)]["speedup"] == pytest.approx({"20.0": 2.5 / 1.2, "40.0": 2.5 / 1.1, "80.0": 2.5 / 1.05})
    assert rows[("ours", 5)]["speedup"] == pytest.approx({"20.0": 3 / 1.4, "40.0": 3 / 1.2, "80.0": 3 / 1.1})
    assert rows[("dflash", 15)]["speedup"] == pytest.approx({"20.0": 5 / 1.5, "40.0": 4.0, "80.0": 5 / 1.125})
    assert result["eagle3_best"] == {t: {"recipe": "ours", "k": 5, "speedup": pytest.approx(s)}
                                     for t, s in (("20.0", 3 / 1.4), ("40.0", 2.5), ("80.0", 3 / 1.1))}
    assert rows[("dflash", 15)]["vs_eagle3"] == pytest.approx({"20.0": 14 / 9, "40.0": 1.6, "80.0": 44 / 27})
    assert rows[("ours", 5)]["vs_eagle3"] == pytest.approx({"20.0": 1.0, "40.0": 1.0, "80.0": 1.0})
    assert "PROJECTION" in result["label"] and result["bar"] == 1.3
    text = "\n".join(projection.format_projection(result))
    assert "PROJECTION" in text and "1.556*" in text and "1.600*" in text and "1.630*" in text


def test_ratio_is_taken_at_each_target_step_against_eagle3s_best_k_there():
    # a slow k 5 draft: k 3 wins at the short target step, k 5 at the long one
    times = {("eagle3", 3): 2.0, ("eagle3", 5): 20.0}
    result = projection.project(ENTRIES[:2], times, target_steps=(10.0, 200.0))
    assert result["eagle3_best"]["10.0"]["k"] == 3  # 2.5/1.2 = 2.083 against 3/3 = 1
    assert result["eagle3_best"]["200.0"]["k"] == 5  # 3/1.1 = 2.727 against 2.5/1.01 = 2.475


def test_a_row_without_tau_or_draft_time_says_what_is_missing():
    entries = [*ENTRIES, {"recipe": "dspark", "kind": "dspark", "k": None, "not_measured": "no engine"},
               {"recipe": "peagle", "kind": "peagle", "k": 8, "tau": 2.0}]
    rows = {r["recipe"]: r for r in projection.project(entries, TIMES)["rows"]}
    assert rows["dspark"]["missing"] == "tau: no engine"
    assert "no peagle at k 8" in rows["peagle"]["missing"]
    # a block draft has one step whatever k it is listed at; a chain or parallel draft needs its own k
    assert projection.draft_ms_for(TIMES, "dflash", 7) == 10.0
    assert projection.draft_ms_for({("peagle", 5): 3.0}, "peagle", 8) is None


def _run(tau: float, stderr: float, per_pos: list[float], drafts: int) -> dict:
    """One engine's measure_acceptance run, as much of it as curves.checkpoint_taus reads."""
    return {"spec_decode": {"mean_acceptance_length": tau, "mean_acceptance_length_stderr": stderr,
                            "acceptance_rate_per_pos": per_pos, "num_drafts": drafts}}


def screen_results() -> dict:
    """A screen results file's `vllm` and `vllm_kinds`, built as bench/acceptance.py builds them: the taus through
    curves.checkpoint_taus (taus_of: its entries less by_kind), a kind's entry as kind_serving's dict + tau."""
    def taus(engines: dict, ks: list[int]) -> dict:
        return {k: v for k, v in lc.checkpoint_taus(engines, ks).items() if k != "by_kind"}

    ours = taus({5: _run(2.9, 0.05, [0.8, 0.6, 0.3, 0.15, 0.05], 100)}, [3, 5])
    dflash = taus({15: _run(4.2, 0.1, [0.9] * 15, 100)}, [3, 5, 15])
    how = {"kind": "dflash", "k": 15, "method": "dflash", "vllm": "0.26.0",
           "speculative_config": {"method": "dflash", "num_speculative_tokens": 15}}
    return {
        "vllm": {"1": {"ours": ours, "plain": ours, "dflash": dflash}},
        "vllm_kinds": {"1": {
            "dflash": {**how, "tau": dflash["15"], "acceptance_rate_per_pos": [0.9] * 15, "num_drafts": 100,
                       "speed": "not measured: no speed phase (--screen-speed-rounds 0)"},
            "dspark": {"kind": "dspark", "not_measured": "vLLM 0.32 cannot serve it here"},
        }},
    }


def test_screen_results_read_as_acceptance_writes_them():
    import acceptance

    results = screen_results()
    assert any("dflash" in line and "k=15" in line for line in acceptance.format_vllm_kinds(results["vllm_kinds"]))
    size, entries = projection.screen_taus(results)
    assert size == "1"
    by = {(e["recipe"], e["k"]): e for e in entries}
    assert by[("ours", 5)]["tau"] == 2.9 and by[("ours", 5)]["source"] == "measured"
    assert by[("ours", 3)]["tau"] == pytest.approx(1 + 0.8 + 0.6 + 0.3)  # 1 + the first 3 positions' rates
    assert by[("ours", 3)]["source"] == "from k=5 counters"
    assert by[("dflash", 15)]["tau"] == 4.2 and by[("dflash", 15)]["kind"] == "dflash"
    assert by[("dspark", None)]["not_measured"].startswith("vLLM 0.32")
    assert ("plain", 5) not in by  # only the EAGLE-3 recipes asked for
    _, with_plain = projection.screen_taus(results, "1", ["ours", "plain"])
    assert {("plain", 3), ("plain", 5)} <= {(e["recipe"], e["k"]) for e in with_plain}
    with pytest.raises(ValueError, match="4x not in"):
        projection.screen_taus(results, "4")


def test_project_cli_reads_both_files_and_writes_the_table(tmp_path, capsys):
    import draft_forward

    screen = tmp_path / "screen.json"
    screen.write_text(json.dumps(screen_results()))
    forward = tmp_path / "forward.json"
    forward.write_text(json.dumps({"label": "one H100", "device": "cuda", "toy": False, "kinds": {
        "eagle3": {"steps": [{"batch": 1, "k": 3, "forward_ms": 3.0}, {"batch": 1, "k": 5, "forward_ms": 5.0},
                             {"batch": 8, "k": 5, "forward_ms": 6.0}]},
        "dflash": {"steps": [{"batch": 1, "k": 15, "forward_ms": 8.0}]}}}))
    out = tmp_path / "projection.json"
    assert draft_forward.main(["project", "--screen", str(screen), "--forward", str(forward),
                               "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PROJECTION" in printed and "dflash" in printed and "dspark" in printed
    result = json.loads(out.read_text())["projections"][0]
    rows = {(r["recipe"], r["k"]): r for r in result["rows"]}
    assert rows[("dflash", 15)]["speedup"]["40.0"] == pytest.approx(4.2 / (1 + 8 / 40))
    assert rows[("ours", 5)]["speedup"]["20.0"] == pytest.approx(2.9 / 1.25)
    assert result["size"] == "1" and result["batch"] == 1 and not result["forward_toy"]


def test_train_costs_are_ours_tokens_per_second_over_each_kinds(tmp_path, capsys):
    # runs as bench/train_throughput.py --kinds names them: ours, ours-KIND; ours-vocab-N and a failed run left out
    train = {"runs": {"ours": {"tokens_per_s": 30000.0}, "ours-dflash": {"tokens_per_s": 12000.0},
                      "ours-peagle": {"tokens_per_s": 24000.0}, "ours-vocab-64000": {"tokens_per_s": 20000.0},
                      "ours-dspark": {"failed": True, "failure": "out of memory"}, "plain": {"tokens_per_s": 9000.0}}}
    assert projection.train_costs(train) == {"eagle3": 1.0, "dflash": 2.5, "peagle": 1.25}
    # --kinds-fsdp 2: dspark sharded over 2 GPUs, priced per GPU; a kind's one-GPU run wins over its sharded one
    sharded = {**train["runs"], "ours-dspark-fsdp2": {"tokens_per_s": 20000.0, "tokens_per_s_per_gpu": 10000.0},
               "ours-dflash-fsdp2": {"tokens_per_s": 4000.0}}
    assert projection.train_costs({"runs": sharded}) == {"eagle3": 1.0, "dflash": 2.5, "peagle": 1.25, "dspark": 3.0}
    with pytest.raises(ValueError, match="'ours' run"):
        projection.train_costs({"runs": {"plain": {"tokens_per_s": 1.0}}})
    result = projection.project(ENTRIES, TIMES, costs=projection.train_costs(train))
    assert [r["train_cost"] for r in result["rows"]] == [1.0, 1.0, 2.5]
    text = "\n".join(projection.format_projection(result))
    assert "train x" in text and "2.50" in text

    import draft_forward

    paths = {name: tmp_path / f"{name}.json" for name in ("screen", "forward", "train")}
    paths["screen"].write_text(json.dumps(screen_results()))
    paths["forward"].write_text(json.dumps({"kinds": {"eagle3": {"steps": [{"batch": 8, "k": 5, "forward_ms": 6.0}]},
                                                      "dflash": {"steps": [{"batch": 8, "k": 15, "forward_ms": 9.0}]}}}))
    paths["train"].write_text(json.dumps(train))
    assert draft_forward.main(["project", "--screen", str(paths["screen"]), "--forward", str(paths["forward"]),
                               "--train", str(paths["train"]), "--batch", "8", "--target-ms", "30"]) == 0
    printed = capsys.readouterr().out
    assert "draft batch 8" in printed and "train x" in printed
    assert f"{4.2 / 1.3:.3f}" in printed  # dflash at 30 ms: 4.2 / (1 + 9/30)
