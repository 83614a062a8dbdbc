"""draft_kinds: each kind's layers, served method and k, and mask token (issue 62). No engine, no training."""

import pytest

from eagle3_pipeline import draft_kinds as dk
from eagle3_pipeline.errors import ConfigError

KIMI_LAYERS = 61  # Kimi-K2.5's text_config.num_hidden_layers
MINI_LAYERS = 6  # the miniatures' (miniature.NUM_LAYERS)


def checkpoint_config(kind: str, **fields) -> dict:
    """The fields of a speculators 0.9.0 checkpoint's config.json the module reads, as speculators writes them
    (measured: `speculators train --speculator-type KIND` on the Llama miniature, 1 epoch)."""
    tokens = {"eagle3": 3, "peagle": 8, "dflash": 15, "dflash2": 7, "dspark": 8, "xpress": 15, "mtp": 3}[kind]
    config = {"speculators_model_type": kind,
              "speculators_config": {"proposal_methods": [{"speculative_tokens": tokens}]}}
    if kind in ("dflash", "dflash2", "dspark", "xpress"):
        config.update(block_size={"dflash": 16, "xpress": 16}.get(kind, 8), sample_from_anchor=kind == "dspark",
                      aux_hidden_state_layer_ids=[2, 3, 4], mask_token_id=716)
    elif kind != "mtp":
        config["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]
    config.update(fields)
    return config


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and message
    return message


def test_an_unknown_kind_is_refused_in_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as err:
        dk.kind("medusa")
    message = one_line(err)
    assert "'medusa'" in message
    for name in ("eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress", "mtp"):
        assert name in message


def test_the_default_kind_is_eagle3():
    assert dk.kind(None).name == "eagle3" == dk.DEFAULT_KIND


@pytest.mark.parametrize("name,method,k,extra", [
    ("eagle3", "eagle3", 3, {}),
    ("peagle", "eagle3", 8, {"parallel_drafting": True}),
    ("dflash", "dflash", 15, {}),  # block 16 - the anchor
    ("dflash2", "dflash", 7, {}),  # 0.32 base.py serves dflash2 as method dflash
    ("dspark", "dspark", 8, {}),  # samples from the anchor: k = block 8
])
def test_served_method_and_k_in_vllm_032(name, method, k, extra):
    config = checkpoint_config(name)
    assert dk.served_method(name, "0.32.0") == method
    assert dk.num_speculative_tokens(name, config) == k
    assert dk.speculative_config(name, "/d", config, "0.32.0") == {
        "model": "/d", "method": method, "num_speculative_tokens": k, **extra}


def test_vllm_026_serves_eagle3_peagle_dflash_and_dspark_with_a_bonus_anchor_only():
    assert dk.served_method("dflash", "0.26.0") == "dflash"
    assert dk.speculative_config("peagle", "/d", checkpoint_config("peagle"), "0.26.0")["parallel_drafting"] is True
    with pytest.raises(ConfigError) as err:
        dk.served_method("dflash2", "0.26.0")
    assert "0.32" in one_line(err)
    # speculators' dspark samples from the anchor by default; 0.26 serves a 1 + k fill-in block whatever the draft
    with pytest.raises(ConfigError) as err:
        dk.num_speculative_tokens("dspark", checkpoint_config("dspark"), vllm_version="0.26.0")
    assert "--no-sample-from-anchor" in one_line(err)
    fill_in = checkpoint_config("dspark", sample_from_anchor=False)
    assert dk.num_speculative_tokens("dspark", fill_in, vllm_version="0.26.0") == 7
    assert dk.num_speculative_tokens("dspark", fill_in, vllm_version="0.32.0") == 7
    # a version between the two read gets 0.26's facts; an older one is refused
    with pytest.raises(ConfigError):
        dk.served_method("dflash2", "0.28.1")
    with pytest.raises(ConfigError):
        dk.served_method("eagle3", "0.25.0")


@pytest.mark.parametrize("name", ["xpress", "mtp"])
def test_kinds_vllm_has_no_loader_for_are_refused_in_one_line(name):
    for version in ("0.26.0", "0.32.0"):
        with pytest.raises(ConfigError) as err:
            dk.served_method(name, version)
        assert "no vLLM" in one_line(err)


def test_k_rules():
    # chain: any k (the project serves EAGLE-3 at 3 and 5), default the checkpoint's TTT steps
    assert dk.num_speculative_tokens("eagle3", checkpoint_config("eagle3"), 5) == 5
    assert dk.trained_positions("eagle3", checkpoint_config("eagle3")) == 3
    # depths: up to the trained depths
    assert dk.num_speculative_tokens("peagle", checkpoint_config("peagle"), 5) == 5
    with pytest.raises(ConfigError):
        dk.num_speculative_tokens("peagle", checkpoint_config("peagle"), 9)
    # block: the trained block only; the block size is the checkpoint's, else speculators' default
    with pytest.raises(ConfigError) as err:
        dk.num_speculative_tokens("dflash", checkpoint_config("dflash"), 5)
    assert "15" in one_line(err)
    assert dk.num_speculative_tokens("dflash", checkpoint_config("dflash", block_size=8)) == 7
    assert dk.block_size("dflash", {}) == 16 and dk.block_size("dspark", None) == 8
    assert dk.block_size("eagle3", {}) is None


@pytest.mark.parametrize("layers,aux", [(KIMI_LAYERS, [2, 30, 58]), (MINI_LAYERS, [2, 3, 4])])
def test_every_kind_but_mtp_reads_the_same_layers_so_one_extraction_serves_them(layers, aux):
    for name in ("eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress"):
        assert dk.layer_ids(name, layers) == aux
    assert dk.layer_ids("mtp", layers) == [layers]


def test_a_checkpoints_layer_ids_are_read_from_its_kinds_key():
    assert dk.draft_layer_ids("dflash", checkpoint_config("dflash")) == [2, 3, 4]
    assert dk.draft_layer_ids("peagle", checkpoint_config("peagle")) == [2, 3, 4]
    assert dk.draft_layer_ids("dflash", {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}) is None
    assert dk.draft_layer_ids("mtp", checkpoint_config("mtp")) is None


@pytest.fixture(scope="module")
def kimi_tokenizer(miniature):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(miniature["kimi"])


def test_the_mask_token_is_found_in_the_kimi_miniatures_tokenizer(kimi_tokenizer):
    tok = kimi_tokenizer
    assert tok.mask_token_id is None and len(tok) == 716
    # an unused embedding row first (vocab 1024 > 716 tokens: what speculators wrote into the trained checkpoints)
    assert dk.find_mask_token(tok, vocab_size=1024) == 716
    assert dk.mask_token_id("dflash", tok, None, vocab_size=1024) == 716
    # no spare row (Kimi-K2.5: 163840 tokens = its vocab): the pad token, [PAD]
    assert dk.find_mask_token(tok, vocab_size=len(tok)) == tok.pad_token_id == tok.convert_tokens_to_ids("[PAD]")
    assert dk.find_mask_token(tok) == 703
    assert dk.mask_token_id("dspark", tok, 715, vocab_size=1024) == 715  # given wins
    assert len(tok) == 716  # the tokenizer is not changed


class _BareTokenizer:
    mask_token_id = pad_token_id = eos_token_id = unk_token_id = None

    def __len__(self):
        return 1024


def test_a_kind_that_needs_a_mask_token_is_refused_in_one_line_when_none_is_found_or_given():
    for name in ("peagle", "dflash", "dflash2", "dspark", "xpress"):
        with pytest.raises(ConfigError) as err:
            dk.mask_token_id(name, _BareTokenizer(), None, vocab_size=1024)
        assert "--mask-token-id" in one_line(err)
        assert dk.mask_token_id(name, _BareTokenizer(), 7, vocab_size=1024) == 7
    assert dk.mask_token_id("eagle3", _BareTokenizer(), None, vocab_size=1024) is None  # eagle3 needs none
    with pytest.raises(ConfigError) as err:
        dk.mask_token_id("dflash", _BareTokenizer(), 1024, vocab_size=1024)
    assert "outside" in one_line(err)


def test_the_mask_rule_matches_speculators_own(kimi_tokenizer, miniature):
    """speculators' resolve_mask_token_id (which adds <|MASK|> to its own tokenizer copy) picks the same id. Asked of
    the Llama miniature (the Kimi tokenizer under a plain config): for the Kimi one speculators loads the whole
    processor, and transformers' kimi_k25 image processor needs torchvision, which this venv leaves out (vLLM breaks
    with it): plain speculators without --mask-token-id fails on a Kimi-K2.5 target here."""
    from speculators.train.utils import resolve_mask_token_id

    for vocab in (1024, 716):
        assert resolve_mask_token_id(str(miniature["llama"]), vocab) == dk.find_mask_token(kimi_tokenizer, vocab)


def test_the_kinds_defaults_are_speculators_resolved_ones():
    from speculators.train.config.resolution import resolve
    from speculators.train.config.schema import TrainConfig

    for name, info in dk.KINDS.items():
        cfg = resolve(TrainConfig, ["--verifier-name-or-path", "v", "--data-path", "d", "--save-path", "s",
                                    "--speculator-type", name])
        assert cfg.draft.num_layers == info.default_num_layers, name
        assert cfg.loss.loss_fn == info.default_loss, name
        if info.block_draft:
            assert cfg.dflash.block_size == info.default_block_size, name
        if name != "mtp":  # mtp's draft is the verifier's own decoder
            assert cfg.draft.draft_arch == info.draft_arch, name


def test_the_verdict_reports_positions_1_to_k_and_which_were_trained():
    # EAGLE-3 trained with 3 TTT steps, served at 5: positions 4-5 never trained
    assert dk.verdict_positions("eagle3", checkpoint_config("eagle3"), 5) == {
        "positions": [1, 2, 3, 4, 5], "trained": [1, 2, 3], "untrained": [4, 5]}
    block = dk.verdict_positions("dflash", checkpoint_config("dflash"), 15)
    assert block["positions"] == list(range(1, 16)) == block["trained"] and block["untrained"] == []


def test_a_kind_measured_to_serve_on_the_cpu_has_a_method_in_vllm_032():
    for info in dk.KINDS.values():
        if info.cpu_serves:
            assert dk.served_method(info, "0.32.0")
        assert info.cpu, info.name  # every kind says what the CPU build did


def test_stage_04_trains_only_the_kinds_a_checked_vllm_serves():
    for name in ("eagle3", "peagle", "dflash", "dflash2", "dspark"):
        assert dk.trainable(name).name == name
    for name in ("xpress", "mtp"):
        with pytest.raises(ConfigError) as err:
            dk.trainable(name)
        assert f"no vLLM checked (0.26 and 0.32) serves a {name} draft" in one_line(err)


class _Draft:
    """draft_config.json's settings as config/schema.py DraftConfig holds them (its defaults)."""
    draft_arch, num_layers, ttt_steps, norm_before_residual, fc_norm, norm_before_fc = "llama", 1, 3, True, True, False
    block_size = None

    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_only_eagle3_reads_the_eagle3_keys_and_another_kind_gets_its_own_defaults():
    lead, tail = dk.architecture_flags("eagle3", _Draft(), 5)
    assert lead == ["--draft-arch", "llama", "--num-layers", "1", "--ttt-steps", "5"]
    assert tail == ["--no-norm-before-fc", "--fc-norm"]
    assert dk.architecture_flags("eagle3", _Draft(norm_before_residual=False, fc_norm=False, norm_before_fc=True), 3)[1] \
        == ["--no-norm-before-residual", "--norm-before-fc"]
    for name in ("peagle", "dflash", "dflash2", "dspark"):  # EAGLE-3's values: the kind's own defaults
        assert dk.architecture_flags(name, _Draft(), 3) == ([], [])
    assert dk.architecture_flags("dflash", _Draft(num_layers=2, block_size=4), 3) == (
        ["--num-layers", "2", "--block-size", "4"], [])
    assert dk.num_draft_layers("dflash", 1) == 5 and dk.num_draft_layers("dflash", 2) == 2
    assert dk.num_draft_layers("eagle3", 1) == 1 and dk.num_draft_layers("peagle", 1) == 1
    assert dk.block_size_problem("dflash", 4) is None and dk.block_size_problem("dflash", None) is None
    assert "no block" in dk.block_size_problem("peagle", 4)
    assert dk.layer_indices_problem("dflash", 1, [4]) is None and dk.layer_indices_problem("eagle3", 1, [1])


def test_an_eagle3_identity_is_the_one_before_the_kinds_another_names_its_kind():
    before = {"draft_arch": "llama", "num_layers": 1, "ttt_steps": 3, "fc_norm": True}
    assert dk.identity_settings("eagle3", {**before, "speculator_type": "eagle3", "block_size": None}) == before
    assert dk.identity_extra("eagle3", 3, 716) == {"ttt_steps": 3}  # the mask token is not part of an eagle3 run
    dflash = dk.identity_settings("dflash", {**before, "speculator_type": "dflash", "block_size": 4})
    assert dflash == {"num_layers": 1, "speculator_type": "dflash", "block_size": 4}
    assert dk.identity_extra("dflash", 3, 716) == {"mask_token_id": 716}
