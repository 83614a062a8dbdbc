"""The throughput bench (`benchlib.throughput`, bench/train_throughput.py): the FLOP count, the
head-only verifier, the synthetic data and its stage manifests, the step summary, the bench's
planning and kernel trace. The runtime changes it measures are stage 04's: tests/test_compat.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchlib import throughput
from benchlib.throughput import (
    DraftGeometry,
    kimi_k25_config,
    mean_attended_keys,
    muon_step_flops,
    train_flops_per_token,
)

pytestmark = pytest.mark.bench

TINY_TEXT = throughput.toy_kimi_text_overrides(4)


# ---------------------------------------------------------------- FLOP count


def test_flop_count_matches_a_hand_count_on_a_tiny_config():
    # H=8, 2 heads of 4 (q width 8), 1 kv head (kv width 4), I=16, draft vocab 10,
    # 2 TTT steps, 1 layer, 3 aux layers, 3 keys per query at step 0.
    geometry = DraftGeometry(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                             intermediate_size=16, draft_vocab_size=10, ttt_steps=2)
    count = train_flops_per_token(geometry, mean_keys=3)
    assert count.forward == {
        "fc": 2 * 24 * 8,                       # 384
        "target_logits": 2 * 8 * 10,            # 160
        "qkv": 2 * (2 * 16 * (8 + 4 + 4)),      # 1024: input [embed, hidden] = 16 wide
        "attention": 4 * 8 * 3 + 4 * 8 * 4,     # 224: step 1 sees one more key
        "o_proj": 2 * (2 * 8 * 8),              # 256
        "mlp": 2 * (2 * 3 * 8 * 16),            # 1536
        "lm_head": 2 * (2 * 8 * 10),            # 320
    }
    assert count.backward == {
        "fc": 384, "target_logits": 0, "qkv": 2048, "attention": 448, "o_proj": 512,
        "mlp": 3072, "lm_head": 320,
    }
    assert count.forward_total == 3904
    assert count.total == 3904 + 6784


def test_layers_after_the_first_take_hidden_not_embed_plus_hidden():
    one = DraftGeometry(hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4,
                        intermediate_size=16, draft_vocab_size=10, ttt_steps=1)
    two = DraftGeometry(**{**one.__dict__, "num_layers": 2})
    extra = train_flops_per_token(two, 5).forward["qkv"] - train_flops_per_token(one, 5).forward["qkv"]
    assert extra == 2 * 8 * (8 + 8 + 8)


def test_mean_attended_keys_is_causal_within_documents_and_clipped_by_the_window():
    assert mean_attended_keys([4], None) == (1 + 2 + 3 + 4) / 4
    assert mean_attended_keys([4], 2) == (1 + 2 + 2 + 2) / 4
    assert mean_attended_keys([1, 3], None) == (1 + 1 + 2 + 3) / 4


def test_muon_cost_is_per_matrix_newton_schulz_on_the_short_side():
    # 2x3 matrix, 1 step: X X^T = 2*2*2*3, A@A = 2*2^3, B@X = 2*2*2*3.
    assert muon_step_flops([(2, 3)], ns_steps=1) == 24 + 16 + 24
    assert muon_step_flops([(3, 2)], ns_steps=2) == 2 * 64


def test_kimi_draft_geometry_is_what_speculators_builds(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25_config()))
    geometry = throughput.kimi_draft_geometry(tmp_path)
    assert (geometry.hidden_size, geometry.intermediate_size, geometry.draft_vocab_size) == (
        7168, 18432, 32000)
    assert geometry.num_heads * geometry.head_dim <= 2 * geometry.hidden_size
    # Documents of 2047 tokens (2048-token rows after the one-token shift), window 2048.
    count = train_flops_per_token(geometry, mean_attended_keys([2047], 2048))
    # Cross-check with the count in ../shared/KNOWLEDGE.md: 5.8 + 9.0 = 14.81 GFLOP/token.
    assert count.forward_total == pytest.approx(5.8e9, rel=0.01)
    assert count.backward_total == pytest.approx(9.0e9, rel=0.01)
    # ... and Muon's ~113 TFLOP per optimizer step.
    assert muon_step_flops(geometry.muon_matrix_shapes()) == pytest.approx(113e12, rel=0.01)


# ---------------------------------------------------------------- head-only verifier


def test_head_only_verifier_holds_exactly_the_three_language_model_head_tensors(tmp_path):
    shapes = throughput.write_head_only_verifier(tmp_path, text_overrides=TINY_TEXT)
    assert shapes == {
        "language_model.model.embed_tokens.weight": [256, 64],
        "language_model.lm_head.weight": [256, 64],
        "language_model.model.norm.weight": [64],
    }
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(throughput.HEAD_ONLY_TENSORS)
        assert all(handle.get_tensor(k).dtype == torch.bfloat16 for k in handle.keys())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(throughput.HEAD_ONLY_TENSORS)


def test_speculators_loader_finds_the_language_model_tensors(tmp_path):
    throughput.write_head_only_verifier(tmp_path, text_overrides=TINY_TEXT, seed=3)
    from safetensors.torch import load_file
    from speculators.utils.loading import _resolve_key, load_model_layers

    written = load_file(str(tmp_path / "model.safetensors"))
    names = ["embed_tokens.weight", "lm_head.weight", "model.norm.weight"]  # what speculators asks
    loaded = load_model_layers(names, str(tmp_path))
    for name in names:
        key = _resolve_key(name, dict.fromkeys(written))
        assert key == ("language_model.model." + name if name == "embed_tokens.weight"
                       else "language_model." + name)
        assert torch.equal(loaded[name], written[key])


def test_real_kimi_config_reads_as_kimi_k25_wrapping_deepseek_v3(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25_config()))
    from speculators.models.utils import get_verifier_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "kimi_k25"
    assert config.architectures == ["KimiK25ForConditionalGeneration"]
    text = get_verifier_config(str(tmp_path))
    assert type(text).__name__ == "DeepseekV3Config"  # text model_type "kimi_k2" maps to it
    assert (text.hidden_size, text.vocab_size, text.num_hidden_layers) == (7168, 163840, 61)
    assert (text.q_lora_rank, text.kv_lora_rank, text.n_routed_experts) == (1536, 512, 384)
    assert text.tie_word_embeddings is False


# ---------------------------------------------------------------- synthetic dataset


def test_synthetic_dataset_reads_back_through_speculators_dataset(tmp_path):
    info = throughput.write_synthetic_prepared_dataset(
        tmp_path, num_rows=6, seq_len=12, hidden_size=8, vocab_size=50, distinct_files=2)
    assert info["hidden_state_bytes_per_token"] == 4 * 8 * 2
    hs = tmp_path / "hidden_states"
    assert os.stat(hs / "hs_4.safetensors").st_ino == os.stat(hs / "hs_0.safetensors").st_ino
    assert (tmp_path / "token_freq.pt").is_file()
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=64, datapath=str(tmp_path), on_missing="raise")
    for index in range(len(dataset)):
        item = dataset[index]
        assert item["hidden_states"].shape == (12, 3 * 8)
        assert item["verifier_last_hidden_states"].shape == (12, 8)
        assert int(item["loss_mask"].sum()) == 12 - 1  # 10% prompt, masked


def test_synthetic_fp8_dataset_reads_back_through_speculators_fp8_transfer(tmp_path):
    """--cold-warm's fp8 data is stage 02's fp8 format: speculators' fp8 backend dequantizes it."""
    info = throughput.write_synthetic_prepared_dataset(
        tmp_path, num_rows=3, seq_len=12, hidden_size=8, vocab_size=50, storage="fp8")
    assert info["hidden_state_bytes_per_token"] == 4 * 8 + 4 and info["storage"] == "fp8"
    from hs_connectors.transfer import FP8Transfer
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset

    stored = load_file(str(tmp_path / "hidden_states" / "hs_1.safetensors"))
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn and stored["hidden_states_scales"].shape == (12, 1, 1)
    transfer = FP8Transfer(tmp_path / "hidden_states", dequantize_dtype=torch.float32)
    dataset = ArrowDataset(max_len=64, datapath=str(tmp_path), on_missing="raise", transfer=transfer)
    item = dataset[1]
    assert item["hidden_states"].shape == (12, 3 * 8) and torch.isfinite(item["hidden_states"]).all()
    assert item["hidden_states"].abs().max() > 0.5  # N(0, 1) states, not zeros


