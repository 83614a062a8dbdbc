"""run_all.sh: run every stage (each decides "done" itself), stop on failures, survive kills and disconnects, resume.

Most tests drive the real script with a stub interpreter (`--python STUB`) that stands in for the
five stage scripts: it records each call and writes the stage's manifest, or fails, hangs, or
stops early, as an environment variable tells it. They take a second or two each. The last test
runs the real five stages on the Kimi-K2.5 miniature, kills everything mid-training with SIGKILL,
and restarts the same command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3_pipeline.compat.samples_record import read_records

from conftest import REPO, SAMPLES, free_port

RUN_ALL = REPO / "eagle3-train" / "run_all.sh"
STAGES = ["01", "02", "03", "04", "05"]

STUB = textwrap.dedent(r'''
    #!{python}
    """Stand-in for `python -u eagle3-train/0N_*.py ARGS`: FAKE_0N=ok|fail|incomplete|sleep:S|until:PATH|hang.
    With ok, a complete manifest already there makes it a no-op, as a finished real stage is."""
    import json, os, signal, sys, time
    from pathlib import Path

    args = sys.argv[1:]
    if args and args[0] == "-u":
        args = args[1:]
    num, rest = Path(args[0]).name[:2], args[1:]
    calls = Path(os.environ["FAKE_CALLS"])

    def flag(name):
        return rest[rest.index(name) + 1] if name in rest else None

    def note(text):
        with open(calls, "a") as handle:
            handle.write(f"{{num}} {{text}}\n")

    def on_term(signum, frame):
        note("TERM")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    note("start pid=%d pgid=%d cvd=%s %s" % (os.getpid(), os.getpgid(0), os.environ.get("CUDA_VISIBLE_DEVICES", "-"),
                                                " ".join(rest)))
    if "--print-config" in rest:
        print(f"# stage {{num}} config (profile {{flag('--profile')}})")
        print(os.environ.get(f"FAKE_{{num}}_CONFIG", "").replace(";", "\n"))  # e.g. world_size = 2
        sys.exit(0)
    mode = os.environ.get(f"FAKE_{{num}}", "ok")
    print(f"stage {{num}} working ({{mode}})", flush=True)
    if mode == "fail":
        print("error: stub failure", file=sys.stderr)
        sys.exit(4)
    if mode == "stall":  # as 04's stall watch in a one-process run: its line, the stacks, exit 75, no error line
        print("epoch 0:  10%|#         | 1/10\repoch 0:  20%|##        | 2/10", flush=True)
        print("[rank 0] stalled: no training step or validation batch for 31.0 min (limit 30.0 min; last: train step "
              "3); every thread's stack and the child processes follow; stopping (exit 75): rerun the same command to "
              "resume from the last checkpoint, or raise 04 --stall-minutes if this wait was expected", file=sys.stderr)
        print('Thread 0x00007f (most recent call first):\n  File "trainer.py", line 9 in step\n  no child processes',
              file=sys.stderr, flush=True)
        os._exit(75)
    if mode == "traceback":  # any crash outside the stage's own errors
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if mode.startswith("sleep:"):
        time.sleep(float(mode.split(":")[1]))
    if mode.startswith("until:"):  # runs until the test lets it finish (no race with a loaded machine's clock)
        deadline = time.monotonic() + 120
        while not Path(mode.split(":", 1)[1]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if mode == "hang":
        while True:
            time.sleep(0.1)
    out = {{"01": flag("--output"), "02": f"{{flag('--data')}}/hidden_states", "03": flag("--output"),
           "04": flag("--output"), "05": flag("--output"), "06": flag("--output")}}[num]
    if num == "05" and mode == "ok":  # as a real 05, finished or not: the serve line of the draft at --output now
        print(f"serve: vllm serve stub --speculative-config {{out}}", flush=True)
    previous = Path(out) / "manifest.json"
    if mode == "ok" and previous.is_file() and json.loads(previous.read_text()).get("complete"):
        print(f"stage {{num}}: already done with these settings; nothing to do", flush=True)  # as a real stage
        note("noop")
        sys.exit(0)
    Path(out).mkdir(parents=True, exist_ok=True)
    if num == "05":
        (Path(out) / "serve_command.txt").write_text(f"vllm serve stub --speculative-config {{out}}\n")
    complete = mode != "incomplete"
    if num == "02" and flag("--world-size") is not None:  # as a real 02 rank: the one that finds every rank's rows writes it
        (Path(out) / f"rank-{{flag('--rank')}}.done").touch()
        complete = all((Path(out) / f"rank-{{r}}.done").exists() for r in range(int(flag("--world-size"))))
    manifest = {{"stage": num, "complete": complete}}
    (Path(out) / "manifest.json").write_text(json.dumps(manifest, indent=2))
    note("done")
''').lstrip()


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub-python"
    path.write_text(STUB.format(python=sys.executable))
    path.chmod(0o755)
    return path


def driver(work: Path, stub: Path, *extra: str, env: dict | None = None, wait: bool = True, timeout: float = 60):
    """Start run_all.sh on WORK with the stub; returns CompletedProcess (wait) or Popen."""
    cmd = ["bash", str(RUN_ALL), "--profile", "cpu-mini", "--target", "/models/T", "--data", "d.jsonl",
           "--work", str(work), "--python", str(stub), *extra]
    full_env = {**os.environ, "FAKE_CALLS": str(work.parent / "calls.txt"), **(env or {})}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            cwd=REPO, start_new_session=True)


def calls(work: Path) -> list[str]:
    path = work.parent / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def started(work: Path) -> list[str]:
    """Stages run (not the --print-config that asks stage 02 for its data-parallel ranks)."""
    return [line.split()[0] for line in calls(work) if line.split()[1] == "start" and "--print-config" not in line]


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def current_stage(work: Path) -> tuple[str, int] | None:
    try:
        num, pid = (work / "logs" / "current_stage").read_text().split()
        return num, int(pid)
    except (OSError, ValueError):
        return None


def test_runs_five_stages_in_order_with_one_log_each_then_asks_each_again(tmp_path, stub):
    """The driver never decides "finished" itself: each stage applies the one rule (identity + complete)."""
    work = tmp_path / "w"
    first = driver(work, stub)
    assert first.returncode == 0, first.stdout + first.stderr
    assert started(work) == STAGES
    for num, name in zip(STAGES, ["prepare", "extract", "vocab", "train", "export"]):
        log = (work / "logs" / f"{num}_{name}.log").read_text()
        assert f"stage {num} working" in log and "run_all attempt:" in log
    assert "vllm serve stub" in first.stdout
    second = driver(work, stub)
    assert second.returncode == 0
    assert started(work) == STAGES + STAGES  # every stage asked again...
    assert second.stdout.count("nothing to do") == 5  # ...and each one found its output finished
    assert [line.split()[0] for line in calls(work) if line.split()[1] == "done"] == STAGES


@pytest.mark.reliability
def test_a_copied_work_dir_prints_the_serve_line_of_its_own_draft(tmp_path, stub):
    """Before: the driver ended with the serve line read from WORK/draft/serve_command.txt, which a copied or moved
    work dir carries over: it named the draft of the directory it was copied from."""
    work, copy = tmp_path / "w", tmp_path / "copy"
    assert driver(work, stub).returncode == 0
    shutil.copytree(work, copy)
    result = driver(copy, stub)
    assert result.returncode == 0, result.stdout + result.stderr
    serve = [line for line in result.stdout.splitlines() if line.startswith("vllm serve ")]
    assert serve == [f"vllm serve stub --speculative-config {copy / 'draft'}"]  # the driver's last line: this draft


def test_a_stale_stage_stops_the_run_with_its_reason(tmp_path, stub):
    """Before: a stage whose manifest said complete was skipped, though its inputs or settings had changed."""
    work = tmp_path / "w"
    assert driver(work, stub).returncode == 0
    stale = driver(work, stub, env={"FAKE_04": "fail"})  # what a real 04 does when --args-04 changed a setting
    assert stale.returncode == 4
    assert "04 train failed (exit 4) after " in stale.stderr and "s: stub failure; see " in stale.stderr
    assert "all five stages finished" not in stale.stdout


def test_stages_get_the_profile_the_wiring_and_their_extra_flags(tmp_path, stub):
    work = tmp_path / "w"
    result = driver(work, stub, "--trust-remote-code", "--args-04", "--epochs 3 --lr 5e-4")
    assert result.returncode == 0, result.stderr
    by_stage = {line.split()[0]: line for line in calls(work) if " start " in line}
    assert all("--profile cpu-mini" in line for line in by_stage.values())
    assert "--trust-remote-code" in by_stage["01"] and "--trust-remote-code" in by_stage["04"]
    assert "--trust-remote-code" not in by_stage["03"] and "--trust-remote-code" not in by_stage["05"]
    assert by_stage["04"].endswith("--epochs 3 --lr 5e-4")
    assert f"--data {work}/data --vocab {work}/vocab --output {work}/checkpoints" in by_stage["04"]


def test_a_failed_stage_stops_the_run_and_the_rerun_starts_at_it(tmp_path, stub):
    work = tmp_path / "w"
    failed = driver(work, stub, env={"FAKE_03": "fail"})
    assert failed.returncode == 4
    assert "03 vocab failed (exit 4)" in failed.stderr
    assert started(work) == ["01", "02", "03"]
    rerun = driver(work, stub)
    assert rerun.returncode == 0
    assert started(work) == ["01", "02", "03", "01", "02", "03", "04", "05"]  # 01, 02: no-ops
    assert [line.split()[0] for line in calls(work) if line.split()[1] == "done"] == STAGES
    log = (work / "logs" / "03_vocab.log").read_text()
    assert log.count("run_all attempt:") == 2 and "stub failure" in log  # appended, not overwritten


@pytest.mark.reliability
def test_a_stage_failing_without_an_error_line_is_reported_with_its_last_meaningful_line(tmp_path, stub):
    """Issue 64 S. Before: "04 train failed (exit 75) after 7 s: ; see LOG" (an empty reason, or an earlier attempt's
    error line), and 75 read as run_all's own code for "another driver runs"."""
    work = tmp_path / "w"
    assert driver(work, stub, env={"FAKE_04": "fail"}).returncode == 4  # an earlier attempt's error line in the log
    stalled = driver(work, stub, env={"FAKE_04": "stall"})
    assert stalled.returncode == 75
    line = [text for text in stalled.stderr.splitlines() if text.startswith("run_all.sh: ")][-1]
    assert "04 train failed (exit 75 from the stage itself (a temporary stop: rerunning resumes), not run_all's own 75 " \
           "(another driver)) after " in line, line
    assert "s: [rank 0] stalled: no training step or validation batch for 31.0 min" in line and "--stall-minutes" in line
    assert "stub failure" not in line
    crashed = driver(work, stub, env={"FAKE_04": "traceback"})
    line = [text for text in crashed.stderr.splitlines() if text.startswith("run_all.sh: ")][-1]
    assert crashed.returncode == 1 and "04 train failed (exit 1) after " in line, line
    assert "s: no error line; it ended in RuntimeError: CUDA error: an illegal memory access was encountered; see " in line


