"""Stage 05's logic: a self-contained speculators-format draft directory for vLLM.

speculators' checkpoint folder already is the format vLLM reads (`config.json` with
`speculators_model_type: eagle3`, a llama `transformer_layer_config`, `draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`, `speculators_config.verifier.name_or_path`; weights
with `d2t`/`t2d`). Export copies only what serving needs (not optimizer state), sets the
verifier name and the proposal's speculative token count, and checks the result.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from pathlib import Path

import numpy as np

from . import checkpoints, model_card, sglang_layout
from .contract import read_manifest, require_written_files
from .errors import ConfigError, ContractError, InputError, PathError
from .files import LockedError, hold_lock, sha256_file
from .stage import OutputBusy

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


def k_above_training(k: int, draft_config: dict) -> str | None:
    """A note when the draft is served at more tokens per step than the TTT steps it was trained to predict (its
    later positions never trained: their acceptance is low and each costs a draft forward); None when k fits."""
    ttt = int((draft_config or {}).get("ttt_steps") or 0)
    if ttt and k > ttt:
        return (f"served at k={k} draft tokens per step, above the {ttt} TTT steps it was trained with: positions "
                f"{ttt + 1}..{k} were never trained (low acceptance, a draft forward each); serve k <= {ttt}")
    return None


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


def verify_draft_dir(draft_dir: Path, d2t_expected: np.ndarray, aux_layer_ids: list[int], verifier_path: str) -> dict:
    """Load the export back with speculators and check what vLLM will rely on. speculators loads the verifier's
    embeddings, head and norm with it from the verifier the config names: here from the target stage 04 trained
    with (`verifier_path`), as the config may name a hub id (`--verifier-name`) this box cannot or should not fetch."""
    import speculators.models  # noqa: F401  (registers Eagle3DraftModel)
    from speculators.config import SpeculatorModelConfig
    from speculators.model import SpeculatorModel

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
    ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    if ids != list(aux_layer_ids):
        raise ContractError(f"{draft_dir}: eagle_aux_hidden_state_layer_ids {ids} != extracted {aux_layer_ids}")
    return {"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "draft_vocab_size": int(d2t.shape[0])}


def serve_command(target: str, draft_dir: Path, num_speculative_tokens: int, tensor_parallel_size: int,
                  multimodal_wrapper: bool) -> str:
    spec = json.dumps({"model": str(Path(draft_dir).resolve()), "method": "eagle3",
                       "num_speculative_tokens": num_speculative_tokens})
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
