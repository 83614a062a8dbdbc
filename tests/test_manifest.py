"""Typed manifests (eagle3_pipeline/manifest.py): one model per stage, every write and read through it."""

import json

import pytest
from pydantic import ValidationError

from eagle3_pipeline.contract import content_sha256, read_manifest, write_manifest
from eagle3_pipeline.errors import ContractError
from eagle3_pipeline.manifest import (
    MODELS,
    SCHEMA_VERSION,
    STAGES,
    ExtractManifest,
    Manifest,
    PrepareCounts,
    PrepareManifest,
    TrainManifest,
    VocabManifest,
)

from conftest import SCRIPTS

RUN_DIRS = {"prepare": ("data", "--data"), "extract": ("hs", "--data"), "vocab": ("vocab", "--vocab"),
            "train": ("checkpoints", "--checkpoints"), "export": ("draft", "--draft")}
UPSTREAM = {"extract": ["prepare"], "vocab": ["prepare"], "train": ["prepare", "extract", "vocab"], "export": ["train"]}


def _leaf_paths(value, prefix=()):
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaf_paths(inner, (*prefix, key))
    else:
        yield prefix


def test_every_stage_of_a_real_run_reads_back_as_its_typed_model(kimi_run):
    """The five manifests of one real pipeline run: each is its stage's model, the JSON on disk is exactly the
    model's dump (nothing the model does not declare, nothing lost), `content_sha256` is the one rule's hash of
    identity + derived content, and every downstream stage recorded its upstream by that hash."""
    dirs = {**kimi_run, "hs": kimi_run["data"] / "hidden_states"}
    read = {}
    for stage, (key, flag) in RUN_DIRS.items():
        manifest = read_manifest(dirs[key], stage, flag)
        read[stage] = manifest
        assert type(manifest) is MODELS[stage] and manifest.complete and manifest.schema_version == SCHEMA_VERSION
        on_disk = json.loads(manifest.path.read_text())
        assert manifest.model_dump(mode="json", exclude_none=True) == on_disk
        assert "content" not in on_disk  # derived from the fields, never stored beside them
        assert manifest.content() is not None, stage
        assert manifest.content_sha256 == content_sha256(manifest)
        assert manifest.identity and manifest.created and manifest.command and manifest.versions["python"]
        assert manifest.path == dirs[key] / "manifest.json" and len(manifest.sha256) == 64
        for upstream in UPSTREAM.get(stage, []):
            assert manifest.inputs[upstream]["content_sha256"] == read[upstream].content_sha256, (stage, upstream)
            assert manifest.identity["inputs"][upstream] == read[upstream].content_sha256, (stage, upstream)
    prepared, extracted, vocab, trained = read["prepare"], read["extract"], read["vocab"], read["train"]
    assert prepared.counts.rows == prepared.counts.train_rows + prepared.counts.val_rows == extracted.counts.rows
    assert extracted.content().shapes["hidden_states"] == ["T", len(extracted.layer_ids), prepared.target["hidden_size"]]
    assert vocab.content().shapes["d2t"] == [vocab.draft_vocab_size] and 0 < vocab.coverage.val_coverage <= 1
    assert (kimi_run["checkpoints"] / trained.best_checkpoint.name / "model.safetensors").is_file()
    assert read["export"].checkpoint == read["export"].identity["inputs"]["checkpoint"]["name"]


@pytest.mark.parametrize("stage", list(STAGES))
def test_no_key_can_be_written_twice_or_undeclared(stage, tmp_path):
    """By construction: no model has a stored `content` (it is derived from the fields), and a key no model
    declares, `content` included, is refused when the manifest is built, before anything is written."""
    model = MODELS[stage]
    assert "content" not in model.model_fields and set(Manifest.model_fields) <= set(model.model_fields)
    for extra in ({"content": {"rows": 1}}, {"rows": 1}, {"shapes_again": {}}):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            model(**extra)
    derived = {"prepare": {"counts", "max_seq_len", "train_data_ratio"}, "extract": {"dtype", "storage", "selection", "shapes"},
               "vocab": {"draft_vocab_size", "target_vocab_size", "shapes", "coverage"},
               "train": {"best_checkpoint", "epochs"}, "export": {"checkpoint"},
               "evaluate": {"num_speculative_tokens", "mean_acceptance_length", "verdict"}}[stage]
    assert derived <= set(model.model_fields)  # content() is built from the manifest's own fields: each exists once
    assert not list(tmp_path.iterdir())


def test_content_is_derived_so_a_rewrite_keeps_its_hash(tmp_path):
    written = write_manifest(tmp_path, PrepareManifest(
        identity={"stage": "prepare", "inputs": {}, "settings": {}}, target={"hidden_size": 8},
        counts=PrepareCounts(rows=3, tokens=30, train_rows=2, val_rows=1), train_data_ratio=2 / 3, max_seq_len=64))
    again = read_manifest(tmp_path, "prepare", "--data")
    assert again.content_sha256 == written.content_sha256 == content_sha256(again)
    assert again.content().counts.rows == 3
    changed = write_manifest(tmp_path, again.model_copy(update={"complete": True, "counts": PrepareCounts(rows=4, tokens=30)}))
    assert changed.content_sha256 != written.content_sha256  # other content: downstream stages see another input


