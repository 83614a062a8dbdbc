"""Recipe screening (acceptance.py --screen, issue 37): many training recipes on one dataset, ranked by the
trainer's own offline acceptance length on held-out rows, the top few then measured in vLLM.

Pure functions, unit-tested in tests/bench/test_screen.py: the recipe table and its composition ("a+b"),
offline tau with a standard error from a checkpoint's validation accuracies, GPU seconds from solo step
timings, the ranking, Spearman's rank correlation (offline against vLLM), and the printed tables. The
equal-time and equal-epoch ratios are benchlib.curves' own tables, fed with offline points.
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

from . import curves as lc

# One change each from the landed defaults ("ours": stage 04 as a user runs it), plus plain speculators.
# `train`: stage 04 flags; `draft`: draft_config.json fields changed; `cost_as`: the recipe whose solo step
# time this one's equals (the same kernels per step: only scalars such as lr, decay, warm-up differ), so the
# timing phase times each step shape once. speculators 0.9.0 has no --noise-std and no --lk-loss-eta flag
# (lk_hybrid's eta is its default, 3.0).
SCREEN_RECIPES: dict[str, dict] = {
    "ours": {},
    "plain": {"plain": True},
    "ttt-5": {"train": ["--ttt-steps", "5"]},
    "ttt-7": {"train": ["--ttt-steps", "7"]},
    "decay-0.8": {"train": ["--extra-args=--ttt-step-loss-decay", "--extra-args=0.8"], "cost_as": "ours"},
    # eager loss: lk_hybrid launches the fused forward kernel twice (KL and TV) in one compiled region, and torch
    # 2.11's Dynamo tracks its autotune configs twice ("ListVariable ... already tracked for mutation", the bug
    # compat/fused_loss.py mends for the backward kernel; H200 image, 2026-12-03)
    "lk-hybrid": {"train": ["--extra-args=--loss-fn", "--extra-args=lk_hybrid", "--loss-impl", "eager"]},
    "tv": {"train": ["--extra-args=--loss-fn", "--extra-args=tv"]},
    # EAGLE 3.1's per-layer norm of each aux state instead of 0.9.0's default single norm over their concatenation
    "fc-norm": {"train": ["--extra-args=--fc-norm", "--extra-args=--no-norm-before-fc"]},
    "layers-2": {"draft": {"num_layers": 2}},
    "muon": {"train": ["--optimizer", "muon"]},
    "warmup-10": {"train": ["--extra-args=--scheduler-warmup-ratio", "--extra-args=0.1"], "cost_as": "ours"},
    "lr-2e-3": {"train": ["--lr", "2e-3"], "cost_as": "ours"},
}
# The first hold's leads and the levers it could not finish (bench/README.md "Recipe screen"); `--screen-recipes` for more
DEFAULT_SCREEN = ["ours", "plain", "fc-norm", "muon", "fc-norm+muon", "lk-hybrid", "ttt-7+decay-0.8"]
PLAIN = "plain"


def resolve_recipe(name: str) -> dict:
    """A recipe by name; "a+b" merges a's and b's changes (flags appended, draft fields merged). A composite's
    cost is its own (no `cost_as`) unless every part but one costs as ours."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in SCREEN_RECIPES]
    if unknown:
        raise ValueError(f"screen recipe {name!r}: unknown {unknown} (known: {', '.join(SCREEN_RECIPES)})")
    if len(parts) == 1:
        return dict(SCREEN_RECIPES[name])
    if PLAIN in parts:
        raise ValueError(f"screen recipe {name!r}: plain is speculators' defaults and combines with nothing")
    merged: dict = {"train": [], "draft": {}}
    for part in parts:
        recipe = SCREEN_RECIPES[part]
        merged["train"] += recipe.get("train", [])
        merged["draft"].update(recipe.get("draft", {}))
    costly = [p for p in parts if SCREEN_RECIPES[p].get("cost_as") != "ours" and p != "ours"]
    if len(costly) <= 1:
        merged["cost_as"] = costly[0] if costly else "ours"
    return {k: v for k, v in merged.items() if v}