def test_a_stage_that_exits_0_without_a_complete_manifest_stops_the_run(tmp_path, stub):
    # e.g. stage 02 with --world-size 2: this rank is done, the other rank's rows are not
    work = tmp_path / "w"
    result = driver(work, stub, env={"FAKE_02": "incomplete"})
    assert result.returncode == 3
    assert "not complete" in result.stderr and "--world-size" in result.stderr
    assert started(work) == ["01", "02"]


def test_sigterm_stops_the_running_stage_and_the_rerun_continues(tmp_path, stub):
    work = tmp_path / "w"
    proc = driver(work, stub, env={"FAKE_02": "hang"}, wait=False)
    wait_for(lambda: (current_stage(work) or ("",))[0] == "02" and "02" in started(work), what="stage 02")
    num, pgid = current_stage(work)
    assert os.getpgid(pgid) == pgid != os.getpgid(proc.pid)  # the stage has its own process group
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "02 TERM" in calls(work)  # the stage got the signal and could clean up
    assert "rerun the same command" in out
    rerun = driver(work, stub)
    assert rerun.returncode == 0
    assert started(work) == ["01", "02", "01", "02", "03", "04", "05"]


def test_sighup_from_a_dropped_ssh_session_does_not_stop_the_run(tmp_path, stub):
    work = tmp_path / "w"
    proc = driver(work, stub, env={"FAKE_02": "sleep:1.5"}, wait=False)
    wait_for(lambda: "02" in started(work), what="stage 02")
    os.killpg(proc.pid, signal.SIGHUP)  # what the terminal sends to its session's process group
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert started(work) == STAGES
    assert "all five stages finished" in (work / "logs" / "run_all.log").read_text()


