"""Sliced runs: extract and train a run larger than the disk, one slice of the prepared rows at a time.

The validation rows are speculators' own split of the whole prepared dataset (the last
`1 - train_data_ratio` of the rows, exactly the rows an unsliced run validates on); the training rows
before them are cut into slices of `slice_rows`. Every slice's hidden states are its training rows
plus the validation rows, so every slice validates on the same rows and `checkpoint_best` compares
like with like. Run position g = epoch * num_slices + slice (0-based) is one speculators "epoch": stage
04 trains run position g as speculators epoch g of a run of `num_slices * epochs` epochs, resumed
from checkpoint g-1 by speculators itself (one optimizer state, one lr schedule whose length is the
sum of every run position's optimizer steps, passed as --scheduler-total-steps). Epochs > 1
re-extract every slice (each pass over the data costs its extraction again; the plan says how much).

Per run position (run_all.sh --slice-rows N drives it; each step is resumable on its own):
  02 --rows SPEC        extracts the position's rows; first deletes the files of rows outside SPEC
                        that its own manifest (or a kept record) lists
  04 --slice-rows N --slice-index g   trains on them through a view (OUTPUT/slice_data: the rows'
                        dataset and hidden_states/ symlinks, renumbered), continuing the run
  python -m eagle3_pipeline.slices release   deletes the position's files the next one does not need, once
                        04's manifest records training on exactly them (slices_trained), keeping stage 02's
                        manifest (with its fingerprints) as DATA/hidden_states/slices/*.json
The schedule (`slices schedule`) is what 04's manifest says was trained: a work dir whose 04 trained otherwise
(unsliced, another slice size, epochs or input) is refused in one line naming the field, before anything runs.
So the disk holds one slice's states (+ the files in flight) at any time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from .checkpoints import complete, read_state
from .config.resolution import resolve_stage_config
from .config.schema import TrainConfig
from .contract import manifest_path, read_manifest, write_manifest
from .errors import ConfigError, ContractError, StageError
from .files import FINGERPRINTS_NAME, atomic_write_json, remove_path
from .hidden_states import FILE_GLOB, HS_DIRNAME, hs_file, hs_files, row_of
from .manifest import SCHEMA_VERSION, ExtractManifest, PrepareManifest, SliceRecord, TrainManifest
from .prepared import load_prepared
from .stage import first_difference, read_own_manifest

# Local imports: speculators (its packing sampler: torch), only where a schedule is counted.

VIEW_DIRNAME = "slice_data"  # under stage 04's output: the dataset speculators reads for one run position
RECORDS_DIRNAME = "slices"  # under DATA/hidden_states: stage 02's manifests of the released slices


# --- row selections ("A:B,C:D", end exclusive) -----------------------------------------------------------

def parse_rows(spec: str, total: int) -> list[int]:
    """The row indices of a selection such as "0:3,9:10" (half-open ranges, in order, inside [0, total))."""
    rows: list[int] = []
    for part in filter(None, (p.strip() for p in str(spec).split(","))):
        start, sep, stop = part.partition(":")
        if not sep or not start.strip().isdigit() or not stop.strip().isdigit():
            raise ConfigError(f"--rows {spec!r}: expected ranges START:END (end exclusive), e.g. 0:1000,90000:100000")
        a, b = int(start), int(stop)
        if not 0 <= a < b <= total or (rows and a < rows[-1] + 1):
            raise ConfigError(f"--rows {spec!r}: range {part} must be ascending, non-empty and inside the {total} "
                              f"prepared rows")
        rows.extend(range(a, b))
    if not rows:
        raise ConfigError(f"--rows {spec!r}: selects no row")
    return rows


def rows_spec(ranges: list[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges if b > a)


# --- the plan of a sliced run --------------------------------------------------------------------------

@dataclass(frozen=True)
class SlicePlan:
    rows: int  # stage 01's rows
    val_start: int  # first validation row (speculators' split of the whole dataset)
    slice_rows: int
    epochs: int

    @property
    def num_slices(self) -> int:
        return math.ceil(self.val_start / self.slice_rows)

    @property
    def positions(self) -> int:
        """Run positions (speculators epochs): every slice once per epoch."""
        return self.num_slices * self.epochs

    def train_range(self, position: int) -> tuple[int, int]:
        k = position % self.num_slices
        return k * self.slice_rows, min((k + 1) * self.slice_rows, self.val_start)

    def selection(self, position: int) -> str:
        """Stage 02's --rows of a run position: its training rows, then the validation rows."""
        return rows_spec([self.train_range(position), (self.val_start, self.rows)])

    def train_data_ratio(self, position: int) -> float:
        """speculators' split of the view that puts exactly the training rows first: int(len * ratio) == n."""
        a, b = self.train_range(position)
        n, total = b - a, b - a + self.rows - self.val_start
        return (n + 0.5) / total

    def record(self) -> dict:
        return {"slice_rows": self.slice_rows, "rows": self.rows, "val_start": self.val_start, "epochs": self.epochs,
                "num_slices": self.num_slices, "positions": self.positions}


