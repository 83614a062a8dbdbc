"""Solo serving speed (acceptance.py --screen-speed-rounds, issue 44 item 3): vLLM output tokens/s of each draft and
of the target alone, one engine at a time, on the same held-out prompts.

The screen's tau phase starts one engine per draft in a fixed order (several at once with --jobs) and times one
generate: the first engine after the baseline pays the box's warm-up (on the H200 38 s engine start against 11 s),
so its tokens/s is confounded with its place in the order. Here each round starts every engine once, alone, in an
order rotated by one per round (round r starts at engine r mod n), so a place's cost is spread over the engines;
each engine generates the prompts once untimed (the warm-up: vLLM's settings.warmup_prompts set to all of them),
then `repeats` times timed (one pass over 96 prompts lasts ~3 s on the H200 against an engine start of ~60 s, so a
single timing scatters by percents; the repeats cost little); on a GPU with CUDA graphs, as vLLM serves
(serving_settings). At temperature 0 the rounds generate
the same tokens, so tau must be equal across rounds: the summary records whether it was (and whether the outputs
were), a check on the measurement itself.

The draft kinds (issue 62: dflash, peagle, dspark, dflash2) are served the same way, one engine each at the kind's
served k with its own speculative_config (method, parallel_drafting for P-EAGLE: acceptance.kind_serving), in the same
rounds and against the same baseline (`by_kind`); a kind the vLLM in use cannot serve starts no engine and is recorded
in `kinds_not_measured` with its one-line reason, as is a kind whose engine failed (the EAGLE-3 figures still come).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .acceptance import VllmSettings, prompt_token_ids, run_engine_isolated

BASELINE = "baseline"  # the target alone: no draft, one engine per round whatever the ks


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """Round r's engine order: the list started at its (r mod n)-th entry."""
    start = round_index % len(names) if names else 0
    return [*names[start:], *names[:start]]


def engine_names(drafts: Mapping[str, str], ks: Sequence[int],
                 kinds: Mapping[str, Mapping] | None = None) -> dict[str, tuple[str | None, int]]:
    """Every engine of a round: the baseline, then each draft at each k (label-kK), then each servable kind draft at
    its own served k only (label-kK; kind_plan's entries), as (draft dir, k)."""
    return {BASELINE: (None, 0), **{f"{label}-k{k}": (path, k) for label, path in drafts.items() for k in ks},
            **{f"{label}-k{kind['k']}": (kind["draft"], kind["k"]) for label, kind in (kinds or {}).items()}}


def kind_plan(kinds: Mapping[str, Mapping]) -> tuple[dict[str, dict], dict[str, str]]:
    """The kind drafts' part of the plan: each label's serving (acceptance.kind_serving's dict plus "draft": its
    checkpoint) -> ({label: {draft, kind, k, method, speculative_config}} to serve, {label: reason} not to: the vLLM
    in use cannot serve it, no engine)."""
    serve, not_measured = {}, {}
    for label, how in kinds.items():
        if "not_measured" in how or "k" not in how or not how.get("draft"):
            not_measured[label] = how.get("not_measured") or "no served k or no checkpoint"
            continue
        serve[label] = {"draft": str(how["draft"]), "kind": how.get("kind"), "k": int(how["k"]), "method": how.get("method"),
                        "speculative_config": dict(how.get("speculative_config") or {})}
    return serve, not_measured


def outputs_digest(token_ids: Sequence[Sequence[int]]) -> str:
    """The generated tokens of one round, short: equal digests = the same outputs token for token."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def stderr_of(values: Sequence[float]) -> float | None:
    """The standard error of the values' mean (None under two values)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def summarize(rounds: Sequence[Mapping], baseline_median: float | None = None) -> dict:
    """One engine's rounds (in round order) -> tokens/s per round, median, min, max, x the baseline's median, tau per
    round and whether tau and the outputs were the same in every round (temperature 0: they must be).
    `stderr_tokens_per_s`: over the rounds' figures when there are several rounds (engine to engine, the honest
    one), else over the one round's timed repeats (within one engine: a lower bound)."""
    tps = [r["tokens_per_s"] for r in rounds]
    taus = [r.get("tau") for r in rounds]
    out = {"rounds": len(rounds), "tokens_per_s": tps, "median_tokens_per_s": statistics.median(tps),
           "min_tokens_per_s": min(tps), "max_tokens_per_s": max(tps),
           "engine_start_s": [r["engine_start_s"] for r in rounds], "generate_s": [r["generate_s"] for r in rounds],
           "generated_tokens": [r["generated_tokens"] for r in rounds], "position": [r["position"] for r in rounds],
           "outputs_equal_across_rounds": len({r["outputs_sha"] for r in rounds}) == 1,
           "repeat_tokens_per_s": [r.get("repeat_tokens_per_s") for r in rounds],
           "outputs_equal_across_repeats": [r.get("outputs_equal_across_repeats", True) for r in rounds],
           "stderr_tokens_per_s": stderr_of(tps) if len(tps) > 1 else stderr_of(rounds[0].get("repeat_tokens_per_s") or []),
           "stderr_from": "rounds" if len(tps) > 1 else "repeats"}
    if any(t is not None for t in taus):
        out.update(tau=taus, tau_equal_across_rounds=len(set(taus)) == 1)
    if baseline_median:
        out["speedup_median"] = out["median_tokens_per_s"] / baseline_median
    return out


