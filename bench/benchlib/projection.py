"""The decode speed-up at Kimi-K2.5 per draft kind: a projection, not a measurement (issue 62 item 3).

    speed-up = tau / (1 + draft_ms / target_ms)

tau: accepted tokens per verify step (vLLM's mean acceptance length, the bonus token included) from a screen
results file (bench/acceptance.py --screen: `vllm[SIZE][RECIPE][k]` for the EAGLE-3 recipes at --ks, `vllm_kinds`
for the kinds at their served k); draft_ms: the draft's time per verify step at Kimi-K2.5's width
(bench/draft_forward.py's results); target_ms: Kimi-K2.5's decode step, assumed (20, 40, 80 ms), not measured. The
verify step is priced as one target step whatever the k (a target step of k + 1 query tokens is taken to cost one of
1: decode is bound by weight reads and, on the PCIe box, the all-reduces). The ratio to EAGLE-3 is to the best
EAGLE-3 recipe's best k at the same target step. tau comes from the screen's recipes as trained there (the same
epochs for every recipe, not equal training GPU time): weigh the ratio with each kind's training step cost
(bench/train_throughput.py --kinds) before calling it "at equal training GPU time".

    python bench/draft_forward.py project --screen SCREEN.json --forward FORWARD.json [--size 1] [--batch 1 8]
        [--train TRAIN.json]   # + each kind's training cost per token at Kimi width over EAGLE-3's
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

TARGET_STEPS_MS = (20.0, 40.0, 80.0)
EAGLE3_RECIPES = ("ours",)  # the screen's EAGLE-3 recipes projected by default (the landed default draft)
BAR = 1.3  # issue 62: a kind's projected speed-up >= 1.3x EAGLE-3's
LABEL = ("PROJECTION, not a measurement: speed-up = tau / (1 + draft ms per verify step / target ms per step); "
         "tau measured in vLLM on the screen's testbed, draft ms at Kimi-K2.5's width, target step assumed")


def speedup(tau: float, draft_ms: float, target_ms: float) -> float:
    """Projected decode speed-up over the target alone: tau tokens per (target step + draft time)."""
    if target_ms <= 0:
        raise ValueError(f"target step {target_ms} ms: must be > 0")
    return tau / (1.0 + draft_ms / target_ms)


def screen_taus(results: Mapping[str, Any], size: str | None = None,
                eagle3_recipes: Sequence[str] = EAGLE3_RECIPES) -> tuple[str, list[dict]]:
    """(size, entries) from a screen results file: each EAGLE-3 recipe at each k it has in `vllm[size]` (the
    screen's --ks), and each kind in `vllm_kinds[size]` at its served k, or with `not_measured`. An entry:
    {"recipe", "kind", "k", "tau", "tau_stderr", "source"}. `size`: the data size ("1", "4"; None: the smallest)."""
    vllm = results.get("vllm") or {}
    kinds = results.get("vllm_kinds") or {}
    sizes = sorted({*vllm, *kinds}, key=lambda s: float(s))
    if not sizes:
        raise ValueError("the screen results hold no vLLM measurements (neither `vllm` nor `vllm_kinds`)")
    size = str(size) if size is not None else sizes[0]
    if size not in sizes:
        raise ValueError(f"data size {size}x not in the screen results (sizes: {', '.join(sizes)})")
    entries: list[dict] = []
    for recipe in eagle3_recipes:
        taus = (vllm.get(size) or {}).get(recipe)
        if not taus:
            entries.append({"recipe": recipe, "kind": "eagle3", "k": None, "not_measured": "not in the screen's vllm"})
            continue
        for k in sorted((key for key in taus if key.isdigit()), key=int):
            t = taus[k]
            entries.append({"recipe": recipe, "kind": "eagle3", "k": int(k), "tau": float(t["tau"]),
                            "tau_stderr": t.get("tau_stderr"), "source": t.get("source")})
    for recipe, entry in (kinds.get(size) or {}).items():
        if "not_measured" in entry or not entry.get("tau"):
            entries.append({"recipe": recipe, "kind": entry.get("kind") or recipe, "k": entry.get("k"),
                            "not_measured": entry.get("not_measured", "no tau")})
            continue
        entries.append({"recipe": recipe, "kind": entry.get("kind") or recipe, "k": int(entry["k"]),
                        "tau": float(entry["tau"]["tau"]), "tau_stderr": entry["tau"].get("tau_stderr"),
                        "source": entry["tau"].get("source", "measured")})
    return size, entries


def forward_times(forward: Mapping[str, Any], batch: int) -> dict[tuple[str, int], float]:
    """{(kind, k): the draft's ms per verify step at `batch`} from a bench/draft_forward.py results file."""
    out: dict[tuple[str, int], float] = {}
    for kind, entry in (forward.get("kinds") or {}).items():
        for step in entry.get("steps", []):
            if int(step["batch"]) == int(batch):
                out[(kind, int(step["k"]))] = float(step["forward_ms"])
    return out


def draft_ms_for(times: Mapping[tuple[str, int], float], kind: str, k: int | None) -> float | None:
    """The draft time of `kind` at `k`; a block draft has one step (its block) whatever the k it is listed at."""
    if k is not None and (kind, k) in times:
        return times[(kind, k)]
    block = [ms for (name, _), ms in times.items() if name == kind and kind not in ("eagle3", "peagle")]
    return block[0] if len(block) == 1 else None


def train_costs(train: Mapping[str, Any], eagle3_run: str = "ours") -> dict[str, float]:
    """{kind: training GPU time per token at Kimi-K2.5's width over EAGLE-3's} from a bench/train_throughput.py
    results file with --kinds (runs `ours` and `ours-KIND`): ours' tokens/s over ours-KIND's; eagle3 1.0. A kind
    whose run failed or is absent is left out. A kind run sharded over N GPUs (`--kinds-fsdp N`: ours-KIND-fsdpN) is
    priced per GPU (GPU time per token), and only where the kind has no one-GPU run."""
    runs = train.get("runs") or {}
    base = (runs.get(eagle3_run) or {}).get("tokens_per_s")
    if not base:
        raise ValueError(f"the training results hold no {eagle3_run!r} run with tokens/s")
    out, sharded = {"eagle3": 1.0}, {}
    for name, run in runs.items():
        if name.startswith(f"{eagle3_run}-") and run.get("tokens_per_s") and not run.get("failed"):
            kind, _, fsdp = name[len(eagle3_run) + 1:].partition("-fsdp")
            if kind.isidentifier() and not fsdp:  # ours-KIND, not ours-vocab-N or ours-2gpu
                out[kind] = float(base) / float(run["tokens_per_s"])
            elif kind.isidentifier() and fsdp.isdigit():
                per_gpu = run.get("tokens_per_s_per_gpu") or float(run["tokens_per_s"]) / int(fsdp)
                sharded[kind] = float(base) / float(per_gpu)
    return {**sharded, **out}


def project(entries: Iterable[Mapping[str, Any]], times: Mapping[tuple[str, int], float],
            target_steps: Sequence[float] = TARGET_STEPS_MS, costs: Mapping[str, float] | None = None) -> dict:
    """Rows {"recipe", "kind", "k", "tau", "draft_ms", "speedup": {target ms: x}, "vs_eagle3": {target ms: ratio}}
    and "eagle3_best" {target ms: {"recipe", "k", "speedup"}}: the best EAGLE-3 row at each target step. `costs`
    (train_costs): each row's `train_cost`, its kind's training GPU time per token over EAGLE-3's."""
    rows = []
    for e in entries:
        row = {key: e.get(key) for key in ("recipe", "kind", "k", "tau", "tau_stderr")}
        if costs is not None:
            row["train_cost"] = costs.get(e.get("kind"))
        if "not_measured" in e:
            rows.append({**row, "missing": f"tau: {e['not_measured']}"})
            continue
        ms = draft_ms_for(times, e["kind"], e["k"])
        if ms is None:
            rows.append({**row, "missing": f"draft time: no {e['kind']} at k {e['k']} in the forward results"})
            continue
        row["draft_ms"] = ms
        row["speedup"] = {str(t): speedup(e["tau"], ms, t) for t in target_steps}
        rows.append(row)
    best: dict[str, dict] = {}
    for t in map(str, target_steps):
        eagle = [r for r in rows if r["kind"] == "eagle3" and "speedup" in r]
        if eagle:
            top = max(eagle, key=lambda r: r["speedup"][t])
            best[t] = {"recipe": top["recipe"], "k": top["k"], "speedup": top["speedup"][t]}
    for row in rows:
        if "speedup" in row:
            row["vs_eagle3"] = {t: row["speedup"][t] / best[t]["speedup"] for t in row["speedup"] if t in best}
    return {"label": LABEL, "target_steps_ms": list(target_steps), "bar": BAR, "rows": rows, "eagle3_best": best}


def format_projection(result: Mapping[str, Any]) -> list[str]:
    steps = [str(t) for t in result["target_steps_ms"]]
    costs = any("train_cost" in r for r in result["rows"])
    lines = [result["label"], f"  {'recipe':<12} {'kind':<7} {'k':>3} " + (f"{'train x':>7} " if costs else "")
             + f"{'tau':>6} {'draft ms':>9} "
             + " ".join(f"{'x @' + format(float(t), 'g') + 'ms':>10} {'/EAGLE-3':>8}" for t in steps)]
    for r in result["rows"]:
        head = f"  {r['recipe']:<12} {r['kind']:<7} {r['k'] if r['k'] is not None else '-':>3} "
        if costs:
            head += f"{'-' if r.get('train_cost') is None else format(r['train_cost'], '.2f'):>7} "
        if "missing" in r:
            lines.append(head + f"   -  {r['missing']}")
            continue
        cells = []
        for t in steps:
            ratio = r.get("vs_eagle3", {}).get(t)
            mark = "*" if ratio is not None and ratio >= result["bar"] else " "
            cells.append(f"{r['speedup'][t]:>10.3f} {'-' if ratio is None else format(ratio, '.3f') + mark:>8}")
        lines.append(head + f"{r['tau']:>6.3f} {r['draft_ms']:>9.3f} " + " ".join(cells))
    lines.append(f"  /EAGLE-3: over the best EAGLE-3 row at the same target step; * >= {result['bar']}x (issue 62's bar,"
                 " which asks for equal training GPU time: tau here is the screen's, at equal epochs)")
    if costs:
        lines.append("  train x: the kind's training GPU time per token at Kimi-K2.5's width over EAGLE-3's "
                     "(train_throughput.py --kinds); above 1, equal GPU time buys it fewer epochs than the screen gave")
    return lines


def project_files(screen: Path, forward: Path, *, size: str | None = None, batch: int = 1,
                  eagle3_recipes: Sequence[str] = EAGLE3_RECIPES,
                  target_steps: Sequence[float] = TARGET_STEPS_MS, train: Path | None = None) -> dict:
    screen_results = json.loads(Path(screen).read_text())
    forward_results = json.loads(Path(forward).read_text())
    size, entries = screen_taus(screen_results, size, eagle3_recipes)
    costs = train_costs(json.loads(Path(train).read_text())) if train else None
    result = project(entries, forward_times(forward_results, batch), target_steps, costs)
    result.update(size=size, batch=batch, screen=str(screen), screen_benchmark=screen_results.get("benchmark"),
                  forward=str(forward), train=str(train) if train else None,
                  forward_label=forward_results.get("label"), forward_device=forward_results.get("device"),
                  forward_toy=bool(forward_results.get("toy")))
    if result["forward_toy"]:
        result["label"] = "TOY (draft times from the CPU at a toy width: meaningless) " + result["label"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draft_forward.py project",
                                     description="the decode speed-up at Kimi-K2.5 per kind: a projection")
    parser.add_argument("--screen", type=Path, required=True, help="a screen results JSON (acceptance.py --screen)")
    parser.add_argument("--forward", type=Path, required=True, help="a bench/draft_forward.py results JSON")
    parser.add_argument("--size", default=None, help="the screen's data size (1, 4; default the smallest)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="the draft-time batch(es) (default 1)")
    parser.add_argument("--eagle3-recipes", nargs="+", default=list(EAGLE3_RECIPES),
                        help="the screen's EAGLE-3 recipes to project (default: ours)")
    parser.add_argument("--target-ms", type=float, nargs="+", default=list(TARGET_STEPS_MS))
    parser.add_argument("--train", type=Path, default=None,
                        help="a bench/train_throughput.py --kinds results JSON: each kind's training cost per token "
                             "over EAGLE-3's (ours-KIND against ours) beside its projection")
    parser.add_argument("--output", type=Path, default=None, help="also write the projection(s) as JSON here")
    args = parser.parse_args(argv)
    out = []
    for batch in args.batch:
        result = project_files(args.screen, args.forward, size=args.size, batch=batch,
                               eagle3_recipes=args.eagle3_recipes, target_steps=args.target_ms, train=args.train)
        print(f"{result.get('screen_benchmark') or 'screen'} at {result['size']}x data, draft batch {batch}:")
        print("\n".join(format_projection(result)))
        out.append(result)
    if args.output:
        args.output.write_text(json.dumps({"projections": out}, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0
