"""Bad input, refused with one line a person can act on (the preflight's refusals: test_preflight.py).

Every case runs a stage's real `main(argv)` (the scripts' own entry point, in this process so 40
cases cost seconds, not minutes; `test_a_refusal_is_one_line_and_an_exit_code_from_the_real_script`
shows one end to end as a subprocess) and asserts:
- the exit code (2 config, 3 contract, 4 input, 5 preflight, 1 other),
- the exact `error: ...` line, which names the file and the row (or the flag) to fix, and that it
  is the only error line,
- nothing already written is lost: the output directory the run pointed at (an earlier finished
  result, hidden states, checkpoints) is byte-identical afterwards, unless the stage's job is to
  drop exactly the bad files (`02 --validate`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.files import writer_tag

from conftest import REPO, SAMPLES, SCRIPTS, STAGE_SCRIPTS

pytestmark = pytest.mark.reliability

GOOD = '{"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]}'
GOOD2 = '{"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}'


# --- helpers ---------------------------------------------------------------------------------------

_modules: dict[str, object] = {}


def stage_module(stage: str):
    """The stage script as a module (not __main__, so nothing runs on import)."""
    if stage not in _modules:
        path = SCRIPTS / STAGE_SCRIPTS[stage]
        spec = importlib.util.spec_from_file_location(f"eagle3_stage_{stage}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[stage] = module
    return _modules[stage]


def refused(capsys, stage: str, *args) -> tuple[int, str]:
    """Run a stage in-process; returns (exit code, the one error line without 'error: ')."""
    capsys.readouterr()
    try:
        code = stage_module(stage).main([str(a) for a in args])
    except SystemExit as exc:  # config errors found while parsing flags exit 2 from resolve_stage_config
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code != 0 and len(lines) == 1, f"exit {code}, stderr:\n{err[-3000:]}"
    return code, lines[0][len("error: "):]


def succeeded(capsys, stage: str, *args) -> str:
    capsys.readouterr()
    code = stage_module(stage).main([str(a) for a in args])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    return captured.out + captured.err


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root (symlinks by target): what 'nothing lost' compares."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + str(path.readlink())
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def ref(kimi_run) -> dict[str, Path]:
    """The shared finished five-stage run on the Kimi miniature (read-only: copy before changing)."""
    return kimi_run


@pytest.fixture
def work(ref, tmp_path) -> dict[str, Path]:
    """A private copy of the finished data (with hidden states), vocab and checkpoints."""
    out = {"target": ref["data"].parent}
    for name in ("data", "vocab", "checkpoints"):
        out[name] = tmp_path / name
        shutil.copytree(ref[name], out[name], symlinks=True)
    out["hs"] = out["data"] / "hidden_states"
    return out


@pytest.fixture
def immutable():
    """make(path): `chattr +i` on path, undone at teardown. The real way here to make writing, renaming or deleting
    an output fail: the box runs as root, which file modes do not stop. Skips where chattr cannot set the flag
    (not root, no CAP_LINUX_IMMUTABLE, a filesystem without it)."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True) if shutil.which("chattr") else None
        if done is None or done.returncode != 0:
            pytest.skip(f"chattr +i {path} not possible here ({done.stderr.strip() if done else 'no chattr'})")
        made.append(path)
        return path

    yield make
    for path in reversed(made):
        subprocess.run(["chattr", "-i", str(path)], check=True)


def target_copy(kimi_target: Path, dest: Path) -> Path:
    shutil.copytree(kimi_target, dest)
    return dest


# --- 01: conversations ------------------------------------------------------------------------------

BAD_ROWS = {
    # name: (line 2 of the file, the message after 'FILE:2: ')
    "malformed_json": ('{"messages": [{"role": "user", "content": "hi"}', "malformed JSON (Expecting ',' delimiter at column 48)"),
    "row_without_messages": ('{"prompt": "hi", "completion": "yo"}',
                             "row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)"),
    "unknown_role": ('{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                     "turn 0 has unknown role 'wizard'"),
    "empty_assistant_turn": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}',
                             "turn 1 is an empty assistant turn"),
    "no_assistant_turn": ('{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}',
                          "conversation has no assistant turn"),
    "content_not_text": ('{"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "yo"}]}',
                         "turn 0 (user) content is not text"),
    "content_part_not_text": ('{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}, '
                              '{"role": "assistant", "content": "yo"}]}',
                              "turn 0 (user) content part 0 has type 'input_audio': only text parts are supported "
                              "(the draft trains on text; drop or caption the other parts)"),
    "tool_result_answering_no_call": (
        '{"messages": [{"role": "user", "content": "Tokyo?"}, {"role": "tool", "content": "sunny"}, '
        '{"role": "assistant", "content": "Sunny."}]}',
        "turn 1 (tool) answers no tool call: it has no tool_call_id and no call before it is left unanswered (the "
        "chat template names the call in the result)"),
    "tool_result_naming_an_unknown_call": (
        '{"messages": [{"role": "user", "content": "Tokyo?"}, {"role": "assistant", "content": "", "tool_calls": '
        '[{"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": "{}"}}]}, '
        '{"role": "tool", "tool_call_id": "functions.search:7", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}',
        "turn 2 (tool) answers no tool call: its tool_call_id 'functions.search:7' matches no call before it (the "
        "chat template names the call in the result)"),
    "think_block_never_closed": (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>I was cut off"}]}',
        "turn 1 (assistant) content opens <think> and never closes it (reasoning cut short?)"),
    "reasoning_given_twice_differently": (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": "greet", '
        '"content": "<think>wave</think>Hello"}]}',
        "turn 1 (assistant) gives its reasoning twice, in reasoning_content and as an inline <think> block in its "
        "content, and they differ"),
    "reasoning_not_text": (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "reasoning_content": ["a", "b"], '
        '"content": "Hello"}]}', "turn 1 (assistant) reasoning_content is a list, not text"),
    "messages_not_a_list": ('{"messages": "hello"}', "messages is not a list of turns"),
    "row_not_an_object": ('[{"role": "user", "content": "hi"}]', "row is not a JSON object"),
    "empty_conversation": ('{"messages": []}', "conversation is empty"),
    "sharegpt_unknown_speaker": ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "yo"}]}',
                                 "turn 1 has unknown role 'narrator'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_is_refused_with_file_and_line_and_the_old_result_is_kept(case, capsys, work, kimi_target, tmp_path):
    line, message = BAD_ROWS[case]
    data = tmp_path / f"{case}.jsonl"
    data.write_text(GOOD + "\n" + line + "\n" + GOOD2 + "\n")
    before = snapshot(work["data"])
    # --overwrite over a finished result: bad input must not cost the user that result.
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data,
                          "--output", work["data"], "--overwrite")
    assert (code, error) == (4, f"{data}:2: {message}")
    assert snapshot(work["data"]) == before


