"""Stage 04's logic: turn our config + upstream manifests into a speculators training run.

We do not re-implement training: `speculators_argv` builds the exact `speculators train`
flags (so a run can be reproduced with speculators alone: see `command.txt`), and
`run_in_process` calls speculators' own `speculators.train.cli.main`, after the
version-gated compatibility fixes that apply to this machine. Multi-GPU runs start the same
entry point under torchrun (or DeepSpeed's launcher) via `launch_command`.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from . import checkpoints, compat, draft_kinds, online, resume
from .checkpoints import latest_progress
from .compat import feature_noise, flex_forward_config, resume_agreement, stall_watch, val_depth
from .compat import sample_check as checks
from .compat.flex_forward_config import traced_calls_summary
from .compat.sample_check import read_records, stop_line
from .compat.samples_record import trained as trained_counts
from .config.resolution import Sources
from .config.schema import SCRIPTS_DIR, DraftConfig, TrainConfig, load_draft_config, speculators_pass_through
from .contract import read_manifest, require_equal, require_upstream, require_written_files
from .errors import ConfigError, ContractError, InputError, Interrupted, StageError
from .files import (
    FINGERPRINTS_NAME,
    DiskFull,
    atomic_write_text,
    changed_fingerprints,
    disk_full_line,
    fingerprints_problem,
    is_disk_full,
)
from .hidden_states import HS_DIRNAME, hs_file, hs_name, rows_label
from .machine import NETWORK_FILESYSTEMS, cuda_capabilities, filesystem_type
from .manifest import ExtractManifest, PrepareManifest, VocabManifest
from .metrics import (
    COMPAT_KEY,
    is_rank_zero,
    write_record,
)
from .online import ENDPOINT_DOWN_TAG
from .online import speculators_args as online_speculators_args
from .prepared import prepared_outputs
from .sizing import FEW_OPTIMIZER_STEPS, SMALL_RUN_SEQ_LEN, optimizer_steps
from .slices import parse_rows
from .vocab import D2T_NAME, T2D_NAME

# Local imports: speculators and torch: imported where the trainer runs and where a run asks torch about CUDA
# (heavy; argv building and --print-config need neither: --print-config asks the driver, machine.cuda_capabilities).

log = logging.getLogger("eagle3")


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_kernels(cfg: TrainConfig, gpu: bool | None = None) -> tuple[str, str]:
    """auto -> flex_attention + fused Triton loss on GPU; sdpa + eager loss on CPU (no flex backward there).
    `gpu`: whether this machine trains on CUDA (default: ask torch, `on_gpu`)."""
    gpu = on_gpu() if gpu is None else gpu
    attn = cfg.attn_impl if cfg.attn_impl != "auto" else ("simple_flex_attention" if gpu else "sdpa")
    loss = cfg.loss_impl if cfg.loss_impl != "auto" else ("fused" if gpu else "eager")
    return attn, loss


def hidden_states_dtype(cfg: TrainConfig, gpu: bool | None = None) -> str:
    """auto -> bf16 autocast on GPU; fp32 on CPU, where bf16 matmuls are several times slower."""
    if cfg.hidden_states_dtype != "auto":
        return cfg.hidden_states_dtype
    return "bfloat16" if (on_gpu() if gpu is None else gpu) else "float32"


def ttt_steps(cfg: TrainConfig, draft: DraftConfig) -> int:
    """The test-time-training steps of this run: --ttt-steps, else the draft config's."""
    return cfg.ttt_steps or draft.ttt_steps


def val_ttt_steps(cfg: TrainConfig, draft: DraftConfig) -> int:
    """The TTT steps validation unrolls: --val-ttt-steps, else the deeper of training's and the served k
    (compat/val_depth.py: speculators validates at training's depth, so positions past it had no offline figure)."""
    return max(cfg.val_ttt_steps or draft.num_speculative_tokens, ttt_steps(cfg, draft))


