"""Stage 04: speculators' real trainer on the miniature; Kimi head tensors; CPU layer; resume."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from eagle3_pipeline.checkpoints import complete as checkpoint_dirs
from eagle3_pipeline.compat import cpu_trainer
from eagle3_pipeline.config import DraftConfig, TrainConfig, build_config
from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.metrics import read_metrics
from eagle3_pipeline.target import weight_map
from eagle3_pipeline.training import resolve_kernels, speculators_argv

from conftest import REPO, run_stage


def _kimi_tensor(target, key):
    with safe_open(str(target / weight_map(target)[key]), "pt") as handle:
        return handle.get_tensor(key)


def test_trained_draft_uses_the_kimi_wrappers_language_model_tensors(kimi_run, kimi_target):
    import numpy as np
    import speculators.models  # noqa: F401
    from speculators.model import SpeculatorModel

    model = SpeculatorModel.from_pretrained(str(kimi_run["checkpoints"] / "checkpoint_best"))
    embed = _kimi_tensor(kimi_target, "language_model.model.embed_tokens.weight")
    lm_head = _kimi_tensor(kimi_target, "language_model.lm_head.weight")
    norm = _kimi_tensor(kimi_target, "language_model.model.norm.weight")
    draft_ids = torch.from_numpy(np.arange(256) + np.load(kimi_run["vocab"] / "d2t.npy"))
    dtype = model.embed_tokens.weight.dtype
    assert torch.equal(model.embed_tokens.weight, embed.to(dtype))
    assert torch.equal(model.verifier_lm_head.weight, lm_head[draft_ids].to(dtype))  # cut to the draft vocab
    assert torch.equal(model.verifier_norm.weight, norm.to(dtype))


def test_training_wrote_checkpoints_metrics_and_summary(kimi_run):
    ckpt = kimi_run["checkpoints"]
    assert [p.name for p in checkpoint_dirs(ckpt)] == ["0", "1"]  # cpu-mini: 2 epochs, one checkpoint each
    assert (ckpt / "checkpoint_best").resolve().name in {"0", "1"}
    records = read_metrics(ckpt / "metrics.jsonl")
    val = [r["val"] for r in records if "val" in r]
    assert len(val) == 2 and all("full_acc_0_epoch" in v and "loss_epoch" in v for v in val)
    assert any("train" in r for r in records)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["complete"] and manifest["aux_layer_ids"] == [2, 3, 4] and manifest["draft_vocab_size"] == 256
    command = (ckpt / "command.txt").read_text()
    assert "--draft-attn-impl sdpa" in command and "--loss-implementation eager" in command  # CPU path
    assert "--target-layer-ids 2 3 4" in command


@pytest.mark.slow
def test_rerun_with_more_epochs_is_refused_and_keeps_every_checkpoint(tmp_path, kimi_run, kimi_target):
    """speculators restores the old lr scheduler on a resume (its base lr and position): a changed
    --epochs would train at the wrong lr while the manifest said otherwise, so it is refused."""
    work = tmp_path / "ckpt"
    shutil.copytree(kimi_run["checkpoints"], work, symlinks=True)
    before = {p.name: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}
    result = run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"],
                       "--vocab", kimi_run["vocab"], "--output", work, "--epochs", "3", "--logger", "", check=False)
    assert result.returncode == 3
    assert "settings.epochs = 2 there, 3 in this run; a resume restores the old optimizer and lr schedule" in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_two_process_training_logs_once_resumes_and_exports(tmp_path, kimi_run, kimi_target, sharding):
    # The multi-GPU path (torchrun + speculators' DDP, or FSDP2) with gloo on the CPU: one
    # metrics line per logged step (rank 0 only), a checkpoint per epoch, a rerun that
    # resumes, and a checkpoint stage 05 exports.
    out = tmp_path / "ckpt"
    args = ("--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"],
            "--vocab", kimi_run["vocab"], "--output", out, "--nproc", "2", "--logger", "", *sharding)
    first = run_stage("train", *args, "--epochs", "1")
    command = (out / "command.txt").read_text()
    assert "eagle3_pipeline.torchrun" in command and ("--fsdp-shard" in command) == bool(sharding)
    assert (first.stdout + first.stderr).count("Destroyed distributed process group") == 2  # two ranks
    records = read_metrics(out / "metrics.jsonl")
    steps = [r["global_step"] for r in records if "train" in r]
    assert steps and len(steps) == len(set(steps))  # not one line per rank
    assert [p.name for p in checkpoint_dirs(out)] == ["0"]
    second = run_stage("train", *args, "--epochs", "1")
    assert "nothing to do" in second.stdout + second.stderr  # a finished run is a no-op
    assert [p.name for p in checkpoint_dirs(out)] == ["0"]
    run_stage("export", "--checkpoints", out, "--output", tmp_path / "draft")
    assert (tmp_path / "draft" / "model.safetensors").is_file()


def test_cpu_layer_applies_only_without_an_accelerator(monkeypatch):
    assert not cpu_trainer.accelerator_present()
    assert cpu_trainer.apply() is True
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert cpu_trainer.apply() is False


def test_kernels_follow_the_device(monkeypatch):
    cfg, _ = build_config(TrainConfig, {"target": "t", "data": "d", "vocab": "v", "output": "o"})
    assert resolve_kernels(cfg) == ("sdpa", "eager")
    monkeypatch.setattr("eagle3_pipeline.training.on_gpu", lambda: True)
    assert resolve_kernels(cfg) == ("simple_flex_attention", "fused")
    argv = speculators_argv(cfg, DraftConfig(num_layers=1, ttt_steps=3), "/t", [2, 30, 58], 32000, 0.9, 163839)
    assert argv[argv.index("--draft-attn-impl") + 1] == "simple_flex_attention"
    assert argv[argv.index("--target-layer-ids") + 1: argv.index("--target-layer-ids") + 4] == ["2", "30", "58"]
    assert "--save-best" not in argv  # it deletes foreign files and skips non-improving epochs


def test_resume_with_another_optimizer_is_refused(tmp_path, kimi_run, kimi_target):
    """Saved optimizer state only loads into the same optimizer: refuse before speculators crashes."""
    work = tmp_path / "ckpt"
    shutil.copytree(kimi_run["checkpoints"], work, symlinks=True)
    result = run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"],
                       "--vocab", kimi_run["vocab"], "--output", work, "--optimizer", "muon", check=False)
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: {work / 'manifest.json'}: {work} holds a finished result made with settings.optimizer = \"adamw\" "
        f"there, \"muon\" in this run; a resume restores the old optimizer")


@pytest.mark.slow
def test_validation_unrolls_the_served_depth_while_training_keeps_its_ttt_steps(tmp_path, kimi_run, kimi_target):
    """--val-ttt-steps 5 on a draft trained 3 TTT steps deep (compat/val_depth.py): every epoch's validation has
    full_acc for 5 positions, so the offline tau reaches k = 5; the training steps still unroll 3."""
    out = tmp_path / "ckpt"
    run_stage("train", "--profile", "cpu-mini", "--target", kimi_target, "--data", kimi_run["data"], "--vocab",
              kimi_run["vocab"], "--output", out, "--epochs", "1", "--val-ttt-steps", "5", "--logger", "")
    records = read_metrics(out / "metrics.jsonl")
    val = [r["val"] for r in records if "val" in r]
    assert val and all(f"full_acc_{i}_epoch" in v for v in val for i in range(5)) and "full_acc_5_epoch" not in val[-1]
    trained = {key for r in records if "train" in r for key in r["train"]}
    assert "full_acc_2" in trained and "full_acc_3" not in trained  # the training forward: 3 steps
    manifest = json.loads((out / "manifest.json").read_text())
    assert "val_depth" in manifest["compat_applied"]
    assert len(manifest["summary"]["full_acc"]) == 5 and "5" in {str(k) for k in manifest["summary"]["expected_accepted_length"]}
    assert "--ttt-steps 3" in (out / "command.txt").read_text()


def test_validation_depth_is_the_served_k_unless_given():
    from eagle3_pipeline.training import val_ttt_steps

    required = {"target": "t", "data": "d", "vocab": "v", "output": "o"}
    draft = DraftConfig(num_speculative_tokens=5, ttt_steps=3)
    assert val_ttt_steps(TrainConfig(**required), draft) == 5
    assert val_ttt_steps(TrainConfig(**required, ttt_steps=7), draft) == 7  # never shallower than training
    assert val_ttt_steps(TrainConfig(**required, val_ttt_steps=2), draft) == 3
    assert val_ttt_steps(TrainConfig(**required, val_ttt_steps=6), DraftConfig()) == 6


def test_a_val_ttt_steps_below_the_ttt_steps_is_raised_and_recorded_as_run_not_as_asked():
    """Issue 64: --val-ttt-steps 2 under 3 TTT steps validated 3 deep while --print-config and the manifest (the
    run's config) kept 2, and nothing said so."""
    from eagle3_pipeline.config.resolution import Sources
    from eagle3_pipeline.training import fit_val_ttt_steps

    required = {"target": "t", "data": "d", "vocab": "v", "output": "o"}
    fitted, note = fit_val_ttt_steps(TrainConfig(**required, val_ttt_steps=2), Sources(val_ttt_steps="flag"),
                                     DraftConfig(ttt_steps=3))
    assert fitted.model_dump()["val_ttt_steps"] == 3  # what 04 records in its manifest's config
    assert note == "val_ttt_steps: 3 instead of 2 (flag): validation unrolls at least the 3 TTT steps training runs"
    kept, note = fit_val_ttt_steps(TrainConfig(**required, val_ttt_steps=5), Sources(), DraftConfig(ttt_steps=3))
    assert kept.val_ttt_steps == 5 and note is None


def test_print_config_shows_the_step_size_and_validation_depth_the_run_uses(kimi_run, capsys):
    """Issue 64: --print-config printed total_seq_len 32768 where the small-run rule gives this data 8192 (it now
    reads --data's stage 01 counts when they are there), and val_ttt_steps as asked."""
    from eagle3_pipeline.config import resolve_stage_config
    from eagle3_pipeline.training import resolved_for_print_config

    def printed(*flags) -> dict[str, str]:
        argv = ["--target", "t", "--data", str(kimi_run["data"]), "--vocab", "v", "--output", "o", *flags]
        with pytest.raises(SystemExit) as stop:
            resolve_stage_config(TrainConfig, [*argv, "--print-config"], run_time_notes=resolved_for_print_config)
        assert stop.value.code == 0
        return {line.split(" = ")[0]: line for line in capsys.readouterr().out.splitlines() if " = " in line}

    lines = printed("--val-ttt-steps", "1")
    assert lines["total_seq_len"].startswith("total_seq_len = 32768  # default -> 8192 (the run would take ~"), lines
    assert lines["val_ttt_steps"] == ("val_ttt_steps = 1  # flag -> 3 (validation unrolls at least the 3 TTT steps "
                                      "training runs)")
    assert "->" not in printed("--total-seq-len", "32768")["total_seq_len"]  # an explicit value is kept


def test_the_exported_checkpoint_is_the_best_offline_tau_not_the_lowest_loss(tmp_path, kimi_run):
    """An epoch with the higher offline tau at the served k but a higher validation loss wins; checkpoint_best
    follows it; the choice and every epoch's figures are recorded (train_report.choose_checkpoint)."""
    import os

    from eagle3_pipeline.train_report import choose_checkpoint, format_summary

    work = tmp_path / "ckpt"
    shutil.copytree(kimi_run["checkpoints"], work, symlinks=True)
    for epoch, (acc, loss) in {"0": (0.9, 9.0), "1": (0.1, 1.0)}.items():
        val = json.loads((work / epoch / "val_metrics.json").read_text())
        val.update({key: acc for key in val if key.startswith("full_acc_")}, loss_epoch=loss)
        (work / epoch / "val_metrics.json").write_text(json.dumps(val))
    (work / "checkpoint_best").unlink()
    (work / "checkpoint_best").symlink_to("1")  # speculators' choice: the lowest loss
    best, choice = choose_checkpoint(work, 3)
    assert best == work / "0" and os.readlink(work / "checkpoint_best") == "0"
    assert choice["chosen"] == "0" and choice["lowest_val_loss"] == "1" and choice["by_epoch"]["0"]["k"] == 3
    assert choice["by_epoch"]["0"]["tau"] == pytest.approx(1 + 3 * 0.9) and choice["by_epoch"]["1"]["val_loss"] == 1.0
    text = format_summary({"best_checkpoint": str(best), "best_epoch": 0, "checkpoint_choice": choice})
    assert "(epoch 0, highest offline tau at k=3)" in text, text  # its loss is the higher one: said by the rule used
    assert "(epoch 1, lowest val loss)" in format_summary({"best_checkpoint": str(work / "1"), "best_epoch": 1})
    for epoch in ("0", "1"):  # a tie in tau: the lower loss
        val = json.loads((work / epoch / "val_metrics.json").read_text())
        val.update({key: 0.5 for key in val if key.startswith("full_acc_")})
        (work / epoch / "val_metrics.json").write_text(json.dumps(val))
    assert choose_checkpoint(work, 3)[0] == work / "1" and os.readlink(work / "checkpoint_best") == "1"


def test_a_checkpoint_saved_without_its_validation_is_named_in_the_choice_and_the_summary(tmp_path, kimi_run, caplog):
    """Issue 64: 04 killed after an epoch's checkpoint was saved and before its validation ended, then resumed: that
    epoch has no val_metrics.json. Before, it was left out of the choice and of summary.json silently; now the choice
    (summary.json's checkpoint_choice, the manifest's summary) lists it as not validated, summary.txt and the log
    say so."""
    import logging

    from eagle3_pipeline.train_report import choose_checkpoint, format_summary

    work = tmp_path / "ckpt"
    shutil.copytree(kimi_run["checkpoints"], work, symlinks=True)
    (work / "1" / "val_metrics.json").unlink()
    with caplog.at_level(logging.WARNING, logger="eagle3"):
        best, choice = choose_checkpoint(work, 3)
    assert best == work / "0" and choice["chosen"] == "0" and list(choice["by_epoch"]) == ["0"], choice
    assert choice["not_validated"] == ["1"] and "left out of the choice" in choice["not_validated_why"], choice
    assert "checkpoint(s) 1 saved without validation metrics" in caplog.text, caplog.text
    text = format_summary({"best_checkpoint": str(best), "best_epoch": 0, "checkpoint_choice": choice})
    assert "not validated   : checkpoint(s) 1 saved without validation metrics" in text, text
    (work / "1" / "val_metrics.json").write_text((work / "0" / "val_metrics.json").read_text())
    assert "not_validated" not in choose_checkpoint(work, 3)[1]  # every epoch validated: nothing to say


# Stage 04 in one process (nproc 1 runs speculators' trainer in-process), with two spies around
# Eagle3DraftModel.forward: `inner` (installed before compat.apply, so the noise wrapper sits above it) sees what
# speculators' forward receives; `outer` (installed right after compat.apply) sees what the trainer passes. Prints,
# per forward call, train/val mode and the largest change of the aux slots and of the last slot between the two.
_SPY_04 = textwrap.dedent("""
    import json, runpy, sys
    from speculators.models.eagle3 import core
    from eagle3_pipeline import compat

    calls, keys = [], ("hidden_states", "verifier_last_hidden_states")
    below_noise = core.Eagle3DraftModel.forward

    def inner(self, *args, **kwargs):
        calls[-1]["inner"] = {k: kwargs[k].detach().clone() for k in keys}
        return below_noise(self, *args, **kwargs)

    core.Eagle3DraftModel.forward = inner
    original_apply = compat.apply

    def apply(metrics_path):
        applied = original_apply(metrics_path)
        wrapped = core.Eagle3DraftModel.forward

        def outer(self, *args, **kwargs):
            calls.append({"training": self.training, "outer": {k: kwargs[k].detach().clone() for k in keys}})
            return wrapped(self, *args, **kwargs)

        core.Eagle3DraftModel.forward = outer
        return applied

    compat.apply = apply
    sys.argv = ["04_train.py", *sys.argv[1:]]
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as exc:
        assert not exc.code, exc.code
    report = []
    for c in calls:
        aux = (c["inner"]["hidden_states"] - c["outer"]["hidden_states"])
        report.append({"training": c["training"], "aux_max": float(aux.abs().max()), "aux_std": float(aux.std()),
                       "last_max": float((c["inner"]["verifier_last_hidden_states"]
                                          - c["outer"]["verifier_last_hidden_states"]).abs().max())})
    print("SPY " + json.dumps(report))
""")


def _spied_04(tmp_path, kimi_run, kimi_target, *flags):
    out = tmp_path / "ckpt"
    driver = _SPY_04.replace("SCRIPT", repr(str(REPO / "eagle3-train" / "04_train.py")))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-c", driver, "--profile", "cpu-mini", "--target", str(kimi_target),
                             "--data", str(kimi_run["data"]), "--vocab", str(kimi_run["vocab"]), "--output", str(out),
                             "--epochs", "1", "--logger", "", *flags],
                            capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    calls = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("SPY "))[4:])
    return calls, json.loads((out / "manifest.json").read_text())