@pytest.mark.parametrize("lines, message", [
    ("", "no rows left from 0 conversation(s) (0 longer than --max-seq-len 2048)"),
    (GOOD + "\n", "1 conversation(s) cannot be split into train and val (--val-ratio 0.1); give at least 2 conversations"),
])
def test_check_refuses_what_the_run_would_refuse_and_writes_nothing(lines, message, capsys, kimi_target, tmp_path):
    """Before: --check passed (exit 0) an empty file and a single conversation that the real run refuses."""
    data = tmp_path / "data.jsonl"
    data.write_text(lines)
    for check in (["--check"], []):
        code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data,
                              "--output", tmp_path / "out", "--max-seq-len", "2048", *check)
        assert (code, error) == (4, f"{data}: {message}")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_non_utf8_bytes_are_refused_with_line_and_byte(capsys, kimi_target, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes((GOOD + "\n").encode() + '{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data,
                          "--output", tmp_path / "out")
    assert (code, error) == (4, f"{data}:2: not valid UTF-8 (byte 46)")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_missing_input_path_is_refused(capsys, kimi_target, tmp_path):
    data = tmp_path / "nowhere.jsonl"
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data,
                          "--output", tmp_path / "out")
    assert (code, error) == (4, f"{data}: input file not found (--data)")


def test_missing_target_config_is_refused(capsys, tmp_path):
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", tmp_path, "--data",
                          SAMPLES / "conversations.jsonl", "--output", tmp_path / "out")
    assert (code, error) == (4, f"{tmp_path / 'config.json'}: target config not found (--target must be a local model directory)")


def test_tokenizer_without_chat_template_is_refused(capsys, kimi_target, tmp_path):
    target = target_copy(kimi_target, tmp_path / "no-template")
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", target, "--data",
                          SAMPLES / "conversations.jsonl", "--output", tmp_path / "out")
    assert (code, error) == (4, f"{target}: tokenizer has no chat template (chat_template.jinja / tokenizer_config.json)")


def test_every_row_too_long_is_refused_and_counted(capsys, kimi_target, tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text(GOOD + "\n" + GOOD2 + "\n")
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data,
                          "--output", tmp_path / "out", "--max-seq-len", 8)
    assert (code, error) == (4, f"{data}: no rows left from 2 conversation(s) (2 longer than --max-seq-len 8)")


def test_one_conversation_cannot_be_split_into_train_and_val(capsys, kimi_target, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(GOOD + "\n")
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data,
                          "--output", tmp_path / "out")
    assert (code, error) == (4, f"{data}: 1 conversation(s) cannot be split into train and val (--val-ratio 0.1); "
                                f"give at least 2 conversations")


def test_a_failed_first_run_of_01_leaves_no_output_folder_behind(capsys, kimi_target, tmp_path):
    """Issue 64: a refused first 01 left `.eagle3.lock` in an empty --output (and the folders above it it made). A
    folder that was there before is the user's: kept."""
    data = tmp_path / "one.jsonl"
    data.write_text(GOOD + "\n")
    out = tmp_path / "new" / "data"
    code, _ = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--output", out)
    assert code == 4 and not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    code, _ = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", data, "--output",
                      tmp_path / "mine")
    assert code == 4 and (tmp_path / "mine").is_dir()