def test_page_cache_evictor_keeps_a_file_out_of_the_page_cache_while_open(tmp_path):
    """--cold-warm's cold runs: a file read inside the evictor is out of the page cache again moments later."""
    from eagle3_pipeline.disk_reads import evict_from_page_cache, page_cache_resident_fraction

    path = tmp_path / "hs_0.safetensors"
    path.write_bytes(os.urandom(8 << 20))
    throughput.read_into_page_cache([path])
    assert page_cache_resident_fraction([path]) == 1.0
    evict_from_page_cache([path])
    if page_cache_resident_fraction([path]) > 0.05:
        pytest.skip(f"{tmp_path}: this filesystem keeps pages cached (tmpfs)")
    with throughput.PageCacheEvictor([path], interval_s=0.05) as evictor:
        assert throughput.read_into_page_cache([path])["bytes"] == 8 << 20
        deadline = time.monotonic() + 10  # an eviction after the read (every 0.05 s; slack for a loaded machine)
        while page_cache_resident_fraction([path]) > 0.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert page_cache_resident_fraction([path]) == 0.0
    stats = evictor.stats()
    assert stats["evictions"] >= 1 and 0.0 < stats["resident_fraction_max"] <= 1.0  # it saw the read, then evicted it


# ---------------------------------------------------------------- step metrics


