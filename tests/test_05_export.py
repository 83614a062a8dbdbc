"""Stage 05: a speculators-format draft directory that loads back and names its verifier."""

import json

import pytest

from conftest import run_stage


def test_export_loads_back_with_speculators(kimi_run, kimi_target):
    import speculators.models  # noqa: F401
    from speculators.model import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(kimi_run["draft"]))
    assert type(model).__name__ == "Eagle3DraftModel"
    assert model.d2t.shape == (256,) and model.t2d.shape == (1024,)
    assert len(model.fc_norm) == 3 and model.input_norm is None  # draft_config.json's default: EAGLE 3.1's norms


def test_export_config_has_what_vllm_reads(kimi_run, kimi_target):
    draft = kimi_run["draft"]
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["draft_vocab_size"] == 256
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    # the norms before fc as trained (04's manifest records draft_config.json's), which vLLM builds from this file
    trained = json.loads((kimi_run["checkpoints"] / "manifest.json").read_text())["draft_config"]
    assert (trained["fc_norm"], trained["norm_before_fc"]) == (config["fc_norm"], config["norm_before_fc"]) == (True, False)
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="np") as weights:
        norms = sorted(name for name in weights.keys() if "norm" in name and not name.startswith("layers."))
    assert norms == ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight"]
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(kimi_target.resolve())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert not (draft / "optimizer_state_dict.pt").exists()
    command = (draft / "serve_command.txt").read_text()
    assert '"method": "eagle3"' in command and "--language-model-only" in command and str(draft.resolve()) in command


def test_rerun_is_a_no_op(kimi_run):
    result = run_stage("export", "--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output", kimi_run["draft"])
    assert "already exported" in result.stderr and "vllm serve" in result.stdout


@pytest.mark.slow
def test_a_draft_vocab_as_large_as_the_target_exports(tmp_path, kimi_run, kimi_target):
    """speculators keeps no d2t when the draft vocab is the whole target vocab (found by the H200 smoke)."""
    run_stage("vocab", "--data", kimi_run["data"], "--output", tmp_path / "vocab", "--draft-vocab-size", "1024")
    run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"],
              "--vocab", tmp_path / "vocab", "--output", tmp_path / "ckpt", "--epochs", "1", "--logger", "")
    result = run_stage("export", "--checkpoints", tmp_path / "ckpt", "--output", tmp_path / "draft")
    assert "vllm serve" in result.stdout
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["draft_vocab_size"] == 1024


def test_a_hub_verifier_name_is_written_and_the_check_loads_the_trained_target(tmp_path, kimi_run, kimi_target):
    """README's real run passes `--verifier-name moonshotai/Kimi-K2.5`. Before: 05's load-back check had speculators
    fetch that name's embeddings and head (a traceback offline; on a box with a hub, a download of Kimi's shards)."""
    result = run_stage("export", "--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output",
                       tmp_path / "draft", "--verifier-name", "moonshotai/Kimi-K2.5",
                       env={"HF_HUB_OFFLINE": "1"})
    assert "Traceback" not in result.stderr
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "moonshotai/Kimi-K2.5"
