"""Entry point each torchrun/DeepSpeed worker runs: `python -m eagle3_pipeline.train_entry <speculators train flags>`.

The same as the single-process path: gated compat fixes, the metrics JSONL hook, then
speculators' own `main`. (Plain `torchrun -m speculators.train` would skip the fixes.)
"""

import sys
from pathlib import Path

from .training import METRICS_FILE, run_in_process


def main(argv: list[str]) -> None:
    save_path = Path(argv[argv.index("--save-path") + 1])
    run_in_process(argv, save_path / METRICS_FILE)


if __name__ == "__main__":
    main(sys.argv[1:])