def fit_seq_len_to_run(cfg: TrainConfig, sources: Sources, counts: dict, train_data_ratio: float):
    """The step-size rule, (config, note): total_seq_len lowered to SMALL_RUN_SEQ_LEN (or the longest row, if
    longer: a row is never cut) when the run would take fewer than FEW_OPTIMIZER_STEPS steps at the default or
    profile value; an explicit --total-seq-len is kept. `counts`: stage 01's manifest counts.

    Why (sizing.py's FEW_OPTIMIZER_STEPS): below that many steps, steps, not tokens, limit the draft."""
    total_tokens = counts.get("tokens", 0)  # none recorded: unchanged (bench/ passes --total-seq-len itself)
    smaller = max(SMALL_RUN_SEQ_LEN, counts.get("max_row_tokens", 0))
    if sources.given("total_seq_len") or not total_tokens or cfg.total_seq_len <= smaller:
        return cfg, None
    _, steps = optimizer_steps(cfg, total_tokens, train_data_ratio)
    if steps >= FEW_OPTIMIZER_STEPS:
        return cfg, None
    note = (f"total_seq_len: {smaller:,} instead of {cfg.total_seq_len:,} ({sources['total_seq_len']}): the run would take "
            f"~{steps:,} optimizer steps, fewer than {FEW_OPTIMIZER_STEPS:,}, where smaller steps learn more per token "
            f"(NOTES.md, 'Acceptance length'); pass --total-seq-len to keep a size")
    return cfg.model_copy(update={"total_seq_len": smaller}), note


def read_upstream(cfg: TrainConfig, target, draft: DraftConfig) -> tuple[PrepareManifest, ExtractManifest | None, VocabManifest]:
    """Stages 01-03's manifests, checked against one another, the target and the draft config.
    Online/hybrid: no stage 02 (`extracted` is None); stage 01's tokenizer is checked here instead."""
    prepared = read_manifest(cfg.data, "prepare", "--data")
    online = cfg.hidden_states != "files"
    extracted = None if online else read_manifest(Path(cfg.data) / HS_DIRNAME, "extract", "--data")
    vocab = read_manifest(cfg.vocab, "vocab", "--vocab")
    require_written_files(prepared, prepared_outputs(cfg.data))  # the rows speculators' loader reads
    require_written_files(vocab, [D2T_NAME, T2D_NAME])
    hint = "all stages must use the same --target"
    for manifest in filter(None, (prepared, extracted, vocab)):
        require_equal("target config", target.config_sha256, manifest.target["config_sha256"], manifest, hint)
    if online:  # what stage 02 checks before it extracts: the rows were tokenized by this target's tokenizer
        require_equal("tokenizer", target.tokenizer_sha256, prepared.target["tokenizer_sha256"], prepared, hint)
    else:
        require_upstream(extracted, "prepare", prepared)
        if extracted.selection and cfg.slice_rows is None:
            raise ConfigError(f"{extracted.path}: holds only rows {extracted.selection} (one slice of a sliced "
                              f"run, 02 --rows); train on it with --slice-rows (run_all.sh --slice-rows), or rerun 02 "
                              f"without --rows")
        require_every_row_file(extracted, prepared.counts.rows)
        require_unchanged_row_files(extracted, prepared.counts.rows)
        if cfg.layer_ids and list(cfg.layer_ids) != extracted.layer_ids[:-1]:
            raise ConfigError(f"--layer-ids {cfg.layer_ids}: stage 02 extracted {extracted.layer_ids[:-1]} (+ the final "
                              f"layer) into {Path(cfg.data) / HS_DIRNAME}; with --hidden-states files the layer ids are "
                              f"stage 02's (drop --layer-ids, or rerun 02 with them)")
    require_upstream(vocab, "prepare", prepared)
    for key, value in (("hidden_size", target.hidden_size), ("target_vocab_size", target.vocab_size)):
        if (stated := getattr(draft, key)) not in (None, value):
            raise ConfigError(f"{cfg.draft_config}: {key} {stated} does not match the target's {value} ({cfg.target}/config.json)")
    if vocab.draft_vocab_size is not None and (problem := draft_kinds.vocabulary_problem(
            draft.speculator_type, vocab.draft_vocab_size, target.vocab_size)):
        raise ConfigError(f"{cfg.vocab}: {problem}")
    return prepared, extracted, vocab


# A node lists files another node landed up to a minute late (NFS caches directory listings; stage 02's ranks wait
# as long, extract/run.py LISTING_GRACE_S): a row file missing from the listing is looked for again before 04 refuses,
# where the folder is on a network filesystem (machine.NETWORK_FILESYSTEMS, or one the mount table does not name);
# on a local disk a missing file is refused at once.
ROW_FILES_GRACE_S = 75.0
ROW_FILES_POLL_S = 5.0


