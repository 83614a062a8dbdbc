"""Two nodes, one --output (issue 46, M): stage 04 with `--nnodes 2` on one machine, as on a shared filesystem.

Each node's stage 04 is a real subprocess on the Kimi miniature's shared run (torchrun, gloo). Where a test
needs a node stopped at a chosen point, a test-only `sitecustomize.py` (active only with EAGLE3_TEST_FAULT,
put on that node's PYTHONPATH) pauses it there until the test releases it (or kills it): the interleaving of
the two nodes is then the same on every run, never a race left to the machine's load.

- node 1 writing (its temp in flight) while node 0 tidies the folder: the temp survives, both nodes finish,
  node 0 alone wrote manifest.json and command.txt (before issue 46 node 0's sweep deleted node 1's
  `.command.txt.tmp-PID`, and node 1 exited 74 "renaming the new one into place failed");
- node 1 stopping on an error before the rendezvous, and node 1 killed (-9) before it: node 0 stops in seconds
  with one line naming node 1 and why (it waited at the rendezvous for its timeout, 15 minutes, before).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3_pipeline import nodes

from conftest import REPO, SCRIPTS, descendants, free_port

pytestmark = pytest.mark.reliability  # the tests running stages are marked slow by their fixture (conftest)

STOP_BOUND_S = 60  # a node gone before the rendezvous: seen within a poll (0.5 s), torchrun stopped within 5 s more
WAIT_S = 420  # generous bound on a stage's start-up on a loaded 2-core machine; a pass never comes near it

PAUSE_SITECUSTOMIZE = textwrap.dedent('''
    """Test-only (tests/test_reliability_two_nodes.py); inert unless EAGLE3_TEST_FAULT is set.

    "replace:GLOB": pause before the first os.replace whose destination matches GLOB (its temp complete, not
    renamed); "popen:TEXT": before the first subprocess.Popen whose command line contains TEXT. The pause
    writes what it paused on to EAGLE3_TEST_FAULT_MARKER, then waits for the file EAGLE3_TEST_FAULT_RELEASE.
    Every process started with this environment carries it (torchrun's ranks too): the first to hit pauses.
    """
    import fnmatch
    import os
    import time

    _spec = os.environ.get("EAGLE3_TEST_FAULT")
    if _spec:
        _kind, _what = _spec.split(":", 1)

        def _pause(what):
            marker = os.environ["EAGLE3_TEST_FAULT_MARKER"]
            if os.path.exists(marker):  # one pause per test: another process got there first
                return
            with open(marker + ".part", "w") as handle:
                handle.write(os.fspath(what))
            os.rename(marker + ".part", marker)
            while not os.path.exists(os.environ["EAGLE3_TEST_FAULT_RELEASE"]):
                time.sleep(0.05)

        if _kind == "replace":
            _replace = os.replace

            def replace(src, dst, *args, **kwargs):
                if fnmatch.fnmatch(os.fspath(dst), _what):
                    _pause(src)
                return _replace(src, dst, *args, **kwargs)

            os.replace = replace
        elif _kind == "popen":
            import subprocess

            _init = subprocess.Popen.__init__

            def __init__(self, args, *rest, **kwargs):
                if _what in " ".join(map(str, args if isinstance(args, (list, tuple)) else [args])):
                    _pause(" ".join(map(str, args)))
                _init(self, args, *rest, **kwargs)

            subprocess.Popen.__init__ = __init__
''')

LAUNCHED = "training with speculators"  # the line a node logs after its tidying and writes, as it starts torchrun


@pytest.fixture(scope="module")
def pause_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pause-injection")
    (directory / "sitecustomize.py").write_text(PAUSE_SITECUSTOMIZE)
    return directory


class Node:
    """One node's stage 04, in its own process group (a kill reaches its torchrun and ranks)."""

    def __init__(self, args: list, log: Path, pause: str | None = None, pause_dir: Path | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.marker, self.release = log.with_suffix(".paused"), log.with_suffix(".release")
        if pause:
            env.update(EAGLE3_TEST_FAULT=pause, EAGLE3_TEST_FAULT_MARKER=str(self.marker),
                       EAGLE3_TEST_FAULT_RELEASE=str(self.release),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(pause_dir), env.get("PYTHONPATH")])))
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "04_train.py"), *map(str, args)], stdout=out,
                                         stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait_until(self, predicate, what: str, alive: bool = True) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            if alive and self.proc.poll() is not None:
                pytest.fail(f"{self.log.stem} exited {self.proc.returncode} before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.log.stem}: timed out waiting for {what}:\n{self.output()[-4000:]}")
            time.sleep(0.05)

    def paused_on(self) -> Path:
        self.wait_until(self.marker.is_file, "the injected pause")
        return Path(self.marker.read_text())

    def launched(self) -> None:
        self.wait_until(lambda: LAUNCHED in self.output(), f"'{LAUNCHED}'")

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.log.stem} still running after {timeout} s:\n{self.output()[-4000:]}")

    def kill(self) -> None:
        """The node's machine going down: its stage 04, torchrun and ranks (in their own sessions) alike."""
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def last_line(self) -> str:
        return self.output().strip().splitlines()[-1]


