"""HF-transformers extraction backend: small targets, debugging, and the one-GPU smoke.

It unwraps a multimodal wrapper (Kimi-K2.5's `language_model.*` checkpoint) into the plain
text causal LM and reads the residual stream with forward hooks: slot for layer id k is
the output of decoder layer k-1 (k = 0: the embeddings), so id L is the last layer's
output *before* the final norm, the same convention as vLLM's extraction. The real 600 GB
INT4 Kimi-K2.5 is vLLM's job; this backend loads plain (unquantized) weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ..target import TargetInfo, weight_map
from .common import ExtractedSample

_TEXT_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_text_model(target: TargetInfo, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    if not target.is_multimodal_wrapper:
        model = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype, trust_remote_code=trust_remote_code)
        return model.to(device).eval()
    text_config = dict(target.text_config)
    model_type = _TEXT_MODEL_TYPE_ALIASES.get(text_config.get("model_type"), text_config.get("model_type"))
    text_config.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **text_config)
    # Built on the CPU (not the meta device: rotary buffers are computed at init), then
    # overwritten by the checkpoint; strict, so a layout we do not understand fails loudly.
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(_load_prefixed_state(Path(target.path), target.weight_prefix, dtype), strict=True)
    return model.to(device).eval()


def _load_prefixed_state(root: Path, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map(root).items():
        if name.startswith(prefix):
            by_shard.setdefault(shard, []).append(name)
    state = {}
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(root / shard), framework="pt") as handle:
            for name in names:
                state[name[len(prefix):]] = handle.get_tensor(name).to(dtype)
    return state


class HfBackend:
    def __init__(self, target: TargetInfo, layer_ids: list[int], dtype: torch.dtype, device: str,
                 trust_remote_code: bool = False):
        self.device = resolve_device(device)
        self.layer_ids = layer_ids
        self.model = load_text_model(target, dtype, self.device, trust_remote_code)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        decoder = self.model.model
        for layer_id in layer_ids:
            module = decoder.embed_tokens if layer_id == 0 else decoder.layers[layer_id - 1]
            self._hooks.append(module.register_forward_hook(self._capture(layer_id)))

    def _capture(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def extract(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]:
        for index, ids in rows:
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            self._captured.clear()
            # Only the hooked layers matter; logits_to_keep=1 skips the full-vocab lm_head.
            self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            states = torch.stack([self._captured[k][0] for k in self.layer_ids], dim=1)  # [T, n, H]
            yield ExtractedSample(index=index, hidden_states=states.cpu(), token_ids=input_ids[0].cpu())

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