def require_every_row_file(extracted: ExtractManifest, rows_total: int) -> None:
    """Stage 02's file of every row it extracted is there (listings of the folder): a row file gone since is one
    line naming it now, not speculators' loader error mid-epoch."""
    hs_dir = extracted.directory
    rows = parse_rows(extracted.selection, rows_total) if extracted.selection else range(rows_total)
    deadline, said = None, False
    while True:
        listed = set(os.listdir(hs_dir))
        missing = [i for i in rows if hs_name(i) not in listed]
        if missing and deadline is None:  # the wait only where a late listing can be the cause: a network filesystem
            fstype = filesystem_type(hs_dir)
            grace = ROW_FILES_GRACE_S if fstype is None or fstype in NETWORK_FILESYSTEMS else 0.0
            deadline = time.monotonic() + grace
            if grace > 0:
                said = True
                log.info("%s: not listed; looking again for up to %.0f s (%s: another node's files may be listed late)",
                         hs_file(hs_dir, missing[0]), grace, f"a {fstype} filesystem" if fstype else "filesystem unknown")
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(ROW_FILES_POLL_S)
    if said and not missing:
        log.info("%s: every row file is listed now", hs_dir)
    if missing:
        raise ContractError(f"{hs_file(hs_dir, missing[0])}: missing since 02_extract_hidden_states.py wrote it "
                            f"({len(missing)} row file(s) gone: {rows_label(missing)}); rerun 02_extract_hidden_states.py")


def require_unchanged_row_files(extracted: ExtractManifest, rows_total: int) -> None:
    """Stage 02's row files are the ones it wrote: each file's size, sampled bytes and modification time as its
    fingerprints record (files.write_fingerprints) holds them. A value changed in place to another finite one passes
    every check the loader makes on a sample (issue 64: 04 trained on it), so a file changed since is refused here in
    one line naming it, finished run or not, as a changed d2t.npy or row file of 01 is; 02's rerun redoes it (a whole
    folder copied without mtimes: 02's rerun re-validates it and records it anew). A manifest written before
    fingerprints records none: nothing to compare (the loader's checks remain)."""
    hs_dir = extracted.directory
    script = "02_extract_hidden_states.py"
    if problem := fingerprints_problem(hs_dir, extracted.fingerprints):
        raise ContractError(f"{hs_dir / FINGERPRINTS_NAME}: {problem}; rerun {script}")
    if not extracted.fingerprints:
        return
    rows = parse_rows(extracted.selection, rows_total) if extracted.selection else range(rows_total)
    changed = changed_fingerprints(hs_dir, [hs_name(i) for i in rows]) or {}
    if changed:
        name, how = next(iter(changed.items()))
        more = f"; {len(changed) - 1} other row file(s) too" if len(changed) > 1 else ""
        raise ContractError(f"{hs_dir / name}: changed since {script} wrote it ({how}{more}); rerun {script} (it redoes "
                            f"changed files, then this stage trains on them)")


def speculators_argv(cfg: TrainConfig, draft: DraftConfig, target_path: str, aux_layer_ids: list[int],
                     draft_vocab_size: int, train_data_ratio: float, mask_token_id: int | None,
                     hidden_states_storage: str = "dtype", gpu: bool | None = None) -> list[str]:
    """The `speculators train` flags for this run (the full contract with its trainer): the paths, the fields
    declared with `speculators=` (config/schema.py) verbatim, then what this stage resolves: the draft kind and its
    architecture flags (draft_kinds.architecture_flags: draft_config.json's EAGLE-3 keys for eagle3 only).
    `hidden_states_storage`: stage 02's `storage` ("fp8" files are read by speculators' fp8 backend).
    `gpu`: whether this machine trains on CUDA (default: ask torch, `on_gpu`)."""
    gpu = on_gpu() if gpu is None else gpu
    attn, loss = resolve_kernels(cfg, gpu)
    out = Path(cfg.output)
    num_workers = cfg.num_workers if gpu else 0  # CPU: worker processes only compete for 2 cores
    lead, tail = draft_kinds.architecture_flags(draft.speculator_type, draft, ttt_steps(cfg, draft))
    argv = [
        "--verifier-name-or-path", target_path,
        "--data-path", str(Path(cfg.data)),
        "--save-path", str(out),
        "--log-dir", str(out / "logs"),
        *speculators_pass_through(cfg),
        "--d2t-path", str(Path(cfg.vocab) / D2T_NAME),
        "--t2d-path", str(Path(cfg.vocab) / T2D_NAME),
        "--draft-vocab-size", str(draft_vocab_size),
        "--target-layer-ids", *map(str, aux_layer_ids),
        "--speculator-type", draft.speculator_type,
        *lead,
        "--sliding-window", str(draft.sliding_window),
        "--draft-attn-impl", attn,
        "--loss-implementation", loss,
        "--hidden-states-dtype", hidden_states_dtype(cfg, gpu),
        "--num-workers", str(num_workers),
        "--train-data-ratio", repr(train_data_ratio),
        *(["--mask-token-id", str(mask_token_id)] if mask_token_id is not None else []),
        # files: a missing file is a bug, never silently skipped; online/hybrid: vLLM generates each sample
        *(["--on-missing", "raise"] if cfg.hidden_states == "files" else online_speculators_args(cfg)),
        # Not --save-best: in speculators 0.9.0 it saves only improving epochs (so a resume can
        # lose work) and deletes every other file in the save path. Without it every epoch is
        # kept and `checkpoint_best` still points at the lowest val loss.
    ]
    if hidden_states_storage == "fp8":  # speculators' FP8Transfer dequantizes each file as it is read
        argv += ["--hidden-states-backend", "fp8"]
    if draft.full_attention_indices:
        argv += ["--full-attention-indices", *map(str, draft.full_attention_indices)]
    return argv + tail + list(cfg.extra_args)  # a user's --extra-args come last (and so win)


