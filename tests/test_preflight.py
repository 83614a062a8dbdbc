"""Preflight: a doomed run is refused in seconds with one line and the numbers; every check prints its estimate.

The checks (eagle3_pipeline/preflight.py) with the size model (sizing.py) and the cold-read
measurement (disk_reads.py), then each stage's `--check` through its real `main(argv)`. The cases
stand in for a machine we do not have (a 3 TB disk, 4 GPUs, an old vLLM) by replacing the probes
(machine.py) where the checks look them up, in `eagle3_pipeline.preflight`.
"""
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# The bad-input tests' in-process stage runner and finished-run copies (the fixtures `ref`, `work`: imported
# here, requested by name below, hence F811).
from test_reliability_bad_input import _train, manifest, ref, refused, succeeded, work  # noqa: F401

from conftest import SAMPLES


def test_preflight_refuses_kimi_hidden_states_that_do_not_fit_with_the_numbers(monkeypatch):
    from eagle3_pipeline import preflight
    from eagle3_pipeline.errors import PreflightError

    monkeypatch.setattr(preflight, "disk_free", lambda path: 3_100_000_000_000)
    with pytest.raises(PreflightError) as refusal:
        preflight.check_hidden_states_disk(100_000, 100_000 * 2048, 4, 7168, "bfloat16", Path("/nvme/run/data/hidden_states"))
    assert str(refusal.value) == ("disk: ~11.7 TB for 100,000 samples x 2,048 tokens (57,344 B/token = 4 layers x 7,168 x 2 B); "
                                  "3.1 TB free at /nvme/run/data/hidden_states: refusing")
    monkeypatch.setattr(preflight, "disk_free", lambda path: 20_000_000_000_000)
    assert preflight.check_hidden_states_disk(100_000, 100_000 * 2048, 4, 7168, "bfloat16", Path("/nvme/x")).endswith(
        "20.0 TB free at /nvme/x")


def test_preflight_counts_optimizer_steps_and_recommends_smaller_steps_for_a_short_run():
    """The SmolLM2 testbed's lesson (NOTES 'Acceptance length'): under ~1,000 steps, 32K-token steps lose."""
    from eagle3_pipeline import preflight
    from eagle3_pipeline.config import TrainConfig, build_config

    required = {"target": "t", "data": "d", "vocab": "v", "output": "o"}
    short, _ = build_config(TrainConfig, required)  # defaults: 32K tokens per step, 10 epochs, 1 GPU
    line = preflight.check_optimizer_steps(short, 710_078, 0.9)  # the testbed's 1,500 conversations
    assert line.startswith("optimizer steps: ~200 (10 epochs x ~20; 32,768 tokens per step per rank x 1 rank(s))")
    assert "--total-seq-len 8192" in line
    kimi, _ = build_config(TrainConfig, {**required, "nproc": 8})  # Kimi-K2.5 at 100K x 2K tokens on 8 GPUs
    line = preflight.check_optimizer_steps(kimi, 100_000 * 2048, 0.9)
    assert line == "optimizer steps: ~7,030 (10 epochs x ~703; 32,768 tokens per step per rank x 8 rank(s))"
    small_steps, _ = build_config(TrainConfig, {**required, "total_seq_len": 8192})
    assert "--total-seq-len" not in preflight.check_optimizer_steps(small_steps, 710_078, 0.9)


def test_a_short_run_packs_8k_tokens_per_step_unless_the_flag_says_otherwise():
    """The measured winner at few steps (bench/README.md, 'Acceptance length in vLLM': 8K beat 32K) is the default."""
    from eagle3_pipeline import preflight
    from eagle3_pipeline.config import TrainConfig, build_config
    from eagle3_pipeline.training import fit_seq_len_to_run

    required = {"target": "t", "data": "d", "vocab": "v", "output": "o"}
    testbed = {"tokens": 710_078, "max_row_tokens": 1084}  # stage 01's counts for 1,500 conversations
    cfg, sources = build_config(TrainConfig, required)
    fitted, note = fit_seq_len_to_run(cfg, sources, testbed, 0.9)
    assert fitted.total_seq_len == 8192 and cfg.total_seq_len == 32768
    assert note.startswith("total_seq_len: 8,192 instead of 32,768 (default): the run would take ~200 optimizer steps")
    assert "--total-seq-len" not in preflight.check_optimizer_steps(fitted, 710_078, 0.9)
    # an explicit flag is kept; a row longer than 8K sets the floor (no row is cut); a long run keeps 32K
    flagged, flag_sources = build_config(TrainConfig, {**required, "total_seq_len": 32768})
    assert fit_seq_len_to_run(flagged, flag_sources, testbed, 0.9) == (flagged, None)
    long_rows, _ = fit_seq_len_to_run(cfg, sources, {**testbed, "max_row_tokens": 12_000}, 0.9)
    assert long_rows.total_seq_len == 12_000
    kimi, kimi_sources = build_config(TrainConfig, {**required, "nproc": 8})
    assert fit_seq_len_to_run(kimi, kimi_sources, {"tokens": 100_000 * 2048}, 0.9) == (kimi, None)
    assert fit_seq_len_to_run(cfg, sources, {}, 0.9) == (cfg, None)  # synthetic data: no counts
    # a profile's value is not an explicit flag: the rule still applies to it
    profiled, profile_sources = build_config(TrainConfig, required, "h200-8x")
    assert not profile_sources.given("total_seq_len") and profile_sources.stated("total_seq_len")
    fitted_profile, profile_note = fit_seq_len_to_run(profiled, profile_sources, testbed, 0.9)
    assert fitted_profile.total_seq_len == 8192 and "instead of 32,768 (profile:h200-8x)" in profile_note