def test_summary_by_epoch_splits_the_run_and_skips_warm_up_only_in_the_first():
    def record(step, epoch, t):
        return {"global_step": step, "epoch": epoch, "time": t,
                "profile": {"tokens_per_s": 2000.0, "step_ms": 500.0}}
    # epoch 0: 2 s per step (cold reads); a 60 s validation gap; epoch 1: 1 s per step (cached)
    records = [record(s, 0, 2.0 * s) for s in range(6)] + [record(s, 1, 70.0 + (s - 6)) for s in range(6, 12)]
    by_epoch = throughput.summarize_by_epoch(records, warmup_steps=2)
    assert sorted(by_epoch) == [0, 1]
    assert by_epoch[0]["measured_steps"] == 3 and by_epoch[0]["tokens_per_s"] == pytest.approx(500.0)
    assert by_epoch[1]["measured_steps"] == 5 and by_epoch[1]["tokens_per_s"] == pytest.approx(1000.0)


def test_summary_takes_tokens_per_second_from_the_wall_clock_window():
    records = [{"global_step": step, "time": 10.0 + step,
                "profile": {"tokens_per_s": 1000.0 / 0.5, "step_ms": 500.0, "fetch_ms": 1.0,
                            "fwd_ms": 2.0, "bwd_ms": 3.0, "opt_ms": 4.0, "h2d_ms": 0.5}}
               for step in range(0, 12, 2)]  # logged every 2 steps, 1 s per step
    summary = throughput.summarize_train_metrics(records, warmup_steps=2)
    assert summary["tokens_per_step"] == 1000.0
    assert summary["measured_steps"] == 8
    assert summary["tokens_per_s"] == pytest.approx(1000.0)
    assert summary["step_split_ms"]["opt_ms"] == 4.0


def _bench_module():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_stops_a_run_once_two_logged_steps_span_the_window(tmp_path):
    bench = _bench_module()
    metrics = tmp_path / "metrics.jsonl"
    writer = textwrap.dedent(f"""
        import json, time
        for step in range(0, 1000, 5):
            with open({str(metrics)!r}, "a") as f:
                f.write(json.dumps({{"global_step": step, "time": time.time(), "profile": {{"step_ms": 1}}}}) + "\\n")
            time.sleep(0.05)
    """)
    outcome = bench.launch("t", [sys.executable, "-c", writer], gpus=[], log=tmp_path / "log",
                           timeout=60, stop_when=lambda: bench.window_complete(metrics, 3, 10))
    assert outcome["exit"] == "stopped after the measured window"
    steps = [json.loads(line)["global_step"] for line in metrics.read_text().splitlines()]
    assert 15 <= steps[-1] < 200


