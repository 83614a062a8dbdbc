"""The multi-GPU scaling prediction (eagle3_pipeline/scaling.py): its parameter count against speculators'
own draft model, the run plan's communication line for the 8-GPU profiles, and the results file."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline import scaling
from eagle3_pipeline.plan import format_plan, make_plan

from conftest import REPO

RESULTS = REPO / "bench" / "results" / "scaling-prediction.json"
EIGHT_GPU = {"rtx-pro-6000-8x": "PCIe Gen5 x16, no NVLink", "b300-8x": "NVLink 5", "h200-8x": "NVLink 4"}


@pytest.fixture(scope="module")
def kimi_config_dir(tmp_path_factory):
    from benchlib.throughput import kimi_k25_config

    folder = tmp_path_factory.mktemp("targets") / "Kimi-K2.5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(kimi_k25_config()))
    return folder


def _speculators_trainable(config_dir) -> tuple[int, int]:
    """speculators' Eagle3DraftModel for this verifier, on the meta device: (trainable, layer) parameters."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3.config import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(verifier_name_or_path=str(config_dir), num_layers=1, draft_arch="llama",
                                                   hidden_act="silu", sliding_window=2048, full_attention_indices=[])
    layer_config._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=32000, norm_before_residual=True,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=str(config_dir), architectures=["x"])))
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    return sum(trainable.values()), sum(v for n, v in trainable.items() if n.startswith("layers."))


@pytest.mark.slow  # imports speculators' model code (seconds)
def test_the_gradient_bytes_are_speculators_trainable_parameters(kimi_config_dir, kimi_target):
    for config_dir in (kimi_config_dir, kimi_target):
        text_config = json.loads((config_dir / "config.json").read_text())["text_config"]
        trainable, layer = _speculators_trainable(config_dir)
        assert scaling.trainable_parameters(scaling.draft_geometry(text_config)) == trainable
    assert trainable > 0 and layer / trainable > 0.5  # the TTT-reused layer holds most of the gradient bytes


def test_the_plan_has_a_communication_line_for_each_8_gpu_profile(kimi_config_dir, tmp_path):
    lines = {}
    for profile, link in EIGHT_GPU.items():
        text = format_plan(make_plan(str(kimi_config_dir), profile, str(tmp_path), rows=100_000, tokens_per_row=2048))
        [line] = [x for x in text.splitlines() if x.strip().startswith("communication:")]
        assert f"over {link} (" in line and "5.29 GB per GPU per step" in line and "not hidden behind" in line
        lines[profile] = line
    efficiency = {p: scaling.predict(json.loads((kimi_config_dir / "config.json").read_text())["text_config"], p, 8)
                  for p in EIGHT_GPU}
    spec = {p: e["predicted"]["spec"]["efficiency"] for p, e in efficiency.items()}
    achieved = {p: e["predicted"]["achieved"]["efficiency"] for p, e in efficiency.items()}
    assert spec["rtx-pro-6000-8x"] < min(spec["b300-8x"], spec["h200-8x"]) < 1  # PCIe scales worst
    assert all(achieved[p] < spec[p] for p in EIGHT_GPU)
    assert f"{spec['h200-8x']:.1%} (spec)" in lines["h200-8x"]
    one = format_plan(make_plan(str(kimi_config_dir), "h200-8x", str(tmp_path), rows=10, tokens_per_row=10, gpus=1))
    assert "communication: none (1 GPU" in one


def test_two_h200s_are_predicted_as_measured():
    """The calibration point: the 'achieved' rate reproduces the 2-H200 step it was taken from."""
    params = 756_051_968
    fraction = scaling.achieved_fraction(params)
    added_ms = scaling.ring_allreduce_bytes(params, 2) / (scaling.INTERCONNECTS["nvlink4"]["gb_s"] * 1e9 * fraction) * 1e3
    assert added_ms == pytest.approx(scaling.TWO_H200_STEP_MS[1] - scaling.TWO_H200_STEP_MS[0])


def test_the_results_file_is_what_the_entry_writes(kimi_config_dir, tmp_path):
    out = tmp_path / "scaling-prediction.json"
    assert scaling.main(["--target", str(kimi_config_dir), "--output", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(RESULTS.read_text())
    report = json.loads(out.read_text())
    assert sorted(report["profiles"]) == sorted(EIGHT_GPU)
    for profile in report["profiles"].values():
        assert sorted(profile["per_gpu_count"]) == ["1", "2", "4", "8"]
        assert all(entry["measured"] is None for entry in profile["per_gpu_count"].values())  # the slot for item 4


def test_the_8_gpu_profiles_use_ddp_as_predicted():
    from eagle3_pipeline.config import load_profile, profile_path

    for profile in EIGHT_GPU:
        assert load_profile(profile)["train"]["fsdp"] is False
        raw = json.loads(profile_path(profile).read_text())
        assert raw["_hardware"]["interconnect"] in scaling.INTERCONNECTS and "train.fsdp" in raw["_why"]
