#!/usr/bin/env python3
"""CPU time of stage 04's per-sample loader check (compat/sample_check.py) at Kimi-K2.5 geometry.

One sample as the loader holds it after reading a row's file (eagle3_pipeline/hidden_states.py): hidden_states [2048, 4, 7168]
bf16 (the 4 extracted layers, 117 MB) + token_ids [2048]; the checks a loader worker runs on it, timed
with the process CPU clock in one thread (speculators limits each loader worker to one):
- `worker_cpu_ms`: what a worker runs when training on CUDA with the default `--on-bad-sample stop`
  (storage, token ids, shape; the value pass runs on the GPU on the packed batch, see
  compat/sample_check.py `check_values_on_device`);
- `whole_cpu_ms`: the whole check (+ one min/max pass per layer slot for NaN/Inf and constant
  slots), what a worker runs on the CPU path and with `--on-bad-sample skip`.
Set against the H200's measured training time per sample (bench/results/h200-train.json, ours:
tokens/s through 04_train.py), as the fraction of the loader workers' time per sample and of the
step when the check would run on the training process itself (num_workers 0: the worst case).

    python bench/loader_check_cost.py            # writes bench/results/cpu-loader-check-cost.json

The GPU figure (tokens/s with and without every input check, one invocation) is
`train_throughput.py --runs ours --loader-check alternate` (on, off, on, off).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENS, SLOTS, HIDDEN = 2048, 4, 7168  # Kimi-K2.5: 3 aux layers + the final one, hidden 7168


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results" / "cpu-loader-check-cost.json")
    parser.add_argument("--train-results", type=Path, default=REPO / "bench" / "results" / "h200-train.json")
    parser.add_argument("--workers", type=int, default=8, help="loader workers per GPU (04's default num_workers)")
    args = parser.parse_args()

    from eagle3_pipeline.compat.sample_check import layout_problem, storage_problem, value_problem

    torch.set_num_threads(1)  # as in a loader worker (speculators' _limit_worker_threads)
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(TOKENS, SLOTS, HIDDEN, generator=generator).to(torch.bfloat16)
    token_ids = torch.randint(0, 163840, (TOKENS,), generator=generator)
    row_ids = token_ids.clone()  # the dataset row's input_ids (an independent tensor, as the loader has)
    sample = {"hidden_states": states, "token_ids": token_ids}
    expected = {"slots": SLOTS, "hidden": HIDDEN, "dtype": "bfloat16", "storage": "dtype"}

    def whole() -> None:  # the CPU path, and --on-bad-sample skip
        assert storage_problem(sample, expected) is None
        assert value_problem(states, token_ids, row_ids, SLOTS, HIDDEN) is None

    def worker() -> None:  # CUDA, --on-bad-sample stop: the value pass is the GPU's
        assert storage_problem(sample, expected) is None
        assert layout_problem(states, token_ids, row_ids, SLOTS, HIDDEN) is None

    def timed(check) -> tuple[list[float], list[float]]:
        check()  # warm-up
        cpu, wall = [], []
        for _ in range(args.repeats):
            c0, w0 = time.process_time(), time.perf_counter()
            check()
            cpu.append((time.process_time() - c0) * 1e3)
            wall.append((time.perf_counter() - w0) * 1e3)
        return cpu, wall

    cpu_ms, wall_ms = timed(whole)
    worker_ms, _ = timed(worker)
    # For scale, what the loader already does with every sample: speculators' collate copies it into
    # the step's preallocated buffer (one pass over the same bytes).
    buffer = torch.zeros(TOKENS, SLOTS * HIDDEN, dtype=torch.bfloat16)
    copy_ms = []
    for _ in range(max(3, args.repeats // 2)):
        c0 = time.process_time()
        buffer.copy_(states.view(TOKENS, -1))
        copy_ms.append((time.process_time() - c0) * 1e3)
    read_cpu_ms = statistics.median(copy_ms)

    train = json.loads(args.train_results.read_text())
    ours = train["runs"]["ours"]
    step_ms_per_sample = TOKENS / ours["tokens_per_s"] * 1e3  # one GPU's training time per 2048-token sample
    check_ms = statistics.median(cpu_ms)
    worker_check_ms = statistics.median(worker_ms)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1,
        "sample": {"hidden_states": [TOKENS, SLOTS, HIDDEN], "dtype": "bfloat16", "bytes": states.numel() * 2},
        "repeats": args.repeats,
        "whole_cpu_ms_median": check_ms, "whole_cpu_ms_min": min(cpu_ms), "whole_wall_ms_median": statistics.median(wall_ms),
        "worker_cpu_ms_median": worker_check_ms, "worker_cpu_ms_min": min(worker_ms),
        "collate_copy_cpu_ms_median": read_cpu_ms,
        "h200_train": {"from": str(args.train_results.relative_to(REPO)), "tokens_per_s": ours["tokens_per_s"],
                       "train_ms_per_sample": step_ms_per_sample},
        "workers_per_gpu": args.workers,
        # the loader's share: each worker has workers x the per-sample training time per sample it prepares
        "whole_fraction_of_loader_budget": check_ms / (step_ms_per_sample * args.workers),
        "worker_fraction_of_loader_budget": worker_check_ms / (step_ms_per_sample * args.workers),
        # worst case, if the check ran on the training process itself (num_workers 0)
        "whole_fraction_of_step_if_inline": check_ms / step_ms_per_sample,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"loader check, one [{TOKENS}, {SLOTS}, {HIDDEN}] bf16 sample (CPU ms, median of {args.repeats}, 1 thread): "
          f"worker side with CUDA {worker_check_ms:.2f}, whole check {check_ms:.1f}; the collate's copy of it "
          f"{read_cpu_ms:.1f}")
    print(f"H200 training time per sample {step_ms_per_sample:.1f} ms ({ours['tokens_per_s']:,.0f} tokens/s): "
          f"of {args.workers} loader workers' budget {100 * report['worker_fraction_of_loader_budget']:.3f}% "
          f"(worker side), {100 * report['whole_fraction_of_loader_budget']:.2f}% (whole check); the whole "
          f"check inline {100 * report['whole_fraction_of_step_if_inline']:.1f}% of the step")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
