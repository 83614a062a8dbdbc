"""Multi-GPU scaling of stage 04, predicted from bytes and bus rates before an 8-GPU box is at hand.

Per optimizer step each rank of speculators' DDP all-reduces the gradients of the draft's
trainable parameters. speculators keeps fp32 master weights under bf16 autocast, so the
gradients are fp32: 4 B x P, P = fc [3H -> H] + the decoder layer(s) (q/k/v over [embed, hidden] =
2H, o_proj, MLP, norms); the embeddings, both lm_heads and the verifier norm are frozen
(counted from speculators' own Eagle3DraftModel in tests/test_04_multirank.py). A ring
all-reduce sends and receives 2 (N-1)/N of those bytes per GPU. FSDP2 (`--fsdp`) moves at least
as much: bf16 all-gathers of every parameter in the forward and again in the backward, plus an
fp32 reduce-scatter, (N-1)/N x (2 x 2P + 4P) = the same 2 (N-1)/N x 4P, and its forward gathers
sit on the critical path.

Whether it hides behind the backward: no. The draft's decoder layer runs once per TTT step, so
autograd completes its gradients (80% of the bytes at Kimi geometry; the fc's, the rest, come
after) only when the backward reaches the first TTT step, i.e. at the very end: DDP's buckets
become ready together and the all-reduce runs after the backward whatever the bucket size. The
2-H200 measurement agrees: the logged step grew 966 -> 978 ms (bench/results/h200x2-ddp2-train.json
vs h200-ddp-baseline-train.json), about the whole all-reduce of 3.0 GB at ~56% of NVLink 4's
rate. So predicted step(N) = step(1) + all-reduce time, at the vendor's bus rate (an upper bound on
speed) and at the fraction of it the 2-H200 run achieved; step(1) is the one-H200 step measured at
32K tokens (bench/results/h200-train.json) scaled by the ratio of the GPUs' dense bf16 peaks.
The interconnect and peak of a profile are its `_hardware` block (sources in NOTES.md,
"Multi-GPU scaling"); a profile without one gets no prediction.

    python -m eagle3_pipeline.scaling --target /models/Kimi-K2.5 --output bench/results/scaling-prediction.json

writes the prediction for every profile with a `_hardware` block at 1/2/4/8 GPUs, each with a
`measured` slot (null until bench/train_throughput.py has run on such a box).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config.resolution import profile_path
from .config.schema import DEFAULT_DRAFT_CONFIG, PROFILES_DIR, TrainConfig, load_draft_config
from .errors import StageError
from .files import atomic_write_text
from .target import load_target_info

# Bus rate per GPU and direction (GB/s), from the vendors' specifications (NOTES.md, "Multi-GPU scaling").
INTERCONNECTS = {
    "pcie5-x16": {"name": "PCIe Gen5 x16, no NVLink", "gb_s": 64.0,
                  "spec": "PCIe 5.0 x16: 32 GT/s x 16 lanes = 64 GB/s each way (128 GB/s bidirectional, "
                          "RTX PRO 6000 Blackwell datasheet)"},
    "nvlink4": {"name": "NVLink 4", "gb_s": 450.0, "spec": "H200: NVLink 900 GB/s per GPU, bidirectional"},
    "nvlink5": {"name": "NVLink 5", "gb_s": 900.0, "spec": "HGX B300: NVLink 5, 1.8 TB/s per GPU, bidirectional"},
}
# One H200, 04_train's defaults at Kimi geometry, 32,752 tokens/step (bench/results/h200-train.json, "ours").
H200_STEP_MS = {"fetch": 36.0, "fwd": 341.0, "bwd": 527.0, "opt": 18.0}
H200_TOKENS_PER_STEP = 32_752
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity
# Two H200s with DDP vs one (bench/results/h200x2-ddp2-train.json, h200-ddp-baseline-train.json): the
# logged step 966 -> 978 ms while each GPU sent and received 2 (2-1)/2 of the fp32 gradients.
TWO_H200_STEP_MS = (966.0, 978.0)
GPU_COUNTS = (1, 2, 4, 8)


def draft_geometry(text_config: dict, num_layers: int = 1, num_aux_layers: int = 3) -> dict:
    """The shapes speculators gives the draft for this target (its create_transformer_layer_config:
    hidden, heads, kv heads and head_dim from the verifier; transformers' DeepSeek-V3 config reports
    qk_rope_head_dim as head_dim)."""
    hidden = int(text_config["hidden_size"])
    heads = int(text_config["num_attention_heads"])
    head_dim = int(text_config.get("head_dim") or text_config.get("qk_rope_head_dim") or hidden // heads)
    return {"hidden_size": hidden, "num_heads": heads,
            "num_kv_heads": int(text_config.get("num_key_value_heads") or heads), "head_dim": head_dim,
            "intermediate_size": int(text_config["intermediate_size"]), "num_layers": num_layers,
            "num_aux_layers": num_aux_layers}


def trainable_parameters(geometry: dict) -> int:
    """speculators' Eagle3DraftModel: fc + per layer q/k/v (input 2H), o_proj, MLP, 3 norms; + the final norm."""
    h, inter = geometry["hidden_size"], geometry["intermediate_size"]
    q, kv = geometry["num_heads"] * geometry["head_dim"], geometry["num_kv_heads"] * geometry["head_dim"]
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * inter + 3 * h
    return geometry["num_aux_layers"] * h * h + geometry["num_layers"] * layer + h