def test_restart_while_a_killed_drivers_stage_still_runs_is_refused_then_continues(tmp_path, stub):
    work = tmp_path / "w"
    go = tmp_path / "let-02-finish"
    proc = driver(work, stub, env={"FAKE_02": f"until:{go}"}, wait=False)
    wait_for(lambda: "02" in started(work), what="stage 02")
    os.kill(proc.pid, signal.SIGKILL)  # the driver only: its stage keeps running in its own group
    proc.wait(timeout=10)
    refused = driver(work, stub, env={"FAKE_02": "ok"})
    assert refused.returncode == 75
    assert "still running" in refused.stderr and "02" in refused.stderr
    status = subprocess.run(["bash", str(RUN_ALL), "--status", "--work", str(work)], capture_output=True, text=True)
    assert "running: stage 02" in status.stdout
    go.touch()
    wait_for(lambda: (work / "data" / "hidden_states" / "manifest.json").exists(), what="stage 02 to finish alone")
    wait_for(lambda: driver(work, stub).returncode == 0, timeout=30, what="the lock to be released")
    # 02 did its work once, to the end, although its driver was killed; the new driver found it finished.
    assert [line.split()[0] for line in calls(work) if line.split()[1] == "done"] == STAGES


@pytest.mark.reliability
def test_two_nodes_run_the_same_command_on_one_work_dir(tmp_path, stub):
    """Multi-node training as set up in practice: WORK on a filesystem both nodes mount, the same run_all.sh command on
    each with its own --node-rank. Before: node 1's driver took the one driver lock of WORK (refused, exit 75, where
    the filesystem's flock spans nodes), else wrote node 0's current_stage and 04 log and went on to run 05 itself."""
    work = tmp_path / "w"
    node = "--nnodes 2 --node-rank {} --rdzv-endpoint 127.0.0.1:29500"
    early = driver(work, stub, "--args-04", node.format(1), "--node-wait", "1")  # node 1 alone: node 0 never starts
    assert early.returncode == 3 and started(work) == []
    assert early.stderr.strip().splitlines()[-1] == (
        f"run_all.sh: gave up waiting for node 0 to finish 01 prepare: nothing in {work}/logs or {work}/data changed "
        "for 1 s (--node-wait); start or fix node 0, then rerun the same command")
    go = tmp_path / "let-node-0s-04-finish"
    node0 = driver(work, stub, "--args-04", node.format(0), env={"FAKE_04": f"until:{go}"}, wait=False)
    try:
        wait_for(lambda: "04" in started(work), what="node 0's stage 04")
        node1 = driver(work, stub, "--args-04", node.format(1))  # beside node 0's driver, on the same WORK
        assert node1.returncode == 0, node1.stdout + node1.stderr
        assert "node 1 finished its part of 04; node 0 writes its manifest, then runs 05" in node1.stdout
        assert current_stage(work)[0] == "04" and node0.poll() is None  # node 0's own record, untouched
        go.touch()
        assert node0.wait(timeout=60) == 0
    finally:
        if node0.poll() is None:
            os.killpg(node0.pid, signal.SIGKILL)
    runs = [line.split()[0] for line in calls(work) if line.split()[1] == "start" and "--print-config" not in line]
    assert runs == ["01", "02", "03", "04", "04", "05"]  # node 1 ran 04 alone; 05 ran once, on node 0
    assert sum("--node-rank 1" in line for line in calls(work) if line.startswith("04 start")) == 1
    logs = work / "logs"
    assert "--node-rank 1" in (logs / "04_train.node1.log").read_text()
    assert "--node-rank 1" not in (logs / "04_train.log").read_text()
    assert "node 1 finished its part of 04" in (logs / "run_all.node1.log").read_text()
    assert "node 1" not in (logs / "run_all.log").read_text()
    assert not (logs / "current_stage.node1").exists()
    sliced = driver(work, stub, "--args-04", node.format(1), "--slice-rows", "8")
    assert sliced.returncode == 2 and "--slice-rows runs on one node" in sliced.stderr


