"""The run plan: bytes, disk, read bandwidth and hours of a real run, before anything heavy starts.

For a target (its config.json is enough), a profile and the data (stage 01's output, or a
hypothetical `--rows` x `--tokens-per-row`), one screen with the numbers a user would otherwise
work out by hand: tokens; hidden-state bytes in bf16 and fp8 (speculators' fp8 format: 1 byte a
value + one fp32 scale per token); free disk; the read bandwidth training needs vs what the disk
gives cold; hours of extraction and training at the given or measured rates; and what that
implies (bf16 files, fp8 files, or training against a running vLLM).

    python -m eagle3_pipeline.plan --target /models/Kimi-K2.5 --profile b300-8x --work /nvme/eagle3 \\
        --rows 100000 --tokens-per-row 2048
    eagle3-train/run_all.sh --plan ...                     (the same, with run_all's flags)

It writes nothing. The disk's cold read rate is measured (files evicted from the page cache, then read
as the loader reads them) only from hidden-state files already under --work; otherwise it is "not
measured" unless --disk-read-gb-s gives it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config.resolution import load_profile
from .config.schema import TrainConfig
from .contract import manifest_path
from .disk_reads import READ_PROBE_MIN_TOTAL_BYTES, measure_cold_read_bandwidth, read_probe_sample
from .errors import ContractError, StageError
from .hidden_states import HS_DIRNAME, NUM_SLOTS, StateFormat
from .machine import disk_free
from .manifest import parse_manifest
from .scaling import communication_line
from .sizing import TRAIN_TOKENS_PER_S_PER_GPU, human_bytes
from .target import load_target_info

# The plan's labels -> stage 02's formats (--storage dtype with --dtype bfloat16, --storage fp8).
FORMATS = {"bf16": StateFormat("dtype", "bfloat16"), "fp8": StateFormat("fp8")}


def bytes_per_token(hidden_size: int, storage: str, num_slots: int = NUM_SLOTS) -> int:
    return FORMATS[storage].bytes_per_token(hidden_size, num_slots)


@dataclass
class Plan:
    target: str
    hidden_size: int
    num_layers: int
    profile: str
    gpus: int
    epochs: int
    rows: int
    tokens: int
    tokens_source: str
    data: str
    free_bytes: int
    bytes_per_token: dict
    total_bytes: dict
    train_tokens_per_s_per_gpu: float
    train_rate_source: str
    disk_read_gb_s: float | None
    disk_read_source: str
    extract_tokens_per_s: float | None
    recommendation: str
    extract_rate_source: str = "not given"
    answer_tokens: int = 0  # decode tokens of regenerating every answer with the target
    answer_tokens_source: str = ""
    decode_tokens_per_s: float | None = None
    decode_rate_source: str = "not given"
    free_source: str = "measured"
    train_data_ratio: float = 0.9  # stage 01's (the validation rows: the rest); 0.9 for a run not prepared yet
    slice_rows: int | None = None  # --slice-rows: the size to plan; else the largest that fits
    disk_write_gb_s: float | None = None  # the data disk's durable write rate (disk_writes.py measures it)
    disk_write_source: str = "not given"
    # stage 02's measured fraction of the disk's write rate, per format, where the disk governs (the connector's
    # writers and stage 02's landing do not keep the disk busy all the time); 1.0 where nothing measured it
    disk_fraction: dict = field(default_factory=lambda: {s: 1.0 for s in FORMATS})
    disk_fraction_source: str = "not measured: the disk's bound itself"

    def need_gb_s(self, storage: str) -> float:
        return self.gpus * self.train_tokens_per_s_per_gpu * self.bytes_per_token[storage] / 1e9

    def train_hours(self, storage: str) -> float:
        """GPU-bound, or disk-bound where the measured disk is slower than the GPUs read."""
        rate = self.gpus * self.train_tokens_per_s_per_gpu
        if self.disk_read_gb_s is not None:
            rate = min(rate, self.disk_read_gb_s * 1e9 / self.bytes_per_token[storage])
        return self.tokens * self.epochs / rate / 3600

    def regen_hours(self) -> float | None:
        return self.answer_tokens / self.decode_tokens_per_s / 3600 if self.decode_tokens_per_s else None

    def extract_rate(self, storage: str) -> tuple[float | None, str]:
        """Stage 02's tokens/s writing `storage` files and which bound governs: the slower of the prefill rate and what
        stage 02 gets of the disk (its write rate over the format's bytes per token, times stage 02's measured fraction
        of that bound: at Kimi-K2.5's width the disk can be the slower, bench/README.md "Stage 02 at Kimi-K2.5's width")."""
        disk = (self.disk_write_gb_s * 1e9 / self.bytes_per_token[storage] * self.disk_fraction[storage]
                if self.disk_write_gb_s else None)
        if disk is not None and (not self.extract_tokens_per_s or disk < self.extract_tokens_per_s):
            return disk, "disk"
        return self.extract_tokens_per_s, "prefill" if disk is not None else "prefill only"

    def extract_hours(self, storage: str = "bf16", tokens: float | None = None) -> float | None:
        rate, _ = self.extract_rate(storage)
        return (self.tokens if tokens is None else tokens) / rate / 3600 if rate else None

    def mode_hours(self) -> dict[str, float | None]:
        """Wall hours after regeneration, per way of feeding the trainer: files (stage 02 once, then every
        epoch from disk), online (vLLM recomputes every epoch's states beside the trainer, on other GPUs:
        each epoch takes the slower of the two), hybrid (the first epoch online, cached in bf16, the rest
        from that cache)."""
        extract, epoch = self.extract_hours("bf16"), self.train_hours("bf16") / max(self.epochs, 1)
        online = self.tokens / self.extract_tokens_per_s / 3600 if self.extract_tokens_per_s else None  # nothing written
        if extract is None or online is None:
            return {"bf16": None, "fp8": None, "online": None, "hybrid": None}
        return {"bf16": extract + self.train_hours("bf16"), "fp8": self.extract_hours("fp8") + self.train_hours("fp8"),
                "online": self.epochs * max(online, self.tokens / (self.gpus * self.train_tokens_per_s_per_gpu) / 3600),
                "hybrid": max(extract, epoch) + (self.epochs - 1) * epoch}


# Room left beside one slice's states: the files in flight, checkpoints (one per run position), logs.
SLICE_HEADROOM = 0.1


@dataclass
class SlicePlanLine:
    storage: str
    slice_rows: int
    num_slices: int
    val_rows: int
    slice_bytes: int  # one slice's training rows + the validation rows
    fits: bool
    extract_h_per_slice: float | None
    train_h_per_slice: float
    extract_h_total: float | None
    train_h_total: float
    reextract_h: float | None  # the extraction epochs 2..E add (every slice again)


def slice_plan(plan: Plan, storage: str) -> SlicePlanLine | None:
    """A sliced run (run_all.sh --slice-rows): N rows per slice from the free disk, or the given N; None when not even
    the validation rows fit. Every slice's states are its training rows + the validation rows (extracted once, kept);
    every epoch re-extracts every slice (eagle3_pipeline/slices.py)."""
    tokens_per_row = plan.tokens / max(plan.rows, 1)
    per_row = tokens_per_row * plan.bytes_per_token[storage]
    val_start = int(plan.rows * plan.train_data_ratio)
    val_rows = plan.rows - val_start
    usable = plan.free_bytes * (1 - SLICE_HEADROOM)
    fit = int((usable - val_rows * per_row) // per_row) if per_row else val_start
    n = min(plan.slice_rows or fit, val_start)
    if n < 1:
        return None
    rate = plan.gpus * plan.train_tokens_per_s_per_gpu
    if plan.disk_read_gb_s is not None:
        rate = min(rate, plan.disk_read_gb_s * 1e9 / plan.bytes_per_token[storage])

    def extract(tokens: float) -> float | None:
        return plan.extract_hours(storage, tokens)

    train_tokens, val_tokens = val_start * tokens_per_row, val_rows * tokens_per_row
    return SlicePlanLine(
        storage=storage, slice_rows=n, num_slices=-(-val_start // n), val_rows=val_rows,
        slice_bytes=int((n + val_rows) * per_row), fits=(n + val_rows) * per_row <= usable,
        extract_h_per_slice=extract(n * tokens_per_row), train_h_per_slice=n * tokens_per_row / rate / 3600,
        extract_h_total=extract(plan.epochs * train_tokens + val_tokens),
        train_h_total=plan.epochs * train_tokens / rate / 3600,
        reextract_h=extract((plan.epochs - 1) * train_tokens))


def slice_lines(plan: Plan) -> list[str]:
    """The sliced run's lines of the plan: slices, hours per slice and in all, per format; the epochs warning."""
    def hours(value: float | None) -> str:
        if value is None:
            return "? h"
        return f"{value:,.1f} h" if value >= 1 else f"{value * 60:,.0f} min"

    lines, warned = [], False
    for storage in FORMATS:
        sliced = slice_plan(plan, storage)
        if sliced is None:
            lines.append(f"  {'slices ' + storage + ':':<15}not even the {plan.rows - int(plan.rows * plan.train_data_ratio):,} "
                         f"validation rows fit in {human_bytes(plan.free_bytes)}")
            continue
        size = f"--slice-rows {sliced.slice_rows:,}" + (" (given)" if plan.slice_rows else " (the most that fit)")
        total = None if sliced.extract_h_total is None else sliced.extract_h_total + sliced.train_h_total
        lines.append(
            f"  {'slices ' + storage + ':':<15}{size}: {sliced.num_slices:,} slice(s) x {plan.epochs} epoch(s); "
            f"{human_bytes(sliced.slice_bytes)} of states on disk at a time (a slice + the {sliced.val_rows:,} validation "
            f"rows), {'fits' if sliced.fits else 'does NOT fit'} in the free disk less {SLICE_HEADROOM:.0%} (files in "
            f"flight, checkpoints); per slice: extraction {hours(sliced.extract_h_per_slice)}, training "
            f"{hours(sliced.train_h_per_slice)}; in all: extraction {hours(sliced.extract_h_total)}, training "
            f"{hours(sliced.train_h_total)}, {hours(total)} one after the other")
        if plan.epochs > 1 and not warned and sliced.reextract_h is not None:
            epoch_train_h = sliced.train_h_total / plan.epochs
            if sliced.reextract_h > (plan.epochs - 1) * epoch_train_h:
                warned = True
                lines.append(
                    f"  WARNING:       a sliced run re-extracts every slice each epoch: epochs 2-{plan.epochs} cost "
                    f"{hours(sliced.reextract_h)} of extraction for {hours((plan.epochs - 1) * epoch_train_h)} of training "
                    f"on rows already seen; those extraction hours would extract "
                    f"{(plan.epochs - 1) * int(plan.rows * plan.train_data_ratio):,} new rows instead (data is the larger "
                    f"lever, data/epochs below): prefer more data at --epochs 1-2")
    return lines


def measured_extract_rate(data: Path) -> tuple[float | None, str]:
    """Stage 02's own rate, from its manifest in DATA/hidden_states (a 10-sample run records it)."""
    manifest = manifest_path(data / HS_DIRNAME)
    counts = getattr(_recorded(manifest), "counts", None)
    if counts is None or not counts.extract_tokens_per_s:
        return None, ""
    return float(counts.extract_tokens_per_s), (f"measured: stage 02 on {counts.extracted_tokens or 0:,} tokens in "
                                                f"{counts.extract_s or 0:.0f} s, engine start excluded ({manifest})")


def _recorded(path: Path):
    """A stage's manifest for the plan's figures, or None (none yet, or one this version cannot read)."""
    try:
        return parse_manifest(path) if path.is_file() else None
    except ContractError:
        return None


def prepared_ratio(data: Path) -> float:
    """Stage 01's train_data_ratio (speculators validates on the rest), else 0.9 (01's default split)."""
    ratio = getattr(_recorded(manifest_path(data)), "train_data_ratio", None)
    return 0.9 if ratio is None else float(ratio)


def answer_tokens(data: Path, rows: int, tokens: int, answer_tokens_per_row: int | None) -> tuple[int, str]:
    """Tokens the target generates to regenerate every answer: stage 01's loss tokens, else the given
    or assumed share of each row."""
    if answer_tokens_per_row is not None:
        return rows * answer_tokens_per_row, f"--answer-tokens-per-row {answer_tokens_per_row:,}"
    manifest = manifest_path(data)
    if (counts := getattr(_recorded(manifest), "counts", None)) is not None:
        loss = counts.loss_tokens
        if loss:
            return int(loss), f"stage 01's loss tokens ({manifest})"
    return tokens // 2, "assumed: half of each row is answer (give --answer-tokens-per-row)"


def data_tokens(data: Path, rows: int | None, tokens_per_row: int | None) -> tuple[int, int, str]:
    """(rows, tokens, where from): stage 01's manifest in `data`, else the hypothetical figures."""
    manifest = manifest_path(data)
    if rows is None and manifest.is_file():
        # stage 01's output is there: its figures, or why they cannot be read (never "no prepared data yet")
        found = parse_manifest(manifest, hint="rerun 01_prepare_dataset.py (run_all.sh does), or give --rows and "
                                              "--tokens-per-row for the plan")
        if found.stage != "prepare" or not found.complete or found.counts is None:
            what = f"stage {found.stage!r}'s manifest" if found.stage != "prepare" else "stage 01 did not finish"
            raise ContractError(f"{manifest}: {what}, no prepared data to plan from; rerun 01_prepare_dataset.py "
                                f"(run_all.sh does), or give --rows and --tokens-per-row for the plan")
        if found.counts.tokens:
            return found.counts.rows, found.counts.tokens, f"stage 01's {manifest}"
    if rows is None or tokens_per_row is None:
        raise StageError(f"{manifest}: no prepared data yet; give --rows and --tokens-per-row for the plan")
    return rows, rows * tokens_per_row, f"--rows {rows:,} x --tokens-per-row {tokens_per_row:,}"


def cold_read(data: Path, given: float | None) -> tuple[float | None, str]:
    if given is not None:
        return given, "--disk-read-gb-s"
    files, total = read_probe_sample(data / HS_DIRNAME)
    if total < READ_PROBE_MIN_TOTAL_BYTES:  # smaller: the page cache holds them
        return None, (f"not measured (under {READ_PROBE_MIN_TOTAL_BYTES / 1e9:.0f} GB of hidden states in {data} to "
                      f"read; the plan's --disk-read-gb-s gives it, or rerun after a 10-sample stage 02)")
    try:
        measured = measure_cold_read_bandwidth(files, threads=8)
    except OSError as exc:
        return None, f"not measured ({exc.strerror or exc})"
    return measured["gb_per_s"], (f"measured: cold (evicted from the page cache), 8 readers, "
                                  f"{human_bytes(measured['bytes'])} of {data}")


def recommend(plan: Plan) -> str:
    fits = {s: plan.total_bytes[s] <= plan.free_bytes for s in FORMATS}
    fast = {s: plan.disk_read_gb_s is None or plan.disk_read_gb_s >= plan.need_gb_s(s) for s in FORMATS}
    unknown = " (disk read rate not measured: check it)" if plan.disk_read_gb_s is None else ""
    if fits["bf16"] and fast["bf16"]:
        return "bf16 hidden-state files: they fit and the disk keeps the GPUs fed" + unknown
    if fits["fp8"] and fast["fp8"]:
        return ("fp8 hidden-state files: half the bytes of bf16 " + ("(bf16 does not fit)" if not fits["bf16"] else
                "(bf16 would leave the GPUs waiting on the disk)") + unknown)
    if fits["fp8"]:
        return ("fp8 files, with the training GPUs waiting on the disk (see the disk-bound hours), or train against "
                "a running vLLM (04_train.py --hidden-states online, the server from python -m eagle3_pipeline.serve_target) "
                "so no state is read from disk")
    return ("the hidden states do not fit even in fp8: train against a running vLLM (04_train.py --hidden-states "
            "online, the server from python -m eagle3_pipeline.serve_target), or extract and train in slices of the data "
            "(run_all.sh --slice-rows N: the slices lines above)")


def make_plan(target_dir: str, profile: str | None, work: str, rows: int | None = None, tokens_per_row: int | None = None,
              train_tokens_per_s: float | None = None, disk_read_gb_s: float | None = None,
              extract_tokens_per_s: float | None = None, *, data: str | None = None, gpus: int | None = None,
              epochs: int | None = None, decode_tokens_per_s: float | None = None,
              answer_tokens_per_row: int | None = None, free_disk_gb: float | None = None,
              slice_rows: int | None = None, disk_write_gb_s: float | None = None,
              extract_disk_fraction: float | None = None) -> Plan:
    """`data`: stage 01's output (default WORK/data); `gpus`/`epochs`: stage 04's resolved values (default:
    the profile's train section, else 04's defaults)."""
    target = load_target_info(target_dir)
    train = load_profile(profile).get("train", {}) if profile else {}
    if gpus is None:
        gpus = int(train.get("nproc", TrainConfig.model_fields["nproc"].default)) * int(train.get("nnodes", 1))
    if epochs is None:
        epochs = int(train.get("epochs", TrainConfig.model_fields["epochs"].default))
    data_dir = Path(data) if data else Path(work) / "data"
    num_rows, tokens, source = data_tokens(data_dir, rows, tokens_per_row)
    per_token = {s: bytes_per_token(target.hidden_size, s) for s in FORMATS}
    read, read_source = cold_read(data_dir, disk_read_gb_s)
    if extract_tokens_per_s:
        extract_source = "--extract-tokens-per-s"
    else:
        extract_tokens_per_s, extract_source = measured_extract_rate(data_dir)
    answers, answers_source = answer_tokens(data_dir, num_rows, tokens, answer_tokens_per_row)
    fractions, fractions_source = disk_fractions(extract_disk_fraction)
    plan = Plan(
        target=target.path, hidden_size=target.hidden_size, num_layers=target.num_layers, profile=profile or "none",
        gpus=gpus, epochs=epochs, rows=num_rows, tokens=tokens, tokens_source=source, data=str(data_dir),
        free_bytes=int(free_disk_gb * 1e9) if free_disk_gb is not None else disk_free(data_dir), bytes_per_token=per_token,
        total_bytes={s: tokens * per_token[s] for s in FORMATS},
        train_tokens_per_s_per_gpu=train_tokens_per_s or TRAIN_TOKENS_PER_S_PER_GPU,
        train_rate_source="--train-tokens-per-s" if train_tokens_per_s else
        "04_train's defaults at Kimi-K2.5 geometry on one H200 (bench/README.md); measure yours with bench/train_throughput.py",
        disk_read_gb_s=read, disk_read_source=read_source, extract_tokens_per_s=extract_tokens_per_s,
        recommendation="", extract_rate_source=extract_source or "not given", answer_tokens=answers,
        answer_tokens_source=answers_source, decode_tokens_per_s=decode_tokens_per_s,
        decode_rate_source="--decode-tokens-per-s" if decode_tokens_per_s else "not given",
        free_source="--free-disk-gb" if free_disk_gb is not None else "measured", slice_rows=slice_rows,
        train_data_ratio=prepared_ratio(data_dir), disk_write_gb_s=disk_write_gb_s,
        disk_write_source="--disk-write-gb-s" if disk_write_gb_s else
        f"not given: python -m eagle3_pipeline.disk_writes --dir {data_dir} measures it",
        disk_fraction=fractions, disk_fraction_source=fractions_source,
    )
    plan.recommendation = recommend(plan)
    return plan


def check_plan_lines(target_dir: str, data: str | Path, profile: str | None, *, gpus: int | None = None,
                     epochs: int | None = None) -> list[str]:
    """The run plan as stage 02's and 04's --check print it: stage 01's output in `data`; no rates but the
    assumed training rate (the plan's own flags give the rest)."""
    return format_plan(make_plan(target_dir, profile, str(Path(data).parent), data=str(data), gpus=gpus,
                                 epochs=epochs)).splitlines()


# The learning-curves results (bench/acceptance.py --curves on one H200) whose priced data/epochs split the plan
# quotes; a checkout's file (an installed package without the repo has none, and the line says so).
CURVES_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-acceptance-curves-smollm2.json"


# Stage 02 at Kimi-K2.5's width on one H200 (bench/extraction_vs_prefill.py --targets kimi-width --disk-write), the
# run that chose stage 02's default writeback (`--writeback on off writer`): `ratio_to_bound` of the default's runs is
# the fraction of the disk's write rate stage 02 reached where the disk governed.
EXTRACTION_RESULTS = CURVES_RESULTS.parent / "h200-extraction-kimi-width-writeback-ab.json"
BENCH_STORAGES = {"bf16": "dtype_writeback_writer", "fp8": "fp8_writeback_writer"}  # the plan's formats -> its runs


def _shown(path: Path) -> Path:
    """A checkout's results file as the docs name it (bench/results/...), any other path as given."""
    return path.relative_to(CURVES_RESULTS.parents[2]) if path.parent == CURVES_RESULTS.parent else path


def disk_fractions(given: float | None = None, results: str | Path = EXTRACTION_RESULTS) -> tuple[dict, str]:
    """Stage 02's fraction of the disk bound per format: `given` (the user's own stage 02 on their disk) for both, else
    the measured `ratio_to_bound`s of `results`, else 1.0 (the bound itself) with the file it needs."""
    if given is not None:
        return {s: float(given) for s in FORMATS}, "--extract-disk-fraction"
    path = Path(results)
    try:
        storages = json.loads(path.read_text())["targets"]["kimi-width"]["storages"]
        fractions = {s: float(storages[bench]["ratio_to_bound"]) for s, bench in BENCH_STORAGES.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {s: 1.0 for s in FORMATS}, (f"not measured: needs {_shown(path)} (bench/h200_vllm_gpu.sh extract-width); "
                                           f"the disk's bound itself")
    return fractions, f"measured on one H200 at Kimi-K2.5's width: {_shown(path)}, ratio_to_bound"


def data_epochs_line(curves_path: str | Path = CURVES_RESULTS) -> str:
    """The split between more data and more epochs that the measured learning curves favour once each
    extracted token is priced at the target's forward (the bench's `run_plan_line`), or which file it needs."""
    path = Path(curves_path)
    try:
        line = json.loads(path.read_text())["run_plan_line"]
    except (OSError, ValueError, KeyError):
        return (f"not measured: needs {_shown(path)} (python bench/acceptance.py --curves --device cuda, bench/README.md); "
                f"until then data size is the larger lever (NOTES.md, 'Acceptance length')")
    return str(line)


def format_plan(plan: Plan) -> str:
    def size(storage: str) -> str:
        total = plan.total_bytes[storage]
        verdict = "fits" if total <= plan.free_bytes else "does NOT fit"
        return f"{storage} {human_bytes(total)} ({plan.bytes_per_token[storage]:,} B/token, {verdict})"

    rate = plan.gpus * plan.train_tokens_per_s_per_gpu
    disk = f"{plan.disk_read_gb_s:.2f} GB/s" if plan.disk_read_gb_s is not None else "?"
    def extract_line(storage: str) -> str:
        rate, bound = plan.extract_rate(storage)
        if rate is None:
            return f"{storage} ? h"
        why = "the prefill; the disk's write rate not given" if bound == "prefill only" else f"{bound} governs"
        return f"{storage} {plan.extract_hours(storage):,.1f} h at {rate:,.0f} tokens/s ({why})"

    fractions = ", ".join(f"{s} {plan.disk_fraction[s]:.3f}" for s in FORMATS)

    prefill = (f"prefill {plan.extract_tokens_per_s:,.0f} tokens/s ({plan.extract_rate_source})" if plan.extract_tokens_per_s
               else "prefill ?: run a 10-sample stage 02 (--max-samples 10; its manifest records the rate) or give "
                    "--extract-tokens-per-s")
    written = (f"{plan.disk_write_gb_s:.2f} GB/s ({plan.disk_write_source})" if plan.disk_write_gb_s
               else f"? ({plan.disk_write_source})")
    extract = (f"{extract_line('bf16')}, {extract_line('fp8')}: the slower of the {prefill} and the disk's "
               f"writes, {written}, over each format's bytes per token times stage 02's fraction of that bound "
               f"({fractions}; {plan.disk_fraction_source})")
    regen = (f"{plan.regen_hours():,.1f} h at {plan.decode_tokens_per_s:,.0f} decode tokens/s ({plan.decode_rate_source})"
             if plan.decode_tokens_per_s else "hours = answer tokens / the target's decode rate at your batch "
                                              "(vLLM's throughput): give --decode-tokens-per-s")

    def hours(value: float | None) -> str:
        return f"{value:,.1f} h" if value is not None else "? h"

    modes = plan.mode_hours()
    return "\n".join([
        f"run plan: {plan.target} (hidden {plan.hidden_size}, {plan.num_layers} layers, {NUM_SLOTS} states per token), "
        f"profile {plan.profile}: {plan.gpus} training GPU(s), {plan.epochs} epochs",
        f"  data:          {plan.rows:,} rows, {plan.tokens:,} tokens ({plan.tokens_source})",
        f"  hidden states: {size('bf16')}; {size('fp8')}; free at {plan.data}: {human_bytes(plan.free_bytes)}"
        + (" (--free-disk-gb)" if plan.free_source != "measured" else ""),
        f"  reads:         {plan.gpus} GPU(s) x {plan.train_tokens_per_s_per_gpu:,.0f} tokens/s need "
        f"{plan.need_gb_s('bf16'):.2f} GB/s in bf16, {plan.need_gb_s('fp8'):.2f} GB/s in fp8; the disk gives {disk} cold "
        f"({plan.disk_read_source})",
        f"  training rate: {plan.train_tokens_per_s_per_gpu:,.0f} tokens/s per GPU ({plan.train_rate_source})",
        f"  regeneration:  {plan.answer_tokens:,} answer tokens ({plan.answer_tokens_source}); {regen}",
        f"  extraction:    {plan.tokens:,} tokens; {extract}",
        f"  training:      {plan.epochs} epochs x {plan.tokens:,} tokens at {rate:,.0f} tokens/s: "
        f"{plan.train_hours('bf16'):,.1f} h from bf16 files, {plan.train_hours('fp8'):,.1f} h from fp8 files"
        + ("" if plan.disk_read_gb_s is not None else " (GPU-bound; the disk not measured)"),
        f"  disk x hours:  bf16 files {human_bytes(plan.total_bytes['bf16'])}, {hours(modes['bf16'])}; fp8 files "
        f"{human_bytes(plan.total_bytes['fp8'])}, {hours(modes['fp8'])}; online 0 B, {hours(modes['online'])} (a vLLM on other GPUs "
        f"recomputes every epoch); hybrid {human_bytes(plan.total_bytes['bf16'])} cache, {hours(modes['hybrid'])} "
        f"(extraction + training; regeneration adds {hours(plan.regen_hours())})",
        communication_line(load_target_info(plan.target).text_config, plan.profile, plan.gpus),
        *slice_lines(plan),
        f"  recommendation: {plan.recommendation}",
        f"  data/epochs:   {data_epochs_line()}",
    ])


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--target", required=True, help="target model directory (config.json is enough)")
    parser.add_argument("--profile", required=True, help="profile name (eagle3-train/profiles/) or JSON path")
    parser.add_argument("--work", required=True, help="the run's work directory (WORK/data is stage 01's output)")
    parser.add_argument("--rows", type=int, help="rows of a run not prepared yet")
    parser.add_argument("--tokens-per-row", type=int, help="average tokens per row of a run not prepared yet")
    parser.add_argument("--train-tokens-per-s", type=float, help="training tokens/s per GPU on this box (bench/train_throughput.py)")
    parser.add_argument("--disk-read-gb-s", type=float, help="the disk's cold read rate, if known")
    parser.add_argument("--extract-tokens-per-s", type=float, help="stage 02's tokens/s on this box, if known "
                        "(default: the rate a stage 02 in WORK/data recorded, e.g. a 10-sample run)")
    parser.add_argument("--decode-tokens-per-s", type=float, help="the target's decode tokens/s on this box (answer regeneration)")
    parser.add_argument("--answer-tokens-per-row", type=int, help="answer tokens per row that regeneration generates "
                        "(default: stage 01's loss tokens, else half of --tokens-per-row)")
    parser.add_argument("--free-disk-gb", type=float, help="the free disk to plan for, in GB (default: measured at WORK/data)")
    parser.add_argument("--disk-write-gb-s", type=float, help="the data disk's durable write rate in GB/s (python -m "
                        "eagle3_pipeline.disk_writes --dir WORK/data measures it): extraction is bound by the slower of "
                        "the prefill and these writes")
    parser.add_argument("--extract-disk-fraction", type=fraction, help="the fraction of --disk-write-gb-s that stage "
                        "02 reaches where the disk governs, both formats (default: the ratio_to_bound per format measured "
                        "at Kimi-K2.5's width, bench/results/h200-extraction-kimi-width-writeback-ab.json)")
    parser.add_argument("--slice-rows", type=int, help="the slice size to plan (run_all.sh --slice-rows; default: the "
                        "largest whose states fit the free disk)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        plan = make_plan(args.target, args.profile, args.work, args.rows, args.tokens_per_row, args.train_tokens_per_s,
                         args.disk_read_gb_s, args.extract_tokens_per_s, decode_tokens_per_s=args.decode_tokens_per_s,
                         answer_tokens_per_row=args.answer_tokens_per_row, free_disk_gb=args.free_disk_gb,
                         slice_rows=args.slice_rows, disk_write_gb_s=args.disk_write_gb_s,
                         extract_disk_fraction=args.extract_disk_fraction)
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
