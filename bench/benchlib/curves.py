"""Learning curves: tau in vLLM against training GPU seconds, and the decisions read off them.

`bench/acceptance.py --curves` trains each recipe once per data size with a checkpoint every epoch,
measures each checkpoint in vLLM and writes one JSON; this module holds what needs no GPU and no
engine (pure functions over that JSON and over speculators' metrics.jsonl), so it is unit-tested:

* `gpu_seconds_by_epoch`: the timing rule. A checkpoint's x is the sum of speculators' own step timer
  (`profile.step_ms`: each phase synchronised, every step logged with --log-freq 1) over the steps up
  to it; validation, checkpoint writes and process start-up are not steps and do not count; the first
  steps' compile surplus is kept apart (`compile_s`). Never a wall clock shared with other jobs.
* `tau_at_k`: tau and its standard error at any k up to an engine's k, from its per-position counters.
* `equal_time_table` / `equal_epochs_table`: ours/plain tau ratio at matched GPU seconds (linear
  interpolation inside both curves) or at the same epoch, per data size.
* `packing_crossover`: where 32K-token steps overtake 8K-token steps (GPU seconds, optimizer steps).
* `priced_curves` / `recommend_split`: tau against total cost when each extracted or regenerated
  token costs the target's forward (Kimi-K2.5's) relative to the draft's training step, and which
  data/epochs split that favours.
* `host_memory_refusal`: the one-line refusal of a --jobs that will not fit in host memory.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Prices (item 6 of issue 27). Kimi-K2.5 activates ~32B parameters per token (8 of 384 routed experts
# + the shared expert + attention of its DeepSeek-V3 backbone): ~2 x 32e9 = 64 GFLOP per token forward
# (issue 27). The draft's training step at Kimi geometry: 14.813 GFLOP per token, forward 5.805 +
# backward 9.008 (benchlib.throughput.train_flops_per_token; KNOWLEDGE.md, bench/README.md's table).
TARGET_FORWARD_GFLOP_PER_TOKEN = 64.0
DRAFT_TRAIN_GFLOP_PER_TOKEN = 14.813
EXTRACT_COST_RATIO = TARGET_FORWARD_GFLOP_PER_TOKEN / DRAFT_TRAIN_GFLOP_PER_TOKEN
PRICE_SOURCE = (f"Kimi-K2.5 forward ~{TARGET_FORWARD_GFLOP_PER_TOKEN:.0f} GFLOP/token (~32B active parameters x 2; "
                f"issue 27) / draft fwd+bwd {DRAFT_TRAIN_GFLOP_PER_TOKEN} GFLOP/token at Kimi geometry "
                f"(benchlib.throughput.train_flops_per_token, bench/README.md) = {EXTRACT_COST_RATIO:.2f}")

TIMING_RULE = ("training GPU seconds = the sum of speculators' own step timer (metrics.jsonl profile.step_ms, each "
               "phase synchronised; --log-freq 1 so every step is timed, the same for every recipe) over the steps "
               "up to each checkpoint; validation, checkpoint writes and process start-up are not steps; the first "
               "steps' compile surplus (a step of a launch's first 3 taking over 3x its epoch's median) is counted "
               "at the median and reported apart as compile_s; trainings run one at a time with nothing else on "
               "the device (datasets before, vLLM engines after); never a wall clock shared with other jobs")

COMPILE_WINDOW = 3  # steps at the start of each launch that may carry compilation
COMPILE_FACTOR = 3.0  # ... when they take over this many times their epoch's median step


# ---------------------------------------------------------------------------------------------
# Timing


def gpu_seconds_by_epoch(profile: Mapping[int, Mapping[str, float]], step_epoch: Mapping[int, int],
                         launch_starts: Sequence[int] = (0,), where: str = "metrics.jsonl") -> dict[int, dict]:
    """Cumulative training cost at the end of each epoch, from the per-step timer.

    `profile`: global_step -> speculators' profile dict (step_ms, tokens_per_s); `step_epoch`: global_step
    -> epoch; `launch_starts`: the first global step of each launch (a resume compiles again).
    Returns epoch -> {"steps", "tokens", "gpu_s", "gpu_s_with_compile", "compile_s"} (cumulative).
    Every step must be timed (--log-freq 1): a gap is an error naming the step, since the sum would
    silently undercount.
    """
    steps = sorted(profile)
    if not steps:
        raise ValueError(f"{where}: no timed training steps (was the run logged with --log-freq 1?)")
    missing = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
    if steps[0] != 0 or missing:
        first = missing[0] if missing else 0
        raise ValueError(f"{where}: step {first} has no timer record; the curves need every step timed (--log-freq 1)")
    by_epoch: dict[int, list[int]] = {}
    for step in steps:
        by_epoch.setdefault(int(step_epoch[step]), []).append(step)
    medians = {e: statistics.median(float(profile[s]["step_ms"]) for s in members) for e, members in by_epoch.items()}
    compiling = {s for start in launch_starts for s in range(start, start + COMPILE_WINDOW)}
    out, steps_done, tokens, gpu_ms, compile_ms = {}, 0, 0.0, 0.0, 0.0
    for epoch in sorted(by_epoch):
        for step in by_epoch[epoch]:
            ms = float(profile[step]["step_ms"])
            counted = medians[epoch] if step in compiling and ms > COMPILE_FACTOR * medians[epoch] else ms
            gpu_ms += counted
            compile_ms += ms - counted
            tokens += float(profile[step].get("tokens_per_s", 0.0)) * ms / 1000.0
            steps_done += 1
        out[epoch] = {"steps": steps_done, "tokens": round(tokens), "gpu_s": gpu_ms / 1000.0,
                      "gpu_s_with_compile": (gpu_ms + compile_ms) / 1000.0, "compile_s": compile_ms / 1000.0}
    return out


def read_gpu_seconds(metrics_jsonl: str | Path) -> dict[int, dict]:
    """`gpu_seconds_by_epoch` of one checkpoint directory's metrics.jsonl (every launch's segment)."""
    from eagle3_pipeline.metrics import COMPAT_KEY, read_metrics
    from eagle3_pipeline.plots import read_curves

    curves = read_curves(metrics_jsonl)  # the later record of a re-run step wins
    starts, after_launch = [], True
    for record in read_metrics(metrics_jsonl):
        if COMPAT_KEY in record:
            after_launch = True
        elif after_launch and "global_step" in record and isinstance(record.get("profile"), dict):
            starts.append(int(record["global_step"]))
            after_launch = False
    return gpu_seconds_by_epoch(curves.profile, curves.train_epoch, starts or [0], where=str(metrics_jsonl))


# ---------------------------------------------------------------------------------------------
# tau at k from one engine's counters


def tau_at_k(survival: Sequence[float], num_drafts: int, k: int) -> dict:
    """tau and standard error with k draft tokens, from an engine with len(survival) >= k positions.

    Greedy chain verification: the accepted length at k is min(L, k), so tau_k = 1 + sum_{i<k} S_i with
    S_i = P(L > i), and E[min(L,k)^2] = sum_{i<k} (2i+1) S_i (the same rule as summarize_spec_decode).
    """
    if k > len(survival):
        raise ValueError(f"k={k} needs an engine with at least {k} draft positions, this one has {len(survival)}")
    head = list(survival[:k])
    mean = sum(head)
    variance = max(0.0, sum((2 * i + 1) * p for i, p in enumerate(head)) - mean * mean)
    return {"tau": 1.0 + mean, "tau_stderr": math.sqrt(variance / max(1, num_drafts))}


def checkpoint_taus(engines: Mapping[int, Mapping], ks: Sequence[int]) -> dict:
    """{"k": {"tau", "tau_stderr", "source"}, "by_kind": {kind: {"k": {...}}}} for one checkpoint.

    `engines`: engine k -> its measure_acceptance run. A k with its own engine is "measured"; a smaller
    k without one comes from the largest engine's per-position counters ("from k=K counters").
    """
    out: dict = {"by_kind": {}}
    top = max(engines)

    def one(spec: Mapping, k: int, source: str) -> dict:
        if source == "measured":
            return {"tau": spec["mean_acceptance_length"], "tau_stderr": spec["mean_acceptance_length_stderr"],
                    "source": source}
        return {**tau_at_k(spec["acceptance_rate_per_pos"], spec["num_drafts"], k), "source": source}

    for k in sorted(set(ks)):
        engine_k = k if k in engines else top
        if engine_k < k:
            raise ValueError(f"k={k}: no engine measured k >= {k} (engines: {sorted(engines)})")
        source = "measured" if engine_k == k else f"from k={engine_k} counters"
        run = engines[engine_k]
        out[str(k)] = one(run["spec_decode"], k, source)
        for kind, group in run.get("by_group", {}).items():
            out["by_kind"].setdefault(kind, {})[str(k)] = one(group["spec_decode"], k, source)
    return out


# ---------------------------------------------------------------------------------------------
# Reading the curves


def interpolate(points: Sequence[tuple[float, float, float]], x: float) -> tuple[float, float] | None:
    """(y, stderr) at x by linear interpolation between the two neighbouring points (x, y, stderr),
    sorted by x; None outside [first x, last x]. The stderr combines the neighbours' in quadrature."""
    pts = sorted(points)
    if not pts or x < pts[0][0] - 1e-9 or x > pts[-1][0] + 1e-9:
        return None
    for (x0, y0, s0), (x1, y1, s1) in zip(pts, pts[1:]):
        if x0 - 1e-9 <= x <= x1 + 1e-9:
            w = 0.0 if x1 == x0 else min(1.0, max(0.0, (x - x0) / (x1 - x0)))
            return y0 + w * (y1 - y0), math.hypot((1 - w) * s0, w * s1)
    return pts[-1][1], pts[-1][2]  # a single point, x on it


