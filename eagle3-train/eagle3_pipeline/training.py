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
import sys
from pathlib import Path

import torch

from .config import SCRIPTS_DIR, TrainConfig
from .errors import ConfigError
from .files import atomic_write_text
from .throughput import MetricsJsonlHandler
from .vocab import D2T_NAME, T2D_NAME

log = logging.getLogger("eagle3")
METRICS_FILE = "metrics.jsonl"


def on_gpu() -> bool:
    return torch.cuda.is_available()


def resolve_kernels(cfg: TrainConfig) -> tuple[str, str]:
    """auto -> flex_attention + fused Triton loss on GPU; sdpa + eager loss on CPU (no flex backward there)."""
    gpu = on_gpu()
    attn = cfg.attn_impl if cfg.attn_impl != "auto" else ("simple_flex_attention" if gpu else "sdpa")
    loss = cfg.loss_impl if cfg.loss_impl != "auto" else ("fused" if gpu else "eager")
    return attn, loss


def hidden_states_dtype(cfg: TrainConfig) -> str:
    """auto -> bf16 autocast on GPU; fp32 on CPU, where bf16 matmuls are several times slower."""
    if cfg.hidden_states_dtype != "auto":
        return cfg.hidden_states_dtype
    return "bfloat16" if on_gpu() else "float32"


def speculators_argv(cfg: TrainConfig, draft: dict, target_path: str, aux_layer_ids: list[int],
                     draft_vocab_size: int, train_data_ratio: float, mask_token_id: int) -> list[str]:
    """The `speculators train` flags for this run (the full contract with its trainer)."""
    attn, loss = resolve_kernels(cfg)
    out = Path(cfg.output)
    num_workers = cfg.num_workers if on_gpu() else 0  # CPU: worker processes only compete for 2 cores
    argv = [
        "--verifier-name-or-path", target_path,
        "--data-path", str(Path(cfg.data)),
        "--save-path", str(out),
        "--log-dir", str(out / "logs"),
        "--logger", cfg.logger,
        "--d2t-path", str(Path(cfg.vocab) / D2T_NAME),
        "--t2d-path", str(Path(cfg.vocab) / T2D_NAME),
        "--draft-vocab-size", str(draft_vocab_size),
        "--target-layer-ids", *map(str, aux_layer_ids),
        "--draft-arch", draft.get("draft_arch", "llama"),
        "--num-layers", str(draft.get("num_layers", 1)),
        "--ttt-steps", str(cfg.ttt_steps or draft.get("ttt_steps", 3)),
        "--sliding-window", str(draft.get("sliding_window", 2048)),
        "--total-seq-len", str(cfg.total_seq_len),
        "--epochs", str(cfg.epochs),
        "--lr", str(cfg.lr),
        "--optimizer", cfg.optimizer,
        "--draft-attn-impl", attn,
        "--loss-implementation", loss,
        "--hidden-states-dtype", hidden_states_dtype(cfg),
        "--num-workers", str(num_workers),
        "--prefetch-factor", str(cfg.prefetch_factor),
        "--train-data-ratio", repr(train_data_ratio),
        "--mask-token-id", str(mask_token_id),
        "--on-missing", "raise",  # offline data: a missing file is a bug, never silently skipped
        "--checkpoint-freq", str(cfg.checkpoint_freq),
        "--log-freq", str(cfg.log_freq),
        "--seed", str(cfg.seed),
        # Not --save-best: in speculators 0.9.0 it saves only improving epochs (so a resume can
        # lose work) and deletes every other file in the save path. Without it every epoch is
        # kept and `checkpoint_best` still points at the lowest val loss.
    ]
    if draft.get("full_attention_indices"):
        argv += ["--full-attention-indices", *map(str, draft["full_attention_indices"])]
    if not draft.get("norm_before_residual", True):
        argv += ["--no-norm-before-residual"]
    if cfg.max_steps is not None:
        argv += ["--max-steps", str(cfg.max_steps)]
    if cfg.fsdp:
        argv += ["--fsdp-shard"]
    if cfg.trust_remote_code:
        argv += ["--trust-remote-code"]
    if cfg.dry_run:
        argv += ["--dry-run"]
    return argv + list(cfg.extra_args)


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc), "--nnodes", str(cfg.nnodes)]
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


