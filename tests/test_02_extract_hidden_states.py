"""Stage 02 (HF backend): files in speculators' layout, equal to the target's own hidden states."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from eagle3_pipeline.extract.common import BadHiddenStates, ExtractedSample, land_sample, partition_indices
from eagle3_pipeline.extract.hf import load_text_model
from eagle3_pipeline.prepared import load_rows
from eagle3_pipeline.target import load_target_info


def test_hidden_states_equal_the_targets_output_hidden_states_and_final_slot_is_pre_norm(kimi_run, kimi_target):
    info = load_target_info(kimi_target)
    manifest = json.loads((kimi_run["data"] / "hidden_states" / "manifest.json").read_text())
    layer_ids = manifest["layer_ids"]
    assert layer_ids == [2, 3, 4, 6] and manifest["dtype"] == "float32"  # cpu-mini extracts in fp32
    model = load_text_model(info, torch.float32, torch.device("cpu"), False)
    rows = load_rows(kimi_run["data"])
    for index in (0, len(rows) - 1):
        saved = load_file(str(kimi_run["data"] / "hidden_states" / f"hs_{index}.safetensors"))
        ids = torch.tensor([rows[index]])
        assert saved["token_ids"].tolist() == rows[index]
        assert saved["hidden_states"].shape == (len(rows[index]), 4, info.hidden_size)
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        for slot, layer in enumerate(layer_ids[:-1]):
            torch.testing.assert_close(saved["hidden_states"][:, slot], out.hidden_states[layer][0], rtol=1e-5, atol=1e-5)
        final = saved["hidden_states"][:, -1]
        with torch.no_grad():
            logits = model.lm_head(model.model.norm(final))
        # the last slot is the last layer's output BEFORE the final norm: norm + lm_head give the logits
        torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(final, out.hidden_states[-1][0], atol=1e-3)  # HF's last entry is post-norm


def test_files_load_in_speculators_training_dataset(kimi_run):
    from speculators.train.data import ArrowDataset

    manifest = json.loads((kimi_run["data"] / "manifest.json").read_text())
    train = ArrowDataset(max_len=512, datapath=kimi_run["data"], on_missing="raise",
                         train_ratio=manifest["train_data_ratio"], split="train")
    sample = train[0]
    assert sample["hidden_states"].shape[1] == 3 * 128 and sample["verifier_last_hidden_states"].shape[1] == 128
    assert len(train) == manifest["counts"]["train_rows"]


@pytest.mark.parametrize("mutate,message", [
    (lambda hs, ids: (hs[:, :3], ids), "one layer slot short: the final layer is missing"),
    (lambda hs, ids: (hs, ids + 1), "token_ids do not equal"),
    (lambda hs, ids: (hs.index_fill(1, torch.tensor([3]), 0.0), ids), "slot(s) [3] are all zero"),
    (lambda hs, ids: (hs.index_fill(0, torch.tensor([1]), float("nan")), ids), "NaN/Inf"),
])
def test_bad_hidden_states_are_refused_before_landing(tmp_path, mutate, message):
    ids = torch.arange(5)
    states, token_ids = mutate(torch.randn(5, 4, 8), ids)
    with pytest.raises(BadHiddenStates, match=re.escape(message)):
        land_sample(ExtractedSample(0, states, token_ids), tmp_path, ids.tolist(), 4, 8, torch.float32)
    assert list(tmp_path.iterdir()) == []


def test_index_partitions_are_disjoint_and_complete():
    indices = list(range(103))
    parts = [partition_indices(indices, 4, rank) for rank in range(4)]
    assert sorted(sum(parts, [])) == indices and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_staged_file_lands_by_renames_with_no_fsync(tmp_path, monkeypatch):
    """The vLLM backend's files land by renames alone (an fsync per row was stage 02's largest per-row cost,
    bench/README.md); one filesystem flush before the manifest makes them durable (test_02_extract_vllm.py)."""
    from safetensors.torch import save_file

    ids = torch.arange(6)
    staged = tmp_path / "staging" / "row0-1.safetensors"
    staged.parent.mkdir()
    save_file({"hidden_states": torch.randn(6, 4, 8), "token_ids": ids}, str(staged))
    (tmp_path / "staging" / "row0-1.safetensors.lock").touch()
    original = staged.read_bytes()
    fsyncs = []
    monkeypatch.setattr("os.fsync", lambda fd: fsyncs.append(fd))
    final = land_sample(ExtractedSample(0, staged_file=staged), tmp_path / "hs", ids.tolist(), 4, 8, torch.float32)
    assert final == tmp_path / "hs" / "hs_0.safetensors" and final.read_bytes() == original
    assert fsyncs == [] and list((tmp_path / "hs").iterdir()) == [final]  # no temp left
    assert list((tmp_path / "staging").iterdir()) == []  # the staged file and its lock are gone