def serving_settings(settings: VllmSettings, cpu: bool) -> VllmSettings:
    """The speed phase's engine settings: the tau phase's, but on a GPU with CUDA graphs (vLLM's serving default, as
    stage 06's own defaults). Eager, every kernel is launched from Python, which at a small target is most of a decode
    step: a draft's few extra small kernels (fc_norm's three RMSNorms) would cost far more than in a served engine.
    tau does not depend on it (the tau phase stays eager: no capture per engine); speed does. vLLM's CPU build: eager."""
    return settings if cpu else dataclasses.replace(settings, enforce_eager=False)


def measure_speed(target_dir, drafts: Mapping[str, str], prompts_path, ks: Sequence[int], rounds: int,
                  settings: VllmSettings, stamp: Callable[[str], str], cache: dict, save: Callable[[dict], None],
                  log_dir: Path | None = None, log=print, key_prefix: str = "", repeats: int = 1,
                  kinds: Mapping[str, Mapping] | None = None) -> dict:
    """`rounds` rounds of every engine (engine_names) one at a time, rotated; `cache` holds each finished (engine,
    round) under key_prefix + engine name with the draft's `stamp` and the settings (a kind's also with its
    speculative_config), so a rerun runs only what is missing (`save` writes it after each engine). Returns the speed
    block: per draft and k the summary, and the baseline's. `kinds`: the kind drafts (label -> kind_serving's dict
    with "draft"), each served at its own k with its speculative_config (`by_kind`, `kinds`); one that cannot be
    served, or whose engine failed, goes to `kinds_not_measured` with its one-line reason. An EAGLE-3 draft's or the
    baseline's failed engine raises, as before."""
    prompts = prompt_token_ids(target_dir, prompts_path)
    # the untimed warm-up generate is every prompt once (run_engine generates settings.warmup_prompts of them first)
    warm = dataclasses.replace(settings, warmup_prompts=len(prompts))
    served_kinds, kinds_not_measured = kind_plan(kinds or {})
    engines = engine_names(drafts, ks, served_kinds)
    spec_of = {f"{label}-k{kind['k']}": (label, kind["speculative_config"]) for label, kind in served_kinds.items()}
    names = list(engines)
    same = json.dumps({"settings": dataclasses.asdict(warm), "prompts": outputs_digest(prompts),
                       **({"repeats": repeats} if repeats > 1 else {})}, sort_keys=True)
    order = []
    for r in range(rounds):
        order.append(rotated(names, r))
        for position, name in enumerate(order[-1]):
            draft, k = engines[name]
            kind_label, spec = spec_of.get(name, (None, None))
            if kind_label in kinds_not_measured:
                continue  # its engine failed in an earlier round: not started again
            key = f"{key_prefix}{name}"
            entry_stamp = f"{stamp(draft) if draft else target_dir}|{same}"
            if kind_label:
                entry_stamp += f"|{json.dumps(spec, sort_keys=True)}"
            if cache.get(key, {}).get("stamp") != entry_stamp:
                cache[key] = {"stamp": entry_stamp, "rounds": {}}
            if str(r) in cache[key]["rounds"]:
                continue
            log_path = str(log_dir / f"vllm-speed-{name}-r{r}.log") if log_dir else None
            try:
                run = run_engine_isolated(target_dir, draft, k, prompts, warm, log_path, timed_repeats=repeats,
                                          **({"speculative_config": spec} if kind_label else {}))
            except RuntimeError as exc:  # EngineFailed: a kind's engine is recorded, the others go on
                if not kind_label:
                    raise
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                kinds_not_measured[kind_label] = f"engine failed: {reason}"
                log(f"  speed round {r + 1}/{rounds} #{position + 1} {name}: engine failed, not measured: {reason}")
                continue
            sd = run.get("spec_decode")
            cache[key]["rounds"][str(r)] = {
                "round": r, "position": position, "tokens_per_s": run["tokens_per_s"], "generate_s": run["generate_s"],
                "generated_tokens": run["generated_tokens"], "engine_start_s": run["engine_start_s"],
                "tau": sd["mean_acceptance_length"] if sd else None,
                "outputs_sha": outputs_digest(run["generated_token_ids"]),
                "repeat_tokens_per_s": run.get("repeat_tokens_per_s"),
                "outputs_equal_across_repeats": run.get("outputs_equal_across_repeats", True)}
            save(cache)
            log(f"  speed round {r + 1}/{rounds} #{position + 1} {name}: {run['tokens_per_s']:.1f} tokens/s"
                + (f", tau {sd['mean_acceptance_length']:.3f}" if sd else "") + f", engine start {run['engine_start_s']:.0f} s")

    def rounds_of(name: str) -> list[dict]:
        return [cache[f"{key_prefix}{name}"]["rounds"][str(r)] for r in range(rounds)]

    baseline = summarize(rounds_of(BASELINE))
    by_draft = {label: {str(k): summarize(rounds_of(f"{label}-k{k}"), baseline["median_tokens_per_s"]) for k in ks}
                for label in drafts}
    by_kind = {label: {str(kind["k"]): summarize(rounds_of(f"{label}-k{kind['k']}"), baseline["median_tokens_per_s"])}
               for label, kind in served_kinds.items() if label not in kinds_not_measured}
    for label, by_k in {**by_draft, **by_kind}.items():
        for k, s in by_k.items():
            if not s["tau_equal_across_rounds"] or not s["outputs_equal_across_rounds"]:
                log(f"  WARNING speed {label} k={k}: tau {s['tau']} or the outputs differ across rounds at temperature "
                    f"{settings.temperature} (the rounds did not generate the same tokens)")
    block = {"rounds": rounds, "repeats": repeats, "ks": list(ks), "prompts": str(prompts_path), "num_prompts": len(prompts),
             "settings": dataclasses.asdict(warm), "drafts": dict(drafts), "order": order,
             "baseline": baseline, "by_draft": by_draft}
    if kinds:  # the EAGLE-3-only block keeps its keys as before
        block.update(kinds={label: kind for label, kind in served_kinds.items() if label not in kinds_not_measured},
                     by_kind=by_kind, kinds_not_measured=kinds_not_measured)
    return block


