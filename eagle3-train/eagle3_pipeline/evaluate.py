"""Acceptance length tau of a draft measured in vLLM: the one home of this measurement (stage 06
and bench/acceptance.py both call it). EAGLE-3 by default; a draft of another kind (draft_kinds.py) is served with
the speculative_config its kind needs (method dflash, eagle3 + parallel_drafting, ...: `speculative_config`).

tau is the mean number of tokens one target forward pass produces with speculative decoding: the
accepted draft tokens plus the one token the target always contributes (the correction at the first
mismatch, or the bonus token when every draft token was accepted). It decides the speed-up.

The target and the exported draft are loaded with `speculative_config={"method": "eagle3", ...}` (or the kind's),
prompts are generated (greedy unless `VllmSettings.temperature`), and vLLM's own spec-decode counters
are read back through `LLM.get_metrics()`:

    vllm:spec_decode_num_drafts                   target steps that verified a draft
    vllm:spec_decode_num_draft_tokens             draft tokens proposed
    vllm:spec_decode_num_accepted_tokens          draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos  accepted tokens at draft position i

tau = 1 + accepted / drafts (vLLM's own "mean acceptance length"), and the acceptance rate at
position i is accepted_per_pos[i] / drafts, i.e. P(draft tokens 0..i all accepted).

Each vLLM engine runs in a fresh interpreter (`run_engine_isolated`): the counters live in the
process-global Prometheus registry, and a second engine in one process would share (or fight over) them.
That interpreter leads its own process group (vLLM's engine-core processes join it) and holds a lifeline:
the read end of a pipe only the caller can write to. When the caller dies, however (kill -9 included), the
pipe reads end-of-file and the engine kills its whole group, so no engine outlives the stage that started it
(a rerun would otherwise start a second one beside it). An engine that exits with an error is one line quoting
vLLM's own reason from its log (`EngineFailed`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import StageError

# Local imports: vllm: only inside the engine's own process (run_engine; heavy, and absent where only
# the counters' arithmetic is used).

SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
SPEC_DECODE_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class VllmSettings:
    """How the engine is run for a measurement; the same for the baseline and the drafts."""

    max_tokens: int = 128
    max_model_len: int = 1024
    # float32 keeps greedy outputs with and without the draft comparable token for token;
    # bf16 argmax ties flip between batch shapes. (The organism is tiny: speed is not the point.)
    dtype: str = "float32"
    max_num_seqs: int = 16
    kv_cache_gib: int = 1
    seed: int = 0
    # 0 = greedy: the draft is judged on the tokens the target would emit anyway; > 0 samples (vLLM's
    # rejection sampling then decides acceptance), as a service with that temperature would.
    temperature: float = 0.0
    # CPU torch.compile of the draft and target costs minutes on 2 cores; eager is what we measure.
    enforce_eager: bool = True
    warmup_prompts: int = 2
    extra_engine_args: dict = field(default_factory=dict)


def spec_decode_counters(metrics: Sequence) -> dict:
    """Sum vLLM's spec-decode counters over engines from `LLM.get_metrics()` output.

    Returns {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"};
    zeros and [] when the engine has no speculative decoding.
    """
    counts = {name: 0 for name in SPEC_DECODE_COUNTERS.values()}
    per_pos: list[int] = []
    for metric in metrics:
        name = getattr(metric, "name", None)
        if name in SPEC_DECODE_COUNTERS:
            counts[SPEC_DECODE_COUNTERS[name]] += int(metric.value)
        elif name == SPEC_DECODE_PER_POS:
            values = list(metric.values)
            if len(per_pos) < len(values):
                per_pos.extend([0] * (len(values) - len(per_pos)))
            for i, v in enumerate(values):
                per_pos[i] += int(v)
    counts["accepted_per_pos"] = per_pos
    return counts


def counters_delta(before: Mapping, after: Mapping) -> dict:
    """after - before, so warm-up requests do not count."""
    delta = {k: after[k] - before.get(k, 0) for k in SPEC_DECODE_COUNTERS.values()}
    prior = list(before.get("accepted_per_pos", []))
    prior += [0] * (len(after["accepted_per_pos"]) - len(prior))
    delta["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prior)]
    return delta


def summarize_spec_decode(counts: Mapping) -> dict:
    """tau and per-position acceptance from counter values (see the module docstring)."""
    drafts = counts["num_drafts"]
    if drafts <= 0:
        raise ValueError("no drafts were verified: is speculative decoding on?")
    per_pos = counts["accepted_per_pos"]
    # With greedy chain verification, position i is accepted only when 0..i-1 were, so
    # per_pos[i] / drafts = P(accepted >= i + 1): the whole distribution of the accepted count,
    # hence its variance. The standard error treats drafts as independent (they are not quite:
    # neighbouring drafts of one request share context), so read it as a lower bound.
    survival = [a / drafts for a in per_pos]
    mean = sum(survival)
    second_moment = sum((2 * i + 1) * p for i, p in enumerate(survival))  # E[L^2] = sum (2i+1) P(L > i)
    variance = max(0.0, second_moment - mean * mean)
    return {
        **{k: counts[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        "accepted_per_pos": list(per_pos),
        "mean_acceptance_length": 1.0 + counts["num_accepted_tokens"] / drafts,
        "mean_acceptance_length_stderr": (variance / drafts) ** 0.5,
        "acceptance_rate_per_pos": survival,
        # each position's rate is a proportion over the same drafts (binomial standard error)
        "acceptance_rate_per_pos_stderr": [(p * (1 - p) / drafts) ** 0.5 for p in survival],
        "draft_acceptance_rate": counts["num_accepted_tokens"] / max(1, counts["num_draft_tokens"]),
    }


def repeated_ngram_fraction(outputs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Fraction of generated tokens that end an n-gram already seen earlier in the same output.

    A looping target (small greedy models repeat themselves) makes drafting easy, so tau on
    repetitive text overstates what a draft does on fresh text; this says how much of the
    measured text was repetition.
    """
    repeated, total = 0, 0
    for tokens in outputs:
        seen: set[tuple[int, ...]] = set()
        for i in range(n - 1, len(tokens)):
            gram = tuple(tokens[i - n + 1 : i + 1])
            repeated += gram in seen
            seen.add(gram)
        total += len(tokens)
    return repeated / max(1, total)


def _timed_pass(llm, requests: list, labels: list[str], greedy, with_draft: bool) -> tuple[list, dict, float, int]:
    """One timed generation of every request, group by group: (token ids per request, per-group figures, seconds,
    generated tokens)."""
    generated: list[list[int]] = [[] for _ in requests]
    by_group, generate_s = {}, 0.0
    for group in sorted(set(labels)):
        members = [i for i, label in enumerate(labels) if label == group]
        group_before = spec_decode_counters(llm.get_metrics()) if with_draft else None
        t0 = time.perf_counter()
        outputs = llm.generate([requests[i] for i in members], greedy, use_tqdm=False)
        seconds = time.perf_counter() - t0
        generate_s += seconds
        for i, output in zip(members, outputs):
            generated[i] = list(output.outputs[0].token_ids)
        tokens = sum(len(generated[i]) for i in members)
        by_group[group] = {"num_prompts": len(members), "generated_tokens": tokens, "generate_s": seconds,
                           "tokens_per_s": tokens / seconds}
        if with_draft:
            delta = counters_delta(group_before, spec_decode_counters(llm.get_metrics()))
            # a group whose outputs all end at once verifies no draft: reported as such, not divided by zero
            by_group[group]["spec_decode"] = summarize_spec_decode(delta) if delta["num_drafts"] > 0 else None
    return generated, by_group, generate_s, sum(len(g) for g in generated)


def run_engine(target_dir: str, draft_dir: str | None, num_speculative_tokens: int,
               prompts: list[list[int]], settings: VllmSettings, groups: list[str] | None = None,
               timed_repeats: int = 1, speculative_config: dict | None = None) -> dict:
    """One engine, in this process: greedy generation on `prompts`, timed, with counters.

    `groups` (one label per prompt, e.g. the prompt's kind) adds `by_group`: each group is
    generated on its own, so vLLM's counters and tokens/s can be read per group.
    `timed_repeats` > 1 times the whole generation that many times in the one engine
    (`repeat_tokens_per_s`): a small target's pass over the prompts lasts seconds, so one
    timing scatters by several percent while the engine's start costs a minute.
    `speculative_config`: the draft's method and its kind's other keys (draft_kinds.speculative_config; None:
    eagle3); its model and k are `draft_dir` and `num_speculative_tokens`.
    Call it through `run_engine_isolated` unless this process runs nothing else with vLLM.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = dict(
        model=target_dir,
        tokenizer=target_dir,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        disable_log_stats=False,  # LLM() turns stats off by default; the counters need them
        **settings.extra_engine_args,
    )
    if draft_dir is not None:
        engine_args["speculative_config"] = {
            "method": "eagle3",
            **(speculative_config or {}),
            "model": draft_dir,
            "num_speculative_tokens": num_speculative_tokens,
        }
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    engine_start_s = time.perf_counter() - t0

    greedy = SamplingParams(temperature=settings.temperature, max_tokens=settings.max_tokens, seed=settings.seed)
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    if settings.warmup_prompts:
        llm.generate(requests[: settings.warmup_prompts], greedy, use_tqdm=False)
    before = spec_decode_counters(llm.get_metrics()) if draft_dir else None
    labels = groups if groups is not None else ["all"] * len(prompts)
    passes = [_timed_pass(llm, requests, labels, greedy, draft_dir is not None) for _ in range(max(1, timed_repeats))]
    generated, by_group, _, _ = passes[0]
    generate_s = sum(p[2] for p in passes)
    result = {
        "draft": draft_dir,
        "num_speculative_tokens": num_speculative_tokens if draft_dir else 0,
        "speculative_config": engine_args.get("speculative_config"),
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": sum(len(g) for g in generated),  # one pass's
        "generate_s": generate_s,  # every pass's
        "tokens_per_s": sum(p[3] for p in passes) / generate_s,
        "engine_start_s": engine_start_s,
        "repeated_4gram_fraction": repeated_ngram_fraction(generated, 4),
        "generated_token_ids": generated,
    }
    if timed_repeats > 1:
        result["repeat_tokens_per_s"] = [p[3] / p[2] for p in passes]
        result["outputs_equal_across_repeats"] = all(p[0] == generated for p in passes)
    if groups is not None:
        result["by_group"] = by_group
    if draft_dir:
        after = spec_decode_counters(llm.get_metrics())
        result["spec_decode"] = summarize_spec_decode(counters_delta(before, after))
    return result


def gpu_memory_args(gpu_memory_utilization: float, kv_cache_memory_gib: float | None) -> dict:
    """vLLM's GPU memory settings (02 and 06): the fraction, and a fixed KV cache when given. With one, vLLM does not
    size the cache by profiling free memory, which counts what other processes on a shared GPU take or free meanwhile
    as its own (on the H200, 06 beside another job's engines stopped with "Error in memory profiling")."""
    args: dict = {"gpu_memory_utilization": gpu_memory_utilization}
    if kv_cache_memory_gib:
        args["kv_cache_memory_bytes"] = int(kv_cache_memory_gib * 2**30)
    return args


def stage_settings(cfg, target, tensor_parallel_size: int, on_gpu: bool) -> VllmSettings:
    """Stage 06's engine settings from its config (EvaluateConfig): the same for the draft and the target alone."""
    extra = {"tensor_parallel_size": tensor_parallel_size, "trust_remote_code": cfg.trust_remote_code}
    if target.is_multimodal_wrapper:
        extra["language_model_only"] = True  # Kimi-K2.5: text only, no vision tower (as the serve command)
    if on_gpu:
        extra.update(gpu_memory_args(cfg.gpu_memory_utilization, cfg.kv_cache_memory_gib))
    return VllmSettings(max_tokens=cfg.max_tokens, max_model_len=cfg.max_model_len, dtype=cfg.dtype,
                        max_num_seqs=cfg.max_num_seqs, kv_cache_gib=cfg.cpu_kv_cache_gib, seed=cfg.seed,
                        enforce_eager=cfg.enforce_eager, warmup_prompts=1, temperature=cfg.temperature,
                        extra_engine_args=extra)


# vLLM's reasons with a remedy the user can act on, by a phrase of the reason
_REMEDIES = {
    "Error in memory profiling": "another process changed the GPU's memory while vLLM measured it: run with the GPU "
                                 "to this stage alone, or give a fixed KV cache (--kv-cache-memory-gib)",
}


def failure_remedy(reason: str | None) -> str | None:
    """What to do about a failed engine's reason, where there is a known remedy."""
    return next((remedy for phrase, remedy in _REMEDIES.items() if reason and phrase in reason), None)


class EngineFailed(StageError, RuntimeError):
    """A vLLM engine exited with an error (it refused the model, the draft or a setting): one line quoting its reason
    and naming its log; exit code 1 (a RuntimeError still, for the bench scripts that catch one)."""


# The lines of a vLLM log that name an error, most specific last; the generic wrappers say "see above".
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)|AssertionError|KeyError): (.+)$")
_PROCESS_PREFIX = re.compile(r"^\([\w.-]+ pid=\d+\)\s*")  # "(EngineCore_DP0 pid=123) ": vLLM's engine-core lines
_GENERIC = ("Engine core initialization failed", "See root cause above", "Engine process failed to start")