@pytest.mark.parametrize("mode", ["drop", "truncate"])
def test_rows_longer_than_max_seq_len_are_dropped_or_truncated_and_counted_never_silently(mode, capsys, ref, kimi_target, tmp_path):
    import datasets

    rows = datasets.load_from_disk(str(ref["data"])).with_format(None)
    lengths = sorted(rows["seq_len"])
    limit = lengths[len(lengths) // 2]
    too_long = [(ids, mask) for ids, mask in zip(rows["input_ids"], rows["loss_mask"]) if len(ids) > limit]
    assert too_long
    out = tmp_path / "out"
    succeeded(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data",
              SAMPLES / "conversations.jsonl", "--output", out, "--max-seq-len", limit, "--on-too-long", mode)
    counts = manifest(out)["counts"]
    if mode == "drop":
        assert counts["dropped_too_long"] == len(too_long) and counts["truncated_too_long"] == 0
        assert counts["rows"] == len(lengths) - len(too_long)
    else:  # a truncated row is kept only if loss tokens survive the cut; the others are dropped
        kept = sum(1 for _, mask in too_long if any(mask[:limit]))
        assert counts["truncated_too_long"] == kept and counts["dropped_too_long"] == len(too_long) - kept
        assert counts["rows"] == len(lengths) - (len(too_long) - kept)
    assert max(datasets.load_from_disk(str(out))["seq_len"]) <= limit


def test_unwritable_output_directory_is_refused_before_any_work(capsys, kimi_target, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    code, error = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data",
                          SAMPLES / "conversations.jsonl", "--output", out)
    assert (code, error) == (74, f"{out}: output directory is not writable (Not a directory); fix --output")


# --- 02: hidden states ------------------------------------------------------------------------------

def _corrupt(hs: Path, how: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = hs / "hs_4.safetensors"
    if how == "truncated":
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) - 1000])
        return
    if how == "missing":
        path.unlink()
        return
    data = load_file(str(path))
    states, ids = data["hidden_states"], data["token_ids"]
    if how == "nan":
        states[1, 2, 3] = float("nan")
    elif how == "inf":
        states[0, 0, 0] = float("inf")
    elif how == "all_zero":
        states.zero_()
    elif how == "final_layer_zero":
        states[:, 3] = 0
    elif how == "token_ids_differ":
        ids = ids.clone()
        ids[5] += 1
    elif how == "final_layer_missing":
        states = states[:, :3].contiguous()
    elif how == "hidden_size_differs":
        states = states[..., :64].contiguous()
    elif how == "no_token_ids":
        save_file({"hidden_states": states}, str(path))
        return
    elif how == "swapped_with_row_5":  # another row's whole file under this row's name
        shutil.copyfile(hs / "hs_5.safetensors", path)
        return
    elif how == "constant_slot":
        states[:, 1] = 0.5
    elif how == "near_constant_slot":
        states[:, 2] = 0.5 + 1e-8 * torch.rand_like(states[:, 2])
    elif how == "one_vector_repeated":
        states[:, 0] = states[:1, 0]
    elif how == "other_dtype":
        states = states.to(torch.bfloat16)
    save_file({"hidden_states": states, "token_ids": ids.to(torch.long)}, str(path))


def _expected_hs_4(hs: Path, how: str, length: int) -> str:
    path = hs / "hs_4.safetensors"
    return {
        "missing": "missing",
        "nan": f"{path}: hidden_states contain NaN/Inf",
        "inf": f"{path}: hidden_states contain NaN/Inf",
        "all_zero": f"{path}: hidden_states layer slot(s) [0, 1, 2, 3] are all zero",
        "final_layer_zero": f"{path}: hidden_states layer slot(s) [3] are all zero",
        "token_ids_differ": (f"{path}: token_ids do not equal the dataset row's input_ids (first difference at "
                             f"position 5, {length} vs {length} tokens: the file of another row, or the data was "
                             f"re-prepared)"),
        "swapped_with_row_5": (f"{path}: token_ids do not equal the dataset row's input_ids (first difference at "
                               f"position {_first_difference(hs, 5, 4)}, {_row_length(hs, 5)} vs {length} tokens: the "
                               f"file of another row, or the data was re-prepared)"),
        "constant_slot": f"{path}: hidden_states layer slot(s) [1] hold one constant value (0.5); not a model's states",
        "near_constant_slot": f"{path}: hidden_states layer slot(s) [2] hold one constant value (0.5); not a model's states",
        "one_vector_repeated": (f"{path}: hidden_states layer slot(s) [0] are the same for every token (one vector "
                                f"repeated); not a model's states"),
        "other_dtype": f"{path}: hidden_states dtype bfloat16, the directory's is float32 (--dtype): files are never mixed",
        "final_layer_missing": (f"{path}: hidden_states shape [{length}, 3, 128] != expected [{length}, 4, 128] (one layer "
                                f"slot short: the final layer is missing, as vLLM before PR #46973 did for DeepSeek backbones)"),
        "hidden_size_differs": f"{path}: hidden_states shape [{length}, 4, 64] != expected [{length}, 4, 128]",
        "no_token_ids": f"{path}: missing tensors ['token_ids']",
    }[how]


def _row_ids(hs: Path, row: int) -> list[int]:
    import datasets

    return list(datasets.load_from_disk(str(hs.parent))[row]["input_ids"].tolist())


def _row_length(hs: Path, row: int) -> int:
    return len(_row_ids(hs, row))


def _first_difference(hs: Path, row_a: int, row_b: int) -> int:
    a, b = _row_ids(hs, row_a), _row_ids(hs, row_b)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


HS_CASES = ["missing", "nan", "inf", "all_zero", "final_layer_zero", "token_ids_differ", "final_layer_missing",
            "hidden_size_differs", "no_token_ids", "swapped_with_row_5", "constant_slot", "near_constant_slot",
            "one_vector_repeated", "other_dtype"]


