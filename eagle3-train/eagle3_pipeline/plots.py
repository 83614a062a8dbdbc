"""Training curves as PNGs, from the checkpoint directory's metrics.jsonl.

`metrics.jsonl` holds speculators' metric dicts as the trainer logs them (one JSON object a
line, appended, so a resumed run continues the file):

    {"train": {"loss_0", "full_acc_0", "cond_acc_0", ..., "loss"}, "profile": {...},
     "epoch": E, "lr": ..., "global_step": S}                       per logged step
    {"val": {"loss_0_epoch", "full_acc_0_epoch", ..., "loss_epoch"}, "epoch": E}   per epoch

plus one config record at the start of each run (no "train"/"val": skipped). After a resume
from an epoch checkpoint the steps of the unfinished epoch are logged again: the later record
of a step wins. Validation has no step of its own; it is drawn at the last step of its epoch.

Writes `<out>/loss.png` (train loss per TTT step and in total, val loss per epoch) and
`<out>/accuracy.png` (full_acc_k: draft steps 0..k all right = P(k+1 draft tokens accepted),
cond_acc_k: step k right given 0..k-1 right; train per step, val per epoch).

While training runs (over SSH): `python -m eagle3_pipeline.plots WORK/checkpoints` redraws
them from what has been logged so far; copy the PNGs back with scp.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .metrics import read_metrics

# Local imports: matplotlib: imported where a plot is drawn (heavy, optional).

PLOTS_DIRNAME = "plots"
_STEP_KEY = re.compile(r"^(loss|full_acc|cond_acc)_(\d+)(?:_epoch)?$")
_SMOOTH_FROM = 30  # draw a moving mean over the faint raw train curve from this many points on


@dataclass
class Curves:
    """Metrics by step (train) and by epoch (val), de-duplicated, sorted."""

    train: dict[int, dict[str, float]] = field(default_factory=dict)  # global_step -> metrics
    train_epoch: dict[int, int] = field(default_factory=dict)  # global_step -> epoch
    profile: dict[int, dict[str, float]] = field(default_factory=dict)  # global_step -> timings (tokens_per_s, step_ms, ...)
    val: dict[int, dict[str, float]] = field(default_factory=dict)  # epoch -> metrics (keys without _epoch)

    @property
    def steps(self) -> list[int]:
        return sorted(self.train)

    def ttt_steps(self) -> int:
        keys = [k for metrics in list(self.train.values()) + list(self.val.values()) for k in metrics]
        found = [int(m.group(2)) for m in map(_STEP_KEY.match, keys) if m]
        return max(found) + 1 if found else 0

    def val_step(self, epoch: int) -> float:
        """x position of an epoch's validation: the last train step logged in that epoch."""
        in_epoch = [s for s, e in self.train_epoch.items() if e == epoch]
        if in_epoch:
            return max(in_epoch)
        if not self.train:  # no train records at all: fall back to epochs on the x axis
            return epoch
        per_epoch = (max(self.train) + 1) / (max(self.train_epoch.values()) + 1)
        return (epoch + 1) * per_epoch - 1