def test_run_gpu_indices_go_through_an_inherited_cuda_visible_devices(monkeypatch):
    bench = _bench_module()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert bench.visible_gpus([0, 1]) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the bench on GPU 1, something else on GPU 0
    assert bench.visible_gpus([0]) == ["1"]
    with pytest.raises(SystemExit, match="needs 2 GPUs, CUDA_VISIBLE_DEVICES=1 has 1"):
        bench.visible_gpus([0, 1])


def test_bench_plans_each_run_from_its_own_flags(monkeypatch):
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=["plain", "ours"], variant=[], ddp=2, ours_via="04_train", ours_profile="h200-8x",
                              ours_variant=["48k=--total-seq-len 49152 --lr 2.4e-3"], warmup_steps=2, steps=8)
    plan = bench._plan_runs(args)
    assert list(plan) == ["plain", "ours", "48k", "ours-2gpu"]
    assert (plan["plain"]["log_freq"], plan["plain"]["stop"]) == (1, 10)  # speculators logs every step
    assert (plan["ours"]["log_freq"], plan["ours"]["warmup"], plan["ours"]["stop"]) == (10, 10, 20)
    assert plan["48k"]["flags"] == ["--total-seq-len", "49152", "--lr", "2.4e-3"] and plan["48k"]["via_04"]
    # the profile's 32K steps as a flag: 04 would pack 8K steps on a dataset this short
    assert plan["ours"]["flags"] == plan["ours-2gpu"]["flags"] == ["--total-seq-len", "32768"]
    assert plan["plain"]["flags"] == []
    # rows for the run's steps + 3 at its tokens/step (2048-token rows), over the 90% train split
    assert plan["48k"]["rows"] == int(23 * 24 / 0.9) + 2 and plan["ours"]["rows"] == int(23 * 16 / 0.9) + 2
    assert plan["ours-2gpu"]["gpus"] == 2 and plan["ours-2gpu"]["rows"] == int(23 * 16 * 2 / 0.9) + 2


def test_bench_alternates_the_input_checks_and_reports_each_pair_and_the_means(monkeypatch):
    """--loader-check alternate: on, off, on, off in one invocation; the cost per adjacent pair (both
    orders) and as means, so a run's place in the invocation shows as on-first vs off-first."""
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=["plain", "ours"], variant=[], ddp=0, ours_via="04_train", ours_profile="h200-8x",
                              ours_variant=[], warmup_steps=2, steps=8, loader_check="alternate", loader_check_pairs=2)
    plan = bench._plan_runs(args)
    assert list(plan) == ["plain", "ours", "ours-no-input-checks", "ours-2", "ours-no-input-checks-2"]
    assert [plan[n]["input_checks"] for n in list(plan)[1:]] == [True, False, True, False]
    assert all(plan[n]["flags"] == ["--total-seq-len", "32768"] and plan[n]["via_04"] for n in list(plan)[1:])
    args.loader_check = "alternate-off-first"
    assert list(bench._plan_runs(args))[1:] == ["ours-no-input-checks", "ours", "ours-no-input-checks-2", "ours-2"]

    # tokens/s with a drift: every later run is 1% slower; the checks cost 3%
    rates = {"ours": 97.0, "ours-no-input-checks": 99.0, "ours-2": 95.06, "ours-no-input-checks-2": 97.0}
    runs = {name: {"tokens_per_s": rate} for name, rate in rates.items()}
    args.loader_check = "alternate"
    (name, pairs), = bench.input_check_pairs(bench._plan_runs(args), runs).items()
    assert name == "ours" and pairs["sequence"] == list(rates)
    assert [p["order"] for p in pairs["pairs"]] == ["on-first", "off-first", "on-first"]
    assert [p["runs"] for p in pairs["pairs"]] == [["ours", "ours-no-input-checks"],
                                                   ["ours-no-input-checks", "ours-2"],
                                                   ["ours-2", "ours-no-input-checks-2"]]
    costs = [p["cost"] for p in pairs["pairs"]]
    assert costs == pytest.approx([1 - 97 / 99, 1 - 95.06 / 99, 1 - 95.06 / 97])
    assert pairs["mean_cost"] == pytest.approx((costs[0] + costs[2]) / 2)
    assert pairs["mean_cost_on_first"] == pytest.approx((costs[0] + costs[2]) / 2)
    assert pairs["mean_cost_off_first"] == pytest.approx(costs[1]) and costs[1] > costs[0]  # the order shows
    assert pairs["mean_cost_adjacent"] == pytest.approx(sum(costs) / 3)
    runs.pop("ours-2")  # a failed run: its pairs have no cost, the disjoint mean none
    pairs = bench.input_check_pairs(bench._plan_runs(args), runs)["ours"]
    assert [("cost" in p) for p in pairs["pairs"]] == [True, False, False] and pairs["mean_cost"] is None
    assert pairs["mean_cost_adjacent"] == pytest.approx(costs[0])