def draft_for_run(cfg: TrainConfig) -> DraftConfig:
    """The draft config this run trains: draft_config.json's, with --speculator-type's kind when given (the
    manifest's draft_config records it). A kind no checked vLLM serves, or a block_size for a kind without a block,
    is refused in one line."""
    draft = load_draft_config(cfg.draft_config, cfg.speculator_type)
    draft_kinds.trainable(draft.speculator_type)
    if problem := draft_kinds.block_size_problem(draft.speculator_type, draft.block_size):
        raise ConfigError(f"{cfg.draft_config}: block_size {draft.block_size}: {problem}")
    return draft


def mask_token(cfg: TrainConfig, draft: DraftConfig, target) -> int:
    """The --mask-token-id this run passes (draft_kinds.mask_token_id): --mask-token-id, else the one speculators
    would find in the target's tokenizer (loaded from the target directory, no model). A kind that needs one and
    finds none is refused in one line; another kind that finds none gets the config's pad token (or 0), as before the
    kinds existed, which spares speculators loading the processor."""
    tokenizer = None
    if cfg.mask_token_id is None:
        from transformers import AutoTokenizer  # heavy: only a run that trains loads it (argv building needs none)

        try:
            tokenizer = AutoTokenizer.from_pretrained(target.path, trust_remote_code=cfg.trust_remote_code)
        except Exception as exc:  # noqa: BLE001 -- any tokenizer failure: said, or the old fallback
            if draft_kinds.kind(draft.speculator_type).needs_mask_token:
                raise ConfigError(f"{target.path}: cannot load the tokenizer ({type(exc).__name__}) to find the mask "
                                  f"token a {draft.speculator_type} draft needs: pass --mask-token-id ID (or "
                                  f"--trust-remote-code where its tokenizer needs its own code)") from None
    found = draft_kinds.mask_token_id(draft.speculator_type, tokenizer, cfg.mask_token_id, target.vocab_size)
    return found if found is not None else (target.text_config.get("pad_token_id") or 0)


def fit_val_ttt_steps(cfg: TrainConfig, sources: Sources, draft: DraftConfig):
    """(config, note): a --val-ttt-steps below the TTT steps training runs becomes those steps (speculators validates
    at least at training's depth), said in a note and recorded as run, not as asked."""
    depth = ttt_steps(cfg, draft)
    if cfg.val_ttt_steps is None or cfg.val_ttt_steps >= depth:
        return cfg, None
    note = (f"val_ttt_steps: {depth} instead of {cfg.val_ttt_steps} ({sources.get('val_ttt_steps', 'flag')}): "
            f"validation unrolls at least the {depth} TTT steps training runs")
    return cfg.model_copy(update={"val_ttt_steps": depth}), note


def _prepared_counts(data: str) -> tuple[dict, float] | None:
    """Stage 01's counts and train ratio at --data, for --print-config; None when there is none to read."""
    try:
        prepared = read_manifest(data, "prepare", "--data")
    except (StageError, OSError):
        return None
    return prepared.counts.model_dump(exclude_none=True), prepared.train_data_ratio