@pytest.mark.slow
def test_noise_std_perturbs_only_the_aux_slots_of_training_steps(tmp_path, kimi_run, kimi_target):
    """--noise-std (compat/feature_noise.py) with speculators' real trainer: 0 leaves every batch as the loader made
    it and installs nothing; 0.5 changes the aux slots of each training step by N(0, 0.5^2) and never the last slot
    (the target logits' source), and validation's batches stay as they were. Recorded in the config and identity."""
    calls, manifest = _spied_04(tmp_path / "off", kimi_run, kimi_target)
    assert any(c["training"] for c in calls) and any(not c["training"] for c in calls)
    assert all(c["aux_max"] == 0 and c["last_max"] == 0 for c in calls)
    assert "feature_noise" not in manifest["compat_applied"] and manifest["config"]["noise_std"] == 0
    assert "noise_std" not in manifest["identity"]["settings"]  # a run without noise keeps the identity it had

    calls, manifest = _spied_04(tmp_path / "on", kimi_run, kimi_target, "--noise-std", "0.5")
    train, val = [c for c in calls if c["training"]], [c for c in calls if not c["training"]]
    assert train and val
    assert all(c["aux_max"] > 0 and 0.4 < c["aux_std"] < 0.6 for c in train)
    assert all(c["last_max"] == 0 for c in calls)
    assert all(c["aux_max"] == 0 for c in val)
    assert "feature_noise" in manifest["compat_applied"]
    assert manifest["config"]["noise_std"] == 0.5 and manifest["identity"]["settings"]["noise_std"] == 0.5


def test_feature_noise_is_out_of_place_and_zero_is_nothing():
    from eagle3_pipeline.compat import feature_noise

    x = torch.ones(1, 64, 12)
    assert feature_noise.add_noise(x, 0.0) is x
    y = feature_noise.add_noise(x, 0.1)
    assert torch.equal(x, torch.ones(1, 64, 12)) and y.dtype == x.dtype and not torch.equal(x, y)
    cfg, _ = build_config(TrainConfig, {"target": "t", "data": "d", "vocab": "v", "output": "o"})
    assert cfg.noise_std == 0.0
    with pytest.raises(ConfigError, match="--noise-std .*greater than or equal to 0"):
        build_config(TrainConfig, {"target": "t", "data": "d", "vocab": "v", "output": "o", "noise_std": -0.1})
