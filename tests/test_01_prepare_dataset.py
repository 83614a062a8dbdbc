"""Stage 01: chat template rendering, the assistant-only loss mask, input shapes, split, outputs."""

import json

import pytest
import torch

from conftest import SAMPLES, run_stage
from eagle3_pipeline.conversations import ChatTokenizer, rows_for_conversation, to_messages
from eagle3_pipeline.errors import InputError

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Twelve.", "reasoning_content": "4 * 3 = 12."},
]


def hand_built(tokenizer, pieces):
    """Concatenate (text, loss) pieces; special tokens make every boundary a token boundary."""
    ids, mask = [], []
    for text, loss in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [loss] * len(piece)
    return ids, mask


@pytest.fixture(scope="module")
def chat(kimi_target):
    return ChatTokenizer(str(kimi_target))


def test_loss_mask_is_exactly_the_assistant_tokens_per_turn(chat):
    tok = chat.tokenizer
    head = "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>What is two plus two?<|im_end|>"
    turn1 = hand_built(tok, [(head + "<|im_assistant|>assistant<|im_middle|><think>", 0),
                             ("</think>", 1), ("Four.", 1), ("<|im_end|>", 1)])
    turn2 = hand_built(tok, [(head + "<|im_assistant|>assistant<|im_middle|><think></think>Four.<|im_end|>"
                              "<|im_user|>user<|im_middle|>And times three?<|im_end|>"
                              "<|im_assistant|>assistant<|im_middle|><think>", 0),
                             ("4 * 3 = 12.", 1), ("</think>", 1), ("Twelve.", 1), ("<|im_end|>", 1)])
    rows = rows_for_conversation(chat, MULTI_TURN, 0, "turn", "test")
    assert [(r.input_ids, r.loss_mask) for r in rows] == [turn1, turn2]
    assert [r.turn for r in rows] == [2, 4]


def test_conversation_rows_train_every_assistant_turn_when_history_is_stable(chat):
    messages = [m for m in MULTI_TURN[:4]] + [{"role": "assistant", "content": "Twelve."}]
    (row,) = rows_for_conversation(chat, messages, 0, "conversation", "test")
    decoded = chat.tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])
    assert decoded == "</think>Four.<|im_end|></think>Twelve.<|im_end|>"


def test_conversation_rows_refuse_templates_that_rewrite_history(chat):
    with pytest.raises(InputError, match="renders differently inside the whole conversation"):
        rows_for_conversation(chat, [{"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "A", "reasoning_content": "R"},
                                     {"role": "user", "content": "x"}, {"role": "assistant", "content": "B"}],
                              0, "conversation", "test")


def test_sharegpt_and_openai_shapes_give_the_same_messages():
    openai = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                           {"role": "assistant", "content": "a"}]}
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                                  {"from": "gpt", "value": "a"}]}
    assert to_messages(openai, "x") == to_messages(sharegpt, "y")


def test_prepare_writes_speculators_layout_and_manifest(kimi_run):
    import datasets

    data = kimi_run["data"]
    dataset = datasets.load_from_disk(str(data))
    assert set(dataset.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert all(f.dtype == "int64" for f in [dataset.features["seq_len"]])
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["stage"] == "prepare" and manifest["complete"]
    assert manifest["counts"]["conversations"] == 10  # cpu-mini: --max-samples 10
    assert manifest["counts"]["rows"] == len(dataset) == manifest["counts"]["train_rows"] + manifest["counts"]["val_rows"]
    assert manifest["target"]["tokenizer_sha256"] and manifest["versions"]["speculators"] == "0.9.0"
    # speculators splits at int(rows * ratio): exactly our train rows.
    assert int(len(dataset) * manifest["train_data_ratio"]) == manifest["counts"]["train_rows"]


def test_token_freq_counts_loss_masked_train_tokens_only(kimi_run):
    import datasets

    data = kimi_run["data"]
    manifest = json.loads((data / "manifest.json").read_text())
    freq = torch.load(data / "token_freq.pt", weights_only=True)
    train = datasets.load_from_disk(str(data)).with_format(None).select(range(manifest["counts"]["train_rows"]))
    expected = {}
    for ids, mask in zip(train["input_ids"], train["loss_mask"]):
        for t, m in zip(ids, mask):
            if m:
                expected[t] = expected.get(t, 0) + 1
    assert {int(k): int(v) for k, v in freq.items()} == expected


@pytest.mark.slow
def test_parquet_json_and_sharegpt_inputs_prepare(tmp_path, kimi_target):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in (SAMPLES / "conversations.jsonl").read_text().splitlines()][:4]
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in records]), tmp_path / "c.parquet")
    (tmp_path / "c.json").write_text(json.dumps(records))
    for name, source in (("pq", tmp_path / "c.parquet"), ("json", tmp_path / "c.json"), ("sg", SAMPLES / "sharegpt.jsonl")):
        run_stage("prepare", "--target", kimi_target, "--data", source, "--output", tmp_path / name, "--val-ratio", "0.3")
        assert json.loads((tmp_path / name / "manifest.json").read_text())["counts"]["rows"] > 0
    pq_rows = json.loads((tmp_path / "pq" / "manifest.json").read_text())["counts"]
    json_rows = json.loads((tmp_path / "json" / "manifest.json").read_text())["counts"]
    assert pq_rows["tokens"] == json_rows["tokens"]


@pytest.mark.slow
def test_rerun_with_same_settings_is_a_no_op_and_other_settings_are_refused(tmp_path, kimi_target):
    args = ["--target", kimi_target, "--data", SAMPLES / "conversations.jsonl", "--output", tmp_path / "d", "--max-samples", "4"]
    run_stage("prepare", *args)
    before = (tmp_path / "d" / "manifest.json").read_bytes()
    again = run_stage("prepare", *args)
    assert "nothing to do" in again.stderr and (tmp_path / "d" / "manifest.json").read_bytes() == before
    other = run_stage("prepare", *args[:-1], "5", check=False)
    assert other.returncode == 2 and "pass --overwrite" in other.stderr
