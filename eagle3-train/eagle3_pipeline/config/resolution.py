"""Resolution: field default < profile (`--profile NAME`, a JSON file under `eagle3-train/profiles/` or a
path) < explicit flag, into a validated stage config and where each value came from (`Sources`).

Unknown keys in a profile are errors. `--print-config` prints every resolved value with where it came
from and exits 0 (printing.py): the run's paths may be left out (shown as placeholders), fields the stage
decides at run time show what they become on this machine (`-> ...`), and values from a profile show its
reason (`_why`). Only `resolve_stage_config` touches argv; config errors exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from ..errors import ConfigError
from .printing import RunTimeNotes, format_config, resolved_at_run_time
from .schema import PROFILES_DIR, STAGE_CONFIGS, StageConfig, flag_name


class Sources(dict):
    """Where each field's value came from: "default", "profile:NAME", "flag" or (--print-config only)
    "required, not given"; and "profile" -> the --profile given (the run plan reads another stage's
    section of it). Logic asks `given` / `stated`; the strings are for people."""

    @property
    def profile(self) -> str | None:
        return self.get("profile")

    def given(self, name: str) -> bool:
        """Was `name` given explicitly, as a flag on this command line?"""
        return self.get(name) == "flag"

    def stated(self, name: str) -> bool:
        """Was `name` set at all, by a flag or the profile (not left at its default)?"""
        return self.get(name, "default") not in ("default", "required, not given")


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
        # strict: a profile is JSON, typed as written; "lr": "1e-3" or true is a mistake, never coerced (an int
        # for a float is the one conversion strict mode makes)
        TypeAdapter(info.annotation).validate_python(value, strict=True)
    except ValidationError as exc:
        reason = exc.errors()[0].get("msg", "invalid")
        raise ConfigError(f"{path}: {section}.{field} = {json.dumps(value)[:40]}: {reason} (stage {section}'s "
                          f"{flag_name(field, cls)} (profile: {path}))") from None


# --- argv -> config -----------------------------------------------------------------------

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
        parser.add_argument(flag_name(name, cls), **kwargs)
    return parser


def resolve_stage_config(cls: type[StageConfig], argv: list[str] | None = None,
                         run_time_notes: RunTimeNotes | None = None) -> tuple[StageConfig, Sources]:
    """Parse argv for one stage; returns (config, sources). Exits 0 after --print-config.

    `run_time_notes(cfg, sources) -> {field: text}`: what --print-config adds for fields the stage decides at run
    time, from the stage's own module (04: training.resolved_for_print_config; config imports no stage logic)."""
    return resolve_parsed(cls, vars(build_parser(cls).parse_args(argv)), run_time_notes)


def resolve_parsed(cls: type[StageConfig], args: dict,
                   run_time_notes: RunTimeNotes | None = None) -> tuple[StageConfig, Sources]:
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
        profile = json.loads(profile_path(profile_name).read_text()) if profile_name else None
        print(format_config(cfg, sources, profile_name, profile, resolved_at_run_time(cfg, run_time_notes, sources)))
        raise SystemExit(0)
    return cfg, sources


def build_config(cls: type[StageConfig], flags: dict[str, Any], profile_name: str | None = None,
                 placeholders: bool = False) -> tuple[StageConfig, Sources]:
    """Layer default < profile < flags and validate; the argv-free seam tests use.

    `placeholders` (for --print-config only): a missing required flag becomes "<--flag>"
    instead of an error. `sources`: each field's source, plus "profile" -> the --profile given (the
    run plan reads another stage's section of it).
    """
    values: dict[str, Any] = {}
    sources = Sources()
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
            values[name], sources[name] = f"<{flag_name(name, cls)}>", "required, not given"
        missing = []
    if missing:
        raise ConfigError(f"missing required {', '.join(flag_name(m, cls) for m in missing)}")
    try:
        cfg = cls(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = first["loc"][0] if first["loc"] else "?"
        where = sources.get(str(field), "default")
        message = first["msg"].removeprefix("Value error, ")
        got = first.get("input")
        if isinstance(got, (int, float)) and not isinstance(got, bool) and "(got " not in message:
            message += f" (got {got})"  # inf, nan, -1: the value itself
        raise ConfigError(f"{flag_name(str(field), cls)} ({where}): {message}") from None
    for name in cls.model_fields:
        sources.setdefault(name, "default")
    return cfg, sources
