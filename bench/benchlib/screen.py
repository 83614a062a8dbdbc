"""Recipe screening (acceptance.py --screen, issue 37): many training recipes on one dataset, ranked by the
trainer's own offline acceptance length on held-out rows, the top few then measured in vLLM.

Pure functions, unit-tested in tests/bench/test_screen.py: the recipe table and its composition ("a+b"),
the data lever's datasets (`data:NAME`, `prompts-2x`: which rows a run trains on), offline tau with a standard
error from a checkpoint's validation accuracies, GPU seconds from solo step timings and their reuse across data
sizes and holds (the same step shape: class and packing), the projection at Kimi-K2.5 geometry, the ranking,
Spearman's rank correlation (offline against vLLM), and the printed tables. The equal-time and equal-epoch ratios
are benchlib.curves' own tables, fed with offline points.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Iterable, Mapping, Sequence

from eagle3_pipeline import draft_kinds

from . import curves as lc

# One change each from the landed defaults ("ours": stage 04 as a user runs it), plus plain speculators.
# `train`: stage 04 flags; `draft`: draft_config.json fields changed; `cost_as`: the recipe whose solo step
# time this one's equals (the same kernels per step: only scalars such as lr, decay, warm-up differ), so the
# timing phase times each step shape once. `data`: the rows it trains on instead of the size's dataset (the data
# lever, below). speculators 0.9.0 has no --noise-std (stage 04's is compat/feature_noise.py) and no --lk-loss-eta
# flag (lk_hybrid's eta is its default, 3.0).
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
    # EAGLE 3.1's per-layer norm of each aux state: the landed default since it led this screen (draft_config.json
    # fc_norm), so now ours itself; kept with its explicit flags (harmless, the same draft) so its runs and names stay
    "fc-norm": {"train": ["--extra-args=--fc-norm", "--extra-args=--no-norm-before-fc"]},
    # the default before that: speculators 0.9.0's single norm over the aux states' concatenation. Its own cost
    # class: its step is the old ours', another shape than the new ours'
    "no-fc-norm": {"draft": {"fc_norm": False, "norm_before_fc": True}},
    "layers-2": {"draft": {"num_layers": 2}},
    "muon": {"train": ["--optimizer", "muon"]},
    "warmup-10": {"train": ["--extra-args=--scheduler-warmup-ratio", "--extra-args=0.1"], "cost_as": "ours"},
    "lr-2e-3": {"train": ["--lr", "2e-3"], "cost_as": "ours"},
    # EAGLE's feature noise on the aux inputs (stage 04 --noise-std). 0.05: the default std of the Gaussian noise
    # transform in speculators' own repository (src/speculators/train/noise_transforms.py, on `hidden_states` only;
    # not in the 0.9.0 wheel), and close to EAGLE-1's uniform noise of width 0.2 (std 0.2 / sqrt(12) = 0.058). Costs
    # as ours: one randn_like over the aux states per step beside the draft's forward and backward.
    "noise": {"train": ["--noise-std", "0.05"], "cost_as": "ours"},
    # the data lever's third arm: twice the prompts, each answered once (the next size's dataset)
    "prompts-2x": {"data": "prompts-2x", "cost_as": "ours"},
    # The two-families diagnosis (issue 61): plain differs from ours in the draft vocabulary (speculators' CLI default
    # is the target's whole vocabulary), the optimizer (muon above) and the norms before fc (no-fc-norm above).
    # `vocab`: the draft vocabulary a run trains with instead of the size's stage 03 one (32K): "full" = the target's,
    # a number = stage 03 --draft-vocab-size N (capped at the target's), "ours" = the size's own 32K (for plain: its
    # d2t/t2d passed to speculators). Each is its own cost class: the draft lm_head's width is the step's largest term.
    "vocab-full": {"vocab": "full"},
    "vocab-64k": {"vocab": 64000},
    # speculators' defaults with the pipeline's 32K d2t/t2d (--draft-vocab-size 32000 --d2t-path --t2d-path): what a
    # careful speculators user runs; `plain` (the CLI defaults, the whole vocabulary) stays the headline baseline
    "plain-32k": {"plain": True, "vocab": "ours"},
    # EAGLE 3.1's second half: speculators 0.9.0 resolves norm_output to true for eagle3 when unset, so ours and plain
    # already feed post-norm states to the next TTT step (their 04 logs: 'norm_output': True); this arm turns it off.
    # The same kernels either way (which of two tensors is fed back): costs as ours
    "no-norm-output": {"train": ["--extra-args=--no-norm-output"], "cost_as": "ours"},
    # Draft kinds beyond EAGLE-3 (issue 62): stage 04 --speculator-type KIND with the kind's own speculators 0.9.0
    # defaults (draft_config.json's EAGLE-3 keys do not reach it); each its own cost class (another draft, another
    # step). Their validation reports no full_acc_i chain, so they have no offline tau (their `kind_offline`: the
    # trainer's eal and per-position accuracy): they always go to vLLM, each at its kind's served k
    # (draft_kinds.num_speculative_tokens: a block draft at its block - 1), where the vLLM in use serves them.
    # A kind whose head must be the target's whole vocabulary (dflash2: draft_kinds.full_vocabulary) trains over it.
    **{kind: {"kind": kind, "train": ["--speculator-type", kind],
              **({"vocab": "full"} if draft_kinds.kind(kind).full_vocabulary else {})}
       for kind in ("dflash", "peagle", "dspark", "dflash2")},
}
KIND_RECIPES = ("dflash", "peagle", "dspark", "dflash2")
# `--screen-recipes kinds`: the kind recipes the vLLM in use serves (kind_recipes)
KINDS_ALIAS = "kinds"
# `data:NAME` (a recipe part, like any other): the size's prompts answered as in --screen-chat NAME (e.g. two sampled
# answers per prompt, bench/chat_data.py regenerate --answers-per-prompt 2 --temperature 0.8), the same prompts as
# the size's own dataset; costs as ours per step (the same step shape when the packing is the same; checked).
DATA_PREFIX = "data:"
PROMPTS_2X = "prompts-2x"
# The first hold's leads and the levers it could not finish (bench/README.md "Recipe screen"); `--screen-recipes` for
# more. fc-norm is ours now (and fc-norm+muon is muon): no-fc-norm keeps the pre-change default beside it
DEFAULT_SCREEN = ["ours", "plain", "no-fc-norm", "muon", "lk-hybrid", "ttt-7+decay-0.8"]
PLAIN = "plain"


def _part(part: str) -> dict:
    """One recipe part: a SCREEN_RECIPES entry, or `data:NAME` (another dataset, the same step)."""
    if part.startswith(DATA_PREFIX) and len(part) > len(DATA_PREFIX):
        return {"data": part[len(DATA_PREFIX):], "cost_as": "ours"}
    if part not in SCREEN_RECIPES:
        raise ValueError(f"screen recipe part {part!r}: unknown (known: {', '.join(SCREEN_RECIPES)}, or data:NAME "
                         f"with --screen-chat NAME=DIR)")
    return SCREEN_RECIPES[part]


def resolve_recipe(name: str) -> dict:
    """A recipe by name; "a+b" merges a's and b's changes (flags appended, draft fields merged, at most one
    dataset). A composite's cost is its own (no `cost_as`) unless every part but one costs as ours."""
    parts = name.split("+")
    try:
        recipes = [_part(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"screen recipe {name!r}: {exc}") from None
    if len(parts) == 1:
        return dict(recipes[0])
    if any(r.get("plain") for r in recipes):
        raise ValueError(f"screen recipe {name!r}: plain is speculators' defaults and combines with nothing")
    for field, what in (("data", "dataset"), ("vocab", "draft vocabulary"), ("kind", "draft kind")):
        if len([r for r in recipes if field in r]) > 1:
            raise ValueError(f"screen recipe {name!r}: one {what} per recipe")
    merged: dict = {"train": [], "draft": {}}
    for recipe in recipes:
        merged["train"] += recipe.get("train", [])
        merged["draft"].update(recipe.get("draft", {}))
        for field in ("data", "vocab", "kind"):
            if field in recipe:
                merged[field] = recipe[field]
    costly = [p for p, r in zip(parts, recipes) if r.get("cost_as") != "ours" and p != "ours"]
    if len(costly) <= 1:
        merged["cost_as"] = costly[0] if costly else "ours"
    return {k: v for k, v in merged.items() if v}


def kind_of(name: str) -> str | None:
    """The draft kind a recipe trains other than EAGLE-3 (dflash, peagle, ...), None for an EAGLE-3 recipe."""
    try:
        return resolve_recipe(name).get("kind")
    except ValueError:
        return None


def kind_recipes(vllm_version: str) -> list[str]:
    """The kind recipes whose kind `vllm_version` serves (draft_kinds.serving: dflash2 from vLLM 0.32 on), for
    `--screen-recipes kinds`. A kind recipe named on its own is trained whatever the vLLM; where it cannot be served
    its vLLM figure is recorded as not measured, with the reason."""
    return [name for name in KIND_RECIPES if draft_kinds.serving(name, vllm_version).method]


def expand_recipes(names: Sequence[str], vllm_version: str) -> list[str]:
    """--screen-recipes with `kinds` replaced by kind_recipes(vllm_version), each name once, in order."""
    out: list[str] = []
    for name in names:
        out += kind_recipes(vllm_version) if name == KINDS_ALIAS else [name]
    return list(dict.fromkeys(out))


def kind_offline(val_metrics: Mapping[str, float]) -> dict:
    """A kind draft's own validation figures (no full_acc_i chain): speculators' `eal` (expected accepted length per
    block, the bonus token included; dflash/dspark), overall `full_acc`, and the accuracy at each block position
    (`position_i_acc`, from the first one logged). Keys as speculators writes them (`_epoch` suffix, `val/` prefix)."""
    clean = {str(k).removeprefix("val/").removesuffix("_epoch"): v for k, v in val_metrics.items()}
    positions = sorted(int(k.split("_")[1]) for k in clean if k.startswith("position_") and k.endswith("_acc")
                       and k.split("_")[1].isdigit())
    return {"eal": clean.get("eal"), "full_acc": clean.get("full_acc"),
            "position_acc": {str(i): float(clean[f"position_{i}_acc"]) for i in positions}}


def is_plain(name: str) -> bool:
    """A recipe that runs speculators' own CLI (plain, plain-32k): it builds on no draft config of ours."""
    try:
        return bool(resolve_recipe(name).get("plain"))
    except ValueError:
        return False


def cost_class(name: str) -> str:
    """The recipe whose solo timing stands for this one's step cost."""
    seen = name
    while (nxt := resolve_recipe(seen).get("cost_as")) and nxt != seen:
        seen = nxt
    return seen


def run_slug(name: str) -> str:
    """A recipe name as a directory name (`data:NAME` -> `data-NAME`: no colon in a path); `recipe_of_slug` reverses it."""
    return "+".join(p.replace(DATA_PREFIX, "data-", 1) if p.startswith(DATA_PREFIX) else p for p in name.split("+"))


def recipe_of_slug(slug: str) -> str:
    return "+".join(DATA_PREFIX + p[len("data-"):] if p.startswith("data-") else p for p in slug.split("+"))


# ---------------------------------------------------------------------------------------------
# The data lever: which rows a run trains on


def run_dataset(size: int, name: str) -> str:
    """The dataset a screen run trains on, as a key: str(size) for the size's own dataset (the first size x
    --train-conversations conversations of the bench's chat; the key screen-positions.json has always used),
    str(2 x size) for `prompts-2x` (the next size's dataset), "SIZE:NAME" for `data:NAME` (chat NAME's rows for
    the same prompts as the size's own dataset)."""
    data = resolve_recipe(name).get("data")
    if data is None:
        return str(size)
    if data == PROMPTS_2X:
        return str(2 * size)
    return f"{size}:{data}"


def base_chat_factor(sizes: Sequence[int], names: Sequence[str]) -> int:
    """Conversations the bench's own chat must hold, in multiples of --train-conversations: the largest size, or
    twice it where a recipe trains on the next size's dataset."""
    return max(int(run_dataset(f, n)) for f in sizes for n in names if ":" not in run_dataset(f, n))


def chat_names(names: Sequence[str]) -> list[str]:
    """The --screen-chat datasets the recipes train on (`data:NAME`), in order."""
    return list(dict.fromkeys(d for n in names if (d := resolve_recipe(n).get("data")) and d != PROMPTS_2X))


def parse_screen_chat(values: Sequence[str]) -> dict[str, str]:
    """`--screen-chat NAME=DIR_OR_ARCHIVE ...` -> {NAME: path}."""
    out = {}
    for value in values:
        name, eq, path = value.partition("=")
        if not eq or not name or not path or any(c in name for c in ":+/") or name == PROMPTS_2X:
            raise ValueError(f"--screen-chat {value}: expected NAME=DIR or NAME=chat-NAME.tar.xz (NAME without ':', "
                             f"'+' or '/', not {PROMPTS_2X})")
        out[name] = path
    return out


def first_prompts(primary_ids: Iterable[str | None], n: int) -> list[str]:
    """The first n conversations' keys in a chat's train_tokens.jsonl order: what stage 01 --max-samples n keeps
    (chat_rows.build_rows counts distinct `primary_id`s; a prompt's several answers share one)."""
    seen: dict[str, None] = {}
    for pid in primary_ids:
        if pid is None:
            raise ValueError("a training row without primary_id: stage 01 would count it as its own conversation")
        if pid not in seen:
            if len(seen) >= n:
                break
            seen[pid] = None
    return list(seen)


def same_prompts(lines: Iterable[str], prompts: Sequence[str]) -> tuple[list[str], dict]:
    """The rows (jsonl lines) of another chat whose prompt (`primary_id`) is one of `prompts` (the size's own
    dataset's), in their order; and the counts (prompts matched, prompts missing: an answer the other chat dropped
    as too long or empty)."""
    wanted, kept, found = set(prompts), [], set()
    for line in lines:
        if not line.strip():
            continue
        pid = json.loads(line).get("primary_id")
        if pid in wanted:
            kept.append(line if line.endswith("\n") else line + "\n")
            found.add(pid)
    return kept, {"prompts": len(prompts), "prompts_matched": len(found), "prompts_missing": len(wanted - found),
                  "rows": len(kept)}


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


def data_base(name: str) -> str:
    """The recipe a data recipe is compared with: the same changes on the size's own dataset (ours if none)."""
    kept = [p for p in name.split("+") if "data" not in _part(p)]
    return "+".join(kept) or "ours"


def equal_steps_epoch(curve: Mapping, steps: int) -> int:
    """The epoch of `curve` whose optimizer steps are nearest `steps` (the earlier on a tie): a data recipe trains
    more rows per epoch at its base's step cost (the same class), so equal steps are equal training GPU time."""
    return min(curve["points"], key=lambda p: (abs(p["steps"] - steps), p["epoch"]))["epoch"]


def data_lever_table(curves_by_size: Mapping[str, Mapping], vllm: Mapping, vllm_equal: Mapping,
                     ks: Sequence[int]) -> list[dict]:
    """The data lever in vLLM (a data recipe's offline tau is on its own dataset's held-out rows, so only vLLM's
    held-out prompts compare datasets): per data recipe, its tau / its base's (the same recipe on the size's own
    dataset) at equal training GPU time (its checkpoint at the base's last steps, `vllm_equal`) and at equal
    epochs (last checkpoints, `vllm`); `prompts-2x` likewise is the "twice the prompts" arm, and a `data:NAME`
    recipe is also set against it at equal GPU time (`vs_prompts_2x_kK`: the same GPU time on other answers to the
    same prompts, or on new prompts)."""
    rows = []
    for size, recipes in curves_by_size.items():
        for name in recipes:
            if "data" not in resolve_recipe(name):
                continue
            base = data_base(name)
            row = {"data": size, "recipe": name, "base": base, "dataset": resolve_recipe(name)["data"]}
            equal = vllm_equal.get(size, {}).get(name)
            if equal:
                row["equal_time_epoch"], row["equal_time_steps"] = equal["epoch"], equal["steps"]
            for k in ks:
                key = str(k)
                base_tau = vllm.get(size, {}).get(base, {}).get(key)
                if not base_tau:
                    continue
                for label, tau in (("equal_time", (equal or {}).get(key)), ("equal_epochs", vllm.get(size, {}).get(name, {}).get(key))):
                    if tau:
                        ratio, se = lc._ratio((tau["tau"], tau["tau_stderr"]), (base_tau["tau"], base_tau["tau_stderr"]))
                        row[f"{label}_k{k}"] = {"tau": tau["tau"], "tau_stderr": tau["tau_stderr"], "base_tau": base_tau["tau"],
                                                "ratio": ratio, "stderr": se}
            # the same GPU time spent on twice the prompts instead (both at their base's last steps)
            twin = PROMPTS_2X if base == "ours" else f"{base}+{PROMPTS_2X}"
            twin_equal = vllm_equal.get(size, {}).get(twin)
            if twin != name and equal and twin_equal:
                row["vs"] = twin
                for k in ks:
                    a, b = equal.get(str(k)), twin_equal.get(str(k))
                    if a and b:
                        ratio, se = lc._ratio((a["tau"], a["tau_stderr"]), (b["tau"], b["tau_stderr"]))
                        row[f"vs_prompts_2x_k{k}"] = {"ratio": ratio, "stderr": se}
            rows.append(row)
    return rows


def format_data_lever(rows: Sequence[Mapping], ks: Sequence[int]) -> list[str]:
    if not rows:
        return []
    lines = ["data lever (vLLM tau / the same recipe on the size's own dataset; = GPU time: the data recipe's checkpoint "
             "at its base's last steps)"]
    for r in rows:
        line = f"{r['data']}x {r['recipe']:<28} vs {r['base']:<14}"
        for k in ks:
            line += f" | k={k} = GPU time {_fmt(r.get(f'equal_time_k{k}')):>12} (epoch {r.get('equal_time_epoch', -1) + 1})" \
                    f" = epochs {_fmt(r.get(f'equal_epochs_k{k}')):>12}"
            line += f" / {r['vs']} at = GPU time {_fmt(r.get(f'vs_prompts_2x_k{k}')):>12}" if "vs" in r else ""
        lines.append(line)
    return lines


def packing_of(records: Iterable[Mapping]) -> int | None:
    """Tokens packed per step of a training, from its metrics.jsonl records (speculators' args record, written
    at each launch: data.total_seq_len; the last launch's); None if none was written."""
    seq = None
    for record in records:
        data = record.get("data")
        if isinstance(data, Mapping) and "total_seq_len" in data:
            seq = int(data["total_seq_len"])
    return seq


def timing_for(timing: Mapping[str, Mapping], key: str, packing: int | None) -> tuple[float | None, str | None]:
    """(step seconds, why not) for a run whose step shape is timing[key]'s class at `packing` tokens per step: a
    timing recorded at another packing is another step shape (a run whose short-run rule packed otherwise, e.g. a
    data recipe with twice the rows), so it gives no step seconds. An entry without a recorded packing (made
    before it was recorded) is taken as it is."""
    entry = timing.get(key)
    if not entry:
        return None, None
    recorded = entry.get("total_seq_len")
    if recorded is not None and packing is not None and recorded != packing:
        return None, f"{key} was timed at {recorded} tokens/step, this run packed {packing}"
    return entry["step_s"], None


# A timing recorded before its packing was (the first 1x hold's file): its class's runs of that size in the same
# results file packed `tokens / steps` tokens per step on average; a packer fills a step to within a row of its
# size (1x: 7,883 of 8,192), so a mean in [FILL_LOW x P, P] says the runs packed P, never 4P.
FILL_LOW = 0.75


def mean_fill(results: Mapping) -> dict[str, float]:
    """{"SIZEx/CLASS": mean tokens per optimizer step of that class's runs there} from a screen results file's curves
    (last points), for its timing entries that record no packing."""
    out = {}
    for size, recipes in results.get("curves", {}).items():
        for name, curve in recipes.items():
            last = last_point(curve)
            if last.get("steps"):
                out.setdefault(f"{size}x/{curve.get('cost_class') or cost_class(name)}", last["tokens"] / last["steps"])
    return out


def _packing_match(entry: Mapping, packing: int) -> str | None:
    """How a donor entry's packing is known to equal `packing`, or None."""
    if entry.get("total_seq_len") is not None:
        return "recorded" if entry["total_seq_len"] == packing else None
    fill = entry.get("mean_tokens_per_step")
    if fill and FILL_LOW * packing <= fill <= packing:
        return f"inferred: its runs' mean {fill:.0f} tokens/step fits {packing}"
    return None


def carried_ours_draft(results: Mapping) -> dict | None:
    """The landed draft config ours trained with in a screen results file (its invocations' setup `ours_draft`), or
    None where any invocation did not record it (files before fc_norm became the default: ours was then
    speculators' single norm over the concatenation) or they differ."""
    setups = [inv.get("setup", {}) for inv in results.get("invocations", [])] or [results.get("setup", {})]
    drafts = [setup.get("ours_draft") for setup in setups]
    return drafts[0] if drafts and drafts[0] is not None and all(d == drafts[0] for d in drafts) else None


def sizes_already_measured(results: Mapping, sizes: Iterable[int], name: str) -> str | None:
    """Why a screen of `sizes` must not write into `results` (the file `name` it would merge into), or None. The
    merge keeps one record per data size, so a size measured again would replace an earlier hold's records of every
    recipe at that size (e.g. a new default's 1x screen over the 1x screen of the recipes that chose it)."""
    again = sorted({str(s) for s in sizes} & set(results.get("curves", {})), key=int)
    if not again:
        return None
    by = [f"{inv.get('commit') or '?'} {str(inv.get('date', '?'))[:10]}" for inv in results.get("invocations", [])
          if {str(s) for s in inv.get("data_sizes", [])} & set(again)]
    made = "; ".join(by) or "an earlier invocation"
    return (f"{name}: already holds the screen at {', '.join(s + 'x' for s in again)} ({made}), whose records this run "
            f"would replace; choose another --output (bench/h200_vllm_gpu.sh: SCREEN_RESULTS=NAME.json)")


def stale_timing(timing: Mapping[str, Mapping], ours_draft: Mapping) -> list[str]:
    """The keys of timing entries made over another landed draft than `ours_draft` (or over an unrecorded one):
    every class but plain trains on top of the draft config, so its step shape changed with it."""
    return [key for key, entry in timing.items()
            if not is_plain(key.split("/", 1)[1]) and entry.get("ours_draft") != ours_draft]


def seed_timing(timing: dict, wanted: Mapping[str, int | None], donors: Sequence[tuple[str, Mapping]],
                recipes_then: Mapping[str, Mapping] | None = None, ours_draft: Mapping | None = None,
                ours_drafts_then: Mapping[str, Mapping | None] | None = None) -> list[str]:
    """Fill timing's missing keys ("SIZEx/CLASS" -> the packing that size's runs of CLASS trained at) from donor
    timings of the same class at the same packing: the step shape is the class's kernels at that many tokens per
    step, whatever the data size. `donors`: (source, timing dict) in order of preference (this work's own
    screen-timing.json first, then a carried results file's `timing`); `recipes_then`: the donor file's recipes
    (its invocations' setup), so a class whose flags changed since is not reused. A donor entry without a recorded
    packing is reused only with its runs' `mean_tokens_per_step` (mean_fill) inside [FILL_LOW x packing, packing].
    `ours_draft`: the landed draft config ours trains with now; every class but plain builds on it, so its timing
    is reused only from an entry made over the same one (the entry's own `ours_draft`, else its source's in
    `ours_drafts_then`, None: not recorded). Each seeded entry says where it came from and how its packing is
    known (`seeded_from`). Returns log lines."""
    lines = []
    for key, packing in wanted.items():
        if key in timing or packing is None:
            continue
        cls = key.split("/", 1)[1]
        if recipes_then is not None and cls in recipes_then and recipes_then[cls] != resolve_recipe(cls):
            lines.append(f"timing {key}: not reused ({cls}'s flags differ from the carried file's)")
            continue
        other_draft = False
        for source, entries in donors:
            same_class = [(k, e) for k, e in entries.items() if k.split("/", 1)[1] == cls and k != key and e.get("step_s")]
            if ours_draft is not None and not is_plain(cls):
                made_over = {k: e.get("ours_draft", (ours_drafts_then or {}).get(source)) for k, e in same_class}
                other_draft = other_draft or any(d != ours_draft for d in made_over.values())
                same_class = [(k, e) for k, e in same_class if made_over[k] == ours_draft]
            match = next(((k, e, how) for k, e in same_class if (how := _packing_match(e, packing))), None)
            if match:
                donor_key, entry, how = match
                kept = {k: v for k, v in entry.items() if k not in ("seeded_from", "mean_tokens_per_step")}
                timing[key] = {**kept, "total_seq_len": packing,
                               **({"ours_draft": dict(ours_draft)} if ours_draft is not None else {}),
                               "seeded_from": {"source": source, "key": donor_key, "packing": how,
                                               **({"via": entry["seeded_from"]} if "seeded_from" in entry else {})}}
                lines.append(f"timing {key}: {1000 * entry['step_s']:.1f} ms/step from {source} {donor_key} "
                             f"(same class, {packing} tokens/step)")
                break
        else:
            if other_draft:
                lines.append(f"timing {key}: not reused (ours' draft differs from the carried file's)")
    return lines


# ---------------------------------------------------------------------------------------------
# The projection at Kimi-K2.5 geometry


# The norms before the fc projection as speculators 0.9.0's eagle3 trains them unless told otherwise: ours' draft until
# 33fcbc2 made fc_norm the landed default. Files made before then record no ours_draft (the screen's setup, a
# train_throughput results file): their ours trained this.
LEGACY_NORMS = {"fc_norm": False, "norm_before_fc": True}
NORM_FLAGS = ("--fc-norm", "--norm-before-fc", "--no-norm-before-fc")


def landed_draft() -> dict:
    """The draft config ours trains with (draft_config.json, validated, its defaults filled in): the screen's and
    the Kimi costs' record of what "ours" was."""
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG, load_draft_config

    return load_draft_config(DEFAULT_DRAFT_CONFIG).model_dump(exclude={"description"})


def extra_args_of(flags: Sequence[str]) -> list[str]:
    """The values of stage 04's --extra-args among `flags` (`--extra-args=X` or `--extra-args X`), in order."""
    out, i = [], 0
    while i < len(flags):
        flag = str(flags[i])
        if flag.startswith("--extra-args="):
            out.append(flag.split("=", 1)[1])
        elif flag == "--extra-args" and i + 1 < len(flags):
            i += 1
            out.append(str(flags[i]))
        i += 1
    return out


def trained_draft(draft: Mapping, extra_args: Sequence[str]) -> dict:
    """The draft speculators trains from stage 04's draft config fields `draft` and its --extra-args: 04 passes both
    norms explicitly and a user's extra args come after them (training.speculators_argv), so the last
    --norm-before-fc / --no-norm-before-fc wins, and --fc-norm (store_true: there is no way back) sets fc_norm."""
    out = dict(draft)
    for arg in extra_args:
        if arg == "--fc-norm":
            out["fc_norm"] = True
        elif arg in ("--norm-before-fc", "--no-norm-before-fc"):
            out["norm_before_fc"] = arg == "--norm-before-fc"
    return out


def recipe_draft(name: str, ours_draft: Mapping) -> dict | None:
    """The draft a recipe trains when ours trains `ours_draft`; None for plain (speculators' own defaults)."""
    recipe = resolve_recipe(name)
    if recipe.get("plain"):
        return None
    draft = trained_draft({**ours_draft, **recipe.get("draft", {})}, extra_args_of(recipe.get("train", [])))
    return {**draft, "speculator_type": recipe["kind"]} if recipe.get("kind") else draft


def _norms_only(part: str) -> bool:
    """A recipe part that changes nothing but the norms before fc (ours, fc-norm, no-fc-norm)."""
    recipe = _part(part)
    train = [str(f) for f in recipe.get("train", [])]
    return (set(recipe) <= {"train", "draft", "cost_as"} and set(recipe.get("draft", {})) <= set(LEGACY_NORMS)
            and all(f.startswith("--extra-args=") for f in train) and set(extra_args_of(train)) <= set(NORM_FLAGS))


def _changes(name: str) -> frozenset | None:
    """What a recipe name changes besides the norms before fc (its other parts); None: not a screen recipe. A Kimi
    run `ours-KIND` (train_throughput.py --kinds) is the kind recipe KIND."""
    if name.startswith("ours-") and name.removeprefix("ours-") in KIND_RECIPES:
        name = name.removeprefix("ours-")
    try:
        return frozenset(p for p in name.split("+") if not _norms_only(p))
    except ValueError:
        return None


def kimi_costs(throughput: Mapping) -> dict:
    """Each run's training tokens/s at Kimi-K2.5 geometry in a bench/train_throughput.py results JSON (`runs`:
    plain, ours, and ours-variants such as fc-norm, each 04 run with the `draft` it trained; `ours_draft`: the landed
    draft config then, absent in files made before the bench recorded it). Which run prices which of the screen's
    cost classes: kimi_classes."""
    runs = {name: {"tokens_per_s": float(r["tokens_per_s"]), "tokens_per_step": r.get("tokens_per_step"),
                   **({"draft": r["draft"]} if r.get("draft") is not None else {})}
            for name, r in throughput.get("runs", {}).items() if isinstance(r, Mapping) and r.get("tokens_per_s")}
    if not runs:
        raise ValueError("no run with tokens_per_s (expected bench/train_throughput.py's results JSON)")
    return {"gpu": throughput.get("gpu"), "commit": throughput.get("commit"), "date": throughput.get("date"),
            "geometry": throughput.get("geometry"), "ours_draft": throughput.get("ours_draft"), "runs": runs}


def kimi_classes(costs: Mapping, classes: Iterable[str], screen_ours_draft: Mapping | None) -> tuple[dict, str]:
    """Which Kimi run prices each of the screen's cost classes ({class: run name, or None: no run trained it}) and a
    note saying how: by the draft each trained, not by name alone (the screen's ours and the Kimi file's can be
    different drafts). A class is priced by the Kimi run of the same changes besides the norms before fc (its name's
    other parts) that trained the same draft (fields both sides record), the run of its own name first. The Kimi
    runs' drafts: each run's recorded `draft`; in a file without `ours_draft` (made before the bench recorded drafts)
    inferred from the run's name over the legacy ours (LEGACY_NORMS), as is the ours of a screen without one
    (`screen_ours_draft` None: made before 9f0f1cf). A legacy screen priced with a legacy Kimi file maps by name."""
    kimi_ours, screen_ours = costs.get("ours_draft"), screen_ours_draft
    kimi_base = kimi_ours if kimi_ours is not None else {**(screen_ours or {}), **LEGACY_NORMS}
    screen_base = screen_ours if screen_ours is not None else {**(kimi_ours or {}), **LEGACY_NORMS}
    run_drafts = {}
    for name, run in costs["runs"].items():
        if _changes(name) is None:
            continue  # not a screen recipe's name (e.g. a packing variant): it prices no class
        if run.get("draft") is not None:
            run_drafts[name] = run["draft"]
        elif kimi_ours is None or resolve_recipe(name).get("plain"):
            run_drafts[name] = recipe_draft(name, kimi_base)

    def same(a: Mapping | None, b: Mapping | None) -> bool:
        return a is None and b is None or (a is not None and b is not None and set(LEGACY_NORMS) <= set(a) & set(b)
                                           and all(a[k] == b[k] for k in set(a) & set(b)))

    mapping = {}
    for cls in dict.fromkeys(classes):
        want = recipe_draft(cls, screen_base)
        found = [n for n, d in run_drafts.items() if _changes(n) == _changes(cls) and same(d, want)]
        mapping[cls] = cls if cls in found else (found[0] if found else None)
    moved = [f"{c} by {r!r}" if r else f"{c} by none (no Kimi run trained its draft)"
             for c, r in mapping.items() if r != c and (r or c in costs["runs"])]
    legacy = ("the Kimi file records no ours_draft: its runs read as over the legacy draft (fc_norm false, "
              "norm_before_fc true; its 'ours' is today's no-fc-norm, its 'fc-norm' today's ours)"
              if kimi_ours is None else "")
    if screen_ours is None:
        legacy += ("; " if legacy else "") + "the screen records no ours_draft: its ours is the legacy draft"
    note = "Kimi runs by the draft each trained" + (f" ({legacy})" if legacy else "") + (
        ": " + ", ".join(moved) if moved else ": every class by its own name")
    return mapping, note


def screen_ours_drafts(results: Mapping) -> dict[str, dict | None]:
    """Each data size's ours draft in a screen results file: the setup `ours_draft` of the last invocation that trained
    it (None where that did not record one: made before 9f0f1cf, ours was the legacy draft); speed-only invocations
    train nothing."""
    out: dict[str, dict | None] = {}
    for inv in results.get("invocations", []):
        if not inv.get("speed_only"):
            for size in inv.get("data_sizes") or []:
                out[str(size)] = inv.get("setup", {}).get("ours_draft")
    return out


def with_kimi_classes(costs: Mapping, curves_by_size: Mapping[str, Mapping],
                      ours_drafts: Mapping[str, Mapping | None]) -> dict:
    """`costs` (kimi_costs) with, per data size, the Kimi run that prices each cost class (`classes`) and how
    (`classes_from`: kimi_classes' note), the screen's ours being `ours_drafts[size]` (absent: the legacy draft)."""
    classes, notes = {}, {}
    for size, recipes in curves_by_size.items():
        wanted = [c.get("cost_class") or cost_class(n) for n, c in recipes.items()]
        classes[size], notes[size] = kimi_classes(costs, wanted, ours_drafts.get(size))
    return {**costs, "classes": classes, "classes_from": notes}


def projected_curves(curves_by_size: Mapping[str, Mapping], costs: Mapping) -> dict[str, dict]:
    """The screen's curves with x = the checkpoint's trained tokens / its cost class's Kimi-geometry tokens/s (the
    GPU seconds the same tokens would cost at Kimi-K2.5's width); recipes whose class no Kimi run prices are left
    out. The run of each class: `costs['classes']` (with_kimi_classes), else as for a screen without ours_draft."""
    if "classes" not in costs:
        costs = with_kimi_classes(costs, curves_by_size, {})
    out: dict[str, dict] = {}
    for size, recipes in curves_by_size.items():
        for name, curve in recipes.items():
            run_name = costs["classes"].get(size, {}).get(curve.get("cost_class") or cost_class(name))
            run = costs["runs"].get(run_name) if run_name else None
            if run:
                points = [{**p, "gpu_s": p["tokens"] / run["tokens_per_s"]} for p in curve["points"]]
                out.setdefault(size, {})[name] = {**curve, "points": points, "kimi": run}
    return out


def curves_projection(results: Mapping, costs: Mapping, ks: Sequence[int]) -> dict:
    """A learning-curves file (acceptance.py --curves) projected to Kimi-K2.5 geometry: each curve named as a screen
    recipe (ours, plain, ...; not the packing variants ours-8k/ours-32k) with x = its checkpoints' trained tokens /
    the Kimi tokens/s of the run that trained its draft (the file's `ours_draft` per size, as a screen's), then the
    equal-time table on those x: SmolLM2's tau against Kimi's step cost, a projection."""
    priced = {size: {n: c for n, c in recipes.items() if _changes(n) is not None}
              for size, recipes in results["curves"].items()}
    costs = with_kimi_classes(costs, priced, screen_ours_drafts(results))
    projected = projected_curves(priced, costs)
    return {**costs, "by_k": {str(k): lc.equal_time_table(projected, k) for k in ks}}


def format_curves_projection(projection: Mapping) -> list[str]:
    """curves_projection's tables as printed lines (the curves' equal-time rows, x in Kimi GPU seconds)."""
    lines = []
    for k, rows in projection["by_k"].items():
        lines.append(f"projection at Kimi-K2.5 geometry, tau ours/plain at k={k} at equal Kimi training GPU seconds "
                     f"(x = trained tokens / the Kimi run's tokens/s, {projection.get('source')}):")
        lines.append(f"  {'data':>5} {'recipe':<14} {'Kimi GPU s':>14} {'ratio at max':>14} {'min ratio':>10}")
        lines += [lc.format_equal_time_row(row) for row in rows]
    lines += [f"  {size}x: {note}" for size, note in projection.get("classes_from", {}).items()]
    return lines


def packing_differs(curve: Mapping) -> bool:
    """The Kimi run packed another number of tokens per step than the screen's run (beyond the few percent a
    packer leaves empty): its tokens/s is another step shape's."""
    seq, kimi = curve.get("total_seq_len"), (curve.get("kimi") or {}).get("tokens_per_step")
    return bool(seq and kimi) and abs(kimi - seq) > 0.05 * seq


# ---------------------------------------------------------------------------------------------
# Ranking


def last_point(curve: Mapping) -> Mapping:
    return max(curve["points"], key=lambda p: p["epoch"])


def best_point(curve: Mapping, k: int) -> Mapping:
    """The checkpoint with the highest offline tau at k (the epoch a held-out choice would keep)."""
    return max(curve["points"], key=lambda p: p["tau"][str(k)]["tau"])


def ranking(curves: Mapping[str, Mapping], k: int) -> list[tuple[str, float]]:
    """Recipes by offline tau at k of their last checkpoint, best first; a recipe without one (a draft kind's
    validation has no full_acc_i chain) is left out."""
    return sorted(((name, last_point(c)["tau"][str(k)]["tau"]) for name, c in curves.items()
                   if str(k) in last_point(c)["tau"]), key=lambda t: -t[1])


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


def screen_table(curves_by_size: Mapping[str, Mapping], ks: Sequence[int], vllm: Mapping | None = None,
                 kimi: Mapping | None = None) -> list[dict]:
    """One row per (data size, recipe): offline tau at each k at the last and at the best epoch, and the ratio
    to plain at equal epochs (last epoch) and at equal GPU time (curves.equal_time_table at the largest matched
    budget; absent until the timing phase gave every recipe a gpu_s), with vLLM's tau where measured. `kimi`
    (kimi_costs): the same equal-time ratio projected to Kimi-K2.5 geometry (`projected_time_kK`: x = trained
    tokens / the class's Kimi tokens/s; absent where a class has no Kimi figure)."""
    rows = []
    projected = projected_curves(curves_by_size, kimi) if kimi else {}
    for size, recipes in curves_by_size.items():
        timed = {n: c for n, c in recipes.items() if all(p["gpu_s"] is not None for p in c["points"])}
        for name, curve in recipes.items():
            row = {"data": size, "recipe": name, "cost_class": curve.get("cost_class"),
                   "step_s": curve.get("step_s"), "epochs": len(curve["points"])}
            last = last_point(curve)
            row["steps"], row["gpu_s"] = last["steps"], last["gpu_s"]
            for k in ks:
                key = str(k)
                measured = (vllm or {}).get(size, {}).get(name, {}).get(key)
                if measured:
                    row[f"vllm_k{k}"] = measured
                if key not in last["tau"]:  # no offline tau (a draft kind): its vLLM figure only
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
                proj = projected.get(size, {})
                if name != PLAIN and name in proj and PLAIN in proj:
                    pt = lc.equal_time_table({size: {name: proj[name], PLAIN: proj[PLAIN]}}, k)
                    if pt and pt[0].get("overlap"):
                        row[f"projected_time_k{k}"] = {
                            "ratio": pt[0]["ratio_at_max"], "stderr": pt[0]["ratio_at_max_stderr"],
                            "kimi_gpu_s": pt[0]["gpu_s_max"], "kimi_tokens_per_s": proj[name]["kimi"]["tokens_per_s"],
                            "packing_differs": packing_differs(proj[name]) or packing_differs(proj[PLAIN])}
            rows.append(row)
    return rows


def _fmt(entry: Mapping | None, value: str = "ratio", err: str = "stderr") -> str:
    return "-" if not entry else f"{entry[value]:.3f}±{entry[err]:.3f}"


def format_screen(rows: Sequence[Mapping], ks: Sequence[int], kimi: Mapping | None = None) -> list[str]:
    """The screen's table per data size; `kimi` (with_kimi_classes): its header says which Kimi run priced which class."""
    lines = []
    for size in dict.fromkeys(r["data"] for r in rows):
        size_rows = [r for r in rows if r["data"] == size]
        projection = any(f"projected_time_k{k}" in r for r in size_rows for k in ks)
        lines.append(f"screen at {size}x data: offline tau (held-out rows, last epoch), ratio to plain at equal epochs "
                     f"and at equal training GPU time, vLLM where measured"
                     + ("; projection: the equal-time ratio at Kimi-K2.5 geometry (trained tokens / the class's "
                        "Kimi tokens/s; * = a Kimi run at another packing than the screen's)" if projection else "")
                     + (f"; {kimi['classes_from'][size]}" if projection and size in (kimi or {}).get("classes_from", {})
                        else ""))
        head = f"{'recipe':<26} {'steps':>6} {'step ms':>8}"
        for k in ks:
            head += f" | k={k} {'offline':>13} {'best@ep':>8} {'= epochs':>12} {'= GPU time':>12} {'vLLM':>13}"
            head += f" {'projection':>12}" if projection else ""
        lines.append(head)
        top = max(ks)
        for r in sorted(size_rows, key=lambda r: -r.get(f"tau_k{top}", {}).get("tau", 0)):
            step_ms = "-" if r.get("step_s") is None else f"{1000 * r['step_s']:.1f}"
            line = f"{r['recipe']:<26} {r['steps']:>6} {step_ms:>8}"
            for k in ks:
                tau = r.get(f"tau_k{k}")
                line += (f" | k={k} {_fmt(tau, 'tau', 'tau_stderr'):>13} "
                         f"{(str(r.get(f'best_epoch_k{k}', '-'))):>8} {_fmt(r.get(f'equal_epochs_k{k}')):>12} "
                         f"{_fmt(r.get(f'equal_time_k{k}')):>12} {_fmt(r.get(f'vllm_k{k}'), 'tau', 'tau_stderr'):>13}")
                proj = r.get(f"projected_time_k{k}")
                line += f" {_fmt(proj) + ('*' if proj and proj['packing_differs'] else ''):>12}" if projection else ""
            lines.append(line)
    return lines
