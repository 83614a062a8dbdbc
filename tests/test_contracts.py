"""Stage contracts: a stage fed another stage's outputs for a different target/tokenizer fails fast."""

import json
import shutil
import time

import pytest

from eagle3_pipeline.contract import read_manifest, write_manifest
from eagle3_pipeline.errors import ContractError
from eagle3_pipeline.manifest import VocabManifest

from conftest import SAMPLES, run_stage


def test_extract_refuses_data_prepared_for_another_target(kimi_run, llama_target):
    start = time.monotonic()
    result = run_stage("extract", "--target", llama_target, "--data", kimi_run["data"], "--backend", "hf", check=False)
    assert result.returncode == 3
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {kimi_run['data'] / 'manifest.json'}: target config mismatch")
    assert time.monotonic() - start < 60  # before any model is loaded


def test_extract_refuses_data_prepared_with_another_tokenizer(tmp_path, kimi_run, kimi_target):
    other = tmp_path / "kimi-other-tokenizer"
    shutil.copytree(kimi_target, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_stage("extract", "--target", other, "--data", kimi_run["data"], "--backend", "hf", check=False)
    assert result.returncode == 3 and "tokenizer mismatch" in result.stderr


@pytest.mark.slow
def test_train_refuses_a_vocab_built_from_other_data(tmp_path, kimi_run, kimi_target):
    run_stage("prepare", "--target", kimi_target, "--data", SAMPLES / "sharegpt.jsonl", "--output", tmp_path / "other",
              "--val-ratio", "0.4")
    run_stage("vocab", "--data", tmp_path / "other", "--output", tmp_path / "vocab", "--draft-vocab-size", "256")
    result = run_stage("train", "--target", kimi_target, "--data", kimi_run["data"], "--vocab", tmp_path / "vocab",
                       "--output", tmp_path / "ckpt", check=False)
    assert result.returncode == 3
    assert f"{tmp_path / 'vocab' / 'manifest.json'}: built from a different 'prepare' output" in result.stderr


def test_train_refuses_when_a_stage_is_missing(tmp_path, kimi_run, kimi_target):
    data = tmp_path / "data"
    shutil.copytree(kimi_run["data"], data, ignore=shutil.ignore_patterns("hidden_states"))
    result = run_stage("train", "--target", kimi_target, "--data", data, "--vocab", kimi_run["vocab"],
                       "--output", tmp_path / "ckpt", check=False)
    assert result.returncode == 3 and "run 02_extract_hidden_states.py first" in result.stderr


def test_manifest_checks_stage_schema_and_completion(tmp_path):
    write_manifest(tmp_path, VocabManifest(complete=False))
    with pytest.raises(ContractError, match="did not finish"):
        read_manifest(tmp_path, "vocab", "--vocab")
    with pytest.raises(ContractError, match="written by stage 'vocab', expected 'prepare'"):
        read_manifest(tmp_path, "prepare", "--data")