def resolved_for_print_config(cfg: TrainConfig, sources: Sources | dict | None = None) -> dict[str, str]:
    """What speculators receives for the fields this stage decides at run time, on this machine
    (`--print-config`): read back from `speculators_argv` itself, so it cannot drift from a run; with a --data
    stage 01 finished, the total_seq_len the small-run rule gives (fit_seq_len_to_run, as the run applies it)."""
    notes: dict[str, str] = {}
    sources = sources if isinstance(sources, Sources) else Sources(sources or {})
    try:
        draft = load_draft_config(cfg.draft_config, cfg.speculator_type)
    except ConfigError as exc:
        draft, notes["draft_config"] = DraftConfig(), f"? ({exc}; built-in draft defaults shown below)"
    fitted = _prepared_counts(cfg.data) if not cfg.data.startswith("<") else None
    if fitted is not None:
        run_cfg, packing_note = fit_seq_len_to_run(cfg, sources, *fitted)
        if packing_note:
            notes["total_seq_len"] = f"{run_cfg.total_seq_len} ({packing_note.split('): ', 1)[1]})"
    _, depth_note = fit_val_ttt_steps(cfg, sources, draft)
    if depth_note:
        notes["val_ttt_steps"] = f"{ttt_steps(cfg, draft)} ({depth_note.split('): ', 1)[1]})"
    capabilities = cuda_capabilities()  # the driver's answer: --print-config imports no torch
    gpu = bool(capabilities)
    argv = speculators_argv(cfg, draft, "<target>", [0, 0, 0], 0, 0.9, 0, gpu=gpu)

    def sent(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    device = "CUDA" if gpu else "no CUDA device"
    lead, _ = draft_kinds.architecture_flags(draft.speculator_type, draft, ttt_steps(cfg, draft))
    if "draft_config" in notes:
        pass
    elif draft_kinds.kind(draft.speculator_type).eagle3_settings:  # its norms before the fc projection decide most
        norms = [flag for flag in ("--fc-norm", "--norm-before-fc", "--no-norm-before-fc") if flag in argv]
        notes["draft_config"] = (f"its fc_norm {str(draft.fc_norm).lower()}, norm_before_fc "
                                 f"{str(draft.norm_before_fc).lower()} -> speculators {' '.join(norms)}")
    else:  # another kind: speculators' own defaults but for what the draft config sets for it
        notes["draft_config"] = (f"speculator_type {draft.speculator_type}: speculators' own {draft.speculator_type} "
                                 f"defaults, not its EAGLE-3 keys -> speculators --speculator-type {draft.speculator_type}"
                                 + "".join(f" {flag}" for flag in lead))
    if cfg.total_seq_len > SMALL_RUN_SEQ_LEN and fitted is None:
        notes["total_seq_len"] = (f"{cfg.total_seq_len}, or {SMALL_RUN_SEQ_LEN} (the longest row if longer) when --data's "
                                  f"rows give fewer than {FEW_OPTIMIZER_STEPS:,} optimizer steps and the value is not "
                                  f"an explicit --total-seq-len (the preflight line says which)")
    if cfg.ttt_steps is None and "--ttt-steps" in argv:
        notes["ttt_steps"] = f"{sent('--ttt-steps')} ({cfg.draft_config}'s ttt_steps)"
    if cfg.val_ttt_steps is None:
        notes["val_ttt_steps"] = (f"{val_ttt_steps(cfg, draft)} (the deeper of the TTT steps and {cfg.draft_config}'s "
                                  f"num_speculative_tokens: the offline acceptance length covers the served k)")
    if cfg.attn_impl == "auto":
        notes["attn_impl"] = f'"{sent("--draft-attn-impl")}" ({device}: flex_attention on GPUs; sdpa on the CPU, no flex backward there)'
    if cfg.loss_impl == "auto":
        notes["loss_impl"] = f'"{sent("--loss-implementation")}" ({device}: the fused Triton loss on GPUs, eager on the CPU)'
    if cfg.hidden_states_dtype == "auto":
        notes["hidden_states_dtype"] = (f'"{sent("--hidden-states-dtype")}" ({device}: bf16 autocast on GPUs; fp32 on the CPU, '
                                        f"where bf16 matmuls are several times slower)")
    if int(sent("--num-workers")) != cfg.num_workers:
        notes["num_workers"] = f"{sent('--num-workers')} ({device}: worker processes would only compete for the trainer's cores)"
    if cfg.hidden_states != "files":
        notes["hidden_states"] = (f'"{cfg.hidden_states}" -> speculators ' + " ".join(online_speculators_args(cfg))
                                  + ("; stage 02's files are not read" if cfg.hidden_states == "online" else
                                     "; each generated sample is kept in --hidden-states-path"))
        if cfg.layer_ids is None:
            notes["layer_ids"] = "the target's 2, L//2, L-3 (+ L), checked against the server's card"
    capability = capabilities[0] if gpu else None  # the device torch would use: the first visible
    decision = flex_forward_config.decide(capability, flex_forward_config.parse_setting(cfg.flex_forward_config))
    notes["flex_forward_config"] = ("applied: " if decision.apply else "not applied: ") + decision.reason
    return notes


def launch_command(cfg: TrainConfig, argv: list[str]) -> list[str] | None:
    """None for a single process (run in-process); else the torchrun/deepspeed command line.

    torchrun, several nodes: the same command on every node with its own --node-rank, static
    rendezvous at node 0's --rdzv-endpoint HOST:PORT, so global rank 0 (checkpoints,
    metrics.jsonl) is on node 0 (c10d would rank nodes by host name). DeepSpeed: one command on
    the first host of --hostfile starts every node over SSH (pdsh); `--no_local_rank` because
    speculators' parser refuses the `--local_rank=N` DeepSpeed otherwise appends (the rank
    arrives in LOCAL_RANK either way).
    """
    if cfg.nproc == 1 and cfg.nnodes == 1 and cfg.launcher == "torchrun":
        return None
    entry = ["-m", "eagle3_pipeline.train_entry", *argv]
    if cfg.node_rank >= cfg.nnodes:
        raise ConfigError(f"--node-rank {cfg.node_rank} must be in [0, --nnodes {cfg.nnodes})")
    if cfg.nnodes > 1 and cfg.launcher == "torchrun" and not cfg.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, node 0's address (the same on every node)")
    if cfg.nnodes > 1 and cfg.launcher == "deepspeed" and not cfg.hostfile:
        raise ConfigError("--launcher deepspeed with --nnodes > 1 needs --hostfile (lines 'HOST slots=GPUS', first host = node 0)")
    host, port = _split_endpoint(cfg.rdzv_endpoint) if cfg.rdzv_endpoint else (None, None)
    if cfg.launcher == "deepspeed":
        # `-m deepspeed.launcher.runner` is the `deepspeed` console script, run by this interpreter.
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(cfg.nproc)]
        if cfg.hostfile:
            cmd += ["--hostfile", cfg.hostfile]
        if cfg.nnodes > 1:
            cmd += ["--num_nodes", str(cfg.nnodes)]
        if host:
            cmd += ["--master_addr", host, "--master_port", port]
        return cmd + ["--no_local_rank", "--module", "eagle3_pipeline.train_entry", *argv]
    # torchrun less its traceback when a rank stops (eagle3_pipeline/torchrun.py: stage 04 prints the one line)
    cmd = [sys.executable, "-m", "eagle3_pipeline.torchrun", "--nproc-per-node", str(cfg.nproc), "--nnodes", str(cfg.nnodes)]
    if cfg.nnodes > 1:
        cmd += ["--node-rank", str(cfg.node_rank), "--master-addr", host, "--master-port", port]
    else:
        cmd += ["--standalone"]
    return cmd + entry


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (node 0's address, e.g. 10.0.0.1:29500)")
    return host.strip("[]"), port


def export_compat_settings(cfg: TrainConfig, sample_check: dict | None = None, draft: DraftConfig | None = None,
                           identity: dict | None = None) -> None:
    """Settings of the compat fixes, for this process and every training process it starts
    (`run_in_process` only gets speculators' flags, which have no place for them). `sample_check`:
    what every sample must be (compat/sample_check.py: slots, hidden, dtype, storage); `draft`: the draft
    config, for the validation depth (compat/val_depth.py, set only when deeper than training); `identity`: the
    run's, which every rank compares with global rank 0's (compat/resume_agreement.py)."""
    os.environ[flex_forward_config.ENV] = cfg.flex_forward_config
    if identity is None:
        os.environ.pop(resume_agreement.IDENTITY_ENV, None)
    else:
        os.environ[resume_agreement.IDENTITY_ENV] = json.dumps(identity, sort_keys=True, default=str)
    if draft is not None and (depth := val_ttt_steps(cfg, draft)) > ttt_steps(cfg, draft):
        os.environ[val_depth.ENV] = str(depth)
    else:
        os.environ.pop(val_depth.ENV, None)
    if cfg.noise_std > 0:  # compat/feature_noise.py; 0 installs nothing
        os.environ[feature_noise.ENV] = repr(cfg.noise_std)
    else:
        os.environ.pop(feature_noise.ENV, None)
    if cfg.stall_minutes > 0:  # compat/stall_watch.py; 0 installs nothing
        os.environ[stall_watch.ENV] = repr(cfg.stall_minutes * 60)
    else:
        os.environ.pop(stall_watch.ENV, None)
    if sample_check is None:
        os.environ.pop(checks.ENV, None)
    else:
        os.environ[checks.ENV] = json.dumps({**sample_check, "on_bad": cfg.on_bad_sample,
                                             "max_bad_fraction": cfg.max_bad_fraction, "data": cfg.data,
                                             "record": str(Path(cfg.output).resolve() / checks.RECORD_NAME)})
    if cfg.hidden_states == "files":
        os.environ.pop(online.MODE_ENV, None)
        os.environ.pop(online.CACHE_ENV, None)
    else:  # compat/online_generation.py, in every rank and loader worker
        os.environ[online.MODE_ENV] = cfg.hidden_states
        os.environ[online.CACHE_ENV] = str(online.cache_dir(cfg.output))


def launch_env() -> dict[str, str]:
    """Child processes must import eagle3_pipeline: `make venv` installs it (pyproject.toml); a Python
    without that install (the numbered scripts also run from a bare clone) finds it beside the scripts."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS_DIR), env.get("PYTHONPATH")]))
    return env


def run_in_process(argv: list[str], metrics_path: Path, checkpoint_bytes: int = 0) -> None:
    """speculators' own trainer, in this process (one GPU, or the CPU). A full disk is one line naming the file
    that could not be written and what was being written: our records (metrics, bad samples, samples) name
    themselves (files.DiskFull, raised here or in a loader worker); else it was speculators saving a checkpoint:
    the newest file, the free bytes and what a checkpoint needs."""
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig

    applied = compat.apply(metrics_path)
    log.info("compatibility fixes applied: %s", ", ".join(applied) or "none")
    save = Path(argv[argv.index("--save-path") + 1])
    try:
        if is_rank_zero():  # stage 04 records them in its manifest (it may not be this process)
            write_record(metrics_path, {COMPAT_KEY: applied})
        speculators_main(SpeculatorsTrainConfig.resolve(argv))
    except DiskFull as exc:  # one of our records in this process (metrics, bad samples, samples): it names the file
        raise StageError(f"{exc}; {DISK_FULL_RERUN}") from None
    except Exception as exc:
        if written := disk_full_line(str(exc)):  # ... or in a loader worker (bad_samples.jsonl): its line, as text
            raise StageError(f"{written}; {DISK_FULL_RERUN}") from None
        if ENDPOINT_DOWN_TAG in str(exc):  # compat/online_generation.py stopped the run at a batch
            raise endpoint_down_error(str(exc).split(ENDPOINT_DOWN_TAG, 1)[1], save) from None
        if stop_line(str(exc)):  # compat/sample_check.py or finite_loss.py: one line naming the file/step
            raise bad_sample_error(stop_line(str(exc)), save) from None
        if not is_disk_full(exc):
            raise
        raise disk_full_error(save, checkpoint_bytes) from None
    if "flex_forward_config" in applied:
        log.info("flex_attention calls in the compiled draft: %s", traced_calls_summary())
    # speculators returns normally after SIGTERM/Ctrl-C: never let that pass for a finished run.
    stopped = resume.interruption()
    if stopped:
        if stopped["saved"]:
            raise Interrupted(f"training interrupted at global step {stopped['state']['global_step']}; checkpoint saved in "
                              f"{save / resume.INTERRUPTED}; rerun the same command to resume from it")
        raise Interrupted(f"training interrupted; the interrupt checkpoint could not be saved (see the log above); "
                          f"rerun the same command to resume from the last epoch checkpoint in {save}")


def bad_sample_error(problem: str, save: Path):
    """A sample that must not be trained on, or a non-finite loss: one line, and where a rerun resumes."""
    progress = latest_progress(save)
    resume_from = (f"checkpoint {progress['checkpoint']} (global step {progress.get('global_step', '?')})"
                   if progress else "the start (no checkpoint was saved yet)")
    if problem.startswith("non-finite training loss"):
        return InputError(f"{problem}; check those rows and the learning rate (a rerun resumes from {resume_from})")
    if checks.too_many_bad(problem):
        return InputError(f"{problem}; training stopped (a rerun resumes from {resume_from}): {left_out_remedy(problem)} in {save}")
    return InputError(f"{problem}; training stopped before it (a rerun resumes from {resume_from}): redo the file with "
                      f"02_extract_hidden_states.py --validate, or pass --on-bad-sample skip to leave such samples out")


def stopped_on(out_dir: Path) -> str | None:
    """The bad sample (or non-finite loss) a training rank stopped on, from its record (torchrun runs)."""
    stops = [r for r in read_records(out_dir) if r.get("action") == "stop"]
    if not stops:
        return None
    last = stops[-1]
    return f"{last['file']}: {last['reason']}" if last.get("file") else last["reason"]


def left_out_remedy(problem: str) -> str:
    raise_it = "" if checks.NONE_LEFT in problem else ", or raise --max-bad-fraction"
    return f"redo those files with 02_extract_hidden_states.py --validate{raise_it}; they are listed in {checks.RECORD_NAME}"


def forget_redone_samples(out_dir: Path) -> None:
    """Before a (re)start: samples left out (--on-bad-sample skip) whose files were redone since, as the stop line
    advises, are no longer counted against --max-bad-fraction: the loader checks them again as it reads them."""
    forgotten, _stops = checks.forget_redone(out_dir)
    if forgotten:
        log.info("%d sample(s) left out earlier have been redone since (their files changed): checked again as they "
                 "are read, no longer counted in %s", forgotten, checks.RECORD_NAME)


def skipped_samples(out_dir: Path) -> dict:
    """--on-bad-sample skip: the samples left out (each once, however many epochs or ranks read it)."""
    skipped: dict[str, str] = {}
    for entry in read_records(out_dir):
        if entry.get("action") == "skip":
            skipped.setdefault(checks.sample_key(entry), entry.get("reason"))
    if skipped:
        log.warning("%d sample(s) left out (--on-bad-sample skip), listed in the manifest's bad_samples; first: %s: %s",
                    len(skipped), *next(iter(skipped.items())))
    return {"count": len(skipped), "files": skipped}


def require_trained(cfg: TrainConfig, rows: int, out_dir: Path) -> dict[str, int]:
    """After training, before the report: what the run trained on ({"optimizer_steps", "samples"}, the manifest's
    `trained`), refused in one line when --on-bad-sample skip left out more than --max-bad-fraction of the `rows`
    samples (the loader stops the run as soon as it does; this also holds for a run resumed with a lower limit)
    or when no step trained on any sample."""
    done = trained_counts(out_dir)
    settings = {"samples": rows, "max_bad_fraction": cfg.max_bad_fraction, "data": cfg.data,
                "record": str(Path(out_dir) / checks.RECORD_NAME)}
    if cfg.on_bad_sample == "skip" and (problem := checks.left_out_problem(settings)):
        raise InputError(f"{problem}; the manifest does not say complete (stage 05 exports none of these checkpoints): "
                         f"{left_out_remedy(problem)} in {out_dir}")
    if not done["optimizer_steps"] or not done["samples"]:
        left_out = skipped_samples(out_dir)["count"]
        why = f" ({left_out} sample(s) left out by --on-bad-sample skip)" if left_out else ""
        # Its checkpoints hold the initial draft: a rerun (after the data is fixed) must not resume from them.
        deleted = checkpoints.delete_checkpoints(out_dir)
        raise InputError(f"{out_dir}: training ran {done['optimizer_steps']} optimizer step(s) on {done['samples']} "
                         f"sample(s){why}: nothing was trained, so the manifest does not say complete and its "
                         f"checkpoints ({', '.join(deleted) or 'none'}) were deleted (a rerun starts from the start); "
                         f"check --data ({cfg.data}) and {out_dir / checks.RECORD_NAME}")
    return done


def endpoint_down_error(problem: str, save: Path):
    """The vLLM server stopped answering mid-training (online/hybrid): one line, and where a rerun resumes."""
    progress = latest_progress(save)
    resume_from = (f"from checkpoint {save / progress['checkpoint']} (global step {progress.get('global_step', '?')})"
                   if progress else "from the start (no checkpoint was saved yet)")
    return StageError(f"{problem.strip()}: training stopped before that batch's step; start the server again, then rerun "
                      f"the same command (training resumes {resume_from})")


DISK_FULL_RERUN = "free space, then rerun (training resumes from the last complete checkpoint)"


def disk_full_error(save: Path, checkpoint_bytes: int):
    """A full disk met by speculators' own writes, which name no file: the checkpoint file being written when the
    disk filled (the newest under the save path). Our records (metrics, bad samples, samples) raise DiskFull,
    naming their file, and never get here."""
    files = [p for p in Path(save).rglob("*") if p.is_file() and not p.is_symlink()]
    newest = max(files, key=lambda p: p.stat().st_mtime_ns) if files else Path(save)
    free = shutil.disk_usage(save).free
    return StageError(f"{newest}: disk full while speculators saved a checkpoint ({free:,} B free at {save}; one "
                      f"checkpoint needs ~{checkpoint_bytes:,} B); {DISK_FULL_RERUN}")


def write_command_file(out_dir: Path, argv: list[str], launch: list[str] | None, notes: tuple[str, ...] = (),
                       node_rank: int = 0) -> None:
    """command.txt; on a node other than node 0 (nodes share --output, node 0 writes its files) the log's lines."""
    plain = "speculators train " + " ".join(shlex.quote(a) for a in argv)
    lines = [
        "# the speculators trainer call this run makes (reproducible with speculators alone):",
        plain,
        *(f"# {note}" for note in notes),
    ]
    if launch:
        lines += ["# launched as:", " ".join(shlex.quote(a) for a in launch)]
    if node_rank > 0:
        log.info("node %d's command:\n%s", node_rank, "\n".join(lines))
        return
    atomic_write_text(Path(out_dir) / "command.txt", "\n".join(lines) + "\n")