@pytest.mark.parametrize("how", HS_CASES)
def test_validate_names_the_bad_hidden_state_file_and_drops_only_it(how, capsys, work, kimi_target):
    hs = work["hs"]
    length = len(json.loads(json.dumps(__import__("datasets").load_from_disk(str(work["data"]))[4]["input_ids"].tolist())))
    _corrupt(hs, how)
    others = {k: v for k, v in snapshot(hs).items() if k.startswith("hs_") and k != "hs_4.safetensors"}
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"],
                          "--validate")
    assert code == 1
    assert error == (f"validation: 1 row(s) bad (listed in {hs / 'redo.json'}), first: row 4: "
                     f"{_expected_hs_4(hs, how, length)}; rerun to redo them")
    assert json.loads((hs / "redo.json").read_text())["rows"] == [4]
    assert not (hs / "hs_4.safetensors").exists() and not (hs / "manifest.json").exists()
    assert {k: v for k, v in snapshot(hs).items() if k.startswith("hs_")} == others  # nothing else touched


def test_validate_names_a_truncated_file_with_safetensors_own_words(capsys, work, kimi_target):
    from safetensors.torch import load_file

    hs = work["hs"]
    _corrupt(hs, "truncated")
    with pytest.raises(Exception) as raised:  # whatever safetensors raises is what the message quotes
        load_file(str(hs / "hs_4.safetensors"))
    detail = str(raised.value).splitlines()[0][:120]
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"],
                          "--validate")
    assert (code, error) == (1, f"validation: 1 row(s) bad (listed in {hs / 'redo.json'}), first: row 4: "
                                f"{hs / 'hs_4.safetensors'}: unreadable safetensors ({detail}); rerun to redo them")


def test_data_prepared_for_another_target_is_refused_and_states_kept(capsys, work, miniature):
    from eagle3_pipeline.target import load_target_info

    before = snapshot(work["data"])
    kimi, llama = load_target_info(miniature["kimi"]), load_target_info(miniature["llama"])
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", miniature["llama"], "--data", work["data"])
    assert (code, error) == (3, f"{work['data'] / 'manifest.json'}: target config mismatch (manifest has "
                                f"{kimi.config_sha256}, this run has {llama.config_sha256}); rerun 01_prepare_dataset.py "
                                f"for this target, or pass the --target it was prepared for")
    assert snapshot(work["data"]) == before


def test_data_prepared_with_another_tokenizer_is_refused(capsys, work, kimi_target, tmp_path):
    from eagle3_pipeline.target import load_target_info

    target = target_copy(kimi_target, tmp_path / "retokenized")
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1234  # any change to the tokenizer files
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_target_info(kimi_target), load_target_info(target)
    assert ours.config_sha256 == theirs.config_sha256
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", target, "--data", work["data"])
    assert (code, error) == (3, f"{work['data'] / 'manifest.json'}: tokenizer mismatch (manifest has "
                                f"{ours.tokenizer_sha256}, this run has {theirs.tokenizer_sha256}); rerun "
                                f"01_prepare_dataset.py for this target, or pass the --target it was prepared for")


def test_states_of_other_layer_ids_are_never_mixed_in(capsys, work, kimi_target):
    before = snapshot(work["hs"])
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"],
                          "--layer-ids", 1, 2, 3)
    hs = work["hs"]
    assert (code, error) == (3, f"{hs / 'manifest.json'}: {hs} holds a finished result made with settings.layer_ids = "
                                f"[2, 3, 4, 6] there, [1, 2, 3, 6] in this run; move {hs} away (or rerun 01 into a new "
                                f"--output) to extract again")
    assert snapshot(hs) == before


def test_wrong_number_of_layer_ids_is_refused(capsys, work, kimi_target):
    code, error = refused(capsys, "extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"],
                          "--layer-ids", 1, 2)
    assert (code, error) == (4, "--layer-ids needs exactly 3 aux layer ids (the final layer is added), got [1, 2]")


# --- 03: vocab ---------------------------------------------------------------------------------------

def test_draft_vocab_larger_than_the_target_vocab_is_refused(capsys, work, tmp_path):
    code, error = refused(capsys, "vocab", "--profile", "cpu-mini", "--data", work["data"], "--output", tmp_path / "v",
                          "--draft-vocab-size", 4096)
    assert (code, error) == (2, "--draft-vocab-size 4096 is larger than the target vocab (1024)")


def test_vocab_from_unfinished_data_is_refused(capsys, tmp_path):
    data = tmp_path / "half-prepared"
    data.mkdir()
    code, error = refused(capsys, "vocab", "--data", data, "--output", tmp_path / "v")
    assert (code, error) == (3, f"{data / 'manifest.json'}: missing; {data} is not a finished 'prepare' output "
                                f"(--data); run 01_prepare_dataset.py first")


def test_vocab_without_token_frequencies_is_refused(capsys, work, tmp_path):
    (work["data"] / "token_freq.pt").unlink()
    code, error = refused(capsys, "vocab", "--profile", "cpu-mini", "--data", work["data"], "--output", tmp_path / "v")
    assert (code, error) == (3, f"{work['data'] / 'token_freq.pt'}: missing since 01_prepare_dataset.py wrote it; rerun "
                                f"01_prepare_dataset.py")


# --- 04: training ------------------------------------------------------------------------------------

def _draft_config(tmp_path: Path, **changes) -> Path:
    from eagle3_pipeline.config import DEFAULT_DRAFT_CONFIG

    config = {**json.loads(DEFAULT_DRAFT_CONFIG.read_text()), **changes}
    path = tmp_path / "draft_config.json"
    path.write_text(json.dumps(config))
    return path