def test_preflight_refuses_fewer_gpus_than_tensor_parallel_and_too_little_gpu_memory():
    from eagle3_pipeline import preflight
    from eagle3_pipeline.errors import PreflightError

    with pytest.raises(PreflightError) as few:
        preflight.check_gpu_count(4, 8, "--tensor-parallel-size")
    assert str(few.value) == ("gpus: 4 visible, --tensor-parallel-size 8: refusing (need at least 8 GPUs; check "
                              "CUDA_VISIBLE_DEVICES or lower --tensor-parallel-size)")
    # Kimi-K2.5 (~595 GB) over 8 x 80 GB GPUs at 0.9 utilisation: 74.4 GB each > 72 GB usable.
    with pytest.raises(PreflightError) as small:
        preflight.check_memory("target weights", 595_000_000_000, 72_000_000_000, 8, "gpu")
    assert str(small.value) == ("gpu memory: target weights 595.0 GB over 8 GPU(s) = 74.4 GB each; 72.0 GB usable "
                                "per GPU: refusing")
    assert preflight.check_memory("target weights", 595_000_000_000, 126_900_000_000, 8, "gpu").startswith("gpu memory")


def test_preflight_hidden_state_read_probe_warns_when_the_disk_is_slower_than_the_gpus(monkeypatch, tmp_path):
    from eagle3_pipeline import preflight

    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i in range(10):
        (hs / f"hs_{i}.safetensors").write_bytes(os.urandom(1 << 20))  # 10 files x 1 MiB
    tokens = 10 * (1 << 20) // 57_344  # Kimi-K2.5 bf16: 57,344 B/token
    assert preflight.check_hidden_state_reads(hs, tokens, 8).startswith(
        "hidden-state reads: not probed (10.5 MB of hidden states: the page cache holds them)")
    read, disk = [], {"gb_per_s": 1.16}  # what 8 readers got on the H200 machine's disk
    monkeypatch.setattr(preflight, "measure_cold_read_bandwidth",
                        lambda files, threads: read.append((len(files), threads)) or
                        {**disk, "threads": threads, "bytes": len(files) << 20})
    line = preflight.check_hidden_state_reads(hs, tokens, 8, probe_bytes=4 << 20, min_total_bytes=0)
    assert read == [(4, 4)]  # a spread of ~probe_bytes, one reader per file up to 8
    per_token = 10 * (1 << 20) / tokens
    assert f"8 GPU(s) at ~35,000 tokens/s each need {8 * 35_000 * per_token / 1e9:.2f} GB/s" in line
    assert f"WARNING: the disk would cap training at ~{1.16e9 / per_token / 8:,.0f} tokens/s per GPU" in line
    disk["gb_per_s"] = 16.5  # striped NVMe: enough for 8 GPUs (16.1 GB/s)
    assert "WARNING" not in preflight.check_hidden_state_reads(hs, tokens, 8, probe_bytes=4 << 20, min_total_bytes=0)


def _keeps_pages_cached(path: Path) -> bool:
    """Whether path's filesystem cannot drop pages from the page cache (tmpfs/ramfs), from /proc/self/mounts:
    known independently of the probe under test."""
    path, fstype = str(path.resolve()), ""
    mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mount, kind in sorted(mounts, key=lambda m: len(m[0])):  # the longest mount point holding path wins
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            fstype = kind
    return fstype in ("tmpfs", "ramfs")