def read_curves(metrics_path: str | Path) -> Curves:
    curves = Curves()
    for record in read_metrics(metrics_path):
        if isinstance(record.get("train"), dict) and "global_step" in record:
            step = int(record["global_step"])
            curves.train[step] = _numbers(record["train"])
            curves.train_epoch[step] = int(record.get("epoch", 0))
            if isinstance(record.get("profile"), dict):
                curves.profile[step] = _numbers(record["profile"])
        elif isinstance(record.get("val"), dict) and "epoch" in record:
            curves.val[int(record["epoch"])] = {k.removesuffix("_epoch"): v for k, v in _numbers(record["val"]).items()}
    return curves


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Draw loss.png and accuracy.png into out_dir; returns the files written (none without metrics)."""
    curves = read_curves(metrics_path)
    if not curves.train and not curves.val:
        return []
    import matplotlib

    matplotlib.use("Agg")  # headless: SSH sessions, CI
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("loss.png", _draw_loss), ("accuracy.png", _draw_accuracy)):
        fig = draw(plt, curves)
        path = out / name
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        tmp.replace(path)
        written.append(path)
    return written


def _draw_loss(plt, curves: Curves):
    n = curves.ttt_steps()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    total, per_step = axes
    _series(total, curves, "loss", "train loss (sum over TTT steps)", "C0")
    _val_series(total, curves, "loss", "val loss (per epoch)", "C3")
    total.set_title("total loss")
    for k in range(n):
        color = f"C{k % 10}"
        _series(per_step, curves, f"loss_{k}", f"train step {k}", color, smooth_only=True)
        _val_series(per_step, curves, f"loss_{k}", f"val step {k}", color)
    per_step.set_title("loss per TTT step (line: train, markers: val)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(_title(curves))
    fig.tight_layout()
    return fig


def _draw_accuracy(plt, curves: Curves):
    n = curves.ttt_steps()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, metric, title in (
        (axes[0], "full_acc", "full_acc_k: draft steps 0..k all right (P(token k accepted))"),
        (axes[1], "cond_acc", "cond_acc_k: step k right given steps 0..k-1 right"),
    ):
        for k in range(n):
            color = f"C{k % 10}"
            _series(ax, curves, f"{metric}_{k}", f"train step {k}", color, smooth_only=True)
            _val_series(ax, curves, f"{metric}_{k}", f"val step {k}", color)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0].set_ylabel("accuracy")
    tau = _val_tau(curves)
    fig.suptitle(_title(curves) + (f"   |   offline tau (val, last epoch) = {tau:.2f}" if tau is not None else ""))
    fig.tight_layout()
    return fig


def _series(ax, curves: Curves, key: str, label: str, color: str, smooth_only: bool = False) -> None:
    steps = [s for s in curves.steps if key in curves.train[s]]
    values = [curves.train[s][key] for s in steps]
    if not steps:
        return
    if len(steps) >= _SMOOTH_FROM:
        ax.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _smooth(values), color=color, linewidth=1.6, label=label + " (smoothed)")
    else:
        ax.plot(steps, values, color=color, linewidth=1.2, marker="." if len(steps) < 50 else None,
                alpha=0.8 if smooth_only else 1.0, label=label)


def _val_series(ax, curves: Curves, key: str, label: str, color: str) -> None:
    epochs = [e for e in sorted(curves.val) if key in curves.val[e]]
    if not epochs:
        return
    ax.plot([curves.val_step(e) for e in epochs], [curves.val[e][key] for e in epochs], color=color,
            linestyle="--", marker="o", markersize=6, markeredgecolor="black", label=label)


def _smooth(values: list[float]) -> list[float]:
    """Centred moving mean (no lag, unlike an EMA); the window shrinks at the ends."""
    half = max(2, len(values) // 50)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out


def _val_tau(curves: Curves) -> float | None:
    """1 + sum_k full_acc_k of the last validation (chain drafting with every TTT step)."""
    if not curves.val:
        return None
    last = curves.val[max(curves.val)]
    accs = [last[f"full_acc_{k}"] for k in range(curves.ttt_steps()) if f"full_acc_{k}" in last]
    return 1.0 + sum(accs) if accs else None


def _title(curves: Curves) -> str:
    steps = curves.steps
    parts = [f"{len(steps)} logged steps" if steps else "no train steps logged"]
    if curves.val:
        parts.append(f"{len(curves.val)} validation epoch(s)")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Draw training curves (loss.png, accuracy.png) from a checkpoint directory's metrics.jsonl.",
        epilog="example:\n  python -m eagle3_pipeline.plots work/checkpoints   # -> work/checkpoints/plots/*.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoints", help="stage 04's --output directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="output directory (default: CHECKPOINTS/plots)")
    args = parser.parse_args(argv)
    metrics = Path(args.checkpoints) / "metrics.jsonl"
    written = write_plots(metrics, args.out or Path(args.checkpoints) / PLOTS_DIRNAME)
    if not written:
        print(f"error: no train/val metrics in {metrics} yet", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
