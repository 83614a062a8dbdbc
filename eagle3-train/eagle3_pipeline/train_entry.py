"""Entry point each torchrun/DeepSpeed worker runs: `python -m eagle3_pipeline.train_entry <speculators train flags>`.

The same as the single-process path: gated compat fixes, the metrics JSONL hook, then
speculators' own `main`. (Plain `torchrun -m speculators.train` would skip the fixes.)
"""

import sys
from pathlib import Path

from .metrics import METRICS_FILE
from .training import run_in_process


def main(argv: list[str]) -> None:
    from .errors import StageError

    save_path = Path(argv[argv.index("--save-path") + 1])
    try:
        run_in_process(argv, save_path / METRICS_FILE)
    except StageError as exc:  # e.g. interrupted: the launcher, then stage 04, see the exit code
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main(sys.argv[1:])
