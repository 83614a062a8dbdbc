"""Chat data for the bench's testbeds, offline: prompts a chat user would send, answered by the target.

Nothing here is SmolLM2's: the conversations carry no system message, so each target's own chat template decides
(SmolLM2's and Qwen2.5's both insert their default system prompt), and a turn ends where the target's
generation_config stops it (bench/testbed.py: Qwen's <|im_end|>); the token rows keep that stop token.

1. `prompts`: prompts built from text that ships with Python and Debian (the standard library's
   sources and docstrings, read with `ast` without importing anything; /usr/share/common-licenses):
   explain / review / rewrite code, write a function from a docstring's summary, summarise or
   explain documentation, what a module is for, explain a licence paragraph, and two-turn
   conversations whose second turn is a follow-up. Deterministic for a given Python (its version is
   recorded); split by source module (a module's prompts are all train or all eval), so the held-out
   evaluation prompts share no source text with the training prompts.
2. `regenerate`: the target answers them itself through vLLM, greedy, in its own chat template
   (on-policy data: "regenerate responses"). A two-turn conversation is generated turn by turn.
   `--answers-per-prompt N --temperature T`: each training prompt answered N times, sampled (seeded per
   prompt, answer and turn), the data lever of issue 44; the held-out prompts stay greedy.
   Writes, in OUT/:
     train_tokens.jsonl     one row per assistant turn: `input_ids` = the prompt as vLLM tokenized it +
                            the generated ids, `loss_mask` 1 on the generated ids (stage 01 takes these
                            rows as they are: inference-exact, no re-tokenisation of the answer)
     train_messages.jsonl   the same conversations as OpenAI messages (answers decoded)
     train_offpolicy.jsonl  off-policy variant: answers written from the source text where one exists
                            (the docstring for "what does this do", the code for "write a function")
     eval_prompts.jsonl     held-out prompts as messages (a two-turn one carries the target's own first
                            answer), with `kind` (code / explanation / multi-turn)
     summary.json           counts, tokens, repeated-4-gram fraction, wall time, settings

    python bench/chat_data.py prompts --out work/smollm2/prompts.jsonl
    python bench/chat_data.py regenerate --target .cache/smollm2-135m-instruct \
        --prompts work/smollm2/prompts.jsonl --out work/smollm2/chat
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

PROMPTS_VERSION = 1
EVAL_FRACTION = 0.15  # of the source modules (by a hash of the module name)
MAX_CODE_LINES = 40
MAX_DOC_CHARS = 1200
# Packages of the standard library that are not library text a user asks about, or that are huge
# generated tables.
SKIP_PARTS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
              "dist-packages", "__pycache__", "encodings", "pydoc_data", "unicodedata"}
SKIP_MODULES = {"antigravity", "this", "__phello__", "_pydecimal", "_pydatetime"}
LICENSES_DIR = Path("/usr/share/common-licenses")

FOLLOW_UPS = [
    "Can you show a shorter version?",
    "Can you give me an example of how to use it?",
    "What edge cases should I watch out for?",
    "How would I write a unit test for this?",
    "Thanks! Can you explain that again in simpler words?",
    "Is there a more efficient way to do this?",
]
# prompt kind -> evaluation group
KIND_GROUP = {
    "code_explain": "code", "code_review": "code", "code_rewrite": "code", "code_write": "code",
    "doc_summary": "explanation", "doc_explain": "explanation", "module_purpose": "explanation",
    "license_explain": "explanation",
}


def stable_hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


def is_eval_module(module: str) -> bool:
    return stable_hash("split:" + module) % 1000 < EVAL_FRACTION * 1000


def stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_PARTS or rel.parts[0] in SKIP_PARTS:
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if module.split(".")[0] in SKIP_MODULES or module.startswith("_") or "._" in module:
            continue
        out.append((module, path))
    return out


def first_line(doc: str) -> str:
    return doc.strip().split("\n\n")[0].replace("\n", " ").strip()


def code_prompts(module: str, path: Path) -> list[dict]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    prompts = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) > 80:
        prompts.append({"kind": "module_purpose", "reference": first_line(doc),
                        "turns": [f"What is the `{module}` module in Python used for?"]})
        paragraph = doc.strip()[:MAX_DOC_CHARS]
        prompts.append({"kind": "doc_summary", "reference": first_line(doc),
                        "turns": [f"Summarize this documentation in two or three sentences:\n\n{paragraph}"]})
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    functions += [item for node in tree.body if isinstance(node, ast.ClassDef)
                  for item in node.body if isinstance(item, ast.FunctionDef)]
    for node in functions:
        if node.name.startswith("_"):
            continue
        segment = ast.get_source_segment(source, node)
        if not segment:
            continue
        lines = segment.splitlines()
        fdoc = ast.get_docstring(node) or ""
        name = f"{module}.{node.name}"
        h = stable_hash(name)
        if isinstance(node, ast.FunctionDef) and 4 <= len(lines) <= MAX_CODE_LINES:
            kind = ("code_explain", "code_review", "code_rewrite")[h % 3]
            ask = {
                "code_explain": "What does this Python function do?",
                "code_review": "Can you review this code and suggest improvements?",
                "code_rewrite": "Rewrite this function so it is easier to read, and explain your changes.",
            }[kind]
            prompts.append({"kind": kind, "reference": first_line(fdoc) if fdoc else "",
                            "turns": [f"{ask}\n\n```python\n{segment}\n```"]})
        if fdoc and 30 <= len(first_line(fdoc)) <= 200:
            if isinstance(node, ast.FunctionDef) and h % 2 == 0 and len(lines) <= MAX_CODE_LINES:
                prompts.append({"kind": "code_write", "reference": segment,
                                "turns": [f"Write a Python function `{node.name}` that does the following: "
                                          f"{first_line(fdoc)}"]})
            else:
                prompts.append({"kind": "doc_explain", "reference": fdoc.strip()[:MAX_DOC_CHARS],
                                "turns": [f"I'm reading the docs for `{name}`: \"{first_line(fdoc)}\" "
                                          f"Can you explain what that means, with an example?"]})
    return prompts


def license_prompts() -> list[tuple[str, dict]]:
    out = []
    if not LICENSES_DIR.is_dir():
        return out
    for path in sorted(LICENSES_DIR.iterdir()):
        if not path.is_file() or path.is_symlink():
            continue
        text = path.read_text(errors="replace")
        paragraphs = [p.strip() for p in text.split("\n\n") if 300 <= len(p.strip()) <= MAX_DOC_CHARS]
        for i, paragraph in enumerate(paragraphs[:6]):
            out.append((f"license:{path.name}", {
                "kind": "license_explain", "reference": "",
                "turns": [f"Explain this license paragraph in plain English:\n\n{paragraph}"]}))
    return out


def build_prompts(out: Path) -> dict:
    """All prompts, one JSON object a line: id, source, split, kind, group, turns, reference."""
    records = []
    sources = [(module, p) for module, path in stdlib_files() for p in code_prompts(module, path)]
    sources += license_prompts()
    for module, prompt in sources:
        top = module.split(".")[0]
        pid = f"{module}:{prompt['kind']}:{stable_hash(prompt['turns'][0]) % 10**8:08d}"
        h = stable_hash(pid)
        if h % 4 == 0:  # a quarter become two-turn conversations
            prompt = {**prompt, "turns": prompt["turns"] + [FOLLOW_UPS[h % len(FOLLOW_UPS)]]}
        group = "multi-turn" if len(prompt["turns"]) > 1 else KIND_GROUP[prompt["kind"]]
        records.append({"id": pid, "source": module, "split": "eval" if is_eval_module(top) else "train",
                        "group": group, **prompt})
    seen, unique = set(), []
    for record in records:  # identical text from two places (re-exported functions) counts once
        key = tuple(record["turns"])
        if key not in seen:
            seen.add(key)
            unique.append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as handle:
        for record in unique:
            handle.write(json.dumps(record) + "\n")
    os.replace(tmp, out)
    counts = {"python": platform.python_version(), "prompts_version": PROMPTS_VERSION, "total": len(unique)}
    for record in unique:
        counts[f"{record['split']}/{record['group']}"] = counts.get(f"{record['split']}/{record['group']}", 0) + 1
    return counts


# --- regeneration ---------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def select(records: list[dict], split: str, limit: int | None, per_group: int | None = None) -> list[dict]:
    chosen = [r for r in records if r["split"] == split]
    chosen.sort(key=lambda r: stable_hash("order:" + r["id"]))  # mixed kinds at any limit
    if per_group is not None:
        by_group: dict[str, list[dict]] = {}
        for record in chosen:
            by_group.setdefault(record["group"], []).append(record)
        chosen = [r for group in sorted(by_group) for r in by_group[group][:per_group]]
    return chosen[:limit] if limit is not None else chosen


def repeated_4gram_fraction(outputs: list[list[int]]) -> float:
    repeated = total = 0
    for tokens in outputs:
        seen: set = set()
        for i in range(3, len(tokens)):
            gram = tuple(tokens[i - 3:i + 1])
            repeated += gram in seen
            seen.add(gram)
        total += len(tokens)
    return repeated / max(1, total)


def regenerate(target: str, prompts_path: Path, out: Path, train_limit: int | None, eval_per_group: int,
               max_tokens: int, max_model_len: int, dtype: str, answers_per_prompt: int = 1, temperature: float = 0.0,
               gpu_memory_utilization: float = 0.5, kv_cache_gib: float | None = None) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    records = read_jsonl(prompts_path)
    train = select(records, "train", train_limit)
    evals = select(records, "eval", None, per_group=eval_per_group)
    tokenizer = AutoTokenizer.from_pretrained(target)
    # a fixed KV cache lets several engines start on one GPU at once: sized from gpu_memory_utilization alone, vLLM
    # 0.26 counts what other processes allocate during its profiling against its own share (an H200 hold, 2026-12-03:
    # three regenerations started together at 0.2 each, one found -1.54 GiB for its KV cache)
    kv = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib else {}
    llm = LLM(model=target, dtype=dtype, max_model_len=max_model_len, seed=0, gpu_memory_utilization=gpu_memory_utilization,
              **kv)
    engine_s = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)

    def sampling(conv: dict, turn: int) -> SamplingParams:
        """Greedy for the held-out prompts and for one answer per prompt; with several answers per training
        prompt (the data lever "sampled answers", as SpecForge regenerates at temperature 0.8), each answer
        samples at `temperature` with its own seed, so a prompt's answers differ and a rerun repeats them."""
        if conv["record"]["split"] != "train" or temperature == 0.0:
            return greedy
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              seed=stable_hash(f"{conv['record']['id']}:{conv['answer']}:{turn}") % 2**31)

    def ids_of(messages: list[dict]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # conversations: list of (record, messages so far); generate turn by turn
    # a training prompt answered `answers_per_prompt` times is that many conversations (answer = which one)
    convs = [{"record": r, "answer": a, "messages": [], "rows": []} for r in train for a in range(answers_per_prompt)]
    convs += [{"record": r, "answer": 0, "messages": [], "rows": []} for r in evals]
    max_turns = max(len(r["turns"]) for r in train + evals)
    generated_tokens = 0
    all_outputs: list[list[int]] = []
    for turn in range(max_turns):
        active = [c for c in convs if turn < len(c["record"]["turns"])]
        # eval conversations stop before their last turn's answer (that is what is measured)
        active = [c for c in active if not (c["record"]["split"] == "eval" and turn == len(c["record"]["turns"]) - 1)]
        prompts = []
        for conv in active:
            conv["messages"].append({"role": "user", "content": conv["record"]["turns"][turn]})
            prompts.append(ids_of(conv["messages"]))
        fits = [i for i, p in enumerate(prompts) if len(p) + max_tokens <= max_model_len]
        print(f"turn {turn + 1}/{max_turns}: {len(fits):,} conversations answer", flush=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in fits],
                               [sampling(active[i], turn) for i in fits], use_tqdm=True)  # hours on a CPU
        done = set()
        for i, output in zip(fits, outputs):
            conv, generated = active[i], list(output.outputs[0].token_ids)
            answer = tokenizer.decode(generated, skip_special_tokens=True)
            if not answer.strip():
                continue
            done.add(i)
            conv["messages"].append({"role": "assistant", "content": answer})
            conv["rows"].append({"input_ids": prompts[i] + generated,
                                 "loss_mask": [0] * len(prompts[i]) + [1] * len(generated)})
            generated_tokens += len(generated)
            all_outputs.append(generated)
        for i, conv in enumerate(active):  # too long or empty: the conversation ends here
            if i not in done:
                conv["record"] = {**conv["record"], "turns": conv["record"]["turns"][:turn]}
                conv["messages"].pop()
    out.mkdir(parents=True, exist_ok=True)
    train_convs = [c for c in convs if c["record"]["split"] == "train" and c["rows"]]
    token_rows, message_rows, offpolicy_rows = [], [], []
    for conv in train_convs:
        record = conv["record"]
        answer = f"_a{conv['answer']}" if answers_per_prompt > 1 else ""
        for t, row in enumerate(conv["rows"]):
            # primary_id groups a conversation's rows, a prompt's several answers too (stage 01 keeps them on one
            # side of the split: a held-out row never shares its prompt with a trained one)
            token_rows.append({**row, "id": f"{record['id']}{answer}_gen{t}", "primary_id": record["id"], "turn": t})
        message_rows.append({"id": record["id"] + answer, "kind": record["kind"], "messages": conv["messages"]})
        if record.get("reference") and len(record["turns"]) == 1 and conv["answer"] == 0:
            offpolicy_rows.append({"id": record["id"], "kind": record["kind"], "messages": [
                {"role": "user", "content": record["turns"][0]}, {"role": "assistant", "content": record["reference"]}]})
    eval_rows = []
    for conv in convs:
        record = conv["record"]
        if record["split"] != "eval" or not record["turns"]:
            continue
        messages = conv["messages"] + [{"role": "user", "content": record["turns"][-1]}]
        if len(record["turns"]) > 1 and len(conv["messages"]) != 2 * (len(record["turns"]) - 1):
            continue
        eval_rows.append({"id": record["id"], "kind": record["group"], "messages": messages})
    write_jsonl(out / "train_tokens.jsonl", token_rows)
    write_jsonl(out / "train_messages.jsonl", message_rows)
    write_jsonl(out / "train_offpolicy.jsonl", offpolicy_rows)
    write_jsonl(out / "eval_prompts.jsonl", eval_rows)
    summary = {
        "target": target, "prompts": str(prompts_path), "train_conversations": len(message_rows),
        "train_prompts": len({c["record"]["id"] for c in train_convs}),
        "train_rows": len(token_rows), "train_tokens": sum(len(r["input_ids"]) for r in token_rows),
        "train_generated_tokens": sum(sum(r["loss_mask"]) for r in token_rows),
        "offpolicy_rows": len(offpolicy_rows), "eval_prompts": len(eval_rows),
        "eval_by_kind": {k: sum(r["kind"] == k for r in eval_rows) for k in sorted({r["kind"] for r in eval_rows})},
        "generated_tokens": generated_tokens, "repeated_4gram_fraction": repeated_4gram_fraction(all_outputs),
        "truncated_at_max_tokens": sum(len(o) >= max_tokens for o in all_outputs),
        "settings": {"max_tokens": max_tokens, "max_model_len": max_model_len, "dtype": dtype,
                     "greedy": temperature == 0.0, "answers_per_prompt": answers_per_prompt, "temperature": temperature},
        "engine_start_s": engine_s, "wall_s": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts", help="build the prompts file from Python's and Debian's text")
    p.add_argument("--out", required=True)
    r = sub.add_parser("regenerate", help="answer the prompts with the target through vLLM (greedy, or sampled)")
    r.add_argument("--target", required=True)
    r.add_argument("--prompts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--train-limit", type=int, default=None, help="at most this many training conversations")
    r.add_argument("--eval-per-kind", type=int, default=32, help="held-out prompts per kind (code, explanation, multi-turn)")
    r.add_argument("--max-tokens", type=int, default=320)
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--answers-per-prompt", type=int, default=1,
                   help="answers per training prompt (> 1 with --temperature > 0: sampled answers, a data lever)")
    r.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the training answers (0 = greedy; held-out prompts stay greedy)")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU (several engines at once)")
    r.add_argument("--kv-cache-gib", type=float, default=None,
                   help="a fixed KV cache (GiB) instead of one sized at start: several engines may then start at once")
    args = parser.parse_args(argv)
    if args.command == "prompts":
        print(json.dumps(build_prompts(Path(args.out)), indent=2))
        return 0
    prompts = Path(args.prompts)
    if not prompts.is_file():
        print(f"error: {prompts}: prompts file not found (build it with `chat_data.py prompts`)", file=sys.stderr)
        return 2
    if args.answers_per_prompt > 1 and args.temperature == 0.0:
        print("error: --answers-per-prompt > 1 needs --temperature > 0 (greedy answers to one prompt are identical)",
              file=sys.stderr)
        return 2
    summary = regenerate(args.target, prompts, Path(args.out), args.train_limit, args.eval_per_kind,
                         args.max_tokens, args.max_model_len, args.dtype, args.answers_per_prompt, args.temperature,
                         args.gpu_memory_utilization, args.kv_cache_gib)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
