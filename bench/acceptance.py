"""Acceptance benchmark: does the draft speed anything up? (issue 7)

One invocation, on the CPU, with vLLM's CPU build:
  1. builds (or reuses) the organism: a small real Llama chat model trained on the standard
     library's sources (eagle3_pipeline.organism), with held-out conversations and prompts;
  2. ours: the five stages with the pipeline's defaults on those conversations;
  3. plain: `speculators train` with its own defaults on the same prepared data and hidden
     states, the same number of epochs (= optimizer steps), through its CLI flags;
  4. in vLLM: the organism alone, then with each draft (speculative_config eagle3, k draft
     tokens), greedy, on the held-out prompts; tau and per-position acceptance from vLLM's
     spec-decode counters, tokens/s with and without the draft;
  5. prints the table (tau ours vs plain, their ratio, the offline estimate beside vLLM's)
     and writes bench/results/cpu-acceptance.json.

    python bench/acceptance.py                        # ours vs plain (make bench-acceptance)
    python bench/acceptance.py --recipes vocab-512 ttt-1 layers-2 data-2x
                                                      # + recipe variants of ours
    python bench/acceptance.py --ks 1 2 3             # measure every k (one engine per k)

Flags that only the CPU forces are the same for both runs and listed in the results
(`cpu_forced`): sdpa attention, eager loss, no dataloader workers, a shorter packed length.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eagle3-train"
sys.path.insert(0, str(SCRIPTS))

from eagle3_pipeline.acceptance import (  # noqa: E402
    VllmSettings, measure_acceptance, offline_estimate, read_val_metrics,
)
from eagle3_pipeline.organism import OrganismSettings, build_organism  # noqa: E402

# Packed tokens per training step. speculators' default (8192) makes each CPU step attend over
# 8192 x 8192 positions per TTT step; 1024 holds one or two conversations and cost ~8x less
# per epoch on this 2-core box. Both runs use it (a CPU constraint, not a recipe choice).
CPU_TOTAL_SEQ_LEN = 1024
# One torch thread per stage process. With torch's default (one per core) a 2-core box that
# also runs other jobs oversubscribes, and every parallel region waits for a descheduled
# thread: measured on stage 04 here, 30-70 tokens/s with 2 threads vs 1,400-3,200 with 1.
TORCH_THREADS = 1
CPU_TRAIN_FLAGS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
                   "--total-seq-len", str(CPU_TOTAL_SEQ_LEN)]

# Recipe variants of ours: extra flags per stage. Each trains a draft on the same prepared data
# (data-2x prepares twice the conversations) for the same number of epochs.
RECIPES = {
    "vocab-512": {"vocab": ["--draft-vocab-size", "512"]},      # 25% of the target vocab (Kimi: 32000/163840 = 20%)
    "ttt-1": {"train": ["--ttt-steps", "1"]},                   # no test-time training beyond step 0
    "ttt-5": {"train": ["--ttt-steps", "5"]},
    "layers-2": {"draft_config": {"num_layers": 2}},            # two draft decoder layers
    "data-2x": {"samples_factor": 2},                           # twice the conversations
}


def run(cmd: list[str], log_path: Path, what: str) -> float:
    """Run a command with output to log_path; returns its wall seconds; raises on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(TORCH_THREADS))}
    start = time.perf_counter()
    with open(log_path, "ab") as log:
        log.write(("$ " + shlex.join(cmd) + "\n").encode())
        log.flush()
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{what} failed (exit {result.returncode}); log {log_path}:\n{tail}")
    print(f"  {what}: {seconds:.0f} s", flush=True)
    return seconds


def stage(name: str, *args) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *map(str, args)]


def prepare_data(organism, work: Path, samples: int, layer_ids: list[int], logs: Path) -> dict:
    data = work / "data"
    times = {}
    times["01_prepare"] = run(stage("01_prepare_dataset.py", "--target", organism.model_dir, "--data",
                                    organism.conversations_path, "--output", data, "--max-samples", samples,
                                    "--max-seq-len", 1024), logs / "01_prepare.log", f"01 prepare ({samples} conversations)")
    times["02_extract"] = run(stage("02_extract_hidden_states.py", "--target", organism.model_dir, "--data", data,
                                    "--backend", "hf", "--device", "cpu", "--dtype", "float32",
                                    "--layer-ids", *layer_ids), logs / "02_extract.log", "02 extract (HF, fp32)")
    return {"dir": data, "times": times}


