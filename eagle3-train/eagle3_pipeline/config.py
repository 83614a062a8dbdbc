"""Stage configs as data: one pydantic model per stage, flags generated from its fields.

Precedence: field default < profile (`--profile NAME`, a JSON file under
`eagle3-train/profiles/` or a path) < explicit flag. Unknown keys in a profile are errors.
`--print-config` prints every resolved value with where it came from and exits 0: the run's paths
may be left out (shown as placeholders), fields the stage decides at run time show what they
become on this machine (`-> ...`), and values from a profile show its reason (`_why`).
Only `resolve_stage_config` touches argv; config errors exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from .compat.flex_forward_config import parse_setting as parse_flex_forward_config
from .contract import read_manifest
from .errors import ConfigError, ContractError, InputError
from .hidden_states import FILE_PATTERN, HS_DIRNAME
from .target import extraction_layer_ids, load_target_info

# Local imports: torch: imported only to tell --print-config whether CUDA is there (heavy; configs load without it).

PACKAGE_DIR = Path(__file__).resolve().parent
SCRIPTS_DIR = PACKAGE_DIR.parent
REPO_DIR = SCRIPTS_DIR.parent
PROFILES_DIR = SCRIPTS_DIR / "profiles"
DEFAULT_DRAFT_CONFIG = REPO_DIR / "draft_config.json"


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    STAGE: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    EXAMPLE: ClassVar[str] = ""


def _field(default: Any, help: str, flag: str | None = None, **extra: Any) -> Any:
    """A config field; `flag` overrides the generated --field-name (when the name would clash)."""
    return Field(default, description=help, json_schema_extra={"flag": flag} if flag else None, **extra)


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
    target: str = _field(..., "target model directory (its tokenizer + chat template are used)")
    tokenizer: Optional[str] = _field(None, "tokenizer directory if not the target's")
    data: str = _field(..., "conversations: a HF datasets name, a local .jsonl/.json/.parquet file or a "
                            "datasets.save_to_disk folder "
                            "(OpenAI messages, ShareGPT, or rows already tokenized for the target: "
                            "input_ids + loss_mask, as speculators regenerate-responses writes)")
    data_split: str = _field("train", "split to read when --data is a HF datasets name or a saved DatasetDict")
    data_subset: Optional[str] = _field(None, "HF datasets config/subset name")
    output: str = _field(..., "output directory (the prepared dataset; stage 02 adds hidden_states/ inside it)")
    max_samples: Optional[int] = _field(None, "use only the first N conversations (the 10-sample smoke)")
    max_seq_len: int = _field(2048, "longest row in tokens")
    on_too_long: Literal["drop", "truncate"] = _field(
        "drop", "rows longer than --max-seq-len: drop them (counted in the manifest) or truncate them")
    rows_per: Literal["turn", "conversation"] = _field(
        "turn", "'turn': one row per assistant turn, rendered exactly as the model sees it at inference "
        "(safe for thinking models whose template drops earlier reasoning); 'conversation': one row, "
        "every assistant turn trained (needs a prefix-stable template)")
    on_bad_row: Literal["fail", "skip"] = _field(
        "fail", "a row that cannot be trained exactly as given (malformed, or the chat template would drop "
        "part of an assistant turn): 'fail' stops with its file and row; 'skip' writes it with the reason to "
        "rejected.jsonl in --output, counts it, and fails only above --max-bad-fraction")
    max_bad_fraction: float = _field(0.01, "with --on-bad-row skip: fail if more than this fraction of rows are bad",
                                     ge=0, le=1)
    chat_template_kwargs: Optional[str] = _field(
        None, "JSON object passed to every chat-template rendering, as vLLM's chat_template_kwargs "
        "(e.g. '{\"thinking\": true}' for DeepSeek-V3.1, '{\"enable_thinking\": false}' for Qwen3); serve with the same")
    end_of_turn_tokens: list[str] = _field(
        [], "tokens an assistant turn ends on (default: generation_config.json's eos ids, what vLLM stops on); "
        "repeat the flag for several")
    val_ratio: float = _field(0.1, "fraction of conversations held out for validation (the last rows)", gt=0, lt=1)
    seed: int = _field(0, "shuffle seed for the train/val split")
    trust_remote_code: bool = _field(False, "allow the target's own tokenizer code (Kimi-K2.5 needs it)")
    overwrite: bool = _field(False, "replace a finished output made with other settings")
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate, render every input row "
                                "(local files and HF datasets) and list the first --report-problems bad ones; writes nothing")
    report_problems: int = _field(20, "how many bad rows --check lists (all are counted)", ge=1)


    @field_validator("chat_template_kwargs")
    @classmethod
    def _chat_template_kwargs_is_a_json_object(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(parsed, dict):
                raise ValueError("must be a JSON object, e.g. '{\"thinking\": true}'")
        return value

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
    target: str = _field(..., "target model directory")
    data: str = _field(..., "stage 01's output directory; hidden_states/ is written inside it")
    backend: Literal["vllm", "hf"] = _field("vllm", "'vllm' for real targets (tensor parallel), 'hf' for small targets and debugging")
    layer_ids: Optional[list[int]] = _field(None, "the 3 aux layer ids (default 2, L//2, L-3); the final layer L is always added")
    dtype: Literal["bfloat16", "float16", "float32"] = _field("bfloat16", "dtype of the saved hidden states (and of the HF backend's compute)")
    storage: Literal["dtype", "fp8"] = _field(
        "dtype", "how the states are saved: 'dtype' = in --dtype; 'fp8' = speculators' fp8 format (float8_e4m3fn "
        "values + one fp32 scale per token, about half of bf16's bytes; stage 04 reads it with speculators' fp8 backend)")
    device: str = _field("auto", "HF backend device: auto (cuda if present), cpu, cuda, cuda:N")
    max_samples: Optional[int] = _field(None, "extract only the first N rows")
    rows: Optional[str] = _field(None, "extract only these rows, START:END ranges (end exclusive, e.g. 0:1000,90000:100000): "
                                       "one slice of a sliced run (run_all.sh --slice-rows); first deletes this stage's "
                                       "files of the rows outside them (their manifest is kept in hidden_states/slices/)")
    world_size: int = _field(1, "number of extraction replicas/nodes sharing the rows", ge=1)
    rank: int = _field(0, "this replica's index in [0, world-size)", ge=0)
    retries: int = _field(2, "re-extract a row whose file fails validation this many times before giving up", ge=0)
    validate_only: bool = _field(False, flag="--validate", help="only validate existing files and list the rows to redo (a rerun redoes them)")
    validate_sample: int = _field(16, "after extraction, re-read this many landed files end to end (0 = none, -1 = all)")
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and the run plan (bytes per format, disk, reads, hours; eagle3_pipeline.plan) and exit")
    trust_remote_code: bool = _field(False, "allow the target's own code (Kimi-K2.5 needs it)")
    # vLLM backend
    tensor_parallel_size: int = _field(1, "vLLM tensor parallel size (8 for Kimi-K2.5 on one 8-GPU box)", ge=1)
    gpu_memory_utilization: float = _field(0.9, "vLLM GPU memory fraction", gt=0, le=1)
    kv_cache_memory_gib: Optional[float] = _field(
        None, "GPU: the KV cache's size in GiB instead of vLLM's memory profiling (which counts other "
        "processes' memory on a shared GPU as its own)", gt=0)
    max_model_len: Optional[int] = _field(None, "vLLM max model length (default: the prepared data's --max-seq-len + 1)")
    max_num_seqs: int = _field(64, "vLLM concurrent sequences (requests in flight)", ge=1)
    language_model_only: Optional[bool] = _field(None, "skip the vision tower of a multimodal wrapper (default: on for wrappers)")
    attention_backend: Optional[str] = _field(None, "vLLM attention backend (e.g. TRITON_MLA on SM120); default: vLLM's choice")
    kv_cache_dtype: str = _field("auto", "vLLM KV-cache dtype")
    enforce_eager: bool = _field(False, "disable CUDA graphs in vLLM")
    staging_dir: Optional[str] = _field(None, "where vLLM writes files before they are validated and moved (fast local disk; same filesystem as --data avoids a copy)")
    endpoint: Optional[str] = _field(None, "URL of a running vLLM server started with --print-server-cmd's flags; default: run vLLM in-process")
    print_server_cmd: bool = _field(False, "print the vLLM server command for this target and exit")
    server_port: int = _field(8000, "port used in --print-server-cmd")


class VocabConfig(StageConfig):
    STAGE: ClassVar[str] = "vocab"
    DESCRIPTION: ClassVar[str] = (
        "Stage 03: the draft vocabulary (d2t/t2d) from loss-masked token frequencies of the training rows, "
        "built with speculators' own functions, plus a coverage report."
    )
    EXAMPLE: ClassVar[str] = "python eagle3-train/03_build_vocab_mapping.py --data work/data --output work/vocab"
    data: str = _field(..., "stage 01's output directory (its token_freq.pt)")
    output: str = _field(..., "output directory for d2t.npy, t2d.npy, coverage.json")
    draft_config: str = _field(str(DEFAULT_DRAFT_CONFIG), "draft_config.json (its draft_vocab_size is the default)")
    draft_vocab_size: Optional[int] = _field(None, "draft vocabulary size (default: draft_config.json's, clipped to the target vocab)", gt=0)
    overwrite: bool = _field(False, "replace a mapping made with other settings or inputs (its own three files; "
                                    "never another stage's output)")
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and exit")


class TrainConfig(StageConfig):
    STAGE: ClassVar[str] = "train"
    DESCRIPTION: ClassVar[str] = (
        "Stage 04: train the EAGLE-3 draft with speculators' own trainer (flex_attention + fused loss on GPU; "
        "a CPU compatibility layer only when no accelerator exists). Resumes from the last checkpoint."
    )
    EXAMPLE: ClassVar[str] = (
        "python eagle3-train/04_train.py --profile rtx-pro-6000-8x --target /models/Kimi-K2.5 \\\n"
        "    --data work/data --vocab work/vocab --output work/checkpoints"
    )
    target: str = _field(..., "target (verifier) model directory")
    data: str = _field(..., "stage 01+02 output directory (stage 01's alone with --hidden-states online/hybrid)")
    vocab: str = _field(..., "stage 03 output directory")
    output: str = _field(..., "checkpoint directory (speculators' <epoch>/ folders, resumed automatically)")
    hidden_states: Literal["files", "online", "hybrid"] = _field(
        "files", "where the target's hidden states come from: 'files' = stage 02's DATA/hidden_states; 'online' = a "
        "running vLLM (--vllm-endpoint) computes each sample's states when the trainer needs them and they are deleted "
        "after use (no stage 02, no disk); 'hybrid' = online, and each sample's states are kept in "
        "OUTPUT/hidden_states_cache the first time, so later epochs and resumes read them from disk")
    vllm_endpoint: Optional[str] = _field(
        None, "online/hybrid: URL of the vLLM server serving the target with hidden-state extraction, started with "
        "`python -m eagle3_pipeline.serve_target` (e.g. http://box-a:8000); checked before training: served model, "
        "max-model-len, layer ids, and that this machine reads the files it writes")
    layer_ids: Optional[list[int]] = _field(
        None, "online/hybrid: the 3 aux layer ids the server extracts (default 2, L//2, L-3; the final layer L is "
        "added). Checked against the server's card when serve_target started it; required when the server has "
        "no card this machine can read")
    vllm_retries: int = _field(3, "online/hybrid: HTTP retries per vLLM request (exponential backoff 2, 4, 8 s; "
                                  "speculators --max-retries); a server that still does not answer stops training", ge=0)
    on_bad_sample: Literal["stop", "skip"] = _field(
        "stop", "a sample whose hidden states are unreadable, misshapen, stored in another dtype, non-finite, constant "
        "in a layer slot, or not its row's tokens (checked as the loader reads it): 'stop' = stop training with one "
        "line naming the file; 'skip' = leave it out, count it and list it in the manifest (bad_samples)")
    vllm_request_timeout: float = _field(120.0, "online/hybrid: seconds per vLLM request (speculators --request-timeout)", gt=0)
    draft_config: str = _field(str(DEFAULT_DRAFT_CONFIG), "draft architecture file")
    epochs: int = _field(10, "training epochs", ge=1)
    max_steps: Optional[int] = _field(None, "stop after this many optimizer steps")
    slice_rows: Optional[int] = _field(None, "sliced run (run_all.sh --slice-rows): the training rows are cut into slices "
                                             "of N rows, each extracted, trained on and deleted in turn "
                                             "(eagle3_pipeline/slices.py)", ge=1)
    slice_index: Optional[int] = _field(None, "sliced run: the run position trained now (epoch x slices + slice, "
                                              "0-based; stage 02 must hold its --rows)", ge=0)
    # Throughput defaults measured on an H200 at Kimi geometry (NOTES.md, "Training defaults and why"; figures in
    # bench/README.md, "Training throughput"). A run with under 1,000 optimizer steps packs 8K instead
    # (preflight.fit_seq_len_to_run): on the SmolLM2 testbed in vLLM 8K steps trained a better draft than 32K on
    # the same data, and lr 1e-3 beat 2e-3 and 4e-3 (bench/README.md, "Acceptance length in vLLM").
    total_seq_len: int = _field(32768, "tokens packed per step per GPU (16384 on 80 GB cards); unless given as a "
                                       "flag, 8192 when the run would have under 1,000 optimizer steps (preflight line)",
                                ge=16)
    lr: float = _field(1e-3, "learning rate")
    optimizer: Literal["muon", "adamw"] = _field("adamw", "optimizer (Muon's ~113 TFLOP per step is 41 percent of a Kimi-size step at 8K tokens)")
    ttt_steps: Optional[int] = _field(None, "test-time-training steps (default: draft_config.json's)", ge=1)
    attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = _field("auto", "draft attention; auto = flex_attention on GPU, sdpa on CPU")
    loss_impl: Literal["auto", "fused", "eager"] = _field("auto", "loss kernel; auto = fused (Triton) on GPU, eager on CPU")
    hidden_states_dtype: Literal["auto", "bfloat16", "float32"] = _field("auto", "training compute dtype for hidden states (speculators autocast); auto = bfloat16 on GPU, float32 on CPU")
    flex_forward_config: str = _field("auto", "flex_attention forward kernel options: auto = the config measured for this GPU kind (sm90: 64x128 tile, 4 warps, 3 stages; none measured elsewhere), off = PyTorch's default, or a JSON object of fwd_ options found with bench/flex_attention_configs.py")
    num_workers: int = _field(8, "dataloader workers per GPU", ge=0)
    prefetch_factor: int = _field(2, "dataloader prefetch per worker (each batch holds total_seq_len x 57 KB of hidden states for Kimi)", ge=1)
    nproc: int = _field(1, "GPUs (torchrun processes) on this node", ge=1)
    nnodes: int = _field(1, "nodes (torchrun --nnodes)", ge=1)
    node_rank: int = _field(0, "this node's rank (torchrun --node-rank); node 0 holds global rank 0, which writes checkpoints and metrics", ge=0)
    rdzv_endpoint: Optional[str] = _field(None, "multi-node: node 0's HOST:PORT, the same on every node (torchrun --master-addr/--master-port; deepspeed --master_addr/--master_port)")
    launcher: Literal["torchrun", "deepspeed"] = _field("torchrun", "multi-process launcher: torchrun (run on every node) or deepspeed (run once; starts the --hostfile hosts over SSH)")
    hostfile: Optional[str] = _field(None, "deepspeed hostfile, lines 'HOST slots=GPUS' (with --launcher deepspeed)")
    fsdp: bool = _field(False, "shard the draft with FSDP2 instead of DDP (multi-GPU)")
    checkpoint_freq: float = _field(1.0, "save every N epochs (<1 for sub-epoch checkpoints)", gt=0)
    log_freq: int = _field(10, "log metrics every N steps (a logged step synchronises the GPU at every phase)", ge=1)
    logger: str = _field("tensorboard", "speculators metric loggers: tensorboard, wandb, trackio, mlflow or '' for none")
    seed: int = _field(0, "training seed")
    trust_remote_code: bool = _field(False, "allow the target's own code when reading its config/tokenizer")
    dry_run: bool = _field(False, "write an initialised draft and exit (speculators --dry-run)")
    extra_args: list[str] = _field([], "further speculators train flags, passed through verbatim (e.g. --extra-args=--muon-lr --extra-args=0.02)")
    overwrite: bool = _field(False, "train anew over a run made with other settings or inputs: deletes only what "
                                    "stage 04 and speculators wrote there (never another stage's output or your files)")
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and the run plan (bytes per format, disk, reads, hours; eagle3_pipeline.plan) and exit")

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
    checkpoints: str = _field(..., "stage 04 output directory")
    output: str = _field(..., "draft directory to write")
    checkpoint: str = _field("best", "which checkpoint: best, latest, or an epoch folder name")
    vocab: Optional[str] = _field(None, "stage 03's output the training used (default: the path stage 04 recorded; "
                                        "needed after moving the work directory); checked by content")
    verifier_name: Optional[str] = _field(None, "verifier path/name written into the draft config (default: the target path used in training)")
    num_speculative_tokens: Optional[int] = _field(None, "draft tokens per step in the printed command (default: draft_config.json's)", ge=1)
    tensor_parallel_size: int = _field(8, "tensor parallel size in the printed vLLM command", ge=1)
    overwrite: bool = _field(False, "replace an export made with other settings or from another checkpoint (never a "
                                    "directory that is not an export)")
    check: bool = _field(False, "preflight only: print the disk/GPU/version estimate and exit")


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    cls.STAGE: cls for cls in (PrepareConfig, ExtractConfig, VocabConfig, TrainConfig, ExportConfig)
}


# --- profiles -----------------------------------------------------------------------------

def profile_path(name: str) -> Path:
    candidate = Path(name)
    if candidate.suffix == ".json" and candidate.is_file():
        return candidate
    path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ConfigError(f"--profile {name}: no such profile (known: {', '.join(known) or 'none'})")
    return path


def load_profile(name: str) -> dict[str, dict[str, Any]]:
    """A profile is {"description": ..., "<stage>": {field: value}}; unknown stages/fields are errors."""
    path = profile_path(name)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: (top level) must be a JSON object of sections ({', '.join(STAGE_CONFIGS)}), "
                          f"found a {type(data).__name__}")
    sections = {}
    for key, values in data.items():
        if key.startswith("_") or key == "description":
            continue
        if key not in STAGE_CONFIGS:
            raise ConfigError(f"{path}: unknown section {key!r} (stages: {', '.join(STAGE_CONFIGS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: {key} must be an object of {key} settings ({{\"field\": value}}), "
                              f"found {json.dumps(values)[:40]}")
        unknown = set(values) - set(STAGE_CONFIGS[key].model_fields)
        if unknown:
            raise ConfigError(f"{path}: section {key!r} has unknown keys {sorted(unknown)}")
        for field, value in values.items():  # every section typed, whichever stage reads the profile now
            _check_profile_value(path, key, STAGE_CONFIGS[key], field, value)
        sections[key] = values
    return sections


def _check_profile_value(path: Path, section: str, cls: type[StageConfig], field: str, value: Any) -> None:
    info = cls.model_fields[field]
    try:
        TypeAdapter(info.annotation).validate_python(value, strict=not isinstance(value, (int, float, str)))
    except ValidationError as exc:
        reason = exc.errors()[0].get("msg", "invalid")
        raise ConfigError(f"{path}: {section}.{field} = {json.dumps(value)[:40]}: {reason} (stage {section}'s "
                          f"{_flag(field, cls)} (profile: {path}))") from None


# --- argv -> config -----------------------------------------------------------------------

def _flag(name: str, cls: type[StageConfig] | None = None) -> str:
    extra = cls.model_fields[name].json_schema_extra if cls and name in cls.model_fields else None
    if isinstance(extra, dict) and extra.get("flag"):
        return extra["flag"]
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def build_parser(cls: type[StageConfig]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=cls.DESCRIPTION,
        epilog=f"example:\n  {cls.EXAMPLE}\n\nprecedence: default < --profile < flag; --print-config shows each value's source",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags actually given override the profile
    )
    parser.add_argument("--profile", help="machine profile: a name under eagle3-train/profiles/ or a .json path")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config with sources and exit")
    for name, info in cls.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        required = info.is_required()
        help_text = (info.description or "") + ("" if required else f" (default: {info.default!r})")
        kwargs: dict[str, Any] = {"help": help_text, "dest": name}
        origin = typing.get_origin(annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is list:
            item_type = typing.get_args(annotation)[0]
            kwargs.update(nargs="*", type=item_type) if item_type is int else kwargs.update(action="append")
        elif origin is Literal:
            kwargs.update(choices=list(typing.get_args(annotation)))
        else:
            kwargs["type"] = annotation if annotation in (int, float) else str
        if required:
            kwargs["help"] += " [required]"
        parser.add_argument(_flag(name, cls), **kwargs)
    return parser


def resolve_stage_config(cls: type[StageConfig], argv: list[str] | None = None, run_time_notes=None):
    """Parse argv for one stage; returns (config, sources). Exits 0 after --print-config.

    `run_time_notes(cfg) -> {field: text}`: what --print-config adds for fields the stage decides at run
    time, from the stage's own module (04: training.resolved_for_print_config; config imports no stage logic)."""
    return resolve_parsed(cls, vars(build_parser(cls).parse_args(argv)), run_time_notes)


