"""Training tokens/s at Kimi-K2.5 geometry: plain `speculators train` vs our `04_train.py`.

One invocation, on one GPU machine, on the same data:
  1. measures the bf16 matmul peak (the MFU denominator) and the disk's cold read speed;
  2. writes a head-only Kimi-K2.5 verifier (real config, random embed/lm_head/norm) and a
     synthetic prepared dataset (random hidden states [2048, 4, 7168]) under --workdir;
  3. runs (a) plain `speculators train` with its defaults and (b) ours with the shipped
     defaults, a fixed number of steps after warm-up each, in subprocesses;
  4. prints tokens/s, the step split (fetch/fwd/bwd/opt), peak memory, MFU and the FLOP
     count per token, and writes bench/results/<gpu>-train.json (both runs, ratio, mfu; each 04_train
     run's `draft` as trained and the landed `ours_draft`, by which the screen's projection prices its classes).

    python bench/train_throughput.py                       # plain vs ours, one GPU
    python bench/train_throughput.py --runs plain ours --ddp 2   # + ours on 2 GPUs (torchrun)
    python bench/train_throughput.py --variant 'x=--total-seq-len 16384'   # speculators flag sets
    python bench/train_throughput.py --runs ours --ours-variant '48k=--total-seq-len 49152'  # 04_train + flags
    python bench/train_throughput.py --runs --trace   # where ours' step time goes, per GPU kernel
    python bench/train_throughput.py --runs ours --draft-vocabs 64000 163840   # ours at other draft vocabularies
    python bench/train_throughput.py --runs ours --draft-vocabs 64000 163840 --ours-seq-len 16384   # 80 GB card
    python bench/train_throughput.py --runs ours --kinds dflash peagle dspark   # each draft kind's step at Kimi width
    python bench/train_throughput.py --cold-warm      # ours from files not in page cache vs cached, bf16 and fp8

Random data: the numbers say how fast, never how well (bench/README.md, "Training throughput").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchlib import screen, throughput
from eagle3_pipeline.compat.sample_check import OFF_ENV as INPUT_CHECKS_ENV
from eagle3_pipeline.disk_reads import measure_cold_read_bandwidth
from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.hidden_states import HS_DIRNAME, StateFormat, hs_file, hs_files
from eagle3_pipeline.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]

ROW_TOKENS = 2048          # tokens per synthetic row (the row is one document)
DRAFT_VOCAB = 32000        # the draft vocab every run uses (plain's own default is the full vocab)
# Kimi's pad token: passing a mask token id keeps speculators from loading a tokenizer,
# which the head-only verifier does not have.
MASK_TOKEN_ID = throughput.KIMI_K25_TEXT_CONFIG["pad_token_id"]

# Our recommended training defaults as speculators flags (reasons: NOTES.md, "Training defaults and why"),
# for `--ours-via flags`: speculators train + DevicePrefetchLoader through this script's own
# launcher. The default, `--ours-via 04_train`, runs the pipeline's stage 04 instead.
OURS_FLAGS = ["--total-seq-len", "32768", "--optimizer", "adamw", "--log-freq", "10",
              "--num-workers", "8", "--prefetch-factor", "2"]


def gpu_slug(name: str) -> str:
    return name.lower().replace("nvidia", "").strip().replace(" ", "-") or "gpu"


class GpuMemoryPoller:
    """Peak `nvidia-smi` memory.used on the given GPUs while a run lasts (any process)."""

    def __init__(self, gpus: list[str], interval: float = 0.5):
        self.gpus, self.interval, self.peak_mib = gpus, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-i", ",".join(map(str, self.gpus))]
        while not self._stop.is_set():
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
                self.peak_mib = max([self.peak_mib, *(int(x) for x in out.split() if x.isdigit())])
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.interval)

    def __enter__(self) -> GpuMemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def speculators_argv(verifier: Path, data: Path, run_dir: Path, max_steps: int) -> list[str]:
    """Plain `speculators train` with its defaults, plus only what this setup needs."""
    return ["--verifier-name-or-path", str(verifier), "--data-path", str(data),
            "--save-path", str(run_dir / "checkpoints"), "--log-dir", str(run_dir / "logs"),
            "--draft-vocab-size", str(DRAFT_VOCAB), "--mask-token-id", str(MASK_TOKEN_ID),
            "--epochs", "1", "--max-steps", str(max_steps)]


def run_child(args: argparse.Namespace) -> None:
    """Inside a run's subprocess: speculators' trainer with the metric sink."""
    rank = os.environ.get("RANK", "0")
    metrics = Path(f"{args.metrics}.rank{rank}")
    throughput.run_speculators_train(args.train_argv, metrics, stop_after_step=args.stop_after,
                                     device_prefetch=args.device_prefetch)


def run_trace_child(args: argparse.Namespace) -> None:
    """Inside a `--trace` run's subprocess: 04_train.py in this process, with torch.profiler
    recording GPU kernels over `--steps` steps after `--after-step` (unlogged steps, so the
    logged steps' synchronisation is not in the picture). Writes the kernel table there."""
    import runpy

    import torch
    from speculators.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
    original = Trainer._optimizers_step
    state = {"step": 0}

    def step_with_profiler(self):
        original(self)
        state["step"] += 1
        if state["step"] in (args.after_step, args.after_step + args.steps) and torch.cuda.is_available():
            torch.cuda.synchronize()  # the window holds exactly its steps' kernels
        if state["step"] == args.after_step:
            profiler.start()
            state["start"] = time.perf_counter()
        elif state["step"] == args.after_step + args.steps:
            wall_ms = (time.perf_counter() - state["start"]) * 1e3 / args.steps
            profiler.stop()
            write_kernel_report(profiler, out, args.steps, wall_ms)

    Trainer._optimizers_step = step_with_profiler
    sys.argv = [args.script, *args.script_argv]
    runpy.run_path(args.script, run_name="__main__")


def write_kernel_report(profiler, out: Path, steps: int, wall_ms: float) -> None:
    """GPU time per kernel class and the top kernels, per step (kernels.json, kernels.txt),
    and the trace itself (trace.json.gz, for chrome://tracing or Perfetto). Wall time minus
    kernel time is the GPU's idle time (launch gaps, waits for data, host syncs)."""
    events = [e for e in profiler.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    by_class: dict[str, float] = {}
    for e in events:
        cls = kernel_class(e.key)
        by_class[cls] = by_class.get(cls, 0.0) + e.self_device_time_total / 1e3 / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:60]
    report = {"steps": steps, "wall_ms_per_step": wall_ms, "gpu_ms_per_step": sum(by_class.values()),
              "ms_per_step_by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
              "top_kernels": [{"name": e.key[:200], "class": kernel_class(e.key), "calls_per_step": e.count / steps,
                               "ms_per_step": e.self_device_time_total / 1e3 / steps} for e in top]}
    lines = [f"{report['gpu_ms_per_step']:.1f} ms of GPU kernels per step of {wall_ms:.1f} ms wall (profiled)"]
    lines += [f"  {name:<22}{ms:9.1f} ms" for name, ms in report["ms_per_step_by_class"].items()]
    lines += ["top kernels (ms/step, calls/step):"]
    lines += [f"  {k['ms_per_step']:8.2f} {k['calls_per_step']:6.1f}  [{k['class']}] {k['name'][:110]}"
              for k in report["top_kernels"]]
    (out / "kernels.txt").write_text("\n".join(lines) + "\n")
    trace = out / "trace.json"
    profiler.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(out / "trace.json.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    # Last: the bench stops the run as soon as kernels.json exists (a stop during the gzip cut
    # a trace short on the H200).
    (out / "kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(lines), flush=True)


def kernel_class(name: str) -> str:
    """A coarse class for a CUDA kernel name (cuBLAS/CUTLASS GEMM, flex attention, Triton
    fusions, copies, ...), for the per-class split of `--trace`."""
    lowered = name.lower()
    rules = (("memcpy", "copy"), ("memset", "memset"), ("nccl", "nccl"),
             # Inductor's only Triton templates without max-autotune are flex attention's.
             ("flex", "flex_attention"), ("triton_tem", "flex_attention"),
             ("gemm", "gemm"), ("nvjet", "gemm"), ("xmma", "gemm"), ("cutlass", "gemm"), ("wgmma", "gemm"),
             ("triton_red", "triton_reduction"), ("triton_per", "triton_reduction"),
             ("triton_poi", "triton_pointwise"), ("triton", "triton_other"),
             ("reduce", "aten_reduction"), ("elementwise", "aten_elementwise"),
             ("cat", "aten_cat_copy"), ("copy", "aten_cat_copy"))
    return next((cls for key, cls in rules if key in lowered), "other")


def launch(name: str, command: list[str], *, gpus: list[int], log: Path, timeout: float,
           stop_when=None, env_extra: dict | None = None) -> dict:
    """Run one training command; with `stop_when`, kill its process group once that is true
    (a benchmark needs neither the final checkpoint nor the validation pass)."""
    print(f"[{name}] {shlex.join(command)}", flush=True)
    # Run indices count within the bench's own CUDA_VISIBLE_DEVICES (so one bench can run on
    # GPU 1 while something else uses GPU 0); nvidia-smi wants the physical ids.
    physical = visible_gpus(gpus)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ",".join(physical), **(env_extra or {})}
    start = time.perf_counter()
    with GpuMemoryPoller(physical) as poller, open(log, "w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
        # The run has its own session (so a stop kills torchrun and every rank); if the bench
        # itself is stopped, take the run down too: an orphan kept training and writing
        # checkpoints into the next run's directory (seen on the H200).
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            code = _wait(proc, start, timeout, stop_when)
        finally:
            signal.signal(signal.SIGTERM, previous)
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return {"exit": code, "wall_s": time.perf_counter() - start,
            "peak_gpu_memory_used_gib": poller.peak_mib / 1024}


def _wait(proc: subprocess.Popen, start: float, timeout: float, stop_when) -> int | str:
    """The run's exit code, or why it must be stopped (measured window complete, timeout);
    `launch` kills a run that is still alive."""
    while (code := proc.poll()) is None:
        if stop_when is not None and stop_when():
            return "stopped after the measured window"
        if time.perf_counter() - start > timeout:
            return "timeout"
        time.sleep(1)
    return code


def free_cached_gpu_memory() -> None:
    """Give back the blocks torch's caching allocator keeps after the bench wrote its verifier or data on the GPU: the
    runs share the card with this process, and on one H100 80GB it held 13.8 GiB through a run that then ran out of
    memory (2026-12-07, results/h100-hold-2026-12-07b/train-1-driver.log)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def visible_gpus(gpus: list[int]) -> list[str]:
    """The physical GPU ids of run indices `gpus`, through an inherited CUDA_VISIBLE_DEVICES."""
    inherited = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if not inherited:
        return [str(g) for g in gpus]
    if max(gpus, default=-1) >= len(inherited):
        raise SystemExit(f"a run needs {max(gpus) + 1} GPUs, CUDA_VISIBLE_DEVICES={','.join(inherited)} has "
                         f"{len(inherited)}")
    return [inherited[g].strip() for g in gpus]


def window_complete(metrics: Path, warmup: int, steps: int) -> bool:
    """True once two logged steps >= `warmup` lie at least `steps` apart."""
    if not metrics.is_file():
        return False
    logged = [r["global_step"] for r in read_metrics(metrics)
              if r.get("profile") and r.get("global_step", -1) >= warmup]
    return len(logged) >= 2 and max(logged) - min(logged) >= steps


# A log line that names why a run failed, most telling first: the OOM itself, then a Python exception line (not the
# launchers' wrappers around it), then a stage's one-line `error:`, then any line that says error/killed.
_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
_EXCEPTION = re.compile(r"^\s*(?:\[rank\d+\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt))(?::\s.*|:?\s*)$")
_WRAPPERS = ("ChildFailedError", "CalledProcessError")
_ERRORISH = re.compile(r"\berror\b|\bkilled\b|\bfatal\b|\btimed? ?out\b", re.IGNORECASE)


def last_error_line(log_text: str, limit: int = 500) -> str | None:
    """The last meaningful error line of a run's log (e.g. `torch.OutOfMemoryError: CUDA out of memory. Tried to
    allocate ...`): the last line saying out of memory, else the last exception line that is not a launcher's
    wrapper (torchrun's ChildFailedError), else the last `error: ...` line (a stage's own), else the last line that
    says error or killed, else the last non-empty line; None for an empty log. Cut to `limit` characters."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    if not lines:
        return None

    def exception(line: str) -> bool:
        match = _EXCEPTION.match(line)
        return bool(match) and not match.group(1).endswith(_WRAPPERS)

    for test in (lambda line: bool(_OOM.search(line)) and (exception(line) or "CUDA out of memory" in line),
                 lambda line: bool(_OOM.search(line)), exception, lambda line: line.startswith("error:"),
                 lambda line: bool(_ERRORISH.search(line)), lambda line: True):
        found = next((line for line in reversed(lines) if test(line)), None)
        if found:
            return found[:limit]
    return None


def failed_run(outcome: dict, why: str, metrics_files: list[Path], log: Path | None) -> dict:
    """The record of a run that gave no measured window (an OOM, a crash, a timeout): why, the log's last error
    line, the peak GPU memory nvidia-smi saw while it lasted (`outcome`'s) and the trainer's own peak from any
    step it logged before failing."""
    text = log.read_text(errors="replace") if log is not None and log.is_file() else ""
    record = {**outcome, "failed": True, "failure": f"{why} (exit {outcome.get('exit')})",
              "error": last_error_line(text) or why, **({"log": str(log)} if log is not None else {})}
    records = [r for p in metrics_files if p.is_file() for r in _read_metrics_safely(p)]
    allocated = [r["max_memory_allocated"] for r in records if r.get("max_memory_allocated")]
    if allocated:
        record["max_memory_allocated_gib"] = max(allocated) / 2**30
    record["logged_steps"] = sum(1 for r in records if r.get("profile"))
    return record


def _read_metrics_safely(path: Path) -> list[dict]:
    try:
        return list(read_metrics(path))
    except (OSError, ValueError):
        return []


def summarize(name: str, outcome: dict, metrics: Path, world: int, warmup: int,
              flops_per_token: float | None, peak_tflops: float, log: Path | None = None) -> dict:
    """A run's figures over its measured window; a run without one (no metrics, or under two logged steps after the
    warm-up: an OOM, a crash, a timeout) becomes a failed record (failed_run) and the bench goes on. MFU only where a
    FLOP count applies (`flops_per_token` None: the kind has no FLOP model here)."""
    per_rank = sorted(metrics.parent.glob(metrics.name + ".rank*")) or (
        [metrics] if metrics.is_file() else [])
    if not per_rank:
        return failed_run(outcome, "no metrics written", [], log)
    try:
        summaries = [throughput.summarize_train_metrics(read_metrics(p),
                                                        warmup_steps=warmup) for p in per_rank]
    except (OSError, ValueError, KeyError) as exc:
        return failed_run(outcome, str(exc), per_rank, log)
    first = summaries[0]
    # Our child writes one file per rank; 04_train writes rank 0's only (all ranks run the
    # same step on the same number of tokens under DDP).
    tokens_per_s = sum(s["tokens_per_s"] for s in summaries) * (world if len(summaries) == 1 else 1)
    return {
        **outcome, **first, "gpus": world, "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world,
        "mfu": (tokens_per_s / world * flops_per_token / (peak_tflops * 1e12)) if flops_per_token else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/eagle3-train-bench"))
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--runs", nargs="*", default=["plain", "ours"],
                        help="one-GPU runs (none: only the --ddp run)")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=FLAGS: an extra run of speculators train with these flags")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="steps left out of the measurement (compile, autotune, caches)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run (min)")
    parser.add_argument("--ours-variant", action="append", default=[],
                        help="NAME=FLAGS: an extra one-GPU run of 04_train.py with these flags added")
    parser.add_argument("--draft-vocabs", type=int, nargs="+", default=[], metavar="N",
                        help="also run ours with a draft vocabulary of N tokens each (its own stage 03 output over the "
                             "same data; N >= the target's = the whole vocabulary, d2t all zero): runs ours-vocab-N, "
                             "each with its FLOP count and MFU at that width (issue 61: 32000 64000 163840)")
    parser.add_argument("--ours-seq-len", type=int, default=None, metavar="N",
                        help="tokens per step of every 04_train run (ours, --ours-variant runs unless their flags set "
                             "--total-seq-len, --draft-vocabs, --kinds, --ddp, --trace, --cold-warm); default: the "
                             "--ours-profile's total_seq_len (04's default where it sets none). E.g. 16384 on an 80 GB "
                             "card, so the 64K and 163,840 draft vocabularies run beside 32K at the same step")
    parser.add_argument("--kinds", nargs="+", default=[], metavar="KIND",
                        help="also one 04_train run per draft kind after the EAGLE-3 runs (ours-KIND: --speculator-type "
                             "KIND with its own speculators defaults, the mask token Kimi's [PAD]), each with tokens/s, "
                             "step ms and peak memory; FLOP count and MFU only for eagle3 (the FLOP model counts "
                             "EAGLE-3's draft; none for the others). Issue 62: dflash peagle dspark dflash2")
    parser.add_argument("--kinds-fsdp", type=int, default=0, metavar="N",
                        help="run each --kinds run on N GPUs sharded with 04 --fsdp (ours-KIND-fsdpN): the 5-layer block "
                             "drafts at Kimi-K2.5's width do not fit one 80 GB card unsharded")
    parser.add_argument("--ddp", type=int, default=0, help="also run ours on N GPUs (torchrun)")
    parser.add_argument("--distinct-files", type=int, default=48,
                        help="distinct hidden-state files (rows beyond share them by hard link)")
    parser.add_argument("--ours-via", choices=("04_train", "flags"),
                        default="04_train" if (REPO / "eagle3-train" / "04_train.py").is_file() else "flags",
                        help="ours = eagle3-train/04_train.py with its shipped defaults (default), or "
                        "speculators train with OURS_FLAGS + device prefetch")
    parser.add_argument("--ours-profile", default="h200-8x",
                        help="04_train profile for ours (--nproc is set per run)")
    parser.add_argument("--loader-check", choices=("on", "off", "both", "both-off-first", "alternate",
                                                   "alternate-off-first"), default="on",
                        help="stage 04's input checks (every sample as the loader reads it, and the non-finite "
                             "loss check) in the 04_train runs: both = each such run also without them (its "
                             "name + '-no-input-checks'), so one invocation measures their cost in tokens/s; "
                             "alternate = on, off, on, off (--loader-check-pairs pairs; alternate-off-first: "
                             "off, on, ...), the cost reported per adjacent pair and as means, so an order "
                             "effect shows")
    parser.add_argument("--loader-check-pairs", type=int, default=2,
                        help="--loader-check alternate: on/off pairs per 04_train run (default 2)")
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--trace", action="store_true",
                        help="also run ours once under torch.profiler (not measured): GPU time per "
                        "kernel class and the top kernels -> <results>/trace-ours/kernels.{txt,json}, trace.json.gz")
    parser.add_argument("--run-timeout", type=float, default=420)
    parser.add_argument("--cold-warm", action="store_true",
                        help="instead of the runs: ours on files kept out of the page cache (cold) vs the same run "
                        "with them cached (warm), in bf16 and in fp8")
    parser.add_argument("--cold-warm-files", type=int, default=192,
                        help="distinct 2048-token hidden-state files per format (192: 22.5 GB bf16, 11.3 GB fp8 of "
                        "Kimi states; rows beyond are hard links to them); each format's data is deleted after its runs")
    parser.add_argument("--cold-warm-steps", type=int, default=30,
                        help="measured steps per cold/warm run, after warm-up + 3x the loader's read-ahead")
    parser.add_argument("--cold-warm-order", choices=("warm-first", "cold-first"), default="warm-first",
                        help="which of each format's two runs goes first (run both to see an order effect)")
    sub = parser.add_subparsers(dest="child")
    child = sub.add_parser("_child")
    child.add_argument("--metrics", required=True)
    child.add_argument("--stop-after", type=int, required=True)
    child.add_argument("--device-prefetch", action="store_true")
    child.add_argument("train_argv", nargs=argparse.REMAINDER)
    trace = sub.add_parser("_trace")
    trace.add_argument("--out", required=True)
    trace.add_argument("--after-step", type=int, required=True)
    trace.add_argument("--steps", type=int, default=3)
    trace.add_argument("script")
    trace.add_argument("script_argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.child == "_trace":
        return run_trace_child(args)
    if args.child == "_child":
        args.train_argv = [a for a in args.train_argv if a != "--"]
        return run_child(args)
    kind_names(args.kinds)  # a kind 04 does not train: refused in one line before anything is measured

    import torch

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "commit": _git_commit(), "torch": torch.__version__}

    # 1. The bf16 ceiling, measured here and now.
    peak = throughput.measure_bf16_matmul_peak()
    report["gpu"] = peak["device_name"]
    report["bf16_matmul"] = peak
    print(f"bf16 matmul peak {peak['peak_tflops']:.0f} TFLOP/s on {peak['device_name']}", flush=True)

    # 2. Verifier and data (reused when present).
    verifier, data = work / "verifier", work / "data"
    if not (verifier / "model.safetensors").is_file():
        throughput.write_head_only_verifier(verifier, device="cuda")
        free_cached_gpu_memory()
    geometry = throughput.kimi_draft_geometry(verifier, draft_vocab_size=DRAFT_VOCAB)
    if args.cold_warm:  # its own datasets, one format at a time
        return cold_warm(args, work, verifier, geometry, report)
    # Each run logs every log_freq steps; size the data for the longest run.
    plan = _plan_runs(args)
    report["ours_seq_len"] = ours_seq_len_record(args)  # the 04 runs' tokens per step (a run's own flag wins)
    rows_needed = max(p["rows"] for p in plan.values())
    if not (data / "dataset_info.json").is_file() or _dataset_rows(data) < rows_needed:
        info = throughput.write_synthetic_prepared_dataset(
            data, num_rows=rows_needed, seq_len=ROW_TOKENS, hidden_size=geometry.hidden_size,
            vocab_size=throughput.KIMI_K25_TEXT_CONFIG["vocab_size"],
            distinct_files=args.distinct_files, device="cuda")
        free_cached_gpu_memory()
        report["data"] = info
    bytes_per_token = StateFormat().bytes_per_token(geometry.hidden_size, throughput.HIDDEN_STATE_SLOTS)
    # The trainer shifts each row by one token: documents of ROW_TOKENS - 1.
    mean_keys = throughput.mean_attended_keys([ROW_TOKENS - 1], 2048)
    flops = throughput.train_flops_per_token(geometry, mean_keys)
    report["flops_per_token"] = flops.as_dict()
    report["geometry"] = geometry.__dict__
    report["muon_flops_per_step"] = throughput.muon_step_flops(geometry.muon_matrix_shapes())
    _print_flops(flops)

    distinct = hs_files(data / HS_DIRNAME)[: args.distinct_files]
    if not args.skip_disk:
        report["disk_direct"] = [measure_cold_read_bandwidth(distinct, threads=t, how="direct")
                                 for t in (1, 8)]
        for r in report["disk_direct"]:
            print(f"disk O_DIRECT read, {r['threads']} threads: {r['gb_per_s']:.2f} GB/s", flush=True)

    # 3. The runs.
    runs: dict = {}
    report["ours_draft"] = screen.landed_draft()  # ours' draft config now (its runs' `draft`: what each trained)
    report["runs"] = runs
    vocab = work / "vocab"
    if any(spec.get("via_04") for spec in plan.values()):
        from eagle3_pipeline.target import default_aux_layer_ids

        throughput.write_synthetic_stage_manifests(
            verifier, data, vocab, aux_layer_ids=default_aux_layer_ids(geometry_layers(verifier)),
            draft_vocab_size=DRAFT_VOCAB)
    run_vocab, run_flops = {}, {}  # --draft-vocabs: each such run's stage 03 output and FLOP count at its width
    for name, spec in plan.items():
        size = min(spec.get("draft_vocab", DRAFT_VOCAB), throughput.KIMI_K25_TEXT_CONFIG["vocab_size"])
        run_vocab[name] = vocab if size == DRAFT_VOCAB else work / f"vocab-{size}"
        if size != DRAFT_VOCAB:
            throughput.write_synthetic_vocab(verifier, data, run_vocab[name], draft_vocab_size=size)
            geometry_n = throughput.kimi_draft_geometry(verifier, draft_vocab_size=size)
            run_flops[name] = throughput.train_flops_per_token(geometry_n, mean_keys)
            report.setdefault("draft_vocab_flops_per_token", {})[name] = {"draft_vocab_size": size,
                                                                         **run_flops[name].as_dict()}
    for name, spec in plan.items():
        run_dir = work / "runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        gpus = list(range(spec["gpus"]))
        if spec.get("via_04"):
            # Ours: the pipeline's stage 04 with its shipped defaults (draft_config.json +
            # the profile), on the same data, stopped once the window is measured.
            metrics = run_dir / "out" / "metrics.jsonl"
            command = [sys.executable, str(REPO / "eagle3-train" / "04_train.py"),
                       "--profile", args.ours_profile, "--target", str(verifier),
                       "--data", str(data), "--vocab", str(run_vocab[name]), "--output", str(run_dir / "out"),
                       "--nproc", str(spec["gpus"]), "--epochs", "1",
                       "--max-steps", str(spec["stop"] + spec["log_freq"] + 2), *spec["flags"]]
            if spec.get("trace"):
                trace_dir = args.results / "trace-ours"
                shutil.rmtree(trace_dir, ignore_errors=True)
                command = [sys.executable, __file__, "_trace", "--out", str(trace_dir),
                           "--after-step", str(spec["warmup"] + 1), *command[1:]]
                outcome = launch(name, command, gpus=gpus, log=run_dir / "log.txt", timeout=args.run_timeout,
                                 stop_when=lambda d=trace_dir: (d / "kernels.json").is_file())
                print((trace_dir / "kernels.txt").read_text() if (trace_dir / "kernels.txt").is_file()
                      else (run_dir / "log.txt").read_text()[-4000:], flush=True)
                continue
            # --loader-check: stage 04's per-sample loader check and non-finite-loss check on or off
            checks = {} if spec.get("input_checks", True) else {INPUT_CHECKS_ENV: "off"}
            outcome = launch(name, command, gpus=gpus, log=run_dir / "log.txt",
                             timeout=args.run_timeout, env_extra=checks,
                             stop_when=lambda m=metrics, w=spec["warmup"]: window_complete(m, w, args.steps))
        else:
            metrics = run_dir / "metrics.jsonl"
            train_argv = speculators_argv(verifier, data, run_dir, spec["stop"] + 2) + spec["flags"]
            command = [sys.executable, __file__, "_child", "--metrics", str(metrics),
                       "--stop-after", str(spec["stop"])] + (
                           ["--device-prefetch"] if spec["prefetch"] else []) + ["--", *train_argv]
            if spec["gpus"] > 1:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={spec['gpus']}", *command[1:]]
            outcome = launch(name, command, gpus=gpus, log=run_dir / "log.txt",
                             timeout=args.run_timeout)
        flop_total = run_flops.get(name, flops).total if has_flop_model(spec) else None
        runs[name] = summarize(name, outcome, metrics, spec["gpus"], spec["warmup"],
                               flop_total, peak["peak_tflops"], log=run_dir / "log.txt")
        if spec.get("kind"):  # --kinds: which kind, and whether a FLOP count applies
            runs[name]["speculator_type"] = spec["kind"]
            runs[name]["flops_per_token"] = (flops.as_dict() if flop_total else
                                             f"none: benchlib.throughput counts EAGLE-3's draft, not {spec['kind']}'s")
        if name in run_flops:
            runs[name]["draft_vocab_size"] = report["draft_vocab_flops_per_token"][name]["draft_vocab_size"]
        runs[name]["command"] = shlex.join(command)
        runs[name]["device_prefetch"] = spec["prefetch"]
        runs[name]["planned_tokens_per_step"] = spec["total_seq_len"]  # the packing asked (--total-seq-len)
        if spec.get("via_04"):
            runs[name]["input_checks"] = spec.get("input_checks", True)
            # what it trained (bench/acceptance.py's projection prices each screen class by the run of its draft)
            try:
                runs[name]["draft"] = run_draft(args, spec["flags"], spec.get("kind"))
            except ConfigError as exc:  # 04 refused the same config: the run failed and prices nothing
                runs[name]["draft"] = None
                print(f"[{name}] its draft: {exc}", flush=True)
        _print_run(name, runs[name])
        if "error" in runs[name]:
            print((run_dir / "log.txt").read_text()[-4000:], flush=True)
        report["runs"] = runs
        _write_report(report, args.results)  # after every run: a cut-off bench keeps its runs

    # 4. Ratio, MFU, read bandwidth, table.
    if "tokens_per_s" in runs.get("plain", {}) and "tokens_per_s" in runs.get("ours", {}):
        report["ratio"] = runs["ours"]["tokens_per_s"] / runs["plain"]["tokens_per_s"]
        report["mfu"] = runs["ours"].get("mfu")
    for name, pairs in input_check_pairs(plan, runs).items():  # --loader-check alternate
        report.setdefault("input_checks_pairs", {})[name] = pairs
        _print_pairs(name, pairs)
    for name, run in runs.items():  # --loader-check both: tokens/s lost to the input checks
        without = runs.get(f"{name}-no-input-checks", {})
        if "tokens_per_s" in run and "tokens_per_s" in without and "alternate" not in plan.get(name, {}):
            cost = 1 - run["tokens_per_s"] / without["tokens_per_s"]
            report.setdefault("input_checks_cost", {})[name] = cost
            print(f"[{name}] input checks cost {100 * cost:.2f}% of tokens/s ({run['tokens_per_s']:,.0f} with, "
                  f"{without['tokens_per_s']:,.0f} without)", flush=True)
    for run in runs.values():
        if "tokens_per_s_per_gpu" in run:
            run["read_gb_per_s_per_gpu"] = throughput.required_read_bandwidth(
                run["tokens_per_s_per_gpu"], bytes_per_token)
    if not args.skip_disk:
        report["disk_evicted"] = measure_cold_read_bandwidth(distinct, threads=8)
    out = _write_report(report, args.results)
    _print_table(report)
    print(f"wrote {out}")


def cold_warm(args: argparse.Namespace, work: Path, verifier: Path, geometry, report: dict) -> None:
    """Does training keep the GPU fed from files that are not in page cache? Per format, the same one-GPU
    run of ours twice on one dataset: "warm" after every file was read into the page cache, "cold" while
    a PageCacheEvictor keeps them out of it, so every read goes to the disk (as in a real run, whose
    states are many times the RAM). Rows are hard links to --cold-warm-files distinct files: a long
    window without a dataset the size of the disk. The window starts after warm-up plus three times the
    loader's read-ahead (num_workers x prefetch_factor batches, filled while the first step compiles and
    drained at the disk's pace), so it measures the steady state."""
    from eagle3_pipeline.target import default_aux_layer_ids

    resolved = _resolved_04_config(args)
    read_ahead = int(resolved.get("num_workers", 8)) * int(resolved.get("prefetch_factor", 2))
    seq_len = ours_seq_len(args)
    rows_per_step = max(seq_len // ROW_TOKENS, 1)
    log_freq = int(resolved.get("log_freq", 10))  # the profile's: each logged step synchronises the GPU
    skip = args.warmup_steps + 3 * read_ahead
    rows = int((skip + args.cold_warm_steps + 2 * log_freq + 4) * rows_per_step / 0.9) + 2  # 0.9: the validation split
    states = ("warm", "cold") if args.cold_warm_order == "warm-first" else ("cold", "warm")
    report["ours_seq_len"] = ours_seq_len_record(args)
    report["cold_warm_settings"] = {"tokens_per_step": seq_len, "read_ahead_batches": read_ahead, "skipped_steps": skip,
                                    "window_steps": args.cold_warm_steps, "rows": rows, "log_freq": log_freq,
                                    "distinct_files": args.cold_warm_files, "order": list(states)}
    report["cold_warm"] = {}
    for storage in ("dtype", "fp8"):
        base = work / f"cold-warm-{storage}"
        data, vocab = base / "data", base / "vocab"
        shutil.rmtree(base, ignore_errors=True)
        info = throughput.write_synthetic_prepared_dataset(
            data, num_rows=rows, seq_len=ROW_TOKENS, hidden_size=geometry.hidden_size,
            vocab_size=throughput.KIMI_K25_TEXT_CONFIG["vocab_size"], distinct_files=args.cold_warm_files,
            device="cuda", storage=storage)
        throughput.write_synthetic_stage_manifests(
            verifier, data, vocab, aux_layer_ids=default_aux_layer_ids(geometry_layers(verifier)),
            draft_vocab_size=DRAFT_VOCAB, storage=storage)
        files = [hs_file(data / HS_DIRNAME, i) for i in range(info["distinct_files"])]
        result: dict = {"data": info, "bytes": sum(f.stat().st_size for f in files)}
        if storage == "dtype" and not args.skip_disk:  # the disk's own cold read rate, on the same files
            report["disk_direct"] = [measure_cold_read_bandwidth(files, threads=t, how="direct") for t in (1, 8)]
            report["disk_evicted"] = measure_cold_read_bandwidth(files, threads=8)
            for r in [*report["disk_direct"], report["disk_evicted"]]:
                print(f"disk read, {r['how']}, {r['threads']} threads: {r['gb_per_s']:.2f} GB/s", flush=True)
        for state in states:
            name = f"cold-warm-{storage}-{state}"
            run_dir = work / "runs" / name
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            metrics = run_dir / "out" / "metrics.jsonl"
            command = [sys.executable, str(REPO / "eagle3-train" / "04_train.py"), "--profile", args.ours_profile,
                       "--target", str(verifier), "--data", str(data), "--vocab", str(vocab),
                       "--output", str(run_dir / "out"), "--nproc", "1", "--epochs", "1", "--total-seq-len", str(seq_len),
                       "--max-steps", str(skip + args.cold_warm_steps + 2 * log_freq + 2)]
            if state == "warm":
                preread = throughput.read_into_page_cache(files)
                page_cache = {"preread": preread, "resident_fraction": throughput.page_cache_resident_fraction(files)}
                evictor = contextlib.nullcontext()
            else:
                evictor = throughput.PageCacheEvictor(files)
            with evictor:
                outcome = launch(name, command, gpus=[0], log=run_dir / "log.txt", timeout=args.run_timeout,
                                 stop_when=lambda: window_complete(metrics, skip, args.cold_warm_steps))
            if state == "cold":
                page_cache = evictor.stats()
            try:
                summary = throughput.summarize_train_metrics(read_metrics(metrics), warmup_steps=skip)
            except (OSError, ValueError) as exc:  # no figures rather than zeros: a refusal, a timeout
                print((run_dir / "log.txt").read_text()[-4000:], flush=True)
                print(f"[{name}] no figures: {exc} (exit {outcome.get('exit')})", flush=True)
                result[state] = {**outcome, "error": str(exc), "page_cache": page_cache}
                continue
            result[state] = {**outcome, **summary, "page_cache": page_cache, "command": shlex.join(command)}
            print(f"[{name}] {summary['tokens_per_s']:,.0f} tokens/s over steps {skip}-"
                  f"{skip + summary['measured_steps']}, fetch {summary['step_split_ms'].get('fetch_ms', 0):.0f} ms "
                  f"median; page cache {page_cache}", flush=True)
        if all("tokens_per_s" in result.get(state, {}) for state in ("warm", "cold")):
            result["cold_over_warm"] = result["cold"]["tokens_per_s"] / result["warm"]["tokens_per_s"]
            print(f"[cold-warm-{storage}] cold/warm {result['cold_over_warm']:.3f} ({len(files)} files, "
                  f"{result['bytes'] / 1e9:.1f} GB, read {rows_per_step * ROW_TOKENS * info['hidden_state_bytes_per_token'] / 1e9:.2f} "
                  f"GB a step)", flush=True)
        report["cold_warm"][storage] = result
        shutil.rmtree(base, ignore_errors=True)  # a 64 GiB disk holds one format's data at a time
        _write_report(report, args.results, suffix="cold-warm-train")
    print(f"wrote {_write_report(report, args.results, suffix='cold-warm-train')}")


def _write_report(report: dict, results: Path, suffix: str = "train") -> Path:
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{gpu_slug(report['gpu'])}-{suffix}.json"
    out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return out


def _plan_runs(args: argparse.Namespace) -> dict[str, dict]:
    """GPU count, warm-up, stop step and data rows of each run.

    A run logs every log_freq steps (0, L, 2L, ...): the window runs from the first logged
    step >= warm-up to the first logged step >= `--steps` later. 04_train's log_freq and
    tokens/step come from its config (the profile's train section, else its defaults), so
    its stop step is only an upper bound; the bench stops it once the window is complete.
    """
    specs: dict[str, dict] = {}
    via_04 = args.ours_via == "04_train"
    ours = ({"via_04": True, "flags": [], "prefetch": True} if via_04
            else {"flags": list(OURS_FLAGS), "prefetch": True})
    for name in args.runs:
        if name == "plain":
            specs[name] = {"flags": [], "prefetch": False, "gpus": 1}
        elif name == "ours":
            specs[name] = {**ours, "gpus": 1}
    for item in args.variant:
        name, _, flags = item.partition("=")
        specs[name] = {"flags": shlex.split(flags.replace("+prefetch", "")),
                       "prefetch": "+prefetch" in flags, "gpus": 1}
    for item in args.ours_variant:
        name, _, flags = item.partition("=")
        specs[name] = {"via_04": True, "flags": shlex.split(flags), "prefetch": True, "gpus": 1}
    for size in getattr(args, "draft_vocabs", []):  # 04 runs over another stage 03 vocabulary each
        specs[f"ours-vocab-{size}"] = {"via_04": True, "flags": [], "prefetch": True, "gpus": 1, "draft_vocab": size}
    if args.ddp > 1:
        specs[f"ours-{args.ddp}gpu"] = {**ours, "gpus": args.ddp}
    shards = getattr(args, "kinds_fsdp", 0)  # the kinds sharded with FSDP over N GPUs (a 5-layer DFlash at Kimi width)
    for kind in kind_names(getattr(args, "kinds", [])):  # after the EAGLE-3 runs: 04 with each kind's own defaults
        specs[f"ours-{kind}" + (f"-fsdp{shards}" if shards > 1 else "")] = {
            "via_04": True, "prefetch": True, "gpus": max(shards, 1), "kind": kind,
            "flags": ["--speculator-type", kind, "--mask-token-id", str(MASK_TOKEN_ID), *(["--fsdp"] if shards > 1 else [])]}
    checks = getattr(args, "loader_check", "on")
    for name in [n for n, spec in specs.items() if spec.get("via_04")]:
        if checks == "off":
            specs[name]["input_checks"] = False
        elif checks == "both":  # the same run without the checks, right after it
            specs[f"{name}-no-input-checks"] = {**specs[name], "input_checks": False}
        elif checks == "both-off-first":  # the same pair in the other order (a run's place in an invocation matters)
            specs = {(f"{n}-no-input-checks" if n == name else n): ({**spec, "input_checks": False} if n == name else spec)
                     for n, spec in specs.items()}
            specs[name] = {**specs[f"{name}-no-input-checks"], "input_checks": True}
        elif checks in ("alternate", "alternate-off-first"):  # on, off, on, off (or off, on, ...) back to back
            sequence = alternate_run_names(name, getattr(args, "loader_check_pairs", 2),
                                           off_first=checks == "alternate-off-first")
            base = specs[name]
            specs = {n: spec for n, spec in specs.items() if n != name}  # the sequence goes last, in its order
            for run_name, on in sequence:
                specs[run_name] = {**base, "input_checks": on, "alternate": {"of": name, "sequence": sequence}}
    if getattr(args, "trace", False):
        specs["trace"] = {"via_04": True, "flags": [], "prefetch": True, "gpus": 1, "trace": True}
    resolved = _resolved_04_config(args) if any(spec.get("via_04") for spec in specs.values()) else {}
    for spec in specs.values():
        flags = spec["flags"]
        if spec.get("via_04"):  # 04_train's resolved config, unless the run's own flags set it
            log_freq = int(resolved.get("log_freq", 50))  # unknown: allow up to 50
            seq = ours_seq_len(args)
            if "--total-seq-len" not in flags:  # a new list: runs share their flag lists
                spec["flags"] = flags = [*flags, "--total-seq-len", str(seq)]
        else:  # speculators' defaults
            log_freq, seq = 1, 8192
        log_freq = int(flags[flags.index("--log-freq") + 1]) if "--log-freq" in flags else log_freq
        seq = int(flags[flags.index("--total-seq-len") + 1]) if "--total-seq-len" in flags else seq
        warmup = -(-args.warmup_steps // log_freq) * log_freq
        stop = warmup + max(-(-args.steps // log_freq), 1) * log_freq
        spec.update(warmup=warmup, stop=stop, log_freq=log_freq, total_seq_len=seq,
                    rows=int((stop + 3) * max(seq // ROW_TOKENS, 1) * spec["gpus"] / 0.9) + 2)
    return specs


def kind_names(kinds: list[str]) -> list[str]:
    """--kinds: each a kind stage 04 trains (draft_kinds.trainable), once each in order; another refused in one line."""
    from eagle3_pipeline import draft_kinds

    for name in kinds:
        try:
            draft_kinds.trainable(name)
        except ConfigError as exc:
            raise SystemExit(f"--kinds {name}: {exc}") from None
    return list(dict.fromkeys(kinds))


def has_flop_model(spec: dict) -> bool:
    """benchlib.throughput's FLOP count is EAGLE-3's draft (fc, a Llama layer per TTT step, the draft lm_head): it
    applies to the eagle3 runs only, not to another kind's (a block of mask tokens through 5 Qwen3 layers, ...)."""
    from eagle3_pipeline import draft_kinds

    return spec.get("kind") is None or draft_kinds.kind(spec["kind"]).eagle3_settings


def alternate_run_names(name: str, pairs: int, *, off_first: bool = False) -> list[tuple[str, bool]]:
    """--loader-check alternate: (run name, checks on) in run order; pair k (from 1) is named
    `name[-k]` (on) and `name-no-input-checks[-k]` (off), as `both` names its single pair."""
    if pairs < 1:
        raise SystemExit(f"--loader-check-pairs {pairs}: at least 1")
    out = []
    for k in range(1, pairs + 1):
        suffix = "" if k == 1 else f"-{k}"
        pair = [(f"{name}{suffix}", True), (f"{name}-no-input-checks{suffix}", False)]
        out.extend(reversed(pair) if off_first else pair)
    return out


def input_check_pairs(plan: dict[str, dict], runs: dict[str, dict]) -> dict[str, dict]:
    """--loader-check alternate: the checks' cost (1 - tokens/s with / without) of each adjacent on/off
    pair in run order (on, off, on, off gives on-first, off-first, on-first pairs), the mean over the
    disjoint pairs (runs 1+2, 3+4, ...), and the means by order: when the on-first and off-first means
    differ, a run's place in the invocation moves tokens/s (warm caches, clocks, the page cache) and
    the mean over both orders is the fairer figure."""
    out: dict[str, dict] = {}
    for spec in plan.values():
        info = spec.get("alternate")
        if not info or info["of"] in out:
            continue
        sequence = info["sequence"]
        rate = {run_name: runs.get(run_name, {}).get("tokens_per_s") for run_name, _ in sequence}
        pairs = []
        for (first, first_on), (second, _) in zip(sequence, sequence[1:]):
            on, off = (first, second) if first_on else (second, first)
            pair = {"runs": [first, second], "order": "on-first" if first_on else "off-first",
                    "tokens_per_s_on": rate[on], "tokens_per_s_off": rate[off]}
            if rate[on] and rate[off]:
                pair["cost"] = 1 - rate[on] / rate[off]
            pairs.append(pair)

        def mean(costs: list) -> float | None:
            costs = [c for c in costs if c is not None]
            return sum(costs) / len(costs) if costs else None

        disjoint = [pair.get("cost") for pair in pairs[::2]]
        out[info["of"]] = {
            "sequence": [run_name for run_name, _ in sequence], "pairs": pairs,
            "mean_cost": mean(disjoint) if None not in disjoint else None,
            "mean_cost_on_first": mean([p.get("cost") for p in pairs if p["order"] == "on-first"]),
            "mean_cost_off_first": mean([p.get("cost") for p in pairs if p["order"] == "off-first"]),
            "mean_cost_adjacent": mean([p.get("cost") for p in pairs]),
        }
    return out


def _print_pairs(name: str, pairs: dict) -> None:
    for pair in pairs["pairs"]:
        cost = pair.get("cost")
        print(f"[{name}] input checks, {pair['order']} pair {' + '.join(pair['runs'])}: "
              + (f"cost {100 * cost:.2f}% ({pair['tokens_per_s_on']:,.0f} with, {pair['tokens_per_s_off']:,.0f} without)"
                 if cost is not None else "a run failed"), flush=True)
    figures = {key: pairs[key] for key in ("mean_cost", "mean_cost_on_first", "mean_cost_off_first",
                                           "mean_cost_adjacent") if pairs[key] is not None}
    print(f"[{name}] input checks cost: " + ", ".join(f"{key} {100 * value:.2f}%" for key, value in figures.items()),
          flush=True)


def ours_seq_len(args: argparse.Namespace) -> int:
    """Tokens per step of the bench's 04_train runs: --ours-seq-len, else the profile's (kimi_run_seq_len)."""
    given = getattr(args, "ours_seq_len", None)
    if given is not None and given < ROW_TOKENS:
        raise SystemExit(f"--ours-seq-len {given}: at least one {ROW_TOKENS}-token row per step")
    return int(given) if given is not None else kimi_run_seq_len(args.ours_profile)


def ours_seq_len_record(args: argparse.Namespace) -> dict:
    """The report's record of the 04 runs' tokens per step and where it came from."""
    given = getattr(args, "ours_seq_len", None)
    return {"tokens_per_step": ours_seq_len(args),
            "source": "--ours-seq-len" if given is not None else f"profile {args.ours_profile}"}


def kimi_run_seq_len(profile: str) -> int:
    """Tokens per step of a Kimi-size run under `profile` (its value, else 04's default). The bench passes
    it as a flag: its synthetic datasets are a few hundred steps long, where 04 would pack 8K-token steps
    instead (training.fit_seq_len_to_run; a cold-vs-warm run on 2026-12-01 measured 8K steps so)."""
    from eagle3_pipeline.config import STAGE_CONFIGS, load_profile

    default = STAGE_CONFIGS["train"].model_fields["total_seq_len"].default
    return int(load_profile(profile).get("train", {}).get("total_seq_len", default))


def run_draft(args: argparse.Namespace, flags: list[str], kind: str | None = None) -> dict:
    """The draft a 04_train run with `flags` trains: the draft config 04 resolves (the profile's, or the flags'
    --draft-config) with the norm flags among its --extra-args applied as speculators reads them; a --kinds run's
    with its `speculator_type` (its EAGLE-3 keys are not passed to speculators: draft_kinds.architecture_flags)."""
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG, load_draft_config

    resolved = _resolved_04_config(args, flags)
    path = resolved.get("draft_config") or (flags[flags.index("--draft-config") + 1] if "--draft-config" in flags
                                            else DEFAULT_DRAFT_CONFIG)
    extra = resolved["extra_args"] if "extra_args" in resolved else screen.extra_args_of(flags)
    draft = load_draft_config(path).model_dump(exclude={"description"})
    if kind is not None:
        draft["speculator_type"] = kind
    return screen.trained_draft(draft, extra)


def _resolved_04_config(args: argparse.Namespace, flags: list[str] | None = None) -> dict:
    """04_train's resolved train config (its `--print-config`: `key = value  # source`), with a run's `flags`."""
    work = args.workdir
    command = [sys.executable, str(REPO / "eagle3-train" / "04_train.py"), "--profile",
               args.ours_profile, "--target", str(work / "verifier"), "--data", str(work / "data"),
               "--vocab", str(work / "vocab"), "--output", str(work / "runs" / "ours" / "out"),
               "--nproc", "1", *(flags or []), "--print-config"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    resolved = {}
    for line in out.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and not key.startswith("#"):
            try:
                resolved[key.strip()] = json.loads(value.split("  #")[0])
            except json.JSONDecodeError:
                continue
    return resolved


def geometry_layers(verifier: Path) -> int:
    return int(json.loads((verifier / "config.json").read_text())["text_config"]["num_hidden_layers"])


def _dataset_rows(data: Path) -> int:
    try:
        from datasets import load_from_disk

        return len(load_from_disk(str(data)))
    except Exception:  # noqa: BLE001 - any unreadable dataset is rebuilt
        return 0


def _git_commit() -> str | None:
    """HEAD, with "+modified" when tracked files differ from it (a copied working tree can
    carry an older .git than its files: the H200 copies did)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return (head + ("+modified" if git("status", "--porcelain", "--untracked-files=no") else "")) or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _print_flops(flops: throughput.FlopCount) -> None:
    print("FLOP per token (matmuls; backward: decoder 2x, fc 1x weight grad, lm_head 1x input grad)")
    for term in flops.forward:
        print(f"  {term:<14} fwd {flops.forward[term] / 1e9:7.3f} G   bwd {flops.backward[term] / 1e9:7.3f} G")
    print(f"  {'total':<14} fwd {flops.forward_total / 1e9:7.3f} G   bwd {flops.backward_total / 1e9:7.3f} G"
          f"   = {flops.total / 1e9:.3f} GFLOP/token", flush=True)


def _print_run(name: str, run: dict) -> None:
    if "error" in run or "tokens_per_s" not in run:
        print(f"[{name}] FAILED ({run.get('failure', 'no figures')}): {run.get('error')}; GPU memory peak "
              f"{run.get('peak_gpu_memory_used_gib', 0):.1f} GiB (nvidia-smi)", flush=True)
        return
    split = run["step_split_ms"]
    print(f"[{name}] {run['tokens_per_s']:,.0f} tokens/s  MFU {_fmt_mfu(run.get('mfu'))}  step "
          f"{split.get('step_ms', 0):.0f} ms (fetch {split.get('fetch_ms', 0):.0f} fwd "
          f"{split.get('fwd_ms', 0):.0f} bwd {split.get('bwd_ms', 0):.0f} opt "
          f"{split.get('opt_ms', 0):.0f})  peak alloc {run['max_memory_allocated_gib']:.1f} GiB "
          f"(nvidia-smi {run['peak_gpu_memory_used_gib']:.1f})", flush=True)


def _fmt_mfu(mfu: float | None) -> str:
    return "none" if mfu is None else f"{mfu:.1%}"


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  torch {report['torch']}  commit {report['commit']}  {report['date']}")
    print(f"bf16 peak {report['bf16_matmul']['peak_tflops']:.0f} TFLOP/s; "
          f"{report['flops_per_token']['total'] / 1e9:.2f} GFLOP/token")
    print(f"{'run':<14}{'GPUs':>5}{'tok/step':>10}{'tokens/s':>11}{'MFU':>7}{'step ms':>9}"
          f"{'fetch':>7}{'fwd':>6}{'bwd':>6}{'opt':>6}{'alloc GiB':>10}{'read GB/s':>10}")
    for name, run in report["runs"].items():
        if "tokens_per_s" not in run or "step_split_ms" not in run:
            print(f"{name:<14} failed: {run.get('error')} (nvidia-smi peak "
                  f"{run.get('peak_gpu_memory_used_gib', 0):.1f} GiB)")
            continue
        s = run["step_split_ms"]
        print(f"{name:<14}{run['gpus']:>5}{run['tokens_per_step']:>10.0f}{run['tokens_per_s']:>11,.0f}"
              f"{_fmt_mfu(run.get('mfu')):>7}{s.get('step_ms', 0):>9.0f}{s.get('fetch_ms', 0):>7.0f}"
              f"{s.get('fwd_ms', 0):>6.0f}{s.get('bwd_ms', 0):>6.0f}{s.get('opt_ms', 0):>6.0f}"
              f"{run['max_memory_allocated_gib']:>10.1f}{run.get('read_gb_per_s_per_gpu', 0):>10.2f}")
    if "ratio" in report:
        print(f"ratio ours/plain {report['ratio']:.2f}   MFU ours {report['mfu']:.1%}")
    for r in report.get("disk_direct", []):
        print(f"disk O_DIRECT {r['threads']} thread(s): {r['gb_per_s']:.2f} GB/s")
    if "disk_evicted" in report:
        print(f"disk cold (evicted, read through the page cache), 8 threads: {report['disk_evicted']['gb_per_s']:.2f} GB/s")


if __name__ == "__main__":
    main()
