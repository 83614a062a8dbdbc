"""What every stage script shares: the error boundary and the "already done?" check."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Callable

from .contract import manifest_path
from .errors import ConfigError, StageError
from .files import sha256_json

log = logging.getLogger("eagle3")


def stage_main(func: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Run a stage; StageErrors become one line on stderr and the error's exit code."""

    @functools.wraps(func)
    def wrapper(argv: list[str] | None = None) -> int:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
        try:
            return func(argv) or 0
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("interrupted: finished files are kept; rerun the same command to continue", file=sys.stderr)
            return 130

    return wrapper


def config_fingerprint(cfg, ignore: tuple[str, ...] = ()) -> str:
    """Hash of the settings that shape a stage's outputs (not flags like --overwrite)."""
    skip = {"overwrite", "check", "print_server_cmd", "validate_only"} | set(ignore)
    return sha256_json({k: v for k, v in cfg.model_dump().items() if k not in skip})


def finished_with_same_inputs(out_dir: Path, fingerprint: str, inputs: dict, overwrite: bool) -> bool:
    """True if out_dir already holds this exact result (skip the stage).

    A finished output made from other settings or inputs is refused unless --overwrite:
    the user may be pointing at the wrong directory, and the old result may be hours of work.
    """
    import json

    path = manifest_path(out_dir)
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    same = manifest.get("config_sha256") == fingerprint and manifest.get("inputs") == inputs
    if same and manifest.get("complete"):
        return True
    if not overwrite:
        raise ConfigError(
            f"{path}: {out_dir} holds a finished result made with other settings or inputs; "
            f"choose another --output or pass --overwrite"
        )
    # --overwrite: the old result stays valid (manifest included) until the new one is ready to
    # be written; the stage calls retire_manifest() right before its first output write, so bad
    # input found while reading never costs the user the old result.
    return False


def retire_manifest(out_dir: Path) -> None:
    """Call right before a stage's first output write: from here on out_dir is unfinished."""
    manifest_path(out_dir).unlink(missing_ok=True)