def _train(work: dict, kimi_target: Path, out: Path, *extra) -> list:
    return ["train", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"], "--vocab", work["vocab"],
            "--output", out, "--logger", "", *extra]


@pytest.mark.parametrize("key,value", [("hidden_size", 7168), ("target_vocab_size", 163840)])
def test_draft_config_not_matching_the_target_is_refused(key, value, capsys, work, kimi_target, tmp_path):
    draft = _draft_config(tmp_path, **{key: value})
    actual = {"hidden_size": 128, "target_vocab_size": 1024}[key]
    code, error = refused(capsys, *_train(work, kimi_target, tmp_path / "ckpt", "--draft-config", draft))
    assert (code, error) == (2, f"{draft}: {key} {value} does not match the target's {actual} ({kimi_target}/config.json)")


def test_vocab_mapping_built_from_other_data_is_refused(capsys, work, kimi_target, tmp_path):
    other_data, other_vocab = tmp_path / "other-data", tmp_path / "other-vocab"
    succeeded(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", SAMPLES / "sharegpt.jsonl",
              "--output", other_data)
    succeeded(capsys, "vocab", "--profile", "cpu-mini", "--data", other_data, "--output", other_vocab)
    work = {**work, "vocab": other_vocab}
    code, error = refused(capsys, *_train(work, kimi_target, tmp_path / "ckpt"))
    assert (code, error) == (3, f"{other_vocab / 'manifest.json'}: built from a different 'prepare' output than "
                                f"{work['data'] / 'manifest.json'} (other data, or it was rerun since); "
                                f"rerun 03_build_vocab_mapping.py")


def test_training_without_hidden_states_is_refused(capsys, work, kimi_target, tmp_path):
    shutil.rmtree(work["hs"])
    code, error = refused(capsys, *_train(work, kimi_target, tmp_path / "ckpt"))
    assert (code, error) == (3, f"{work['hs']}: no such directory (--data); run 02_extract_hidden_states.py first")


def test_training_on_unfinished_hidden_states_is_refused(capsys, work, kimi_target, tmp_path):
    path = work["hs"] / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "complete": False}))  # as a killed 02 leaves it
    code, error = refused(capsys, *_train(work, kimi_target, tmp_path / "ckpt"))
    assert (code, error) == (3, f"{path}: stage 'extract' did not finish; rerun 02_extract_hidden_states.py")


def test_checkpoints_from_another_draft_config_are_refused_and_kept(capsys, work, kimi_target, tmp_path):
    draft = _draft_config(tmp_path, ttt_steps=2)
    before = snapshot(work["checkpoints"])
    code, error = refused(capsys, *_train(work, kimi_target, work["checkpoints"], "--draft-config", draft))
    assert (code, error) == (3, f"{work['checkpoints'] / 'manifest.json'}: {work['checkpoints']} holds a finished "
                                f"result made with settings.draft_config.ttt_steps = 3 there, 2 in this run; a resume "
                                f"restores the old optimizer and lr schedule from the checkpoints, so it cannot change "
                                f"a run; rerun with the old value, choose another --output, or pass --overwrite to "
                                f"train anew (deletes only this stage's checkpoints and logs)")
    assert snapshot(work["checkpoints"]) == before


def test_a_bad_flag_value_of_04_is_one_line_before_overwrite_deletes_the_finished_run(capsys, work, kimi_target):
    """Issue 64 N, T: `--logger tensorbord` (or a logger not installed) ended in tracebacks after --overwrite had
    deleted the finished run; `--noise-std inf` trained to a NaN loss. Every value is checked before anything."""
    import importlib.util

    before = snapshot(work["checkpoints"])
    cases = [(("--logger", "tensorbord"), 2, "--logger (flag): unknown logger 'tensorbord'"),
             (("--noise-std", "inf"), 2, "--noise-std (flag): Input should be a finite number (got inf)"),
             (("--stall-minutes", "-1"), 2, "--stall-minutes (flag): Input should be greater than or equal to 0 (got -1"),
             (("--layer-ids", "2", "-3", "4"), 2, "--layer-ids (flag): must not be negative (got -3)")]
    if importlib.util.find_spec("mlflow") is None:
        cases.append((("--logger", "mlflow"), 5, "logger: mlflow (--logger mlflow) is not installed: refusing (pip "
                                                 "install mlflow, or pass --logger none)"))
    for flags, exit_code, message in cases:
        code, error = refused(capsys, *_train(work, kimi_target, work["checkpoints"], "--overwrite", "--epochs", "1",
                                              *flags))
        assert (code, error.startswith(message)) == (exit_code, True), (flags, code, error)
        assert snapshot(work["checkpoints"]) == before, flags


def test_a_node_rank_outside_the_nodes_is_refused_before_the_shared_folder_is_touched(capsys, tmp_path):
    """Issue 64: `--node-rank 2` of a 2-node run wrote its node record into the shared --output before the launch
    refused it."""
    out = tmp_path / "shared" / "checkpoints"
    code, error = refused(capsys, "train", "--target", tmp_path / "t", "--data", tmp_path / "d", "--vocab",
                          tmp_path / "v", "--output", out, "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint",
                          "10.0.0.1:29500")
    assert (code, error) == (2, "--node-rank (flag): must be in [0, --nnodes 2) (got 2)")
    assert not out.exists()


