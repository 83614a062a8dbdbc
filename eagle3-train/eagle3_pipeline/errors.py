"""Typed errors. Scripts turn them into one line on stderr and a non-zero exit."""


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


class DraftRejected(StageError):
    """Stage 06: the draft's acceptance in vLLM is ~1 (verdict.py); the message is the verdict line."""

    exit_code = 6