def achieved_fraction(params: int) -> float:
    """The share of NVLink 4's spec rate the 2-H200 DDP run's extra step time implies."""
    added_s = (TWO_H200_STEP_MS[1] - TWO_H200_STEP_MS[0]) / 1e3
    return ring_allreduce_bytes(params, 2) / added_s / (INTERCONNECTS["nvlink4"]["gb_s"] * 1e9)


def ring_allreduce_bytes(params: int, gpus: int, grad_bytes: int = 4) -> float:
    """Bytes each GPU sends (and receives) per step: 2 (N-1)/N x the fp32 gradients."""
    return 2 * (gpus - 1) / gpus * params * grad_bytes


def hardware(profile: str) -> dict | None:
    data = json.loads(profile_path(profile).read_text())
    return data.get("_hardware")


def predict(text_config: dict, profile: str, gpus: int | None = None, tokens_per_step: int | None = None,
            num_layers: int | None = None) -> dict | None:
    """The prediction for one profile at `gpus` GPUs (default: its nproc); None without a `_hardware` block."""
    hw = hardware(profile)
    if not hw:
        return None
    train = json.loads(profile_path(profile).read_text()).get("train", {})
    gpus = gpus or int(train.get("nproc", 1)) * int(train.get("nnodes", 1))
    tokens = tokens_per_step or int(train.get("total_seq_len", TrainConfig.model_fields["total_seq_len"].default))
    if num_layers is None:
        num_layers = load_draft_config(DEFAULT_DRAFT_CONFIG).num_layers
    params = trainable_parameters(draft_geometry(text_config, num_layers))
    link = INTERCONNECTS[hw["interconnect"]]
    scale = H200_BF16_DENSE_TFLOPS / float(hw["bf16_dense_tflops"])
    per_token_ms = (H200_STEP_MS["fetch"] + H200_STEP_MS["fwd"] + H200_STEP_MS["bwd"]) / H200_TOKENS_PER_STEP
    step_1_ms = (per_token_ms * tokens + H200_STEP_MS["opt"]) * scale
    bwd_ms = H200_STEP_MS["bwd"] / H200_TOKENS_PER_STEP * tokens * scale
    comm_bytes = ring_allreduce_bytes(params, gpus)
    fraction = achieved_fraction(params)
    spec_ms = comm_bytes / (link["gb_s"] * 1e9) * 1e3
    achieved_ms = spec_ms / fraction

    def at(comm_ms: float) -> dict:
        step = step_1_ms + comm_ms
        return {"step_ms": round(step, 1), "efficiency": round(step_1_ms / step, 4),
                "tokens_per_s": round(gpus * tokens / step * 1e3)}

    return {
        "profile": profile, "gpu": hw["gpu"], "gpus": gpus, "interconnect": link["name"],
        "bus_gb_s_per_direction": link["gb_s"], "bus_source": link["spec"], "bf16_dense_tflops": hw["bf16_dense_tflops"],
        "tokens_per_step_per_gpu": tokens, "trainable_parameters": params, "gradient_dtype": "float32",
        "allreduce_bytes_per_gpu_per_step": round(comm_bytes), "fsdp_bytes_per_gpu_per_step_at_least": round(comm_bytes),
        "step_1gpu_ms": round(step_1_ms, 1), "backward_ms": round(bwd_ms, 1),
        "allreduce_ms": {"spec": round(spec_ms, 1), "achieved": round(achieved_ms, 1)},
        "achieved_fraction_of_spec": round(fraction, 3),
        "hides_behind_backward": False,
        "predicted": {"spec": at(spec_ms), "achieved": at(achieved_ms)} if gpus > 1 else
                     {"spec": at(0.0), "achieved": at(0.0)},
    }


