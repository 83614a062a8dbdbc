"""Flex attention forward at the draft's training geometry, per Triton kernel config.

The draft's attention at Kimi-K2.5 geometry: 64 heads of 64, 32,768 packed tokens of
2,047-token documents, sliding window 2048, speculators' own document + causal + window mask
(step 0 of TTT), bf16 q/k/v (what the kernel gets in training: torch's flex_attention casts
to the autocast dtype itself). `bench/train_throughput.py --trace` showed the forward kernel
of PyTorch's default config on the H200 taking ~28 ms per TTT step at 255 registers per
thread (4 warps for a 128x128 tile); this times the candidate configs against it, in one
process. The winner on a GPU kind becomes its row in
`eagle3_pipeline/compat/flex_forward_config.py`'s FORWARD_CONFIGS.

    python bench/flex_attention_configs.py
    python bench/flex_attention_configs.py --configs "fwd 64x128 4w 3s"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> flex_attention kernel_options (the `fwd_` keys change the forward kernel only)
CANDIDATES: dict[str, dict[str, int]] = {
    "fwd 128x64 4w 3s": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 128x64 8w 3s": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "fwd 128x128 8w 2s": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128x128 8w 3s": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "fwd 64x64 4w 3s": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 64x128 4w 3s": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "128x64 4w 3s (unprefixed)": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--doc-len", type=int, default=2047)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--configs", nargs="*", help="subset of the candidates (default: all)")
    parser.add_argument("--results", type=Path,
                        help="output JSON (default: bench/results/<gpu>-flex-attention-configs.json)")
    args = parser.parse_args()

    import torch
    from speculators.models.eagle3.attention import create_combined_mask_mod
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from triton.testing import do_bench

    tokens = args.tokens
    doc_ids = torch.full((tokens,), -1, dtype=torch.long)
    for doc, start in enumerate(range(0, tokens - args.doc_len + 1, args.doc_len)):
        doc_ids[start:start + args.doc_len] = doc
    doc_ids = doc_ids.cuda()
    mask = create_block_mask(create_combined_mask_mod(doc_ids, tokens, args.window), None, None,
                             tokens, tokens, device="cuda")
    blocks = int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum())
    block_flops = blocks * 128 * 128 * args.heads * args.head_dim * 4  # QK^T + PV over visited blocks
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, tokens, args.head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen) for _ in range(3))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens,
              "visited_blocks": blocks, "block_tflop": block_flops / 1e12, "configs": {}}
    reference = None
    candidates = {"torch default": None, **{n: o for n, o in CANDIDATES.items() if not args.configs or n in args.configs}}
    for name, options in candidates.items():
        def attend(q, k, v, options=options):
            return flex_attention(q, k, v, block_mask=mask, kernel_options=options)

        try:
            compiled = torch.compile(attend, dynamic=False)
            out = compiled(q, k, v)
            ms = do_bench(lambda: compiled(q, k, v), warmup=25, rep=200, return_mode="median")
        except Exception as error:  # noqa: BLE001 - a config this torch rejects is a result too
            report["configs"][name] = {"options": options, "error": str(error).splitlines()[0][:300]}
            print(f"{name:<28} failed: {report['configs'][name]['error']}", flush=True)
            continue
        reference = out if reference is None else reference
        diff = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        report["configs"][name] = {"options": options, "forward_ms": ms,
                                   "block_tflops": block_flops / ms / 1e9, "rel_diff_vs_default": diff}
        print(f"{name:<28} forward {ms:7.2f} ms  {block_flops / ms / 1e9:6.0f} TFLOP/s (visited blocks)  "
              f"rel diff {diff:.1e}", flush=True)
        torch._dynamo.reset()
    if args.results is None:
        from train_throughput import gpu_slug  # the bench beside this one names results the same way

        args.results = REPO / "bench" / "results" / f"{gpu_slug(torch.cuda.get_device_name())}-flex-attention-configs.json"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
