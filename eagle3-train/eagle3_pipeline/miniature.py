"""The miniature: tiny random targets shaped like Kimi-K2.5, built locally and deterministically.

`build_miniature(cache_dir)` writes (once; later calls reuse the cache):
- `kimi-k25-mini/`: top-level `kimi_k25` config (`KimiK25ForConditionalGeneration`) with a
  deepseek_v3 `text_config` (MLA with kv_lora_rank + qk_rope_head_dim = 576, the only
  size vLLM's CPU MLA kernel takes; `topk_method: noaux_tc`; a few routed experts + one
  shared; first layer dense), weights under `language_model.` in two safetensors shards
  with an index (like the real 64-shard checkpoint), a small `vision_config` and a
  `preprocessor_config.json` so vLLM can load it text-only, and the tokenizer.
- `llama-mini/`: a tiny plain Llama with the same tokenizer (vLLM's CPU backend can
  spec-decode a Llama target, not an MLA one).
- `kimi-width` (`build_kimi_width`, built on demand): the same shape at Kimi-K2.5's hidden size 7168 with a few
  layers, so stage 02 writes the real run's bytes per token (4 slots x 7168 x bf16 = 57,344 B) while the forward
  stays cheap: the extraction bench's target for a run bound by bytes (bench/README.md).
- the tokenizer: byte-level BPE trained on the bundled sample conversations, carrying
  Kimi's special tokens (tool-call section ones included) and a chat template that behaves like
  Kimi-K2.5's real one (history reasoning dropped up to the last plain assistant turn, tool calls,
  tool results, tool declarations, content parts, thinking on by default).
Weights are random (seeded): the miniature tests plumbing and shapes, not quality.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from .files import atomic_path, sha256_json

# Local imports: torch, transformers, tokenizers, safetensors: imported where the miniature is built (`--print` of a cached one needs none).

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
SAMPLE_CONVERSATIONS = SAMPLES_DIR / "conversations.jsonl"
SAMPLE_SHAREGPT = SAMPLES_DIR / "sharegpt.jsonl"

SEED = 1234
VOCAB_SIZE = 1024  # config vocab; the trained tokenizer is smaller, like Kimi's padded 163840
BPE_VOCAB_SIZE = 700
NUM_LAYERS = 6

KIMI_SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
    "<|im_middle|>", "<think>", "</think>", "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
    "<|tool_call_end|>", "[UNK]", "[PAD]",
]
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi-K2.5's chat format, rendered the way its real template behaves (KNOWLEDGE.md): turns are
# concatenated with no separators; `tools` come first as a `tool_declare` block; content may be a
# list of text parts. The LAST assistant message without tool calls and everything before it are
# history: assistant turns there render `<think></think>` + content (reasoning dropped). Messages
# after it (the current tool-call chain) render `<think>REASONING</think>` + content. Tool calls
# follow the content as `<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>
# ARGS<|tool_call_end|>...<|tool_calls_section_end|>` (the id, `functions.NAME:INDEX`, is all that
# names the function); tool results render under their name (or `tool`) as `## Return of ID`.
# The generation prompt ends with `<think>` (thinking on) or `<think></think>` with thinking=false.
KIMI_CHAT_TEMPLATE = (
    "{%- macro render_content(m) -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] is not none -%}"
    "{%- for part in m['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- set ns = namespace(last_plain=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last_plain = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ render_content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ render_content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>{{ m.get('name') or 'tool' }}<|im_middle|>"
    "## Return of {{ m.get('tool_call_id') or '' }}\n{{ render_content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_plain -%}<think>{{ m.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ render_content(m) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


# Kimi-K2.5's own MoE routing and MLA head dims (its config.json). The miniature keeps them at toy
# sizes, and the bench's full-size Kimi config (bench/benchlib/throughput.py) takes them from here.
# MLA head dims, not toy ones: vLLM's CPU kernel needs kv_lora_rank + qk_rope_head_dim = 576, and its
# CUDA MLA prefill (0.26, FLASH_ATTN) accepts only DeepSeek's (128, 64, 128) or GLM's: with 32/64/32
# the engine did not start on an H200.
KIMI_K25_ROUTING_AND_MLA_HEADS = {
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def kimi_text_config(vocab_size: int, special_ids: dict[str, int]) -> dict:
    """DeepSeek-V3 text config with Kimi-K2.5's structure at toy sizes."""
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        **KIMI_K25_ROUTING_AND_MLA_HEADS,
        "q_lora_rank": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 50000.0,
        # Kimi-K2.5's (and DeepSeek-V3's) value. It matters beyond fidelity: HF's DeepSeek-V3
        # hard-codes eps=1e-6 for the MLA q_a/kv_a norms while vLLM uses this field, so any
        # other value makes vLLM and HF disagree (~1e-3) on the miniature but not on Kimi.
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": special_ids["[BOS]"],
        "eos_token_id": special_ids["[EOS]"],
        "pad_token_id": special_ids["[PAD]"],
        "dtype": "float32",
    }


