"""Entry point each torchrun/DeepSpeed worker runs: `python -m eagle3_pipeline.train_entry <speculators train flags>`.

The same as the single-process path: gated compat fixes, the metrics JSONL hook, then
speculators' own `main`. (Plain `torchrun -m speculators.train` would skip the fixes.) Each rank
records how it ended (`ranks.write_exit`), so stage 04 can say which rank or node stopped first:
a stop stage 04 reports (a bad sample, an interrupt, an OSError on a path) is that record and a
`[rank R]` log line here, never a second `error:` line or a traceback; anything else keeps its traceback.
"""

import os
import sys
from pathlib import Path

from .errors import Interrupted, StageError, path_error_from
from .metrics import METRICS_FILE
from .ranks import write_exit
from .training import run_in_process


def main(argv: list[str]) -> None:
    save_path = Path(argv[argv.index("--save-path") + 1])
    write_exit(save_path, "running")  # stays so if this rank is killed
    try:
        run_in_process(argv, save_path / METRICS_FILE)
    except BaseException as exc:
        error = exc if isinstance(exc, StageError) else path_error_from(exc)
        if error is None:  # the traceback follows; the record keeps its last line for stage 04
            write_exit(save_path, "error", f"{type(exc).__name__}: {exc}")
            raise
        # e.g. interrupted, or a bad sample: the launcher, then stage 04, see the exit code and the record
        write_exit(save_path, "interrupted" if isinstance(error, Interrupted) else "error", str(error))
        print(f"[rank {os.environ.get('RANK', '0')}] stopped: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None
    write_exit(save_path, "ok")


if __name__ == "__main__":
    main(sys.argv[1:])