def _se(summary: Mapping) -> str:
    se = summary.get("stderr_tokens_per_s")
    return "-" if se is None else f"{se:.1f}"


def _same(summary: Mapping) -> str:
    """yes: the same tokens (and tau) in every round and every timed repeat, as greedy decoding must give."""
    repeats_equal = all(summary.get("outputs_equal_across_repeats") or [True])
    return "yes" if summary.get("tau_equal_across_rounds", True) and summary["outputs_equal_across_rounds"] and repeats_equal else "NO"


def format_speed(speed_by_size: Mapping[str, Mapping]) -> list[str]:
    """The speed table: draft, k, median tokens/s over the rounds, its standard error (stderr_from), its range, x the
    baseline's median, tau."""
    lines = []
    for size, block in speed_by_size.items():
        base = block["baseline"]
        lines.append(f"serving speed at {size}x data: vLLM output tokens/s, one engine at a time, {block['rounds']} "
                     f"rounds in rotated order x {block.get('repeats', 1)} timed passes, {block['num_prompts']} held-out "
                     f"prompts (median over rounds; se over the {base.get('stderr_from', 'rounds')}; min-max over rounds)")
        lines.append(f"{'draft':<26} {'k':>2} {'tokens/s':>9} {'se':>6} {'range':>15} {'x base':>7} {'tau':>7} {'same':>5}")
        lines.append(f"{BASELINE:<26} {'-':>2} {base['median_tokens_per_s']:>9.1f} {_se(base):>6} "
                     f"{base['min_tokens_per_s']:>7.1f}-{base['max_tokens_per_s']:<7.1f} {1.0:>7.2f} {'-':>7} "
                     f"{_same(base):>5}")
        kinds = block.get("kinds", {})
        for label, by_k in {**block["by_draft"], **block.get("by_kind", {})}.items():
            for k, s in sorted(by_k.items(), key=lambda kv: int(kv[0])):
                lines.append(f"{label:<26} {k:>2} {s['median_tokens_per_s']:>9.1f} {_se(s):>6} "
                             f"{s['min_tokens_per_s']:>7.1f}-{s['max_tokens_per_s']:<7.1f} {s['speedup_median']:>7.2f} "
                             f"{s['tau'][0]:>7.3f} {_same(s):>5}"
                             + (f"  ({kinds[label]['method']}, its served k)" if label in kinds else ""))
        for label, reason in block.get("kinds_not_measured", {}).items():
            lines.append(f"{label:<26} not measured: {reason}")
    return lines