KIMI_K25_HIDDEN_SIZE = 7168
KIMI_K25_Q_LORA_RANK = 1536
KIMI_WIDTH_LAYERS = 4  # the fewest that hold 3 distinct aux layers >= 1 (2, 3, ... made distinct) and the dense first


# The miniature's text config at Kimi-K2.5's width: its hidden size and q_lora_rank, MLA + MoE as the miniature, few
# layers and heads and small experts (the forward is cheap; the states are the real run's size).
KIMI_WIDTH_CHANGES = {"hidden_size": KIMI_K25_HIDDEN_SIZE, "num_hidden_layers": KIMI_WIDTH_LAYERS,
                      "q_lora_rank": KIMI_K25_Q_LORA_RANK, "intermediate_size": 1024, "moe_intermediate_size": 256,
                      "dtype": "bfloat16"}


def kimi_wrapper_config(text_config: dict) -> dict:
    return {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": text_config,
        # A small vision tower config: vLLM builds its processor from it even text-only.
        "vision_config": {
            "model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128,
            "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4, "merge_kernel_size": [2, 2],
        },
        "projection_hidden_size": 64,
        "tie_word_embeddings": False,  # the top-level default is True; Kimi-K2.5 unties
        "bos_token_id": text_config["bos_token_id"],
        "eos_token_id": text_config["eos_token_id"],
        "pad_token_id": text_config["pad_token_id"],
        "dtype": "float32",
    }


# vLLM loads Kimi-K2.5's image processor even for text-only use; it reads `media_proc_cfg`.
KIMI_PREPROCESSOR_CONFIG = {
    "media_proc_cfg": {
        "in_patch_limit": 4096, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
        "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
        "max_num_frames": 8, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "kimi_k25",
    },
}


def llama_config(vocab_size: int, special_ids: dict[str, int]) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": special_ids["[BOS]"],
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["[PAD]"],
        "dtype": "float32",
    }


def _sample_texts() -> list[str]:
    """Every text of the sample rows (content, text parts, reasoning, tool calls, tools): the BPE's corpus."""
    texts = []
    for path in (SAMPLE_CONVERSATIONS, SAMPLE_SHAREGPT):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("tools"):
                texts.append(row["tools"] if isinstance(row["tools"], str) else json.dumps(row["tools"]))
            for turn in row.get("messages") or row.get("conversations"):
                content = turn.get("content", turn.get("value"))
                if isinstance(content, list):
                    texts.extend(part.get("text", "") for part in content)
                elif isinstance(content, str):
                    texts.append(content)
                texts.append(turn.get("reasoning_content") or "")
                texts.extend(json.dumps(call) for call in turn.get("tool_calls") or [])
    return [text for text in texts if text]