@pytest.fixture
def nodes_started():
    started: list[Node] = []
    yield started
    for node in started:  # never leave a node (and its torchrun) behind a failed test
        if node.proc.poll() is None:
            node.kill()


def node_args(kimi_run: dict, kimi_target: Path, out: Path, rank: int, port: int, *extra) -> list:
    return ["--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"], "--vocab", kimi_run["vocab"],
            "--output", out, "--logger", "", "--epochs", "1", "--nnodes", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]


def test_node_0_tidies_the_shared_folder_while_node_1_writes_and_both_finish(kimi_run, kimi_target, pause_dir,
                                                                              tmp_path, nodes_started):
    out, port = tmp_path / "ckpt", free_port()
    # Node 1 pauses at its first rename under the shared folder, its temp complete and in flight.
    node1 = Node(node_args(kimi_run, kimi_target, out, 1, port), tmp_path / "node1.log", pause=f"replace:{out}/*",
                 pause_dir=pause_dir)
    nodes_started.append(node1)
    # Node 0 starts once node 1 is paused mid-write or waits at the rendezvous (it then writes only after it).
    node1.wait_until(lambda: node1.marker.is_file() or LAUNCHED in node1.output(), "node 1 paused or launched")
    node0 = Node(node_args(kimi_run, kimi_target, out, 0, port), tmp_path / "node0.log")
    nodes_started.append(node0)
    node0.launched()  # node 0 swept stale temps and wrote its files
    in_flight = node1.paused_on()
    assert in_flight.name.startswith(".") and ".tmp-" in in_flight.name
    assert in_flight.exists(), f"node 0 deleted node 1's temp in flight: {in_flight}"
    node1.release.touch()
    codes = [node0.wait(), node1.wait()]
    assert codes == [0, 0], node0.output()[-3000:] + node1.output()[-3000:]
    assert "node 1/2 done" in node1.output()
    # one writer per shared file: node 0's command (node 1 logs its own), node 0's manifest
    command = (out / "command.txt").read_text()
    assert "--node-rank 0" in command and "--node-rank 1" not in command
    assert "node 1's command:" in node1.output() and "--node-rank 1" in node1.output()
    assert json.loads((out / "manifest.json").read_text())["complete"]
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_a_node_that_stops_before_the_rendezvous_stops_the_others_in_seconds(kimi_run, kimi_target, tmp_path,
                                                                             nodes_started):
    out, port = tmp_path / "ckpt", free_port()
    node0 = Node(node_args(kimi_run, kimi_target, out, 0, port), tmp_path / "node0.log")
    nodes_started.append(node0)
    node0.launched()  # waiting at the rendezvous
    # Node 1 does not see the prepared data (e.g. the shared filesystem is mounted elsewhere there).
    missing = tmp_path / "not-mounted" / "data"
    args = node_args(kimi_run, kimi_target, out, 1, port)
    args[args.index(kimi_run["data"])] = missing
    node1 = Node(args, tmp_path / "node1.log")
    nodes_started.append(node1)
    assert node1.wait() != 0
    reason = node1.last_line().removeprefix("error: ")
    assert str(missing) in reason
    stopped_at = time.monotonic()
    code = node0.wait(timeout=STOP_BOUND_S)
    assert time.monotonic() - stopped_at < STOP_BOUND_S
    assert code == 1
    assert node0.last_line() == (
        f"error: training stopped before it started: node 1 of 2 (host {os.uname().nodename}, pid {node1.proc.pid}) "
        f"stopped before the rendezvous: {reason}; this node stopped waiting for it at the rendezvous "
        f"(127.0.0.1:{port}); fix that node, then rerun the same command on every node")
    assert "Traceback" not in node0.output()