@pytest.mark.reliability
def test_two_nodes_each_extract_their_rank_then_train_from_one_command_each_in_any_order(tmp_path, stub):
    """Two nodes, one WORK, each extracting its share (--args-02 "--world-size 2 --rank R", TP 8 on each node), then
    training. Node 1 is started first: it waits for node 0's 01, runs its 02 rank, waits for 02 and 03, runs its part
    of 04; node 0 runs 01, its rank, waits for rank 1's rows, then 03-05. Before, node 1 refused to start until node
    0's 01-03 were finished (which needed node 1's rows: node 0 stopped after its rank, exit 3)."""
    work = tmp_path / "w"
    args = lambda r: ["--args-02", f"--world-size 2 --rank {r}",  # noqa: E731
                      "--args-04", f"--nnodes 2 --node-rank {r} --rdzv-endpoint 127.0.0.1:29500"]
    alone = driver(work, stub, *args(0), "--node-wait", "1")  # node 0 alone: rank 1's rows never come
    assert alone.returncode == 3 and started(work) == ["01", "02"]
    assert "gave up waiting for 02's other ranks" in alone.stderr.strip().splitlines()[-1]
    (work.parent / "calls.txt").unlink()
    shutil.rmtree(work)

    go = tmp_path / "let-rank-1-finish"
    node1 = driver(work, stub, *args(1), env={"FAKE_02": f"until:{go}"}, wait=False)
    node0 = None
    try:
        wait_for(lambda: (work / "logs" / "run_all.node1.log").is_file() and "waiting for node 0 to finish it" in
                 (work / "logs" / "run_all.node1.log").read_text(), what="node 1 waiting for node 0's 01")
        assert started(work) == []
        node0 = driver(work, stub, *args(0), wait=False)
        log0 = work / "logs" / "run_all.log"
        wait_for(lambda: log0.is_file() and "waiting for 02's other ranks" in log0.read_text(), timeout=60,
                 what="node 0 waiting for rank 1's rows")
        wait_for(lambda: "02 start" in " ".join(line for line in calls(work) if "--rank 1" in line), timeout=30,
                 what="node 1's rank once node 0's 01 is finished")
        assert node0.poll() is None and "--rank 1" in (work / "logs" / "02_extract.node1.log").read_text()
        go.touch()
        assert node1.wait(timeout=60) == 0 and node0.wait(timeout=60) == 0
    finally:
        for process in (node0, node1):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    runs = [" ".join(line.split()[:1] + [f for f in ("--rank 0", "--rank 1", "--node-rank 1") if f in line])
            for line in calls(work) if line.split()[1] == "start" and "--print-config" not in line]
    assert runs[:3] == ["01", "02 --rank 1", "02 --rank 0"] or runs[:3] == ["01", "02 --rank 0", "02 --rank 1"]
    assert sorted(runs[3:]) == ["03", "04", "04 --node-rank 1", "05"]  # (the stub's 04 does not wait for the other)
    assert runs.index("03") < runs.index("04 --node-rank 1")  # node 1 trained once node 0's 03 was finished
    out1 = node1.stdout.read()
    assert "node 1 finished its part of 04" in out1 and "01 prepare: waiting for node 0 to finish it" in out1


