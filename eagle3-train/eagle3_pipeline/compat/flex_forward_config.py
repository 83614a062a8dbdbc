"""The draft's flex-attention forward kernel config on Hopper (sm90): one gated fix.

Why: at Kimi-K2.5 geometry (64 heads of 64, 32K packed tokens, speculators' document +
window mask) PyTorch's default forward config for head_dim 64 on sm90 (a 128x128 tile,
4 warps, 3 stages) runs at 255 registers per thread and was the outlier of the training step on
an H200; a 64x128 tile with the same warps and stages is several times faster for the same output
(`bench/flex_attention_configs.py`; figures in bench/README.md, "Flex-attention forward configs" and
"Where the step's time goes"). The backward kernel keeps PyTorch's config (the `fwd_` keys reach the forward only).

How: speculators 0.9.0 calls `flex_attention` from `speculators.models.attention` without
`kernel_options`; this wraps that module-level name so calls whose head_dim is the measured
one get the measured forward config (a caller's own options win). Dynamo resolves the name
when it traces the draft's compiled forward, so the wrapper must be installed before the
first training step (`training.apply_compat` does it).

Why a dtype gate would be wrong: at trace time speculators hands flex_attention fp32 q/k/v
(the rotary product promotes them); torch's flex_attention casts them to the autocast dtype
itself, so the kernel runs in bf16 either way.

Which config (04_train's `--flex-forward-config`, carried to every training process in the
EAGLE3_FLEX_FORWARD_CONFIG environment variable): `auto` = the measured row of FORWARD_CONFIGS
for this CUDA device (sm90: H100, H200), nothing elsewhere (Blackwell, CPU) until someone
measures it with `bench/flex_attention_configs.py`; `off` = PyTorch's default; or a JSON object
of `fwd_` kernel options (e.g. the winner of that bench on a new GPU), applied on any CUDA device.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("eagle3")

ENV = "EAGLE3_FLEX_FORWARD_CONFIG"
# (major, minor) compute capability -> kernel_options measured fastest for head_dim 64.
HEAD_DIM = 64
FORWARD_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (9, 0): {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
}

# Keys (query dtype, key dtype, value dtype, head_dim, options passed), one per distinct call:
# what the compiled graphs hand flex_attention (Dynamo replays the store on every call of a
# graph, so a dict, not a list). No sequence lengths: making a key of them would specialise
# the graph on them, i.e. one recompile per length until Dynamo's limit, then eager flex
# attention. Read by `traced_calls_summary`.
TRACED_CALLS: dict[tuple, bool] = {}


@dataclass(frozen=True)
class FlexConfigDecision:
    apply: bool
    reason: str
    options: dict[str, int] | None = None


def parse_setting(text: str) -> str | dict[str, int]:
    """`auto`, `off`, or a JSON object of `fwd_` kernel options with integer values."""
    if text in ("auto", "off"):
        return text
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict) or not options or not all(
            isinstance(key, str) and key.startswith("fwd_") and type(value) is int for key, value in options.items()):
        raise ValueError(f"{text!r}: expected auto, off, or a JSON object of fwd_ kernel options with integer "
                         'values, e.g. {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3}')
    return options


def decide(capability: tuple[int, int] | None, setting: str | dict[str, int] = "auto") -> FlexConfigDecision:
    """`capability` is the CUDA device's (major, minor), None without a CUDA device."""
    if capability is None:
        return FlexConfigDecision(False, "no CUDA device")
    if setting == "off":
        return FlexConfigDecision(False, "off: PyTorch's default")
    if isinstance(setting, dict):
        return FlexConfigDecision(True, f"given: forward config {setting}", setting)
    options = FORWARD_CONFIGS.get(tuple(capability))
    if options is None:
        return FlexConfigDecision(False, f"sm{capability[0]}{capability[1]}: no measured forward config")
    return FlexConfigDecision(True, f"sm{capability[0]}{capability[1]}: forward config {options}", options)


def with_forward_config(flex_attention, options: dict[str, int], head_dim: int | None = HEAD_DIM):
    """`flex_attention` with `options` added where the head_dim is `head_dim` (None: every call)."""

    def flex_attention_with_config(query, key, value, *args, kernel_options=None, **kwargs):
        if head_dim is None or query.shape[-1] == head_dim:
            kernel_options = {**options, **(kernel_options or {})}
        TRACED_CALLS[(query.dtype, key.dtype, value.dtype, query.shape[-1],
                      tuple(sorted((kernel_options or {}).items())))] = True
        return flex_attention(query, key, value, *args, kernel_options=kernel_options, **kwargs)

    flex_attention_with_config.wrapped = flex_attention
    return flex_attention_with_config


def install(options: dict[str, int], head_dim: int | None = HEAD_DIM) -> None:
    """Wrap speculators' module-level `flex_attention` (idempotent)."""
    from speculators.models import attention

    current = attention.flex_attention
    original = getattr(current, "wrapped", current)
    attention.flex_attention = with_forward_config(original, options, head_dim)


def traced_calls_summary() -> str:
    """What the compiled graphs handed flex_attention, one line per distinct call."""
    return "; ".join(f"q/k/v {q}/{k}/{v} head_dim {head_dim} options {dict(opts)}"
                     for (q, k, v, head_dim, opts) in TRACED_CALLS) or "no flex_attention call traced"


def apply() -> bool:
    """The compat-layer interface (`training.apply_compat`): True if the config was installed."""
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    setting = parse_setting(os.environ.get(ENV, "auto"))
    decision = decide(capability, setting)
    log.info("flex attention forward config: %s", decision.reason)
    if decision.apply:
        # The measured rows are for the draft's head_dim 64; given options apply to every call.
        install(decision.options, head_dim=None if isinstance(setting, dict) else HEAD_DIM)
    return decision.apply
