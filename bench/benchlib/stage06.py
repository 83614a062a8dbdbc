"""Stage 06 against the bench (`acceptance.py --vs-stage06`, issue 45): does the tau a user reads from
`06_evaluate.py` equal what the bench measures in vLLM for the same draft, prompts and k?

The draft is trained and exported by the pipeline's own stages (the landed defaults); the bench measures it with
`measure_acceptance` on its held-out prompt file; stage 06 runs as a user runs it (a subprocess, its own prompt
rendering by stage 01's rules) on the same file, with the engine settings the bench uses. Two faults 06 must name:
the draft's d2t scrambled (a lost or regenerated mapping) and the draft served states of other layers than it was
trained on (its config's aux layer ids shifted: vLLM feeds the draft the layers its config names).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

STAGE06 = Path(__file__).resolve().parents[2] / "eagle3-train" / "06_evaluate.py"
FAULTS = ("scrambled-d2t", "shifted-layers")


def fault_draft(draft: Path, fault: str, out: Path) -> Path | None:
    """A copy of `draft` with one fault: `scrambled-d2t` (every draft token names another target token) or
    `shifted-layers` (each aux layer id one layer deeper than trained). None where the fault cannot be made (a draft
    whose vocabulary is the target's whole one has no d2t: the miniature's 1,024 tokens)."""
    import torch
    from safetensors.torch import load_file, save_file

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")
    weights = load_file(str(draft / "model.safetensors"))
    if fault == "scrambled-d2t" and "d2t" not in weights:
        return None
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(draft, out)
    if fault == "scrambled-d2t":
        d2t = weights["d2t"]
        targets = torch.arange(len(d2t)) + d2t
        shuffled = targets[torch.randperm(len(d2t), generator=torch.Generator().manual_seed(0))]
        weights["d2t"] = shuffled - torch.arange(len(d2t))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    elif fault == "shifted-layers":
        config = json.loads((out / "config.json").read_text())
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def stage06_flags(settings: dict, gpu: bool) -> list[str]:
    """06's flags for the bench's VllmSettings (asdict), so both serve the target the same way."""
    flags = ["--max-tokens", settings["max_tokens"], "--max-model-len", settings["max_model_len"],
             "--dtype", settings["dtype"], "--max-num-seqs", settings["max_num_seqs"], "--seed", settings["seed"],
             "--temperature", settings["temperature"],
             "--enforce-eager" if settings["enforce_eager"] else "--no-enforce-eager", "--no-baseline"]
    extra = settings.get("extra_engine_args") or {}
    if gpu and "gpu_memory_utilization" in extra:
        flags += ["--gpu-memory-utilization", extra["gpu_memory_utilization"]]
    if gpu and extra.get("kv_cache_memory_bytes"):  # the bench's fixed KV cache: no memory profiling beside other jobs
        flags += ["--kv-cache-memory-gib", extra["kv_cache_memory_bytes"] / 2**30]
    if not gpu:
        flags += ["--cpu-kv-cache-gib", settings["kv_cache_gib"]]
    return [str(f) for f in flags]


def run_stage06(draft: Path, out: Path, prompts: Path, k: int, flags: list[str], log_path: Path) -> dict:
    """06 as a user runs it; its exit code, last stderr line and report (when it wrote one)."""
    cmd = [sys.executable, str(STAGE06), "--draft", str(draft), "--output", str(out), "--prompts", str(prompts),
           "--num-speculative-tokens", str(k), "--overwrite", *flags]
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.PIPE, text=True)
        log.write(done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() and done.returncode in (0, 6) else None
    result = {"argv": cmd[1:], "rc": done.returncode, "last_line": lines[-1] if lines else "", "log": str(log_path)}
    if report:
        spec = report["spec_decode"]
        result.update(tau=spec["mean_acceptance_length"], tau_stderr=spec["mean_acceptance_length_stderr"],
                      acceptance_per_pos=spec.get("acceptance_rate_per_pos"), prompts=report["prompts"]["count"],
                      settings=report["settings"], verdict=report["verdict"])
    return result


def agreement(bench_tau: float, bench_se: float, stage06_tau: float, stage06_se: float) -> dict:
    """The difference and whether it is within one standard error: the bench's own, and that of the difference
    (sqrt(se_a^2 + se_b^2)) beside it."""
    diff = stage06_tau - bench_tau
    se_diff = math.sqrt(bench_se ** 2 + stage06_se ** 2)
    return {"difference": diff, "bench_stderr": bench_se, "stage06_stderr": stage06_se, "stderr_of_difference": se_diff,
            "within_one_bench_stderr": abs(diff) <= bench_se, "within_one_stderr_of_difference": abs(diff) <= se_diff}
