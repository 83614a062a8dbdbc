"""The speculators-version gate the fixes share: each was read from one speculators release.

A fix that patches speculators' private names calls `require_speculators` before it patches (another
version raises one line naming the fix and what to re-read); one that only adds something asks
`speculators_supported` and stays off elsewhere. Its own module, so the fixes import it without
importing the package's `apply`, which imports them.
"""

from __future__ import annotations

from importlib import metadata


def speculators_supported(supported: tuple[str, ...]) -> bool:
    """Is the installed speculators one of the versions a fix was read from?"""
    return metadata.version("speculators") in supported


def require_speculators(module_name: str, supported: tuple[str, ...], what_to_recheck: str) -> None:
    """Raise `compat/<module_name>.py was written for speculators (...), found X; re-check it against ...`."""
    version = metadata.version("speculators")
    if version not in supported:
        raise RuntimeError(f"compat/{module_name}.py was written for speculators {supported}, found {version}; "
                           f"re-check it against {what_to_recheck}")
