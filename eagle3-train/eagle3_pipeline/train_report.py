"""After training: a one-screen summary from speculators' metrics.

`summarize` reads the best checkpoint's `val_metrics.json` (speculators writes it per epoch;
metrics.jsonl's val records are the fallback) and the train records of metrics.jsonl, and
returns a JSON-ready dict (it also goes into stage 04's manifest). The expected accepted
length is `expected_accepted_length`: tau(k) = 1 + sum_{i<k} full_acc_i, the offline estimate
for greedy chain drafting with k draft tokens (its docstring lists the assumptions);
`bench/acceptance.py` measures it in vLLM.
`format_summary` renders the dict as text; `write_summary` writes summary.json + summary.txt.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from .checkpoints import BEST_LINK, complete
from .checkpoints import best as best_checkpoint
from .files import atomic_write_json, atomic_write_text
from .metrics import METRICS_FILE, read_metrics
from .online import CACHE_DIRNAME
from .plots import PLOTS_DIRNAME, read_curves

log = logging.getLogger("eagle3")

SUMMARY_JSON = "summary.json"
SUMMARY_TXT = "summary.txt"
_MAX_EPOCH_ROWS = 12  # epochs listed in the table (the best one is always listed)


# --- the offline acceptance estimate ----------------------------------------------------------

_FULL_ACC_KEY = re.compile(r"^(?:val/)?full_acc_(\d+)(?:_epoch)?$")


def full_acc_by_step(val_metrics: Mapping[str, float]) -> list[float]:
    """[full_acc_0, full_acc_1, ...] from a speculators validation-metrics dict.

    Accepts the keys as the trainer logs them (`full_acc_{i}_epoch` in `val_metrics.json`,
    optionally prefixed `val/`) or bare `full_acc_{i}`. The steps must be contiguous from 0.
    """
    found: dict[int, float] = {}
    for key, value in val_metrics.items():
        match = _FULL_ACC_KEY.match(key)
        if match:
            found[int(match.group(1))] = float(value)
    if not found:
        raise KeyError("no full_acc_<i> keys in the validation metrics")
    steps = sorted(found)
    if steps != list(range(len(steps))):
        raise KeyError(f"full_acc steps are not contiguous from 0: {steps}")
    return [found[i] for i in steps]


def expected_accepted_length(full_acc: Sequence[float], num_speculative_tokens: int) -> float:
    """Expected tokens per target forward pass for chain drafting with k draft tokens.

        tau(k) = 1 + sum_{i=0}^{k-1} full_acc_i

    where full_acc_i is speculators' validation metric for TTT step i: the fraction of
    positions at which the draft's argmax at steps 0..i all equal the target's argmax
    (`compute_accuracy_single_step` ANDs the running `prev_correct`). Draft token i is accepted
    exactly when tokens 0..i are all right, so the expected number accepted is the sum of those
    probabilities (linearity of expectation; no independence between steps is assumed), and the
    target always adds one token (the correction or the bonus), hence the leading 1.

    Assumptions, each a way the estimate can differ from vLLM's measurement:
      * greedy decoding on both sides (vLLM with temperature 0 accepts a draft token iff it
        equals the target's argmax); sampling acceptance is a different quantity;
      * a single chain of k tokens per step (no tree);
      * TTT step i stands in for inference draft position i: training feeds the draft its own
        earlier hidden states the same way, but along the *dataset's* text, while in vLLM the
        continuation is the target's own greedy output;
      * validation rows resemble the prompts measured (same distribution, no truncation bias);
      * k <= the number of TTT steps trained (positions beyond were never measured);
      * the draft vocabulary covers the target's choices: speculators cuts the verifier's
        lm_head to the draft vocabulary before taking the target's argmax, so where the
        target's real choice lies outside the draft vocabulary the step counts as right when
        the draft picks the best in-vocabulary token, while vLLM always rejects it. With a
        pruned vocabulary the estimate is optimistic by up to the uncovered share of tokens
        (bench/benchlib/acceptance.py's `draft_vocab_coverage` measures that share on the target's outputs).
    full_acc_i is a ratio over the positions valid at step i (the last i positions of a row
    have no target), so the steps' denominators differ slightly; the sum ignores that.
    """
    if num_speculative_tokens < 0:
        raise ValueError("num_speculative_tokens must be >= 0")
    if num_speculative_tokens > len(full_acc):
        raise ValueError(
            f"k={num_speculative_tokens} needs full_acc for {num_speculative_tokens} TTT steps, "
            f"only {len(full_acc)} were measured (train with --ttt-steps >= k)"
        )
    for i, value in enumerate(full_acc[:num_speculative_tokens]):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"full_acc_{i}={value} is not a probability")
    return 1.0 + float(sum(full_acc[:num_speculative_tokens]))


def expected_accepted_lengths(full_acc: Sequence[float]) -> dict[int, float]:
    """{k: tau(k)} for k = 1 .. number of TTT steps measured."""
    return {k: expected_accepted_length(full_acc, k) for k in range(1, len(full_acc) + 1)}


# --- the summary ------------------------------------------------------------------------------

def choose_checkpoint(out_dir: Path, num_speculative_tokens: int) -> tuple[Path | None, dict]:
    """The checkpoint to export: the highest offline tau at the served k (its validation's full_acc; validation
    unrolls at least k steps, compat/val_depth.py), the lower validation loss breaking ties; then speculators'
    `checkpoint_best` (the lowest validation loss) points at it too. Tau can peak before the loss does (DeepSpec
    reports EAGLE-3 tau falling ~5% from epoch 5 to 10 while the loss kept dropping). Without any checkpoint's
    validation metrics: speculators' choice. Returns (checkpoint, the record of the choice)."""
    out_dir = Path(out_dir)
    by_epoch: dict[str, dict] = {}
    unvalidated: list[str] = []
    for folder in complete(out_dir):
        val = checkpoint_val_metrics(folder)
        try:
            full_acc = full_acc_by_step(val or {})
        except KeyError:  # no validation metrics in this checkpoint
            unvalidated.append(folder.name)
            continue
        k = min(num_speculative_tokens, len(full_acc))
        by_epoch[folder.name] = {"tau": expected_accepted_length(full_acc, k), "k": k, "val_loss": val.get("loss")}
    by_loss = best_checkpoint(out_dir)
    if not by_epoch:
        return by_loss, {"rule": "lowest validation loss (speculators' checkpoint_best): no checkpoint has validation "
                                 "accuracies", "chosen": by_loss.name if by_loss else None}
    chosen = max(by_epoch, key=lambda e: (by_epoch[e]["tau"], -(by_epoch[e]["val_loss"] or 0.0)))
    # A checkpoint without validation metrics among validated ones: a run killed after saving that epoch and before
    # its validation ended, then resumed past it (speculators resumes from the checkpoint and starts the next epoch).
    # It cannot be compared, so it is left out of the choice, and the summary and the manifest say so (issue 64).
    # Not validated on resume: that needs speculators' trainer built again around one checkpoint, outside its loop
    # (a second path to keep in step with its validation), for an epoch the run's later epochs have already passed.
    missing = {"not_validated": unvalidated,
               "not_validated_why": "saved without validation metrics (a run stopped after saving the epoch and "
                                    "before its validation ended, then resumed): left out of the choice"} if unvalidated else {}
    if unvalidated:
        log.warning("%s: checkpoint(s) %s %s; choosing among %s", out_dir, ", ".join(unvalidated),
                    missing["not_validated_why"], ", ".join(by_epoch))
    link = out_dir / BEST_LINK
    if not link.exists() or link.resolve().name != chosen:  # one best for users and tools alike; atomic
        tmp = out_dir / f".{BEST_LINK}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(chosen)
        tmp.replace(link)
    return out_dir / chosen, {
        "rule": f"highest offline tau at k={num_speculative_tokens} (validation full_acc), lower validation loss on a tie",
        "chosen": chosen, "lowest_val_loss": by_loss.name if by_loss else None, "by_epoch": by_epoch, **missing}


def summarize(metrics_path: Path, best: Path, num_speculative_tokens: int | None = None) -> dict:
    """The summary of one training run; `best` is the chosen checkpoint directory."""
    metrics_path, best = Path(metrics_path), Path(best)
    curves = read_curves(metrics_path)
    best_epoch = int(best.name) if best.name.isdigit() else None
    summary: dict = {"best_checkpoint": str(best), "best_epoch": best_epoch}

    val = _best_val_metrics(best, curves, best_epoch)
    if val:
        summary.update(_val_block(val, num_speculative_tokens))
    summary["val_by_epoch"] = {str(e): _epoch_row(m) for e, m in sorted(curves.val.items())}

    steps = curves.steps
    train: dict = {"logged_steps": len(steps)}
    if steps:
        last = curves.train[steps[-1]]
        train.update(last_step=steps[-1], epochs=max(curves.train_epoch.values()) + 1, last_loss=last.get("loss"))
    train.update(_throughput(curves))
    summary["train"] = train
    summary["hidden_states"] = hidden_states_source(metrics_path)
    return summary


def checkpoint_val_metrics(folder: Path) -> dict | None:
    """The validation metrics speculators saved in a checkpoint folder, keys without `_epoch`; None if unreadable."""
    path = Path(folder) / "val_metrics.json"
    try:
        return {k.removesuffix("_epoch"): v for k, v in json.loads(path.read_text()).items()}
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _best_val_metrics(best: Path, curves, best_epoch: int | None) -> dict | None:
    val = checkpoint_val_metrics(best)
    if val is not None:
        return val
    if best_epoch is not None and best_epoch in curves.val:
        return curves.val[best_epoch]
    return None


def _val_block(val: dict, num_speculative_tokens: int | None) -> dict:
    block: dict = {"val_loss": val.get("loss")}
    n = len([k for k in val if k.startswith("loss_")])
    block["val_loss_per_step"] = [val[f"loss_{k}"] for k in range(n) if f"loss_{k}" in val]
    try:
        full_acc = full_acc_by_step(val)
    except KeyError:
        return block
    block["full_acc"] = full_acc
    block["cond_acc"] = [val.get(f"cond_acc_{k}") for k in range(len(full_acc))]
    block["expected_accepted_length"] = {str(k): tau for k, tau in expected_accepted_lengths(full_acc).items()}
    if num_speculative_tokens and num_speculative_tokens <= len(full_acc):
        block["num_speculative_tokens"] = num_speculative_tokens
    return block


def _epoch_row(val: dict) -> dict:
    row = {"val_loss": val.get("loss")}
    try:
        full_acc = full_acc_by_step(val)
    except KeyError:
        return row
    row["full_acc"] = full_acc
    row["tau"] = 1.0 + sum(full_acc)  # tau(k) at k = every TTT step measured
    return row


def hidden_states_source(metrics_path: Path) -> str:
    """files / online / hybrid, from the run config speculators logged (its --on-missing) and the hybrid cache."""
    configs = [r["generation"] for r in read_metrics(metrics_path) if isinstance(r.get("generation"), dict)]
    if not configs or configs[-1].get("on_missing") != "generate":
        return "files"
    return "hybrid" if (Path(metrics_path).parent / CACHE_DIRNAME).is_dir() else "online"


def _throughput(curves) -> dict:
    """Median tokens/s per rank and step time over logged steps, step 0 (compilation) left out."""
    profiles = [p for step, p in curves.profile.items() if step > 0]
    rates = [p["tokens_per_s"] for p in profiles if "tokens_per_s" in p]
    times = [p["step_ms"] for p in profiles if "step_ms" in p]
    out = {}
    if rates:
        out["median_tokens_per_s_per_rank"] = statistics.median(rates)
    if times:
        out["median_step_ms"] = statistics.median(times)
    # speculators' step split: waiting for the batch (file reads; with --hidden-states online/hybrid the
    # vLLM round trips) vs the draft's forward + backward + optimizer.
    waits = {step: p["fetch_ms"] for step, p in curves.profile.items() if step > 0 and "fetch_ms" in p}
    computes = [p["fwd_ms"] + p["bwd_ms"] + p["opt_ms"] for p in profiles if {"fwd_ms", "bwd_ms", "opt_ms"} <= set(p)]
    if waits and computes:
        out["median_data_wait_ms"] = statistics.median(waits.values())
        out["median_compute_ms"] = statistics.median(computes)
        first = min(curves.train_epoch.get(step, 0) for step in waits)
        later = [ms for step, ms in waits.items() if curves.train_epoch.get(step, 0) > first]
        if later:  # hybrid: the first epoch generates, the later ones read the cache
            out["median_data_wait_ms_first_epoch"] = statistics.median(
                ms for step, ms in waits.items() if curves.train_epoch.get(step, 0) == first)
            out["median_data_wait_ms_later_epochs"] = statistics.median(later)
    return out


def format_summary(summary: dict, out_dir: Path | None = None) -> str:
    """One screen of text: best checkpoint, val loss, per-step accuracies, tau, the epoch table."""
    kind = summary.get("speculator_type") or "eagle3"
    lines = [f"{'EAGLE-3' if kind == 'eagle3' else kind} draft training summary" + (f"  ({out_dir})" if out_dir else "")]
    epoch = summary.get("best_epoch")
    choice = summary.get("checkpoint_choice") or {}
    chosen = (choice.get("by_epoch") or {}).get(str(epoch))  # choose_checkpoint's rule, else speculators' (by loss)
    why = f"highest offline tau at k={chosen['k']}" if chosen else "lowest val loss"
    lines.append(f"best checkpoint : {summary['best_checkpoint']}" + (f"  (epoch {epoch}, {why})" if epoch is not None else ""))
    if choice.get("not_validated"):
        lines.append(f"not validated   : checkpoint(s) {', '.join(choice['not_validated'])} "
                     f"{choice.get('not_validated_why', '')}")
    if summary.get("val_loss") is not None:
        per_step = " ".join(f"{v:.4f}" for v in summary.get("val_loss_per_step", []))
        lines.append(f"val loss        : {summary['val_loss']:.4f}" + (f"   per TTT step: {per_step}" if per_step else ""))
    if "full_acc" in summary:
        lines.append("full_acc_k      : " + " ".join(f"{v:.3f}" for v in summary["full_acc"])
                     + "   (val; P(draft token k accepted) under greedy chain drafting)")
        lines.append("cond_acc_k      : " + " ".join("  -  " if v is None else f"{v:.3f}" for v in summary["cond_acc"])
                     + "   (step k right given steps 0..k-1 right)")
        taus = summary["expected_accepted_length"]
        chosen = summary.get("num_speculative_tokens")
        shown = "  ".join(f"tau({k})={v:.2f}" + (" <- served k" if chosen and int(k) == chosen else "")
                          for k, v in taus.items())
        lines.append(f"accepted length : {shown}")
        lines.append("                  offline: 1 + sum of full_acc_0..k-1 tokens per target forward")
        lines.append("                  (vLLM's own figure: bench/acceptance.py)")
    elif summary.get("val_loss") is None:
        lines.append("validation      : no validation metrics found (is the val split empty?)")
    train = summary.get("train", {})
    if train.get("logged_steps"):
        parts = [f"{train['logged_steps']} logged steps over {train.get('epochs', '?')} epoch(s)"]
        if train.get("last_loss") is not None:
            parts.append(f"last train loss {train['last_loss']:.4f}")
        lines.append("training        : " + ", ".join(parts))
        if "median_tokens_per_s_per_rank" in train:
            lines.append(f"throughput      : median {train['median_tokens_per_s_per_rank']:,.0f} tokens/s per rank"
                         + (f", {train['median_step_ms']:,.0f} ms/step" if "median_step_ms" in train else "")
                         + " (step 0 left out)")
        if "median_data_wait_ms" in train:
            source = summary.get("hidden_states", "files")
            waited = "vLLM generation" if source in ("online", "hybrid") else "reading hidden states"
            by_epoch = (f"; first epoch {train['median_data_wait_ms_first_epoch']:,.0f} ms, later epochs "
                        f"{train['median_data_wait_ms_later_epochs']:,.0f} ms"
                        if source == "hybrid" and "median_data_wait_ms_later_epochs" in train else "")
            lines.append(f"step split      : median {train['median_data_wait_ms']:,.0f} ms waiting for data ({waited}"
                         + (", kept after the first epoch" if source == "hybrid" else "") + by_epoch
                         + f"), {train['median_compute_ms']:,.0f} ms training (forward + backward + optimizer)")
    rows = summary.get("val_by_epoch", {})
    if rows:
        lines.append("")
        lines += _epoch_table(rows, epoch)
    if out_dir is not None and (Path(out_dir) / PLOTS_DIRNAME).is_dir():
        lines.append("")
        lines.append(f"plots           : {Path(out_dir) / PLOTS_DIRNAME}/loss.png, accuracy.png")
    return "\n".join(lines)


def _epoch_table(rows: dict, best_epoch: int | None) -> list[str]:
    epochs = sorted(rows, key=int)
    if len(epochs) > _MAX_EPOCH_ROWS:
        keep = set(epochs[-(_MAX_EPOCH_ROWS - 1):]) | ({str(best_epoch)} if best_epoch is not None else set())
        epochs = [e for e in epochs if e in keep]
    n = max((len(r.get("full_acc", [])) for r in rows.values()), default=0)
    header = "epoch  val_loss  " + " ".join(f"full_acc_{k}" for k in range(n)) + (f"  tau({n})" if n else "")
    out = [header]
    for e in epochs:
        row = rows[e]
        loss = f"{row['val_loss']:8.4f}" if row.get("val_loss") is not None else "       -"
        mark = "*" if best_epoch is not None and int(e) == best_epoch else " "
        accs = " ".join(f"{v:10.3f}" for v in row.get("full_acc", []))
        tau = f"  {row['tau']:6.2f}" if "tau" in row else ""
        out.append(f"{int(e):5d}  {loss}{mark} {accs}{tau}")
    out.append("(* = best checkpoint)")
    return out


def write_summary(out_dir: Path, summary: dict) -> str:
    """summary.json (machine-readable) and summary.txt (the text above); returns the text."""
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / SUMMARY_JSON, summary)
    text = format_summary(summary, out_dir)
    atomic_write_text(out_dir / SUMMARY_TXT, text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3_pipeline.train_report CHECKPOINTS`: the summary of a run (also mid-training)."""
    parser = argparse.ArgumentParser(description=main.__doc__,
                                     epilog="example:\n  python -m eagle3_pipeline.train_report work/checkpoints",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", help="stage 04's --output directory")
    args = parser.parse_args(argv)
    out_dir = Path(args.checkpoints)

    best = best_checkpoint(out_dir)
    if best is None:
        print(f"error: no checkpoint in {out_dir} yet")
        return 1
    print(format_summary(summarize(out_dir / METRICS_FILE, best), out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