def build_tokenizer(out_dir: Path) -> dict[str, int]:
    """Train a byte-level BPE on the samples, add Kimi's special tokens, save as HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_sample_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
        additional_special_tokens=[t for t in KIMI_SPECIAL_TOKENS if t not in ("[BOS]", "[EOS]", "[UNK]", "[PAD]")],
    )
    fast.chat_template = KIMI_CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    if len(fast) > VOCAB_SIZE:
        raise RuntimeError(f"miniature tokenizer has {len(fast)} tokens > config vocab {VOCAB_SIZE}")
    return {tok: fast.convert_tokens_to_ids(tok) for tok in KIMI_SPECIAL_TOKENS}


def _save_sharded(state: dict, out_dir: Path, prefix: str, num_shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(state)
    shards = [names[i::num_shards] for i in range(num_shards)]
    weight_map = {}
    for i, shard_names in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({prefix + n: state[n].contiguous() for n in shard_names}, str(out_dir / file_name),
                  metadata={"format": "pt"})
        weight_map.update({prefix + n: file_name for n in shard_names})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )


def _random_model_state(model_type: str, config: dict, seed: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        # Kimi's router bias exists in the checkpoint (noaux_tc); give it non-trivial values.
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.uniform_(-0.1, 0.1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.uniform_(-0.1, 0.1)
    # The checkpoint layout, not the in-memory one: transformers 5 fuses MoE experts into
    # `experts.gate_up_proj` tensors in memory, while real checkpoints (Kimi-K2.5, DeepSeek-V3)
    # store `experts.{e}.{gate,up,down}_proj.weight`, the only layout vLLM loads. save_pretrained
    # writes the checkpoint layout (and from_pretrained reads it back to the same model).

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(str(shard)))
    return state


def miniature_key() -> str:
    """Changes whenever anything that shapes the miniature changes; names the cache entry."""
    return sha256_json({
        "seed": SEED, "weights": "checkpoint-layout", "vocab": VOCAB_SIZE, "bpe": BPE_VOCAB_SIZE, "layers": NUM_LAYERS,
        "template": KIMI_CHAT_TEMPLATE, "kimi": kimi_text_config(VOCAB_SIZE, dict.fromkeys(KIMI_SPECIAL_TOKENS, 0)),
        "llama": llama_config(VOCAB_SIZE, dict.fromkeys(KIMI_SPECIAL_TOKENS, 0)),
        "preproc": KIMI_PREPROCESSOR_CONFIG,
        "samples": [SAMPLE_CONVERSATIONS.read_text(), SAMPLE_SHAREGPT.read_text()],
    })[:12]


def build_miniature(cache_dir: str | Path) -> dict[str, Path]:
    """Build (or reuse) the miniature targets; returns their paths and the sample data."""
    root = Path(cache_dir) / f"miniature-{miniature_key()}"
    paths = {
        "kimi": root / "kimi-k25-mini",
        "llama": root / "llama-mini",
        "conversations": SAMPLE_CONVERSATIONS,
        "sharegpt": SAMPLE_SHAREGPT,
    }
    if (root / "DONE").is_file():
        return paths
    with atomic_path(root) as tmp:
        tmp.mkdir(parents=True)
        tok_dir = tmp / "tokenizer"
        special_ids = build_tokenizer(tok_dir)

        kimi_dir = tmp / "kimi-k25-mini"
        kimi_dir.mkdir()
        text_config = kimi_text_config(VOCAB_SIZE, special_ids)
        (kimi_dir / "config.json").write_text(json.dumps(kimi_wrapper_config(text_config), indent=2))
        (kimi_dir / "preprocessor_config.json").write_text(json.dumps(KIMI_PREPROCESSOR_CONFIG, indent=2))
        _write_generation_config(kimi_dir, special_ids)
        _save_sharded(_random_model_state("deepseek_v3", text_config, SEED), kimi_dir, "language_model.", 2)

        llama_dir = tmp / "llama-mini"
        llama_dir.mkdir()
        config = llama_config(VOCAB_SIZE, special_ids)
        (llama_dir / "config.json").write_text(json.dumps(config, indent=2))
        _write_generation_config(llama_dir, special_ids)
        _save_sharded(_random_model_state("llama", config, SEED + 1), llama_dir, "", 1)

        for target in (kimi_dir, llama_dir):
            for item in tok_dir.iterdir():
                (target / item.name).write_bytes(item.read_bytes())
        (tmp / "DONE").write_text(miniature_key() + "\n")
    return paths


def build_kimi_width(cache_dir: str | Path) -> Path:
    """Build (or reuse) the Kimi-width target beside the miniature (its tokenizer and template); returns its path."""
    import torch

    kimi = build_miniature(cache_dir)["kimi"]
    key = sha256_json({"miniature": miniature_key(), "changes": KIMI_WIDTH_CHANGES})[:12]
    root = Path(cache_dir) / f"kimi-width-{key}"
    if (root / "DONE").is_file():
        return root
    with atomic_path(root) as tmp:
        tmp.mkdir(parents=True)
        text_config = {**json.loads((kimi / "config.json").read_text())["text_config"], **KIMI_WIDTH_CHANGES}
        (tmp / "config.json").write_text(json.dumps({**kimi_wrapper_config(text_config), "dtype": "bfloat16"}, indent=2))
        for item in kimi.iterdir():  # tokenizer, template, generation and preprocessor configs
            if item.name != "config.json" and not item.name.startswith("model"):
                (tmp / item.name).write_bytes(item.read_bytes())
        state = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
                 for name, tensor in _random_model_state("deepseek_v3", text_config, SEED + 2).items()}
        _save_sharded(state, tmp, "language_model.", 2)
        (tmp / "DONE").write_text(key + "\n")
    return root


def _write_generation_config(directory: Path, special_ids: dict[str, int]) -> None:
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": special_ids["[BOS]"],
        "eos_token_id": [special_ids["[EOS]"], special_ids["<|im_end|>"]],
        "pad_token_id": special_ids["[PAD]"],
    }, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the miniature targets (tiny Kimi-K2.5-shaped + tiny Llama).")
    parser.add_argument("--cache-dir", default=".cache", help="where to build (reused when unchanged)")
    parser.add_argument("--print", choices=["kimi", "llama", "conversations", "sharegpt", "kimi-width"],
                        help="print one path only (for shell scripts); kimi-width builds the Kimi-width target")
    args = parser.parse_args()
    if args.print == "kimi-width":
        print(build_kimi_width(args.cache_dir))
        return
    paths = build_miniature(args.cache_dir)
    if args.print:
        print(paths[args.print])
    else:
        for name, path in paths.items():
            print(f"{name}: {path}")


if __name__ == "__main__":
    main()
