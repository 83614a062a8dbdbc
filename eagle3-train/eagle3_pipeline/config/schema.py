"""The stage configs and the draft config as typed data: one pydantic model per stage, every field's facts
declared with it (`_field`: help text, default, identity, the speculators flag it maps to), and the draft
architecture (`DraftConfig`, the one home of its defaults). Reading profiles and argv is resolution.py's;
`--print-config`'s text is printing.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .. import draft_kinds
from ..compat.flex_forward_config import parse_setting as parse_flex_forward_config
from ..errors import ConfigError
from ..hidden_states import FILE_PATTERN, HS_DIRNAME

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = PACKAGE_DIR.parent
REPO_DIR = SCRIPTS_DIR.parent
PROFILES_DIR = SCRIPTS_DIR / "profiles"
DEFAULT_DRAFT_CONFIG = REPO_DIR / "draft_config.json"


class StageConfig(BaseModel):
    # allow_inf_nan=False: every float setting of every stage is finite (`--noise-std inf` trained to a NaN loss)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    STAGE: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    EXAMPLE: ClassVar[str] = ""

    @field_validator("*", mode="after")
    @classmethod
    def _numbers_are_not_negative(cls, value: Any, info) -> Any:
        """One rule for every numeric setting of every stage (flag or profile): no negative value, unless its field
        declares `negative_ok=True` (its own bound then says how low). Non-finite ones: `allow_inf_nan` above."""
        if info.field_name and field_meta(cls, info.field_name).get("negative_ok"):
            return value
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, (int, float)) and not isinstance(number, bool) and number < 0:
                raise ValueError(f"must not be negative (got {number})")
        return value

    def identity_settings(self) -> dict[str, Any]:
        """The settings of this config that are part of its stage's identity (stage.stage_identity)."""
        return {name: value for name, value in self.model_dump().items() if field_meta(type(self), name)["identity"]}


def _field(default: Any, help: str, *, identity: bool, speculators: str | None = None, flag: str | None = None,
           negative_ok: bool = False, **extra: Any) -> Any:
    """A config field and its facts, declared once, here:
    `identity`: part of the stage's identity (stage.py: a finished output made with another value is
      refused). False for paths (their content is in the inputs' identity), for flags that change how, not
      what (validation sampling, batching, devices, worker counts, logging, kernels), and for values the
      stage records resolved instead (layer ids, the draft vocab size). Keyword-only, without a default:
      a new field says which it is.
    `speculators`: the `speculators train` flag this field is passed to verbatim (training.speculators_argv;
      a bool passes the bare flag when true, None passes nothing).
    `flag`: overrides the generated --field-name (when the name would clash).
    `negative_ok`: a number below 0 means something (else StageConfig refuses it)."""
    meta: dict[str, Any] = {"identity": identity}
    if negative_ok:
        meta["negative_ok"] = True
    if speculators:
        meta["speculators"] = speculators
    if flag:
        meta["flag"] = flag
    return Field(default, description=help, json_schema_extra=meta, **extra)


def field_meta(cls: type[BaseModel], name: str) -> dict[str, Any]:
    """A field's declared facts ({"identity": bool, "speculators": flag, "flag": flag}, the last two optional)."""
    extra = cls.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_name(name: str, cls: type[StageConfig] | None = None) -> str:
    """The command-line flag of a field: `flag=` where declared, else --field-name."""
    if cls is not None and name in cls.model_fields and field_meta(cls, name).get("flag"):
        return field_meta(cls, name)["flag"]
    return "--" + name.replace("_", "-")


def json_object_or_none(value: Optional[str]) -> Optional[str]:
    """A --chat-template-kwargs value: None or the text of a JSON object (the stage parses it where it uses it)."""
    if value is not None:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object, e.g. '{\"thinking\": true}'")
    return value


def speculators_pass_through(cfg: StageConfig) -> list[str]:
    """The `speculators train` flags of the fields declared with `speculators=`, in field order."""
    argv: list[str] = []
    for name in type(cfg).model_fields:
        flag = field_meta(type(cfg), name).get("speculators")
        value = getattr(cfg, name)
        if flag is None or value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv


# speculators 0.9.0's metric loggers (train/logger.py's setup_metric_logger: "" for none, else a comma-separated list)
# and the package each one imports when training starts
METRIC_LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
NO_LOGGER = ("", "none", "''", '""')  # '' through run_all.sh --args-04 "--logger ''" arrives with its quotes


