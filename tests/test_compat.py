"""The compat layer (`eagle3_pipeline.compat`): every runtime change to speculators, its gate and
its effect. CPU tests run everywhere; the GPU tests (marked `gpu`) run the compiled kernels."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from eagle3_pipeline import compat
from eagle3_pipeline.compat import device_prefetch, flex_forward_config, fused_loss, metrics_jsonl, stall_watch
from eagle3_pipeline.metrics import COMPAT_KEY, METRICS_FILE, MetricsJsonlHandler, compat_applied, read_metrics

# ---------------------------------------------------------------- the registry

# Run in a fresh process: the fixes patch speculators for the rest of the process. Prints, per
# fix, whether its change is visible on speculators after `compat.apply`.
_APPLY_AND_LOOK = textwrap.dedent("""
    import json, sys
    import speculators.train.cli as cli
    import speculators.train.dataloader as dataloader
    import speculators.train.trainer as trainer
    import speculators.train.checkpointer as ckpt
    from speculators.losses import fused
    from speculators.models import attention
    from speculators.models.eagle3 import Eagle3DraftModel
    from eagle3_pipeline import compat

    shared_before = fused.loss_backward_kernel.configs is fused.loss_forward_kernel.configs
    applied = compat.apply(sys.argv[1])
    visible = {
        "cpu_trainer": any(c.__name__ == "CpuTrainer" for c in cli.Trainer.__mro__),
        "fused_loss": shared_before and fused.loss_backward_kernel.configs is not fused.loss_forward_kernel.configs,
        "flex_forward_config": hasattr(attention.flex_attention, "wrapped"),
        "interrupt_progress": bool(getattr(trainer.Trainer, "_eagle3_progress", False)),
        "resume_agreement": bool(getattr(ckpt.BaseCheckpointer._get_previous_epoch, "_eagle3_resume_agreement", False)),
        "samples_record": bool(getattr(trainer.Trainer, "_eagle3_samples_record", False)),
        "epoch_val_metrics": bool(getattr(trainer.Trainer.maybe_update_best, "_eagle3_epoch_val_metrics", False)),
        "metrics_jsonl": hasattr(cli.setup_metric_logger, "wrapped"),
        "device_prefetch": bool(getattr(cli.create_train_val_loaders, "_device_prefetch", False)),
        "sample_check": bool(getattr(cli.create_train_val_loaders, "_sample_check", False)),
        "finite_loss": cli.Trainer.__name__ == "FiniteLossTrainer",
        "val_depth": bool(getattr(Eagle3DraftModel.get_trainer_kwargs, "_eagle3_val_depth", False)),
        "feature_noise": bool(getattr(Eagle3DraftModel.forward, "_eagle3_feature_noise", False))
                         and bool(getattr(Eagle3DraftModel.get_trainer_kwargs, "_eagle3_feature_noise", False)),
        "online_generation": dataloader.ArrowDataset.__name__ == "OnlineArrowDataset",
        "stall_watch": bool(getattr(trainer.Trainer.run_training, "_stall_watch", False)),
    }
    print(json.dumps({"applied": applied, "visible": visible}))
