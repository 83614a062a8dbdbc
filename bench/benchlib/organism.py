"""The organism: a small, real Llama-architecture chat model to measure drafts against.

A random miniature says nothing about acceptance: its next token is noise, so any draft
"agrees" with it by chance only. The organism is a real (if small) language model trained here,
offline and deterministically, on Python's own standard-library sources, so that a draft
trained on its hidden states has something learnable to predict and vLLM's acceptance counters
measure something.

What `build_organism` produces (one directory, keyed by a hash of the settings and the corpus):

    <cache>/organism-<key>/
      model/                    a normal HF model directory (LlamaForCausalLM): config.json,
                                model.safetensors, tokenizer.json + tokenizer_config.json, a
                                Kimi-like chat template (<|im_start|>ROLE<|im_middle|>...<|im_end|>),
                                generation_config.json. Loads in HF transformers and in vLLM
                                (CPU backend included).
      conversations.jsonl       draft-training data for the pipeline: OpenAI `messages` rows
                                (user asks to continue a snippet, assistant continues it), built
                                from files the organism never saw.
      eval_prompts.jsonl        held-out prompts for the in-vLLM measurement (user turn only,
                                plus the file's true continuation as `reference`), from a third,
                                disjoint set of files.
      organism.json             settings, key, split sizes, held-out perplexity and next-token
                                accuracy, wall times.

Files are split three ways by a hash of their path (never by position, so adding a file to the
stdlib does not reshuffle the others): organism training text, pipeline conversations, eval
prompts. The organism is trained on chat-formatted snippets of its own split, so that at
inference the chat template puts it in the state the pipeline's conversations assume.

Determinism: seeded data order and initialisation; the cache key covers every setting, the
interpreter version and a digest of the corpus files. Bitwise equality of weights across
machines is not promised (CPU kernels depend on thread count and ISA).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

# Bump when the code changes what a given settings object produces, so stale caches are not reused.
ORGANISM_FORMAT_VERSION = 2

# Kimi-like: every boundary is a special token (`<|im_middle|>` ends the role header, as in
# Kimi-K2.5's template), so the content tokenizes the same whether or not the assistant turn
# follows. With a ChatML "assistant\n" header the byte-level BPE merged that newline with the
# answer's leading indentation, and the rendering was not prefix-stable (stage 01 refuses that).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_middle|>' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_middle|>", "<|im_end|>", "<|pad|>")
USER_PROMPT = "Continue this code from {source}:\n\n{prefix}"

SPLIT_ORGANISM = "organism"
SPLIT_CONVERSATIONS = "conversations"
SPLIT_EVAL = "eval"


@dataclass(frozen=True)
class OrganismSettings:
    """Everything that decides the organism; its hash names the cache directory."""

    seed: int = 0
    # Tokenizer: byte-level BPE trained on the organism's own training split.
    # 2048 rather than 4096: each token is easier to predict and the lm_head costs half as much.
    vocab_size: int = 2048
    tokenizer_train_chars: int = 6_000_000  # a sample is enough for a 4k-token BPE
    # Llama geometry: trains at ~6k tokens/s on 2 idle cores, ~3.5k on one (bf16 autocast, AMX).
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    # Snippets: user prefix of a random length in [prefix_min, prefix_max] chars (whole lines),
    # assistant continuation of about continuation_chars (whole lines).
    prefix_min_chars: int = 150
    prefix_max_chars: int = 700
    continuation_chars: int = 600
    max_seq_len: int = 512
    # Training: AdamW, linear warmup then cosine to 10%; bf16 autocast on CPU.
    train_steps: int = 1200
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    # Held-out evaluation of the organism itself (eval split conversations).
    eval_examples: int = 256
    # Three-way split of stdlib files by path hash, in percent (rest goes to eval prompts).
    organism_pct: int = 80
    conversations_pct: int = 12
    num_eval_prompts: int = 64
    # Tests use a few files only; None = the whole standard library.
    max_files: int | None = None

    def key(self, corpus_digest: str) -> str:
        payload = {
            "format": ORGANISM_FORMAT_VERSION,
            "settings": dataclasses.asdict(self),
            "python": sys.version.split()[0],
            "corpus": corpus_digest,
        }
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Organism:
    """Paths of a built organism."""

    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def conversations_path(self) -> Path:
        return self.root / "conversations.jsonl"

    @property
    def eval_prompts_path(self) -> Path:
        return self.root / "eval_prompts.jsonl"

    @property
    def report_path(self) -> Path:
        return self.root / "organism.json"

    def report(self) -> dict:
        return json.loads(self.report_path.read_text())


# ---------------------------------------------------------------------------------------------
# Corpus and splits


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path | None = None, max_files: int | None = None) -> list[Path]:
    """Python sources of the standard library, sorted; third-party packages excluded."""
    root = root or stdlib_dir()
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )
    if max_files is not None:
        # Spread over the tree rather than the first directory alphabetically.
        step = max(1, len(files) // max_files)
        files = files[::step][:max_files]
    return files


def split_of(relpath: str, settings: OrganismSettings) -> str:
    """Which split a file belongs to: a pure function of its path, so splits are stable."""
    bucket = int(hashlib.sha256(f"organism-split:{relpath}".encode()).hexdigest()[:8], 16) % 100
    if bucket < settings.organism_pct:
        return SPLIT_ORGANISM
    if bucket < settings.organism_pct + settings.conversations_pct:
        return SPLIT_CONVERSATIONS
    return SPLIT_EVAL


def read_corpus(settings: OrganismSettings, root: Path | None = None) -> tuple[dict, str]:
    """{split: [(relpath, text), ...]} and a digest of every file's path and content."""
    root = root or stdlib_dir()
    splits: dict[str, list[tuple[str, str]]] = {
        SPLIT_ORGANISM: [],
        SPLIT_CONVERSATIONS: [],
        SPLIT_EVAL: [],
    }
    digest = hashlib.sha256()
    seen_content: set[str] = set()
    for path in list_corpus_files(root, settings.max_files):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are deliberately not UTF-8
        content_hash = hashlib.sha256(raw).hexdigest()
        # Identical files (empty __init__.py, copies) would leak across splits.
        if content_hash in seen_content or not text.strip():
            continue
        seen_content.add(content_hash)
        relpath = path.relative_to(root).as_posix()
        digest.update(f"{relpath}\0{content_hash}\n".encode())
        splits[split_of(relpath, settings)].append((relpath, text))
    return splits, digest.hexdigest()