def test_bench_trace_run_profiles_ours_after_the_warm_up(monkeypatch):
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=[], variant=[], ddp=0, ours_via="04_train", ours_variant=[], ours_profile="h200-8x",
                              warmup_steps=3, steps=10, trace=True)
    plan = bench._plan_runs(args)
    assert list(plan) == ["trace"] and plan["trace"]["via_04"] and plan["trace"]["warmup"] == 10


def test_kernel_classes_of_the_names_seen_on_the_h200():
    bench = _bench_module()
    seen = {  # names from bench/results/h200-trace-ours-kernels.json
        "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN": "gemm",
        "triton_tem_fused_flex_attention_4": "flex_attention",
        "triton_tem_fused__to_copy_add_flex_attention_backward_transpose_view_6": "flex_attention",
        "triton_per_fused_flex_attention_backward_transpose_view_5": "flex_attention",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "triton_red_fused_argmax_2": "triton_reduction",
        "triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_2": "triton_pointwise",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16>>": "aten_reduction",
        "loss_forward_kernel": "other",
    }
    assert {name: bench.kernel_class(name) for name in seen} == seen
    recorded = json.loads((Path(bench.__file__).parent / "results" / "h200-trace-ours-kernels.json").read_text())
    assert all(bench.kernel_class(k["name"]) == k["class"] for k in recorded["top_kernels"])


@pytest.mark.slow
def test_bench_trace_child_profiles_04_train_in_process(tmp_path, kimi_run, kimi_target):
    """`_trace` runs 04_train.py in its own process under torch.profiler (on the CPU: no
    GPU kernels, but the same path: the step hook, the report, the trace file)."""
    out = tmp_path / "trace"
    result = subprocess.run(
        [sys.executable, str(_bench_module().__file__), "_trace", "--out", str(out), "--after-step", "1",
         "--steps", "1", str(Path(__file__).resolve().parents[2] / "eagle3-train" / "04_train.py"), "--profile", "cpu-mini",
         "--target", str(kimi_target), "--data", str(kimi_run["data"]), "--vocab", str(kimi_run["vocab"]),
         "--output", str(tmp_path / "run"), "--epochs", "1", "--logger", ""],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "kernels.json").read_text())
    assert report["steps"] == 1 and report["wall_ms_per_step"] > 0
    assert (out / "kernels.txt").read_text().startswith(f"{report['gpu_ms_per_step']:.1f} ms of GPU kernels")
    import gzip

    assert json.loads(gzip.decompress((out / "trace.json.gz").read_bytes()))["traceEvents"]


