"""`--print-config`'s text: every resolved value with where it came from, what the stage makes of it at
run time on this machine (`-> ...`), and a profile's reason (`_why`) under each value it sets.

Nothing here imports torch (stage 04's `--print-config` must answer without it): the CUDA facts come
from machine.cuda_capabilities, which asks the driver.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from pydantic import ValidationError

from ..contract import read_manifest
from ..errors import ConfigError, ContractError, InputError
from ..machine import cuda_capabilities
from ..target import extraction_layer_ids, load_target_info
from .schema import DraftConfig, ExportConfig, ExtractConfig, StageConfig, VocabConfig, load_draft_config

RunTimeNotes = Callable[[StageConfig, dict[str, str]], dict[str, str]]  # (config, its sources) -> {field: text}


def format_config(cfg: StageConfig, sources: dict[str, str], profile_name: str | None = None,
                  profile: dict[str, Any] | None = None, resolved: dict[str, str] | None = None) -> str:
    """`name = value  # source` per field; `-> what it becomes` where the stage decides a value at run
    time (`resolved`); the profile's description and its reason (`_why`) under each value it sets.
    `profile`: the --profile file's JSON, named `profile_name`."""
    lines = [f"# {cfg.STAGE} config (value  # source; -> what the stage resolves it to on this machine)"]
    reasons: dict[str, str] = {}
    if profile_name and profile is not None:
        if profile.get("description"):
            lines.append(f"# profile {profile_name}: {profile['description']}")
        prefix = f"{cfg.STAGE}."
        reasons = {key.removeprefix(prefix): why for key, why in profile.get("_why", {}).items() if key.startswith(prefix)}
    resolved = resolved or {}
    for name in type(cfg).model_fields:
        line = f"{name} = {json.dumps(getattr(cfg, name))}  # {sources.get(name, 'default')}"
        if name in resolved:
            line += f" -> {resolved[name]}"
        lines.append(line)
        if name in reasons and sources.get(name, "").startswith("profile:"):
            lines.append(f"#   why: {reasons[name]}")
    return "\n".join(lines)


def resolved_at_run_time(cfg: StageConfig, run_time_notes: RunTimeNotes | None = None,
                         sources: dict[str, str] | None = None) -> dict[str, str]:
    """For --print-config: what the `auto`/unset fields become in a run on this machine, where that is
    cheap to know without the run's inputs (train: what speculators receives, from `run_time_notes`;
    vocab/export: draft defaults)."""
    if run_time_notes is not None:
        return run_time_notes(cfg, sources or {})
    if isinstance(cfg, ExtractConfig):
        return _extract_resolved(cfg)
    if isinstance(cfg, VocabConfig) and cfg.draft_vocab_size is None:
        try:
            value = load_draft_config(cfg.draft_config).draft_vocab_size
        except ConfigError as exc:
            return {"draft_vocab_size": f"? ({exc})"}
        return {"draft_vocab_size": f"{value} ({cfg.draft_config}; clipped to the target's vocabulary size)"}
    if isinstance(cfg, ExportConfig) and cfg.num_speculative_tokens is None:
        recorded = "the draft config's, as stage 04 recorded it in --checkpoints"
        try:
            trained = read_manifest(cfg.checkpoints, "train", "--checkpoints")
            value = DraftConfig(**(trained.draft_config or {})).num_speculative_tokens
        except (ContractError, OSError, ValidationError, TypeError):
            return {"num_speculative_tokens": recorded}
        return {"num_speculative_tokens": f"{value} (the draft config stage 04 recorded in {cfg.checkpoints})"}
    return {}


def _extract_resolved(cfg: ExtractConfig) -> dict[str, str]:
    notes: dict[str, str] = {}
    try:
        target = load_target_info(cfg.target)
        notes["layer_ids"] = (f"{extraction_layer_ids(target.num_layers, cfg.layer_ids)} saved "
                              f"(the aux layers + the final layer {target.num_layers} of {cfg.target})")
    except InputError as exc:
        given = "" if cfg.target.startswith("<") else f": {exc}"
        notes["layer_ids"] = f"the aux layers (default 2, L//2, L-3 of the target's L) + L (no target config{given})"
    if cfg.backend == "hf" and cfg.device == "auto":
        notes["device"] = '"cuda"' if cuda_capabilities() else '"cpu" (no CUDA device)'
    return notes