def test_unwritable_checkpoint_directory_is_refused(capsys, work, kimi_target, tmp_path):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "ckpt"
    code, error = refused(capsys, *_train(work, kimi_target, out))
    assert (code, error) == (74, f"{out}: output directory is not writable (Not a directory); fix --output")


def recorded_by_02(hs_dir: Path) -> None:
    """Hidden-state files changed after stage 02, recorded as its own (its fingerprints.json and the manifest's record
    of it; the manifest's content is unchanged): as 02 leaves bytes it wrote itself (an extraction gone wrong, vLLM's
    files). Stage 04's per-sample checks stand between those and training; a file changed since 02's record is refused
    before (training.require_unchanged_row_files, issue 64)."""
    from eagle3_pipeline.files import write_fingerprints

    record = manifest(hs_dir)
    record["fingerprints"] = write_fingerprints(hs_dir, sorted(p.name for p in Path(hs_dir).glob("hs_*.safetensors")))
    (Path(hs_dir) / "manifest.json").write_text(json.dumps(record))


def _spoil_hidden_states(work: dict, rows) -> None:
    for row in rows:
        (work["hs"] / f"hs_{row}.safetensors").write_bytes(b"garbage")  # unreadable, as a damaged copy leaves it
    recorded_by_02(work["hs"])


def _counts(work: dict) -> dict:
    return manifest(work["data"])["counts"]


def test_skip_stops_once_more_than_max_bad_fraction_of_the_samples_are_bad(capsys, work, kimi_target, tmp_path):
    """Issue 40: `--on-bad-sample skip` with every sample bad "trained" on nothing and wrote a complete manifest.
    It stops in one line at the first sample over --max-bad-fraction (1%: 1 of the 15), as stage 01 does."""
    rows = _counts(work)["rows"]
    _spoil_hidden_states(work, range(rows))
    out = tmp_path / "ckpt"
    code, error = refused(capsys, *_train(work, kimi_target, out, "--on-bad-sample", "skip"))
    head = (f"{work['data']}: 1 of {rows} samples are bad ({1 / rows:.1%} > --max-bad-fraction 1.0%); first: "
            f"{work['hs']}/hs_")
    tail = ("; training stopped (a rerun resumes from the start (no checkpoint was saved yet)): redo those files with "
            f"02_extract_hidden_states.py --validate, or raise --max-bad-fraction; they are listed in bad_samples.jsonl "
            f"in {out}")
    assert code == 4 and error.startswith(head) and error.endswith(tail), error
    assert ".safetensors: unreadable safetensors (" in error
    assert not manifest(out)["complete"] and not (out / "summary.json").exists()


def test_skip_with_every_sample_bad_stops_even_at_max_bad_fraction_1(capsys, work, kimi_target, tmp_path):
    rows = _counts(work)["rows"]
    _spoil_hidden_states(work, range(rows))
    out = tmp_path / "ckpt"
    code, error = refused(capsys, *_train(work, kimi_target, out, "--on-bad-sample", "skip", "--max-bad-fraction", "1",
                                          "--epochs", "1"))
    assert code == 4 and error.startswith(f"{work['data']}: all {rows} samples are bad, none is left to train on; "
                                          f"first: {work['hs']}/hs_"), error
    assert "redo those files with 02_extract_hidden_states.py --validate; they are listed in" in error  # no "raise it"
    assert not manifest(out)["complete"]


def test_a_run_that_trained_on_no_sample_never_gets_a_complete_manifest(capsys, work, kimi_target, tmp_path):
    """Every training row bad, the validation rows good, --max-bad-fraction 1: the trainer runs its steps on empty
    batches; stage 04 counts what the steps trained on (logs/samples) and refuses the report and the manifest."""
    counts = _counts(work)
    _spoil_hidden_states(work, range(counts["train_rows"]))
    out = tmp_path / "ckpt"
    code, error = refused(capsys, *_train(work, kimi_target, out, "--on-bad-sample", "skip", "--max-bad-fraction", "1",
                                          "--epochs", "1"))
    assert code == 4, error
    assert error == (
        f"{out}: training ran 0 optimizer step(s) on 0 sample(s) ({counts['train_rows']} sample(s) left out by "
        f"--on-bad-sample skip): nothing was trained, so the manifest does not say complete and its checkpoints (0, "
        f"checkpoint_best, epoch0_end) "
        f"were deleted (a rerun starts from the start); check --data ({work['data']}) and {out / 'bad_samples.jsonl'}")
    assert not manifest(out)["complete"] and not (out / "summary.json").exists()


def test_a_run_that_trained_on_no_sample_leaves_nothing_to_resume_from(capsys, work, kimi_target, tmp_path):
    """Issue 46, G: with every training sample left out, the trainer took optimizer steps on empty batches and saved
    checkpoint 0, and the rerun after the files were redone resumed from it: epoch 0 never trained, nothing to
    report. Now no step on no sample, no checkpoint of it: the rerun trains from the start and finishes."""
    counts = _counts(work)
    _spoil_hidden_states(work, range(counts["train_rows"]))
    out = tmp_path / "ckpt"
    train = _train(work, kimi_target, out, "--on-bad-sample", "skip", "--max-bad-fraction", "1", "--epochs", "1")
    code, error = refused(capsys, *train)
    assert code == 4 and "training ran 0 optimizer step(s) on 0 sample(s)" in error, error
    assert not list(out.glob("[0-9]*")) and not (out / "checkpoint_best").exists()
    _extract(capsys, work, kimi_target, "--validate")  # as the line advises: drop the bad files
    _extract(capsys, work, kimi_target)  # and extract them again
    succeeded(capsys, *train)  # a resume from an empty epoch 0 would train nothing and be refused
    done = manifest(out)
    assert done["complete"] and done["trained"]["samples"] > 0 and done["bad_samples"]["count"] == 0


