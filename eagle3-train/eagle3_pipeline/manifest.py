"""The manifests' schema: one pydantic model per stage, the only way a manifest is written or read.

Every fact is one field, written once. `content()` is the part downstream stages depend on (what
`content_sha256` hashes with the identity); it is derived from the fields, never stored beside them,
so a key cannot be written twice. Unknown keys are refused (`extra="forbid"`): a field a stage writes
must be declared here. Reading a file checks it against its stage's model; a mismatch is one line
naming the file and the field (`parse_manifest`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from .errors import ContractError

# 2: one home per fact (the `content` key is derived, not stored; 02/03's repeated keys dropped). A manifest
# of another version is refused in one line (rerun the stage that wrote it); none was ever released.
SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"

# Stage names, in pipeline order, and the script that writes each.
STAGES = {
    "prepare": "01_prepare_dataset.py",
    "extract": "02_extract_hidden_states.py",
    "vocab": "03_build_vocab_mapping.py",
    "train": "04_train.py",
    "export": "05_export.py",
    "evaluate": "06_evaluate.py",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Manifest(_Strict):
    """What every stage records. Provenance (`created`, `command`, `git_commit`, `versions`) is filled in by
    contract.write_manifest; `identity` (stage.py) decides whether a rerun is finished."""

    stage: str
    schema_version: int = SCHEMA_VERSION
    complete: bool = True
    created: str | None = None
    command: list[str] | None = None
    git_commit: str | None = None
    versions: dict[str, str] | None = None
    identity: dict[str, Any] | None = None
    content_sha256: str | None = None
    inputs: dict[str, Any] | None = None  # upstream name -> contract.input_record (05: also the checkpoint path)
    config: dict[str, Any] | None = None
    config_sha256: str | None = None
    target: dict[str, Any] | None = None  # target.TargetInfo.summary()
    synthetic: bool | None = None  # bench/benchlib/throughput.py's manifests for plain speculators' data
    # The files the stage wrote, by their bytes when it finished: name (relative to the directory) -> [size, digest]
    # (files.output_record). stage.finished and run_all --status check them; absent in manifests written before
    # (those are checked by the files' presence only). Not in content(): downstream identities do not change.
    output_files: dict[str, list[int | str]] | None = None
    _path: Path | None = PrivateAttr(default=None)
    _sha256: str | None = PrivateAttr(default=None)
    # Fields later stages read that the identity's settings record too (content_sha256 covers the identity, not
    # them): contract.read_manifest refuses a manifest where the two disagree (one was edited by hand).
    SETTINGS_ALSO_IN_IDENTITY: ClassVar[tuple[str, ...]] = ()

    def edited_setting(self) -> tuple[str, Any, Any] | None:
        """(field, its value, the identity's) for the first field of SETTINGS_ALSO_IN_IDENTITY that disagrees."""
        settings = (self.identity or {}).get("settings") or {}
        for name in self.SETTINGS_ALSO_IN_IDENTITY:
            if name in settings and getattr(self, name) != settings[name]:
                return name, getattr(self, name), settings[name]
        return None

    @property
    def path(self) -> Path:
        """The file it was read from (or last written to)."""
        return self._path

    @property
    def directory(self) -> Path:
        return self._path.parent

    @property
    def sha256(self) -> str | None:
        """The file's bytes (recorded for people; stages compare `content_sha256`)."""
        return self._sha256

    def content(self) -> BaseModel | None:
        """What downstream stages depend on; None while the stage has not finished its outputs."""
        return None

    def did_nothing(self) -> str | None:
        """Why this manifest must not say complete (its run did no work), or None; contract.write_manifest asks."""
        return None

    def content_dict(self) -> dict:
        content = self.content()
        return {} if content is None else content.model_dump(mode="json", exclude_none=True)


# --- 01 prepare -------------------------------------------------------------------------------------------

class PrepareCounts(_Strict):
    rows: int
    tokens: int
    train_rows: int | None = None
    val_rows: int | None = None
    loss_tokens: int | None = None
    max_row_tokens: int | None = None
    input_rows: int | None = None
    conversations: int | None = None
    pretokenized_rows: int | None = None
    rejected_rows: int | None = None
    dropped_too_long: int | None = None
    truncated_too_long: int | None = None


class PrepareContent(_Strict):
    counts: PrepareCounts
    max_seq_len: int | None
    train_data_ratio: float


class PrepareManifest(Manifest):
    stage: Literal["prepare"] = "prepare"
    SETTINGS_ALSO_IN_IDENTITY: ClassVar[tuple[str, ...]] = ("max_seq_len",)
    counts: PrepareCounts | None = None
    train_data_ratio: float | None = None
    max_seq_len: int | None = None
    # an unfinished run: the files it was installing (and the earlier run's it replaces): what a rerun may delete
    outputs: list[str] | None = None

    def content(self) -> PrepareContent | None:
        if self.counts is None or self.train_data_ratio is None:
            return None
        return PrepareContent(counts=self.counts, max_seq_len=self.max_seq_len, train_data_ratio=self.train_data_ratio)


# --- 02 extract -------------------------------------------------------------------------------------------

class ExtractCounts(_Strict):
    rows: int  # the whole run's (every rank's)
    tokens: int
    # --world-size > 1: "rank R of N", the rank that wrote the manifest (the last to finish); every count below (rows
    # and tokens aside) is that rank's alone: the others' are in their logs (issue 64: said as the whole run's before)
    counts_of: str | None = None
    rows_this_rank: int | None = None
    skipped_done: int | None = None
    stale_removed: int | None = None
    extract_s: float | None = None
    extracted_tokens: int | None = None
    extract_tokens_per_s: float | None = None
    sync_s: float | None = None
    # wall clock (Unix seconds) when the extraction began: lines extract_s up with the disk's own counters
    # (bench/benchlib/disk_timeline.py)
    extract_started_at: float | None = None
    # rows by how they were landed (extract.common.land_sample): header, read_back, quantized_here, tensors
    landed: dict[str, int] | None = None


class ExtractContent(_Strict):
    rows: int
    tokens: int
    dtype: str
    storage: str
    selection: str | None = None
    shapes: dict[str, list[int | str]] | None = None


class ExtractManifest(Manifest):
    stage: Literal["extract"] = "extract"
    SETTINGS_ALSO_IN_IDENTITY: ClassVar[tuple[str, ...]] = ("dtype", "layer_ids", "storage", "target_config_sha256")
    layer_ids: list[int] | None = None
    dtype: str | None = None  # the states' dtype (hidden_states.StateFormat.from_manifest)
    storage: str | None = None  # "dtype" or "fp8"
    selection: str | None = None  # --rows: one slice of a sliced run (slices.py)
    rows_total: int | None = None  # stage 01's rows
    target_config_sha256: str | None = None
    backend: str | None = None
    fingerprints: dict[str, Any] | None = None  # files.write_fingerprints' record
    shapes: dict[str, list[int | str]] | None = None
    counts: ExtractCounts | None = None
    released: bool | None = None  # slices.release deleted files it describes: never finished again

    def content(self) -> ExtractContent | None:
        if self.counts is None or self.dtype is None or self.storage is None:
            return None
        return ExtractContent(rows=self.counts.rows, tokens=self.counts.tokens, dtype=self.dtype, storage=self.storage,
                              selection=self.selection, shapes=self.shapes)


# --- 03 vocab ---------------------------------------------------------------------------------------------

class VocabCoverage(_Strict):
    """coverage.json less the vocab sizes (the manifest's own fields)."""
    draft_vocab_size_source: str
    distinct_train_tokens: int
    train_coverage: float
    val_coverage: float


class VocabContent(_Strict):
    draft_vocab_size: int
    target_vocab_size: int
    shapes: dict[str, list[int]] | None = None
    coverage: VocabCoverage | None = None


class VocabManifest(Manifest):
    stage: Literal["vocab"] = "vocab"
    SETTINGS_ALSO_IN_IDENTITY: ClassVar[tuple[str, ...]] = ("draft_vocab_size",)
    outputs: list[str] | None = None
    draft_vocab_size: int | None = None
    target_vocab_size: int | None = None
    shapes: dict[str, list[int]] | None = None
    coverage: VocabCoverage | None = None

    def content(self) -> VocabContent | None:
        if self.draft_vocab_size is None or self.target_vocab_size is None:
            return None
        return VocabContent(draft_vocab_size=self.draft_vocab_size, target_vocab_size=self.target_vocab_size,
                            shapes=self.shapes, coverage=self.coverage)


# --- 04 train ---------------------------------------------------------------------------------------------

class CheckpointRef(_Strict):
    """A checkpoint by its weights' bytes (checkpoints.checkpoint_content)."""
    name: str
    model_sha256: str


class TrainContent(_Strict):
    best_checkpoint: CheckpointRef
    epochs: list[str]


class TrainManifest(Manifest):
    stage: Literal["train"] = "train"
    outputs: list[str] | None = None  # what --overwrite may delete (checkpoints.own_outputs)
    draft_config: dict[str, Any] | None = None
    speculator_type: str | None = None  # the draft kind trained (draft_kinds.py); None: a run before kinds, eagle3
    mask_token_id: int | None = None  # the --mask-token-id passed
    aux_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = None
    best_checkpoint: CheckpointRef | None = None
    epochs: list[str] | None = None
    summary: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    compat_applied: list[str] | None = None
    hidden_states: dict[str, Any] | None = None
    bad_samples: dict[str, Any] | None = None
    trained: dict[str, int] | None = None  # {"optimizer_steps", "samples"}: compat/samples_record.trained
    slicing: dict[str, Any] | None = None  # slices.run_identity
    slices_trained: list[dict[str, Any]] | None = None

    def content(self) -> TrainContent | None:
        if self.best_checkpoint is None or self.epochs is None:
            return None
        return TrainContent(best_checkpoint=self.best_checkpoint, epochs=self.epochs)

    def did_nothing(self) -> str | None:
        steps, samples = ((self.trained or {}).get(k, 0) for k in ("optimizer_steps", "samples"))
        if self.complete and not (steps and samples):
            return f"{steps} optimizer step(s) on {samples} trained sample(s)"
        return None


# --- 05 export --------------------------------------------------------------------------------------------

class ExportContent(_Strict):
    checkpoint: str


class ExportManifest(Manifest):
    stage: Literal["export"] = "export"
    SETTINGS_ALSO_IN_IDENTITY: ClassVar[tuple[str, ...]] = ("num_speculative_tokens", "verifier_name")
    verifier_name: str | None = None
    checkpoint: str | None = None
    num_speculative_tokens: int | None = None
    verified: dict[str, Any] | None = None
    serve_command: str | None = None
    layout: str | None = None  # "speculators" or "sglang" (05 --layout; None: written before the flag, speculators)
    # The model card (model_card.py): {"name": "README.md", "written": [size, digest] as 05 wrote it}. Listed here,
    # outside output_files: 06 rewrites its measured section and users edit it, neither a reason to redo the export.
    card: dict[str, Any] | None = None

    def content(self) -> ExportContent | None:
        return None if self.checkpoint is None else ExportContent(checkpoint=self.checkpoint)


# --- 06 evaluate ------------------------------------------------------------------------------------------

class EvaluateContent(_Strict):
    num_speculative_tokens: int
    mean_acceptance_length: float
    passed: bool


class EvaluateManifest(Manifest):
    stage: Literal["evaluate"] = "evaluate"
    draft: str | None = None  # the export measured (resolved path; by content in inputs/identity)
    num_speculative_tokens: int | None = None
    tensor_parallel_size: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # what rendered the prompts
    prompts: int | None = None
    mean_acceptance_length: float | None = None
    mean_acceptance_length_stderr: float | None = None
    verdict: dict[str, Any] | None = None  # eval_checks.verdict: passed, line, the self-checks' findings
    # Manifests written before 06 kept the one record of written files (`output_files`) held their files here: read
    # (eval_report.already_evaluated), never written now.
    outputs: list[str] | None = None
    output_sha256: dict[str, str] | None = None

    def content(self) -> EvaluateContent | None:
        if self.num_speculative_tokens is None or self.mean_acceptance_length is None or self.verdict is None:
            return None
        return EvaluateContent(num_speculative_tokens=self.num_speculative_tokens,
                               mean_acceptance_length=self.mean_acceptance_length, passed=bool(self.verdict["passed"]))


class SliceRecord(ExtractManifest):
    """A released slice's record in DATA/hidden_states/slices/ (slices.release): that slice's stage-02 manifest
    with the fingerprints of the files it wrote (files.write_fingerprints: name -> [size, fingerprint, mtime_ns]),
    so slices.owned_rows still knows which rows stage 02 wrote once the slice's own manifest is replaced."""

    fingerprint_files: dict[str, list[Any]] | None = None


MODELS: dict[str, type[Manifest]] = {
    "prepare": PrepareManifest, "extract": ExtractManifest, "vocab": VocabManifest,
    "train": TrainManifest, "export": ExportManifest, "evaluate": EvaluateManifest,
}


def parse_manifest(path: Path, hint: str | None = None) -> Manifest:
    """The manifest file at `path`, checked against its stage's model. Every problem is one ContractError line
    naming the file (and the field), ending in `hint` (default: rerun the stage that wrote it)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ContractError(f"{path}: unreadable manifest ({str(exc)[:80]}); {hint or 'rerun the stage that wrote it'}") from None
    if not isinstance(data, dict):
        raise ContractError(f"{path}: unreadable manifest (not a JSON object); {hint or 'rerun the stage that wrote it'}")
    stage = data.get("stage")
    model = MODELS.get(stage) if isinstance(stage, str) else None
    if model is None:
        raise ContractError(f"{path}: not a manifest of this pipeline (stage {stage!r}); {hint or 'choose another directory'}")
    hint = hint or f"rerun {STAGES[stage]}"
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ContractError(f"{path}: schema version {data.get('schema_version')!r}, this version reads "
                            f"{SCHEMA_VERSION} (written by another version of eagle3-train); {hint}")
    try:
        manifest = model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "(top level)"
        raise ContractError(f"{path}: field {field}: {error['msg'].lower()} (stage {stage!r} manifest); {hint}") from None
    manifest._path, manifest._sha256 = path, hashlib.sha256(raw).hexdigest()  # the bytes read: no second read
    return manifest