def export_compat_settings(cfg: TrainConfig) -> None:
    """Settings of the compat fixes, for this process and every training process it starts
    (`run_in_process` only gets speculators' flags, which have no place for them)."""
    from .compat import flex_forward_config

    os.environ[flex_forward_config.ENV] = cfg.flex_forward_config


def launch_env() -> dict[str, str]:
    """Child processes must import eagle3_pipeline (the library beside the scripts)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS_DIR), env.get("PYTHONPATH")]))
    return env


def apply_compat() -> list[str]:
    """Version/hardware-gated fixes; returns the names of those that applied."""
    from .compat import cpu_trainer

    applied = []
    if cpu_trainer.apply():
        applied.append("cpu_trainer")
    try:
        from .compat import fused_loss
    except ImportError:
        fused_loss = None
    if fused_loss is not None and fused_loss.apply():
        applied.append("fused_loss")
    from .compat import flex_forward_config

    if flex_forward_config.apply():
        applied.append("flex_forward_config")
    return applied


def attach_metrics_file(metrics_path: Path) -> None:
    """Also append speculators' metric dicts (train/val, per step) to a JSONL file we can read back."""
    import speculators.train.cli as cli

    original = cli.setup_metric_logger

    def setup_with_jsonl(*args, **kwargs):
        original(*args, **kwargs)
        # Rank 0 only: every DDP rank logs the same step (bench/ scales by the world size).
        handler = MetricsJsonlHandler(metrics_path, rank_zero_only=True)
        logging.getLogger("speculators.metrics").addHandler(handler)

    cli.setup_metric_logger = setup_with_jsonl


def run_in_process(argv: list[str], metrics_path: Path) -> None:
    """speculators' own trainer, in this process (one GPU, or the CPU)."""
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig

    from . import resume
    from .errors import Interrupted

    applied = apply_compat()
    if applied:
        log.info("compatibility fixes applied: %s", ", ".join(applied))
    resume.install_interrupt_progress()
    attach_metrics_file(metrics_path)
    if on_gpu():
        # Copies the next batch to the GPU while this step computes (NOTES.md, "Training throughput").
        from .throughput import install_device_prefetch

        install_device_prefetch()
    speculators_main(SpeculatorsTrainConfig.resolve(argv))
    if "flex_forward_config" in applied:
        from .compat.flex_forward_config import traced_calls_summary

        log.info("flex_attention calls in the compiled draft: %s", traced_calls_summary())
    # speculators returns normally after SIGTERM/Ctrl-C: never let that pass for a finished run.
    stopped = resume.interruption()
    if stopped:
        save = Path(argv[argv.index("--save-path") + 1])
        if stopped["saved"]:
            raise Interrupted(f"training interrupted at global step {stopped['state']['global_step']}; checkpoint saved in "
                              f"{save / resume.INTERRUPTED}; rerun the same command to resume from it")
        raise Interrupted(f"training interrupted; the interrupt checkpoint could not be saved (see the log above); "
                          f"rerun the same command to resume from the last epoch checkpoint in {save}")


def write_command_file(out_dir: Path, argv: list[str], launch: list[str] | None) -> None:
    plain = "speculators train " + " ".join(shlex.quote(a) for a in argv)
    lines = [
        "# the speculators trainer call this run makes (reproducible with speculators alone):",
        plain,
    ]
    if launch:
        lines += ["# launched as:", " ".join(shlex.quote(a) for a in launch)]
    atomic_write_text(Path(out_dir) / "command.txt", "\n".join(lines) + "\n")


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill: skip it
    return records


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """speculators' epoch checkpoints (<save>/<epoch>/ with model.safetensors), oldest first."""
    dirs = [p for p in Path(out_dir).iterdir() if p.is_dir() and p.name.isdigit() and (p / "model.safetensors").is_file()]
    return sorted(dirs, key=lambda p: int(p.name))


def best_checkpoint(out_dir: Path) -> Path | None:
    best = Path(out_dir) / "checkpoint_best"
    if best.exists():
        return best.resolve()
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None
