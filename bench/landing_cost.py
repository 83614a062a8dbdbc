"""Stage 02's landing cost per row, with and without an fsync per file (no engine; any machine).

Stage 02's vLLM backend lands every row the connector wrote: wait for its lock, read the file back, check it
(token ids, shape, dtype, finite, no zero/constant/repeated slot), rename it into `hidden_states/`
(`eagle3_pipeline.extract.common.land_sample`, on `LANDING_THREADS` threads). Until issue 29 each landing also
fsynced its file; it now relies on one `syncfs` after the last row. This lands the same staged files both ways,
in one invocation, on 1 and on `LANDING_THREADS` threads:

  land            land_sample as stage 02 runs it now
  land + fsync    the same, then an fsync of the landed file (what each row cost before)
  sync_s          the one syncfs after all rows (what `land` defers to the end)

Files: seeded random states [T, --slots, --hidden] in --dtype (the landing's cost does not depend on where the
values came from), T log-uniform in [--min-tokens, --max-tokens]. Put --work on the disk stage 02 writes to.

    python bench/landing_cost.py --work /tmp/landing --rows 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "eagle3-train")]

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eagle3_pipeline.disk_writes import sync_filesystem  # noqa: E402
from eagle3_pipeline.extract.common import ExtractedSample, land_sample  # noqa: E402
from eagle3_pipeline.extract.vllm_backend import LANDING_THREADS  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SEED = 29


def make_staged(folder: Path, rows: int, min_tokens: int, max_tokens: int, slots: int, hidden: int,
                dtype: torch.dtype) -> dict[int, list[int]]:
    rng = random.Random(SEED)
    generator = torch.Generator().manual_seed(SEED)
    folder.mkdir(parents=True)
    ids_by_row = {}
    for index in range(rows):
        length = int(round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))))
        ids = [rng.randrange(1000) for _ in range(length)]
        states = torch.randn(length, slots, hidden, generator=generator).to(dtype)
        save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(folder / f"row{index}.safetensors"))
        ids_by_row[index] = ids
    return ids_by_row


def land_all(source: Path, work: Path, ids_by_row: dict[int, list[int]], slots: int, hidden: int, dtype: torch.dtype,
             threads: int, fsync_each: bool) -> dict:
    staging, hs_dir = work / "staging", work / "hidden_states"
    for folder in (staging, hs_dir):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, staging)
    hs_dir.mkdir()
    sync_filesystem(work)  # the copies' writes are not this measurement's

    def land(index: int) -> None:
        final = land_sample(ExtractedSample(index, staged_file=staging / f"row{index}.safetensors"), hs_dir,
                            ids_by_row[index], slots, hidden, dtype)
        if fsync_each:
            with open(final, "rb") as handle:
                os.fsync(handle.fileno())

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(land, sorted(ids_by_row)))
    seconds = time.perf_counter() - started
    synced = time.perf_counter()
    sync_filesystem(hs_dir)
    return {"threads": threads, "fsync_each": fsync_each, "seconds": seconds,
            "ms_per_row": 1000 * seconds / len(ids_by_row), "sync_s": time.perf_counter() - synced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--work", required=True, help="scratch folder on the disk to measure (emptied)")
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=4, help="layer slots per token (3 aux + the final layer)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (the Kimi miniature's: 128)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all four measurements, interleaved")
    parser.add_argument("--results", help="write the results JSON here too")
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    dtype = DTYPES[args.dtype]
    ids_by_row = make_staged(work / "source", args.rows, args.min_tokens, args.max_tokens, args.slots, args.hidden, dtype)
    runs = []
    for _ in range(args.repeats):  # interleaved: a busy machine's load changes between rounds, not within one pair
        for threads in (1, LANDING_THREADS):
            for fsync_each in (True, False):
                run = land_all(work / "source", work, ids_by_row, args.slots, args.hidden, dtype, threads, fsync_each)
                runs.append(run)
                print(f"{threads} thread(s), {'land + fsync' if fsync_each else 'land        '}: "
                      f"{run['ms_per_row']:.2f} ms/row (then one syncfs: {run['sync_s']:.3f} s)", flush=True)
    medians = {}
    for threads in (1, LANDING_THREADS):
        for fsync_each in (True, False):
            key = f"{threads}_threads_{'land_fsync' if fsync_each else 'land'}"
            medians[key] = statistics.median(r["ms_per_row"] for r in runs
                                             if r["threads"] == threads and r["fsync_each"] == fsync_each)
            print(f"median over {args.repeats}: {key} {medians[key]:.2f} ms/row")
    results = {"bench": "landing_cost", "rows": args.rows, "tokens": sum(map(len, ids_by_row.values())),
               "settings": {k: v for k, v in vars(args).items() if k not in ("work", "results")},
               "work": str(work), "cpu_count": os.cpu_count(), "median_ms_per_row": medians, "runs": runs}
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