def _prepared(tmp_path):
    write_manifest(tmp_path, PrepareManifest(identity={"inputs": {}}, counts=PrepareCounts(rows=3, tokens=30),
                                             train_data_ratio=0.5, max_seq_len=64, target={"vocab_size": 10}))
    return tmp_path / "manifest.json"


@pytest.mark.parametrize(("change", "field"), [
    (lambda m: m["counts"].update(rows="many"), "counts.rows"),
    (lambda m: m["counts"].pop("tokens"), "counts.tokens"),
    (lambda m: m.update(train_data_ratio=[0.9]), "train_data_ratio"),
    (lambda m: m.update(surprise=1), "surprise"),
    (lambda m: m.update(content={"counts": {}}), "content"),
])
def test_a_malformed_manifest_is_one_line_naming_the_file_and_the_field(change, field, tmp_path):
    path = _prepared(tmp_path)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ContractError) as info:
        read_manifest(tmp_path, "prepare", "--data")
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{path}: field {field}: "), line
    assert line.endswith("rerun 01_prepare_dataset.py (--data)"), line


def test_a_manifest_of_another_schema_version_is_refused_in_one_line(tmp_path):
    path = _prepared(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 1}))
    with pytest.raises(ContractError) as info:
        read_manifest(tmp_path, "prepare", "--data")
    assert str(info.value) == (f"{path}: schema version 1, this version reads {SCHEMA_VERSION} (written by another "
                               f"version of eagle3-train); rerun 01_prepare_dataset.py (--data)")


def test_a_stage_reading_a_malformed_upstream_manifest_says_so_in_one_line(tmp_path):
    """Through a stage's own command line: stage 03 on a prepared dir whose manifest has a bad field (--check:
    the contract is read before anything, and nothing is written)."""
    import subprocess
    import sys

    path = _prepared(tmp_path / "data")
    data = json.loads(path.read_text())
    data["counts"]["train_rows"] = "two"
    path.write_text(json.dumps(data))
    result = subprocess.run([sys.executable, str(SCRIPTS / "03_build_vocab_mapping.py"), "--data", str(tmp_path / "data"),
                             "--output", str(tmp_path / "vocab"), "--check"], capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 3 and errors == [f"error: {path}: field counts.train_rows: input should be a valid "
                                                 f"integer, unable to parse string as an integer (stage 'prepare' "
                                                 f"manifest); rerun 01_prepare_dataset.py (--data)"], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "vocab").exists()


def test_own_unfinished_manifests_read_back_typed(tmp_path):
    """What a stage writes before its work (complete: false) is its model too: stage.finished reads it."""
    from eagle3_pipeline.stage import read_own_manifest

    write_manifest(tmp_path, TrainManifest(complete=False, identity={"inputs": {}}, outputs=["metrics.jsonl"]))
    own = read_own_manifest(tmp_path)
    assert isinstance(own, TrainManifest) and not own.complete and own.outputs == ["metrics.jsonl"] and own.content() is None
    write_manifest(tmp_path, ExtractManifest(complete=False, identity={}, dtype="float32", storage="dtype", selection="0:2"))
    assert read_own_manifest(tmp_path).selection == "0:2"
    write_manifest(tmp_path, VocabManifest(complete=False))
    with pytest.raises(ContractError, match="did not finish"):
        read_manifest(tmp_path, "vocab", "--vocab")


@pytest.mark.reliability
@pytest.mark.parametrize("trained", [None, {"optimizer_steps": 0, "samples": 0}, {"optimizer_steps": 8, "samples": 0}],
                         ids=["not-recorded", "no-step", "no-sample"])
def test_a_training_that_trained_nothing_is_never_written_complete(trained, tmp_path):
    """The one place every manifest is written refuses `complete: true` for a run that did nothing, whichever
    path of stage 04 got there (issue 40: `--on-bad-sample skip` over only bad samples wrote one)."""
    from eagle3_pipeline.errors import StageError

    with pytest.raises(StageError) as refused:
        write_manifest(tmp_path, TrainManifest(identity={"inputs": {}}, trained=trained))
    steps, samples = (trained or {}).get("optimizer_steps", 0), (trained or {}).get("samples", 0)
    assert str(refused.value) == (f"{tmp_path / 'manifest.json'}: not written as complete: the run did no work "
                                  f"({steps} optimizer step(s) on {samples} trained sample(s))")
    assert not (tmp_path / "manifest.json").exists()
    write_manifest(tmp_path, TrainManifest(complete=False, identity={"inputs": {}}, trained=trained))  # unfinished: fine
    written = write_manifest(tmp_path, TrainManifest(identity={"inputs": {}}, trained={"optimizer_steps": 8, "samples": 3}))
    assert written.complete and written.trained == {"optimizer_steps": 8, "samples": 3}
