"""speculators' fused Triton loss under torch 2.11's compiler: one gated fix.

The bug: `speculators/losses/fused.py` (0.9.0) decorates both `loss_forward_kernel` and
`loss_backward_kernel` with ONE `triton.autotune(...)` object, so the two Autotuners hold
the same `configs` list. Dynamo, tracing the compiled draft forward (and its backward),
wraps each kernel's `configs` through a path that skips its "already tracked" check, sees
the one list twice and fails: "ListVariable(length=21) is already tracked for mutation"
(PyTorch issue #177600). PyTorch fixed the wrapping (PR #177874, March 2026: route through
`VariableBuilder.__call__`); torch 2.11, on the H200 image, predates it.

The fix: give the backward kernel its own copy of the list. Same configs, same tuning, no
behaviour change; it only removes the aliasing. It covers one loss call per compiled graph,
which is what the draft's forward makes (a graph break per TTT step at speculators'
compiler-disabled `extend_mask_for_draft_tokens`); two calls in one graph still fail on
torch 2.11 (the forward kernel's own list, seen twice: measured on the H200).

Applied only when both hold: the kernels share one list (speculators' layout; a later
speculators that stops sharing needs nothing) and the installed torch has the unfixed
wrapper (read from its source where possible, else torch < 2.12). Elsewhere a no-op.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

# First torch release line whose Dynamo wraps autotuner configs with de-duplication.
FIXED_IN_TORCH = (2, 12)


@dataclass(frozen=True)
class FusedLossFixDecision:
    apply: bool
    reason: str


def _torch_version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def dynamo_has_config_aliasing_bug(
    source: str | None = None, torch_version: str | None = None,
) -> tuple[bool, str]:
    """Whether this torch's Dynamo double-tracks a shared autotuner `configs` list.

    Reads `DynamoTritonHOPifier.wrap_user_defined_obj`: the unfixed version calls
    `VariableBuilder(...)._wrap(...)`, the fixed one `VariableBuilder(...)(...)`. If the
    source cannot be read (no source files, renamed class), falls back to the version.
    Both are arguments so the decision can be tested against either torch on any machine.
    """
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if source is None:
        try:
            from torch._dynamo.variables.functions import DynamoTritonHOPifier

            source = inspect.getsource(DynamoTritonHOPifier.wrap_user_defined_obj)
        except (ImportError, AttributeError, OSError, TypeError):
            source = None
    if source is None:
        buggy = _torch_version_tuple(torch_version) < FIXED_IN_TORCH
        return buggy, f"torch {torch_version} ({'<' if buggy else '>='} 2.12)"
    buggy = "._wrap(" in source
    return buggy, f"torch {torch_version} Dynamo wraps autotuner configs " + (
        "without de-duplication" if buggy else "with de-duplication")


def decide(fused_module: Any, aliasing_bug: tuple[bool, str] | None = None) -> FusedLossFixDecision:
    """Apply only if the kernels share one configs list AND Dynamo has the bug."""
    forward = getattr(fused_module, "loss_forward_kernel", None)
    backward = getattr(fused_module, "loss_backward_kernel", None)
    if forward is None or backward is None or not hasattr(backward, "configs"):
        return FusedLossFixDecision(False, "fused loss kernels not found or not autotuned")
    if forward.configs is not backward.configs:
        return FusedLossFixDecision(False, "forward and backward kernels have separate configs")
    buggy, why = aliasing_bug if aliasing_bug is not None else dynamo_has_config_aliasing_bug()
    if not buggy:
        return FusedLossFixDecision(False, f"{why}: not needed")
    return FusedLossFixDecision(True, f"{why}; kernels share one configs list")


def apply_fused_loss_fix(
    fused_module: Any = None, aliasing_bug: tuple[bool, str] | None = None,
) -> FusedLossFixDecision:
    """Give speculators' fused backward kernel its own configs list where needed.

    Idempotent (after the first call the lists are separate). Call before the first
    training step; safe on any machine (imports Triton only through speculators).
    """
    if fused_module is None:
        try:
            from speculators.losses import fused as fused_module
        except ImportError as error:  # no Triton: the fused loss cannot run at all
            return FusedLossFixDecision(False, f"speculators fused loss unavailable ({error})")
    decision = decide(fused_module, aliasing_bug)
    if decision.apply:
        backward = fused_module.loss_backward_kernel
        backward.configs = list(backward.configs)
    return decision


def apply() -> bool:
    """The compat-layer interface (`training.apply_compat`): True if the fix was applied."""
    return apply_fused_loss_fix().apply