def test_synthetic_manifests_satisfy_04_train_contracts(tmp_path):
    throughput.write_head_only_verifier(tmp_path / "verifier", text_overrides=TINY_TEXT)
    throughput.write_synthetic_prepared_dataset(tmp_path / "data", num_rows=12, seq_len=32,
                                                hidden_size=64, vocab_size=256, distinct_files=3)
    throughput.write_synthetic_stage_manifests(tmp_path / "verifier", tmp_path / "data",
                                               tmp_path / "vocab", aux_layer_ids=[1, 2, 3],
                                               draft_vocab_size=64)
    from eagle3_pipeline.contract import read_manifest, require_upstream

    prepared = read_manifest(tmp_path / "data", "prepare", "--data")
    extracted = read_manifest(tmp_path / "data" / "hidden_states", "extract", "--data")
    vocab = read_manifest(tmp_path / "vocab", "vocab", "--vocab")
    require_upstream(extracted, "prepare", prepared)
    require_upstream(vocab, "prepare", prepared)
    assert extracted.layer_ids == [1, 2, 3, 4] and vocab.draft_vocab_size == 64
    assert prepared.counts.model_dump(exclude_none=True) == {"rows": 12, "tokens": 12 * 32}  # what 04_train's preflight reads
    assert (tmp_path / "vocab" / "d2t.npy").is_file() and (tmp_path / "vocab" / "t2d.npy").is_file()
    # --draft-vocabs: another stage 03 output over the same data, the whole vocabulary here (d2t all zero)
    throughput.write_synthetic_vocab(tmp_path / "verifier", tmp_path / "data", tmp_path / "vocab-256", draft_vocab_size=256)
    full = read_manifest(tmp_path / "vocab-256", "vocab", "--vocab")
    require_upstream(full, "prepare", prepared)
    assert full.draft_vocab_size == 256 and not np.load(tmp_path / "vocab-256" / "d2t.npy").any()
    assert np.load(tmp_path / "vocab-256" / "t2d.npy").all()


def test_bench_plans_an_ours_run_per_draft_vocabulary(monkeypatch):
    """Issue 61 item 5: --draft-vocabs N... adds one 04 run per draft vocabulary (same flags as ours otherwise)."""
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=["ours"], variant=[], ddp=0, ours_via="04_train", ours_profile="h200-8x",
                              ours_variant=[], warmup_steps=2, steps=8, draft_vocabs=[64000, 163840])
    plan = bench._plan_runs(args)
    assert list(plan) == ["ours", "ours-vocab-64000", "ours-vocab-163840"]
    assert plan["ours-vocab-163840"]["draft_vocab"] == 163840 and plan["ours-vocab-163840"]["via_04"]
    assert plan["ours-vocab-64000"]["flags"] == plan["ours"]["flags"] == ["--total-seq-len", "32768"]


def test_bench_plans_each_kind_sharded_over_n_gpus_with_kinds_fsdp(monkeypatch):
    """Issue 62: a 5-layer DFlash at Kimi-K2.5's width is refused on one 80 GB card (04's memory check, one H100):
    --kinds-fsdp N runs each kind on N GPUs with 04 --fsdp; without it, one GPU, unsharded."""
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=["ours"], variant=[], ddp=0, ours_via="04_train", ours_profile="h200-8x",
                              ours_variant=[], warmup_steps=2, steps=8, kinds=["dflash", "peagle"], kinds_fsdp=2)
    plan = bench._plan_runs(args)
    assert list(plan) == ["ours", "ours-dflash-fsdp2", "ours-peagle-fsdp2"]
    assert plan["ours-dflash-fsdp2"]["gpus"] == 2 and plan["ours-dflash-fsdp2"]["kind"] == "dflash"
    assert plan["ours-dflash-fsdp2"]["flags"][:5] == ["--speculator-type", "dflash", "--mask-token-id", "163839", "--fsdp"]
    plain = bench._plan_runs(argparse.Namespace(**{**vars(args), "kinds_fsdp": 0}))
    assert plain["ours-dflash"]["gpus"] == 1 and "--fsdp" not in plain["ours-dflash"]["flags"]


