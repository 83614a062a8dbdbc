"""speculators' metric dicts also go to stage 04's `metrics.jsonl`: one runtime change.

Why a patch: speculators configures the `speculators.metrics` logger with
`logging.config.dictConfig` inside `speculators.train.cli.setup_metric_logger`, which replaces
the logger's handlers, so a handler attached before `cli.main` runs is dropped. `install` wraps
that name so the handler is attached right after speculators' own setup. Nothing the trainer
computes changes; its loggers (tensorboard, ...) still get every record.

Gate: always applied in a training process (the report, the plots and the manifest read
metrics.jsonl); if speculators no longer has `setup_metric_logger` this raises, naming this
file, rather than train without metrics.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..metrics import MetricsJsonlHandler

METRICS_LOGGER = "speculators.metrics"


def install(handler: logging.Handler) -> None:
    """Attach `handler` to speculators' metric logger once speculators has configured it.

    A second call replaces the first handler (it wraps speculators' original function again).
    """
    import speculators.train.cli as cli

    current = getattr(cli, "setup_metric_logger", None)
    if current is None:
        raise RuntimeError("speculators.train.cli has no setup_metric_logger; "
                           "re-check eagle3_pipeline/compat/metrics_jsonl.py against this speculators")
    original = getattr(current, "wrapped", current)

    def setup_then_attach(*args, **kwargs):
        result = original(*args, **kwargs)
        logging.getLogger(METRICS_LOGGER).addHandler(handler)
        return result

    setup_then_attach.wrapped = original
    cli.setup_metric_logger = setup_then_attach


def apply(metrics_path: str | Path) -> bool:
    """The compat-layer interface: stage 04's file, written by global rank 0 only."""
    install(MetricsJsonlHandler(metrics_path, rank_zero_only=True))
    return True