def train_ours(organism, data: Path, out: Path, epochs: int, logs: Path, recipe: dict) -> dict:
    """Stages 03-05 with the pipeline defaults (plus the recipe's overrides); returns the draft."""
    out.mkdir(parents=True, exist_ok=True)
    config_args = []
    if recipe.get("draft_config"):
        draft_config = {**json.loads((REPO / "draft_config.json").read_text()), **recipe["draft_config"]}
        (out / "draft_config.json").write_text(json.dumps(draft_config, indent=2))
        config_args = ["--draft-config", out / "draft_config.json"]
    times = {}
    times["03_vocab"] = run(stage("03_build_vocab_mapping.py", "--data", data, "--output", out / "vocab",
                                  *config_args, *recipe.get("vocab", [])), logs / f"{out.name}-03.log", "03 vocab")
    times["04_train"] = run(stage("04_train.py", "--target", organism.model_dir, "--data", data, "--vocab", out / "vocab",
                                  "--output", out / "checkpoints", "--epochs", epochs, "--logger", "",
                                  "--total-seq-len", CPU_TOTAL_SEQ_LEN, *config_args, *recipe.get("train", [])),
                            logs / f"{out.name}-04.log", f"04 train ({epochs} epochs)")
    times["05_export"] = run(stage("05_export.py", "--checkpoints", out / "checkpoints", "--output", out / "draft",
                                   "--tensor-parallel-size", 1), logs / f"{out.name}-05.log", "05 export")
    summary = json.loads((out / "checkpoints" / "summary.json").read_text())
    return {"draft": out / "draft", "times": times,
            "offline": {"full_acc": summary.get("full_acc"),
                        "expected_accepted_length": summary.get("expected_accepted_length")}}


