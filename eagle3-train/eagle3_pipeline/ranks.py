"""How each training rank ended, and the one line stage 04 prints when a multi-process run stops.

torchrun reports a dead rank as a ChildFailedError block per node, and the ranks that survived
it (a collective with a dead peer fails, then torchrun sends SIGTERM and, 30 s later, SIGKILL)
each print their own traceback: on a node whose peer node died, nothing says which rank or node
went first. So every rank (`train_entry`) writes `<save>/logs/ranks/rank-<R>.json` when it starts
(status "running"), once more when every rank is in the process group ("joined": the rendezvous is over;
compat/resume_agreement.py), and as it ends: {"rank", "node", "status": "ok" | "interrupted" | "error",
"error": one line}. A rank killed by a signal (kill -9, the OOM killer) or on a node that went down
stays "running". After a failed launch, `stopped_line` reads the records written since the launch
started and names the ranks (and nodes: torchrun's static rendezvous gives node n the global ranks
n*nproc .. n*nproc+nproc-1) that never ended, else the first rank's error, else says that no rank
started (the launcher failed: its own output says why), and where a rerun resumes.

The save path is shared by the nodes (node 0 writes the checkpoints); each node clears the records
of its own ranks before it launches them (`clear_own`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .checkpoints import latest_progress
from .files import atomic_write_text

RANKS_DIRNAME = "ranks"  # under <save-path>/logs/


def records_dir(save_path: str | Path) -> Path:
    return Path(save_path) / "logs" / RANKS_DIRNAME


def write_exit(save_path: str | Path, status: str, error: str = "", joined: bool = False) -> None:
    """Called by each rank as it starts, joins the group and ends (train_entry); never raises (it must not mask
    the real error)."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        record = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", "0")), "status": status,
                  "error": " ".join(error.split())[:500], "time": time.time(), **({"joined": True} if joined else {})}
        folder = records_dir(save_path)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"rank-{rank}.json", json.dumps(record) + "\n")
    except Exception:  # noqa: BLE001 - best effort by design
        pass


def clear_own(save_path: str | Path, nproc: int, node_rank: int) -> None:
    """Delete the records of the ranks this node is about to start."""
    folder = records_dir(save_path)
    for rank in range(node_rank * nproc, (node_rank + 1) * nproc):
        (folder / f"rank-{rank}.json").unlink(missing_ok=True)


def read_exits(save_path: str | Path, since: float = 0.0) -> dict[int, dict]:
    """{rank: record} for records written at or after `since` (seconds, wall clock)."""
    out = {}
    folder = records_dir(save_path)
    for path in folder.glob("rank-*.json") if folder.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("time", 0) >= since:
            out[int(record["rank"])] = record
    return out


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def stopped_line(save_path: str | Path, *, nproc: int, nnodes: int, node_rank: int, since: float,
                 returncode: int) -> str:
    """One line: which ranks/nodes stopped first and why, and where the same command resumes."""
    world = nproc * nnodes
    exits = read_exits(save_path, since)
    silent = [r for r in range(world) if exits.get(r, {}).get("status", "running") == "running"]
    silent_nodes = sorted({r // nproc for r in silent})
    if not exits:
        cause = f"the launcher exited with code {returncode} before any rank started (its output above says why)"
    elif silent and all(n != node_rank for n in silent_nodes):
        nodes = ", ".join(f"node {n}" for n in silent_nodes)
        cause = (f"{nodes} of {nnodes} stopped answering: rank(s) {_ranges(silent)} ended without an exit record "
                 f"(the node, its stage 04 or its ranks were killed, ran out of memory or lost the network); this "
                 f"node's ranks stopped with it")
    elif silent:
        cause = (f"rank(s) {_ranges(silent)} ended without an exit record (killed by a signal such as kill -9 or the "
                 f"out-of-memory killer, or never started); the other ranks stopped with them")
    else:
        failed = [exits[r] for r in sorted(exits) if exits[r]["status"] == "error"]
        first = min(failed, key=lambda r: r.get("time", 0)) if failed else None  # the cause; the others followed it
        cause = (f"rank {first['rank']} (node {first['node']}) failed: {first['error']}" if first else
                 f"the training processes exited with code {returncode}")
    progress = latest_progress(save_path)
    where = (f"checkpoint {Path(save_path) / progress['checkpoint']} (global step {progress.get('global_step', '?')})"
             if progress else "the start (no checkpoint was saved yet)")
    every = " on every node" if nnodes > 1 else ""
    return f"training stopped: {cause}; rerun the same command{every} to resume from {where}"