def cost_class(name: str) -> str:
    """The recipe whose solo timing stands for this one's step cost."""
    seen = name
    while (nxt := resolve_recipe(seen).get("cost_as")) and nxt != seen:
        seen = nxt
    return seen


# ---------------------------------------------------------------------------------------------
# Offline acceptance length with a standard error


def offline_tau(full_acc: Sequence[float], positions: int, k: int) -> dict:
    """tau at k from a checkpoint's validation accuracies: full_acc_i = P(draft steps 0..i all right) over the
    held-out positions, so the accepted length A = min(L, k) has P(A > i) = full_acc_i (greedy chain, the same
    rule as curves.tau_at_k) and tau = 1 + E[A]. The standard error treats the `positions` as independent:
    positions of one row are correlated, so it is a lower bound."""
    if k > len(full_acc):
        raise ValueError(f"k={k}: validation measured {len(full_acc)} TTT steps (stage 04 --val-ttt-steps {k})")
    return {**lc.tau_at_k(full_acc, positions, k), "source": "offline"}


def offline_point(epoch: int, cost: Mapping, full_acc: Sequence[float], positions: int, ks: Sequence[int],
                  step_s: float | None) -> dict:
    """One checkpoint as a curves point (benchlib.curves' tables read it): `gpu_s` = steps x the recipe's solo
    step seconds (None until the timing phase ran), the concurrent run's own timer kept apart."""
    tau = {str(k): offline_tau(full_acc, positions, k) for k in ks if k <= len(full_acc)}
    tau["by_kind"] = {}
    return {"epoch": epoch, "steps": cost["steps"], "tokens": cost["tokens"],
            "gpu_s": None if step_s is None else cost["steps"] * step_s,
            "gpu_s_concurrent": cost["gpu_s"], "full_acc": list(full_acc), "tau": tau}


def solo_step_seconds(step_ms: Sequence[float], skip: int = lc.COMPILE_WINDOW) -> float:
    """The median step of a solo timing run after its first `skip` steps (compilation); a run of no more steps
    than that (a tiny test dataset) keeps its last."""
    if not step_ms:
        raise ValueError("a timing run without a timed step")
    return statistics.median(list(step_ms)[min(skip, len(step_ms) - 1):]) / 1000.0


# ---------------------------------------------------------------------------------------------
# Ranking


def last_point(curve: Mapping) -> Mapping:
    return max(curve["points"], key=lambda p: p["epoch"])


def best_point(curve: Mapping, k: int) -> Mapping:
    """The checkpoint with the highest offline tau at k (the epoch a held-out choice would keep)."""
    return max(curve["points"], key=lambda p: p["tau"][str(k)]["tau"])


