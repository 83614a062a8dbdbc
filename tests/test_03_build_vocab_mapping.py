"""Stage 03: speculators' d2t/t2d from loss-masked frequencies, clipped defaults, coverage."""

import json

import numpy as np
import pytest
import torch

from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.vocab import build_mapping, resolve_draft_vocab_size


def test_mapping_holds_the_most_frequent_loss_tokens(kimi_run):
    vocab, data = kimi_run["vocab"], kimi_run["data"]
    d2t, t2d = np.load(vocab / "d2t.npy"), np.load(vocab / "t2d.npy")
    manifest = json.loads((vocab / "manifest.json").read_text())
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    assert d2t.shape == (256,) and t2d.shape == (1024,) and t2d.sum() == 256
    draft_to_target = np.arange(256) + d2t  # speculators' convention: target = idx + d2t[idx]
    assert np.array_equal(np.flatnonzero(t2d), draft_to_target)
    freq = torch.load(data / "token_freq.pt", weights_only=True)
    top = sorted(freq, key=lambda t: (-freq[t], t))[: min(256, len(freq))]
    assert set(top) <= set(draft_to_target.tolist())
    # train coverage = the share of the train rows' loss tokens that the 256 most frequent hold
    assert manifest["coverage"]["train_coverage"] == pytest.approx(sum(freq[t] for t in top) / sum(freq.values()))
    assert 0 < manifest["coverage"]["val_coverage"] <= 1


def test_default_draft_vocab_is_clipped_but_an_explicit_oversize_is_refused():
    assert resolve_draft_vocab_size(None, 32000, 1024) == (1024, "draft_config.json's 32000 clipped to the target vocab")
    assert resolve_draft_vocab_size(None, 32000, 163840) == (32000, "draft_config.json")
    with pytest.raises(ConfigError, match="larger than the target vocab"):
        resolve_draft_vocab_size(2048, 32000, 1024)


def test_mapping_pads_with_low_ids_when_data_has_few_tokens():
    d2t, t2d = build_mapping({7: 3, 9: 1}, 4, 16)
    assert np.flatnonzero(t2d).tolist() == [0, 1, 7, 9]
    assert (np.arange(4) + d2t).tolist() == [0, 1, 7, 9]


def test_low_val_coverage_is_warned_about():
    from eagle3_pipeline.vocab import coverage_warning

    report = {"draft_vocab_size": 400, "val_coverage": 0.794, "train_coverage": 0.793}
    assert "covers only 79.4% of the loss-masked val tokens" in coverage_warning(report)
    assert coverage_warning({**report, "val_coverage": 0.996}) is None