def test_preflight_hidden_state_read_probe_really_reads_or_says_why_not(tmp_path):
    from eagle3_pipeline import preflight

    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i in range(3):
        (hs / f"hs_{i}.safetensors").write_bytes(os.urandom(4 << 20))
    line = preflight.check_hidden_state_reads(hs, 3 * (4 << 20) // 57_344, 1, min_total_bytes=0)
    # ext4/xfs let the probe evict the files first; tmpfs keeps them cached, which is reported.
    if _keeps_pages_cached(tmp_path):
        assert "no cold read here" in line
    else:
        assert "GB/s cold from" in line and "(3 readers, 12.6 MB)" in line


def test_cold_read_probe_evicts_the_files_from_the_page_cache_before_reading(tmp_path):
    from eagle3_pipeline import disk_reads

    files = [tmp_path / f"hs_{i}.safetensors" for i in range(2)]
    for path in files:
        path.write_bytes(os.urandom(4 << 20))
        path.read_bytes()  # now cached
    assert disk_reads.page_cache_resident_fraction(files) == 1.0
    if _keeps_pages_cached(tmp_path):  # tmpfs: the pages cannot leave the cache, said instead of a flattering figure
        with pytest.raises(OSError, match="stayed in the page cache"):
            disk_reads.measure_cold_read_bandwidth(files, threads=2)
        pytest.skip(f"{tmp_path}: this filesystem keeps pages cached (tmpfs): the refusal is checked, eviction cannot be")
    measured = disk_reads.measure_cold_read_bandwidth(files, threads=2)
    assert (measured["how"], measured["bytes"], measured["threads"]) == ("evicted", 8 << 20, 2)
    disk_reads.evict_from_page_cache(files)
    assert disk_reads.page_cache_resident_fraction(files) <= 0.05


def test_extract_check_refuses_a_disk_too_small_and_writes_nothing(capsys, monkeypatch, work, kimi_target):
    from eagle3_pipeline import preflight, sizing

    shutil.rmtree(work["hs"])
    monkeypatch.setattr(preflight, "disk_free", lambda path: 1_500)
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"],
                          "--check")
    tokens = manifest(work["data"])["counts"]["tokens"]
    rows = manifest(work["data"])["counts"]["rows"]
    assert code == 5
    assert error == (f"disk: ~{sizing.human_bytes(tokens * 4 * 128 * 4)} for {rows:,} samples x {tokens / rows:,.0f} "
                     f"tokens (2,048 B/token = 4 layers x 128 x 4 B); 1.5 KB free at {work['hs']}: refusing")
    assert not list(work["hs"].glob("*"))


def test_extract_check_refuses_missing_gpus_memory_and_an_old_vllm(capsys, monkeypatch, work, kimi_target):
    from eagle3_pipeline import preflight
    from eagle3_pipeline.extract import vllm_backend

    args = ["extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"], "--check",
            "--backend", "vllm"]
    monkeypatch.setattr(preflight, "probe_gpus", lambda: [80_000_000_000] * 4)
    code, error = refused(capsys, *args, "--tensor-parallel-size", 8)
    assert (code, error) == (5, "gpus: 4 visible, --tensor-parallel-size 8: refusing (need at least 8 GPUs; check "
                                "CUDA_VISIBLE_DEVICES or lower --tensor-parallel-size)")
    monkeypatch.setattr(preflight, "target_weights_bytes", lambda path: 595_000_000_000)
    code, error = refused(capsys, *args, "--tensor-parallel-size", 4)
    assert (code, error) == (5, "gpu memory: target weights 595.0 GB over 4 GPU(s) = 148.8 GB each; 72.0 GB usable "
                                "per GPU: refusing")
    monkeypatch.setattr(preflight, "target_weights_bytes", lambda path: 1_000_000)
    monkeypatch.setattr(vllm_backend, "vllm_installed_version", lambda: "0.24.0")
    monkeypatch.setattr(vllm_backend, "_vllm_source", lambda relative: None)
    code, error = refused(capsys, *args, "--tensor-parallel-size", 4)
    assert (code, error) == (5, "versions: deepseek-final-layer: vLLM 0.24.0 does not return the final layer (6) for "
                                "DeepSeek-style backbones (deepseek_v3); fixed by vLLM PR #46973, vLLM >= 0.25.0: "
                                "upgrade vLLM: refusing")