def communication_line(target_text_config: dict, profile: str | None, gpus: int) -> str:
    """The run plan's `communication:` line."""
    if gpus <= 1:
        return "  communication: none (1 GPU: no gradient all-reduce)"
    try:
        found = predict(target_text_config, profile, gpus) if profile and profile != "none" else None
    except KeyError as missing:  # a config without the draft's shapes (hidden, heads, MLP width)
        return f"  communication: {gpus} GPUs; the target's config has no {missing} to size the draft's gradients"
    if found is None:
        return (f"  communication: {gpus} GPUs; no interconnect known for profile {profile or 'none'} (a profile's "
                f"_hardware block gives it: eagle3_pipeline/scaling.py)")
    p = found
    return (f"  communication: DDP all-reduce of {p['trainable_parameters'] / 1e6:,.0f}M fp32 gradients = "
            f"{p['allreduce_bytes_per_gpu_per_step'] / 1e9:.2f} GB per GPU per step (FSDP's reduce-scatter + 2 all-gathers: "
            f"at least as much) over {p['interconnect']} ({p['bus_gb_s_per_direction']:.0f} GB/s each way): "
            f"{p['allreduce_ms']['spec']:.0f} ms at the spec rate, {p['allreduce_ms']['achieved']:.0f} ms at the "
            f"{p['achieved_fraction_of_spec']:.0%} of it 2 H200s achieved; not hidden behind the {p['backward_ms']:.0f} ms "
            f"backward (the TTT-reused layer's gradients complete at its end); predicted scaling at {gpus} GPUs "
            f"{p['predicted']['spec']['efficiency']:.1%} (spec) / {p['predicted']['achieved']['efficiency']:.1%} (achieved) "
            f"of linear at {p['tokens_per_step_per_gpu']:,} tokens/step/GPU")


MEASURE_COMMAND = ("python bench/train_throughput.py --runs ours --ours-profile {profile} --skip-disk --distinct-files 24 "
                   "--warmup-steps 2 --steps 8 --results /tmp/scaling-1 && for n in 2 4 8; do python "
                   "bench/train_throughput.py --runs --ddp $n --ours-profile {profile} --skip-disk --distinct-files 24 "
                   "--warmup-steps 2 --steps 8 --results /tmp/scaling-$n; done")


def prediction_report(text_config: dict, target: str) -> dict:
    profiles = sorted(p.stem for p in PROFILES_DIR.glob("*.json") if hardware(p.stem))
    return {
        "what": "predicted stage-04 DDP scaling at Kimi-K2.5 geometry (eagle3_pipeline/scaling.py); `measured` is null "
                "until the command has run on such a box",
        "target": target,
        "model": {"h200_step_ms_1gpu": H200_STEP_MS, "h200_tokens_per_step": H200_TOKENS_PER_STEP,
                  "two_h200_step_ms": TWO_H200_STEP_MS, "h200_bf16_dense_tflops": H200_BF16_DENSE_TFLOPS},
        "profiles": {
            name: {"per_gpu_count": {str(n): {**predict(text_config, name, n), "measured": None} for n in GPU_COUNTS},
                   "measure_with": MEASURE_COMMAND.format(profile=name)}
            for name in profiles
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="target model directory (config.json is enough)")
    parser.add_argument("--output", help="write the JSON here (bench/results/scaling-prediction.json); else print it")
    args = parser.parse_args(argv)
    try:
        target = load_target_info(args.target)
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    report = prediction_report(target.text_config, Path(args.target).name)
    text = json.dumps(report, indent=2) + "\n"
    if args.output:
        atomic_write_text(Path(args.output), text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