def series(curve: Mapping, k: int, x: str = "gpu_s", kind: str | None = None) -> list[tuple[float, float, float]]:
    """(x, tau, stderr) per checkpoint of one recipe's curve at k (overall or one kind)."""
    out = []
    for point in curve["points"]:
        tau = point["tau"]["by_kind"][kind] if kind else point["tau"]
        if str(k) in tau:
            out.append((float(point[x]), float(tau[str(k)]["tau"]), float(tau[str(k)]["tau_stderr"])))
    return sorted(out)


def _ratio(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    (ya, sa), (yb, sb) = a, b
    ratio = ya / yb
    return ratio, ratio * math.hypot(sa / ya, sb / yb)


def equal_time_table(curves: Mapping, k: int, baseline: str = "plain") -> list[dict]:
    """ours/plain tau at matched training GPU seconds, per data size and recipe.

    At every checkpoint x of either curve inside both curves' ranges, both taus are interpolated
    linearly in GPU seconds. A row per (data, recipe): the matched points, the ratio at the largest
    matched budget (`ratio_at_max`), the smallest ratio over the matched points (`ratio_min`), and the
    ranges when the curves do not overlap (`overlap: false`, no ratio).
    """
    rows = []
    for data, recipes in sorted(curves.items(), key=lambda kv: float(kv[0])):
        if baseline not in recipes:
            continue
        base = series(recipes[baseline], k)
        for name, curve in recipes.items():
            if name == baseline:
                continue
            ours = series(curve, k)
            if not ours or not base:
                continue
            lo, hi = max(ours[0][0], base[0][0]), min(ours[-1][0], base[-1][0])
            row = {"data": data, "recipe": name, "k": k, "baseline": baseline,
                   "ranges_gpu_s": {name: [ours[0][0], ours[-1][0]], baseline: [base[0][0], base[-1][0]]}}
            if lo > hi:
                rows.append({**row, "overlap": False})
                continue
            xs = sorted({x for x, _, _ in ours + base if lo - 1e-9 <= x <= hi + 1e-9})
            matched = []
            for x in xs:
                a, b = interpolate(ours, x), interpolate(base, x)
                ratio, se = _ratio(a, b)
                matched.append({"gpu_s": x, "tau": a[0], "tau_stderr": a[1], "tau_baseline": b[0],
                                "tau_baseline_stderr": b[1], "ratio": ratio, "ratio_stderr": se})
            rows.append({**row, "overlap": True, "points": matched, "ratio_at_max": matched[-1]["ratio"],
                         "ratio_at_max_stderr": matched[-1]["ratio_stderr"], "gpu_s_max": matched[-1]["gpu_s"],
                         "ratio_min": min(p["ratio"] for p in matched)})
    return rows


def equal_epochs_table(curves: Mapping, k: int, baseline: str = "plain") -> list[dict]:
    """ours/plain tau at the same epoch (both checkpoints measured), per data size and recipe."""
    rows = []
    for data, recipes in sorted(curves.items(), key=lambda kv: float(kv[0])):
        if baseline not in recipes:
            continue
        base = {p["epoch"]: p for p in recipes[baseline]["points"] if str(k) in p["tau"]}
        for name, curve in recipes.items():
            if name == baseline:
                continue
            points = []
            for p in curve["points"]:
                q = base.get(p["epoch"])
                if q is None or str(k) not in p["tau"]:
                    continue
                a, b = p["tau"][str(k)], q["tau"][str(k)]
                ratio, se = _ratio((a["tau"], a["tau_stderr"]), (b["tau"], b["tau_stderr"]))
                points.append({"epoch": p["epoch"], "ratio": ratio, "ratio_stderr": se})
            if points:
                rows.append({"data": data, "recipe": name, "k": k, "baseline": baseline, "points": points,
                             "ratio_last": points[-1]["ratio"], "ratio_min": min(p["ratio"] for p in points)})
    return rows


def packing_crossover(curves: Mapping, k: int, small: str = "ours-8k", large: str = "ours-32k") -> list[dict]:
    """Where `large` (32K tokens/step) overtakes `small` (8K) in tau at equal GPU seconds, per data size.

    d(x) = tau_large(x) - tau_small(x) at the matched checkpoints; the crossover is the first x where d
    turns from < 0 to >= 0 (linear between neighbours), also as the large run's optimizer steps and
    tokens there. `resolved` says whether the points on both sides differ by over 2 standard errors;
    without a sign change the row says which packing led throughout and up to how many steps.
    """
    rows = []
    for data, recipes in sorted(curves.items(), key=lambda kv: float(kv[0])):
        if small not in recipes or large not in recipes:
            continue
        a, b = series(recipes[large], k), series(recipes[small], k)
        if not a or not b:
            continue
        lo, hi = max(a[0][0], b[0][0]), min(a[-1][0], b[-1][0])
        steps_of = [(float(p["gpu_s"]), float(p["steps"]), 0.0) for p in recipes[large]["points"]]
        tokens_of = [(float(p["gpu_s"]), float(p["tokens"]), 0.0) for p in recipes[large]["points"]]
        row = {"data": data, "k": k, "small": small, "large": large}
        if lo > hi:
            rows.append({**row, "overlap": False})
            continue
        diffs = []
        for x in sorted({x for x, _, _ in a + b if lo - 1e-9 <= x <= hi + 1e-9}):
            ya, yb = interpolate(a, x), interpolate(b, x)
            diffs.append((x, ya[0] - yb[0], math.hypot(ya[1], yb[1])))
        crossing = None
        for (x0, d0, s0), (x1, d1, s1) in zip(diffs, diffs[1:]):
            if d0 < 0 <= d1:
                x = x0 + (x1 - x0) * (-d0) / (d1 - d0)
                crossing = {"gpu_s": x, "steps": interpolate(steps_of, x)[0], "tokens": interpolate(tokens_of, x)[0],
                            "resolved": abs(d0) > 2 * s0 and abs(d1) > 2 * s1}
                break
        last_x, last_d, last_s = diffs[-1]
        row.update(overlap=True, diffs=[{"gpu_s": x, "diff": d, "stderr": s} for x, d, s in diffs], crossover=crossing,
                   matched_up_to_steps=interpolate(steps_of, last_x)[0], diff_at_max=last_d, diff_at_max_stderr=last_s)
        if crossing is None:
            row["leader"] = large if all(d >= 0 for _, d, _ in diffs) else small if all(d < 0 for _, d, _ in diffs) \
                else "mixed"
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Prices: epochs against data


def priced_curves(curves: Mapping, data_costs: Mapping[str, Mapping[str, int]], k: int,
                  ratio: float = EXTRACT_COST_RATIO) -> dict:
    """tau against total cost per data size and recipe, in draft-token units (one unit = one token
    through one draft training step, fwd+bwd): cost = tokens trained so far + ratio x (tokens the
    target processed to make the data: every extracted token + every regenerated answer token).

    `data_costs`: data size -> {"extracted_tokens", "regenerated_tokens"}. Returns
    {data: {recipe: [{"epoch", "cost", "data_cost", "train_cost", "tau", "tau_stderr"}]}}.
    """
    out: dict = {}
    for data, recipes in curves.items():
        costs = data_costs[data]
        data_cost = ratio * (costs["extracted_tokens"] + costs.get("regenerated_tokens", 0))
        for name, curve in recipes.items():
            out.setdefault(data, {})[name] = [
                {"epoch": p["epoch"], "train_cost": p["tokens"], "data_cost": data_cost, "cost": p["tokens"] + data_cost,
                 "tau": p["tau"][str(k)]["tau"], "tau_stderr": p["tau"][str(k)]["tau_stderr"]}
                for p in curve["points"] if str(k) in p["tau"]]
    return out


def best_within(points: Sequence[Mapping], budget: float) -> Mapping | None:
    """The best checkpoint affordable within `budget` (a run can stop at any checkpoint)."""
    affordable = [p for p in points if p["cost"] <= budget * (1 + 1e-9)]
    return max(affordable, key=lambda p: p["tau"]) if affordable else None


def recommend_split(priced: Mapping, recipe: str) -> dict:
    """Which data size buys the most tau for `recipe` at equal total cost.

    Budgets: every checkpoint cost at which every data size already has an affordable checkpoint
    (from the most expensive first checkpoint on). At each, the best affordable checkpoint per data
    size (a run can stop at any checkpoint); the recommendation is read at the largest such budget: a
    larger data size winning means "more data, fewer epochs", a smaller one "more epochs on less data".
    `margin_stderr` is the winner's lead over the runner-up in standard errors. A smaller data size
    often ends below that budget (its last checkpoint cost less): `still_rising` lists the sizes whose
    curve still gained > 2 standard errors at its last checkpoint, where more epochs might have
    changed the answer; the line says so.
    """
    sizes = sorted((d for d in priced if recipe in priced[d] and priced[d][recipe]), key=float)
    if len(sizes) < 2:
        return {"recipe": recipe, "split": None, "line": f"{recipe}: curves at fewer than 2 data sizes, no split to read"}
    start = max(min(p["cost"] for p in priced[d][recipe]) for d in sizes)
    budgets = sorted({p["cost"] for d in sizes for p in priced[d][recipe] if p["cost"] >= start})
    table = []
    for budget in budgets:
        best = {d: best_within(priced[d][recipe], budget) for d in sizes}
        table.append({"cost": budget, "by_data": {d: {"epoch": b["epoch"], "tau": b["tau"], "tau_stderr": b["tau_stderr"]}
                                                  for d, b in best.items()}})
    final = table[-1]["by_data"]
    ranked = sorted(sizes, key=lambda d: final[d]["tau"], reverse=True)
    winner, runner = ranked[0], ranked[1]
    margin = (final[winner]["tau"] - final[runner]["tau"]) / max(1e-12, math.hypot(final[winner]["tau_stderr"],
                                                                                      final[runner]["tau_stderr"]))
    smallest, largest = sizes[0], sizes[-1]
    split = "more data, fewer epochs" if float(winner) > float(smallest) else "more epochs on less data"
    if winner not in (smallest, largest):
        split = f"{winner}x data (between the measured sizes)"
    still_rising = []
    for d in sizes:
        pts = sorted(priced[d][recipe], key=lambda p: p["cost"])
        if len(pts) >= 2 and pts[-1]["tau"] - pts[-2]["tau"] > 2 * math.hypot(pts[-1]["tau_stderr"], pts[-2]["tau_stderr"]):
            still_rising.append(d)
    cost_of = {d: next(p["cost"] for p in priced[d][recipe] if p["epoch"] == final[d]["epoch"]) for d in (winner, runner)}
    line = (f"{split}: within {table[-1]['cost']:.3g} draft-token units the best {recipe} checkpoint is {winner}x data x "
            f"{final[winner]['epoch'] + 1} epochs (tau {final[winner]['tau']:.3f}, cost {cost_of[winner]:.3g}) vs {runner}x x "
            f"{final[runner]['epoch'] + 1} (tau {final[runner]['tau']:.3f}, cost {cost_of[runner]:.3g}); lead {margin:.1f} "
            f"standard errors" + (f"; still rising at its last checkpoint: {', '.join(d + 'x' for d in still_rising)}"
                                   if still_rising else ""))
    return {"recipe": recipe, "split": split, "winner_data": winner, "margin_stderr": margin, "still_rising": still_rising,
            "budgets": table, "line": line}


# ---------------------------------------------------------------------------------------------
# Host memory for --jobs

GIB = 2**30
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def mem_available_bytes(meminfo: str | Path = "/proc/meminfo") -> int:
    """The kernel's MemAvailable (what can be allocated without swapping), in bytes."""
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo}: no MemAvailable line")