def parse_loggers(value: str) -> str:
    """A --logger value as speculators takes it: "" (none / '') or known names joined by commas; else ValueError
    naming the accepted values (speculators itself fails only once training starts, in three tracebacks)."""
    if value.strip().lower() in NO_LOGGER:
        return ""
    names = [name.strip().lower() for name in value.split(",")]
    unknown = [name for name in names if name not in METRIC_LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger {unknown[0]!r} in {value!r} (accepted: {', '.join(METRIC_LOGGERS)}, several "
                         f"comma-separated, or none)")
    return ",".join(dict.fromkeys(names))


class PrepareConfig(StageConfig):
    STAGE: ClassVar[str] = "prepare"
    DESCRIPTION: ClassVar[str] = (
        "Stage 01: conversations -> the target's chat template -> input_ids + assistant-only loss_mask, "
        "saved in speculators' layout (datasets.save_to_disk + token_freq.pt)."
    )
    EXAMPLE: ClassVar[str] = (
        "python eagle3-train/01_prepare_dataset.py --target /models/Kimi-K2.5 --trust-remote-code \\\n"
        "    --data mlabonne/open-perfectblend --max-samples 10 --output work/data"
    )
    target: str = _field(..., "target model directory (its tokenizer + chat template are used)", identity=False)
    tokenizer: Optional[str] = _field(None, "tokenizer directory if not the target's", identity=False)
    data: str = _field(..., "conversations: a HF datasets name, a local .jsonl/.json/.parquet file or a "
                            "datasets.save_to_disk folder "
                            "(OpenAI messages, ShareGPT, or rows already tokenized for the target: "
                            "input_ids + loss_mask, as speculators regenerate-responses writes)", identity=False)
    data_split: str = _field("train", "split to read when --data is a HF datasets name or a saved DatasetDict", identity=True)
    data_subset: Optional[str] = _field(None, "HF datasets config/subset name", identity=True)
    output: str = _field(..., "output directory (the prepared dataset; stage 02 adds hidden_states/ inside it)", identity=False)
    max_samples: Optional[int] = _field(None, "use only the first N conversations (the 10-sample smoke)", identity=True)
    max_seq_len: int = _field(2048, "longest row in tokens", identity=True)
    on_too_long: Literal["drop", "truncate"] = _field(
        "drop", "rows longer than --max-seq-len: drop them (counted in the manifest) or truncate them", identity=True)
    rows_per: Literal["turn", "conversation"] = _field(
        "turn", "'turn': one row per assistant turn, rendered exactly as the model sees it at inference "
        "(safe for thinking models whose template drops earlier reasoning); 'conversation': one row, "
        "every assistant turn trained (needs a prefix-stable template)", identity=True)
    on_bad_row: Literal["fail", "skip"] = _field(
        "fail", "a row that cannot be trained exactly as given (malformed, or the chat template would drop "
        "part of an assistant turn): 'fail' stops with its file and row; 'skip' writes it with the reason to "
        "rejected.jsonl in --output, counts it, and fails only above --max-bad-fraction", identity=True)
    max_bad_fraction: float = _field(0.01, "with --on-bad-row skip: fail if more than this fraction of rows are bad",
                                     ge=0, le=1, identity=True)
    chat_template_kwargs: Optional[str] = _field(
        None, "JSON object passed to every chat-template rendering, as vLLM's chat_template_kwargs "
        "(e.g. '{\"thinking\": true}' for DeepSeek-V3.1, '{\"enable_thinking\": false}' for Qwen3); serve with the same", identity=True)
    end_of_turn_tokens: list[str] = _field(
        [], "tokens an assistant turn ends on (default: generation_config.json's eos ids, what vLLM stops on); "
        "repeat the flag for several", identity=True)
    val_ratio: float = _field(0.1, "fraction of conversations held out for validation (the last rows)", gt=0, lt=1, identity=True)
    seed: int = _field(0, "shuffle seed for the train/val split", identity=True)
    trust_remote_code: bool = _field(False, "allow the target's own tokenizer code (Kimi-K2.5 needs it)", identity=False)
    overwrite: bool = _field(False, "replace a finished output made with other settings", identity=False)
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate, render every input row "
                                "(local files and HF datasets) and list the first --report-problems bad ones; writes nothing", identity=False)
    report_problems: int = _field(20, "how many bad rows --check lists (all are counted)", ge=1, identity=False)


    _chat_template_kwargs_is_a_json_object = field_validator("chat_template_kwargs")(
        classmethod(lambda cls, value: json_object_or_none(value)))

    def template_kwargs(self) -> dict:
        return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}


