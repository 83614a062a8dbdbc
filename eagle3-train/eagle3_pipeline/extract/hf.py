"""HF-transformers extraction backend: small targets, debugging, and the one-GPU smoke.

It unwraps a multimodal wrapper (Kimi-K2.5's `language_model.*` checkpoint) into the plain
text causal LM and reads the residual stream with forward hooks: slot for layer id k is
the output of decoder layer k-1 (k = 0: the embeddings), so id L is the last layer's
output *before* the final norm, the same convention as vLLM's extraction. The real 600 GB
INT4 Kimi-K2.5 is vLLM's job; this backend loads plain (unquantized) weights.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch

from ..errors import InputError
from ..target import TargetInfo
from .common import ExtractedSample

# Local imports: transformers: imported where the model is loaded (heavy).

_TEXT_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
# CPU forwards run on one intra-op thread: fp32 reductions split across threads round differently
# (measured on the miniature: 5 of 12 rows differ by up to 2e-7 between 1, 2 and 3 threads, each
# count deterministic), so the saved states would depend on the machine's core count or a
# process's thread setting. One thread makes them bit-identical however rows are batched, resumed
# or redone (tests/test_reliability_rerun.py). The HF CPU path serves miniatures and debugging only.
CPU_THREADS = 1


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_text_model(target: TargetInfo, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {}
    if target.is_multimodal_wrapper:
        text_config = dict(target.text_config)
        model_type = _TEXT_MODEL_TYPE_ALIASES.get(text_config.get("model_type"), text_config.get("model_type"))
        text_config.pop("model_type", None)
        # The text model's own config, and the wrapper prefix mapped away from every key.
        kwargs = {"config": AutoConfig.for_model(model_type, **text_config),
                  "key_mapping": {"^" + re.escape(target.weight_prefix): ""}}
    # transformers' own loader: it also converts checkpoint-layout (per-expert) MoE tensors into
    # its fused in-memory layout. Weights it could not place are an error, never silently random.
    model, info = AutoModelForCausalLM.from_pretrained(
        target.path, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True, **kwargs,
    )
    if info["missing_keys"]:
        raise InputError(f"{target.path}: weights missing for the text model (prefix {target.weight_prefix!r}): "
                         f"{sorted(info['missing_keys'])[:3]}")
    return model.to(device).eval()


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

    def extract(self, rows: list[tuple[int, list[int]]]) -> Iterator[ExtractedSample]:
        # Each row is its own forward (batch of one, no padding): a row's states never depend on
        # which rows share its call, so a resume or a redo of single rows gives the same bytes.
        for index, ids in rows:
            yield ExtractedSample(index=index, hidden_states=self._forward(ids), token_ids=torch.tensor(ids, dtype=torch.long))

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        self._captured.clear()
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(CPU_THREADS)
        try:
            # Only the hooked layers matter; logits_to_keep=1 skips the full-vocab lm_head.
            self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        finally:
            torch.set_num_threads(threads)
        return torch.stack([self._captured[k][0] for k in self.layer_ids], dim=1).cpu()  # [T, n, H]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