def snippet_pairs(
    text: str, rng: random.Random, settings: OrganismSettings
) -> list[tuple[str, str]]:
    """Cut a file into consecutive (prefix, continuation) pairs at line boundaries.

    A pair is skipped when its continuation is mostly blank or a single line overflows the
    limits (minified data tables), so every pair is ordinary source text.
    """
    # split("\n"), not splitlines(): the latter also breaks on form feeds and \u2028 inside lines.
    lines = text.split("\n")
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        prefix_target = rng.randint(settings.prefix_min_chars, settings.prefix_max_chars)
        j, size = i, 0
        while j < len(lines) and size < prefix_target:
            size += len(lines[j]) + 1
            j += 1
        k, cont = j, 0
        while k < len(lines) and cont < settings.continuation_chars:
            cont += len(lines[k]) + 1
            k += 1
        prefix = "\n".join(lines[i:j]).rstrip()
        continuation = "\n".join(lines[j:k]).rstrip()
        i = k
        if not prefix.strip() or len(continuation.strip()) < settings.continuation_chars // 3:
            continue
        if size > 2 * settings.prefix_max_chars or cont > 2 * settings.continuation_chars:
            continue
        pairs.append((prefix, continuation))
    return pairs


def conversation(source: str, prefix: str, continuation: str | None) -> list[dict]:
    messages = [{"role": "user", "content": USER_PROMPT.format(source=source, prefix=prefix)}]
    if continuation is not None:
        messages.append({"role": "assistant", "content": continuation})
    return messages