class ExtractConfig(StageConfig):
    STAGE: ClassVar[str] = "extract"
    DESCRIPTION: ClassVar[str] = (
        "Stage 02: run the target and save aux-layer + final (pre-norm) hidden states per row as "
        f"{HS_DIRNAME}/{FILE_PATTERN} (speculators' layout), validated as they land."
    )
    EXAMPLE: ClassVar[str] = (
        "python eagle3-train/02_extract_hidden_states.py --profile rtx-pro-6000-8x \\\n"
        "    --target /models/Kimi-K2.5 --trust-remote-code --data work/data"
    )
    target: str = _field(..., "target model directory", identity=False)
    data: str = _field(..., "stage 01's output directory; hidden_states/ is written inside it", identity=False)
    backend: Literal["vllm", "hf"] = _field("vllm", "'vllm' for real targets (tensor parallel), 'hf' for small targets and debugging", identity=False)
    # not identity: recorded resolved (the layer ids saved, the final layer included)
    layer_ids: Optional[list[int]] = _field(None, "the 3 aux layer ids (default 2, L//2, L-3); the final layer L is always added", identity=False)
    dtype: Literal["bfloat16", "float16", "float32"] = _field("bfloat16", "dtype of the saved hidden states (and of the HF backend's compute)", identity=True)
    storage: Literal["dtype", "fp8"] = _field(
        "dtype", "how the states are saved: 'dtype' = in --dtype; 'fp8' = speculators' fp8 format (float8_e4m3fn "
        "values + one fp32 scale per token, about half of bf16's bytes; stage 04 reads it with speculators' fp8 backend)", identity=True)
    device: str = _field("auto", "HF backend device: auto (cuda if present), cpu, cuda, cuda:N", identity=False)
    max_samples: Optional[int] = _field(None, "extract only the first N rows", identity=False)
    # not identity: a sliced run's selection, recorded in the manifest (`selection`), one per slice
    rows: Optional[str] = _field(None, "extract only these rows, START:END ranges (end exclusive, e.g. 0:1000,90000:100000): "
                                       "one slice of a sliced run (run_all.sh --slice-rows); first deletes this stage's "
                                       "files of the rows outside them (their manifest is kept in hidden_states/slices/)", identity=False)
    world_size: int = _field(1, "number of extraction replicas sharing the rows (one per node: each node's own --rank, "
                                "one --data on a shared filesystem; the last to finish writes the manifest)", ge=1,
                             identity=False)
    rank: int = _field(0, "this replica's index in [0, world-size)", ge=0, identity=False)
    retries: int = _field(2, "re-extract a row whose file fails validation this many times before giving up", ge=0, identity=False)
    validate_only: bool = _field(False, flag="--validate", help="only validate existing files and list the rows to redo (a rerun redoes them)", identity=False)
    validate_sample: int = _field(16, "after extraction, re-read this many landed files end to end (0 = none, -1 = all)",
                                  ge=-1, negative_ok=True, identity=False)
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and the run plan (bytes per format, disk, reads, hours; eagle3_pipeline.plan) and exit", identity=False)
    trust_remote_code: bool = _field(False, "allow the target's own code (Kimi-K2.5 needs it)", identity=False)
    # vLLM backend
    tensor_parallel_size: int = _field(1, "vLLM tensor parallel size (8 for Kimi-K2.5 on one 8-GPU box)", ge=1, identity=False)
    gpu_memory_utilization: float = _field(0.9, "vLLM GPU memory fraction", gt=0, le=1, identity=False)
    kv_cache_memory_gib: Optional[float] = _field(
        None, "GPU: the KV cache's size in GiB instead of vLLM's memory profiling (which counts other "
        "processes' memory on a shared GPU as its own)", gt=0, identity=False)
    max_model_len: Optional[int] = _field(None, "vLLM max model length (default: the prepared data's --max-seq-len + 1)", identity=False)
    max_num_seqs: int = _field(64, "vLLM concurrent sequences (requests in flight)", ge=1, identity=False)
    language_model_only: Optional[bool] = _field(None, "skip the vision tower of a multimodal wrapper (default: on for wrappers)", identity=False)
    attention_backend: Optional[str] = _field(None, "vLLM attention backend (e.g. TRITON_MLA on SM120); default: vLLM's choice", identity=False)
    kv_cache_dtype: str = _field("auto", "vLLM KV-cache dtype", identity=True)
    enforce_eager: bool = _field(False, "disable CUDA graphs in vLLM", identity=False)
    writer_threads: int = _field(8, "vLLM: threads writing the files in the engine's connector (its num_writer_threads); "
                                    "more for a disk that wants deep queues", ge=1, identity=False)
    staging_dir: Optional[str] = _field(None, "where vLLM writes files before they are validated and moved (fast local disk; same filesystem as --data avoids a copy)", identity=False)
    endpoint: Optional[str] = _field(None, "URL of a running vLLM server started with --print-server-cmd's flags; default: run vLLM in-process", identity=False)
    print_server_cmd: bool = _field(False, "print the vLLM server command for this target and exit", identity=False)
    server_port: int = _field(8000, "port used in --print-server-cmd", identity=False)


class VocabConfig(StageConfig):
    STAGE: ClassVar[str] = "vocab"
    DESCRIPTION: ClassVar[str] = (
        "Stage 03: the draft vocabulary (d2t/t2d) from loss-masked token frequencies of the training rows, "
        "built with speculators' own functions, plus a coverage report."
    )
    EXAMPLE: ClassVar[str] = "python eagle3-train/03_build_vocab_mapping.py --data work/data --output work/vocab"
    data: str = _field(..., "stage 01's output directory (its token_freq.pt)", identity=False)
    output: str = _field(..., "output directory for d2t.npy, t2d.npy, coverage.json", identity=False)
    draft_config: str = _field(str(DEFAULT_DRAFT_CONFIG), "draft_config.json (its draft_vocab_size is the default)", identity=False)
    # not identity: recorded resolved (the size used, after clipping)
    draft_vocab_size: Optional[int] = _field(None, "draft vocabulary size (default: draft_config.json's, clipped to the target vocab)", gt=0, identity=False)
    overwrite: bool = _field(False, "replace a mapping made with other settings or inputs (its own three files; "
                                    "never another stage's output)", identity=False)
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and exit", identity=False)


