"""bench/vllm_gpu.py and bench/chat_data.py: the parts that decide figures, without a GPU or vLLM."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_gpu = load("vllm_gpu")
chat_data = load("chat_data")


def counts(drafts: int, accepted_per_pos: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": drafts * len(accepted_per_pos),
            "num_accepted_tokens": sum(accepted_per_pos), "accepted_per_pos": accepted_per_pos}


def test_tau_is_one_plus_accepted_per_draft_and_warm_up_counts_are_subtracted():
    before = counts(10, [9, 9, 9])  # warm-up: every token accepted
    after = counts(110, [9 + 60, 9 + 30, 9 + 10])
    summary = vllm_gpu.spec_summary(before, after)
    assert summary["num_drafts"] == 100
    assert summary["tau"] == pytest.approx(1 + (60 + 30 + 10) / 100)
    assert summary["acceptance_per_pos"] == pytest.approx([0.6, 0.3, 0.1])
    # accepted length L in {0..3} with P(L>=1)=.6, P(L>=2)=.3, P(L>=3)=.1: var = E[L^2] - E[L]^2
    mean, second = 1.0, 0.6 + 3 * 0.3 + 5 * 0.1
    assert summary["tau_stderr"] == pytest.approx(((second - mean**2) / 100) ** 0.5)


def test_an_engine_without_drafts_reports_no_tau():
    assert vllm_gpu.spec_summary(counts(5, [1]), counts(5, [1]))["tau"] is None


def test_same_fraction_counts_prompts_whose_whole_output_matches():
    assert vllm_gpu.same_fraction([[1, 2], [3], [4]], [[1, 2], [3, 0], [4]]) == pytest.approx(2 / 3)


def test_prompts_from_a_module_cover_code_and_docs_kinds(tmp_path):
    source = tmp_path / "demo.py"
    source.write_text(
        '"""A demo module for parsing small configuration files into dictionaries of values.\n\n'
        'Each line holds one key and one value, separated by an equals sign."""\n\n'
        "def parse_line(line, sep='='):\n"
        '    """Split one configuration line into a stripped key and value pair."""\n'
        "    key, _, value = line.partition(sep)\n"
        "    return key.strip(), value.strip()\n"
    )
    prompts = chat_data.code_prompts("demo", source)
    kinds = {p["kind"] for p in prompts}
    assert {"module_purpose", "doc_summary"} <= kinds
    assert kinds & {"code_explain", "code_review", "code_rewrite"}
    assert all(p["turns"] and isinstance(p["turns"][0], str) for p in prompts)
    code_prompt = next(p for p in prompts if p["kind"].startswith("code_") and p["kind"] != "code_write")
    assert "def parse_line" in code_prompt["turns"][0]


def test_the_train_eval_split_is_by_module_and_stable():
    modules = [f"module{i}" for i in range(400)]
    first = [chat_data.is_eval_module(m) for m in modules]
    assert first == [chat_data.is_eval_module(m) for m in modules]  # deterministic, no seed state
    share = sum(first) / len(first)
    assert 0.05 < share < 0.3  # EVAL_FRACTION 0.15 of the modules, by hash


def test_extraction_vs_prefill_rows_are_deterministic_and_both_sides_get_stage_02s_settings():
    evp = load("extraction_vs_prefill")
    rows = evp.make_rows(1000, 50, 16, 2048)
    assert rows == evp.make_rows(1000, 50, 16, 2048)  # the same rows on every run and machine
    lengths = [len(r["input_ids"]) for r in rows]
    assert 16 <= min(lengths) and max(lengths) <= 2048 and max(lengths) > 8 * min(lengths)  # very different lengths
    assert all(len(r["loss_mask"]) == len(r["input_ids"]) and any(r["loss_mask"]) for r in rows)
    assert all(0 <= t < 1000 for r in rows for t in r["input_ids"])

    class Args:
        max_num_seqs, dtype, compile, gpu_memory_utilization = 128, None, False, 0.8

    gpu = evp.engine_settings(Args, on_cpu=False)
    assert gpu == {"max_num_seqs": 128, "dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": 0.8}
    assert evp.settings_flags(gpu) == ["--max-num-seqs", "128", "--dtype", "bfloat16", "--enforce-eager",
                                       "--gpu-memory-utilization", "0.8"]
    assert evp.engine_settings(Args, on_cpu=True)["dtype"] == "float32"