def host_memory_refusal(jobs: int, per_job: Mapping[str, tuple[int, str]], available: int,
                        headroom: float = 0.9) -> str | None:
    """One line refusing `jobs` concurrent jobs when the largest job kind times `jobs` exceeds
    `headroom` x MemAvailable; None when it fits. `per_job`: kind -> (bytes, where the figure is from)."""
    kind, (need, source) = max(per_job.items(), key=lambda kv: kv[1][0])
    if jobs * need <= headroom * available:
        return None
    fits = max(1, int(headroom * available // need))
    return (f"--jobs {jobs}: {jobs} x {need / GIB:.1f} GiB per {kind} job ({source}) = {jobs * need / GIB:.1f} GiB "
            f"> {headroom:.0%} of MemAvailable {available / GIB:.1f} GiB; use --jobs {fits} or fewer")


def training_job_bytes(total_seq_len: int, num_slots: int, hidden_size: int, workers: int, prefetch: int,
                       model_bytes: int, base_bytes: int = 3 * GIB, worker_bytes: int = 1 * GIB) -> int:
    """A training process tree's host memory from sizes: the main process (torch, CUDA context, the
    verifier's embed/lm_head, `base_bytes`) + the model's weights + each loader worker (its own Python
    and torch, `worker_bytes`) + the batches in flight (workers x prefetch, hidden states read as fp32:
    4 bytes a value, the larger of the stored bf16/fp32 and what collation holds)."""
    batch = total_seq_len * num_slots * hidden_size * 4
    return base_bytes + model_bytes + max(1, workers) * worker_bytes + max(1, workers) * max(1, prefetch) * batch


def engine_job_bytes(model_bytes: int, base_bytes: int = 4 * GIB) -> int:
    """A vLLM engine process's host memory from sizes: the engine's processes (`base_bytes`) + the weights,
    which vLLM's loader reads through host memory."""
    return base_bytes + model_bytes


def process_tree_rss(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of a process and all its descendants (summed: shared pages count once per process,
    so this overstates, which is the safe side for a memory check); 0 once it has exited."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
            rss[int(entry.name)] = int(fields[21]) * PAGE_BYTES  # rss in pages (field 24 of stat)
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


class HostMemory:
    """Peak resident memory per job kind ("training", "dataset", ...), measured on this machine and kept in
    `path` (JSON, the larger figure wins), so the next invocation's --jobs check uses measured figures."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.peaks: dict[str, int] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def record(self, kind: str, peak_bytes: int) -> None:
        with self._lock:
            self.peaks[kind] = max(self.peaks.get(kind, 0), int(peak_bytes))
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.peaks, indent=2))
            os.replace(tmp, self.path)

    def per_job(self, estimates: Mapping[str, int]) -> dict[str, tuple[int, str]]:
        """kind -> (bytes, source): the measured peak where there is one, else the size estimate."""
        return {kind: (self.peaks[kind], f"measured peak, {self.path}") if kind in self.peaks
                else (estimate, "estimated from model and batch sizes") for kind, estimate in estimates.items()}


# ---------------------------------------------------------------------------------------------
# The whole analysis of a curves JSON, its printout and its plot

PACKING_SMALL = "ours-8k"
PACKING_LARGE = ("ours-32k", "ours-32k-lr")  # 32K as it is, and with the lr scaled and warmed up


def analyse(curves: Mapping, data_costs: Mapping, ks: Sequence[int], ratio: float = EXTRACT_COST_RATIO,
            split_recipes: Sequence[str] | None = None) -> dict:
    """Every table the curves decide from, at each k: equal GPU time, equal epochs, the packing
    crossover; and at the largest k the priced curves and the data/epochs split per recipe."""
    out = {"by_k": {}}
    for k in ks:
        out["by_k"][str(k)] = {"equal_time": equal_time_table(curves, k), "equal_epochs": equal_epochs_table(curves, k),
                               "packing_crossover": [row for large in PACKING_LARGE
                                                     for row in packing_crossover(curves, k, PACKING_SMALL, large)]}
    k = max(ks)
    priced = priced_curves(curves, data_costs, k, ratio)
    recipes = split_recipes or sorted({name for recipes in curves.values() for name in recipes})
    out["pricing"] = {"k": k, "ratio": ratio, "source": PRICE_SOURCE,
                      "unit": "one token through one draft training step (fwd+bwd); cost = tokens trained + ratio x "
                              "(tokens extracted + tokens regenerated)",
                      "priced": priced, "split": {r: recommend_split(priced, r) for r in recipes}}
    return out


def format_equal_time_row(row: Mapping) -> str:
    """One equal_time_table row as printed: the matched GPU seconds, the ratio at the largest, the lowest ratio."""
    if not row["overlap"]:
        return f"  {row['data'] + 'x':>5} {row['recipe']:<14} no overlap: {row['ranges_gpu_s']}"
    return (f"  {row['data'] + 'x':>5} {row['recipe']:<14} {row['gpu_s_max']:>14.1f} "
            f"{row['ratio_at_max']:>8.3f}±{row['ratio_at_max_stderr']:.3f} {row['ratio_min']:>10.3f}")


def format_analysis(analysis: Mapping) -> list[str]:
    """The tables as printed lines."""
    lines = []
    for k, tables in analysis["by_k"].items():
        lines.append(f"equal training GPU time, tau ours/plain at k={k} (interpolated at matched GPU seconds):")
        lines.append(f"  {'data':>5} {'recipe':<14} {'GPU s matched':>14} {'ratio at max':>14} {'min ratio':>10}")
        lines += [format_equal_time_row(row) for row in tables["equal_time"]]
        lines.append(f"equal epochs, tau ours/plain at k={k}:")
        for row in tables["equal_epochs"]:
            lines.append(f"  {row['data'] + 'x':>5} {row['recipe']:<14} last epoch {row['points'][-1]['epoch'] + 1}: "
                         f"{row['ratio_last']:.3f}, min over epochs {row['ratio_min']:.3f}")
        lines.append(f"packing crossover at k={k} (32K-token steps overtake 8K at equal GPU time):")
        for row in tables["packing_crossover"]:
            head = f"  {row['data'] + 'x':>5} {row['large']:<12}"
            if not row["overlap"]:
                lines.append(f"{head} no overlap")
            elif row["crossover"]:
                c = row["crossover"]
                lines.append(f"{head} at {c['gpu_s']:.1f} GPU s = {c['steps']:.0f} steps of 32K "
                             f"({c['tokens']:.3g} tokens){'' if c['resolved'] else ' (within 2 standard errors)'}")
            else:
                lines.append(f"{head} none: {row['leader']} led up to {row['matched_up_to_steps']:.0f} "
                             f"steps of 32K (diff at the end {row['diff_at_max']:+.3f}±{row['diff_at_max_stderr']:.3f})")
    pricing = analysis["pricing"]
    lines.append(f"priced at k={pricing['k']}: extracted/regenerated token = {pricing['ratio']:.2f} draft training "
                 f"tokens ({pricing['source']})")
    for split in pricing["split"].values():
        lines.append(f"  {split['line']}")
    return lines


PLAN_RECIPES = ("ours", "ours-8k")


def plan_recipe(curves: Mapping) -> str:
    """The recipe whose data/epochs split the run plan quotes: the landed defaults (`ours`) where the file has them,
    else ours at 8K tokens per step (what the files before issue 44's curves measured the defaults as)."""
    present = {name for recipes in curves.values() for name in recipes}
    return next((r for r in PLAN_RECIPES if r in present), PLAN_RECIPES[0])


def merge_earlier(curves: dict, data_costs: dict, earlier: Mapping, date: str) -> list[dict]:
    """Fill this invocation's `curves` and `data_costs` with the data sizes an earlier results file holds and this
    one did not measure; return the earlier file's invocations, each naming the sizes of its own that this one
    replaced (`replaced_sizes`, `replaced_by`): the file keeps one record per size, so those records are gone from
    it (git history keeps them) and that invocation no longer describes them."""
    measured = set(curves)
    for size, recipes_then in earlier.get("curves", {}).items():
        if size not in measured:
            curves[size] = recipes_then
            data_costs[size] = earlier["data_costs"][size]
    invocations = []
    for inv in earlier.get("invocations", []):
        gone = sorted({str(s) for s in inv.get("data_sizes") or []} & measured, key=float)
        if gone:
            inv = {**inv, "replaced_sizes": sorted({*inv.get("replaced_sizes", []), *gone}, key=float),
                   "replaced_by": date}
        invocations.append(inv)
    return invocations


def run_plan_line(analysis: Mapping, recipe: str, source: str) -> str:
    """The run plan's data/epochs line (eagle3_pipeline.plan reads it from the curves JSON)."""
    split = analysis["pricing"]["split"].get(recipe)
    if not split or not split.get("split"):
        return f"no data/epochs split measured for {recipe} in {source}" + (f" ({split['line']})" if split else "")
    return f"{split['line']} (curves: {source}; extracted token priced at {analysis['pricing']['ratio']:.2f} draft tokens)"


def write_png(curves: Mapping, k: int, path: str | Path, title: str = "") -> Path | None:
    """One PNG: a panel per data size, a line per recipe, tau at k (± standard error) against training GPU
    seconds. None when matplotlib is missing (draw it elsewhere: acceptance.py --curves-report FILE)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(curves, key=float)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.5), squeeze=False)
    for ax, data in zip(axes[0], sizes):
        for name, curve in sorted(curves[data].items()):
            pts = series(curve, k)
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                            markersize=3, capsize=2, label=name)
        ax.set_title(f"{data}x data")
        ax.set_xlabel("training GPU seconds (trainer's step timer)")
        ax.set_ylabel(f"tau in vLLM, k={k}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
