"""bench/draft_forward.py on the CPU at a toy width (`--toy`): each kind's draft built by speculators' own path, one
speculative step per kind over the context cache, the results file. The figures mean nothing for speed here; the
GPU run at Kimi-K2.5's width is bench/README.md's."""

from __future__ import annotations

import json

import draft_forward
import pytest
import torch

from benchlib import projection, throughput


@pytest.fixture(scope="module")
def toy_verifier(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy") / "verifier"
    throughput.write_head_only_verifier(out, text_overrides=draft_forward.TOY_TEXT)
    return out


def build(kind, verifier, tmp_path):
    model, argv = draft_forward.build_draft(kind, verifier, draft_vocab_size=draft_forward.TOY_DRAFT_VOCAB,
                                            mask_token_id=draft_forward.TOY_TEXT["pad_token_id"], device="cpu",
                                            save_path=tmp_path / kind)
    return model, argv


def test_toy_run_on_the_cpu_times_eagle3_and_dflash_and_records_a_kind_it_cannot_build(tmp_path):
    assert draft_forward.main(["--toy", "--kinds", "eagle3", "dflash", "dflash2", "--batches", "1", "2",
                               "--warmup", "0", "--repeats", "2", "--results", str(tmp_path),
                               "--workdir", str(tmp_path / "work")]) == 0
    report = json.loads((tmp_path / "cpu-toy-draft-forward.json").read_text())
    assert report["toy"] is True and report["device"] == "cpu"
    assert "CPU" in report["label"] and "meaningless for speed" in report["label"]
    assert report["versions"]["speculators"] == "0.9.0" and report["versions"]["torch"] == torch.__version__
    assert report["settings"]["context"] == 64 and report["method"].startswith("Each kind's draft built")
    eagle3, dflash = report["kinds"]["eagle3"], report["kinds"]["dflash"]
    assert [(s["batch"], s["k"]) for s in eagle3["steps"]] == [(1, 3), (1, 5), (2, 3), (2, 5)]
    assert [s["forwards"] for s in eagle3["steps"]] == [3, 5, 3, 5]
    assert [(s["batch"], s["k"], s["forwards"], s["queries_per_forward"]) for s in dflash["steps"]] == [
        (1, 15, 1, [16]), (2, 15, 1, [16])]
    for step in eagle3["steps"] + dflash["steps"]:
        assert step["forward_ms"] > 0 and step["forward_ms_from"] == "eager" and len(step["eager"]["repeats_ms"]) == 2
    assert dflash["draft"]["layers"] == 5 and dflash["draft"]["block_size"] == 16
    assert dflash["attended_context"] == [63] * 5  # 64 - the new token, under the 2048 window
    assert "--speculator-type" in dflash["speculators_argv"] and "dflash" in dflash["speculators_argv"]
    assert "full verifier vocabulary" in report["kinds"]["dflash2"]["not_timed"]
    # what the projection reads from it
    assert projection.forward_times(report, 2).keys() == {("eagle3", 3), ("eagle3", 5), ("dflash", 15)}


@pytest.mark.parametrize("kind, drafted, appended", [
    ("eagle3", 3, 2 + 2),      # the 2 new tokens, then 2 more single-token forwards
    ("peagle", 3, 2 + 2),      # the 2 new tokens and k - 1 = 2 mask positions, one forward
    ("dflash", 15, 2 + 16),    # the new tokens' keys + the block of 16; drafts block - 1
    ("dspark", 8, 2 + 8),      # block 8, samples from the anchor: drafts all 8
])
def test_each_kinds_step_drafts_its_positions_over_the_context_cache(toy_verifier, tmp_path, kind, drafted, appended):
    model, _ = build(kind, toy_verifier, tmp_path)
    step, info = draft_forward.make_step(kind, model, batch=2, k=3, context=32, new_tokens=2, device="cpu")
    with torch.inference_mode():
        first = step()
        again = step()  # the cache is reset: the same work, the same tokens
    assert first.shape == (2, drafted)
    assert torch.equal(first, again)
    assert int(first.min()) >= 0 and int(first.max()) < draft_forward.TOY_TEXT["vocab_size"]
    cache = info["cache"]
    assert cache.base == [30] * len(model.layers)  # the context before the new tokens
    assert cache.lengths == [30 + appended] * len(model.layers)


def test_the_drafts_are_speculators_own_with_each_kinds_defaults(toy_verifier, tmp_path):
    eagle3, _ = build("eagle3", toy_verifier, tmp_path)
    assert type(eagle3).__name__ == "Eagle3DraftModel" and len(eagle3.layers) == 1
    assert eagle3.target_layer_ids == [2, 4, 5]  # draft_kinds.layer_ids of the toy's 8 layers
    assert draft_forward.kind_ks("eagle3", eagle3, [5, 3]) == [3, 5]
    peagle, _ = build("peagle", toy_verifier, tmp_path)
    assert type(peagle).__name__ == "PEagleDraftModel"
    assert draft_forward.kind_ks("peagle", peagle, [3, 5]) == [3, 5, 8]  # speculators' 8 depths
    dflash, _ = build("dflash", toy_verifier, tmp_path)
    record = draft_forward.draft_record("dflash", dflash)
    assert (record["layers"], record["block_size"], record["sample_from_anchor"]) == (5, 16, False)
    assert draft_forward.kind_ks("dflash", dflash, [3, 5]) == [15]
    dspark, _ = build("dspark", toy_verifier, tmp_path)
    assert draft_forward.draft_record("dspark", dspark)["block_size"] == 8
    assert draft_forward.kind_ks("dspark", dspark, [3, 5]) == [8]
    assert next(dspark.parameters()).dtype == torch.bfloat16


def test_a_sliding_layer_attends_its_window_of_the_context(toy_verifier, tmp_path):
    model, _ = build("dflash", toy_verifier, tmp_path)
    assert draft_forward.attended_context(model, 4095) == [2048] * 5
    assert draft_forward.attended_context(model, 100) == [100] * 5


def test_the_context_cache_appends_in_place_and_refuses_past_its_room():
    cache = draft_forward.ContextKV([4], batch=1, kv_heads=2, head_dim=8, room=3, dtype=torch.float32, device="cpu")
    buffer = cache.keys[0]
    keys, values = cache.update(torch.ones(1, 2, 2, 8), torch.ones(1, 2, 2, 8), 0)
    assert keys.shape == (1, 2, 6, 8) and keys.data_ptr() == buffer.data_ptr()  # a view, no copy of the context
    assert torch.equal(keys[:, :, 4:], torch.ones(1, 2, 2, 8))
    with pytest.raises(ValueError, match="room"):
        cache.update(torch.ones(1, 2, 2, 8), torch.ones(1, 2, 2, 8), 0)
    cache.reset()
    assert cache.lengths == [4]


def test_eagle3s_serving_step_computes_what_its_own_forward_computes(toy_verifier, tmp_path):
    """Over a cache holding the context's real K/V, the step's first draft logits are the draft's own TTT step 0
    logits at the last position of the same sequence (speculators' training forward, sdpa, causal), at several
    context lengths; over a random context they are not (the context is attended, not decoration)."""
    model, _ = build("eagle3", toy_verifier, tmp_path)
    model = model.float()
    tokens, hidden = 16, draft_forward.TOY_TEXT["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(1, tokens, 3 * hidden, generator=gen)
    ids = torch.randint(0, draft_forward.TOY_TEXT["vocab_size"], (1, tokens), generator=gen)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
    with torch.inference_mode():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, tokens, dtype=torch.long), ttt_steps=1)
        own = logits.pop()[0]  # [tokens, draft vocab]

        def first_logits(context: int, real: bool) -> torch.Tensor:
            cache = None
            if real:
                cache = draft_forward.ContextKV([0], batch=1, kv_heads=4, head_dim=16, room=context + 3,
                                                dtype=torch.float32, device="cpu")
                x = torch.cat([model.embed_tokens(ids[:, :context - 1]),
                               draft_forward._eagle_fuse(model, aux[:, :context - 1])], dim=-1)
                pos = torch.arange(context - 1).unsqueeze(0)
                for layer in model.layers:  # the context's K/V, written as the earlier steps would have
                    layer(x, attention_mask=None, position_ids=pos, past_key_values=cache,
                          position_embeddings=model.rotary_emb(x, pos), is_causal=True)
                cache.base = list(cache.lengths)
            step, _ = draft_forward.make_step("eagle3", model, batch=1, k=3, context=context, new_tokens=1,
                                              device="cpu", inputs=(aux[:, context - 1:context],
                                                                    ids[:, context - 1:context]), context_kv=cache)
            logits.clear()
            assert step().shape == (1, 3) and len(logits) == 3  # k forwards, one lm_head each
            return logits[0][0, -1]

        for context in (6, 11, 16):
            torch.testing.assert_close(first_logits(context, real=True), own[context - 1], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(first_logits(16, real=False), own[15], rtol=1e-4, atol=1e-5)
    hook.remove()


def test_dflashs_serving_step_computes_what_its_own_block_forward_computes(toy_verifier, tmp_path):
    """The block step (the context's fc'd target states as keys, the anchor + mask tokens as queries) gives the
    draft's own training logits for a block anchored at the same position (speculators' _backbone_forward, one
    anchor). Full attention on every layer: speculators trains a sliding layer's block causally, a full one not, and
    the step attends its block without a mask (its cost is the same either way)."""
    model, _ = draft_forward.build_draft("dflash", toy_verifier, draft_vocab_size=draft_forward.TOY_DRAFT_VOCAB,
                                         mask_token_id=draft_forward.TOY_TEXT["pad_token_id"], device="cpu",
                                         save_path=tmp_path / "dflash",
                                         extra_args=["--full-attention-indices", "0", "1", "2", "3", "4"])
    model = model.float()
    tokens, anchor, hidden = 40, 10, draft_forward.TOY_TEXT["hidden_size"]
    gen = torch.Generator().manual_seed(2)
    aux = torch.randn(1, tokens, 3 * hidden, generator=gen)
    ids = torch.randint(0, 250, (1, tokens), generator=gen)
    loss_mask = torch.zeros(1, tokens, dtype=torch.long)
    loss_mask[0, anchor] = 1  # the one position select_anchors can take
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
    with torch.inference_mode():
        model._backbone_forward(aux, ids, loss_mask, torch.randn(1, tokens, hidden, generator=gen),
                                torch.zeros(1, tokens, dtype=torch.long), max_anchors=1)
        own = logits.pop()[0]  # [block, draft vocab]
        step, info = draft_forward.make_step("dflash", model, batch=1, k=15, context=anchor, new_tokens=anchor,
                                             device="cpu", inputs=(aux[:, :anchor], ids[:, :anchor],
                                                                   ids[:, anchor:anchor + 1]))
        assert step().shape == (1, 15)
    hook.remove()
    assert info["cache"].lengths == [anchor + 16] * 5
    torch.testing.assert_close(logits[0][0], own[1:], rtol=1e-4, atol=1e-5)  # the anchor's slot is not drafted