def test_one_invocation_runs_stage_02_per_storage_writer_and_writeback_the_first_under_the_storages_name():
    evp = load("extraction_vs_prefill")
    plain = evp.stage_02_runs(["dtype", "fp8"], None, None, stock_fp8=True)  # no new flags: the runs as before
    assert [(r["key"], r["variant"], r["env"]) for r in plain] == [
        ("dtype", "dtype", {}), ("fp8", "fp8", {}), ("fp8_host_quantized", "fp8-stock", {evp.CONNECTOR_ENV: "stock"})]
    assert {r["writeback"] for r in plain} == {"writer"}  # unset: stage 02's default, recorded as such
    runs = evp.stage_02_runs(["dtype"], ["safetensors", "raw"], ["on", "off"], stock_fp8=True)
    assert [r["key"] for r in runs] == ["dtype", "dtype_writer_safetensors_writeback_off", "dtype_writer_raw_writeback_on",
                                        "dtype_writer_raw_writeback_off"]
    assert [(r["writer"], r["writeback"]) for r in runs] == [("safetensors", "on"), ("safetensors", "off"),
                                                             ("raw", "on"), ("raw", "off")]
    assert runs[3]["env"] == {evp.WRITER_ENV: "raw", evp.LANDING_WRITEBACK_ENV: "off"}
    assert runs[3]["variant"] == "dtype-writer-raw-writeback-off"  # its logs' name
    assert [r["env"] for r in evp.stage_02_runs(["fp8"], ["raw"], None, stock_fp8=False)] == [{evp.WRITER_ENV: "raw"}]
    # the writeback A/B with the connector-side start: one run per mode and storage, the mode in its env and key
    modes = evp.stage_02_runs(["dtype", "fp8"], None, ["on", "off", "writer"], stock_fp8=False)
    assert [r["key"] for r in modes] == ["dtype", "dtype_writeback_off", "dtype_writeback_writer",
                                         "fp8", "fp8_writeback_off", "fp8_writeback_writer"]
    assert modes[2]["env"] == {evp.LANDING_WRITEBACK_ENV: "writer"} and modes[2]["writeback"] == "writer"
    # h200_vllm_gpu.sh extract-width passes --stock-fp8 before the caller's flags: a later --no-stock-fp8 drops that run
    parsed = evp.build_parser().parse_args(["--work", "w", "--storages", "dtype", "fp8", "--stock-fp8", "--no-stock-fp8"])
    assert parsed.stock_fp8 is False and evp.build_parser().parse_args(["--stock-fp8"]).stock_fp8 is True


def test_the_extraction_bound_is_the_slower_of_the_prefill_and_the_disks_durable_bytes():
    evp = load("extraction_vs_prefill")
    disk = {"writeback": {"device_gb_per_s": 2.0, "page_cache_gb_per_s": 2.1},
            "kernel_pace": {"device_gb_per_s": 1.5, "page_cache_gb_per_s": 25.0}}
    stage_02 = {"bytes_per_token": 50_000, "device_tokens_per_s": 30_000, "tokens_per_s": 30_100, "disk": disk}
    bound = evp.bound_of(stage_02, {"tokens_per_s": 400_000})
    assert bound["bound"] == "disk" and bound["disk_device_gb_per_s"] == 2.0  # the disk's better way
    assert bound["bound_tokens_per_s"] == 40_000 and bound["ratio_to_bound"] == 0.75
    assert bound["ratio_to_bound_page_cache"] == 30_100 / 400_000  # the page cache takes 500,000 tokens/s
    slow_prefill = evp.bound_of(stage_02, {"tokens_per_s": 20_000})
    assert slow_prefill["bound"] == "prefill" and slow_prefill["ratio_to_bound"] == 1.5
    assert evp.bound_of({"device_tokens_per_s": 1.0}, {"tokens_per_s": 2.0}) == {}  # no disk measured: no bound


