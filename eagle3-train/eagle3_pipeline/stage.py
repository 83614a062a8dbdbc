"""What every stage script shares: the error boundary, the one rule for "done", and the output lock.

The rule for "done" (`finished`), the same for all five stages and for run_all.sh (which just runs
each stage): an output directory is finished when its manifest is complete AND its identity equals
the identity this invocation would produce. An identity (`stage_identity`) is
- the inputs' content identity: each upstream output's `content_sha256` (what it was made from and
  what it holds, see contract.py), the target's config and tokenizer hashes, a data file's sha256;
  never a path, a manifest's bytes, a timestamp or a package version;
- the settings that change the outputs: every config field declared `identity=True` (config/schema.py;
  not paths, whose content is already in the inputs, nor flags that change how, not what: validation
  sampling, batching, device, worker counts, logging, kernels), plus values resolved from other
  files (layer ids, the draft config, the draft vocab size).
A directory whose identity differs is refused with the first differing field and both values; with
`--overwrite` (03-05) the stage replaces only what it wrote itself. A directory holding another
stage's output is refused even with `--overwrite`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .contract import manifest_path
from .errors import ConfigError, ContractError, StageError, path_error_from
from .files import (
    LOCK_NAME,
    LockedError,
    changed_outputs,
    hold_lock,
    release_locks,
    remove_path,
    safetensors_problem,
    sha256_file,
    sha256_json,
)
from .manifest import STAGES, Manifest, parse_manifest

log = logging.getLogger("eagle3")

class OutputBusy(StageError):
    """Another live process writes this output directory; exit code 75 (EX_TEMPFAIL), as run_all.sh's lock."""

    exit_code = 75


