"""Stage 05: a speculators-format draft directory that loads back and names its verifier."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_stage


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


def test_an_output_that_is_a_symlink_to_a_folder_is_followed_and_a_dangling_one_named(kimi_run, tmp_path):
    """Issue 64 R. Before: 05 into an --output that is a symlink to a folder exited 74 blaming "permissions, mount,
    free space", never naming the link. Now the export goes into the folder the link points to (the link kept)."""
    real, link = tmp_path / "real", tmp_path / "draft"
    real.mkdir()
    link.symlink_to(real)
    result = run_stage("export", "--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output", link)
    assert link.is_symlink() and (real / "model.safetensors").is_file() and (real / "manifest.json").is_file()
    assert f"{link}: a symlink; exporting into the folder it points to" in result.stderr
    again = run_stage("export", "--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output", link)
    assert "already exported" in again.stderr
    dangling = tmp_path / "gone"
    dangling.symlink_to(tmp_path / "nowhere")
    refused = run_stage("export", "--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output",
                        dangling, check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: {dangling}: --output is a symlink to nothing (a dangling link) ({tmp_path / 'nowhere'}); give a "
        f"folder, or a link to one")


# --- issue 63: the model card, --check on a draft folder, SGLang's layout -----------------------------------------

def card_fields_match_the_run(draft: Path) -> dict:
    """The card in `draft` read against the run's manifests (05's, 04's, 03's, 01's) and summary: every figure the
    card states is the one its record holds. Returns the front matter."""
    import yaml

    from eagle3_pipeline.model_card import MEASURED_BEGIN, MEASURED_END

    text = (draft / "README.md").read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    export = json.loads((draft / "manifest.json").read_text())
    train = json.loads((Path(export["inputs"]["train"]["path"]) / "manifest.json").read_text())
    prepare = json.loads((Path(train["inputs"]["prepare"]["path"]) / "manifest.json").read_text())
    vocab_dir = Path(train["inputs"]["vocab"]["path"])
    coverage = json.loads((vocab_dir / "coverage.json").read_text())
    target = export["target"]
    assert front["base_model"] == (export["verifier_name"] if export["verifier_name"] != target["path"]
                                   else Path(target["path"]).name)
    assert front["library_name"] == "speculators" and "eagle3" in front["tags"] and "license" not in front
    counts = prepare["counts"]
    for fact in (target["config_sha256"], f"conversations: {counts['conversations']:,}", f"tokens: {counts['tokens']:,}",
                 f"trained (assistant, loss 1): {counts['loss_tokens']:,}",
                 f"rows regenerated by the target (already tokenized): "
                 f"{100 * counts['pretokenized_rows'] / counts['rows']:.1f}%",
                 f"`{prepare['config']['data']}`", f"{coverage['draft_vocab_size']:,} draft tokens",
                 f"coverage of trained tokens: {100 * coverage['train_coverage']:.1f}%",
                 f"{train['draft_config']['num_layers']} llama decoder layer(s)",
                 f"fc_norm (an RMSNorm per aux hidden state before fc): {str(train['draft_config']['fc_norm']).lower()}",
                 f"epochs: {train['config']['epochs']}; optimizer steps: {train['trained']['optimizer_steps']}",
                 f"optimizer: {train['config']['optimizer']}, lr {train['config']['lr']}",
                 f"Checkpoint exported: `{export['checkpoint']}`", "CPUs: 1; training CPU-hours: ",
                 "vllm serve ", "python -m sglang.launch_server ", "--speculative-algorithm EAGLE3", MEASURED_BEGIN,
                 MEASURED_END):
        assert fact in text, f"{fact!r} not in the card"
    for epoch, row in train["summary"]["checkpoint_choice"]["by_epoch"].items():
        assert f"| {epoch} | {row['tau']:.3f}".rstrip("0").rstrip(".") in text, (epoch, row)
    assert export["card"]["name"] == "README.md" and "README.md" not in export["output_files"]
    return front


def test_the_draft_folder_holds_a_model_card_filled_from_the_run(kimi_run, kimi_target):
    """Issue 63.1: README.md, a Hugging Face card whose every figure is read from the run's records."""
    front = card_fields_match_the_run(kimi_run["draft"])
    assert front["base_model"] == kimi_target.name


@pytest.mark.skipif(not (REPO / "work" / "smoke" / "draft" / "manifest.json").is_file(),
                    reason="run `make smoke` first: this reads its draft folder")
def test_make_smokes_draft_folder_holds_a_card_filled_from_the_run():
    """Issue 63's must-show: `make smoke`'s work/smoke/draft, read against its own manifests."""
    card_fields_match_the_run(REPO / "work" / "smoke" / "draft")


def test_check_on_a_draft_folder_checks_what_a_hub_user_meets(kimi_run, tmp_path):
    """Issue 63.4: --check on a finished export: the card parses and names its base model, the config loads with
    speculators' config class, every recorded file is as written; a problem is one line naming the file. A card
    edited by its user (outside the digest record) is no reason to redo the export."""
    draft = tmp_path / "draft"
    shutil.copytree(kimi_run["draft"], draft)
    flags = ("--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output", draft, "--check")
    checked = run_stage("export", *flags)
    lines = [line for line in checked.stdout.splitlines() if line.startswith("05 --check: ")]
    assert len(lines) == 3 and "base_model" in lines[0] and "loads (Eagle3SpeculatorConfig)" in lines[1], lines
    card = draft / "README.md"
    card.write_text(card.read_text() + "\nA note of ours.\n")  # a user's edit: the export stays finished
    rerun = run_stage("export", *flags[:-1])
    assert "already exported" in rerun.stderr and card.read_text().endswith("A note of ours.\n")
    card.write_text("# no front matter\n")
    bad = run_stage("export", *flags, check=False)
    assert bad.returncode == 3 and bad.stderr.strip().splitlines()[-1].startswith(f"error: {card}: no YAML front matter")
    shutil.copyfile(kimi_run["draft"] / "README.md", card)
    with open(draft / "model.safetensors", "r+b") as handle:
        handle.seek(-3, 2)
        byte = handle.read(1)
        handle.seek(-3, 2)
        handle.write(bytes([byte[0] ^ 1]))
    changed = run_stage("export", *flags, check=False)
    assert changed.returncode == 3 and changed.stderr.strip().splitlines()[-1] == (
        f"error: {draft / 'model.safetensors'}: same size, other bytes since 05_export.py wrote it; rerun 05_export.py")


def test_the_sglang_layout_refuses_a_draft_its_loader_does_not_build(kimi_run, tmp_path):
    """Issue 63.3: the default draft (fc_norm, speculators' residual and output norms) is not what SGLang's
    LlamaForCausalLMEagle3 builds: refused in one line naming each, nothing written."""
    out = tmp_path / "draft"
    refused = run_stage("export", "--profile", "cpu-mini", "--checkpoints", kimi_run["checkpoints"], "--output", out,
                        "--layout", "sglang", check=False)
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and line.startswith("error: ") and "--layout sglang: SGLang's EAGLE-3 loader" in line
    assert "fc_norm (an RMSNorm per aux hidden state before fc)" in line and "norm_output" in line, line
    assert not out.exists()