def test_train_check_refuses_a_transformers_without_the_kimi_config(capsys, monkeypatch, work, kimi_target, tmp_path):
    from eagle3_pipeline import preflight

    monkeypatch.setattr(preflight, "transformers_knows", lambda model_type: False)
    code, error = refused(capsys, *_train(work, kimi_target, tmp_path / "ckpt", "--check"))
    assert code == 5
    assert error.startswith("versions: speculators 0.9.0, transformers ") and error.endswith(
        ": refusing (transformers " + error.split("transformers ")[1].split(",")[0] + " has no 'kimi_k25' config, which "
        "speculators needs to read the verifier; install transformers >= 5.19 (see requirements.txt))")
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def test_every_stage_check_prints_its_estimate_and_writes_nothing(capsys, caplog, work, kimi_target, tmp_path):
    import logging

    caplog.set_level(logging.INFO, logger="eagle3")
    tmp_path = tmp_path / "new"
    checks = {
        "prepare": ["--profile", "cpu-mini", "--target", kimi_target, "--data", SAMPLES / "conversations.jsonl",
                    "--output", tmp_path / "data"],
        "vocab": ["--profile", "cpu-mini", "--data", work["data"], "--output", tmp_path / "vocab"],
        "train": _train(work, kimi_target, tmp_path / "ckpt")[1:],
        "export": ["--checkpoints", work["checkpoints"], "--output", tmp_path / "draft"],
    }
    for stage, args in checks.items():
        caplog.clear()
        succeeded(capsys, stage, *args, "--check")
        assert "preflight disk: ~" in caplog.text, (stage, caplog.text[-2000:])
        if stage == "train":  # 04's --check ends with the run plan, for its own GPUs and epochs
            rows, tokens = (json.loads((work["data"] / "manifest.json").read_text())["counts"][k] for k in ("rows", "tokens"))
            assert f"{rows:,} rows, {tokens:,} tokens (stage 01's" in caplog.text and "recommendation: bf16" in caplog.text
            assert "run plan: " in caplog.text and "1 training GPU(s), 2 epochs" in caplog.text, caplog.text[-2000:]
    shutil.rmtree(work["hs"])
    caplog.clear()
    succeeded(capsys, "extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"], "--check")
    assert "preflight disk: ~" in caplog.text and "preflight host memory: target weights" in caplog.text
    assert "run plan: " in caplog.text and "profile cpu-mini" in caplog.text and "hidden states: bf16 " in caplog.text
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name in ("data", "vocab", "ckpt", "draft")]
    assert written == [] and not (tmp_path / "draft").exists()


def test_fsdp_shards_the_drafts_training_state_over_the_ranks_in_the_memory_check():
    """A 5-layer DFlash draft at Kimi-K2.5's width (04's estimate: 70.6 GB) is refused on one 80 GB card (seen on one
    H100, bench/README.md "Draft kinds beside EAGLE-3"); with --fsdp over the box's 8 ranks its fp32 weights, grads and
    AdamW state are sharded, and the check counts one rank's share (the frozen parts whole)."""
    from types import SimpleNamespace

    from eagle3_pipeline import preflight
    from eagle3_pipeline.errors import PreflightError
    from eagle3_pipeline.sizing import draft_parameters

    saved, trainable = draft_parameters(7168, 163840, 32000, 5)
    head = 32000 * 7168
    one = SimpleNamespace(nproc=1, nnodes=1, fsdp=False, optimizer="adamw")
    need, what = preflight.train_memory_need(one, saved, trainable, head)
    assert what == "draft + frozen verifier head" and round(need / 1e9, 1) == 70.6
    with pytest.raises(PreflightError, match=r"70\.6 GB; 42\.5 GB usable"):
        preflight.check_memory(what, need, 42_500_000_000, 1, "gpu")
    ddp = SimpleNamespace(nproc=8, nnodes=1, fsdp=False, optimizer="adamw")
    assert preflight.train_memory_need(ddp, saved, trainable, head)[0] == need  # DDP: every rank holds it all
    fsdp = SimpleNamespace(nproc=8, nnodes=1, fsdp=True, optimizer="adamw")
    sharded, what = preflight.train_memory_need(fsdp, saved, trainable, head)
    assert what == "draft + frozen verifier head (draft state sharded over 8 ranks)"
    frozen = (saved - trainable) * 2 + head * 2
    assert sharded == int(trainable * 16 / 8 + frozen) and sharded < 42_500_000_000
    assert preflight.check_memory(what, sharded, 42_500_000_000, 1, "gpu").startswith("gpu memory")
    two_nodes = SimpleNamespace(nproc=8, nnodes=2, fsdp=True, optimizer="adamw")
    assert preflight.train_memory_need(two_nodes, saved, trainable, head)[0] == int(trainable * 16 / 16 + frozen)