def test_a_node_killed_before_the_rendezvous_stops_the_others_in_seconds(kimi_run, kimi_target, pause_dir, tmp_path,
                                                                         nodes_started):
    out, port = tmp_path / "ckpt", free_port()
    # Node 1 first, held just before it starts its torchrun: it has joined nothing yet.
    node1 = Node(node_args(kimi_run, kimi_target, out, 1, port), tmp_path / "node1.log",
                 pause="popen:eagle3_pipeline.torchrun", pause_dir=pause_dir)
    nodes_started.append(node1)
    node1.paused_on()
    node0 = Node(node_args(kimi_run, kimi_target, out, 0, port), tmp_path / "node0.log")
    nodes_started.append(node0)
    node0.launched()
    node1.kill()  # kill -9 of node 1's stage 04 (and anything it started)
    killed_at = time.monotonic()
    code = node0.wait(timeout=STOP_BOUND_S)
    assert time.monotonic() - killed_at < STOP_BOUND_S
    assert code == 1
    assert node0.last_line() == (
        f"error: training stopped before it started: node 1 of 2 (host {os.uname().nodename}, pid {node1.proc.pid}) is "
        f"gone before the rendezvous: its stage 04 and all it started ended without a word (killed, e.g. kill -9 or "
        f"the out-of-memory killer, or its machine went down); this node stopped waiting for it at the rendezvous "
        f"(127.0.0.1:{port}); fix that node, then rerun the same command on every node")
    assert "Traceback" not in node0.output()


def test_a_node_killed_while_the_ranks_join_the_process_group_stops_the_others_in_seconds(kimi_run, kimi_target,
                                                                                          pause_dir, tmp_path,
                                                                                          nodes_started):
    """Before: node 0 stopped watching for gone nodes once every rank had written its start record; node 1 killed
    right after its rank's, rank 0 then waited in the process group's set-up for good, saying nothing. Now the watch
    lasts until every rank is in the group (its record says `joined`)."""
    out, port = tmp_path / "ckpt", free_port()
    node0 = Node(node_args(kimi_run, kimi_target, out, 0, port), tmp_path / "node0.log",
                 pause="replace:*/logs/ranks/rank-0.json", pause_dir=pause_dir)  # rank 0, about to land its start record
    nodes_started.append(node0)
    node1 = Node(node_args(kimi_run, kimi_target, out, 1, port), tmp_path / "node1.log")
    nodes_started.append(node1)
    node0.paused_on()
    node1.wait_until(lambda: (out / "logs" / "ranks" / "rank-1.json").is_file(), "rank 1's start record")
    node1.kill()
    killed_at = time.monotonic()
    node0.release.touch()
    code = node0.wait(timeout=STOP_BOUND_S + 30)
    assert time.monotonic() - killed_at < STOP_BOUND_S, node0.output()[-3000:]
    assert code == 1 and node0.last_line().startswith(
        "error: training stopped before it started: node 1 of 2 "), node0.output()[-3000:]
    assert "Traceback" not in node0.output()


# --- the presence records alone, without launching anything ------------------------------------------------

def _record(out: Path, node: int, **fields) -> None:
    nodes.record_path(out, node, 2).write_text(json.dumps({"node": node, "host": "h1", "pid": 7, "error": "", **fields}))