def engine_failure_reason(log_text: str) -> str | None:
    """vLLM's own reason for a failed engine, from its log: the last exception line that is not a wrapper's "see
    above" (pydantic's "N validation error for X" with the line that says what), or None."""
    lines = [line.strip() for line in log_text.splitlines()]
    found = None
    for i, line in enumerate(lines):
        match = _ERROR_LINE.match(_PROCESS_PREFIX.sub("", line))
        if not match or any(generic in line for generic in _GENERIC):
            continue
        reason = f"{match.group(1)}: {match.group(2)}"
        if re.search(r"\d+ validation errors? for ", reason):  # pydantic: the next lines say what
            detail = [x for x in lines[i + 1:i + 4] if x and not x.startswith("For further information")]
            reason += ": " + " ".join(detail[:2])
        found = reason
    return found[:300] if found else None


def _lifeline(fd: int, scratch: Path) -> None:
    """In the engine's process: block on the caller's pipe; end-of-file means the caller is gone (killed: it closes
    its end only after this process exited), so remove the caller's scratch folder (the request; no one is left to)
    and end this process group (the engine and vLLM's engine-core processes)."""
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    shutil.rmtree(scratch, ignore_errors=True)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _child_main() -> None:
    """Entry point of the isolated engine process: request JSON on argv[2], result to argv[3], lifeline fd argv[4]."""
    if len(sys.argv) > 4:
        threading.Thread(target=_lifeline, args=(int(sys.argv[4]), Path(sys.argv[2]).parent), daemon=True,
                         name="lifeline").start()
    request = json.loads(Path(sys.argv[2]).read_text())
    settings = VllmSettings(**request.pop("settings"))
    result = run_engine(settings=settings, **request)
    tmp = Path(sys.argv[3] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, sys.argv[3])


