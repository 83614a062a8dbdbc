"""Stage 04 trains other speculators draft kinds than EAGLE-3 (issue 62 item 1): speculators' real trainer on the Kimi
miniature, a few steps each; the kinds no vLLM serves and a stage 02 of other layers refused in one line; an eagle3
run's identity as it was before the kinds existed."""

import json
import shutil

import pytest

from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG, DraftConfig, TrainConfig, build_config
from eagle3_pipeline.draft_kinds import EAGLE3_KEYS
from eagle3_pipeline.training import speculators_argv

from conftest import run_stage

# speculators flags that are EAGLE-3's architecture: another kind gets speculators' own defaults instead
EAGLE3_FLAGS = ("--ttt-steps", "--draft-arch", "--fc-norm", "--norm-before-fc", "--no-norm-before-fc",
                "--no-norm-before-residual")
KIMI_MINI_MASK = 716  # the Kimi miniature's tokenizer: no mask token, 716 tokens < 1024 rows (draft_kinds.find_mask_token)


def _train(kimi_run, kimi_target, out, *flags, check=True):
    return run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"], "--vocab",
                     kimi_run["vocab"], "--output", out, "--logger", "", *flags, check=check)


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kind,settings,launch", [
    # a small block and 2 layers: seconds on the CPU; sharded with FSDP over 2 gloo ranks, as a 5-layer DFlash at
    # Kimi-K2.5's width must be (too large for one 80 GB card: bench/README.md "Draft kinds beside EAGLE-3")
    ("dflash", {"block_size": 4, "num_layers": 2}, ["--nproc", "2", "--fsdp"]),
    ("peagle", {}, []),
])
def test_another_kind_trains_with_its_own_defaults_and_the_manifest_records_it(tmp_path, kimi_run, kimi_target, kind,
                                                                               settings, launch):
    """--speculator-type overrides draft_config.json's eagle3; the EAGLE-3 keys stay out of the trainer's call, the
    mask token is the target tokenizer's, and the manifest, identity and checkpoint name the kind."""
    draft_file = tmp_path / "draft_config.json"
    draft_file.write_text(json.dumps({**json.loads(DEFAULT_DRAFT_CONFIG.read_text()), **settings}))
    out = tmp_path / kind
    _train(kimi_run, kimi_target, out, "--speculator-type", kind, "--draft-config", draft_file,
           "--epochs", "1", "--max-steps", "2", *launch)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["fsdp"] == ("--fsdp" in launch)
    assert ("--fsdp-shard" in (out / "command.txt").read_text()) == ("--fsdp" in launch)
    assert manifest["complete"] and manifest["speculator_type"] == kind == manifest["draft_config"]["speculator_type"]
    assert manifest["mask_token_id"] == KIMI_MINI_MASK and manifest["summary"]["speculator_type"] == kind
    settings_id = manifest["identity"]["settings"]
    assert settings_id["draft_config"]["speculator_type"] == kind and settings_id["mask_token_id"] == KIMI_MINI_MASK
    assert not set(EAGLE3_KEYS) & set(settings_id["draft_config"]) and "ttt_steps" not in settings_id
    command = (out / "command.txt").read_text().split()
    assert command[command.index("--speculator-type") + 1] == kind
    assert command[command.index("--mask-token-id") + 1] == str(KIMI_MINI_MASK)
    assert not set(EAGLE3_FLAGS) & set(command), command
    for key, value in settings.items():  # what the draft config sets for the kind is passed
        assert command[command.index("--" + key.replace("_", "-")) + 1] == str(value)
    checkpoint = json.loads((out / "checkpoint_best" / "config.json").read_text())
    assert checkpoint["speculators_model_type"] == kind and checkpoint.get("mask_token_id") == KIMI_MINI_MASK
    if "block_size" in settings:
        assert checkpoint["block_size"] == settings["block_size"]
    assert f"{kind} draft training summary" in (out / "summary.txt").read_text()


@pytest.mark.parametrize("kind", ["xpress", "mtp"])
def test_a_kind_no_vllm_serves_is_refused_in_one_line(tmp_path, kind):
    """Before anything is read: the pipeline hands vLLM a draft it can serve."""
    result = run_stage("train", "--target", tmp_path / "t", "--data", tmp_path / "d", "--vocab", tmp_path / "v",
                       "--output", tmp_path / "o", "--speculator-type", kind, "--check", check=False)
    line = _last_line(result)
    assert result.returncode == 2 and line == result.stderr.strip(), result.stderr
    assert f"speculator_type {kind}: no vLLM checked (0.26 and 0.32) serves a {kind} draft" in line
    assert "choose eagle3, peagle, dflash, dflash2, dspark" in line
    draft_file = tmp_path / "draft_config.json"  # the same from draft_config.json
    draft_file.write_text(json.dumps({"speculator_type": kind}))
    result = run_stage("train", "--target", tmp_path / "t", "--data", tmp_path / "d", "--vocab", tmp_path / "v",
                       "--output", tmp_path / "o", "--draft-config", draft_file, "--check", check=False)
    assert result.returncode == 2 and f"speculator_type {kind}: no vLLM checked" in _last_line(result)


def test_a_block_size_for_a_kind_without_a_block_is_refused_in_one_line(tmp_path):
    draft_file = tmp_path / "draft_config.json"
    draft_file.write_text(json.dumps({"block_size": 4}))
    result = run_stage("train", "--target", tmp_path / "t", "--data", tmp_path / "d", "--vocab", tmp_path / "v",
                       "--output", tmp_path / "o", "--draft-config", draft_file, "--check", check=False)
    assert result.returncode == 2 and _last_line(result) == result.stderr.strip()
    assert _last_line(result).startswith(f"error: {draft_file}: block_size 4: the eagle3 kind has no block")


