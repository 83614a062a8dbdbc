"""Feature noise: Gaussian noise on the draft's input aux hidden states while it trains (stage 04 --noise-std).

EAGLE trains its draft on the target's features with noise added (EAGLE-1's `AddUniformNoise` on its input
features; speculators' own repository has `AddGaussianNoise` on `hidden_states` only, default std 0.05, in
src/speculators/train/noise_transforms.py, which the 0.9.0 wheel does not ship): at inference the draft's later
steps read features that are not the target's exact ones, and a draft that has only ever seen exact features
overfits to them. speculators 0.9.0 has no such flag
(no `--noise-std` in its CLI or trainer). This wraps two of its names:

- `Eagle3DraftModel.get_trainer_kwargs` returns (train kwargs, val kwargs); the wrapper adds `NOISE_KWARG` to the
  train kwargs only, so validation's forward never asks for noise;
- `Eagle3DraftModel.forward` pops `NOISE_KWARG` and, in train mode, adds `std * N(0, 1)` to its `hidden_states`
  argument: the concatenated aux layers [1, T, n_aux * H] before the draft's norms and fc. Never to
  `verifier_last_hidden_states`, the last slot, from which the trainer computes the target logits (noise there
  would change what the draft is taught, not what it reads). Out of place: the loader's tensor (on the CPU the
  same object) is left as it was.

Std 0 (the default) installs nothing: training is exactly speculators'. The noise draws from torch's global
generator, which speculators seeds (`--seed`), so a run repeats.

Gate: stage 04 set `EAGLE3_NOISE_STD` > 0 (training.export_compat_settings); speculators 0.9.0 (the two names
and their signatures: re-read them before widening SUPPORTED_SPECULATORS).
"""

from __future__ import annotations

import functools
import os

from .gate import require_speculators

SUPPORTED_SPECULATORS = ("0.9.0",)
ENV = "EAGLE3_NOISE_STD"
NOISE_KWARG = "eagle3_noise_std"  # a train-call kwarg speculators' forward never sees (the wrapper pops it)
_applied = False


def noise_std() -> float:
    value = os.environ.get(ENV)
    return float(value) if value else 0.0


def add_noise(hidden_states, std: float):
    """hidden_states + std * N(0, 1) in its own dtype and device, a new tensor (std 0: the same tensor)."""
    import torch

    if not std:
        return hidden_states
    return hidden_states + torch.randn_like(hidden_states) * std


def apply() -> bool:
    global _applied

    if noise_std() <= 0:
        return False
    if _applied:
        return True
    require_speculators("feature_noise", SUPPORTED_SPECULATORS,
                        "speculators/models/eagle3/core.py Eagle3DraftModel.forward and get_trainer_kwargs")
    from speculators.models.eagle3 import core

    original_kwargs = core.Eagle3DraftModel.get_trainer_kwargs  # val_depth's wrapper, when it applied first
    original_forward = core.Eagle3DraftModel.forward

    # functools.wraps keeps the wrapped function's markers (val_depth's `_eagle3_val_depth`) visible
    @functools.wraps(original_kwargs)
    def get_trainer_kwargs(**kwargs):
        train_kwargs, val_kwargs = original_kwargs(**kwargs)
        return {**train_kwargs, NOISE_KWARG: noise_std()}, val_kwargs

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        std = kwargs.pop(NOISE_KWARG, 0.0)
        if std and self.training:
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = add_noise(kwargs["hidden_states"], std)
            else:
                args = (add_noise(args[0], std), *args[1:])
        return original_forward(self, *args, **kwargs)

    get_trainer_kwargs._eagle3_feature_noise = True  # what tests/test_compat.py looks for
    forward._eagle3_feature_noise = True
    core.Eagle3DraftModel.get_trainer_kwargs = staticmethod(get_trainer_kwargs)
    core.Eagle3DraftModel.forward = forward
    _applied = True
    return True
