"""Several nodes, one --output on a shared filesystem (stage 04, `--nnodes N` with torchrun).

One writer per shared file: node 0 writes everything directly under --output (manifest.json, command.txt,
the report) and tidies it (stale temps, --overwrite, an incomplete checkpoint) before it starts its
torchrun; global rank 0, which torchrun's static rendezvous places on node 0, saves the checkpoints. Another
node's stage 04 writes nothing there but its own hidden files (its lock, its presence record below, neither
a temp), and its ranks start only once node 0's torchrun is up, i.e. after node 0's tidying, and write under
logs/ only (ranks.py's records, the samples logs). So node 0's sweep of stale temps never meets a temp of
another node in flight. (Before issue 46 every node wrote manifest.json and command.txt: node 0's sweep
deleted node 1's `.command.txt.tmp-PID` while node 1 was writing it.)

A node that stops before the rendezvous: torchrun's static rendezvous waits for every node (up to its
timeout, 15 minutes and more), so a node whose stage 04 stopped first (a flag, a missing input, a lost
mount, kill -9) would leave the others waiting that long. So each node keeps a presence record,
`.eagle3.node<N>-of-<M>.json` in --output ({"node", "host", "pid", "status": "starting" | "error" |
"ended", "error": one line, "time"}), and holds its node lock (`.eagle3.node<N>-of-<M>.lock`, flock,
inherited by its torchrun and ranks) while any of them lives. While this node's torchrun waits,
`run_launch` reads the other nodes' records every half second: a node whose lock is free (its stage 04,
torchrun and ranks are gone: the OS released the lock) and whose record is of this attempt (written or
changed since this node started, or its lock was seen held meanwhile) stops this node's torchrun with one
line naming that node and why (its recorded error, or "killed"). An older record (that node not started
again) counts after STALE_GRACE_S: its restart may simply be slower than this node's. Once every rank
of the launch has written its record (ranks.py), the rendezvous is over and torchrun's own failure
detection takes over (tests/test_04_multirank.py).

Filesystems whose flock is local to each node (BeeGFS by default, NFS mounted with `local_lock=flock`, Lustre with
`localflock`): there another node's lock always looks free, which alone would count a live node as gone. So a node
also beats: while it is "starting" its record's `beat` counts up every BEAT_S. A node whose lock looks free but whose
beat this node saw change within BEAT_STALE_S (by this node's own clock: the nodes' clocks need not agree) is alive;
once this node has seen it beat with its lock looking free, it says once that the filesystem's locks are per node.
A node killed there is seen gone when its beat stops (BEAT_STALE_S); one that stops on an error, at once (its record
says so). Where flock works across nodes nothing changes: a lock seen held, then free, proves that node gone at once.
The record is written in place, not as temp + rename:
a temp would sit where node 0 sweeps, and nothing treats it as an output (readers skip a record caught
half-written and read it again half a second later). Tests: tests/test_reliability_two_nodes.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

from .errors import StageError, path_error_from
from .files import lock_held_elsewhere
from .ranks import read_exits

POLL_S = 0.5
STALE_GRACE_S = 60  # an earlier attempt's record of a node not started again: how long its restart may take
TERM_GRACE_S = 5  # torchrun blocked in the rendezvous may not see SIGTERM: SIGKILL after this
BEAT_S = 2.0  # a "starting" node rewrites its record (`beat` + 1) this often
BEAT_STALE_S = 20.0  # a beat not seen changing for this long (this node's clock) no longer proves that node alive

log = logging.getLogger("eagle3")


def lock_path(out_dir: Path, node: int, nnodes: int) -> Path:
    return Path(out_dir) / f".eagle3.node{node}-of-{nnodes}.lock"


def record_path(out_dir: Path, node: int, nnodes: int) -> Path:
    return Path(out_dir) / f".eagle3.node{node}-of-{nnodes}.json"


def read_record(out_dir: Path, node: int, nnodes: int) -> dict | None:
    try:
        record = json.loads(record_path(out_dir, node, nnodes).read_text())
    except (OSError, ValueError):
        return None  # none yet, or caught half-written: read again at the next poll
    return record if isinstance(record, dict) else None


def lock_is_free(out_dir: Path, node: int, nnodes: int) -> bool:
    """True when no process holds that node's lock (its stage 04, torchrun and ranks are all gone); no lock file
    (that node has not started) or a filesystem without locks prove nothing."""
    return lock_held_elsewhere(lock_path(out_dir, node, nnodes)) is False


def error_line(exc: BaseException) -> str:
    error = exc if isinstance(exc, StageError) else path_error_from(exc)
    text = str(error) if error is not None else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


class Presence:
    """This node's record in the shared --output, and what it knows of the others'."""

    def __init__(self, out_dir: Path, node: int, nnodes: int, endpoint: str = "", clock=time.monotonic):
        self.out_dir, self.node, self.nnodes, self.endpoint = Path(out_dir), node, nnodes, endpoint
        self.clock = clock  # the watch's own time (tests pass their own)
        self.started = time.time()
        self.beat = 0
        self._beats: dict[int, tuple[object, float]] = {}  # node -> (its last beat seen, when it was first seen)
        self._local_locks_said = False
        self.others = [n for n in range(nnodes) if n != node]
        self._before = {n: read_record(self.out_dir, n, nnodes) for n in self.others}  # earlier attempts' records
        # Seen running since this node started: its record is of this attempt, however old (it started first).
        self._seen_alive = {n for n in self.others if self._before[n] is not None and not lock_is_free(out_dir, n, nnodes)}
        self._watch_started: float | None = None

    def write(self, status: str, error: str = "") -> None:
        """Best effort (the stage's own error must never be masked by this record's)."""
        record = {"node": self.node, "host": socket.gethostname(), "pid": os.getpid(), "status": status,
                  "error": error, "time": time.time(), "beat": self.beat}
        with contextlib.suppress(OSError):
            self.out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(record_path(self.out_dir, self.node, self.nnodes), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)

    def beating(self, stop: threading.Event) -> None:
        """The heartbeat thread: rewrite the "starting" record every BEAT_S until `stop` is set."""
        while not stop.wait(BEAT_S):
            self.beat += 1
            self.write("starting")

    def _beats_alive(self, node: int, record: dict) -> bool:
        """That node's beat, its lock looking free, changed within BEAT_STALE_S of this node's clock: alive."""
        if record.get("status") != "starting" or "beat" not in record:
            return False
        now, beat = self.clock(), (record.get("pid"), record.get("beat"))
        seen = self._beats.get(node)
        if seen is None or seen[0] != beat:
            if seen is not None and not self._local_locks_said:  # it beats while its lock looks free
                self._local_locks_said = True
                log.warning("flock on the filesystem of %s is local to each node (node %d beats while its lock "
                            "looks free): nodes are watched by their heartbeats (a killed one is seen gone in %.0f s), "
                            "and a second stage 04 started for a node on another machine is not refused",
                            self.out_dir, node, BEAT_STALE_S)
            self._beats[node] = seen = (beat, now)
        return now - seen[1] < BEAT_STALE_S

    def _this_attempt(self, node: int, record: dict) -> bool:
        # Written since this node started (the nodes' clocks agree, as ranks.stopped_line assumes), or
        # changed since it first looked (that node started a little earlier than this one).
        return record.get("time", 0) >= self.started or record != self._before.get(node)

    def gone(self) -> str | None:
        """The first other node that stopped before the rendezvous, as the stop line's cause; None: wait on.

        Only a node whose lock is free counts (no process of its stage 04 lives). Its record is of this
        attempt (written or changed since this node started, or its lock was seen held meanwhile), or,
        older, has stayed as it was for STALE_GRACE_S of this node's watch (that node was not started again).
        """
        now = self.clock()
        if self._watch_started is None:
            self._watch_started = now
        for node in self.others:
            record = read_record(self.out_dir, node, self.nnodes)
            if record is None:
                continue  # not started yet: the rendezvous waits for it
            if not lock_is_free(self.out_dir, node, self.nnodes):
                self._seen_alive.add(node)
                continue
            if node not in self._seen_alive and self._beats_alive(node, record):
                continue  # its lock never seen held (locks may be per node), its heartbeat going on
            fresh = self._this_attempt(node, record) or node in self._seen_alive
            if not fresh and now - self._watch_started < STALE_GRACE_S:
                continue  # an earlier attempt's record: that node may be starting again
            where = f"node {node} of {self.nnodes} (host {record.get('host', '?')}, pid {record.get('pid', '?')})"
            if not fresh:
                when = time.strftime("%H:%M:%S", time.localtime(record.get("time", 0)))
                where += f", not started again in {STALE_GRACE_S} s since its stage 04 of {when},"
            status, error = record.get("status"), record.get("error") or "no reason recorded"
            if status == "error":
                return f"{where} stopped before the rendezvous: {error}"
            if status == "ended":
                return f"{where} ended before the rendezvous without training ({error})"
            return (f"{where} is gone before the rendezvous: its stage 04 and all it started ended without a word "
                    f"(killed, e.g. kill -9 or the out-of-memory killer, or its machine went down)")
        return None


@contextlib.contextmanager
def presence(out_dir: Path, node: int, nnodes: int, endpoint: str = "") -> Iterator[Presence]:
    """Around a multi-node stage 04, entered once this node holds its node lock (a record of a node whose lock
    is free means that node is gone; and a second stage 04 started for the same node must not write it): "starting",
    beating every BEAT_S (`Presence.beating`), then how it ended; an exception is recorded as "error" with its one
    line, and re-raised."""
    here = Presence(out_dir, node, nnodes, endpoint)
    here.write("starting")
    stop = threading.Event()
    heart = threading.Thread(target=here.beating, args=(stop,), name="node-heartbeat", daemon=True)
    heart.start()

    def stop_beating() -> None:  # before the last record: a late beat must not overwrite how it ended
        stop.set()
        heart.join()

    try:
        yield here
    except BaseException as exc:
        stop_beating()
        here.write("error", error_line(exc))
        raise
    stop_beating()
    here.write("ended", "it finished or found nothing to do")


def run_launch(launch: list[str], *, env: dict, pass_fds: tuple[int, ...], here: Presence | None, world: int,
               save_path: Path) -> int:
    """Run the launcher (torchrun); with several nodes, stop it in seconds when another node is gone before
    the rendezvous (`Presence.gone`): StageError, one line. Returns the launcher's exit code."""
    launched_at = time.time()
    proc = subprocess.Popen(launch, env=env, pass_fds=pass_fds)
    try:
        watching = here is not None
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if not watching:
                continue
            # every rank in the process group: past the rendezvous (a rank that only started may still wait in it
            # for a node killed meanwhile, which no collective would ever report)
            if sum(bool(r.get("joined")) for r in read_exits(save_path, launched_at).values()) >= world:
                watching = False
                continue
            cause = here.gone()
            if cause:
                _stop(proc)
                raise StageError(f"training stopped before it started: {cause}; this node stopped waiting for it at "
                                 f"the rendezvous ({here.endpoint}); fix that node, then rerun the same command on "
                                 f"every node")
    except BaseException:
        if proc.poll() is None:
            _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
