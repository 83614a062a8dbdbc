"""Stage 02 --storage fp8: speculators' fp8 hidden-state format, end to end (02 -> 04 -> 05).

The files must be what speculators' own FP8Transfer (`--hidden-states-backend fp8`) reads, their
values within fp8's rounding of the same row's states in full precision, and refused by the
validator when they are not well formed.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.extract.common import SCALES_KEY, BadHiddenStates, check_hidden_states, quantize_fp8
from eagle3_pipeline.files import LOCK_NAME
from eagle3_pipeline.hidden_states import HS_DIRNAME, StateFormat, hs_file

from conftest import run_stage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, kimi_target, kimi_run):
    """Stages 02-05 on the miniature with fp8 hidden states, beside the same data's fp32 states: the shared run's
    (read only), whose prepared rows, copied without its states, are the fp8 run's input (a moved stage-01 output
    is the same input: contract.py)."""
    work = tmp_path_factory.mktemp("fp8")
    data, ref = work / "data", kimi_run["data"]  # ref: conftest.run_pipeline's cpu-mini run of the same samples
    shutil.copytree(ref, data, ignore=shutil.ignore_patterns(HS_DIRNAME, LOCK_NAME))
    run_stage("extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--storage", "fp8")
    run_stage("vocab", "--profile", "cpu-mini", "--data", data, "--output", work / "vocab")
    run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--vocab", work / "vocab",
              "--output", work / "checkpoints", "--logger", "")
    run_stage("export", "--profile", "cpu-mini", "--checkpoints", work / "checkpoints", "--output", work / "draft")
    return {"work": work, "data": data, "ref": ref}


def test_fp8_files_are_what_speculators_fp8_transfer_reads_within_fp8_rounding(fp8_run):
    from hs_connectors.transfer import FP8Transfer

    hs, ref = fp8_run["data"] / "hidden_states", fp8_run["ref"] / "hidden_states"
    manifest = json.loads((hs / "manifest.json").read_text())
    assert manifest["complete"] and manifest["storage"] == "fp8"
    transfer = FP8Transfer(hs, dequantize_dtype=torch.float32)
    rows = manifest["counts"]["rows"]
    for i in range(rows):
        raw, full = load_file(str(hs_file(hs, i))), load_file(str(hs_file(ref, i)))
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw[SCALES_KEY].shape == (len(raw["token_ids"]), 1, 1)
        sample = transfer.get_cached(i)
        assert SCALES_KEY not in sample and torch.equal(sample["token_ids"], full["token_ids"])
        expected = full["hidden_states"].float()
        # e4m3: 3 mantissa bits (relative step 2^-3, rounding half of it) and subnormals of 2^-9 x the token's scale
        bound = expected.abs() * 2.0**-4 + raw[SCALES_KEY] * 2.0**-9 + 1e-6
        assert ((sample["hidden_states"] - expected).abs() <= bound).all(), f"row {i}"
    bytes_fp8 = sum(hs_file(hs, i).stat().st_size for i in range(rows))
    bytes_fp32 = sum(hs_file(ref, i).stat().st_size for i in range(rows))
    assert bytes_fp8 < bytes_fp32 / 3.5  # 1 byte + a per-token scale vs 4 bytes a value


def test_training_reads_fp8_files_through_speculators_fp8_backend_and_exports(fp8_run):
    command = (fp8_run["work"] / "checkpoints" / "command.txt").read_text()
    assert "--hidden-states-backend fp8" in command
    assert json.loads((fp8_run["work"] / "checkpoints" / "manifest.json").read_text())["complete"]
    assert (fp8_run["work"] / "draft" / "config.json").is_file()


def test_a_rerun_with_the_other_storage_is_refused_never_mixed(fp8_run, kimi_target):
    result = run_stage("extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", fp8_run["data"], check=False)
    assert result.returncode != 0
    assert "settings.storage = \"fp8\" there, \"dtype\" in this run" in result.stderr


def test_fp8_bytes_per_token_are_half_of_bf16_plus_the_scale():
    assert StateFormat("fp8").bytes_per_token(7168, 4) == 28_676
    assert StateFormat("dtype", "bfloat16").bytes_per_token(7168, 4) == 57_344


@pytest.mark.reliability
def test_validator_refuses_malformed_fp8_files(fp8_run, tmp_path):
    hs = fp8_run["data"] / "hidden_states"
    data = load_file(str(hs_file(hs, 0)))
    ids = data["token_ids"].tolist()
    slots, hidden = data["hidden_states"].shape[1:]

    def check(states, scales, dtype=torch.float8_e4m3fn):
        check_hidden_states(states, data["token_ids"], ids, slots, hidden, "f", dtype, scales)

    check(data["hidden_states"], data[SCALES_KEY])  # the real file passes
    with pytest.raises(BadHiddenStates, match="need hidden_states_scales float32"):
        check(data["hidden_states"], None)
    with pytest.raises(BadHiddenStates, match="non-finite or non-positive scales"):
        check(data["hidden_states"], -data[SCALES_KEY])
    with pytest.raises(BadHiddenStates, match="dtype bfloat16, the directory's is float8_e4m3fn"):
        check(data["hidden_states"].float().bfloat16(), None)
    with pytest.raises(BadHiddenStates, match="only fp8 files carry scales"):
        check(data["hidden_states"].float(), data[SCALES_KEY], dtype=torch.float32)
    # a broken backend's constant slot, quantized as stage 02 does: refused on the dequantized values
    states = load_file(str(hs_file(fp8_run["ref"] / "hidden_states", 0)))["hidden_states"].clone()
    states[:, 1] = 0.5
    quantized = quantize_fp8(states)
    with pytest.raises(BadHiddenStates, match=r"slot\(s\) \[1\]"):
        check(quantized["hidden_states"], quantized[SCALES_KEY])
    save_file({**data, SCALES_KEY: torch.zeros_like(data[SCALES_KEY])}, str(tmp_path / "zero-scale.safetensors"))
    with pytest.raises(BadHiddenStates, match="non-positive"):
        loaded = load_file(str(tmp_path / "zero-scale.safetensors"))
        check(loaded["hidden_states"], loaded[SCALES_KEY])