class TrainConfig(StageConfig):
    STAGE: ClassVar[str] = "train"
    DESCRIPTION: ClassVar[str] = (
        "Stage 04: train the draft (EAGLE-3 unless --speculator-type / draft_config.json say another kind) with speculators' own trainer (flex_attention + fused loss on GPU; "
        "a CPU compatibility layer only when no accelerator exists). Resumes from the last checkpoint."
    )
    EXAMPLE: ClassVar[str] = (
        "python eagle3-train/04_train.py --profile rtx-pro-6000-8x --target /models/Kimi-K2.5 \\\n"
        "    --data work/data --vocab work/vocab --output work/checkpoints"
    )
    target: str = _field(..., "target (verifier) model directory", identity=False)
    data: str = _field(..., "stage 01+02 output directory (stage 01's alone with --hidden-states online/hybrid)", identity=False)
    vocab: str = _field(..., "stage 03 output directory", identity=False)
    output: str = _field(..., "checkpoint directory (speculators' <epoch>/ folders, resumed automatically)", identity=False)
    # hidden_states .. vllm_request_timeout, not identity: where the states come from is recorded resolved
    # (hidden_states_source, layer_ids); online and hybrid train on the same states (hybrid only keeps them),
    # and the server's address is not the data
    hidden_states: Literal["files", "online", "hybrid"] = _field(
        "files", "where the target's hidden states come from: 'files' = stage 02's DATA/hidden_states; 'online' = a "
        "running vLLM (--vllm-endpoint) computes each sample's states when the trainer needs them and they are deleted "
        "after use (no stage 02, no disk); 'hybrid' = online, and each sample's states are kept in "
        "OUTPUT/hidden_states_cache the first time, so later epochs and resumes read them from disk", identity=False)
    vllm_endpoint: Optional[str] = _field(
        None, "online/hybrid: URL of the vLLM server serving the target with hidden-state extraction, started with "
        "`python -m eagle3_pipeline.serve_target` (e.g. http://box-a:8000); checked before training: served model, "
        "max-model-len, layer ids, and that this machine reads the files it writes", identity=False)
    layer_ids: Optional[list[int]] = _field(
        None, "online/hybrid: the 3 aux layer ids the server extracts (default 2, L//2, L-3; the final layer L is "
        "added). Checked against the server's card when serve_target started it; required when the server has "
        "no card this machine can read", identity=False)
    vllm_retries: int = _field(3, "online/hybrid: HTTP retries per vLLM request (exponential backoff 2, 4, 8 s; "
                                  "speculators --max-retries); a server that still does not answer stops training", ge=0, identity=False)
    # on_bad_sample, max_bad_fraction, not identity: how a bad input is handled (they change whether training
    # goes on, not what a step trains on); the samples skipped are listed in the manifest
    on_bad_sample: Literal["stop", "skip"] = _field(
        "stop", "a sample whose hidden states are unreadable, misshapen, stored in another dtype, non-finite, constant "
        "in a layer slot, or not its row's tokens (checked as the loader reads it): 'stop' = stop training with one "
        "line naming the file; 'skip' = leave it out, count it, list it in the manifest (bad_samples), and stop "
        "only above --max-bad-fraction", identity=False)
    max_bad_fraction: float = _field(0.01, "with --on-bad-sample skip: stop if more than this fraction of the samples "
                                           "are left out (or all of them); a file redone since it was left out (02) counts no more", ge=0, le=1, identity=False)
    vllm_request_timeout: float = _field(120.0, "online/hybrid: seconds per vLLM request (speculators --request-timeout)", gt=0, identity=False)
    # not identity: a guard, not a learning setting (compat/stall_watch.py)
    stall_minutes: float = _field(30.0, "stop a training process (exit 75, resumable) when no training step or "
                                        "validation batch came for this long, after writing every thread's stack and "
                                        "the loader workers' states to the log (a hung rank or loader otherwise idles "
                                        "the GPUs silently); the log's 'stall watch' line gives a run's longest wait; "
                                        "0 = off", ge=0, identity=False)
    draft_config: str = _field(str(DEFAULT_DRAFT_CONFIG), "draft architecture file: speculator_type (the kind, eagle3 by "
                                                          "default), layers, window; EAGLE-3's TTT steps and norm before fc "
                                                          "(fc_norm per aux state by default, or norm_before_fc); a block "
                                                          "draft's block_size (null = the kind's)",
                               identity=False)
    # not identity: recorded resolved (the draft config's speculator_type in the identity, eagle3 left out)
    speculator_type: Optional[str] = _field(
        None, "the draft kind speculators trains (--speculator-type; default: draft_config.json's speculator_type, "
        "eagle3): eagle3, peagle, dflash, dflash2 or dspark (xpress and mtp are refused: no vLLM serves them). Another "
        "kind than eagle3 gets speculators' own defaults, not draft_config.json's EAGLE-3 keys (draft_arch, ttt_steps, "
        "the norms); its num_layers (1 = the kind's default) and block_size (null = the kind's) are passed", identity=False)
    # not identity: recorded resolved (in the identity for a kind that reads a mask token)
    mask_token_id: Optional[int] = _field(
        None, "the mask (placeholder) token a peagle or block draft is trained with (default: the target tokenizer's "
        "mask token, else its first unused embedding row, else its pad/eos/unk token: speculators' own rule)",
        identity=False)
    epochs: int = _field(10, "training epochs", ge=1, identity=True, speculators="--epochs")
    max_steps: Optional[int] = _field(None, "stop after this many optimizer steps", ge=1, identity=True,
                                      speculators="--max-steps")
    slice_rows: Optional[int] = _field(None, "sliced run (run_all.sh --slice-rows): the training rows are cut into slices "
                                             "of N rows, each extracted, trained on and deleted in turn "
                                             "(eagle3_pipeline/slices.py)", ge=1, identity=True)
    # not identity: which slice of a sliced run trains now (slice_rows is the identity; slices.py)
    slice_index: Optional[int] = _field(None, "sliced run: the run position trained now (epoch x slices + slice, "
                                              "0-based; stage 02 must hold its --rows)", ge=0, identity=False)
    # Throughput defaults measured on an H200 at Kimi geometry (NOTES.md, "Training defaults and why"; figures in
    # bench/README.md, "Training throughput"). A run with under 1,000 optimizer steps packs 8K instead
    # (training.fit_seq_len_to_run): on the SmolLM2 testbed in vLLM 8K steps trained a better draft than 32K on
    # the same data, and lr 1e-3 beat 2e-3 and 4e-3 (bench/README.md, "Acceptance length in vLLM").
    total_seq_len: int = _field(32768, "tokens packed per step per GPU (16384 on 80 GB cards); unless given as a "
                                       "flag, 8192 when the run would have under 1,000 optimizer steps (preflight line)",
                                ge=16, identity=True, speculators="--total-seq-len")
    lr: float = _field(1e-3, "learning rate", gt=0, allow_inf_nan=False, identity=True, speculators="--lr")
    optimizer: Literal["muon", "adamw"] = _field("adamw", "optimizer (Muon's ~113 TFLOP per step is 41 percent of a Kimi-size step at 8K tokens)", identity=True, speculators="--optimizer")
    # not identity: recorded resolved (this flag, else the draft config's)
    ttt_steps: Optional[int] = _field(None, "EAGLE-3 test-time-training steps (default: draft_config.json's)", ge=1, identity=False)
    # not identity: validation only (recorded resolved: the manifest's summary has one full_acc per step validated)
    val_ttt_steps: Optional[int] = _field(None, "TTT steps validation unrolls, so the offline acceptance length covers "
                                                "the served k (default: the deeper of the training TTT steps and "
                                                "draft_config.json's num_speculative_tokens)", ge=1, identity=False)
    # not identity: recorded resolved, and only when on (04_train.py adds noise_std to the identity when > 0), so
    # every run without noise, made before the flag existed or after, keeps its identity (a resume is not refused)
    noise_std: float = _field(0.0, "std of the Gaussian noise added to the draft's input aux hidden states while it "
                                   "trains (EAGLE's feature-noise augmentation; never to the last slot the target "
                                   "logits come from, never in validation; compat/feature_noise.py); 0 = off",
                              ge=0, identity=False)
    attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = _field("auto", "draft attention; auto = flex_attention on GPU, sdpa on CPU", identity=False)
    loss_impl: Literal["auto", "fused", "eager"] = _field("auto", "loss kernel; auto = fused (Triton) on GPU, eager on CPU", identity=False)
    hidden_states_dtype: Literal["auto", "bfloat16", "float32"] = _field("auto", "training compute dtype for hidden states (speculators autocast); auto = bfloat16 on GPU, float32 on CPU", identity=True)
    flex_forward_config: str = _field("auto", "flex_attention forward kernel options: auto = the config measured for this GPU kind (sm90: 64x128 tile, 4 warps, 3 stages; none measured elsewhere), off = PyTorch's default, or a JSON object of fwd_ options found with bench/flex_attention_configs.py", identity=False)
    num_workers: int = _field(8, "dataloader workers per GPU", ge=0, identity=False)
    prefetch_factor: int = _field(2, "dataloader prefetch per worker (each batch holds total_seq_len x 57 KB of hidden states for Kimi)", ge=1, identity=False, speculators="--prefetch-factor")
    nproc: int = _field(1, "GPUs (torchrun processes) on this node", ge=1, identity=False)
    nnodes: int = _field(1, "nodes (torchrun --nnodes)", ge=1, identity=False)
    node_rank: int = _field(0, "this node's rank (torchrun --node-rank); node 0 (global rank 0) alone writes the shared --output: checkpoints, metrics, manifest.json, command.txt", ge=0, identity=False)
    rdzv_endpoint: Optional[str] = _field(None, "multi-node: node 0's HOST:PORT, the same on every node (torchrun --master-addr/--master-port; deepspeed --master_addr/--master_port)", identity=False)
    launcher: Literal["torchrun", "deepspeed"] = _field("torchrun", "multi-process launcher: torchrun (run on every node) or deepspeed (run once; starts the --hostfile hosts over SSH)", identity=False)
    hostfile: Optional[str] = _field(None, "deepspeed hostfile, lines 'HOST slots=GPUS' (with --launcher deepspeed)", identity=False)
    fsdp: bool = _field(False, "shard the draft with FSDP2 instead of DDP (multi-GPU)", identity=False, speculators="--fsdp-shard")
    checkpoint_freq: float = _field(1.0, "save every N epochs (<1 for sub-epoch checkpoints)", gt=0, identity=True, speculators="--checkpoint-freq")
    log_freq: int = _field(10, "log metrics every N steps (a logged step synchronises the GPU at every phase)", ge=1, identity=False, speculators="--log-freq")
    logger: str = _field("tensorboard", "speculators metric loggers: tensorboard, wandb, trackio or mlflow (several: "
                                        "comma-separated), or none (also '')", identity=False, speculators="--logger")
    seed: int = _field(0, "training seed", identity=True, speculators="--seed")
    trust_remote_code: bool = _field(False, "allow the target's own code when reading its config/tokenizer", identity=False, speculators="--trust-remote-code")
    dry_run: bool = _field(False, "write an initialised draft and exit (speculators --dry-run)", identity=False, speculators="--dry-run")
    extra_args: list[str] = _field([], "further speculators train flags, passed through verbatim (e.g. --extra-args=--muon-lr --extra-args=0.02)", identity=True)
    overwrite: bool = _field(False, "train anew over a run made with other settings or inputs: deletes only what "
                                    "stage 04 and speculators wrote there (never another stage's output or your files)", identity=False)
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and the run plan (bytes per format, disk, reads, hours; eagle3_pipeline.plan) and exit", identity=False)

    @field_validator("logger")
    @classmethod
    def _loggers_speculators_has(cls, value: str) -> str:
        return parse_loggers(value)

    @field_validator("node_rank")
    @classmethod
    def _node_rank_is_a_node(cls, value: int, info) -> int:
        # here, not at the launch: a multi-node 04 writes its node record into the shared --output first
        nnodes = info.data.get("nnodes", 1)
        if value >= nnodes:
            raise ValueError(f"must be in [0, --nnodes {nnodes})")
        return value

    @field_validator("speculator_type")
    @classmethod
    def _a_kind_speculators_trains(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in draft_kinds.KINDS:
            raise ValueError(f"speculators 0.9.0 trains {', '.join(draft_kinds.KINDS)}")
        return value

    @field_validator("flex_forward_config")
    @classmethod
    def _flex_forward_config_parses(cls, value: str) -> str:
        parse_flex_forward_config(value)  # fail at the flag, not in the training processes
        return value


class ExportConfig(StageConfig):
    STAGE: ClassVar[str] = "export"
    DESCRIPTION: ClassVar[str] = (
        "Stage 05: copy the chosen checkpoint into a self-contained speculators-format draft directory that vLLM "
        "loads with --speculative-config, verify it loads back, and print the serving command."
    )
    EXAMPLE: ClassVar[str] = "python eagle3-train/05_export.py --checkpoints work/checkpoints --output work/draft"
    checkpoints: str = _field(..., "stage 04 output directory", identity=False)
    output: str = _field(..., "draft directory to write", identity=False)
    checkpoint: str = _field("best", "which checkpoint: best, latest, or an epoch folder name", identity=False)
    vocab: Optional[str] = _field(None, "stage 03's output the training used (default: the path stage 04 recorded; "
                                        "needed after moving the work directory); checked by content", identity=False)
    verifier_name: Optional[str] = _field(None, "verifier path/name written into the draft config (default: the target path used in training)", identity=True)
    num_speculative_tokens: Optional[int] = _field(None, "draft tokens per step in the printed command (default: an eagle3 draft draft_config.json's; a block draft its block - 1, P-EAGLE its trained depths: draft_kinds.num_speculative_tokens)", ge=1, identity=False)
    tensor_parallel_size: int = _field(8, "tensor parallel size in the printed vLLM command", ge=1, identity=True)
    overwrite: bool = _field(False, "replace an export made with other settings or from another checkpoint (never a "
                                    "directory that is not an export)", identity=False)
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and exit", identity=False)


class EvaluateConfig(StageConfig):
    STAGE: ClassVar[str] = "evaluate"
    DESCRIPTION: ClassVar[str] = (
        "Stage 06: serve the target with the exported draft in vLLM (its kind's method: eagle3, dflash, ...) and alone, on chat prompts "
        "rendered as stage 01 rendered its rows; report tau (1 + accepted/drafts), per-position acceptance and tau "
        "per category with standard errors, and tokens/s with and without the draft (report.json, report.txt, "
        "report.png). A tau at or below --min-tau, a first-position acceptance below --min-first-acceptance, or a "
        "draft not served as trained (its d2t or aux layer ids other than stages 03/04's) exits 6 with one line "
        "naming the causes it checked."
    )
    EXAMPLE: ClassVar[str] = (
        "python eagle3-train/06_evaluate.py --draft work/draft --output work/eval \\\n"
        "    --prompts eagle3-train/samples/eval_prompts.jsonl --temperature 0"
    )
    draft: str = _field(..., "stage 05's output (the exported draft)", identity=False)
    output: str = _field(..., "report directory to write (report.json, report.txt, report.png, vLLM logs)", identity=False)
    prompts: str = _field(str(SCRIPTS_DIR / "samples" / "eval_prompts.jsonl"),
                          "jsonl of OpenAI `messages` (optional `category`, `tools`); a final assistant message is "
                          "dropped (the prompt is everything before it)", identity=False)
    target: Optional[str] = _field(None, "target model directory (default: the one the draft was trained for, from "
                                         "stage 05's manifest); its config must be that one", identity=False)
    data: Optional[str] = _field(None, "stage 01's output the draft was trained on (default: the path stage 04 "
                                       "recorded): its chat template kwargs render the prompts", identity=False)
    vocab: Optional[str] = _field(None, "stage 03's output (default: the path stage 04 recorded): the draft's d2t is "
                                        "compared with its d2t.npy", identity=False)
    chat_template_kwargs: Optional[str] = _field(
        None, "JSON object for the chat template (default: stage 01's, what the draft was trained with); another "
        "value measures another serving mode and is named in the verdict", identity=True)
    checkpoints: Optional[str] = _field(None, "stage 04's output the draft was exported from (default: the path stage "
                                              "05 recorded)", identity=False)
    num_speculative_tokens: Optional[int] = _field(None, "draft tokens per step (default: the draft config's, as stage 05 "
                                                          "wrote it)", ge=1, identity=True)
    tensor_parallel_size: Optional[int] = _field(None, "vLLM tensor parallel size (default: stage 05's, i.e. the "
                                                       "profile's export.tensor_parallel_size)", ge=1, identity=True)
    temperature: float = _field(0.0, "sampling temperature (0 = greedy; > 0: vLLM's rejection sampling)", ge=0, identity=True)
    max_tokens: int = _field(256, "tokens generated per prompt", ge=1, identity=True)
    max_model_len: int = _field(4096, "vLLM max-model-len (a prompt longer than this less --max-tokens is refused)",
                                ge=2, identity=True)
    max_prompts: Optional[int] = _field(None, "use only the first N prompts", ge=1, identity=True)
    seed: int = _field(0, "vLLM's seed (sampling at --temperature > 0)", identity=True)
    dtype: str = _field("auto", "vLLM dtype (auto: the target's)", identity=True)
    baseline: bool = _field(True, "also serve the target alone on the same prompts (tokens/s without the draft, and "
                                  "whether the draft changed greedy outputs)", identity=True)
    min_tau: float = _field(1.05, "verdict: a mean acceptance length at or below this fails (exit 6)", ge=1, identity=True)
    min_first_acceptance: float = _field(0.05, "verdict: an acceptance rate at draft position 1 below this fails "
                                               "(exit 6)", ge=0, le=1, identity=True)
    max_num_seqs: int = _field(16, "vLLM max_num_seqs (prompts decoded at once)", ge=1, identity=False)
    gpu_memory_utilization: float = _field(0.9, "vLLM gpu_memory_utilization (GPU only)", gt=0, le=1, identity=False)
    kv_cache_memory_gib: Optional[float] = _field(
        None, "GPU: the KV cache's size in GiB instead of vLLM's memory profiling (which counts other "
        "processes' memory on a shared GPU as its own and can stop the engine)", gt=0, identity=False)
    enforce_eager: bool = _field(False, "no CUDA graphs / torch.compile in vLLM (the CPU profile sets it: compiling "
                                        "costs minutes on a few cores)", identity=False)
    cpu_kv_cache_gib: int = _field(1, "vLLM's CPU KV cache in GiB (CPU only: VLLM_CPU_KVCACHE_SPACE)", ge=1, identity=False)
    trust_remote_code: bool = _field(False, "allow the target's own code (Kimi-K2.5 needs it)", identity=False)
    overwrite: bool = _field(False, "replace a report made with other settings or another draft", identity=False)
    check: bool = _field(False, "preflight only: check the inputs' manifests, render every prompt, run the draft's "
                                "self-checks (layer ids, d2t, method, template, weights) and exit; writes nothing", identity=False)

    _chat_template_kwargs_is_a_json_object = field_validator("chat_template_kwargs")(
        classmethod(lambda cls, value: json_object_or_none(value)))


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    cls.STAGE: cls for cls in (PrepareConfig, ExtractConfig, VocabConfig, TrainConfig, ExportConfig, EvaluateConfig)
}