def _extract(capsys, work: dict, kimi_target: Path, *extra) -> None:
    args = ["--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"], *extra]
    stage_module("extract").main([str(a) for a in args])  # --validate exits 4 when it dropped bad files
    capsys.readouterr()


def test_skip_finishes_once_the_bad_files_are_redone_as_advised(capsys, work, kimi_target, tmp_path):
    """Issue 46, G: after a stop for too many bad files, redoing them as the line advises (02 --validate, then 02)
    let no rerun finish: the old bad_samples.jsonl still counted them. Samples whose files were redone since are
    checked again as they are read; the rerun trains on them and finishes."""
    _spoil_hidden_states(work, (0, 1, 2))  # 3 of the 15 samples: over the 10% limit
    out = tmp_path / "ckpt"
    train = _train(work, kimi_target, out, "--on-bad-sample", "skip", "--max-bad-fraction", "0.1", "--epochs", "1")
    code, error = refused(capsys, *train)
    assert code == 4 and "> --max-bad-fraction 10.0%" in error and "redo those files with 02" in error, error
    _extract(capsys, work, kimi_target, "--validate")  # drops the bad files
    _extract(capsys, work, kimi_target)  # and extracts them again
    succeeded(capsys, *train)
    done = manifest(out)
    assert done["complete"] and done["bad_samples"]["count"] == 0, done["bad_samples"]
    assert done["trained"]["samples"] > 0


# --- 05: export --------------------------------------------------------------------------------------

def test_export_of_a_checkpoint_that_does_not_exist_is_refused(capsys, work, tmp_path):
    code, error = refused(capsys, "export", "--checkpoints", work["checkpoints"], "--output", tmp_path / "d",
                          "--checkpoint", "7")
    assert (code, error) == (3, f"{work['checkpoints']}: no checkpoint '7' with model.safetensors (--checkpoint)")


def test_export_never_replaces_a_directory_it_did_not_write(capsys, work, tmp_path):
    """The export swaps its whole --output directory: not even --overwrite lets it take another one."""
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    for out in (mine, work["vocab"]):
        before = snapshot(out)
        code, error = refused(capsys, "export", "--checkpoints", work["checkpoints"], "--output", out, "--overwrite")
        assert (code, error) == (2, f"{out}: exists and is not an export made by 05_export.py (it would be "
                                    f"replaced as a whole); choose another --output")
        assert snapshot(out) == before


def test_export_of_unfinished_training_is_refused(capsys, work, tmp_path):
    path = work["checkpoints"] / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "complete": False}))
    code, error = refused(capsys, "export", "--checkpoints", work["checkpoints"], "--output", tmp_path / "d")
    assert (code, error) == (3, f"{path}: stage 'train' did not finish; rerun 04_train.py")


def test_export_into_a_directory_it_cannot_rename_is_one_line_and_keeps_it(capsys, ref, work, immutable, tmp_path):
    """Issue 40: 05 replacing an export it cannot move aside (here: `chattr +i`) ended in a PermissionError traceback."""
    draft = tmp_path / "exports" / "draft"
    shutil.copytree(ref["draft"], draft)
    before = snapshot(draft)
    immutable(draft)
    code, error = refused(capsys, "export", "--checkpoints", work["checkpoints"], "--vocab", work["vocab"], "--output",
                          draft, "--tensor-parallel-size", "2", "--overwrite")  # another identity: replace it
    assert code == 74 and error == (f"{draft}: moving the old one aside (renaming it to .draft.old.tmp-{writer_tag()}) "
                                    f"failed (Operation not permitted); fix the path (permissions, mount, free space) "
                                    f"or choose another one, then rerun"), error
    assert snapshot(draft) == before  # and no staging copy left beside it
    assert sorted(p.name for p in draft.parent.iterdir()) == [".draft.eagle3.lock", "draft"]


# --- every stage: an output path it cannot write, rename, create or delete ------------------------------

def _stage_args(stage: str, ref: dict, work: dict, kimi_target: Path, out: Path) -> list:
    """A stage run whose --output is `out` (02: whose --data is work's)."""
    return {
        "prepare": ["prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", SAMPLES / "conversations.jsonl",
                    "--output", out],
        "extract": ["extract", "--profile", "cpu-mini", "--target", kimi_target, "--data", work["data"]],
        "vocab": ["vocab", "--profile", "cpu-mini", "--data", work["data"], "--output", out],
        "train": _train(work, kimi_target, out),
        "export": ["export", "--checkpoints", work["checkpoints"], "--vocab", work["vocab"], "--output", out],
        "evaluate": ["evaluate", "--profile", "cpu-mini", "--draft", ref["draft"], "--checkpoints", work["checkpoints"],
                     "--data", work["data"], "--vocab", work["vocab"], "--output", out],
    }[stage]


