"""Training throughput at the target's real geometry: FLOP count, fixtures, measurement.

Everything `bench/train_throughput.py` needs to say "this many tokens/s is this much of the
GPU"; nothing here changes training (the levers under test are stage 04's own: its flags and
`eagle3_pipeline.compat.device_prefetch`).

- `train_flops_per_token`: the explicit per-token FLOP count of one EAGLE-3 draft
  training step (forward + backward over all TTT steps), each term written out.
- `muon_step_flops`: Muon's Newton-Schulz cost per optimizer step (independent of tokens).
- `write_head_only_verifier`: Kimi-K2.5's real config with only the three head tensors
  speculators loads (embed_tokens, lm_head, final norm), random bf16: a verifier
  speculators can train against without the 595 GB checkpoint.
- `write_synthetic_prepared_dataset` (+ `write_synthetic_stage_manifests` for 04_train): a
  prepared dataset in speculators' on-disk layout with random hidden states, for speed only
  (random data says nothing about learning).
- `measure_bf16_matmul_peak` (and `eagle3_pipeline.disk_reads.measure_cold_read_bandwidth`):
  the two ceilings.
- `run_speculators_train` + `summarize_train_metrics`: plain speculators with per-step timing
  out of its own trainer (its `_StepTimer` profile) as JSON lines, and the summary the bench prints.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.disk_reads import evict_from_page_cache, page_cache_resident_fraction
from eagle3_pipeline.hidden_states import HS_DIRNAME, NUM_SLOTS, StateFormat, hs_file
from eagle3_pipeline.miniature import KIMI_K25_ROUTING_AND_MLA_HEADS

# --------------------------------------------------------------------------------------
# Kimi-K2.5's config (the real dims; ../shared/KNOWLEDGE.md). Only what the draft reads
# matters for training speed: hidden 7168, vocab 163840, 61 layers, heads, intermediate.
# The rest is kept so that the config is the real model's, not a lookalike.
# --------------------------------------------------------------------------------------

KIMI_K25_TEXT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    **KIMI_K25_ROUTING_AND_MLA_HEADS,
    "q_lora_rank": 1536,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


def toy_kimi_text_overrides(num_layers: int) -> dict[str, Any]:
    """`text_overrides` for write_head_only_verifier: a Kimi-shaped config small enough for the CPU (tests, --toy
    runs); its figures say nothing about speed."""
    return {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": num_layers,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "bos_token_id": 250, "eos_token_id": 251,
            "pad_token_id": 255}

# The three frozen verifier tensors the EAGLE-3 draft reads, under the wrapper's prefix.
HEAD_ONLY_TENSORS = (
    "language_model.model.embed_tokens.weight",
    "language_model.lm_head.weight",
    "language_model.model.norm.weight",
)

# Hidden-state slots on disk: 3 aux layers + the final layer (pre-norm).
HIDDEN_STATE_SLOTS = NUM_SLOTS


def kimi_k25_config(text_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Top-level `config.json` of Kimi-K2.5: the `kimi_k25` wrapper around the text config.

    `text_overrides` shrinks the text model for CPU tests; the default is the real model.
    No `auto_map`: the head-only directory ships no remote code, and transformers 5.19
    has a native `kimi_k25` config, which is what speculators reads.
    """
    text = {**KIMI_K25_TEXT_CONFIG, **(text_overrides or {})}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
    }