def test_a_job_wait_leaves_at_most_eight_files_for_the_device_to_return_the_results_json_among_them(tmp_path):
    """Fails before fit_out: the 2026-12-05 hold's job-wait left 13 files in $OUT, and the device (which returns at most
    8) left the job's results JSON behind. Past 8 files, all but the *.json go into one extras.tgz."""
    import tarfile

    jobs, out = tmp_path / "jobs", tmp_path / "out"
    job = jobs / "vs06"
    (job / "sub").mkdir(parents=True)
    (job / "gpu-acceptance-smollm2.json").write_text('{"tau": 1.6}')
    for i in range(9):
        (job / f"engine-{i}.log").write_text(f"log {i}\n")
    (job / "sub" / "deep.txt").write_text("kept in the archive")
    (job / "rc").write_text("0\n")
    env = {**os.environ, "H200_JOBS_DIR": str(jobs), "OUT": str(out)}
    result = subprocess.run(["bash", str(REPO / "bench" / "h200_vllm_gpu.sh"), "job-wait", "0", "vs06"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "vs06 finished, rc 0" in result.stdout and "11 files packed" in result.stdout
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["extras.tgz", "vs06/gpu-acceptance-smollm2.json"]
    with tarfile.open(out / "extras.tgz") as archive:
        names = sorted(archive.getnames())
    assert "./vs06/rc" in names and "./vs06/sub/deep.txt" in names and len(names) == 11
    small = tmp_path / "small"  # at most 8 files: left as they are
    subprocess.run(["bash", str(REPO / "bench" / "h200_vllm_gpu.sh"), "job-wait", "0", "none"],
                   env={**env, "OUT": str(small)}, capture_output=True, text=True, timeout=60, check=True)
    assert not (small / "extras.tgz").exists()


def test_a_wait_the_device_cuts_short_still_brings_back_what_the_bench_has_so_far(tmp_path):
    """Fails before the snapshots: a wait copied into $OUT only when it returned, so a call cut at the session's last
    device second (the device kills it and brings back what $OUT holds then) brought back nothing of a bench that had
    run for many minutes. Now every H200_SNAPSHOT_S seconds $OUT holds partial.tgz; a wait that returns removes it."""
    import signal
    import tarfile
    import time

    bg, out = tmp_path / "acceptance-out", tmp_path / "out"
    bg.mkdir()
    (bg / "bench.log").write_text("training ours\n")
    records = tmp_path / "work" / "bench-acceptance-gpu"
    (records / "logs").mkdir(parents=True)
    (records / "logs" / "04-ours.log").write_text("epoch 3\n")
    (records / "vllm-k5.json").write_text('{"ours": {"tau": 2.5}}')
    env = {**os.environ, "H200_BG_OUT": str(bg), "H200_SNAPSHOT_S": "5", "OUT": str(out)}
    script = str(REPO / "bench" / "h200_vllm_gpu.sh")
    wait = subprocess.Popen(["bash", script, "acceptance-wait", "600"], env=env, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out / "partial.tgz").is_file() and time.monotonic() < deadline and wait.poll() is None:
            time.sleep(0.5)
        assert (out / "partial.tgz").is_file(), "no snapshot within 60 s"
    finally:
        os.killpg(wait.pid, signal.SIGKILL)  # as the device cuts the call: no trap, no clean-up
        wait.wait()
    with tarfile.open(out / "partial.tgz") as archive:
        names = set(archive.getnames())
        assert {"./bench.log", "./records.tgz"} <= names
        with tarfile.open(fileobj=archive.extractfile("./records.tgz")) as inner:
            assert {"vllm-k5.json", "logs/04-ours.log"} <= set(inner.getnames())

    (bg / "gpu-acceptance-smollm2.json").write_text('{"tau": 2.5}')
    (bg / "rc").write_text("0\n")
    done = subprocess.run(["bash", script, "acceptance-wait", "600"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "bench-acceptance finished, rc 0" in done.stdout, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "gpu-acceptance-smollm2.json", "rc", "records.tgz"]