def make_plan(rows: int, train_data_ratio: float, slice_rows: int, epochs: int) -> SlicePlan:
    val_start = int(rows * train_data_ratio)  # speculators' ArrowDataset split of the unsliced dataset
    if not 0 < val_start < rows:
        raise ConfigError(f"{rows} prepared rows with train_data_ratio {train_data_ratio} leave no training or no "
                          f"validation rows to slice")
    if slice_rows < 1:
        raise ConfigError(f"--slice-rows {slice_rows}: must be at least 1")
    return SlicePlan(rows=rows, val_start=val_start, slice_rows=min(slice_rows, val_start), epochs=epochs)


def planned_steps(seq_lens: list[int], plan: SlicePlan, total_seq_len: int, world_size: int, seed: int) -> list[int]:
    """Optimizer steps of every run position, counted by speculators' own packing sampler (the one its
    train loader uses, with the epoch's seed) over the position's training rows: their sum is the lr
    schedule's length."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    steps = []
    for g in range(plan.positions):
        a, b = plan.train_range(g)
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=seq_lens[a:b],
                                                     num_replicas=world_size, rank=0, seed=seed)
        sampler.set_epoch(g)
        steps.append(len(sampler))
    return steps


# --- stage 04's view of one run position -----------------------------------------------------------------

def build_view(data_dir: Path, hs_dir: Path, view: Path, rows: list[int]) -> Path:
    """OUTPUT/slice_data: the selected rows as a dataset (speculators' layout) and, as row j's file, a
    symlink to stage 02's file of row rows[j] (no copy). Rebuilt whole each time (temp + rename)."""

    view = Path(view)
    tmp = view.with_name(f".{view.name}.tmp")
    remove_path(tmp)
    load_prepared(data_dir).select(rows).save_to_disk(str(tmp))
    (tmp / HS_DIRNAME).mkdir()
    for j, row in enumerate(rows):
        hs_file(tmp / HS_DIRNAME, j).symlink_to(hs_file(Path(hs_dir).resolve(), row))
    remove_path(view)
    tmp.rename(view)
    return view


def sliced_argv(argv: list[str], view: Path, position: int, ratio: float, total_steps: int) -> list[str]:
    """speculators' flags for one run position: the view's data, the run so far + this position as its
    epochs, and one lr schedule over the whole sliced run (warmup 1% of it, speculators' default)."""
    argv = list(argv)
    for flag, value in (("--data-path", str(view)), ("--epochs", str(position + 1)), ("--train-data-ratio", repr(ratio))):
        argv[argv.index(flag) + 1] = value
    return argv + ["--scheduler-total-steps", str(total_steps), "--scheduler-warmup-steps", str(total_steps // 100)]


def check_position(cfg, prepared: PrepareManifest, extracted: ExtractManifest) -> tuple[SlicePlan, int]:
    """Stage 04 in a sliced run: the plan, and the run position it trains now, whose rows stage 02 must hold."""

    if cfg.hidden_states != "files":
        raise ConfigError("--slice-rows slices stage 02's files; --hidden-states online/hybrid needs no slices")
    if cfg.slice_index is None:
        raise ConfigError("--slice-rows needs --slice-index (the run position; run_all.sh --slice-rows passes both)")
    if cfg.checkpoint_freq > 1 or cfg.max_steps is not None:
        raise ConfigError("--slice-rows: every run position ends in a checkpoint the next one resumes from; drop "
                          "--checkpoint-freq > 1 / --max-steps")
    plan = make_plan(prepared.counts.rows, prepared.train_data_ratio, cfg.slice_rows, cfg.epochs)
    g = cfg.slice_index
    if g >= plan.positions:
        raise ConfigError(f"--slice-index {g}: this run has {plan.positions} run positions ({plan.num_slices} slices x "
                          f"{plan.epochs} epochs)")
    where = Path(cfg.data) / HS_DIRNAME / "manifest.json"
    if extracted.selection != plan.selection(g):  # files only (checked above): stage 02's manifest is there
        raise ContractError(f"{where}: holds rows {extracted.selection or 'all'}, run position {g} trains on "
                            f"rows {plan.selection(g)}; run 02_extract_hidden_states.py --rows {plan.selection(g)} first")
    return plan, g


def run_identity(position: tuple[SlicePlan, int], prepared: PrepareManifest, identity_inputs: dict, out_dir: Path
                 ) -> tuple[dict, dict, dict]:
    """Stage 04's identity in a sliced run: the slices are the run's input one after another, so it is the plan
    over stage 01's rows (02's content is recorded per position instead). Returns the identity's inputs, its extra
    fields, and the manifest's slicing fields so far (the positions before this one)."""
    plan, g = position
    inputs = {name: sha for name, sha in identity_inputs.items() if name != "extract"}
    trained = [r for r in getattr(read_own_manifest(out_dir), "slices_trained", None) or [] if r["position"] < g]
    return inputs, {"slicing": plan.record()}, {"slicing": {**plan.record(), "prepare": prepared.content_sha256},
                                                  "slices_trained": trained}


def already_trained(out_dir: Path, position: tuple[SlicePlan, int], replace: bool) -> bool:
    """Whether this run position finished training; refuses one whose predecessor has not."""
    plan, g = position
    newest = trained_through(out_dir) if not replace else -1
    if newest < g - 1:
        raise ContractError(f"{out_dir}: run position {g - 1} is not trained yet (newest checkpoint: "
                            f"{newest if newest >= 0 else 'none'}); run the positions in order (run_all.sh "
                            f"--slice-rows resumes at the right one)")
    return newest >= g


def position_argv(cfg, position: tuple[SlicePlan, int], spec_argv: list[str], out_dir: Path,
                  build: bool = True) -> tuple[list[str], list[int]]:
    """speculators' flags for this run position (its rows' view in `out_dir`, its epoch in the run, one lr schedule
    over every position) and every position's optimizer steps. `build`: False on a node other than node 0, which
    alone writes the shared --output (eagle3_pipeline/nodes.py): its ranks read node 0's view, built before they start."""
    plan, g = position
    steps = planned_steps(list(load_prepared(cfg.data).with_format(None)["seq_len"]), plan, cfg.total_seq_len,
                          cfg.nproc * cfg.nnodes, cfg.seed)
    view = out_dir / VIEW_DIRNAME
    if build:
        build_view(Path(cfg.data), Path(cfg.data) / HS_DIRNAME, view, parse_rows(plan.selection(g), plan.rows))
    return sliced_argv(spec_argv, view, g, plan.train_data_ratio(g), sum(steps)), steps


def position_record(g: int, plan: SlicePlan, extracted: ExtractManifest, steps: int) -> dict:
    """What a run position trained on (stage 04's manifest lists one per position: the record once its files are gone)."""
    return {"position": g, "epoch": g // plan.num_slices, "slice": g % plan.num_slices, "rows": plan.selection(g),
            "optimizer_steps": steps, "extract": {"content_sha256": extracted.content_sha256,
                                                  "fingerprints": extracted.fingerprints}}


# --- deleting a trained slice's states (stage 02's own files only) -------------------------------------

def read_slice_record(path: Path) -> SliceRecord:
    """A kept slice record (DATA/hidden_states/slices/*.json), checked: a truncated or foreign file is one line
    naming it. Never skipped: the rows it lists are files stage 02 wrote, which only it says may be deleted."""
    try:
        data = json.loads(Path(path).read_bytes())
        record = SliceRecord.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        reason = f"field {'.'.join(str(part) for part in error['loc']) or '(top level)'}: {error['msg'].lower()}"
    except (OSError, ValueError) as exc:  # truncated: not JSON
        reason = f"unreadable: {str(exc)[:80]}"
    else:
        if record.schema_version != SCHEMA_VERSION:
            reason = f"schema version {record.schema_version}, this version reads {SCHEMA_VERSION}"
        elif not record.selection or not record.rows_total:
            reason = "no selection (a slice's rows) or rows_total"
        else:
            return record
    raise ContractError(f"{path}: not a slice record stage 02 kept ({reason}); restore it, or move it away (its "
                        f"rows' hidden-state files are then never deleted by a release: delete them yourself)")


def owned_rows(hs_dir: Path) -> dict[int, str]:
    """Rows whose file stage 02 says it wrote (row -> the record that says so): its manifest's selection, its
    fingerprints, and every kept slice record (read_slice_record: a bad one is refused, never skipped)."""

    hs_dir = Path(hs_dir)
    owned: dict[int, str] = {}

    def own(rows, source: Path) -> None:
        for row in rows:
            owned.setdefault(row, str(source))

    def named(names) -> list[int]:  # row 0 included
        return [row for row in map(row_of, names) if row is not None]

    def selected(record) -> list[int]:
        return parse_rows(record.selection, record.rows_total) if record.selection and record.rows_total else []

    try:
        manifest = read_own_manifest(hs_dir)
    except ContractError:
        manifest = None
    if isinstance(manifest, ExtractManifest):
        own(selected(manifest), manifest_path(hs_dir))
    try:
        fingerprinted = json.loads((hs_dir / FINGERPRINTS_NAME).read_text())
    except (OSError, ValueError):
        fingerprinted = {}
    own(named(fingerprinted), hs_dir / FINGERPRINTS_NAME)
    for path in sorted((hs_dir / RECORDS_DIRNAME).glob("*.json")):
        record = read_slice_record(path)
        own(named(record.fingerprint_files or {}), path)
        own(selected(record), path)
    return owned


def files_past_rows(hs_dir: Path, rows_total: int) -> tuple[list[Path], list[Path]]:
    """Row files at or past stage 01's `rows_total` rows (01 was redone on fewer rows since): (those a record of stage
    02 lists as written by it, owned_rows: a rerun deletes them; the others: kept, never deleted by their name alone)."""
    past = [path for path in hs_files(hs_dir) if (row := row_of(path.name)) is not None and row >= rows_total]
    owned = owned_rows(hs_dir) if past else {}
    return [p for p in past if row_of(p.name) in owned], [p for p in past if row_of(p.name) not in owned]


def require_trained(hs_dir: Path, ckpt_dir: Path, doomed: list[int]) -> None:
    """A release deletes states only once this run's stage 04 recorded training on exactly them: stage 02's slice
    (its rows and content) is one of 04's `slices_trained`, and every file to go lies in a trained position's rows.
    Anything else (an unsliced extraction, a slice 04 never recorded, another run's) is refused, nothing deleted."""

    if not doomed:
        return
    trained = read_own_manifest(ckpt_dir)
    sliced = isinstance(trained, TrainManifest) and trained.slicing
    records = (trained.slices_trained or []) if sliced else []
    where = manifest_path(ckpt_dir)
    extracted = read_own_manifest(hs_dir)
    if isinstance(extracted, ExtractManifest) and extracted.complete and not any(
            r.get("rows") == extracted.selection and (r.get("extract") or {}).get("content_sha256") ==
            extracted.content_sha256 for r in records):
        raise ContractError(f"{manifest_path(hs_dir)}: its states (rows {extracted.selection or 'all'}) are not what "
                            f"{where} records as trained (slices_trained); nothing deleted (a release deletes only "
                            f"states this run's stage 04 trained on)")
    covered = {row for r in records for row in parse_rows(r["rows"], sys.maxsize) if r.get("rows")}
    if missing := [row for row in doomed if row not in covered]:
        raise ContractError(f"{hs_file(hs_dir, missing[0])}: row {missing[0]}'s states ({len(missing)} file(s) in all) "
                            f"are not in a run position {where} records as trained; nothing deleted")


def release(hs_dir: Path, keep: set[int], trained_in: Path | None = None) -> list[int]:
    """Delete the hidden-state files of the rows not in `keep` that stage 02 wrote, after keeping its manifest
    (with the fingerprints of every file: what was trained) in DATA/hidden_states/slices/. `trained_in`: stage
    04's output, whose manifest must record training on exactly those states (require_trained; the driver's
    release). Idempotent: a kill at any point leaves a state a rerun finishes."""

    hs_dir = Path(hs_dir)
    manifest = read_own_manifest(hs_dir)
    if trained_in is not None:
        require_trained(hs_dir, Path(trained_in), [row for row in sorted(owned_rows(hs_dir))
                                                   if row not in keep and hs_file(hs_dir, row).is_file()])
    if manifest is not None and manifest.complete and manifest.selection:
        try:
            fingerprinted = json.loads((hs_dir / FINGERPRINTS_NAME).read_text())
        except (OSError, ValueError):
            fingerprinted = None
        record = SliceRecord(**manifest.model_dump(exclude_none=True), fingerprint_files=fingerprinted)
        name = manifest.selection.replace(":", "-").replace(",", "_")
        atomic_write_json(hs_dir / RECORDS_DIRNAME / f"{manifest.created or ''}_{name}.json".replace(":", ""),
                          record.model_dump(mode="json", exclude_none=True))
    deleted = []
    for row in sorted(owned_rows(hs_dir)):
        if row not in keep and hs_file(hs_dir, row).is_file():
            hs_file(hs_dir, row).unlink(missing_ok=True)  # data-parallel ranks release side by side
            deleted.append(row)
    if manifest is not None and deleted:  # the files it describes are gone: never a finished extraction again
        write_manifest(hs_dir, read_own_manifest(hs_dir).model_copy(update={"complete": False, "released": True}),
                       fresh=False)
    return deleted


def hidden_state_bytes(hs_dir: Path) -> int:
    """Bytes of the hidden-state files there now (landed and in flight)."""
    return sum(p.stat().st_size for p in Path(hs_dir).glob(f"*{FILE_GLOB}*") if p.is_file())


# --- the driver's helpers (run_all.sh --slice-rows) ------------------------------------------------------

def resolve(argv: list[str]) -> tuple[SlicePlan, dict, object]:
    """The plan of a sliced run from stage 04's own flags, checked against what stage 04's manifest says was trained
    (sliced or not, slice size, epochs, rows, input): any difference is refused with one line naming the field, before
    anything is extracted or deleted."""

    cfg, _ = resolve_stage_config(TrainConfig, argv)
    if cfg.slice_rows is None:
        raise ConfigError("--slice-rows is needed for a sliced run")
    prepared = read_manifest(cfg.data, "prepare", "--data")
    plan = make_plan(prepared.counts.rows, prepared.train_data_ratio, cfg.slice_rows, cfg.epochs)
    trained = read_own_manifest(Path(cfg.output))
    if trained is None:
        return plan, prepared, cfg
    where = manifest_path(cfg.output)
    fresh = "choose a fresh --work (a slice size, epochs or input cannot change mid-run)"
    if not isinstance(trained, TrainManifest):
        raise ContractError(f"{where}: holds stage {trained.stage!r}'s output, not a training run; {fresh}")
    recorded = trained.slicing
    if not recorded:
        done = f"a finished unsliced training run ({len(trained.epochs or [])} epoch(s))" if trained.complete else \
            "an unfinished unsliced training run"
        raise ContractError(f"{where}: holds {done}, not a sliced one; --slice-rows {cfg.slice_rows} cannot continue "
                            f"it: rerun without --slice-rows, or choose a fresh --work")
    if recorded.get("prepare") != prepared.content_sha256:
        raise ContractError(f"{where}: this sliced run was planned over another input: prepare (stage 01's output "
                            f"in {cfg.data}) changed since; rerun 01 as it was, or {fresh}")
    now = plan.record()
    for field in ("slice_rows", "epochs", *now):
        if (diff := first_difference(recorded.get(field), now[field])) is not None:
            raise ContractError(f"{where}: this sliced run was planned with {field} = {json.dumps(diff[1])}, "
                                f"{json.dumps(diff[2])} in this run; rerun with the old value, or {fresh}")
    for record in trained.slices_trained or []:
        g = record.get("position")
        planned = plan.selection(g) if isinstance(g, int) and 0 <= g < plan.positions else "none (no such position)"
        if record.get("rows") != planned:
            raise ContractError(f"{where}: slices_trained records run position {g} on rows {record.get('rows')}, "
                                f"this run's position {g} has rows {planned}; {fresh}")
    return plan, prepared, cfg


def trained_through(out_dir: Path) -> int:
    """The last run position whose training finished (-1: none): its complete checkpoint saved at the epoch's end. A
    mid-epoch checkpoint (--checkpoint-freq < 1) of a position is where speculators resumes that position, not its end."""

    ends = [int(p.name) for p in complete(out_dir) if not (read_state(p) or {}).get("local_step")]
    return max(ends, default=-1)


def trained_positions(plan: SlicePlan, out_dir: Path) -> list[bool]:
    """Which run positions need nothing but their release: stage 04's manifest records training on them
    (`slices_trained`, checked against the plan by resolve; the last one also needs the manifest complete: the report
    is written after its record). A checkpoint alone is not a record: 04 reruns that position, finds it trained and
    records it."""

    manifest = read_own_manifest(out_dir)
    recorded = {r.get("position") for r in getattr(manifest, "slices_trained", None) or []}
    finished = bool(getattr(manifest, "complete", False))
    last = plan.positions - 1
    return [g in recorded and (g < last or finished) for g in range(plan.positions)]


def recorded_position(out_dir: Path, position: int) -> bool:
    """Whether stage 04's manifest in `out_dir` already records run position `position` as trained."""
    return any(r.get("position") == position for r in getattr(read_own_manifest(out_dir), "slices_trained", None) or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="sliced runs (run_all.sh --slice-rows): the schedule, and deleting "
                                                 "a trained slice's hidden states")
    sub = parser.add_subparsers(dest="command", required=True)
    schedule = sub.add_parser("schedule", help="one line per run position: POSITION ROWS (stage 02's --rows) "
                                               "trained|todo; refuses a run that differs from what stage 04's "
                                               "manifest recorded; the rest are stage 04's flags")
    schedule.add_argument("train_args", nargs=argparse.REMAINDER)
    rel = sub.add_parser("release", help="delete stage 02's files of the rows not in --keep (its manifest is kept), "
                                         "only those stage 04's manifest in --checkpoints records as trained")
    rel.add_argument("--data", required=True, help="stage 01's output (its hidden_states/)")
    rel.add_argument("--keep", default="", help="rows to keep (stage 02's --rows of the next position), or none")
    rel.add_argument("--checkpoints", required=True, help="stage 04's output (its manifest's slices_trained)")
    args = parser.parse_args(argv)
    try:
        if args.command == "schedule":
            plan, _, cfg = resolve([a for a in args.train_args if a != "--"])
            for g, done in enumerate(trained_positions(plan, Path(cfg.output))):
                print(g, plan.selection(g), "trained" if done else "todo")
            return 0

        hs_dir = Path(args.data) / HS_DIRNAME
        rows_total = read_manifest(args.data, "prepare", "--data").counts.rows
        keep = set(parse_rows(args.keep, rows_total)) if args.keep else set()
        deleted = release(hs_dir, keep, trained_in=Path(args.checkpoints))
        print(f"released {len(deleted)} hidden-state file(s) in {hs_dir} (stage 02's manifest kept in "
              f"{hs_dir / RECORDS_DIRNAME})")
        return 0
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
