"""The Kimi adapter: unwrapping, layer ids, and which tensors speculators loads."""

import pytest
import torch
from safetensors import safe_open

from eagle3_pipeline.errors import InputError
from eagle3_pipeline.target import (
    default_aux_layer_ids,
    extraction_layer_ids,
    load_target_info,
    resolve_verifier_head_keys,
    weight_map,
)


def test_kimi_k25_layer_ids_are_2_30_58_plus_final_61():
    assert extraction_layer_ids(61, None) == [2, 30, 58, 61]


@pytest.mark.parametrize("layers,expected", [(6, [2, 3, 4]), (8, [2, 4, 5]), (4, [1, 2, 3]), (32, [2, 16, 29])])
def test_default_aux_layers_are_distinct_and_below_the_final_layer(layers, expected):
    assert default_aux_layer_ids(layers) == expected


def test_explicit_layer_ids_are_checked():
    assert extraction_layer_ids(6, [1, 2, 5]) == [1, 2, 5, 6]
    with pytest.raises(InputError):
        extraction_layer_ids(6, [1, 6, 2])
    with pytest.raises(InputError):
        extraction_layer_ids(6, [1, 2])


def test_target_info_unwraps_the_kimi_wrapper(kimi_target):
    info = load_target_info(kimi_target)
    assert info.is_multimodal_wrapper and info.is_mla
    assert (info.text_model_type, info.num_layers, info.hidden_size, info.vocab_size) == ("deepseek_v3", 6, 128, 1024)
    assert info.weight_prefix == "language_model."
    assert info.tokenizer_sha256 and info.config_sha256


def test_speculators_resolves_head_tensors_to_language_model_keys(kimi_target):
    assert resolve_verifier_head_keys(kimi_target) == {
        "model.embed_tokens.weight": "language_model.model.embed_tokens.weight",
        "lm_head.weight": "language_model.lm_head.weight",
        "model.norm.weight": "language_model.model.norm.weight",
    }


def test_speculators_loader_returns_the_kimi_wrapper_tensors(kimi_target):
    """speculators' own `load_model_layers` reads embed/lm_head/norm from the language_model.* keys."""
    from speculators.utils.loading import load_model_layers

    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    loaded = load_model_layers(names, str(kimi_target))
    shards = weight_map(kimi_target)
    for name in names:
        key = "language_model." + name
        with safe_open(str(kimi_target / shards[key]), "pt") as handle:
            assert torch.equal(loaded[name], handle.get_tensor(key)), name