class DraftConfig(BaseModel):
    """draft_config.json: the draft architecture, typed, with every default in this one place.

    Keys starting with `_` are comments. Unknown keys and bad values (a negative layer count,
    `ttt_steps: 0`, a string where a number goes) are refused with the key named; numbers are
    strict (`"2"` is not 2), so a typo never becomes a silently different draft.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    description: str = ""
    speculator_type: str = Field(draft_kinds.DEFAULT_KIND, description="speculators --speculator-type: the draft "
                                 "kind (eagle3, peagle, dflash, dflash2, dspark; 04 --speculator-type overrides it)")
    draft_arch: Literal["llama", "qwen3"] = Field("llama", description="speculators --draft-arch (eagle3 only)")
    num_layers: int = Field(1, ge=1, description="decoder layers in the draft (another kind than eagle3: 1 = that "
                                                 "kind's own default)")
    hidden_size: Optional[int] = Field(None, gt=0, description="null = the target's; a number must equal it")
    target_vocab_size: Optional[int] = Field(None, gt=0, description="null = the target's; a number must equal it")
    draft_vocab_size: int = Field(32000, gt=0, description="stage 03's default draft vocabulary size")
    ttt_steps: int = Field(3, ge=1, description="test-time-training steps (eagle3 only)")
    sliding_window: int = Field(2048, ge=1, description="draft attention window (tokens)")
    full_attention_indices: list[int] = Field([], description="draft layers with full attention")
    # a block draft's block (dflash, dflash2, dspark): null = the kind's own default (16 for dflash, 8 otherwise)
    block_size: Optional[int] = Field(None, ge=2, description="block drafts' --block-size; null = the kind's default")
    norm_before_residual: bool = True
    # EAGLE 3.1's per-layer norms: on the H200 they beat the single concatenation norm in vLLM at 1x data and were
    # level or ahead at 4x, for +2% step cost at Kimi-K2.5's geometry (bench/README.md "Recipe screen")
    fc_norm: bool = Field(True, description="a separate RMSNorm on each aux hidden state before the fc projection "
                                            "(EAGLE 3.1)")
    norm_before_fc: bool = Field(False, description="one RMSNorm over the aux hidden states' concatenation before "
                                                    "the fc projection (speculators 0.9.0's eagle3 default)")
    num_speculative_tokens: int = Field(3, ge=1, description="draft tokens per step in the serve command")

    def identity_settings(self) -> dict[str, Any]:
        """The draft's part of stage 04's identity. fc_norm / norm_before_fc only when they differ from what
        speculators 0.9.0 trained before the pipeline passed them (fc_norm false, norm_before_fc true), so a run
        made before these keys existed resumes with them set to that, and is refused under the new default.
        The kind's part (draft_kinds.identity_settings): an eagle3 draft's identity is the one it had before
        speculator_type and block_size existed; another kind's names it and leaves out the EAGLE-3 keys."""
        settings = self.model_dump(exclude={"description"})
        if not self.fc_norm and self.norm_before_fc:
            del settings["fc_norm"], settings["norm_before_fc"]
        return draft_kinds.identity_settings(self.speculator_type, settings)

    @property
    def draft_layers(self) -> int:
        """The decoder layers the draft gets (num_layers, or for another kind than eagle3 at 1 its default)."""
        return draft_kinds.num_draft_layers(self.speculator_type, self.num_layers)

    @field_validator("speculator_type")
    @classmethod
    def _a_kind_speculators_trains(cls, value: str) -> str:
        if value not in draft_kinds.KINDS:
            raise ValueError(f"speculators 0.9.0 trains {', '.join(draft_kinds.KINDS)}")
        return value

    @field_validator("full_attention_indices")
    @classmethod
    def _indices_are_layers(cls, value: list[int], info) -> list[int]:
        kind = info.data.get("speculator_type", draft_kinds.DEFAULT_KIND)
        if problem := draft_kinds.layer_indices_problem(kind, info.data.get("num_layers", 1), value):
            raise ValueError(problem)
        return value


def load_draft_config(path: str | Path, speculator_type: Optional[str] = None) -> DraftConfig:
    """The validated draft config (every key present, defaults filled in). `speculator_type`: the kind stage 04's
    --speculator-type sets instead of the file's (the settings that depend on the kind are checked for it)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: draft config not found (--draft-config)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object of draft settings")
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(data) - set(DraftConfig.model_fields))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown} (known: {', '.join(DraftConfig.model_fields)})")
    if speculator_type is not None:
        data["speculator_type"] = speculator_type
    try:
        draft = DraftConfig(**data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "?"
        got = data.get(str(first["loc"][0]), "?") if first["loc"] else "?"
        raise ConfigError(f"{path}: {key}: {first['msg']} (got {json.dumps(got)})") from None
    if draft.fc_norm and draft.norm_before_fc:  # speculators' Eagle3SpeculatorConfig refuses both, after minutes of setup
        raise ConfigError(f"{path}: fc_norm and norm_before_fc are both true: choose one norm before the fc projection "
                          f"(fc_norm: one per aux hidden state, the default; norm_before_fc: one over their "
                          f"concatenation)")
    return draft