def ranking(curves: Mapping[str, Mapping], k: int) -> list[tuple[str, float]]:
    """Recipes by offline tau at k of their last checkpoint, best first."""
    return sorted(((name, last_point(c)["tau"][str(k)]["tau"]) for name, c in curves.items()), key=lambda t: -t[1])


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for m in range(i, j + 1):
            out[order[m]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's over the ranks); None under 3 pairs or a constant side."""
    if len(x) != len(y):
        raise ValueError("spearman: the two sides differ in length")
    if len(x) < 3:
        return None
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def curves_offline_vs_vllm(curves: Mapping, k: int = 3) -> dict:
    """Offline tau (the trainer's validation) against vLLM's tau over every measured checkpoint of a learning
    curves JSON's `curves` (acceptance.py --curves): Spearman over all points, and per recipe's last point."""
    pairs, last = [], []
    for data, recipes in curves.items():
        for name, curve in recipes.items():
            usable = [p for p in curve["points"] if p.get("offline") and str(k) in p["offline"]["expected_accepted_length"]
                      and str(k) in p["tau"]]
            for p in usable:
                pairs.append({"data": data, "recipe": name, "epoch": p["epoch"],
                              "offline": p["offline"]["expected_accepted_length"][str(k)], "vllm": p["tau"][str(k)]["tau"]})
            if usable:
                last.append(pairs[-1])
    rho = spearman([p["offline"] for p in pairs], [p["vllm"] for p in pairs])
    rho_last = spearman([p["offline"] for p in last], [p["vllm"] for p in last])
    return {"k": k, "points": len(pairs), "spearman_all_checkpoints": rho, "spearman_last_checkpoints": rho_last,
            "pairs": pairs}


# ---------------------------------------------------------------------------------------------
# Tables


def screen_table(curves_by_size: Mapping[str, Mapping], ks: Sequence[int], vllm: Mapping | None = None) -> list[dict]:
    """One row per (data size, recipe): offline tau at each k at the last and at the best epoch, and the ratio
    to plain at equal epochs (last epoch) and at equal GPU time (curves.equal_time_table at the largest matched
    budget; absent until the timing phase gave every recipe a gpu_s), with vLLM's tau where measured."""
    rows = []
    for size, recipes in curves_by_size.items():
        timed = {n: c for n, c in recipes.items() if all(p["gpu_s"] is not None for p in c["points"])}
        for name, curve in recipes.items():
            row = {"data": size, "recipe": name, "cost_class": curve.get("cost_class"),
                   "step_s": curve.get("step_s"), "epochs": len(curve["points"])}
            last = last_point(curve)
            row["steps"], row["gpu_s"] = last["steps"], last["gpu_s"]
            for k in ks:
                key = str(k)
                if key not in last["tau"]:
                    continue
                best = best_point(curve, k)
                row[f"tau_k{k}"] = last["tau"][key]
                row[f"best_epoch_k{k}"] = best["epoch"] + 1
                row[f"best_tau_k{k}"] = best["tau"][key]["tau"]
                if name != PLAIN and PLAIN in recipes:
                    eq = lc.equal_epochs_table({size: {name: curve, PLAIN: recipes[PLAIN]}}, k)
                    if eq:
                        row[f"equal_epochs_k{k}"] = {"ratio": eq[0]["points"][-1]["ratio"],
                                                     "stderr": eq[0]["points"][-1]["ratio_stderr"]}
                    if name in timed and PLAIN in timed:
                        et = lc.equal_time_table({size: {name: timed[name], PLAIN: timed[PLAIN]}}, k)
                        if et and et[0].get("overlap"):
                            row[f"equal_time_k{k}"] = {"ratio": et[0]["ratio_at_max"], "stderr": et[0]["ratio_at_max_stderr"],
                                                       "gpu_s": et[0]["gpu_s_max"], "ratio_min": et[0]["ratio_min"]}
                measured = (vllm or {}).get(size, {}).get(name, {}).get(key)
                if measured:
                    row[f"vllm_k{k}"] = measured
            rows.append(row)
    return rows


def _fmt(entry: Mapping | None, value: str = "ratio", err: str = "stderr") -> str:
    return "-" if not entry else f"{entry[value]:.3f}±{entry[err]:.3f}"


def format_screen(rows: Sequence[Mapping], ks: Sequence[int]) -> list[str]:
    lines = []
    for size in dict.fromkeys(r["data"] for r in rows):
        lines.append(f"screen at {size}x data: offline tau (held-out rows, last epoch), ratio to plain at equal epochs "
                     f"and at equal training GPU time, vLLM where measured")
        head = f"{'recipe':<22} {'steps':>6} {'step ms':>8}"
        for k in ks:
            head += f" | k={k} {'offline':>13} {'best@ep':>8} {'= epochs':>12} {'= GPU time':>12} {'vLLM':>13}"
        lines.append(head)
        size_rows = [r for r in rows if r["data"] == size]
        top = max(ks)
        for r in sorted(size_rows, key=lambda r: -r.get(f"tau_k{top}", {}).get("tau", 0)):
            step_ms = "-" if r.get("step_s") is None else f"{1000 * r['step_s']:.1f}"
            line = f"{r['recipe']:<22} {r['steps']:>6} {step_ms:>8}"
            for k in ks:
                tau = r.get(f"tau_k{k}")
                line += (f" | k={k} {_fmt(tau, 'tau', 'tau_stderr'):>13} "
                         f"{(str(r.get(f'best_epoch_k{k}', '-'))):>8} {_fmt(r.get(f'equal_epochs_k{k}')):>12} "
                         f"{_fmt(r.get(f'equal_time_k{k}')):>12} {_fmt(r.get(f'vllm_k{k}'), 'tau', 'tau_stderr'):>13}")
            lines.append(line)
    return lines