def stage_main(func: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Run a stage; StageErrors become one line on stderr and the error's exit code. So does an OSError on a
    path (writing, renaming, creating or deleting an output; reading an input), wherever it was raised:
    files.py's helpers name the operation themselves, `path_error_from` names the rest's."""

    @functools.wraps(func)
    def wrapper(argv: list[str] | None = None) -> int:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
        try:
            return func(argv) or 0
        except StageError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        except OSError as exc:
            error = path_error_from(exc)
            if error is None:
                raise
            print(f"error: {error}", file=sys.stderr)
            return error.exit_code
        except KeyboardInterrupt:
            print("interrupted: finished files are kept; rerun the same command to continue", file=sys.stderr)
            return 130
        finally:
            release_locks()  # the OS releases them too when the process dies

    return wrapper


# --- identity ---------------------------------------------------------------------------------------

def stage_identity(cfg, inputs: dict[str, Any], **resolved: Any) -> dict:
    """{"inputs": content ids, "settings": the output-changing settings} of one invocation."""
    return {"inputs": dict(inputs), "settings": {**cfg.identity_settings(), **resolved}}


def data_identity(data: str) -> str:
    """A local data file by content (any path to it, moved or not, is the same input); else its name."""
    path = Path(data)
    if path.is_file():
        return "sha256:" + sha256_file(path)
    if path.is_dir():
        return "files:" + sha256_json({p.relative_to(path).as_posix(): sha256_file(p)
                                       for p in sorted(path.rglob("*")) if p.is_file()})
    return "name:" + data


def first_difference(old: Any, new: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first (sorted) dotted field where two identities differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            found = first_difference(old.get(key, "<absent>"), new.get(key, "<absent>"), f"{prefix}{key}.")
            if found:
                return found
        return None
    if old != new:
        return prefix.rstrip("."), old, new
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def describe_difference(diff: tuple[str, Any, Any]) -> str:
    field, old, new = diff
    return f"{field} = {_short(old)} there, {_short(new)} in this run"


# --- the rule for "done" ------------------------------------------------------------------------------

def lock_output(out_dir: Path, lock_file: Path | None = None, exclusive: bool = True) -> None:
    """One writer per output directory, held until the stage ends (or dies: the OS releases flock)."""
    lock_file = Path(lock_file) if lock_file else Path(out_dir) / LOCK_NAME
    try:
        hold_lock(lock_file, exclusive)
    except LockedError:
        raise OutputBusy(f"{out_dir}: another process is writing it now (it holds {lock_file}); wait for it to end, "
                         f"or stop it, then rerun") from None


def read_own_manifest(out_dir: Path) -> Manifest | None:
    """This stage's manifest in out_dir (None: none yet), finished or not; a bad one is one line, not a traceback."""
    path = manifest_path(out_dir)
    if not path.is_file():
        return None
    # Not "move the manifest away": 01 and 04 then refuse the files it described as not theirs (refuse_unowned).
    return parse_manifest(path, hint=f"without it nothing says what {out_dir} holds: move {out_dir} away, then rerun "
                                     f"to make it anew")


def finished(out_dir: Path, stage: str, identity: dict, overwrite: bool = False, check: bool = False,
             lock_file: Path | None = None, input_change_redoes: bool = False, extra_done: bool = True,
             remedy: str = "rerun with the old value, choose another --output, or pass --overwrite to replace it",
             outputs: Sequence[str] = (), damaged: Callable[[dict[str, str]], None] | None = None) -> bool:
    """True when out_dir already holds exactly what this invocation would write (the stage is a no-op).

    Takes the output's exclusive lock first (not with --check, which writes nothing). Returns False
    when the stage must (re)do work: nothing there yet, an unfinished run of this identity (resume),
    or --overwrite over another identity. Refuses another stage's output, and another identity
    without --overwrite, naming the field that differs. `input_change_redoes`: when only the
    inputs differ the stage re-checks its existing files itself (02 keeps the rows whose token ids
    still match). `extra_done`: a stage-specific completeness condition (02: every row's file present).
    `remedy`: the end of the refusal (02 has no --overwrite). `outputs`: the files (names in out_dir) the stage
    wrote; a finished run with one of them gone is redone, never reported done. So is one whose files differ from the
    sizes and digests its manifest recorded (`output_files`, contract.write_manifest's `outputs`; a manifest written
    before that records none: its files are checked by presence, a safetensors file by its header's size).
    `damaged`: a stage that cannot redo its own files within a finished run (04: a resume has nothing left to train)
    refuses instead: called with the changed files ({name: how}), it raises the stage's one line.
    """
    if not check:
        lock_output(out_dir, lock_file)
    path = manifest_path(out_dir)
    manifest = read_own_manifest(out_dir)
    if manifest is None:
        return False
    if manifest.stage != stage:
        raise ConfigError(f"{path}: {out_dir} holds stage {manifest.stage!r}'s output ({STAGES[manifest.stage]}); "
                          f"choose another --output (--overwrite never replaces another stage's output)")
    recorded = manifest.identity
    if recorded is None:  # bench/benchlib/throughput.py's synthetic manifests: never a stage's own output
        raise ContractError(f"{path}: records no identity (not written by {STAGES[stage]}); {remedy}")
    diff = first_difference(recorded, identity)
    if diff is None:
        if not manifest.complete:
            return False
        changed = {name: "missing" for name in outputs if not (out_dir / name).exists()}
        changed.update(changed_outputs(out_dir, manifest.output_files))  # by the bytes written, not by existence
        if manifest.output_files is None:  # a manifest from before the record: no sizes to compare, but a safetensors
            # file's header gives its own size, so one cut short still shows
            changed.update({name: problem for name in outputs if str(name).endswith(".safetensors")
                            and (out_dir / name).is_file() and (problem := safetensors_problem(out_dir / name))})
        if changed and damaged is not None:
            damaged(changed)
        if changed:
            log.info("%s: %s (this stage wrote %s); redoing it", out_dir,
                     "; ".join(f"{name} {how}" for name, how in changed.items()), "it" if len(changed) == 1 else "them")
        return extra_done and not changed
    if input_change_redoes and diff[0].startswith("inputs") and \
            first_difference(recorded["settings"], identity["settings"]) is None:
        log.info("%s: an input changed since (%s); re-checking every existing file", out_dir, describe_difference(diff))
        return False
    if overwrite:
        log.info("%s: --overwrite: replacing this stage's outputs made with %s", out_dir, describe_difference(diff))
        return False
    what = "a finished result" if manifest.complete else "an unfinished run"
    raise ContractError(f"{path}: {out_dir} holds {what} made with {describe_difference(diff)}; {remedy}")


def refuse_unowned(out_dir: Path, stage: str) -> None:
    """No manifest in out_dir, yet something is there (a user's own dataset, a work directory): none of it is
    this stage's to replace. Hidden names (locks, temps) do not count. Call it before `finished`, which
    takes the lock (and so would leave a lock file in a folder that is not the stage's)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or manifest_path(out_dir).exists():  # a manifest: `finished` says whose it is
        return
    there = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir() if not p.name.startswith("."))
    if there:
        shown = ", ".join(there[:6]) + (f" and {len(there) - 6} more" if len(there) > 6 else "")
        raise ContractError(f"{out_dir}: holds files {STAGES[stage]} did not write ({shown}) and no manifest of it; "
                            f"choose an empty or new --output (nothing was deleted)")


@contextlib.contextmanager
def no_empty_output_left(out_dir: Path):
    """A run into an --output that did not exist, failing or refused before its first file (a bad input, too many bad
    rows, a refused identity): the folders it made hold only its lock file, and are removed (issue 64: a failed 01 left
    `.eagle3.lock` in an empty --output). Anything else there (an unfinished manifest: a rerun continues) is kept.
    Deleting a lock file this process holds: its folder is going, and a run started into it meanwhile was refused at
    the lock (taken without waiting), never left holding it."""
    out_dir = Path(out_dir)
    first_made = out_dir if not out_dir.exists() else None
    while first_made is not None and not first_made.parent.exists():
        first_made = first_made.parent
    try:
        yield
    except BaseException:
        if first_made is not None:
            with contextlib.suppress(OSError):
                entries = list(out_dir.iterdir())
                if all(p.name == LOCK_NAME and p.is_file() for p in entries):
                    for p in entries:
                        p.unlink()
                    folder = out_dir
                    while True:  # the folders this run made, inner first, while empty
                        folder.rmdir()
                        if folder == first_made:
                            break
                        folder = folder.parent
        raise


def retire_manifest(out_dir: Path) -> None:
    """Call right before a stage's first output write: from here on out_dir is unfinished."""
    remove_path(manifest_path(out_dir))


def config_fingerprint(cfg, ignore: tuple[str, ...] = ()) -> str:
    """Hash of the whole config (recorded for people; `finished` decides by identity, not by this)."""
    skip = {"overwrite", "check", "print_server_cmd", "validate_only"} | set(ignore)
    return sha256_json({k: v for k, v in cfg.model_dump().items() if k not in skip})