def _hold(out: Path, node: int) -> int:
    fd = os.open(nodes.lock_path(out, node, 2), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what that node's stage 04 holds while it (or its torchrun) lives
    return fd


def test_a_node_counts_as_gone_only_when_its_lock_is_free_and_its_record_is_of_this_attempt(tmp_path, monkeypatch):
    out = tmp_path
    _record(out, 1, status="error", error="an earlier attempt's stop", time=1.0)  # before node 0 started
    here = nodes.Presence(out, 0, 2, "h0:29500")
    assert here.gone() is None  # not started again yet: the rendezvous waits for it (up to STALE_GRACE_S)
    fd = _hold(out, 1)  # node 1 starts again: lock first, then its record
    _record(out, 1, status="starting", time=1.0)  # (a clock behind node 0's: the change still counts)
    assert here.gone() is None  # alive
    _record(out, 1, status="error", error="/data: no such directory (--data)", time=1.0)
    assert here.gone() is None  # its stage 04 still holds the lock (writing its record, exiting)
    os.close(fd)
    assert here.gone() == "node 1 of 2 (host h1, pid 7) stopped before the rendezvous: /data: no such directory (--data)"

    # killed: the record still says "starting", the lock is free; seen alive before, so of this attempt
    fd = _hold(out, 1)
    _record(out, 1, status="starting", time=1.0)
    here = nodes.Presence(out, 0, 2)
    assert here.gone() is None
    os.close(fd)
    assert "is gone before the rendezvous: its stage 04 and all it started ended without a word" in here.gone()

    # an earlier attempt's record, never changed, lock free: counted only once its restart had STALE_GRACE_S
    here = nodes.Presence(out, 0, 2)
    assert here.gone() is None
    monkeypatch.setattr(nodes, "STALE_GRACE_S", 0)
    assert here.gone().startswith("node 1 of 2 (host h1, pid 7), not started again in 0 s since its stage 04 of ")


def test_where_flock_is_per_node_a_beating_node_is_alive_and_a_silent_one_gone(tmp_path, monkeypatch, caplog):
    """BeeGFS by default, NFS with local_lock=flock, Lustre with localflock: another node's lock always looks free.
    Before heartbeats node 0 then took a live node 1 for killed and stopped the run at once."""
    import logging

    monkeypatch.setattr(nodes, "lock_is_free", lambda *args: True)  # this node never sees the other's lock
    now = [100.0]
    here = nodes.Presence(tmp_path, 0, 2, "h0:29500", clock=lambda: now[0])
    _record(tmp_path, 1, status="starting", time=1.0, beat=0)  # (its clock far behind this node's: no matter)
    assert here.gone() is None  # its first beat seen
    now[0] += nodes.BEAT_S
    _record(tmp_path, 1, status="starting", time=1.0, beat=1)
    with caplog.at_level(logging.WARNING, logger="eagle3"):
        assert here.gone() is None  # it beats
    assert "is local to each node (node 1 beats while its lock looks free)" in caplog.text
    now[0] += nodes.BEAT_STALE_S - 1
    assert here.gone() is None  # no beat for a while, not yet BEAT_STALE_S
    now[0] += 1
    assert "is gone before the rendezvous: its stage 04 and all it started ended without a word" in here.gone()

    # one that stops on an error says so: gone at once, beats or not
    here = nodes.Presence(tmp_path, 0, 2, "h0:29500", clock=lambda: now[0])
    _record(tmp_path, 1, status="error", error="/data: no such directory (--data)", time=1.0, beat=7)
    assert here.gone() == "node 1 of 2 (host h1, pid 7) stopped before the rendezvous: /data: no such directory (--data)"


def test_a_node_beats_while_starting_and_its_last_record_says_how_it_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(nodes, "BEAT_S", 0.02)
    for fails in (False, True):
        with contextlib.suppress(RuntimeError), nodes.presence(tmp_path, 1, 2):
            deadline = time.monotonic() + 30
            while (nodes.read_record(tmp_path, 1, 2) or {}).get("beat", 0) < 3:
                assert time.monotonic() < deadline, "no heartbeat"
                time.sleep(0.01)
            assert nodes.read_record(tmp_path, 1, 2)["status"] == "starting"
            if fails:
                raise RuntimeError("a flag nobody knows")
        ended = nodes.read_record(tmp_path, 1, 2)
        assert ended["status"] == ("error" if fails else "ended") and ended["beat"] >= 3
        assert ended["error"] == ("RuntimeError: a flag nobody knows" if fails else "it finished or found nothing to do")
        time.sleep(0.1)  # five beat periods: none came after the last record
        assert nodes.read_record(tmp_path, 1, 2) == ended


def test_a_filesystem_without_flock_is_one_line_naming_the_lock_file(tmp_path, monkeypatch):
    """Lustre mounted without flock answers ENOSYS, some NFS mounts ENOLCK: before, a traceback from fcntl."""
    import errno

    from eagle3_pipeline import files
    from eagle3_pipeline.errors import StageError
    from eagle3_pipeline.stage import lock_output

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    with pytest.raises(StageError) as error:
        lock_output(tmp_path / "ckpt")
    line = str(error.value)
    assert line.startswith(f"{tmp_path / 'ckpt' / '.eagle3.lock'}: locking it failed (No locks available): ")
    assert "\n" not in line and "mount it with them" in line and error.value.exit_code == 74
    assert not files.held_lock_fds()


RESUME_RANK = textwrap.dedent('''
    """One rank of a 2-rank gloo group: which checkpoint speculators resumes from, seen from this rank's --output."""
    import json, logging, os, sys, types
    from pathlib import Path
    import torch.distributed as dist
    from speculators.train import checkpointer, trainer
    from eagle3_pipeline.compat import resume_agreement

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if sys.argv[2] == "agreed":
        assert resume_agreement.apply()
    dist.init_process_group("gloo")
    path = Path(sys.argv[1])
    ckpt = types.SimpleNamespace(path=path)
    ckpt.previous_epoch = checkpointer.BaseCheckpointer._get_previous_epoch(ckpt)
    state_of = lambda epoch: path / str(epoch) / "training_state.json"
    owner = types.SimpleNamespace(checkpointer=ckpt, _training_state_path=state_of)
    state = trainer.Trainer._load_training_state(owner)
    print(json.dumps({"rank": dist.get_rank(), "epoch": ckpt.previous_epoch, "state": state}))
    dist.destroy_process_group()
''')


def _checkpoints(root: Path, states: dict[int, dict]) -> Path:
    """A --output as one node sees it: epoch folders, each with its training_state.json."""
    for epoch, state in states.items():
        (root / str(epoch)).mkdir(parents=True)
        (root / str(epoch) / "training_state.json").write_text(json.dumps(state))
    return root


def _resume_ranks(tmp_path: Path, views: list[Path], mode: str) -> list[dict]:
    port = free_port()
    script = tmp_path / "resume_rank.py"
    script.write_text(RESUME_RANK)
    procs = [subprocess.Popen([sys.executable, str(script), str(view), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(views)),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank, view in enumerate(views)]
    outs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
    return [{**json.loads(out.strip().splitlines()[-1]), "log": err} for out, err in outs]


def test_every_rank_resumes_from_rank_0s_checkpoint_when_another_nodes_listing_is_older(tmp_path):
    """Node 1 lists the shared --output from its filesystem's cache, as it was before node 0 moved `interrupted/`
    into place as epoch 2 (resume.py): speculators alone would resume node 1's ranks from epoch 1, with other
    optimizer state and another step count than rank 0 (a hang at the first collective they disagree on). With
    compat/resume_agreement every rank takes rank 0's epoch and training state, and node 1's rank says what it saw."""
    mid_epoch = {"epoch": 2, "local_step": 5, "global_step": 50}
    node0 = _checkpoints(tmp_path / "node0-view", {0: {"epoch": 0, "local_step": 0, "global_step": 20},
                                                   1: {"epoch": 1, "local_step": 0, "global_step": 40}, 2: mid_epoch})
    node1 = _checkpoints(tmp_path / "node1-view", {0: {"epoch": 0, "local_step": 0, "global_step": 20},
                                                   1: {"epoch": 1, "local_step": 0, "global_step": 40}})
    alone = _resume_ranks(tmp_path, [node0, node1], "speculators")
    assert [(r["epoch"], r["state"]["global_step"]) for r in alone] == [(2, 50), (1, 40)]  # the disagreement
    agreed = _resume_ranks(tmp_path, [node0, node1], "agreed")
    assert [(r["epoch"], r["state"]) for r in agreed] == [(2, mid_epoch), (2, mid_epoch)]
    assert agreed[0]["log"].strip() == ""
    assert f"rank 1 lists checkpoint 1 in {node1} where rank 0 lists 2" in agreed[1]["log"]
    fresh = _resume_ranks(tmp_path, [tmp_path / "empty", node1], "agreed")  # rank 0 starts afresh: so does rank 1
    assert [r["epoch"] for r in fresh] == [-1, -1] and "rank 0 lists none" in fresh[1]["log"]


# --- stage 02: ranks on two nodes extracting into one folder -----------------------------------------------------

def test_each_engine_stages_in_a_new_folder_and_only_this_hosts_dead_engines_folders_go(tmp_path):
    """Ranks on two nodes share the staging folder (default --data/hidden_states/.staging), and containers give their
    processes the same pids. Before, an engine took `vllm-<pid>`, deleting it if there: the live folder of another
    node's engine with that pid, its in-flight files lost. Now each engine makes a new folder named by pid and host,
    and a rerun removes only the folders of this host's engines that are gone."""
    from eagle3_pipeline.extract.run import remove_dead_engines_staging
    from eagle3_pipeline.extract.vllm_backend import engine_staging_owner, new_engine_staging_dir
    from eagle3_pipeline.files import writer_host

    staging = tmp_path / ".staging"
    other_node_live = staging / f"vllm-{os.getpid()}@other-node.k2x9"  # another node's engine, this same pid
    other_node_live.mkdir(parents=True)
    (other_node_live / "row-3.safetensors").write_bytes(b"in flight")
    mine, again = new_engine_staging_dir(staging), new_engine_staging_dir(staging)
    assert mine != again and mine.is_dir() and again.is_dir()
    assert engine_staging_owner(mine) == (os.getpid(), writer_host())
    assert (other_node_live / "row-3.safetensors").read_bytes() == b"in flight"

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is free now
    killed_here = staging / f"vllm-{gone.pid}@{writer_host()}.a1b2"
    killed_elsewhere = staging / f"vllm-{gone.pid}@other-node.a1b2"
    for folder in (killed_here, killed_elsewhere):
        folder.mkdir()
        (folder / "row-1.safetensors").write_bytes(b"never landed")
    (staging / "vllm-notes.txt").write_text("not an engine's")
    assert remove_dead_engines_staging(staging) == [killed_here]
    assert sorted(p.name for p in staging.iterdir()) == sorted(
        [other_node_live.name, mine.name, again.name, killed_elsewhere.name, "vllm-notes.txt"])


def test_hosts_whose_long_names_share_a_prefix_get_distinct_writer_tags(monkeypatch):
    """Before: the tag was the first label cut to 32 characters, so pods `eagle3-hidden-states-extract-worker-0` and
    `-1` (same container pid) shared `1@eagle3-hidden-states-extract-wor`: one removed the other's live engine
    staging folder as a dead engine's, and its temp as its own."""
    import socket

    from eagle3_pipeline.files import parse_writer_tag, writer_host

    tags = {}
    for host in ("eagle3-hidden-states-extract-worker-0", "eagle3-hidden-states-extract-worker-1", "node_1", "node-1",
                 "node-0.cluster.local"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        tags[host] = writer_host()
        assert parse_writer_tag(f"1@{tags[host]}") == (1, tags[host]) and len(tags[host]) <= 32
    assert len(set(tags.values())) == len(tags)
    assert (tags["node-1"], tags["node-0.cluster.local"]) == ("node-1", "node-0")  # short names stay readable


def test_two_nodes_writing_one_file_with_the_same_pid_each_keep_their_own_temp(tmp_path, monkeypatch):
    """Stage 02's ranks on two nodes both write --data/hidden_states/manifest.json, and containers give their
    processes the same pids. Before, the temp was `.manifest.json.tmp-PID`: one file for both writers; the second
    deleted the first's temp as it began, and the first then failed renaming it into place (exit 74). Now it is
    `.manifest.json.tmp-PID@HOST`: two writers in flight at once each land whole bytes (the last rename wins)."""
    import socket

    from eagle3_pipeline.files import atomic_path, final_name_of, parse_writer_tag, temp_path_for

    final = tmp_path / "manifest.json"

    def on(host: str) -> None:
        monkeypatch.setattr(socket, "gethostname", lambda: host)

    on("node-0.cluster.local")
    with atomic_path(final) as first:
        first.write_text('{"by": "node 0"}')
        on("node-1.cluster.local")
        with atomic_path(final) as second:
            second.write_text('{"by": "node 1"}')
        assert final.read_text() == '{"by": "node 1"}' and first.read_text() == '{"by": "node 0"}'
    assert final.read_text() == '{"by": "node 0"}' and sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert (first.name, second.name) == (f".manifest.json.tmp-{os.getpid()}@node-0", f".manifest.json.tmp-{os.getpid()}@node-1")
    assert final_name_of(first) == "manifest.json" and parse_writer_tag(first.name.split(".tmp-")[1]) == (os.getpid(), "node-0")
    assert temp_path_for(final) == second
