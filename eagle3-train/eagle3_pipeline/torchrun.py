"""torchrun as stage 04 launches it: `python -m eagle3_pipeline.torchrun <torchrun flags> -m eagle3_pipeline.train_entry ...`.

`torch.distributed.run` itself (same flags, same workers, same exit code 1 when a rank fails), less the
traceback of its `ChildFailedError` and its failure table: by then every rank has recorded how it ended
(`ranks.write_exit`) and stage 04 prints the one line (the bad sample, or which rank or node stopped
first, `ranks.stopped_line`), which that block would otherwise bury. A rank's own traceback (a bug) is
still printed by the rank. Stopped by a signal (stage 04 stops it when another node is gone before the
rendezvous, and says so), it exits 128 + the signal's number without its own traceback.
"""

import sys

# Local imports: torch (heavy; imported where torchrun runs).


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()  # reads sys.argv, as the `torchrun` command does
    except ChildFailedError:
        return 1
    except SignalException as exc:  # its workers were sent the signal on the way out (torchrun's own handler)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