def test_a_04_runs_recorded_draft_is_what_04_resolves_with_its_norm_flags(tmp_path):
    """bench/train_throughput.py records each 04 run's draft (the projection prices screen classes by it): the draft
    config 04 resolves (--print-config, real) with the norm flags among its --extra-args as speculators reads them."""
    import argparse

    from benchlib import screen

    bench = _bench_module()
    args = argparse.Namespace(workdir=tmp_path, ours_profile="h200-8x")
    landed = screen.landed_draft()
    assert bench.run_draft(args, ["--total-seq-len", "8192"]) == landed
    legacy_file = tmp_path / "draft_config.json"
    legacy_file.write_text(json.dumps({**landed, **screen.LEGACY_NORMS}))
    legacy = bench.run_draft(args, ["--draft-config", str(legacy_file)])
    assert legacy == {**landed, **screen.LEGACY_NORMS}
    # the landed Kimi file's "fc-norm" run: today's ours over the legacy draft config
    assert bench.run_draft(args, ["--draft-config", str(legacy_file), "--extra-args=--fc-norm",
                                  "--extra-args=--no-norm-before-fc"]) == landed


OOM_LINE = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 15.62 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 3.12 GiB is free.")


def test_a_run_without_logged_steps_is_recorded_with_its_error_and_peak_memory(tmp_path):
    """A run that failed (here an OOM at its first step: one logged step before the warm-up, none after) is a record
    with the log's OOM line, why, and the GPU memory peak, not a ValueError that aborts the bench."""
    bench = _bench_module()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"global_step": 0, "time": 1.0, "max_memory_allocated": 70 * 2**30,
                                   "profile": {"tokens_per_s": 1.0, "step_ms": 1.0}}) + "\n")
    log = tmp_path / "log.txt"
    log.write_text("\n".join([
        "[rank0]: Traceback (most recent call last):", "[rank0]:   File \"x.py\", line 3, in <module>",
        f"[rank0]: {OOM_LINE}", OOM_LINE,
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "error: training stopped: rank 0 (node 0) failed: OutOfMemoryError; rerun the same command to resume", ""]))
    outcome = {"exit": 1, "wall_s": 80.0, "peak_gpu_memory_used_gib": 78.9}
    run = bench.summarize("ours-vocab-64000", outcome, metrics, 1, 3, 1e9, 700.0, log=log)
    assert run["failed"] and run["error"] == OOM_LINE
    assert run["failure"] == "need at least 2 logged steps after warm-up, got 0 (exit 1)"
    assert run["peak_gpu_memory_used_gib"] == 78.9 and run["max_memory_allocated_gib"] == 70.0
    assert run["logged_steps"] == 1 and "tokens_per_s" not in run and run["log"] == str(log)
    # no metrics at all (a crash before the first step), a timeout: the last meaningful line of the log
    log.write_text("loading\nTraceback (most recent call last):\nRuntimeError: NCCL hung\n  (see above)\n")
    run = bench.summarize("ours-dflash", {"exit": "timeout", "peak_gpu_memory_used_gib": 3.0},
                          tmp_path / "none.jsonl", 1, 3, None, 700.0, log=log)
    assert run["error"] == "RuntimeError: NCCL hung" and run["failure"] == "no metrics written (exit timeout)"
    assert bench.last_error_line("step 1\nstep 2\n") == "step 2" and bench.last_error_line("") is None
    assert bench.last_error_line("a\nerror: 04 refused the config\nexit\n") == "error: 04 refused the config"
    # the table and the run line print a failed run and go on
    bench._print_run("ours-dflash", run)
    bench._print_table({"gpu": "H100", "torch": "2", "commit": "x", "date": "d", "bf16_matmul": {"peak_tflops": 700},
                        "flops_per_token": {"total": 1e9}, "runs": {"ours-dflash": run}})


def test_a_kind_run_without_a_flop_model_has_no_mfu(tmp_path):
    bench = _bench_module()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"global_step": s, "time": float(s), "max_memory_allocated": 2**30,
                                           "profile": {"tokens_per_s": 100.0, "step_ms": 1000.0}}) + "\n"
                               for s in range(0, 8)))
    run = bench.summarize("ours-dflash", {"exit": 0, "peak_gpu_memory_used_gib": 2.0}, metrics, 1, 2, None, 700.0)
    assert run["tokens_per_s"] == pytest.approx(100.0) and run["mfu"] is None
    bench._print_run("ours-dflash", {**run, "step_split_ms": {}})