@pytest.mark.parametrize("stage", ["prepare", "vocab", "train", "export", "evaluate"])
def test_an_output_directory_that_cannot_be_created_is_one_line_naming_it(stage, capsys, ref, work, kimi_target):
    """A directory under /proc cannot be created, by root either; check_writable_dir (mode bits) lets it through."""
    out = Path("/proc") / f"eagle3-test-{os.getpid()}" / "out"
    code, error = refused(capsys, *_stage_args(stage, ref, work, kimi_target, out))
    assert code == 74 and error.startswith(f"{out.parent}: creating the directory failed ("), error
    assert error.endswith("); fix the path (permissions, mount, free space) or choose another one, then rerun")


@pytest.mark.parametrize("stage", ["prepare", "extract", "vocab", "train", "export", "evaluate"])
def test_an_unwritable_output_found_before_the_stage_starts_exits_74_as_when_writing(stage, capsys, ref, work,
                                                                                     kimi_target, tmp_path):
    """Issue 46: the preflight's `output directory is not writable` exited 1, a failed write of the same path 74
    (README promises 74): one code for one cause, in every stage. The output lies under a file (Not a directory):
    no mode bits involved, so root sees it too."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    if stage == "extract":  # 02 writes into --data's hidden_states/: there, a file
        shutil.rmtree(work["hs"])
        work["hs"].write_text("not a directory")
        out = work["hs"]
    code, error = refused(capsys, *_stage_args(stage, ref, work, kimi_target, out))
    flag = "--data" if stage == "extract" else "--output"
    where = out.parent if stage == "export" else out  # 05 replaces --output as a whole: its parent is written
    assert (code, error) == (74, f"{where}: output directory is not writable (Not a directory); fix {flag}")


@pytest.mark.parametrize("stage", ["prepare", "extract", "vocab", "train"])
def test_an_output_file_that_cannot_be_replaced_is_one_line_naming_it_and_the_operation(stage, capsys, ref, work,
                                                                                        kimi_target, immutable):
    """The finished output's manifest.json made immutable, then a run that must rewrite it: 02 redoes a deleted
    file, the others replace their output (another --max-seq-len, draft vocab size or lr, with --overwrite)."""
    out = {"prepare": work["data"], "extract": work["hs"], "vocab": work["vocab"], "train": work["checkpoints"]}[stage]
    extra = {"prepare": ["--max-seq-len", "400", "--overwrite"], "extract": [],
             "vocab": ["--draft-vocab-size", "128", "--overwrite"], "train": ["--lr", "0.002", "--overwrite"]}[stage]
    if stage == "extract":
        (work["hs"] / "hs_3.safetensors").unlink()
    immutable(out / "manifest.json")
    code, error = refused(capsys, *_stage_args(stage, ref, work, kimi_target, out), *extra)
    operation = ("renaming the new one (.manifest.json.tmp-{}) into place".format(writer_tag()) if stage == "extract"
                 else "deleting it")
    assert code == 74 and error == (f"{out / 'manifest.json'}: {operation} failed (Operation not permitted); fix the "
                                    f"path (permissions, mount, free space) or choose another one, then rerun"), error


def test_an_os_error_outside_the_file_helpers_is_one_line_naming_the_path_and_the_operation(capsys, tmp_path):
    """stage_main turns an OSError raised anywhere (a library's write, speculators' checkpoint save) into the line."""
    from eagle3_pipeline.stage import stage_main

    blocker = tmp_path / "a-file"
    blocker.write_text("")

    @stage_main
    def stage(argv):
        (blocker / "sub").mkdir()

    assert stage([]) == 74
    assert capsys.readouterr().err.splitlines() == [
        f"error: {blocker / 'sub'}: creating the directory failed (Not a directory); fix the path (permissions, mount, "
        f"free space) or choose another one, then rerun"]

    @stage_main
    def bug(argv):
        raise OSError("no path in it")  # not a path's error: a bug keeps its traceback

    with pytest.raises(OSError, match="no path in it"):
        bug([])


def test_a_failed_swap_puts_the_old_directory_back(tmp_path, immutable):
    """atomic_path: when the new directory cannot be renamed into place after the old one was moved aside, the old
    one is renamed back: never neither."""
    from eagle3_pipeline.errors import StageError
    from eagle3_pipeline.files import atomic_path

    final = tmp_path / "out"
    final.mkdir()
    (final / "kept.txt").write_text("old")
    with pytest.raises((StageError, OSError)) as raised:
        with atomic_path(final) as tmp:
            tmp.mkdir()
            (tmp / "new.txt").write_text("new")
            immutable(tmp)  # a directory with the flag cannot be renamed
    assert final.is_dir() and [p.name for p in final.iterdir()] == ["kept.txt"], sorted(p.name for p in tmp_path.iterdir())
    assert isinstance(raised.value, StageError) and str(raised.value) == (
        f"{final}: renaming the new one ({tmp.name}) into place failed (Operation not permitted); fix the path "
        f"(permissions, mount, free space) or choose another one, then rerun")


# --- end to end: the real script, its exit code and its one line --------------------------------------

@pytest.mark.slow
def test_a_refusal_is_one_line_and_an_exit_code_from_the_real_script(kimi_target, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(GOOD + "\n" + BAD_ROWS["unknown_role"][0] + "\n")
    result = subprocess.run([sys.executable, str(SCRIPTS / STAGE_SCRIPTS["prepare"]), "--profile", "cpu-mini",
                             "--target", str(kimi_target), "--data", str(data), "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 4
    assert [line for line in result.stderr.splitlines() if line.startswith("error")] == [
        f"error: {data}:2: turn 0 has unknown role 'wizard'"]
    assert "Traceback" not in result.stderr
