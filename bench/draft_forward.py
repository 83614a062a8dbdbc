"""The draft's forward time per verify step at Kimi-K2.5's width, per draft kind, on one GPU (issue 62 item 3).

Each kind's draft is built as `speculators train` builds it (speculators 0.9.0's own config resolution and
`build_draft_model` -> the kind's `from_training_args`, over a head-only Kimi-K2.5 verifier: benchlib.throughput),
random bf16 weights, and one speculative step is timed as serving runs it:
- eagle3: k sequential forwards (k = --ks), each one query per sequence (the first over --new-tokens), each with the
  draft lm_head and argmax;
- peagle: one forward over the new tokens + k - 1 mask positions (k parallel positions), lm_head over k;
- dflash, dspark: one forward over the block (the kind's speculators default: dflash 16, dspark 8) whose keys are the
  context's plus the new tokens' projected target states; dspark adds its Markov head (sequential over the block)
  and its confidence head.
The draft attends a KV cache holding the context (bench/README.md, "Draft forward time"). CUDA events, warm-up,
median over repeats; each step also as one CUDA graph (vLLM serves drafts with graphs).

    python bench/draft_forward.py                      # eagle3 peagle dflash dspark, batch 1 and 8 -> results/<gpu>-draft-forward.json
    python bench/draft_forward.py --toy --results /tmp/x   # CPU, toy width: the code runs; figures meaningless for speed
    python bench/draft_forward.py project --screen SCREEN.json --forward results/h100-draft-forward.json

`project`: benchlib/projection.py (the decode speed-up at Kimi-K2.5 for target steps of 20, 40, 80 ms, a projection).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchlib import projection, throughput

REPO = Path(__file__).resolve().parents[1]

KINDS = ("eagle3", "peagle", "dflash", "dspark")
DRAFT_VOCAB = 32000  # as bench/train_throughput.py's runs
MASK_TOKEN_ID = throughput.KIMI_K25_TEXT_CONFIG["pad_token_id"]  # Kimi's [PAD], what 04 passes (draft_kinds)

# --toy: a Kimi-shaped verifier small enough for the CPU (tests); its figures say nothing about speed.
TOY_TEXT = throughput.toy_kimi_text_overrides(8)
TOY_DRAFT_VOCAB = 64

METHOD = (
    "Each kind's draft built as `speculators train` builds it (speculators.train.config resolve + "
    "cli.build_draft_model -> the kind's from_training_args, the kind's own defaults, --draft-vocab-size {vocab}, "
    "--mask-token-id {mask}, --target-layer-ids from eagle3_pipeline.draft_kinds, --draft-attn-impl sdpa) over a "
    "head-only Kimi-K2.5 verifier (benchlib.throughput: real config, random embed/lm_head/norm), random bf16 weights. "
    "One speculative step per sequence, batch B: eagle3 = k sequential forwards (embed + fc'd target states for the "
    "first, its own hidden after; each forward: its decoder layer(s), norm, draft lm_head on the last position, "
    "argmax, d2t); peagle = one forward over new tokens + k - 1 mask positions (mask_hidden through fc), lm_head on "
    "k positions; dflash/dspark = one forward of the block (anchor + mask tokens) through the draft's layers, keys "
    "= context + the new tokens' fc'd target states + the block (DFlash attention), lm_head over the block's "
    "predicted positions; dspark also its Markov head one position at a time (each position's bias from the token "
    "argmax'd before it) and its confidence head. Context: every query attends a KV cache of the context's last "
    "min(context, sliding window) positions per draft layer (speculators' default draft: every layer sliding, "
    "window 2048; vLLM's sliding-window attention attends the same keys), random pre-rotated bf16 K/V "
    "preallocated on the device; a step writes its new positions' K/V after them in place (no copy), as paged "
    "slots do, and forgets them before the next repeat. The context's own K/V projection (earlier steps) and the "
    "target's forward are not timed. Attention: torch SDPA (not vLLM's kernels); no sampling beyond argmax. "
    "Timing: the whole step, torch.cuda events, {warmup} warm-up steps then {repeats} timed, median; eager and "
    "as one captured CUDA graph (graph replay, as vLLM serves drafts; `forward_ms` is the graph's where the capture "
    "worked)."
)


# ----------------------------------------------------------------------------------------------------------------
# The draft, as speculators train builds it


def build_draft(kind: str, verifier: Path, *, draft_vocab_size: int, mask_token_id: int, device: str,
                save_path: Path, extra_args: list[str] | None = None):
    """A `kind` draft over `verifier` through speculators 0.9.0's own path (`resolve` of the train CLI's argv, then
    `build_draft_model`, which calls the kind's `from_training_args`), with a synthetic vocabulary mapping (the
    first `draft_vocab_size` target ids: speed only). Returns the model in bf16 on `device`, eval mode."""
    import torch
    from speculators.model import SpeculatorModel
    from speculators.train import cli
    from speculators.train.config.resolution import resolve
    from speculators.train.config.schema import TrainConfig

    from eagle3_pipeline import draft_kinds

    text = json.loads((verifier / "config.json").read_text())["text_config"]
    layer_ids = draft_kinds.layer_ids(kind, int(text["num_hidden_layers"]))
    argv = ["--verifier-name-or-path", str(verifier), "--save-path", str(save_path), "--speculator-type", kind,
            "--draft-vocab-size", str(draft_vocab_size), "--mask-token-id", str(mask_token_id),
            "--draft-attn-impl", "sdpa", "--target-layer-ids", *map(str, layer_ids), *(extra_args or [])]
    args = argparse.Namespace(**resolve(TrainConfig, argv).flatten())
    vocab = int(text["vocab_size"])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    d2t = torch.zeros(draft_vocab_size, dtype=torch.long)
    try:  # random init on the device: seconds at Kimi width, where the CPU takes a minute
        with torch.device(device):
            model = cli.build_draft_model(args, SpeculatorModel.registry[kind], t2d, d2t, draft_vocab_size)
    except (RuntimeError, ValueError) as exc:  # speculators' loading code mixing devices: the CPU, as the trainer
        if device == "cpu":
            raise
        print(f"[{kind}] built on the CPU ({type(exc).__name__} on {device}: {str(exc).splitlines()[0][:200]})",
              flush=True)
        args = argparse.Namespace(**resolve(TrainConfig, argv).flatten())
        model = cli.build_draft_model(args, SpeculatorModel.registry[kind], t2d, d2t, draft_vocab_size)
    return model.to(device=device, dtype=torch.bfloat16).eval(), argv


def draft_record(kind: str, model) -> dict:
    """What was timed: the kind's layers, block, widths, parameters, and its served k rule (draft_kinds)."""
    from eagle3_pipeline import draft_kinds

    tl = model.config.transformer_layer_config
    config = model.config.to_dict()
    record = {"kind": kind, "class": type(model).__name__, "layers": int(tl.num_hidden_layers),
              "hidden_size": int(tl.hidden_size), "intermediate_size": int(tl.intermediate_size),
              "heads": int(tl.num_attention_heads), "kv_heads": int(tl.num_key_value_heads),
              "head_dim": int(getattr(tl, "head_dim", None) or tl.hidden_size // tl.num_attention_heads),
              "layer_types": list(getattr(tl, "layer_types", None) or []),
              "sliding_window": getattr(tl, "sliding_window", None),
              "draft_vocab_size": int(model.draft_vocab_size),
              "parameters": sum(p.numel() for p in model.parameters()),
              "trained_positions": draft_kinds.trained_positions(kind, config)}
    if draft_kinds.kind(kind).block_draft:
        record["block_size"] = int(model.config.block_size)
        record["sample_from_anchor"] = bool(model.config.sample_from_anchor)
    return record


# ----------------------------------------------------------------------------------------------------------------
# The context the draft attends


class ContextKV:
    """The draft's KV cache in serving, duck-typed for transformers' attention (`update`): per draft layer the
    context's keys and values (random, already rotated; `lengths[i]` positions) in a buffer with room for a step's
    new positions. `update` writes the new K/V after the context in place and returns views of everything so far
    (no copy of the context, as a paged cache's slots); `reset` forgets what the last step appended."""

    def __init__(self, lengths: list[int], *, batch: int, kv_heads: int, head_dim: int, room: int, dtype, device):
        import torch

        self.base = list(lengths)
        self.lengths = list(lengths)
        shape = [(batch, kv_heads, n + room, head_dim) for n in lengths]
        self.keys = [torch.randn(s, dtype=dtype, device=device) for s in shape]
        self.values = [torch.randn(s, dtype=dtype, device=device) for s in shape]

    def update(self, key, value, layer_idx: int, cache_kwargs=None):
        start, n = self.lengths[layer_idx], key.shape[2]
        if start + n > self.keys[layer_idx].shape[2]:
            raise ValueError(f"ContextKV layer {layer_idx}: {start + n} positions, room for {self.keys[layer_idx].shape[2]}")
        self.keys[layer_idx][:, :, start:start + n].copy_(key)
        self.values[layer_idx][:, :, start:start + n].copy_(value)
        self.lengths[layer_idx] = start + n
        return self.keys[layer_idx][:, :, :start + n], self.values[layer_idx][:, :, :start + n]

    def reset(self) -> None:
        self.lengths = list(self.base)


def attended_context(model, context: int) -> list[int]:
    """Keys of the context each draft layer attends: a sliding layer its window's last positions, a full one all."""
    tl = model.config.transformer_layer_config
    types = list(getattr(tl, "layer_types", None) or [])
    window = getattr(tl, "sliding_window", None)
    return [min(context, window) if window and i < len(types) and types[i] == "sliding_attention" else context
            for i in range(int(tl.num_hidden_layers))]


# ----------------------------------------------------------------------------------------------------------------
# One speculative step per kind


def _eagle_fuse(model, aux):
    """EAGLE-3 / P-EAGLE: the target's aux states -> the draft's hidden width (its input norms, then fc)."""
    import torch

    if model.input_norm is not None:
        aux = model.input_norm(aux)
    if model.fc_norm is not None:
        chunks = aux.chunk(len(model.fc_norm), dim=-1)
        aux = torch.cat([norm(chunk) for norm, chunk in zip(model.fc_norm, chunks)], dim=-1)
    return model.fc(aux)


def _to_target(model, ids):
    """Draft-vocabulary ids -> target ids (d2t), as the serving draft returns them."""
    d2t = getattr(model, "d2t", None)
    return ids if d2t is None else ids + d2t[ids]


def make_step(kind: str, model, *, batch: int, k: int, context: int, new_tokens: int, device: str,
              inputs=None, context_kv: ContextKV | None = None):
    """A callable running one speculative step of `model` for `batch` sequences (the cache reset first, so every
    call does the same work), and what it runs: {"forwards", "queries_per_forward", "k", "cache": ContextKV}.
    `inputs`: (aux states [batch, new_tokens, aux * hidden], token ids [batch, new_tokens]) of the new tokens, and
    for a block draft its anchor [batch, 1] (the verify step's bonus token, whose target states are not known yet), else
    random; `context_kv`: a ContextKV holding the context (with room for the step), else one of random K/V."""
    import torch

    tl = model.config.transformer_layer_config
    hidden = int(tl.hidden_size)
    head_dim = int(getattr(tl, "head_dim", None) or hidden // tl.num_attention_heads)
    vocab = int(model.verifier_vocab_size)
    dtype = model.fc.weight.dtype  # bf16 as built; a test may run the draft in float32
    gen = torch.Generator(device=device).manual_seed(0)
    num_aux = len(model.target_layer_ids)
    if inputs is None:
        aux = torch.randn(batch, new_tokens, num_aux * hidden, generator=gen, device=device, dtype=dtype)
        ids = torch.randint(0, vocab, (batch, new_tokens), generator=gen, device=device)
        anchor = torch.randint(0, vocab, (batch, 1), generator=gen, device=device)
    else:
        aux, ids, *rest = inputs
        anchor = rest[0] if rest else ids[:, -1:]
    first = context - new_tokens  # the new tokens' positions: context - new_tokens .. context - 1
    layers = list(model.layers)
    info: dict = {"k": k}

    def cache_for(room: int) -> ContextKV:
        if context_kv is not None:
            return context_kv
        return ContextKV(attended_context(model, first), batch=batch, kv_heads=int(tl.num_key_value_heads),
                         head_dim=head_dim, room=room, dtype=dtype, device=device)

    if kind == "eagle3":
        cache = cache_for(new_tokens + k)
        pos0 = torch.arange(first, context, device=device).unsqueeze(0)

        def step():
            cache.reset()
            h, tokens, pos, out = _eagle_fuse(model, aux), ids, pos0, []
            for _ in range(k):
                x = torch.cat([model.embed_tokens(tokens), h], dim=-1)
                pe = model.rotary_emb(x, pos)
                for layer in layers:
                    x = layer(x, attention_mask=None, position_ids=pos, past_key_values=cache, position_embeddings=pe,
                              is_causal=False)
                last = x[:, -1:]
                if model.config.norm_output:
                    h = model.norm(last)
                    logits = model.lm_head(h)
                else:
                    h, logits = last, model.lm_head(model.norm(last))
                tokens = _to_target(model, logits.argmax(-1))
                out.append(tokens)
                pos = pos[:, -1:] + 1
            return torch.cat(out, dim=1)

        info.update(forwards=k, queries_per_forward=[new_tokens] + [1] * (k - 1))
    elif kind == "peagle":
        cache = cache_for(new_tokens + k)
        pos = torch.arange(first, context + k - 1, device=device).unsqueeze(0)
        mask_ids = torch.full((batch, k - 1), int(model.mask_token_id), device=device)
        mask_hidden = model.mask_hidden.expand(batch, k - 1, -1)

        def step():
            cache.reset()
            h = torch.cat([_eagle_fuse(model, aux), _eagle_fuse(model, mask_hidden)], dim=1)
            x = torch.cat([model.embed_tokens(torch.cat([ids, mask_ids], dim=1)), h], dim=-1)
            pe = model.rotary_emb(x, pos)
            for layer in layers:
                x = layer(x, attention_mask=None, position_ids=pos, past_key_values=cache, position_embeddings=pe,
                          is_causal=False)
            sel = x[:, new_tokens - 1:]  # the k positions that predict: the last real one and the k - 1 masks
            return _to_target(model, model.lm_head(model.norm(sel)).argmax(-1))

        info.update(forwards=1, queries_per_forward=[new_tokens + k - 1])
    else:  # a block draft (the DFlash family)
        block = int(model.config.block_size)
        cache = cache_for(new_tokens + block)
        pos = torch.arange(first, context + block, device=device).unsqueeze(0)
        block_ids = torch.full((batch, block), int(model.mask_token_id), device=device)
        block_ids[:, :1] = anchor  # the bonus token; the block's first position
        from_anchor = bool(model.config.sample_from_anchor)
        markov = getattr(model, "markov_head", None)
        confidence = getattr(model, "confidence_head", None)
        with_markov = bool(getattr(model.config, "confidence_head_with_markov", False))

        def step():
            cache.reset()
            target_hidden = model.hidden_norm(model.fc(aux))
            x = model.embed_tokens(block_ids)
            pe = model.rotary_emb(x, pos)
            for layer in layers:
                x = layer(target_hidden=target_hidden, hidden_states=x, attention_mask=None, position_ids=pos,
                          past_key_value=cache, position_embeddings=pe)
            sel = model.norm(x) if from_anchor else model.norm(x[:, 1:])
            logits = model.lm_head(sel)
            if markov is None:
                return _to_target(model, logits.argmax(-1))
            prev, out, embs = block_ids[:, :1], [], []
            for p in range(sel.shape[1]):  # each position's bias from the token drafted before it
                emb = markov.prev_embeddings(prev)
                bias = markov.block_bias(prev_token_ids=prev, hidden_states=sel[:, p:p + 1], prev_emb=emb)
                prev = _to_target(model, (logits[:, p:p + 1] + bias).argmax(-1))
                out.append(prev)
                embs.append(emb)
            if confidence is not None:
                features = torch.cat([sel, torch.cat(embs, dim=1).to(sel.dtype)], dim=-1) if with_markov else sel
                confidence(features)
            return torch.cat(out, dim=1)

        info.update(forwards=1, queries_per_forward=[block], block_size=block, new_context_keys=new_tokens)
    info["cache"] = cache
    return step, info


# ----------------------------------------------------------------------------------------------------------------
# Timing


def time_step(step, *, device: str, warmup: int, repeats: int, graph: bool) -> dict:
    """Milliseconds per call of `step`: eager, and (on CUDA with `graph`) as one captured CUDA graph; median, min,
    max and every repeat. CUDA: events around each call; CPU: perf_counter."""
    import torch

    def measure(call) -> list[float]:
        for _ in range(warmup):
            call()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1000)
        return times

    def summary(times: list[float]) -> dict:
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                "repeats_ms": [round(t, 4) for t in times]}

    with torch.inference_mode():
        out = {"eager": summary(measure(step))}
        if device == "cuda" and graph:
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    step()
                out["graph"] = summary(measure(cuda_graph.replay))
            except Exception as exc:  # noqa: BLE001 - recorded: the eager figure stands
                out["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        if device == "cuda":
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["forward_ms"] = out.get("graph", out["eager"])["median_ms"]
    out["forward_ms_from"] = "graph" if "graph" in out else "eager"
    return out


def kind_ks(kind: str, model, ks: list[int]) -> list[int]:
    """The k's a kind is timed at: eagle3 --ks; peagle --ks and its trained depths (the screen serves it there);
    a block draft its served k (draft_kinds: block - 1, or the block when it samples from the anchor)."""
    from eagle3_pipeline import draft_kinds

    trained = draft_kinds.trained_positions(kind, model.config.to_dict())
    if kind == "eagle3":
        return sorted(set(ks))
    if kind == "peagle":
        return sorted({*(k for k in ks if k <= trained), trained})
    return [trained]


def measure(args: argparse.Namespace) -> dict:
    import torch

    device = "cpu" if args.toy else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("draft_forward: no CUDA device (use --toy for the CPU check)")
    work = args.workdir
    verifier = work / ("verifier-toy" if args.toy else "verifier")
    if not (verifier / "model.safetensors").is_file():
        throughput.write_head_only_verifier(verifier, text_overrides=TOY_TEXT if args.toy else None, device=device)
    vocab = TOY_DRAFT_VOCAB if args.toy else args.draft_vocab
    mask = TOY_TEXT["pad_token_id"] if args.toy else MASK_TOKEN_ID
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    report = {
        "benchmark": "draft-forward",
        "label": ("CPU at a toy width (--toy): the code runs; the figures are meaningless for speed" if args.toy
                  else f"one {gpu} at Kimi-K2.5's width"),
        "toy": bool(args.toy), "device": device,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "commit": _git_commit(),
        "method": METHOD.format(vocab=vocab, mask=mask, warmup=args.warmup, repeats=args.repeats),
        "machine": {"platform": platform.platform(), "gpu": gpu, "cpus": _cpus(),
                    "load_average_start": _load()},
        "versions": _versions(),
        "settings": {"context": args.context, "batches": args.batches, "ks": args.ks, "new_tokens": args.new_tokens,
                     "warmup": args.warmup, "repeats": args.repeats, "cuda_graph": not args.no_graph,
                     "draft_vocab_size": vocab, "mask_token_id": mask, "verifier": "head-only Kimi-K2.5"
                     + (" (toy width)" if args.toy else "")},
        "kinds": {},
    }
    for kind in args.kinds:
        try:
            model, argv = build_draft(kind, verifier, draft_vocab_size=vocab, mask_token_id=mask, device=device,
                                      save_path=work / f"draft-forward-{kind}")
        except Exception as exc:  # noqa: BLE001 - a kind that cannot be built is recorded and the bench goes on
            report["kinds"][kind] = {"not_timed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            print(f"[{kind}] not timed: {report['kinds'][kind]['not_timed']}", flush=True)
            continue
        entry = {"draft": draft_record(kind, model), "speculators_argv": argv,
                 "attended_context": attended_context(model, args.context - args.new_tokens), "steps": []}
        for batch in args.batches:
            for k in kind_ks(kind, model, args.ks):
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                step, info = make_step(kind, model, batch=batch, k=k, context=args.context,
                                       new_tokens=args.new_tokens, device=device)
                timing = time_step(step, device=device, warmup=args.warmup, repeats=args.repeats,
                                   graph=not args.no_graph)
                info.pop("cache")
                entry["steps"].append({"batch": batch, **info, **timing})
                print(f"[{kind}] batch {batch} k {k}: {timing['forward_ms']:.3f} ms per step "
                      f"({timing['forward_ms_from']}; eager {timing['eager']['median_ms']:.3f})"
                      + (f"; graph failed: {timing['graph_error']}" if "graph_error" in timing else ""), flush=True)
                del step
        report["kinds"][kind] = entry
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    report["machine"]["load_average_end"] = _load()
    return report


# ----------------------------------------------------------------------------------------------------------------
# Records


def _git_commit() -> str | None:
    from train_throughput import _git_commit as commit

    return commit()


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "speculators", "vllm"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _cpus() -> int | None:
    import os

    return os.cpu_count()


def _load() -> list[float] | None:
    import os

    try:
        return list(os.getloadavg())
    except OSError:
        return None


def output_path(report: dict, results: Path) -> Path:
    from train_throughput import gpu_slug

    name = "cpu-toy" if report["toy"] else gpu_slug(report["machine"]["gpu"] or "gpu")
    return results / f"{name}-draft-forward.json"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["project"]:
        return projection.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), help=f"draft kinds to time (default {' '.join(KINDS)})")
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="eagle3's k (and peagle's up to its depths)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=4096, help="tokens of context before the step (default 4096)")
    parser.add_argument("--new-tokens", type=int, default=1,
                        help="tokens the last verify step added (their target states enter the step: eagle3's first "
                             "forward, peagle's forward, a block draft's new keys); default 1")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-graph", action="store_true", help="eager only (no CUDA-graph capture)")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB)
    parser.add_argument("--toy", action="store_true",
                        help="the CPU at a toy width (tests): context 64, 1 warm-up, 3 repeats unless set; figures "
                             "labelled CPU and meaningless for speed")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/eagle3-train-bench"),
                        help="where the head-only verifier is written (reused when present; train_throughput's too)")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.toy:
        given = set(argv)
        args.context = args.context if "--context" in given else 64
        args.warmup = args.warmup if "--warmup" in given else 1
        args.repeats = args.repeats if "--repeats" in given else 3
    if args.new_tokens < 1 or args.context <= args.new_tokens:
        raise SystemExit(f"--new-tokens {args.new_tokens} / --context {args.context}: need 1 <= new tokens < context")
    report = measure(args)
    args.results.mkdir(parents=True, exist_ok=True)
    out = output_path(report, args.results)
    out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
