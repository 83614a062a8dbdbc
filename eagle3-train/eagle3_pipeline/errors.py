"""Typed errors. Scripts turn them into one line on stderr and a non-zero exit."""

from __future__ import annotations


class StageError(Exception):
    """A problem a person must fix (bad input, wrong flag). The message is one line."""

    exit_code = 1


class ConfigError(StageError):
    """Bad flags, profile or config file; exits 2 like argparse."""

    exit_code = 2


class ContractError(StageError):
    """An upstream stage's outputs are missing or do not match what this stage needs."""

    exit_code = 3


class InputError(StageError):
    """A bad input file or row; the message names the file and the row."""

    exit_code = 4


class PreflightError(StageError):
    """The run would not fit (disk, GPUs, memory, versions); refused before heavy work."""

    exit_code = 5


class Interrupted(StageError):
    """SIGTERM/Ctrl-C stopped the work after saving what it could; rerunning continues it."""

    exit_code = 130


class Stalled(StageError):
    """Stage 04: no training step or validation batch for --stall-minutes (compat/stall_watch.py ends the
    process with this code, its stacks in the log); rerunning resumes from the last checkpoint."""

    exit_code = 75  # sysexits.h EX_TEMPFAIL


class DraftRejected(StageError):
    """Stage 06: the draft's acceptance in vLLM is ~1 (verdict.py); the message is the verdict line."""

    exit_code = 6


class PathError(StageError):
    """A file-system operation on a path failed (permissions, a read-only mount, an immutable file, a file
    where a directory belongs, a name too long): one line naming the path and the operation."""

    exit_code = 74  # sysexits.h EX_IOERR

    @classmethod
    def of(cls, exc: OSError, operation: str, path=None) -> PathError:
        """`operation`: what was being done to the path, e.g. "creating the directory", "renaming it to X"."""
        return cls(f"{path or exc.filename}: {operation} failed ({exc.strerror or exc}); fix the path (permissions, "
                   f"mount, free space) or choose another one, then rerun")


# What a failed call was doing, by the innermost Python function it failed in (the C call's caller): for an
# OSError raised outside eagle3's own file helpers (a library's write, a checkpoint save, a copy).
_OPERATIONS = {
    "mkdir": "creating the directory", "makedirs": "creating the directory", "open": "opening", "touch": "creating",
    "write_text": "writing", "write_bytes": "writing", "save_file": "writing", "save": "writing",
    "copyfile": "copying", "copy": "copying", "copy2": "copying", "copytree": "copying", "move": "moving",
    "replace": "renaming", "rename": "renaming", "unlink": "deleting",
    "rmtree": "deleting", "rmdir": "deleting", "chmod": "changing the mode of",
}


def path_error_from(exc: BaseException) -> PathError | None:
    """An OSError that names a path (raised anywhere in a stage: eagle3's code or a library's) as a PathError
    naming the path and the operation; None for any other exception (a bug keeps its traceback)."""
    if not isinstance(exc, OSError) or exc.filename is None:
        return None
    tb, func = exc.__traceback__, None
    while tb is not None:
        func, tb = tb.tb_frame.f_code.co_name, tb.tb_next
    operation = _OPERATIONS.get(func or "", f"{func}()" if func else "accessing it")
    if func == "symlink_to":  # os.symlink(target, link): the link is the path written
        return PathError.of(exc, f"creating the link (to {exc.filename})", exc.filename2)
    if exc.filename2 is not None:
        operation += f" it to {exc.filename2}" if operation in ("renaming", "moving") else f" ({exc.filename2})"
    return PathError.of(exc, operation)