@pytest.mark.reliability
def test_status_shows_another_nodes_driver_running_and_its_logs(tmp_path, stub):
    """Issue 64. Before: `--status` read node 0's record alone (current_stage: "nothing running" while node 1's
    driver ran its 04) and listed no *.nodeN.log."""
    work = tmp_path / "w"
    assert driver(work, stub).returncode == 0  # node 0 finished everything
    go = tmp_path / "let-node-1s-04-finish"
    node1 = driver(work, stub, "--args-04", "--nnodes 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:29500",
                   env={"FAKE_04": f"until:{go}"}, wait=False)
    try:
        wait_for(lambda: (work / "logs" / "current_stage.node1").exists(), what="node 1's stage 04")
        status = subprocess.run(["bash", str(RUN_ALL), "--status", "--work", str(work), "--python", sys.executable],
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert any(line.startswith("running on node 1: stage 04 (process group ") and
                   line.endswith(f"tail -f {work}/logs/04_train.node1.log") for line in lines), status.stdout
        assert any(line.split()[:1] == ["node1"] and line.endswith(f"{work}/logs/04_train.node1.log")
                   for line in lines), status.stdout
        go.touch()
        assert node1.wait(timeout=60) == 0
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_from_reruns_finished_stages_and_print_config_asks_every_stage(tmp_path, stub):
    work = tmp_path / "w"
    assert driver(work, stub).returncode == 0
    assert driver(work, stub, "--from", "04").returncode == 0
    assert started(work) == STAGES + ["04", "05"]
    printed = driver(work, stub, "--print-config")
    assert printed.returncode == 0
    assert [line for line in printed.stdout.splitlines() if line.startswith("## ")] == [
        "## 01_prepare", "## 02_extract", "## 03_vocab", "## 04_train", "## 05_export"]
    assert printed.stdout.count("(profile cpu-mini)") == 5
    status = subprocess.run(["bash", str(RUN_ALL), "--status", "--work", str(work)], capture_output=True, text=True)
    # --status asks the stages' own rule (eagle3_pipeline.status): the stubs' manifests are no stage's of this
    # pipeline (stage "01"), which a real stage refuses, so none counts as finished or resumable there
    # (tests/test_reliability_trust_bytes.py checks "finished" on real stages)
    assert [line.split()[2:4] for line in status.stdout.splitlines()] == [["manifest", "unreadable"]] * 5


def test_eval_runs_stage_06_after_05_on_the_default_or_given_prompts(tmp_path, stub):
    work = tmp_path / "w"
    plain = driver(work, stub)
    assert plain.returncode == 0 and started(work) == STAGES  # no --eval: five stages, no engine started
    default = driver(work, stub, "--eval")
    assert default.returncode == 0, default.stdout + default.stderr
    assert started(work)[-1] == "06"
    call = [line for line in calls(work) if line.startswith("06 start")][-1]
    # and WORK's own training run, data and vocab (issue 46 J: a moved WORK's recorded paths are gone)
    assert f"--draft {work / 'draft'} --checkpoints {work / 'checkpoints'} --data {work / 'data'} --vocab " \
           f"{work / 'vocab'} --output {work / 'eval'}" in call and "--prompts" not in call, call
    assert "06 evaluate" in (work / "logs" / "run_all.log").read_text() and (work / "logs" / "06_evaluate.log").is_file()
    mine = driver(tmp_path / "w2", stub, "--eval-prompts", "mine.jsonl", "--args-06", "--temperature 0.7")
    assert mine.returncode == 0
    call = [line for line in calls(tmp_path / "w2") if line.startswith("06 start")][-1]
    assert call.endswith("--prompts mine.jsonl --temperature 0.7")


def test_a_failed_verdict_stops_the_run_with_its_line(tmp_path, stub):
    work = tmp_path / "w"
    result = driver(work, stub, "--eval", env={"FAKE_06": "fail"})
    assert result.returncode == 4 and "06 evaluate failed (exit 4)" in result.stderr
    assert "stub failure" in result.stderr  # the stage's own error line (06: the verdict) in the driver's


def test_help_shows_an_example_and_the_tmux_pattern():
    result = subprocess.run(["bash", str(RUN_ALL), "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "--profile rtx-pro-6000-8x" in result.stdout and "tmux attach" in result.stdout and "nohup" in result.stdout


# --- the real pipeline ------------------------------------------------------------------------

def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _manifest(path: Path) -> dict:
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
@pytest.mark.reliability
def test_driver_restarts_after_sigkill_mid_training_on_the_miniature(tmp_path, kimi_target):
    """Kill -9 the driver and its running stage (a crash, a reboot) after training saved epoch 0,
    then run the same command: 01-03 are no-ops, 04 resumes from checkpoint 0, 05 exports."""
    work = tmp_path / "run"
    cmd = ["bash", str(RUN_ALL), "--profile", "cpu-mini", "--target", str(kimi_target),
           "--data", str(SAMPLES / "conversations.jsonl"), "--work", str(work), "--python", sys.executable,
           "--args-04", "--epochs 3 --logger="]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    epoch0 = work / "checkpoints" / "0" / "training_state.json"
    try:
        wait_for(lambda: epoch0.exists() or proc.poll() is not None, timeout=420, what="checkpoint 0")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        stage = current_stage(work)
        assert stage is not None and stage[0] == "04"
        os.killpg(proc.pid, signal.SIGKILL)  # the driver (and its log viewer)
        os.killpg(stage[1], signal.SIGKILL)  # the training process group
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    wait_for(lambda: not _group_alive(stage[1]), timeout=60, what="the killed training processes to exit")
    assert not _manifest(work / "checkpoints").get("complete")
    assert all(_manifest(work / d).get("complete") for d in ("data", "data/hidden_states", "vocab"))

    rerun = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=420)
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-2000:]
    for num, name in (("01", "prepare"), ("02", "extract"), ("03", "vocab")):
        assert "nothing to do" in (work / "logs" / f"{num}_{name}.log").read_text().split("run_all attempt:")[-1]
    train_log = (work / "logs" / "04_train.log").read_text()
    assert train_log.count("run_all attempt:") == 2
    assert "Resuming" in train_log.split("run_all attempt:")[-1]  # speculators resumed, not restarted
    trained = _manifest(work / "checkpoints")
    assert trained.get("complete") and _manifest(work / "draft").get("complete")
    records = [json.loads(line) for line in (work / "checkpoints" / "metrics.jsonl").read_text().splitlines()
               if line.endswith("}")]
    steps = [r["global_step"] for r in records if "train" in r and "global_step" in r]
    assert max(steps) + 1 == len(set(steps))  # every step of the 3 epochs logged, none lost
    assert (work / "checkpoints" / "plots" / "loss.png").stat().st_size > 10_000
    assert "best checkpoint" in (work / "checkpoints" / "summary.txt").read_text()


@pytest.mark.slow
@pytest.mark.reliability
def test_two_nodes_run_the_real_pipeline_from_one_command_each_on_one_work_dir(tmp_path, kimi_target):
    """The same run_all.sh command on two nodes (here two drivers on one machine, gloo, one rank each) and one WORK,
    started together, node 1 first: node 0 runs 01; each node extracts its rank's rows (--args-02 "--world-size 2
    --rank R"); node 0 runs 03 and holds global rank 0; node 1 trains beside it in its own logs; node 0 writes 04's
    manifest and exports. Each node's rank extracted half the rows and trained its own share of every epoch."""
    work, port = tmp_path / "run", free_port()

    def command(rank: int) -> list:
        return ["bash", str(RUN_ALL), "--profile", "cpu-mini", "--target", str(kimi_target),
                "--data", str(SAMPLES / "conversations.jsonl"), "--work", str(work), "--python", sys.executable,
                "--args-02", f"--world-size 2 --rank {rank}",
                "--args-04", f"--epochs 1 --logger= --nnodes 2 --node-rank {rank} --rdzv-endpoint 127.0.0.1:{port}"]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nodes = []
    try:
        for rank in (1, 0):
            nodes.append(subprocess.Popen(command(rank), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=env, cwd=REPO, start_new_session=True))
        out1, out0 = (node.communicate(timeout=600)[0] for node in nodes)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert nodes[0].returncode == 0, out1[-3000:]
    assert nodes[1].returncode == 0, out0[-4000:]
    assert "node 1 finished its part of 04" in out1
    extracted = _manifest(work / "data" / "hidden_states")
    assert extracted.get("complete") and extracted["counts"]["rows"] == _manifest(work / "data")["counts"]["rows"]
    logs = work / "logs"
    shares = [int(re.search(r"extracting (\d+) row\(s\)", (logs / name).read_text()).group(1))
              for name in ("02_extract.log", "02_extract.node1.log")]
    assert sum(shares) == extracted["counts"]["rows"] and min(shares) > 0  # each node extracted its own rows
    assert _manifest(work / "checkpoints").get("complete") and _manifest(work / "draft").get("complete")
    assert sorted({record["rank"] for record in read_records(work / "checkpoints")}) == [0, 1]  # one rank per node
    assert "node 1/2 done" in (logs / "04_train.node1.log").read_text()
    assert "--node-rank 1" not in (logs / "04_train.log").read_text()
    assert not (logs / "05_export.node1.log").exists() and (logs / "05_export.log").exists()


def test_data_parallel_extraction_starts_one_rank_per_share_of_the_gpus(tmp_path, stub):
    """extract.world_size 2 x tensor_parallel_size 2 (a profile's choice, here via the config stage 02 prints):
    two stage-02 processes, --rank 0 and 1, on GPUs 0,1 and 2,3, each with its own log; then 03 runs."""
    work = tmp_path / "w"
    result = driver(work, stub, env={"FAKE_02_CONFIG": "world_size = 2;tensor_parallel_size = 2"})
    assert result.returncode == 0, result.stdout + result.stderr
    # the two ranks start side by side, so their start lines come in either order
    ranks = sorted((line for line in calls(work) if line.startswith("02 start") and "--print-config" not in line),
                   key=lambda line: line.rsplit("--rank ", 1)[-1])
    assert len(ranks) == 2
    assert ranks[0].endswith("--rank 0") and " cvd=0,1 " in ranks[0]
    assert ranks[1].endswith("--rank 1") and " cvd=2,3 " in ranks[1]
    assert (work / "logs" / "02_extract.rank0.log").is_file() and (work / "logs" / "02_extract.rank1.log").is_file()
    assert started(work)[-3:] == ["03", "04", "05"]
    assert "2 data-parallel ranks x tensor parallel 2" in result.stdout
