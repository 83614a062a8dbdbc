"""The target (verifier) adapter: what the pipeline needs to know about the model.

Kimi-K2.5 is a multimodal wrapper (`kimi_k25`, `KimiK25ForConditionalGeneration`) around a
DeepSeek-V3 text model: the text config is nested under `text_config`, and the text
weights live under `language_model.` (`language_model.model.layers.*`,
`language_model.lm_head.weight`, ...). Everything downstream (layer ids, hidden size,
vocab, which tensors speculators loads) is read through `TargetInfo`, which unwraps it.
Reads only JSON and safetensors headers: no model code, no weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import InputError
from .files import sha256_file, sha256_json

# Local imports: safetensors, speculators: imported where weights or the loader's key rule are needed (a config read needs neither).

# Files that decide how text becomes token ids (and back); their bytes form the tokenizer hash.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tiktoken.model",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)

# The three frozen verifier tensors the EAGLE-3 draft reuses, by their plain-LM names.
VERIFIER_HEAD_TENSORS = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")


@dataclass(frozen=True)
class TargetInfo:
    path: str
    model_type: str
    architectures: list[str]
    text_model_type: str
    is_multimodal_wrapper: bool
    num_layers: int
    hidden_size: int
    vocab_size: int
    weight_prefix: str  # "language_model." for the Kimi wrapper, "" for a plain causal LM
    config_sha256: str
    tokenizer_sha256: str | None
    text_config: dict = field(repr=False)

    def summary(self) -> dict:
        data = asdict(self)
        data.pop("text_config")
        return data

    @property
    def is_mla(self) -> bool:
        return bool(self.text_config.get("kv_lora_rank"))


def load_target_info(path: str | Path, tokenizer_path: str | Path | None = None) -> TargetInfo:
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise InputError(f"{config_file}: target config not found (--target must be a local model directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_file}: not valid JSON ({exc})") from None
    text_config = config.get("text_config") or config
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text_config:
            raise InputError(f"{config_file}: text config has no {key!r}")
    return TargetInfo(
        path=str(root.resolve()),
        model_type=config.get("model_type", ""),
        architectures=list(config.get("architectures") or []),
        text_model_type=text_config.get("model_type", ""),
        is_multimodal_wrapper="text_config" in config,
        num_layers=int(text_config["num_hidden_layers"]),
        hidden_size=int(text_config["hidden_size"]),
        vocab_size=int(text_config["vocab_size"]),
        weight_prefix=detect_weight_prefix(root),
        config_sha256=sha256_json(config),
        tokenizer_sha256=tokenizer_sha256(Path(tokenizer_path) if tokenizer_path else root),
        text_config=text_config,
    )


# vLLM 0.32's rule for the longest max_model_len a model allows (config/model.py _get_and_verify_max_len): the
# smallest of these text-config keys, times a RoPE scaling factor unless the type already scaled it.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def max_model_len_limit(target: TargetInfo) -> int | None:
    """The longest --max-model-len vLLM serves this target with (None: its config names none), so stage 06 refuses
    a longer one in one line before an engine starts instead of vLLM's ValueError traceback."""
    config = target.text_config
    found = [config[key] for key in _MAX_LEN_KEYS if isinstance(config.get(key), (int, float))]
    if not found:
        return None
    limit = config["model_max_length"] if isinstance(config.get("model_max_length"), (int, float)) else min(found)
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind and kind not in _PRESCALED_ROPE and kind != "default" and isinstance(rope.get("factor"), (int, float)):
        limit *= rope["factor"]
    return int(limit)


def tokenizer_sha256(directory: Path) -> str | None:
    present = {name: sha256_file(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()}
    return sha256_json(present) if present else None


def weight_map(root: Path) -> dict[str, str]:
    """tensor name -> shard file, from the index or the single safetensors header."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = root / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), "model.safetensors")
    return {}


def detect_weight_prefix(root: Path) -> str:
    names = weight_map(root)
    if any(name.startswith("language_model.") for name in names):
        return "language_model."
    return ""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high aux layers: (2, L//2, L-3), made distinct for tiny models.

    For Kimi-K2.5 (L=61) this is [2, 30, 58]; the extractor adds L itself (the final
    layer's output before the final norm), giving vLLM's [2, 30, 58, 61].
    """
    ids = [2, num_layers // 2, num_layers - 3]
    for i in (1, 2):
        ids[i] = max(ids[i], ids[i - 1] + 1)
    if ids[-1] < num_layers and ids[0] >= 1:
        return ids
    if num_layers < 4:
        raise InputError(f"target has {num_layers} layers; EAGLE-3 needs at least 4 (three aux layers + final)")
    return [round(num_layers * j / 4) for j in (1, 2, 3)]


def extraction_layer_ids(num_layers: int, aux_layer_ids: list[int] | None) -> list[int]:
    """Aux layers + the final layer L (hidden-state slot order on disk)."""
    aux = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers)
    if len(aux) != 3:
        raise InputError(f"--layer-ids needs exactly 3 aux layer ids (the final layer is added), got {aux}")
    if sorted(set(aux)) != aux or aux[0] < 0 or aux[-1] >= num_layers:
        raise InputError(f"--layer-ids {aux}: must be increasing, distinct, within [0, {num_layers})")
    return aux + [num_layers]


def resolve_verifier_head_keys(root: Path) -> dict[str, str]:
    """The checkpoint keys speculators' loader picks for embed/lm_head/norm.

    The Kimi adapter check: speculators resolves names by exact match, then by suffix
    (shortest key wins). For the wrapper every head tensor must resolve to its
    `language_model.` key, never to a vision-tower or projector tensor.
    """
    from speculators.utils.loading import _resolve_key  # the loader's own rule

    names = weight_map(Path(root))
    prefix = detect_weight_prefix(Path(root))
    resolved = {}
    for name in VERIFIER_HEAD_TENSORS:
        key = _resolve_key(name, names)
        expected = prefix + name
        if key != expected:
            raise InputError(
                f"{root}: speculators would load {name!r} from {key!r}, expected {expected!r} "
                f"(weight layout not understood)"
            )
        resolved[name] = key
    return resolved
