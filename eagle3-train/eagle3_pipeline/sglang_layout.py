"""SGLang's EAGLE-3 layout (SpecForge's): the same draft weights under the names and config keys SGLang's loader reads.

Read from SGLang's source (sgl-project/sglang at commit 03d5a77, NOTES.md "Stage 05/06"):
- `python/sglang/srt/models/llama_eagle3.py`: `LlamaForCausalLMEagle3` builds one decoder layer `midlayer`
  (its qkv over [embedding, hidden] = 2 x hidden_size, `input_layernorm` on the embedding, `hidden_norm` on the
  hidden state, the residual taken *before* `hidden_norm`), `fc` over 3 x `target_hidden_size` (or hidden_size)
  with no norm before it, `norm`, `lm_head` of `draft_vocab_size` rows, `embed_tokens`; `d2t` becomes its hot-token
  map, `t2d` is skipped; a name not among its parameters is looked up again under `model.`. It returns the pre-norm
  hidden state as the next step's input (speculators' `norm_output: false`).
- `python/sglang/srt/model_executor/model_runner.py` takes the target's aux layers from the draft config's
  `eagle_config.eagle_aux_hidden_state_layer_ids`, and `python/sglang/srt/models/llama.py`
  (`set_eagle3_layers_to_capture`) captures layer `id + 1`'s input: SGLang's id k is the output of layer k, vLLM's
  (and this pipeline's) id k the stream after k layers, so SGLang's ids are ours minus one.
vLLM reads the same files (its registry maps `LlamaForCausalLMEagle3` to its EAGLE-3 Llama, `midlayer.` to
`layers.0.`), taking the top-level `eagle_aux_hidden_state_layer_ids` (its own convention) before `eagle_config`'s:
both are written. A draft whose architecture SGLang's loader does not build (fc_norm, norm_before_fc,
norm_before_residual, norm_output, more than one layer or three aux layers, a non-Llama layer) is refused, named.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYOUTS = ("speculators", "sglang")
# transformer_layer_config keys SGLang's LlamaConfig reads (the rest are speculators' own)
LLAMA_KEYS = ("attention_bias", "bos_token_id", "eos_token_id", "head_dim", "hidden_act", "hidden_size",
              "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias", "num_attention_heads",
              "num_key_value_heads", "pretraining_tp", "rms_norm_eps", "vocab_size", "layer_types", "sliding_window",
              "use_sliding_window")
LAYER_PREFIX, SGLANG_PREFIX = "layers.0.", "midlayer."


def is_sglang(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def sglang_problems(config: dict) -> list[str]:
    """What in a speculators-format draft config SGLang's EAGLE-3 loader does not build (empty: it can serve it)."""
    layer = config.get("transformer_layer_config") or {}
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type {config.get('speculators_model_type')!r} (SGLang's loader is EAGLE-3's)")
    if layer.get("model_type") != "llama":
        problems.append(f"a {layer.get('model_type')!r} decoder layer (its loader builds a Llama one)")
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"{layer.get('num_hidden_layers')} decoder layers (its loader maps one, `midlayer`)")
    if len(config.get("eagle_aux_hidden_state_layer_ids") or []) != 3:
        problems.append(f"{len(config.get('eagle_aux_hidden_state_layer_ids') or [])} aux layers (its fc takes 3)")
    for key, what in (("fc_norm", "fc_norm (an RMSNorm per aux hidden state before fc)"),
                      ("norm_before_fc", "norm_before_fc (an RMSNorm over the aux states before fc)"),
                      ("norm_before_residual", "norm_before_residual (its residual is taken before hidden_norm)"),
                      ("norm_output", "norm_output (it feeds the pre-norm hidden state to the next step)")):
        if config.get(key):
            problems.append(what)
    return problems


def require_servable(config: dict, where: str) -> None:
    kind = config.get("speculators_model_type") or "eagle3"
    if kind != "eagle3":  # another kind (draft_kinds.py): no SGLang layout at all, whatever its other keys
        raise ConfigError(f"{where}: --layout sglang writes EAGLE-3 drafts only (SGLang's LlamaForCausalLMEagle3), "
                          f"this is a {kind} draft: export it with --layout speculators (vLLM serves it)")
    if problems := sglang_problems(config):
        raise ConfigError(f"{where}: --layout sglang: SGLang's EAGLE-3 loader (LlamaForCausalLMEagle3) does not build "
                          f"{'; '.join(problems)}; this draft serves in vLLM (--layout speculators), or train one "
                          f"without them (draft_config.json; --extra-args=--no-norm-output)")


def sglang_config(config: dict) -> dict[str, Any]:
    """config.json in SGLang's layout from a speculators-format draft config (require_servable first)."""
    layer = config["transformer_layer_config"]
    ids = list(config["eagle_aux_hidden_state_layer_ids"])
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "llama"}
    out.update({key: layer[key] for key in LLAMA_KEYS if key in layer})
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out.update(num_hidden_layers=1, tie_word_embeddings=False, draft_vocab_size=config["draft_vocab_size"],
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
               eagle_aux_hidden_state_layer_ids=ids)  # vLLM's convention, which vLLM reads first
    if config.get("target_hidden_size"):
        out["target_hidden_size"] = config["target_hidden_size"]
    if config.get("dtype"):
        out["torch_dtype"] = config["dtype"]
    return out


def sglang_name(name: str) -> str:
    return SGLANG_PREFIX + name[len(LAYER_PREFIX):] if name.startswith(LAYER_PREFIX) else name


def speculators_view(config: dict, shapes: dict[str, list[int]]) -> tuple[dict, dict[str, list[int]]]:
    """An SGLang-layout draft as its speculators-format twin (config keys, tensor names), for the checks stage 06
    runs on a draft (verdict.py): what vLLM builds from either is the same model."""
    layer = {key: config[key] for key in LLAMA_KEYS if key in config}
    layer.update(model_type="llama", num_hidden_layers=config.get("num_hidden_layers", 1))
    view = {"speculators_model_type": "eagle3", "transformer_layer_config": layer,
            "draft_vocab_size": config.get("draft_vocab_size"), "target_hidden_size": config.get("target_hidden_size"),
            "eagle_aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids")
            or [i + 1 for i in (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", [])],
            "fc_norm": False, "norm_before_fc": False, "norm_before_residual": False, "norm_output": False}
    names = {(LAYER_PREFIX + n[len(SGLANG_PREFIX):] if n.startswith(SGLANG_PREFIX) else n): s for n, s in shapes.items()}
    return view, names
