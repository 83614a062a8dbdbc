"""The draft's flex-attention forward kernel config on Hopper (sm90): one gated fix.

Why: at Kimi-K2.5 geometry (64 heads of 64, 32K packed tokens, speculators' document +
window mask) PyTorch's default forward config for head_dim 64 on sm90 (a 128x128 tile,
4 warps, 3 stages) runs at 255 registers per thread and takes ~28 ms per TTT step on an
H200, ~10% of the training step; a 64x128 tile with the same warps and stages takes 2.6 ms
for the same output (`bench/flex_attention_configs.py`, NOTES.md "Where the step's time
goes"). The backward kernel keeps PyTorch's config (the `fwd_` keys reach the forward only).

How: speculators 0.9.0 calls `flex_attention` from `speculators.models.attention` without
`kernel_options`; this wraps that module-level name so calls whose head_dim is the measured
one get the measured forward config (a caller's own options win). Dynamo resolves the name
when it traces the draft's compiled forward, so the wrapper must be installed before the
first training step (`training.apply_compat` does it).

Applied only on a CUDA device whose compute capability has a measured config (sm90: H100,
H200); elsewhere (Blackwell, CPU) PyTorch's own choice stands until someone measures it with
`bench/flex_attention_configs.py` and adds a row to FORWARD_CONFIGS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("eagle3")

# (major, minor) compute capability -> kernel_options measured fastest for head_dim 64.
HEAD_DIM = 64
FORWARD_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (9, 0): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
}

# Keys (query dtype, key dtype, value dtype, query shape, key shape, options passed), one per
# distinct call: what the compiled graphs hand flex_attention (Dynamo replays the store on
# every call of a graph, so a dict, not a list). Read by `traced_calls_summary`.
TRACED_CALLS: dict[tuple, bool] = {}


@dataclass(frozen=True)
class FlexConfigDecision:
    apply: bool
    reason: str
    options: dict[str, int] | None = None


def decide(capability: tuple[int, int] | None) -> FlexConfigDecision:
    """`capability` is the CUDA device's (major, minor), None without a CUDA device."""
    if capability is None:
        return FlexConfigDecision(False, "no CUDA device")
    options = FORWARD_CONFIGS.get(tuple(capability))
    if options is None:
        return FlexConfigDecision(False, f"sm{capability[0]}{capability[1]}: no measured forward config")
    return FlexConfigDecision(True, f"sm{capability[0]}{capability[1]}: forward config {options}", options)


def with_forward_config(flex_attention, options: dict[str, int]):
    """`flex_attention` with `options` added where the head_dim is HEAD_DIM."""

    def flex_attention_with_config(query, key, value, *args, kernel_options=None, **kwargs):
        if query.shape[-1] == HEAD_DIM:
            kernel_options = {**options, **(kernel_options or {})}
        TRACED_CALLS[(query.dtype, key.dtype, value.dtype, tuple(query.shape), tuple(key.shape),
                      tuple(sorted((kernel_options or {}).items())))] = True
        return flex_attention(query, key, value, *args, kernel_options=kernel_options, **kwargs)

    flex_attention_with_config.wrapped = flex_attention
    return flex_attention_with_config


def install(options: dict[str, int]) -> None:
    """Wrap speculators' module-level `flex_attention` (idempotent)."""
    from speculators.models import attention

    current = attention.flex_attention
    original = getattr(current, "wrapped", current)
    attention.flex_attention = with_forward_config(original, options)


def traced_calls_summary() -> str:
    """What the compiled graphs handed flex_attention, one line per distinct call."""
    return "; ".join(f"q/k/v {q}/{k}/{v} q{list(qs)} k{list(ks)} options {dict(opts)}"
                     for (q, k, v, qs, ks, opts) in TRACED_CALLS) or "no flex_attention call traced"


def apply() -> bool:
    """The compat-layer interface (`training.apply_compat`): True if the config was installed."""
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    decision = decide(capability)
    log.info("flex attention forward config: %s", decision.reason)
    if decision.apply:
        install(decision.options)
    return decision.apply