""")


def test_apply_returns_the_name_of_every_change_it_made_and_no_other(tmp_path):
    # stage 04's sample-check settings (training.export_compat_settings), as every training process gets them
    checks = json.dumps({"slots": 4, "hidden": 64, "dtype": "float32", "storage": "dtype", "on_bad": "stop"})
    env = {**os.environ, "EAGLE3_SAMPLE_CHECK": checks, "EAGLE3_VAL_TTT_STEPS": "5",  # validation deeper than training
           "EAGLE3_NOISE_STD": "0.05",  # stage 04 --noise-std 0.05
           "EAGLE3_STALL_S": "1800"}  # stage 04 --stall-minutes 30
    env.pop("EAGLE3_INPUT_CHECKS", None)
    result = subprocess.run([sys.executable, "-c", _APPLY_AND_LOOK, str(tmp_path / METRICS_FILE)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert set(report["visible"]) == set(compat.FIXES)
    assert report["applied"] == [name for name in compat.FIXES if report["visible"][name]]
    # Gated by the machine: the CPU shim exactly without an accelerator, the GPU pieces only with CUDA.
    assert ("cpu_trainer" in report["applied"]) == (torch.accelerator.current_accelerator() is None)
    assert ("device_prefetch" in report["applied"]) == torch.cuda.is_available()
    assert {"interrupt_progress", "resume_agreement", "samples_record", "epoch_val_metrics", "metrics_jsonl", "sample_check", "finite_loss",
            "val_depth", "feature_noise", "stall_watch"} <= set(report["applied"])
    assert "online_generation" not in report["applied"]  # files mode (no EAGLE3_HIDDEN_STATES): speculators untouched


def test_metrics_handler_is_attached_after_speculators_configures_its_logger(monkeypatch, tmp_path):
    import speculators.train.cli as cli

    monkeypatch.setattr(cli, "setup_metric_logger", cli.setup_metric_logger)  # undone after the test
    path = tmp_path / METRICS_FILE
    handler = MetricsJsonlHandler(path)
    metrics_jsonl.install(handler)
    metrics_jsonl.install(handler)  # a second install wraps speculators' original, not the wrapper
    assert not hasattr(cli.setup_metric_logger.wrapped, "wrapped")
    metrics_logger = logging.getLogger(metrics_jsonl.METRICS_LOGGER)
    try:
        cli.setup_metric_logger("", "run", str(tmp_path / "logs"))  # speculators' dictConfig runs here
        metrics_logger.info({"train": {"loss": 1.5}, "global_step": 3})
        metrics_logger.info("a text message is not a metric record")
    finally:
        metrics_logger.removeHandler(handler)
    records = read_metrics(path)
    assert [(r["train"], r["global_step"]) for r in records] == [({"loss": 1.5}, 3)]
    assert isinstance(records[0]["time"], float)


def test_04_records_the_fixes_its_training_process_applied(kimi_run):
    manifest = json.loads((kimi_run["checkpoints"] / "manifest.json").read_text())
    recorded = compat_applied(kimi_run["checkpoints"] / METRICS_FILE)
    assert manifest["compat_applied"] == recorded
    assert {"cpu_trainer", "interrupt_progress", "metrics_jsonl", "sample_check", "finite_loss"} <= set(recorded)
    assert [r for r in read_metrics(kimi_run["checkpoints"] / METRICS_FILE) if COMPAT_KEY in r]


def test_04_records_the_longest_wait_its_stall_watch_saw(kimi_run):
    # the default --stall-minutes 30: the watch ran through the whole run and never fired
    records = [r[stall_watch.RECORD_KEY] for r in read_metrics(kimi_run["checkpoints"] / METRICS_FILE)
               if stall_watch.RECORD_KEY in r]
    assert len(records) == 1 and records[0]["limit_s"] == 1800.0
    assert 0 < records[0]["longest_wait_s"] < 1800 and records[0]["where"].startswith(("training", "validation", "saving"))


# A training process whose validation never gets its next batch, under a 1 s limit: the watch's own stop
# (the one stage 04 installs), with a child process standing in for a loader worker.
_STUCK = textwrap.dedent("""
    import subprocess, sys, threading, time
    from pathlib import Path
    from eagle3_pipeline.compat import stall_watch

    worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    print(worker.pid, flush=True)
    watch = stall_watch.StallWatch(1.0, stall_watch.stop_process(Path(sys.argv[1])))
    watch.mark("training epoch 1")
    watch.arm()
    for _ in range(30):  # 1.5 s of steps 50 ms apart: progress, no stall
        time.sleep(0.05)
        watch.mark()

    def stuck_in_validation():
        watch.mark("validation epoch 1")
        watch.mark()
        threading.Event().wait()  # the batch that never comes

    stuck_in_validation()
