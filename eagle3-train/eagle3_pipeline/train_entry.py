"""Entry point each torchrun/DeepSpeed worker runs: `python -m eagle3_pipeline.train_entry <speculators train flags>`.

The same as the single-process path: gated compat fixes, the metrics JSONL hook, then
speculators' own `main`. (Plain `torchrun -m speculators.train` would skip the fixes.) Each rank
records how it ended (`ranks.write_exit`), so stage 04 can say which rank or node stopped first.
"""

import sys
from pathlib import Path

from .errors import Interrupted, StageError
from .metrics import METRICS_FILE
from .ranks import write_exit
from .training import run_in_process


def main(argv: list[str]) -> None:
    save_path = Path(argv[argv.index("--save-path") + 1])
    write_exit(save_path, "running")  # stays so if this rank is killed
    try:
        run_in_process(argv, save_path / METRICS_FILE)
    except StageError as exc:  # e.g. interrupted: the launcher, then stage 04, see the exit code
        write_exit(save_path, "interrupted" if isinstance(exc, Interrupted) else "error", str(exc))
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except BaseException as exc:  # the traceback follows; the record keeps its last line for stage 04
        write_exit(save_path, "error", f"{type(exc).__name__}: {exc}")
        raise
    write_exit(save_path, "ok")


if __name__ == "__main__":
    main(sys.argv[1:])