def train_plain(organism, data: Path, out: Path, epochs: int, layer_ids: list[int], logs: Path) -> dict:
    """`speculators train` with its defaults: only what the CPU, the organism's depth and the
    prepared data's split force is passed. Its checkpoint directory is what vLLM loads."""
    prepared = json.loads((data / "manifest.json").read_text())
    argv = ["--verifier-name-or-path", organism.model_dir, "--data-path", data, "--save-path", out,
            "--epochs", epochs, "--target-layer-ids", *layer_ids,  # defaults [2, L//2, L-3] need L >= 5
            "--train-data-ratio", repr(prepared["train_data_ratio"]),  # the same val rows as ours
            "--logger", "", *CPU_TRAIN_FLAGS]
    # speculators' own CLI through the pipeline's entry point, which adds only the gated CPU
    # trainer fix (speculators 0.9.0's Trainer assumes CUDA).
    seconds = run([sys.executable, "-m", "eagle3_pipeline.train_entry", *map(str, argv)], logs / "plain-train.log",
                  f"plain speculators train ({epochs} epochs)")
    best = out / "checkpoint_best"
    return {"draft": best.resolve(), "times": {"train": seconds}, "argv": ["speculators", "train", *map(str, argv)],
            "offline": offline_estimate(read_val_metrics(out))}


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "work" / "bench-acceptance")
    parser.add_argument("--cache-dir", type=Path, default=None, help="organism cache (default: .cache/)")
    parser.add_argument("--samples", type=int, default=600, help="conversations for the draft's training data")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs, the same for every run")
    parser.add_argument("--ks", type=int, nargs="+", default=[3], help="num_speculative_tokens to measure")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts measured in vLLM")
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    parser.add_argument("--recipes", nargs="*", default=[], choices=sorted(RECIPES), help="recipe variants of ours")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain speculators run")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "cpu-acceptance.json")
    args = parser.parse_args()

    started = time.perf_counter()
    load_start = os.getloadavg()
    work, logs = args.work, args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"bench-acceptance: work {work}, load average {load_start[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    # 1. The organism.
    t0 = time.perf_counter()
    organism = build_organism(OrganismSettings(), cache_dir=args.cache_dir)
    organism_s = time.perf_counter() - t0
    report = organism.report()
    layers = report["settings"]["num_layers"]
    layer_ids = [1, layers // 2, layers - 1] if layers >= 4 else list(range(1, layers + 1))
    heldout = report["heldout"]["assistant_tokens"]
    print(f"organism: {report['num_parameters'] / 1e6:.1f}M params, held-out ppl {heldout['perplexity']:.2f}, "
          f"next-token acc {heldout['next_token_accuracy']:.3f}", flush=True)

    # 2-3. Data once; then ours, plain and the recipes on it.
    data = prepare_data(organism, work / "ours", args.samples, layer_ids, logs)
    runs = {"ours": train_ours(organism, data["dir"], work / "ours", args.epochs, logs, {})}
    runs["ours"]["times"].update(data["times"])
    if not args.no_plain:
        runs["plain"] = train_plain(organism, data["dir"], work / "plain", args.epochs, layer_ids, logs)
    for name in args.recipes:
        recipe = RECIPES[name]
        recipe_data = data
        if recipe.get("samples_factor"):
            recipe_data = prepare_data(organism, work / name, args.samples * recipe["samples_factor"], layer_ids, logs)
        runs[name] = train_ours(organism, recipe_data["dir"], work / name, args.epochs, logs, recipe)
        if recipe_data is not data:
            runs[name]["times"].update(recipe_data["times"])

    # 4. vLLM.
    t0 = time.perf_counter()
    measured = measure_acceptance(organism.model_dir, {name: str(r["draft"]) for name, r in runs.items()},
                                  organism.eval_prompts_path, ks=args.ks,
                                  settings=VllmSettings(max_tokens=args.max_tokens), num_prompts=args.prompts,
                                  log_dir=logs)
    vllm_s = time.perf_counter() - t0

    # 5. Table and results.
    k_main = max(args.ks)
    print(f"\n{'run':<10} {'tau vLLM k=' + str(k_main):>14} {'offline':>8} {'per-position acceptance':>30} "
          f"{'tok/s':>7} {'x base':>7}")
    table = {}
    for name, r in runs.items():
        m = measured["runs"][f"{name}-k{k_main}"]
        sd = m["spec_decode"]
        offline = (r["offline"].get("expected_accepted_length") or {}).get(str(k_main))
        table[name] = {"tau_vllm": sd["mean_acceptance_length"], "tau_offline": offline}
        print(f"{name:<10} {sd['mean_acceptance_length']:>14.3f} {fmt(offline):>8} "
              f"{str([round(x, 3) for x in sd['acceptance_rate_per_pos']]):>30} {m['tokens_per_s']:>7.1f} "
              f"{m['speedup_tokens_per_s']:>7.2f}")
    print(f"{'no draft':<10} {'':>14} {'':>8} {'':>30} {measured['baseline']['tokens_per_s']:>7.1f}")
    ratio = None
    if "plain" in table:
        ratio = table["ours"]["tau_vllm"] / table["plain"]["tau_vllm"]
        print(f"\ntau ours / tau plain (vLLM, k={k_main}): {ratio:.3f}")

    results = {
        "benchmark": "acceptance",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "organism": {"path": str(organism.root), "num_parameters": report["num_parameters"],
                     "vocab_size": report["vocab_size"], "heldout": report["heldout"], "train": report["train"],
                     "build_s_this_run": organism_s, "build_s_when_built": report["wall_s"]},
        "setup": {"samples": args.samples, "epochs": args.epochs, "ks": args.ks, "prompts": args.prompts,
                  "max_tokens": args.max_tokens, "aux_layer_ids": layer_ids, "cpu_forced": CPU_TRAIN_FLAGS,
                  "recipes": {n: RECIPES[n] for n in args.recipes}},
        "runs": {name: {**{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()},
                        "vllm": {key: m for key, m in measured["runs"].items() if m["label"] == name}}
                 for name, r in runs.items()},
        "baseline": measured["baseline"],
        "vllm_settings": measured["settings"],
        "summary": {"k": k_main, "tau": table, "tau_ratio_ours_over_plain": ratio},
        "wall_s": {"organism": organism_s, "vllm": vllm_s, "total": time.perf_counter() - started},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {args.output} ({results['wall_s']['total'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