""")


def test_a_training_process_with_no_progress_for_the_limit_says_where_and_stops_resumably(tmp_path):
    from eagle3_pipeline.errors import Stalled
    from eagle3_pipeline.ranks import read_exits

    result = subprocess.run([sys.executable, "-c", _STUCK, str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "RANK": "3"})
    assert result.returncode == Stalled.exit_code == 75, result.stderr[-3000:]
    worker = result.stdout.split()[0]
    lines = result.stderr.splitlines()
    assert re.match(r"\[rank 3\] stalled: no training step or validation batch for \d+ s \(limit 1 s; "
                    r"validation epoch 1, 1 done\);", lines[0]), lines[0]
    assert lines[0] and "resume from the last checkpoint" in lines[0]
    assert "stuck_in_validation" in result.stderr  # the main thread's stack, where it waits
    assert any(line.startswith(f"  child {worker}: state ") for line in lines)  # the "loader worker"
    record = read_exits(tmp_path)[3]
    assert record["status"] == "error" and record["error"].startswith("stalled: no training step")


def test_the_watch_is_off_without_a_limit(monkeypatch):
    monkeypatch.delenv(stall_watch.ENV, raising=False)
    assert stall_watch.apply() is False
    monkeypatch.setenv(stall_watch.ENV, "0")  # 04 --stall-minutes 0
    assert stall_watch.apply() is False


def test_device_prefetch_is_not_installed_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present (the GPU tests below cover it)")
    assert device_prefetch.apply() is False


# ---------------------------------------------------------------- fused-loss fix gate


class _Kernel:
    def __init__(self, configs):
        self.configs = configs


class _FusedModule:
    def __init__(self, shared: bool):
        configs = ["c1", "c2"]
        self.loss_forward_kernel = _Kernel(configs)
        self.loss_backward_kernel = _Kernel(configs if shared else list(configs))


def test_bug_is_read_from_dynamos_source_not_just_the_version():
    unfixed = "wrapped = VariableBuilder(tx, src)._wrap(user_obj)"
    fixed = "wrapped = VariableBuilder(tx, src)(user_obj)"
    assert fused_loss.dynamo_has_config_aliasing_bug(unfixed, "2.11.0")[0] is True
    assert fused_loss.dynamo_has_config_aliasing_bug(fixed, "2.11.0")[0] is False
    assert fused_loss.dynamo_has_config_aliasing_bug(None, "2.11.0+cu130")[0] in (True, False)


def test_version_fallback_marks_only_torch_before_2_12():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_loss.inspect, "getsource", lambda _obj: (_ for _ in ()).throw(OSError()))
        assert fused_loss.dynamo_has_config_aliasing_bug(None, "2.11.0+cu130")[0] is True
        assert fused_loss.dynamo_has_config_aliasing_bug(None, "2.12.0")[0] is False
        assert fused_loss.dynamo_has_config_aliasing_bug(None, "2.13.0+cpu")[0] is False


def test_fix_separates_shared_configs_only_under_the_bug():
    module = _FusedModule(shared=True)
    decision = fused_loss.apply_fused_loss_fix(module, aliasing_bug=(True, "torch 2.11"))
    assert decision.apply
    assert module.loss_backward_kernel.configs is not module.loss_forward_kernel.configs
    assert module.loss_backward_kernel.configs == module.loss_forward_kernel.configs
    assert not fused_loss.apply_fused_loss_fix(module, aliasing_bug=(True, "torch 2.11")).apply

    untouched = _FusedModule(shared=True)
    assert not fused_loss.apply_fused_loss_fix(untouched, aliasing_bug=(False, "torch 2.13")).apply
    assert untouched.loss_backward_kernel.configs is untouched.loss_forward_kernel.configs


def test_fix_is_a_no_op_on_the_installed_torch_when_it_has_dynamos_fix():
    from speculators.losses import fused

    buggy, _why = fused_loss.dynamo_has_config_aliasing_bug()
    shared_before = fused.loss_backward_kernel.configs is fused.loss_forward_kernel.configs
    decision = fused_loss.apply_fused_loss_fix()
    assert decision.apply == (buggy and shared_before)
    if not buggy:
        assert (fused.loss_backward_kernel.configs is fused.loss_forward_kernel.configs) == shared_before


# ---------------------------------------------------------------- flex forward config


def test_flex_forward_config_applies_only_where_it_was_measured():
    assert not flex_forward_config.decide(None).apply
    hopper = flex_forward_config.decide((9, 0))
    assert hopper.apply and hopper.options == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128,
                                               "fwd_num_warps": 4, "fwd_num_stages": 3}
    for unmeasured in [(8, 0), (10, 0), (12, 0)]:  # A100, B200/B300, RTX PRO 6000
        decision = flex_forward_config.decide(unmeasured)
        assert not decision.apply and "no measured forward config" in decision.reason
    if not torch.cuda.is_available():
        assert flex_forward_config.apply() is False


def test_flex_forward_config_setting_off_and_given_options():
    given = {"fwd_BLOCK_M": 64, "fwd_num_warps": 8}
    assert not flex_forward_config.decide((9, 0), "off").apply
    assert flex_forward_config.decide((12, 0), given).options == given  # a measured winner on a new GPU
    assert not flex_forward_config.decide(None, given).apply
    assert flex_forward_config.parse_setting('{"fwd_BLOCK_M": 64, "fwd_num_warps": 8}') == given
    for bad in ['{"BLOCK_M": 64}', '{"fwd_BLOCK_M": "64"}', '{"fwd_BLOCK_M": 6.4}', "{}", "[64]", "fast"]:
        with pytest.raises(ValueError, match="expected auto, off, or a JSON object of fwd_ kernel options"):
            flex_forward_config.parse_setting(bad)


def test_04_train_flex_flag_is_checked_and_reaches_every_training_process(monkeypatch, capsys):
    from eagle3_pipeline.config import TrainConfig, resolve_stage_config
    from eagle3_pipeline.training import export_compat_settings, launch_env

    required = ["--target", "t", "--data", "d", "--vocab", "v", "--output", "o"]
    with pytest.raises(SystemExit) as stopped:
        resolve_stage_config(TrainConfig, required + ["--flex-forward-config", '{"BLOCK_M": 64}'])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: --flex-forward-config (flag):")
    assert "expected auto, off, or a JSON object of fwd_ kernel options" in error
    cfg, _ = resolve_stage_config(TrainConfig, required + ["--flex-forward-config", '{"fwd_BLOCK_M": 64}'])
    monkeypatch.delenv(flex_forward_config.ENV, raising=False)
    export_compat_settings(cfg)
    assert launch_env()[flex_forward_config.ENV] == '{"fwd_BLOCK_M": 64}'
    assert flex_forward_config.parse_setting(os.environ[flex_forward_config.ENV]) == {"fwd_BLOCK_M": 64}


def test_flex_wrapper_adds_the_config_for_head_dim_64_and_keeps_the_callers_options():
    calls = []

    def flex(query, key, value, *args, kernel_options=None, **kwargs):
        calls.append(kernel_options)
        return query

    wrapped = flex_forward_config.with_forward_config(flex, {"fwd_BLOCK_M": 64, "fwd_num_warps": 4})
    wrapped(torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64), block_mask=None)
    wrapped(torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64),
            kernel_options={"fwd_num_warps": 8})
    wrapped(torch.zeros(1, 2, 8, 128), torch.zeros(1, 2, 8, 128), torch.zeros(1, 2, 8, 128))
    assert calls == [{"fwd_BLOCK_M": 64, "fwd_num_warps": 4}, {"fwd_BLOCK_M": 64, "fwd_num_warps": 8}, None]
    every_call = flex_forward_config.with_forward_config(flex, {"fwd_BLOCK_M": 32}, head_dim=None)
    every_call(torch.zeros(1, 2, 8, 128), torch.zeros(1, 2, 8, 128), torch.zeros(1, 2, 8, 128))
    assert calls[-1] == {"fwd_BLOCK_M": 32}


def test_flex_config_reaches_the_flex_node_dynamo_traces_from_speculators_attention(monkeypatch):
    """The wrapper must be what speculators' registered attention calls when Dynamo traces
    the draft's forward: the flex_attention node of the traced graph carries the options, and
    the wrapper adds no recompiles across sequence lengths (a recompile per length ends in
    Dynamo's limit and an eager, unfused flex attention)."""
    from speculators.models import attention
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(attention, "flex_attention", attention.flex_attention)  # undone after the test
    monkeypatch.setattr(flex_forward_config, "TRACED_CALLS", {})
    attend = attention.ALL_ATTENTION_FUNCTIONS["simple_flex_attention"]

    def trace_lengths(lengths):
        torch._dynamo.reset()
        graphs = []

        def recording_backend(graph_module, _inputs):
            graphs.append(graph_module)
            return graph_module.forward

        compiled = torch.compile(lambda q, mask: attend(None, q, q, q, mask)[0], backend=recording_backend)
        for length in lengths:
            mask = create_block_mask(lambda _b, _h, q, kv: q >= kv, None, None, length, length, device="cpu")
            assert compiled(torch.randn(1, 2, length, 64), mask).shape == (1, length, 2, 64)
        return graphs

    lengths = [256, 384, 512, 640]
    compiles_without = len(trace_lengths(lengths))
    options = flex_forward_config.FORWARD_CONFIGS[(9, 0)]
    flex_forward_config.install(options)
    flex_forward_config.install(options)  # idempotent: wraps speculators' original once
    assert not hasattr(attention.flex_attention.wrapped, "wrapped")
    graphs = trace_lengths(lengths)
    assert len(graphs) == compiles_without
    flex_nodes = [node for graph in graphs for node in graph.graph.nodes
                  if node.op == "call_function" and "flex_attention" in str(node.target)]
    assert flex_nodes
    for node in flex_nodes:
        node_options = next(arg for arg in node.args if isinstance(arg, dict))
        assert {key: node_options[key] for key in options} == options
    assert flex_forward_config.traced_calls_summary() == (
        f"q/k/v torch.float32/torch.float32/torch.float32 head_dim 64 options {dict(sorted(options.items()))}")


# ---------------------------------------------------------------- GPU only

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_COMPILED_FUSED_LOSS = textwrap.dedent("""
    import sys, torch
    from eagle3_pipeline.compat.fused_loss import apply_fused_loss_fix
    if sys.argv[1] == "fix":
        print(apply_fused_loss_fix())
    from speculators.losses.fused import fused_kl_div_loss
    from speculators.losses.eager import kl_div_loss

    @torch.compile
    def three_steps(logits, targets):
        # Like the draft's compiled forward: the loss once per TTT step, with a graph break
        # between steps (speculators' extend_mask_for_draft_tokens is compiler-disabled), so
        # each graph holds one loss call with its forward and backward kernel.
        total = 0
        for s in range(3):
            total = total + fused_kl_div_loss(logits * (1 + s), targets).sum()
            torch._dynamo.graph_break()
        return total

    torch.manual_seed(0)
    logits = torch.randn(1, 256, 32000, device="cuda", requires_grad=True)
    targets = torch.randn(1, 256, 32000, device="cuda")
    loss = three_steps(logits, targets)
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = sum(kl_div_loss(ref_logits * (1 + s), targets).sum() for s in range(3))
    ref.backward()
    rel = lambda a, b: float((a - b).norm() / b.norm())
    print("loss_rel", rel(loss.detach(), ref.detach()), "grad_rel", rel(logits.grad, ref_logits.grad))
    assert rel(loss.detach(), ref.detach()) < 1e-3 and rel(logits.grad, ref_logits.grad) < 1e-3
""")


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """A fresh process (its own Dynamo and Triton state, its own speculators patches)."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)


def _run_compiled_fused_loss(mode: str) -> subprocess.CompletedProcess:
    return _run_script(_COMPILED_FUSED_LOSS, mode)


@gpu
@needs_cuda
def test_compiled_fused_loss_matches_eager_with_the_fix():
    result = _run_compiled_fused_loss("fix")
    assert result.returncode == 0, result.stderr[-3000:]


@gpu
@needs_cuda
def test_without_the_fix_the_compiled_fused_loss_fails_exactly_where_the_gate_applies():
    from speculators.losses import fused

    needed = fused_loss.decide(fused).apply or (
        fused.loss_backward_kernel.configs is not fused.loss_forward_kernel.configs
        and fused_loss.dynamo_has_config_aliasing_bug()[0])
    result = _run_compiled_fused_loss("nofix")
    if needed:
        assert result.returncode != 0
        assert "already tracked for mutation" in result.stderr
    else:
        assert result.returncode == 0, result.stderr[-3000:]


@gpu
@needs_cuda
def test_device_prefetch_loader_yields_the_same_batches_on_the_device():
    batches = [{"x": torch.full((4, 1024), float(i)).pin_memory(), "n": i} for i in range(5)]

    class Loader(list):
        batch_sampler = "sampler"

    loader = device_prefetch.DevicePrefetchLoader(Loader(batches), torch.device("cuda", 0))
    assert len(loader) == 5 and loader.batch_sampler == "sampler"
    seen = [(batch["n"], batch["x"].device.type, float(batch["x"].sum())) for batch in loader]
    assert seen == [(i, "cuda", 4 * 1024 * i) for i in range(5)]
    for batch in loader:  # an early break (--max-steps) ends the producer before the next epoch
        break
    assert [batch["n"] for batch in loader] == list(range(5))


@gpu
@needs_cuda
def test_device_prefetch_stages_the_per_step_scalar_on_the_device():
    loader = device_prefetch.DevicePrefetchLoader([{"error_records": 3}], torch.device("cuda", 0))
    (batch,) = list(loader)
    assert batch["error_records"].device.type == "cuda" and int(batch["error_records"]) == 3


_COMPILED_FLEX = textwrap.dedent("""
    import sys, torch
    from speculators.models.eagle3.attention import create_combined_mask_mod
    from torch._inductor.utils import run_and_get_code
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from eagle3_pipeline.compat.flex_forward_config import decide, with_forward_config

    tokens, heads = 8192, 64  # speculators' mask at 2,047-token documents, window 2048
    doc_ids = torch.arange(tokens, device="cuda") // 2047
    mask = create_block_mask(create_combined_mask_mod(doc_ids, tokens, 2048), None, None, tokens, tokens,
                             device="cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(1, heads, tokens, 64, device="cuda", dtype=torch.bfloat16)

    def forward_backward(attend):
        out = torch.compile(lambda q, k, v: attend(q, k, v, block_mask=mask))(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        torch._dynamo.reset()
        return out, grads

    decision = decide(torch.cuda.get_device_capability())
    print(decision.reason)
    reference, reference_grads = forward_backward(flex_attention)
    if decision.apply:
        attend = with_forward_config(flex_attention, decision.options)
        (out, grads), code = run_and_get_code(forward_backward, attend)
        assert "BLOCK_M : tl.constexpr = %d" % decision.options["fwd_BLOCK_M"] in "".join(code), "config not in the kernel"
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
        diffs = [rel(out, reference)] + [rel(g, r) for g, r in zip(grads, reference_grads)]
        print("rel diffs out/dq/dk/dv", diffs)
        assert max(diffs) < 1e-2, diffs
""")


@gpu
@needs_cuda
def test_flex_forward_config_reaches_the_kernel_and_keeps_outputs_and_grads():
    result = _run_script(_COMPILED_FLEX)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)


def test_the_version_gate_refuses_another_speculators_with_one_line_naming_the_fix():
    from importlib import metadata

    from eagle3_pipeline.compat.gate import require_speculators, speculators_supported

    installed = metadata.version("speculators")
    require_speculators("sample_check", (installed,), "speculators/train/data.py")  # this version: no error
    assert speculators_supported((installed,)) and not speculators_supported(("0.0.1",))
    with pytest.raises(RuntimeError) as refused:
        require_speculators("sample_check", ("0.0.1",), "speculators/train/data.py")
    assert str(refused.value) == (f"compat/sample_check.py was written for speculators ('0.0.1',), found {installed}; "
                                  f"re-check it against speculators/train/data.py")


@pytest.mark.reliability
def test_skipping_stops_above_max_bad_fraction_counting_each_sample_once_over_ranks_and_epochs(tmp_path):
    """compat/sample_check.left_out_problem: every rank's and worker's lines count, each sample once (epochs and
    ranks read a bad file again), the limit is a fraction of the run's samples as in stage 01, and a run with
    every sample left out stops even at --max-bad-fraction 1; each call reads only the lines added since."""
    from eagle3_pipeline.compat import sample_check

    record = tmp_path / sample_check.RECORD_NAME
    config = {"samples": 20, "max_bad_fraction": 0.1, "data": "DATA", "record": str(record)}

    def skip(sample: str) -> None:
        sample_check.record(str(record), {"file": f"hs/{sample}", "sample": sample, "row": 0, "reason": "bad",
                                          "action": "skip"})

    assert sample_check.left_out_problem(config) is None  # no record yet
    for sample in ("a", "b", "a", "b", "a"):  # 2 of 20 (10%): at the limit, not above it
        skip(sample)
    assert sample_check.left_out_problem(config) is None
    with record.open("a") as handle:  # a line still being written: not read yet
        handle.write('{"file": "hs/c", "sample": "c", "act')
    assert sample_check.left_out_problem(config) is None
    with record.open("a") as handle:
        handle.write('ion": "skip", "reason": "bad"}\n')
    line = sample_check.left_out_problem(config)
    assert line == "DATA: 3 of 20 samples are bad (15.0% > --max-bad-fraction 10.0%); first: hs/a: bad"
    assert sample_check.too_many_bad(line)
    every = {**config, "samples": 3, "max_bad_fraction": 1.0}
    assert sample_check.left_out_problem(every) == "DATA: all 3 samples are bad, none is left to train on; first: hs/a: bad"
    assert sample_check.left_out_problem({**every, "samples": 4}) is None  # one sample left to train on


_EPOCH_VAL_METRICS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from types import SimpleNamespace
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.trainer import Trainer
    from eagle3_pipeline.compat import epoch_val_metrics

    save = Path(sys.argv[1])
    for epoch in ("0", "1"):  # what maybe_save_checkpoint saved before each validation; epoch 2 was not saved
        (save / epoch).mkdir(parents=True)
    if sys.argv[2] == "fixed":
        epoch_val_metrics.apply()
    run = SimpleNamespace(best_val_loss=float("inf"), config=SimpleNamespace(save_best=False, checkpoint_freq=1),
                          checkpointer=SingleGPUCheckpointer(save))
    for epoch, loss, acc in ((0, 2.0, 0.25), (1, 2.5, 0.5), (2, 3.0, 0.6)):  # the loss rises after epoch 0
        Trainer.maybe_update_best(run, epoch, {"loss_epoch": loss, "full_acc_0_epoch": acc})
    print(json.dumps({"best": (save / "checkpoint_best").readlink().name, "best_val_loss": run.best_val_loss,
                      "files": {e: json.loads(p.read_text()) for e in ("0", "1", "2")
                                if (p := save / e / "val_metrics.json").exists()},
                      "listing": sorted(p.name for p in (save / "1").iterdir())}))
""")


@pytest.mark.parametrize("mode", ["speculators", "fixed"])
def test_every_saved_epoch_keeps_its_validation_metrics_though_its_loss_rose(tmp_path, mode):
    """speculators 0.9.0's Trainer.maybe_update_best (real, on its real checkpointer) writes an epoch's
    val_metrics.json only for a new lowest loss: epoch 1, whose loss rose but whose accuracy is the best, had none,
    so 04's choice by offline tau could not see it. compat/epoch_val_metrics writes it, as speculators would; the best
    by loss (checkpoint_best, best_val_loss) stays speculators'; an epoch with no saved folder gets nothing."""
    from eagle3_pipeline.checkpoints import epoch_folders

    result = subprocess.run([sys.executable, "-c", _EPOCH_VAL_METRICS, str(tmp_path / "ckpt"), mode],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["best"] == "0" and report["best_val_loss"] == 2.0
    epoch0 = {"loss_epoch": 2.0, "full_acc_0_epoch": 0.25}
    if mode == "speculators":
        assert report["files"] == {"0": epoch0}
    else:
        assert report["files"] == {"0": epoch0, "1": {"loss_epoch": 2.5, "full_acc_0_epoch": 0.5}}
        assert report["listing"] == ["val_metrics.json"]  # written through a temp and renamed: no temp left
    assert not (tmp_path / "ckpt" / "2").exists()
    assert [p.name for p in epoch_folders(tmp_path / "ckpt")] == ["0", "1"]


def test_a_val_metrics_temp_left_by_a_killed_write_keeps_the_folder_a_checkpoint(tmp_path):
    """A kill between epoch_val_metrics' temp write and its rename leaves `.val_metrics.json.tmp-*` in the epoch's
    folder: the folder is still speculators' checkpoint (stage 04 tidies and resumes), not a folder a person made."""
    from eagle3_pipeline.checkpoints import epoch_folders, foreign_epoch_folders
    from eagle3_pipeline.files import temp_path_for

    folder = tmp_path / "3"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    temp_path_for(folder / "val_metrics.json").write_text('{"loss_ep')
    assert [p.name for p in epoch_folders(tmp_path)] == ["3"] and foreign_epoch_folders(tmp_path) == []
    (folder / "notes.txt").write_text("mine")
    assert foreign_epoch_folders(tmp_path) == [folder]
