"""Every change eagle3-train makes to speculators' runtime behaviour: one module each, here.

Each module has an `apply(...) -> bool` that checks its own gate and installs its change only
where it holds; `apply` below runs them all, in this order, and returns the names of those
installed (stage 04 logs them and records them in its manifest, via metrics.jsonl):

  cpu_trainer          speculators' Trainer, step timer, checkpointer and DDP setup on the CPU
                       (gate: no accelerator; speculators 0.9.0, else it raises)
  fused_loss           the fused Triton loss's backward kernel gets its own autotune configs list
                       (gate: the kernels share one list and torch's Dynamo double-tracks it)
  flex_forward_config  speculators' flex_attention call gets the measured forward kernel config
                       (gate: sm90, or options given with --flex-forward-config; not `off`)
  interrupt_progress   Trainer.train_epoch / maybe_save_checkpoint record where a SIGTERM save
                       stopped, so it resumes (gate: speculators 0.9.0)
  resume_agreement     every rank resumes from the checkpoint (epoch and training state) global rank 0 chose:
                       another node can list a shared --output from its filesystem's cache (gate: speculators 0.9.0)
  samples_record       Trainer.train_epoch also appends, per rank and step, the train rows that step
                       trained on and how many the loader left out to <save>/logs/samples/rank-<R>.jsonl
                       (stage 04's manifest `trained` counts them; gate: speculators 0.9.0)
  epoch_val_metrics    every saved epoch keeps its validation metrics (speculators writes them only for a new
                       lowest loss), so the choice by offline tau sees every epoch (gate: speculators 0.9.0)
  metrics_jsonl        speculators' metric logger setup also attaches stage 04's metrics.jsonl
                       (always; raises if speculators' setup function is gone)
  device_prefetch      the training loader copies the next batch to the GPU on a side stream
                       (gate: CUDA)
  sample_check         every sample is checked as the loader reads it (shape, storage, finite, token ids);
                       a bad one stops training with one line, or is skipped and listed, up to
                       --max-bad-fraction of the samples (gate: stage 04)
  finite_loss          a non-finite loss stops training before its optimizer step (gate: stage 04)
  val_depth            validation unrolls --val-ttt-steps TTT steps (the served k), deeper than training's
                       (gate: stage 04 asked for more steps than it trains; speculators 0.9.0)
  feature_noise        Gaussian noise (04 --noise-std) on the draft's input aux hidden states in training steps only,
                       never on the last slot (the target logits) nor in validation (gate: --noise-std > 0;
                       speculators 0.9.0)
  online_generation    on-demand generation from a vLLM server (04 --hidden-states online/hybrid):
                       a dead endpoint stops training at that batch with one line; hybrid keeps each
                       generated sample (gate: online/hybrid mode; speculators 0.9.0, else it raises)
  stall_watch          no training step or validation batch for 04 --stall-minutes: one line, every
                       thread's stack and the loader workers' states, exit 75 (resumable); logs the
                       run's longest wait (gate: a limit > 0; speculators 0.9.0, else it raises)

Not applied here: `hidden_states_connector`, a vLLM KV connector class that vLLM's workers
load by module path (every vLLM engine the pipeline starts). This package's import stays light for them.
`gate` holds the speculators-version check the fixes share (`require_speculators`).
"""

from __future__ import annotations

from pathlib import Path

# Local imports: each fix imports torch/speculators/vLLM inside its functions (its gate checks speculators'
# version first; vLLM's workers import hidden_states_connector light); apply() imports the fixes.

FIXES = ("cpu_trainer", "fused_loss", "flex_forward_config", "interrupt_progress", "resume_agreement", "samples_record",
         "epoch_val_metrics", "metrics_jsonl", "device_prefetch", "sample_check", "finite_loss", "val_depth", "feature_noise",
         "online_generation", "stall_watch")


def apply(metrics_path: str | Path) -> list[str]:
    """Install every fix whose gate holds, before `speculators.train.cli.main`; returns their names.

    Once per training process (each torchrun/DeepSpeed rank runs it); the settings that are
    not speculators flags come from the environment (`training.export_compat_settings`).
    """
    from . import (
        cpu_trainer,
        device_prefetch,
        epoch_val_metrics,
        feature_noise,
        finite_loss,
        flex_forward_config,
        fused_loss,
        interrupt_progress,
        metrics_jsonl,
        online_generation,
        resume_agreement,
        sample_check,
        samples_record,
        stall_watch,
        val_depth,
    )

    gates = {
        "cpu_trainer": cpu_trainer.apply,
        "fused_loss": fused_loss.apply,
        "flex_forward_config": flex_forward_config.apply,
        "interrupt_progress": interrupt_progress.apply,
        "resume_agreement": resume_agreement.apply,
        "samples_record": samples_record.apply,
        "epoch_val_metrics": epoch_val_metrics.apply,
        "metrics_jsonl": lambda: metrics_jsonl.apply(metrics_path),
        "device_prefetch": device_prefetch.apply,
        "sample_check": sample_check.apply,
        "finite_loss": finite_loss.apply,
        "val_depth": val_depth.apply,
        "feature_noise": feature_noise.apply,
        "online_generation": online_generation.apply,
        "stall_watch": lambda: stall_watch.apply(metrics_path),
    }
    return [name for name in FIXES if gates[name]()]