def write_head_only_verifier(
    out_dir: str | Path,
    *,
    text_overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    device: str = "cpu",
    init_std: float = 0.02,
) -> dict[str, list[int]]:
    """Write config.json + model.safetensors (+ index) with only the three head tensors.

    Random bf16 (generated on `device`: at Kimi size that is 2 x 2.35 GB, seconds on a
    GPU, a minute on a small CPU). The final norm is ones plus small noise, like a
    trained RMSNorm. Returns {tensor name: shape}.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = kimi_k25_config(text_overrides)
    text = config["text_config"]
    vocab, hidden = int(text["vocab_size"]), int(text["hidden_size"])
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, std: float = init_std) -> torch.Tensor:
        values = torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)
        return (values * std + mean).to(torch.bfloat16).cpu()

    tensors = {
        "language_model.model.embed_tokens.weight": normal(vocab, hidden),
        "language_model.lm_head.weight": normal(vocab, hidden),
        "language_model.model.norm.weight": normal(hidden, mean=1.0, std=0.05),
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": dict.fromkeys(tensors, "model.safetensors"),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {name: list(t.shape) for name, t in tensors.items()}


def write_synthetic_prepared_dataset(
    out_dir: str | Path,
    *,
    num_rows: int,
    seq_len: int,
    hidden_size: int,
    vocab_size: int,
    distinct_files: int | None = None,
    prompt_fraction: float = 0.1,
    seed: int = 0,
    device: str = "cpu",
    storage: str = "dtype",
) -> dict[str, Any]:
    """A prepared dataset in speculators' layout, with random hidden states.

    `storage="fp8"` writes stage 02's fp8 files instead (the product's `quantize_fp8`: float8_e4m3fn
    values + one float32 scale per token, half the bytes), which speculators reads with
    `--hidden-states-backend fp8`.

    `out_dir` gets the `datasets.save_to_disk` table (input_ids, loss_mask int64, seq_len;
    torch format, as speculators' prepare-data saves it), stage 02's row files in `hidden_states/`
    ({"hidden_states": [T, 4, H] bf16, "token_ids": [T] int64}) and `token_freq.pt`
    (counted by speculators' own function). With `distinct_files=K`, row i's file is a
    hard link to file i % K (and row i has that file's tokens): a long benchmark run needs
    many rows, not many gigabytes. The first `prompt_fraction` of each row is masked out
    of the loss, like a prompt.
    """
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    from eagle3_pipeline.extract.common import quantize_fp8

    if storage not in ("dtype", "fp8"):
        raise ValueError(f"storage {storage!r}: 'dtype' (bf16) or 'fp8'")
    out = Path(out_dir)
    hs_dir = out / HS_DIRNAME
    hs_dir.mkdir(parents=True, exist_ok=True)
    distinct = min(distinct_files or num_rows, num_rows)
    generator = torch.Generator(device=device).manual_seed(seed)
    token_rows: list[torch.Tensor] = []
    for i in range(distinct):
        tokens = torch.randint(0, vocab_size, (seq_len,), generator=generator, device=device)
        hidden = torch.randn(
            seq_len, HIDDEN_STATE_SLOTS, hidden_size, generator=generator, device=device,
            dtype=torch.float32,
        ).to(torch.bfloat16)
        tokens = tokens.to(torch.int64).cpu()
        states = quantize_fp8(hidden) if storage == "fp8" else {"hidden_states": hidden}
        save_file({**{k: v.cpu().contiguous() for k, v in states.items()}, "token_ids": tokens},
                  str(hs_file(hs_dir, i)))
        token_rows.append(tokens)
    for i in range(distinct, num_rows):
        target = hs_file(hs_dir, i)
        target.unlink(missing_ok=True)
        source = hs_file(hs_dir, i % distinct)
        try:
            os.link(source, target)
        except OSError:  # a filesystem without hard links: copy instead
            target.write_bytes(source.read_bytes())

    prompt = int(seq_len * prompt_fraction)
    loss_mask = [0] * prompt + [1] * (seq_len - prompt)
    table = Dataset.from_dict({
        "input_ids": [token_rows[i % distinct].tolist() for i in range(num_rows)],
        "loss_mask": [loss_mask] * num_rows,
        "seq_len": [seq_len] * num_rows,
    })
    table.set_format(type="torch")
    table.save_to_disk(str(out))
    freq_path = out / "token_freq.pt"
    freq_path.unlink(missing_ok=True)
    save_token_frequency_distribution(table, output_path=freq_path)
    file_bytes = hs_file(hs_dir, 0).stat().st_size
    return {
        "rows": num_rows,
        "distinct_files": distinct,
        "seq_len": seq_len,
        "storage": storage,
        "hidden_state_file_bytes": file_bytes,
        "hidden_state_bytes_per_token": StateFormat(storage).bytes_per_token(hidden_size, HIDDEN_STATE_SLOTS),
    }


# --------------------------------------------------------------------------------------
# FLOP count
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftGeometry:
    """The shapes that decide an EAGLE-3 draft's training cost."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    ttt_steps: int = 3
    num_layers: int = 1
    num_aux_layers: int = 3

    @classmethod
    def from_layer_config(
        cls, layer_config: Any, *, draft_vocab_size: int, ttt_steps: int = 3,
        num_aux_layers: int = 3,
    ) -> DraftGeometry:
        """From the draft's `transformer_layer_config` (what speculators builds)."""
        hidden = int(layer_config.hidden_size)
        heads = int(layer_config.num_attention_heads)
        head_dim = getattr(layer_config, "head_dim", None) or hidden // heads
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(getattr(layer_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(layer_config.intermediate_size),
            draft_vocab_size=int(draft_vocab_size),
            ttt_steps=int(ttt_steps),
            num_layers=int(layer_config.num_hidden_layers),
            num_aux_layers=int(num_aux_layers),
        )

    def muon_matrix_shapes(self) -> list[tuple[int, int]]:
        """Shapes of the weights speculators hands to Muon (2-D, not embed/lm_head)."""
        h, q = self.hidden_size, self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        shapes = [(h, self.num_aux_layers * h)]  # fc
        for layer in range(self.num_layers):
            d_in = 2 * h if layer == 0 else h
            shapes += [(q, d_in), (kv, d_in), (kv, d_in), (h, q)]  # q, k, v, o
            shapes += [(self.intermediate_size, h)] * 2 + [(h, self.intermediate_size)]
        return shapes


@dataclass
class FlopCount:
    """FLOPs per trained token, by term (a multiply-add counts 2)."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)

    @property
    def forward_total(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_total(self) -> float:
        return sum(self.backward.values())

    @property
    def total(self) -> float:
        return self.forward_total + self.backward_total

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "forward_total": self.forward_total,
                "backward_total": self.backward_total, "total": self.total}


def mean_attended_keys(doc_lengths: Iterable[int], sliding_window: int | None) -> float:
    """Mean number of keys a query attends to at TTT step 0 (causal, within its document,
    at most `sliding_window`): query p of a document sees min(p + 1, window) keys."""
    keys = tokens = 0
    for length in doc_lengths:
        window = sliding_window or length
        full = min(length, window)
        keys += full * (full + 1) // 2 + (length - full) * window
        tokens += length
    if tokens == 0:
        raise ValueError("mean_attended_keys needs at least one token")
    return keys / tokens


def train_flops_per_token(geometry: DraftGeometry, mean_keys: float) -> FlopCount:
    """Per-token FLOPs of one EAGLE-3 training step: forward and backward, all TTT steps.

    Matmuls only (norms, rotary, softmax, the loss and argmax are elementwise: bytes, not
    FLOPs). `mean_keys` is `mean_attended_keys` of the packed documents at TTT step 0;
    at TTT step s each query also attends to its own position in the s earlier steps'
    keys (the diagonal the TTT mask adds), so s more keys.

    Forward, per token:
      fc             2 * A*H * H                  once (aux layers -> H)
      target_logits  2 * H * Vd                   once, no grad (verifier lm_head cut to
                                                  the draft vocab over the last hidden state)
      per TTT step s and decoder layer l (input width Din = 2H for the first layer,
      which sees [embed, hidden], else H):
        qkv          2 * Din * (nh + 2*nkv) * hd
        attention    4 * nh * hd * (mean_keys + s)    (QK^T and PV)
        o_proj       2 * nh*hd * H
        mlp          2 * 3 * H * I                    (gate, up, down)
      per TTT step:
        lm_head      2 * H * Vd                   (draft lm_head, draft vocab)
    Backward: 2x forward for the decoder layer (input and weight gradients); 1x for fc
    (weight gradient only: the aux hidden states are data); 1x for lm_head (input
    gradient only: speculators freezes the draft lm_head); 0 for target_logits.
    """
    g = geometry
    h, q_width = g.hidden_size, g.num_heads * g.head_dim
    kv_width = g.num_kv_heads * g.head_dim
    fwd = {"fc": 2.0 * g.num_aux_layers * h * h, "target_logits": 2.0 * h * g.draft_vocab_size,
           "qkv": 0.0, "attention": 0.0, "o_proj": 0.0, "mlp": 0.0, "lm_head": 0.0}
    for step in range(g.ttt_steps):
        for layer in range(g.num_layers):
            d_in = 2 * h if layer == 0 else h
            fwd["qkv"] += 2.0 * d_in * (q_width + 2 * kv_width)
            fwd["attention"] += 4.0 * q_width * (mean_keys + step)
            fwd["o_proj"] += 2.0 * q_width * h
            fwd["mlp"] += 2.0 * 3 * h * g.intermediate_size
        fwd["lm_head"] += 2.0 * h * g.draft_vocab_size
    bwd = {
        "fc": fwd["fc"],
        "target_logits": 0.0,
        "qkv": 2 * fwd["qkv"],
        "attention": 2 * fwd["attention"],
        "o_proj": 2 * fwd["o_proj"],
        "mlp": 2 * fwd["mlp"],
        "lm_head": fwd["lm_head"],
    }
    return FlopCount(forward=fwd, backward=bwd)


def muon_step_flops(shapes: Sequence[tuple[int, int]], ns_steps: int = 5) -> float:
    """FLOPs of Muon's Newton-Schulz orthogonalisation per optimizer step.

    torch.optim.Muon, per m x n matrix (m <= n after transposing): each iteration does
    A = X X^T (2 m^2 n), B = bA + cA@A (2 m^3), X = aX + B@X (2 m^2 n). It does not
    depend on the tokens in the step, which is why it dominates small steps.
    """
    total = 0.0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += ns_steps * (4.0 * m * m * n + 2.0 * m**3)
    return total


def kimi_draft_geometry(
    verifier_dir: str | Path, *, draft_vocab_size: int = 32000, ttt_steps: int = 3,
    sliding_window: int = 2048,
) -> DraftGeometry:
    """The draft speculators builds for this verifier with its default shaping flags."""
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(verifier_dir), num_layers=1, draft_arch="llama",
        hidden_act="silu", sliding_window=sliding_window, full_attention_indices=[],
    )
    return DraftGeometry.from_layer_config(
        layer_config, draft_vocab_size=draft_vocab_size, ttt_steps=ttt_steps,
    )


# --------------------------------------------------------------------------------------
# Ceilings: bf16 matmul peak (the disk's: eagle3_pipeline.disk_reads.measure_cold_read_bandwidth)
# --------------------------------------------------------------------------------------

# Square and draft-shaped products (32K tokens x the draft's q/k/v and MLP widths).
PEAK_SHAPES = ((8192, 8192, 8192), (16384, 16384, 16384), (32768, 14336, 12288),
               (32768, 7168, 18432))


def measure_bf16_matmul_peak(
    device: str = "cuda", shapes: Sequence[tuple[int, int, int]] = PEAK_SHAPES,
    warmup: int = 5, reps: int = 30,
) -> dict[str, Any]:
    """Median TFLOP/s of bf16 `A @ B` on random data, per shape; `peak` is the best.

    Random normal inputs (zeros run faster on this GPU); two input sets rotated so no
    shape runs from a warm L2; CUDA events around each product.
    """
    import torch

    results = []
    for m, k, n in shapes:
        sets = [(torch.randn(m, k, device=device, dtype=torch.bfloat16),
                 torch.randn(k, n, device=device, dtype=torch.bfloat16)) for _ in range(2)]
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        for i in range(warmup):
            torch.matmul(*sets[i % 2], out=out)
        times = []
        for i in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(*sets[i % 2], out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        seconds = statistics.median(times)
        results.append({"shape": [m, k, n], "seconds": seconds,
                        "tflops": 2.0 * m * k * n / seconds / 1e12})
        del sets, out
        torch.cuda.empty_cache()
    return {"peak_tflops": max(r["tflops"] for r in results), "shapes": results,
            "device_name": torch.cuda.get_device_name(device)}


def read_into_page_cache(paths: Iterable[str | Path]) -> dict[str, float]:
    """Read every file once through the page cache (so a following run reads them from RAM)."""
    start, total = time.perf_counter(), 0
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while chunk := handle.read(64 << 20):
                total += len(chunk)
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / max(seconds, 1e-9) / 1e9}


class PageCacheEvictor:
    """While open, a thread keeps `paths` out of the page cache: every `interval_s` it samples how much
    of them is resident, then evicts them. A training run inside it reads every file from the disk, as
    it does when the hidden states are many times the RAM (the Kimi-K2.5 run's 11.7 TB), even where a
    benchmark's files would fit in RAM. The resident samples say how cold the reads really were."""

    def __init__(self, paths: Sequence[str | Path], interval_s: float = 0.25):
        self.paths, self.interval_s = list(paths), interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(page_cache_resident_fraction(self.paths))
            evict_from_page_cache(self.paths)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PageCacheEvictor:
        evict_from_page_cache(self.paths)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict[str, float]:
        """Evictions done and the resident fraction of the files found before each (mean, max)."""
        return {"evictions": len(self.samples), "interval_s": self.interval_s,
                "resident_fraction_mean": statistics.fmean(self.samples) if self.samples else 0.0,
                "resident_fraction_max": max(self.samples, default=0.0)}


def required_read_bandwidth(tokens_per_s: float, bytes_per_token: int) -> float:
    """GB/s of hidden states one GPU must read to train at `tokens_per_s`."""
    return tokens_per_s * bytes_per_token / 1e9


# --------------------------------------------------------------------------------------
# Step timing out of speculators' trainer
# --------------------------------------------------------------------------------------


def summarize_train_metrics(
    records: Sequence[Mapping[str, Any]], *, warmup_steps: int,
) -> dict[str, Any]:
    """tokens/s and the step split from per-step records, skipping `warmup_steps`.

    tokens/s is wall clock: tokens trained between the first and the last record after
    warm-up over the time between them (each record is stamped after a device sync), so
    it counts every step in the window, logged or not. The split (fetch/fwd/bwd/opt) is
    the median over the logged steps in the window; those steps synchronise at each
    phase, so their split is exact while the window's wall clock is not inflated by it.
    """
    steps = sorted((r for r in records if r.get("profile") and r["global_step"] >= warmup_steps),
                   key=lambda r: r["global_step"])
    if len(steps) < 2:
        raise ValueError(f"need at least 2 logged steps after warm-up, got {len(steps)}")
    first, last = steps[0], steps[-1]
    # Every step of a run packs the same token count here (synthetic rows of equal
    # length), so the tokens between two records = steps between them x tokens per step.
    tokens_per_step = statistics.median(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"]
                                        / 1000 for r in steps)
    trained_steps = last["global_step"] - first["global_step"]
    seconds = last["time"] - first["time"]
    split = {key: statistics.median(r["profile"][key] for r in steps)
             for key in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms", "h2d_ms")
             if all(key in r["profile"] for r in steps)}
    return {
        "tokens_per_s": tokens_per_step * trained_steps / seconds,
        "tokens_per_step": tokens_per_step,
        "measured_steps": trained_steps,
        "window_seconds": seconds,
        "step_split_ms": split,
        "max_memory_allocated_gib": max(r.get("max_memory_allocated", 0) for r in steps) / 2**30,
        "max_memory_reserved_gib": max(r.get("max_memory_reserved", 0) for r in steps) / 2**30,
        "last_train_loss": steps[-1].get("train", {}).get("loss"),
    }


def summarize_by_epoch(records: Sequence[Mapping[str, Any]], *, warmup_steps: int) -> dict[int, dict[str, Any]]:
    """`summarize_train_metrics` per epoch (the first skips `warmup_steps`): each epoch's window runs
    from its first logged step to its last, so the validation and checkpoint between epochs are not in
    it. With files dropped from the page cache before the run, epoch 0 reads them cold and epoch 1 from
    the page cache (when they fit in RAM): one process, one compile, the same steps."""
    by_epoch: dict[int, list] = {}
    for record in records:
        if record.get("profile") and "epoch" in record:
            by_epoch.setdefault(int(record["epoch"]), []).append(record)
    return {epoch: summarize_train_metrics(rows, warmup_steps=warmup_steps if epoch == min(by_epoch) else 0)
            for epoch, rows in sorted(by_epoch.items())}


def run_speculators_train(
    argv: Sequence[str], metrics_path: str | Path, *, stop_after_step: int | None = None,
    device_prefetch: bool = False,
) -> None:
    """Run speculators' own `train` entry point in this process, logging step metrics.

    This is `speculators train ARGV` plus three things around it, none of which changes a
    training step: the gated fused-loss fix (without it torch 2.11 cannot compile the
    default loss at all), a JSON-lines sink for the trainer's metric dicts (one file per
    rank), and, with `stop_after_step`, a hard exit once that step is logged (a benchmark
    needs neither the 6 GB checkpoint nor the validation pass that follow). `device_prefetch`
    installs stage 04's `compat.device_prefetch` (the lever under test).
    """
    import speculators.train.cli as train_cli
    from speculators.train.config import TrainConfig

    from eagle3_pipeline.compat import device_prefetch as prefetch
    from eagle3_pipeline.compat import metrics_jsonl
    from eagle3_pipeline.compat.fused_loss import apply_fused_loss_fix
    from eagle3_pipeline.metrics import MetricsJsonlHandler

    decision = apply_fused_loss_fix()
    logging.getLogger("eagle3.throughput").warning("fused-loss fix: %s", decision)
    handler = MetricsJsonlHandler(metrics_path)
    if stop_after_step is not None:
        emit = handler.emit

        def emit_then_maybe_stop(record: logging.LogRecord) -> None:
            emit(record)
            message = record.msg
            if isinstance(message, Mapping) and message.get("global_step", -1) >= stop_after_step:
                os._exit(0)

        handler.emit = emit_then_maybe_stop  # type: ignore[method-assign]

    metrics_jsonl.install(handler)
    if device_prefetch:
        prefetch.apply()
    train_cli.main(TrainConfig.resolve(list(argv)))


def write_synthetic_stage_manifests(
    verifier_dir: str | Path, data_dir: str | Path, vocab_dir: str | Path, *,
    aux_layer_ids: Sequence[int], draft_vocab_size: int, train_data_ratio: float = 0.9,
    storage: str = "dtype",
) -> None:
    """Stage 01/02/03 manifests (and 03's d2t/t2d) for a synthetic prepared dataset.

    `04_train.py` trains only on data whose upstream manifests say which target, which
    layers, which vocab mapping: this writes them for `write_synthetic_prepared_dataset`'s
    output, marked `"synthetic": true`, so the benchmark can run 04_train on the same data
    as plain speculators. The mapping is speculators' own, from the data's token_freq.pt;
    the counts are the table's, as stage 01 records them.
    """
    from datasets import load_from_disk

    from eagle3_pipeline.contract import input_record, read_manifest, write_manifest
    from eagle3_pipeline.manifest import ExtractManifest, PrepareCounts, PrepareManifest
    from eagle3_pipeline.target import load_target_info

    target = load_target_info(verifier_dir)
    data = Path(data_dir)
    summary = target.summary()
    layer_ids = [*aux_layer_ids, target.num_layers]
    table = load_from_disk(str(data))
    counts = {"rows": len(table), "tokens": int(sum(int(n) for n in table["seq_len"]))}
    write_manifest(data, PrepareManifest(synthetic=True, target=summary, counts=PrepareCounts(**counts),
                                         train_data_ratio=train_data_ratio))
    prepared = read_manifest(data, "prepare", "--data")
    write_manifest(data / "hidden_states", ExtractManifest(
        synthetic=True, target=summary, layer_ids=layer_ids, dtype="bfloat16", storage=storage,
        target_config_sha256=target.config_sha256, inputs={"prepare": input_record(prepared)}))
    write_synthetic_vocab(verifier_dir, data, vocab_dir, draft_vocab_size=draft_vocab_size)


def write_synthetic_vocab(verifier_dir: str | Path, data_dir: str | Path, vocab_dir: str | Path, *,
                          draft_vocab_size: int) -> None:
    """Stage 03's output (d2t/t2d + manifest) of `draft_vocab_size` for a synthetic dataset whose 01/02 manifests
    write_synthetic_stage_manifests wrote: one per draft vocabulary a run trains with (--draft-vocabs)."""
    import numpy as np

    from eagle3_pipeline.contract import input_record, read_manifest, write_manifest
    from eagle3_pipeline.manifest import VocabManifest
    from eagle3_pipeline.target import load_target_info
    from eagle3_pipeline.vocab import D2T_NAME, T2D_NAME, build_mapping, load_token_freq

    target = load_target_info(verifier_dir)
    data, vocab = Path(data_dir), Path(vocab_dir)
    prepared = read_manifest(data, "prepare", "--data")
    d2t, t2d = build_mapping(load_token_freq(data / "token_freq.pt"), draft_vocab_size, target.vocab_size)
    vocab.mkdir(parents=True, exist_ok=True)
    np.save(vocab / D2T_NAME, d2t)
    np.save(vocab / T2D_NAME, t2d)
    write_manifest(vocab, VocabManifest(synthetic=True, target=target.summary(), draft_vocab_size=draft_vocab_size,
                                        target_vocab_size=target.vocab_size, inputs={"prepare": input_record(prepared)}))