def test_every_kind_trains_on_the_layers_02_extracted_and_other_layer_ids_are_refused_in_one_line(
        tmp_path, kimi_run, kimi_target):
    """02 run with --layer-ids 1 3 4: a dflash draft trains on them without repeating them (speculators'
    --target-layer-ids from 02's manifest, as for eagle3: one extraction serves every kind); 04 --layer-ids other than
    02's is refused in one line naming 02's states."""
    data = tmp_path / "data"
    shutil.copytree(kimi_run["data"], data, ignore=shutil.ignore_patterns("hidden_states"))
    run_stage("extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--layer-ids", "1", "3", "4")
    flags = ["--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--vocab", kimi_run["vocab"],
             "--output", tmp_path / "out", "--speculator-type", "dflash", "--check"]
    assert run_stage("train", *flags, check=False).returncode == 0
    result = run_stage("train", *flags, "--layer-ids", "2", "3", "4", check=False)
    assert result.returncode != 0 and _last_line(result).startswith(
        f"error: --layer-ids [2, 3, 4]: stage 02 extracted [1, 3, 4] (+ the final layer) into {data / 'hidden_states'}"
    ), result.stderr[-2000:]


def test_an_eagle3_run_keeps_the_identity_it_had_before_the_kinds(tmp_path, kimi_run, kimi_target):
    """The identity an eagle3 run records is the one 04 computed before speculator_type, block_size and
    --mask-token-id existed (no kind, no mask token in it; the draft config's old keys, ttt_steps), and a draft
    config without the new keys is the same run: the rerun over the finished run has nothing to do."""
    manifest = json.loads((kimi_run["checkpoints"] / "manifest.json").read_text())
    settings = manifest["identity"]["settings"]
    before_kinds = DraftConfig().model_dump(exclude={"description", "speculator_type", "block_size"})
    assert settings["draft_config"] == before_kinds and settings["ttt_steps"] == 3
    assert "mask_token_id" not in settings and "speculator_type" not in json.dumps(manifest["identity"])
    assert manifest["speculator_type"] == "eagle3"
    old_file = tmp_path / "draft_config.json"  # a draft config from before the kinds: eagle3
    old_file.write_text(json.dumps({k: v for k, v in json.loads(DEFAULT_DRAFT_CONFIG.read_text()).items()
                                    if k not in ("speculator_type", "block_size", "_speculator_type")}))
    out = tmp_path / "checkpoints"
    shutil.copytree(kimi_run["checkpoints"], out, symlinks=True)
    for flags in (["--draft-config", old_file], ["--speculator-type", "eagle3"]):
        result = _train(kimi_run, kimi_target, out, *flags)
        assert "already trained with these settings and inputs; nothing to do" in result.stderr, result.stderr[-2000:]


def test_only_eagle3_gets_the_eagle3_flags():
    cfg, _ = build_config(TrainConfig, {"target": "t", "data": "d", "vocab": "v", "output": "o"})
    eagle3 = speculators_argv(cfg, DraftConfig(), "/t", [2, 30, 58], 32000, 0.9, 163839, gpu=True)
    assert {"--ttt-steps", "--draft-arch", "--fc-norm", "--no-norm-before-fc"} <= set(eagle3)
    assert eagle3[eagle3.index("--speculator-type") + 1] == "eagle3" and "--block-size" not in eagle3
    dflash = speculators_argv(cfg, DraftConfig(speculator_type="dflash"), "/t", [2, 30, 58], 32000, 0.9, 163839, gpu=True)
    assert not set(EAGLE3_FLAGS) & set(dflash) and "--num-layers" not in dflash and "--block-size" not in dflash
    assert dflash[dflash.index("--mask-token-id") + 1] == "163839"
    three = speculators_argv(cfg, DraftConfig(speculator_type="dspark", num_layers=3, block_size=8), "/t", [2, 30, 58],
                             32000, 0.9, 163839, gpu=True)
    assert three[three.index("--num-layers") + 1] == "3" and three[three.index("--block-size") + 1] == "8"


def test_dflash2_over_a_draft_vocabulary_smaller_than_the_targets_is_refused_in_one_line(tmp_path, kimi_run, kimi_target):
    """speculators 0.9.0's DFlash2 raises at model build unless its head is the target's whole vocabulary (seen on the
    SmolLM2 testbed: a 32K mapping, 49,152 tokens); 04 --check says so first, naming the vocabulary folder and the 03
    command that builds one (the cpu-mini run's 256-token mapping); a vocabulary of the target's size passes."""
    target_vocab = json.loads((kimi_target / "config.json").read_text())["text_config"]["vocab_size"]
    flags = ["--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"], "--output", tmp_path / "out",
             "--speculator-type", "dflash2", "--check"]
    result = run_stage("train", *flags, "--vocab", kimi_run["vocab"], check=False)
    assert result.returncode == 2 and _last_line(result) == result.stderr.strip(), result.stderr
    assert _last_line(result) == (
        f"error: {kimi_run['vocab']}: a dflash2 draft predicts over the target's whole vocabulary ({target_vocab:,} "
        f"tokens; speculators 0.9.0 refuses another size), this one maps 256: build it with 03_build_vocab_mapping.py "
        f"--draft-vocab-size {target_vocab} into another --output")
    full = tmp_path / "vocab-full"
    run_stage("vocab", "--profile", "cpu-mini", "--data", kimi_run["data"], "--output", full, "--draft-vocab-size",
              str(target_vocab))
    result = run_stage("train", *flags, "--vocab", full, check=False)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "out").exists()  # --check writes nothing