def resolve_parsed(cls: type[StageConfig], args: dict, run_time_notes=None):
    """`resolve_stage_config` after parsing (a caller with flags of its own pops them first)."""
    profile_name = args.pop("profile", None)
    print_config = args.pop("print_config", False)
    try:
        # --print-config shows a profile without the run's paths: missing ones print as placeholders.
        cfg, sources = build_config(cls, args, profile_name, placeholders=print_config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if print_config:
        print(format_config(cfg, sources, profile_name, resolved_at_run_time(cfg, run_time_notes)))
        raise SystemExit(0)
    return cfg, sources


def build_config(cls: type[StageConfig], flags: dict[str, Any], profile_name: str | None = None,
                 placeholders: bool = False):
    """Layer default < profile < flags and validate; the argv-free seam tests use.

    `placeholders` (for --print-config only): a missing required flag becomes "<--flag>"
    instead of an error. `sources`: each field's source, plus "profile" -> the --profile given (the
    run plan reads another stage's section of it).
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if profile_name:
        for key, value in load_profile(profile_name).get(cls.STAGE, {}).items():
            values[key] = value
            sources[key] = f"profile:{profile_name}"
        sources["profile"] = profile_name
    for key, value in flags.items():
        values[key] = value
        sources[key] = "flag"
    missing = [name for name, info in cls.model_fields.items() if info.is_required() and name not in values]
    if missing and placeholders:
        for name in missing:
            values[name], sources[name] = f"<{_flag(name, cls)}>", "required, not given"
        missing = []
    if missing:
        raise ConfigError(f"missing required {', '.join(_flag(m, cls) for m in missing)}")
    try:
        cfg = cls(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = first["loc"][0] if first["loc"] else "?"
        where = sources.get(str(field), "default")
        raise ConfigError(f"{_flag(str(field), cls)} ({where}): {first['msg']}") from None
    for name in cls.model_fields:
        sources.setdefault(name, "default")
    return cfg, sources


def format_config(cfg: StageConfig, sources: dict[str, str], profile_name: str | None = None,
                  resolved: dict[str, str] | None = None) -> str:
    """`name = value  # source` per field; `-> what it becomes` where the stage decides a value at run
    time (`resolved`); the profile's description and its reason (`_why`) under each value it sets."""
    lines = [f"# {cfg.STAGE} config (value  # source; -> what the stage resolves it to on this machine)"]
    reasons: dict[str, str] = {}
    if profile_name:
        profile = json.loads(profile_path(profile_name).read_text())
        if profile.get("description"):
            lines.append(f"# profile {profile_name}: {profile['description']}")
        prefix = f"{cfg.STAGE}."
        reasons = {key.removeprefix(prefix): why for key, why in profile.get("_why", {}).items() if key.startswith(prefix)}
    resolved = resolved or {}
    for name in type(cfg).model_fields:
        line = f"{name} = {json.dumps(getattr(cfg, name))}  # {sources.get(name, 'default')}"
        if name in resolved:
            line += f" -> {resolved[name]}"
        lines.append(line)
        if name in reasons and sources.get(name, "").startswith("profile:"):
            lines.append(f"#   why: {reasons[name]}")
    return "\n".join(lines)


def resolved_at_run_time(cfg: StageConfig, run_time_notes=None) -> dict[str, str]:
    """For --print-config: what the `auto`/unset fields become in a run on this machine, where that is
    cheap to know without the run's inputs (train: what speculators receives, from `run_time_notes`;
    vocab/export: draft defaults)."""
    if run_time_notes is not None:
        return run_time_notes(cfg)
    if isinstance(cfg, ExtractConfig):
        return _extract_resolved(cfg)
    if isinstance(cfg, VocabConfig) and cfg.draft_vocab_size is None:
        try:
            value = load_draft_config(cfg.draft_config)["draft_vocab_size"]
        except ConfigError as exc:
            return {"draft_vocab_size": f"? ({exc})"}
        return {"draft_vocab_size": f"{value} ({cfg.draft_config}; clipped to the target's vocabulary size)"}
    if isinstance(cfg, ExportConfig) and cfg.num_speculative_tokens is None:
        try:
            trained = read_manifest(cfg.checkpoints, "train", "--checkpoints")
        except (ContractError, OSError):
            return {"num_speculative_tokens": "the draft config's, as stage 04 recorded it in --checkpoints"}
        value = (trained.draft_config or {}).get("num_speculative_tokens", 3)
        return {"num_speculative_tokens": f"{value} (the draft config stage 04 recorded in {cfg.checkpoints})"}
    return {}


class DraftConfig(BaseModel):
    """draft_config.json: the draft architecture, typed, with every default in this one place.

    Keys starting with `_` are comments. Unknown keys and bad values (a negative layer count,
    `ttt_steps: 0`, a string where a number goes) are refused with the key named; numbers are
    strict (`"2"` is not 2), so a typo never becomes a silently different draft.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    description: str = ""
    draft_arch: Literal["llama", "qwen3"] = Field("llama", description="speculators --draft-arch")
    num_layers: int = Field(1, ge=1, description="decoder layers in the draft")
    hidden_size: Optional[int] = Field(None, gt=0, description="null = the target's; a number must equal it")
    target_vocab_size: Optional[int] = Field(None, gt=0, description="null = the target's; a number must equal it")
    draft_vocab_size: int = Field(32000, gt=0, description="stage 03's default draft vocabulary size")
    ttt_steps: int = Field(3, ge=1, description="test-time-training steps")
    sliding_window: int = Field(2048, ge=1, description="draft attention window (tokens)")
    full_attention_indices: list[int] = Field([], description="draft layers with full attention")
    norm_before_residual: bool = True
    num_speculative_tokens: int = Field(3, ge=1, description="draft tokens per step in the serve command")

    @field_validator("full_attention_indices")
    @classmethod
    def _indices_are_layers(cls, value: list[int], info) -> list[int]:
        layers = info.data.get("num_layers", 1)
        bad = [i for i in value if not 0 <= i < layers]
        if bad:
            raise ValueError(f"{bad} are not layer indices of a {layers}-layer draft")
        return value


def _extract_resolved(cfg: ExtractConfig) -> dict[str, str]:
    notes: dict[str, str] = {}
    try:
        target = load_target_info(cfg.target)
        notes["layer_ids"] = (f"{extraction_layer_ids(target.num_layers, cfg.layer_ids)} saved "
                              f"(the aux layers + the final layer {target.num_layers} of {cfg.target})")
    except InputError as exc:
        given = "" if cfg.target.startswith("<") else f": {exc}"
        notes["layer_ids"] = f"the aux layers (default 2, L//2, L-3 of the target's L) + L (no target config{given})"
    if cfg.backend == "hf" and cfg.device == "auto":
        import torch

        notes["device"] = '"cuda"' if torch.cuda.is_available() else '"cpu" (no CUDA device)'
    return notes


def load_draft_config(path: str | Path) -> dict:
    """The validated draft config as a dict (every key present, defaults filled in)."""
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
    try:
        return DraftConfig(**data).model_dump()
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "?"
        got = data.get(str(first["loc"][0]), "?") if first["loc"] else "?"
        raise ConfigError(f"{path}: {key}: {first['msg']} (got {json.dumps(got)})") from None
