"""Config as data: the stage configs and the draft config (schema.py), resolved from default < profile <
flag (resolution.py), shown by `--print-config` (printing.py). Exported here: what the scripts, tests and
bench import."""

from .resolution import build_config, build_parser, load_profile, profile_path, resolve_stage_config
from .schema import (
    DEFAULT_DRAFT_CONFIG,
    PROFILES_DIR,
    SCRIPTS_DIR,
    STAGE_CONFIGS,
    DraftConfig,
    EvaluateConfig,
    ExportConfig,
    ExtractConfig,
    PrepareConfig,
    TrainConfig,
    VocabConfig,
    load_draft_config,
)

__all__ = [
    "DEFAULT_DRAFT_CONFIG", "PROFILES_DIR", "SCRIPTS_DIR", "STAGE_CONFIGS", "DraftConfig", "EvaluateConfig",
    "ExportConfig", "ExtractConfig",
    "PrepareConfig", "TrainConfig", "VocabConfig", "build_config", "build_parser", "load_draft_config", "load_profile",
    "profile_path", "resolve_stage_config",
]