_live_engines: set[subprocess.Popen] = set()  # engines this process started and has not reaped yet


def _stop_group(proc: subprocess.Popen) -> None:
    """The engine's whole process group, now (it leads its group: vLLM's own processes are in it). Called before
    the engine is reaped, so its pid (the group's id) cannot have been reused."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_engines() -> None:
    """Every engine still running (another thread's too): what a stopping caller does before it raises on."""
    for proc in list(_live_engines):
        _stop_group(proc)


def _wait_engine(proc: subprocess.Popen) -> int:
    """Wait for the engine to exit, then end what is left of its group (engine-core processes its exit left
    behind), and only then reap it; anything stopping this wait (Ctrl-C) stops the engine first."""
    _live_engines.add(proc)
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: the group id stays ours
        _stop_group(proc)
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        try:
            proc.wait()
        finally:
            _live_engines.discard(proc)
    return proc.returncode


def run_engine_isolated(target_dir, draft_dir, num_speculative_tokens, prompts,
                        settings: VllmSettings, log_path: str | os.PathLike | None = None,
                        env: Mapping[str, str] | None = None, groups: list[str] | None = None,
                        timed_repeats: int = 1, speculative_config: dict | None = None) -> dict:
    """`run_engine` in a fresh Python process (its own process group, dying with this one); vLLM's output goes to
    `log_path`. An engine that fails raises `EngineFailed` quoting vLLM's reason from that log."""
    package_parent = str(Path(__file__).resolve().parents[1])  # eagle3-train/, for a bare clone
    with tempfile.TemporaryDirectory(prefix="acceptance-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps({
            "target_dir": str(target_dir),
            "draft_dir": str(draft_dir) if draft_dir else None,
            "num_speculative_tokens": num_speculative_tokens,
            "prompts": prompts,
            "settings": asdict(settings),
            "groups": groups,
            "timed_repeats": timed_repeats,
            "speculative_config": speculative_config,
        }))
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(
            [package_parent] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
        child_env.update(env or {})
        # The lifeline: only this process holds the write end (os.pipe's ends are not inherited by other children).
        lifeline_read, lifeline_write = os.pipe()
        log_file = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "eagle3_pipeline.evaluate", "--child",
                 str(request_path), str(result_path), str(lifeline_read)],
                env=child_env, stdout=log_file, stderr=subprocess.STDOUT, pass_fds=(lifeline_read,),
                start_new_session=True,
            )
        finally:
            os.close(lifeline_read)
            if log_path:
                log_file.close()
        try:
            returncode = _wait_engine(proc)
        finally:
            os.close(lifeline_write)
        if returncode != 0 or not result_path.exists():
            where = f"draft {draft_dir}, k={num_speculative_tokens}" if draft_dir else "the target alone"
            reason = None
            if log_path and Path(log_path).is_file():
                reason = engine_failure_reason(Path(log_path).read_text(errors="replace")[-200_000:])
            remedy = failure_remedy(reason)
            raise EngineFailed(
                f"vLLM's engine ({where}) exited {returncode}: {reason or 'no error line in its log'}; "
                + (f"{remedy}; " if remedy else "") + f"see {log_path or 'its log (no log_path given)'}"
            )
        return json.loads(result_path.read_text())


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How closely two greedy runs agree: identical outputs, and mean shared-prefix fraction.

    Spec decoding with greedy acceptance should not change the output; numerics of batched
    verification can, rarely, flip a near-tie. This reports how often that happened.
    """
    identical, prefix_frac = 0, 0.0
    for a, b in zip(reference, other):
        identical += a == b
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        prefix_frac += n / max(1, max(len(a), len(b)))
    count = max(1, len(reference))
    return {"identical_fraction": identical / count, "mean_shared_prefix_fraction": prefix_frac / count}


def in_dependency_order(tasks: Mapping[str, tuple[Sequence[str], Callable[[dict], object]]], workers: int) -> dict:
    """Run named tasks, each once the tasks it names are finished, at most `workers` at once (a task still
    waiting for others holds no slot, so a training starts as soon as its own dataset is ready instead of
    after every dataset). A task is `name: (names it needs, fn(results of those))`; slots go out in the
    order given. Returns name -> result, or the exception it raised (also for the tasks needing it)."""
    slots = threading.Semaphore(max(1, workers))
    results: dict = {}
    finished = {name: threading.Event() for name in tasks}

    def work(name: str) -> None:
        needs, fn = tasks[name]
        try:
            for need in needs:
                finished[need].wait()
            failed = [n for n in needs if isinstance(results[n], BaseException)]
            if failed:
                raise RuntimeError(f"{name} not run: {', '.join(failed)} failed")
            with slots:
                results[name] = fn({n: results[n] for n in needs})
        except BaseException as exc:  # SystemExit too (a failed stage): reported, the caller decides
            results[name] = exc
        finally:
            finished[name].set()

    threads = [threading.Thread(target=work, args=(name,), name=f"task-{name}") for name in tasks]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # start in the given order, so the slots are handed out in it
    for thread in threads:
        thread.join()
    return {name: results[name] for name in tasks}


def measure_acceptance(target_dir, drafts: Mapping[str, str], prompts: list[list[int]],
                       groups: list[str] | None = None, ks: Sequence[int] = (1, 2, 3),
                       settings: VllmSettings | None = None, log_dir: str | os.PathLike | None = None,
                       log=print, baseline: tuple[dict, list[list[int]]] | None = None, jobs: int = 1,
                       with_baseline: bool = True, speculative_config: Mapping | None = None) -> dict:
    """Baseline (no draft) plus every (draft, k): tau, per-position acceptance, tokens/s.

    `prompts`: token ids (already rendered with the chat template); `groups`: one label per prompt (its
    category), for tau and tokens/s per group. `drafts` maps a label to an exported EAGLE-3 draft directory.
    `baseline` = (the "baseline" and "baseline_token_ids" of an earlier call on the same prompts and
    settings) skips measuring the target alone again. Returns a JSON-ready dict; generated token ids are dropped after
    comparing each run with the baseline; `with_baseline=False` serves no target alone (no tokens/s without
    the draft, no agreement: "baseline" is None). `jobs` engines run at once after the baseline (on one GPU
    each needs a fixed KV cache, `kv_cache_memory_bytes`); their tokens/s then include each other's load.
    `speculative_config`: every draft's method and kind keys (run_engine; None: eagle3).
    """
    settings = settings or VllmSettings()
    kinds = groups
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)

    def _log_path(name):
        return str(log_dir / f"vllm-{name}.log") if log_dir else None

    if not with_baseline:
        baseline, reference = None, None
    elif baseline is None:
        log(f"vllm: baseline (no draft), {len(prompts)} prompts, max_tokens {settings.max_tokens}")
        baseline = run_engine_isolated(target_dir, None, 0, prompts, settings, _log_path("baseline"), groups=kinds)
        reference = baseline.pop("generated_token_ids")
        log(f"vllm: baseline {baseline['tokens_per_s']:.1f} tokens/s")
    else:
        baseline, reference = baseline
    def one(label: str, draft_dir: str, k: int) -> dict:
        name = f"{label}-k{k}"
        result = run_engine_isolated(target_dir, draft_dir, k, prompts, settings, _log_path(name), groups=kinds,
                                     speculative_config=dict(speculative_config) if speculative_config else None)
        generated = result.pop("generated_token_ids")
        if baseline is not None:
            result["agreement_with_baseline"] = agreement(reference, generated)
            result["speedup_tokens_per_s"] = result["tokens_per_s"] / baseline["tokens_per_s"]
        result["concurrent_engines"] = jobs
        sd = result["spec_decode"]
        log(
            f"vllm: {name}: tau {sd['mean_acceptance_length']:.3f}, per-position "
            f"{[round(x, 3) for x in sd['acceptance_rate_per_pos']]}, "
            f"{result['tokens_per_s']:.1f} tokens/s"
            + (f" (x{result['speedup_tokens_per_s']:.2f})" if baseline is not None else "")
        )
        return {"label": label, **result}

    # each engine is its own process, so threads suffice; a failed engine is raised once the others finish
    try:
        runs = in_dependency_order({f"{label}-k{k}": ((), lambda done, job=(label, draft_dir, k): one(*job))
                                    for label, draft_dir in drafts.items() for k in ks}, jobs)
    except BaseException:  # Ctrl-C reaches this thread only: the engines in the worker threads stop with it
        stop_engines()
        raise
    for result in runs.values():
        if isinstance(result, BaseException):
            raise result
    return {
        "target": str(target_dir),
        "settings": asdict(settings),
        "baseline": baseline,
        "runs": runs,
        # The target's own greedy tokens, for diagnostics such as draft_vocab_coverage; too
        # large for a results file, drop before writing.
        "baseline_token_ids": reference,
    }


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child_main()