def test_ours_seq_len_sets_every_04_runs_tokens_per_step(monkeypatch):
    """--ours-seq-len N: ours, the --draft-vocabs runs, the DDP run and an ours-variant without its own
    --total-seq-len train N tokens per step (a variant's own flag wins; plain keeps speculators' 8192)."""
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=["plain", "ours"], variant=[], ddp=2, ours_via="04_train", ours_profile="h200-8x",
                              ours_variant=["lr=--lr 2e-3", "48k=--total-seq-len 49152"], warmup_steps=2, steps=8,
                              draft_vocabs=[64000, 163840], ours_seq_len=16384)
    plan = bench._plan_runs(args)
    for name in ("ours", "lr", "ours-vocab-64000", "ours-vocab-163840", "ours-2gpu"):
        assert plan[name]["flags"][-2:] == ["--total-seq-len", "16384"] and plan[name]["total_seq_len"] == 16384
        assert plan[name]["rows"] == int(23 * 8 * plan[name]["gpus"] / 0.9) + 2  # 8 rows of 2048 per step
    assert plan["48k"]["total_seq_len"] == 49152 and plan["plain"]["total_seq_len"] == 8192
    assert bench.ours_seq_len_record(args) == {"tokens_per_step": 16384, "source": "--ours-seq-len"}
    args.ours_seq_len = None  # the profile's, as before
    assert bench._plan_runs(args)["ours"]["total_seq_len"] == 32768
    assert bench.ours_seq_len_record(args) == {"tokens_per_step": 32768, "source": "profile h200-8x"}
    args.ours_seq_len = 1000
    with pytest.raises(SystemExit, match="at least one 2048-token row"):
        bench._plan_runs(args)


def test_bench_plans_one_04_run_per_kind_after_the_eagle3_runs(monkeypatch):
    """Issue 62 item 3: --kinds KIND... adds ours-KIND, 04 with --speculator-type KIND (its own defaults; the mask token
    Kimi's [PAD], the head-only verifier has no tokenizer), at --ours-seq-len; a kind 04 does not train is refused."""
    import argparse

    bench = _bench_module()
    monkeypatch.setattr(bench, "_resolved_04_config", lambda args: {"log_freq": "10", "total_seq_len": "32768"})
    args = argparse.Namespace(runs=["plain", "ours"], variant=[], ddp=0, ours_via="04_train", ours_profile="h200-8x",
                              ours_variant=[], warmup_steps=2, steps=8, draft_vocabs=[64000],
                              kinds=["dflash", "peagle", "dspark", "dflash2", "dflash"], ours_seq_len=16384)
    plan = bench._plan_runs(args)
    assert list(plan) == ["plain", "ours", "ours-vocab-64000", "ours-dflash", "ours-peagle", "ours-dspark",
                          "ours-dflash2"]
    mask = str(throughput.KIMI_K25_TEXT_CONFIG["pad_token_id"])
    assert plan["ours-dflash"]["flags"] == ["--speculator-type", "dflash", "--mask-token-id", mask,
                                            "--total-seq-len", "16384"]
    assert plan["ours-dspark"]["via_04"] and plan["ours-dspark"]["kind"] == "dspark" and plan["ours-dspark"]["gpus"] == 1
    # the FLOP model is EAGLE-3's: eagle3 runs get a count and MFU, the other kinds none
    assert bench.has_flop_model(plan["ours"]) and bench.has_flop_model(plan["ours-vocab-64000"])
    assert not any(bench.has_flop_model(plan[f"ours-{k}"]) for k in ("dflash", "peagle", "dspark", "dflash2"))
    assert bench.has_flop_model({"kind": "eagle3"})
    for bad in ("xpress", "medusa"):
        args.kinds = [bad]
        with pytest.raises(SystemExit, match=f"--kinds {bad}: "):
            bench._plan_runs(args)


def test_a_kind_runs_recorded_draft_names_its_kind(tmp_path):
    import argparse

    from benchlib import screen

    bench = _bench_module()
    args = argparse.Namespace(workdir=tmp_path, ours_profile="h200-8x")
    draft = bench.run_draft(args, ["--speculator-type", "dflash", "--mask-token-id", "163839"], "dflash")
    assert draft == {**screen.landed_draft(), "speculator_type": "dflash"}