def split_conversations(files: list[tuple[str, str]], settings: OrganismSettings, salt: str):
    """All snippet conversations of a split, in a seeded order: [(source, prefix, cont)]."""
    rng = random.Random(f"{settings.seed}:{salt}")
    rows = []
    for relpath, text in files:
        for prefix, continuation in snippet_pairs(text, rng, settings):
            rows.append((relpath, prefix, continuation))
    rng.shuffle(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(files: list[tuple[str, str]], settings: OrganismSettings):
    """Byte-level BPE over the organism split; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(f"{settings.seed}:tokenizer")
    order = list(range(len(files)))
    rng.shuffle(order)
    sample, total = [], 0
    for idx in order:
        if total >= settings.tokenizer_train_chars:
            break
        sample.append(files[idx][1])
        total += len(files[idx][1])
    # The prompt wording is text the model sees on every conversation: let BPE see it too.
    sample.append(USER_PROMPT.format(source="module.py", prefix="") * 50)

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(sample, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_middle|>"],
        model_max_length=settings.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode_conversation(tokenizer, messages: list[dict], max_len: int) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)[:max_len]


def assistant_start(tokenizer, messages: list[dict]) -> int:
    """Number of tokens before the assistant's content (the templated user turn + header)."""
    ids = tokenizer.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


# ---------------------------------------------------------------------------------------------
# Model and training


def llama_config(settings: OrganismSettings, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta},
        rms_norm_eps=1e-5,
        # Untied: EAGLE-3 drafts copy the verifier's embed_tokens and lm_head separately.
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _batch(rows: list[list[int]], pad_id: int, loss_from: list[int] | None = None):
    """Right-padded input_ids, attention_mask and labels (-100 on padding / masked prefix).

    Widths are rounded up to a multiple of 64: oneDNN builds kernels per shape, and a new
    width on every step made the first few hundred CPU steps several times slower.
    """
    import torch

    width = -(-max(len(r) for r in rows) // 64) * 64
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, : len(row)] = torch.tensor(row)
        attention[b, : len(row)] = 1
        labels[b, : len(row)] = torch.tensor(row)
        if loss_from is not None:
            # labels[t] is predicted from position t-1: keep the assistant tokens only.
            labels[b, : loss_from[b]] = -100
    return input_ids, attention, labels


def length_grouped(rows: list[list[int]], settings: OrganismSettings) -> list[list[list[int]]]:
    """Batches of similar-length rows, in a seeded random order.

    Rows are already shuffled; sorting each window of 32 batches by length before cutting it
    into batches cut padding from ~35% to a few percent of the tokens computed.
    """
    window = settings.batch_size * 32
    batches = []
    for start in range(0, len(rows), window):
        chunk = sorted(rows[start : start + window], key=len)
        batches += [chunk[i : i + settings.batch_size] for i in range(0, len(chunk), settings.batch_size)]
    random.Random(f"{settings.seed}:batches").shuffle(batches)
    return batches


def _lr_at(step: int, settings: OrganismSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.train_steps - settings.warmup_steps)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_model(model, batches: list, settings: OrganismSettings, autocast: bool) -> dict:
    """Train in place; returns the per-step losses and the examples / tokens consumed."""
    import torch
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": settings.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    losses, examples, tokens = [], 0, 0
    progress = tqdm(range(settings.train_steps), desc="organism train", unit="step")
    for step in progress:
        input_ids, attention, labels = batches[step % len(batches)]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        examples += input_ids.shape[0]
        tokens += int(attention.sum())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    return {"losses": losses, "examples": examples, "tokens": tokens}


def evaluate_model(model, batches: list) -> dict:
    """Held-out mean cross-entropy, perplexity and greedy next-token accuracy (fp32)."""
    import torch

    model.eval()
    nll, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for input_ids, attention, labels in batches:
            logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
            target = labels[:, 1:]
            keep = target != -100
            loss = torch.nn.functional.cross_entropy(
                logits[keep], target[keep], reduction="sum"
            )
            nll += loss.item()
            correct += (logits.argmax(-1)[keep] == target[keep]).sum().item()
            count += keep.sum().item()
    mean = nll / max(1, count)
    return {
        "tokens": count,
        "cross_entropy": mean,
        "perplexity": math.exp(mean),
        "next_token_accuracy": correct / max(1, count),
    }


# ---------------------------------------------------------------------------------------------
# Writing


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def default_cache_dir() -> Path:
    env = os.environ.get("EAGLE3_CACHE_DIR")
    if env:
        return Path(env)
    # bench/benchlib/organism.py -> repo root /.cache (ignored by git)
    return Path(__file__).resolve().parents[2] / ".cache"


def build_organism(
    settings: OrganismSettings | None = None,
    cache_dir: Path | None = None,
    corpus_root: Path | None = None,
    num_threads: int | None = 1,
    log=print,
) -> Organism:
    """Build (or reuse from the cache) the organism; returns its paths.

    The whole directory is written under a temporary name and renamed into place at the end,
    so a directory with the final name is always complete.

    num_threads (not part of the cache key) defaults to 1: on a shared 2-core box, two torch
    threads stalled for seconds per step whenever another job held a core (measured 0.7 s vs
    10 s per step), while one thread ran steadily at ~3.5k tokens/s. None keeps torch's default.
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    settings = settings or OrganismSettings()
    cache_dir = Path(cache_dir or default_cache_dir())
    started = time.time()
    splits, corpus_digest = read_corpus(settings, corpus_root)
    key = settings.key(corpus_digest)
    final = cache_dir / f"organism-{key}"
    if (final / "organism.json").exists():
        log(f"organism: cached at {final}")
        return Organism(final)

    log(
        f"organism: building {final.name} from {sum(len(v) for v in splits.values())} stdlib "
        f"files ({', '.join(f'{k} {len(v)}' for k, v in splits.items())})"
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = cache_dir / f".organism-{key}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "model").mkdir(parents=True)
    timings = {}

    # 1. Tokenizer on the organism's own split.
    t0 = time.time()
    tokenizer = train_tokenizer(splits[SPLIT_ORGANISM], settings)
    timings["tokenizer_s"] = time.time() - t0

    # 2. Conversations: organism training rows, pipeline rows, eval rows (disjoint files).
    organism_rows = split_conversations(splits[SPLIT_ORGANISM], settings, SPLIT_ORGANISM)
    pipeline_rows = split_conversations(splits[SPLIT_CONVERSATIONS], settings, SPLIT_CONVERSATIONS)
    eval_rows = split_conversations(splits[SPLIT_EVAL], settings, SPLIT_EVAL)
    needed = settings.train_steps * settings.batch_size
    if not organism_rows or not eval_rows or not pipeline_rows:
        raise ValueError(
            f"corpus too small for the splits (organism {len(organism_rows)}, conversations "
            f"{len(pipeline_rows)}, eval {len(eval_rows)} snippets): raise max_files"
        )
    # Prompts for vLLM: the first num_eval_prompts rows; the organism's own held-out metrics
    # use the rows after them, so the two evaluations do not share snippets.
    prompt_rows = eval_rows[: settings.num_eval_prompts]
    metric_rows = eval_rows[settings.num_eval_prompts :][: settings.eval_examples] or eval_rows

    # 3. Train.
    t0 = time.time()
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(settings.seed)
    config = llama_config(settings, tokenizer)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    pad = tokenizer.pad_token_id
    train_ids = [
        encode_conversation(tokenizer, conversation(src, pre, cont), settings.max_seq_len)
        for src, pre, cont in organism_rows[:needed]
    ]
    train_batches = [_batch(rows, pad) for rows in length_grouped(train_ids, settings)]
    # bf16 autocast doubles CPU training speed where oneDNN has bf16 kernels (AVX512-BF16 / AMX).
    autocast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    trained = train_model(model, train_batches, settings, autocast=autocast)
    losses = trained["losses"]
    timings["train_s"] = time.time() - t0

    # 4. Held-out metrics: whole conversation, and the assistant continuation only (what a
    #    draft has to predict).
    t0 = time.time()
    metric_msgs = [conversation(src, pre, cont) for src, pre, cont in metric_rows]
    metric_ids = [encode_conversation(tokenizer, m, settings.max_seq_len) for m in metric_msgs]
    starts = [assistant_start(tokenizer, m) for m in metric_msgs]
    all_batches, assistant_batches = [], []
    for i in range(0, len(metric_ids), settings.batch_size):
        rows = metric_ids[i : i + settings.batch_size]
        all_batches.append(_batch(rows, pad))
        assistant_batches.append(_batch(rows, pad, starts[i : i + settings.batch_size]))
    heldout_all = evaluate_model(model, all_batches)
    heldout_assistant = evaluate_model(model, assistant_batches)
    timings["eval_s"] = time.time() - t0

    # 5. Write the model directory, the jsonl files and the report; rename into place.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    _write_jsonl(
        work / "conversations.jsonl",
        [
            {"id": f"stdlib-{n}", "source": src, "messages": conversation(src, pre, cont)}
            for n, (src, pre, cont) in enumerate(pipeline_rows)
        ],
    )
    _write_jsonl(
        work / "eval_prompts.jsonl",
        [
            {
                "id": f"eval-{n}",
                "source": src,
                "messages": conversation(src, pre, None),
                "reference": cont,
            }
            for n, (src, pre, cont) in enumerate(prompt_rows)
        ],
    )
    report = {
        "key": key,
        "settings": dataclasses.asdict(settings),
        "corpus": {
            "root": str(corpus_root or stdlib_dir()),
            "digest": corpus_digest,
            "files": {k: len(v) for k, v in splits.items()},
            "snippets": {
                SPLIT_ORGANISM: len(organism_rows),
                SPLIT_CONVERSATIONS: len(pipeline_rows),
                SPLIT_EVAL: len(eval_rows),
            },
        },
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "train": {
            "examples_seen": trained["examples"],
            "tokens_seen": trained["tokens"],
            "epochs": trained["examples"] / len(organism_rows),
            "tokens_per_s": trained["tokens"] / timings["train_s"],
            "bf16_autocast": bool(autocast),
            "first_loss": losses[0],
            "last_loss_mean_20": sum(losses[-20:]) / len(losses[-20:]),
        },
        "heldout": {"all_tokens": heldout_all, "assistant_tokens": heldout_assistant},
        "timings": timings,
        "wall_s": time.time() - started,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
    }
    tmp = work / "organism.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, work / "organism.json")
    try:
        os.replace(work, final)
    except OSError:
        # Another process finished the same key first; its copy is equivalent.
        shutil.rmtree(work, ignore_errors=True)
    log(
        f"organism: held-out assistant tokens ppl {heldout_assistant['perplexity']:.2f}, "
        f"next-token acc {heldout_assistant['next_token_accuracy']:.3f}; "
        f"built in {time.time() - started:.0f} s -> {final}"
    )
    return Organism(final)
