"""Stage configs and machine profiles: precedence default < profile < flag, unknown keys refused,
every shipped profile and draft_config.json valid, --print-config showing where each value came from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle3_pipeline.config import (
    DEFAULT_DRAFT_CONFIG,
    PROFILES_DIR,
    SCRIPTS_DIR,
    STAGE_CONFIGS,
    DraftConfig,
    ExtractConfig,
    TrainConfig,
    build_config,
    build_parser,
    load_draft_config,
    load_profile,
    resolve_stage_config,
)
from eagle3_pipeline.config.schema import _field, field_meta
from eagle3_pipeline.errors import ConfigError
from eagle3_pipeline.stage import stage_identity
from eagle3_pipeline.training import speculators_argv

from conftest import run_stage

PROFILES = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
EIGHT_GPU = ["rtx-pro-6000-8x", "b300-8x", "h200-8x"]
# What may differ between two GPU boxes (the list): everything else is the recipe.
MACHINE_FIELDS = {
    "extract": {"tensor_parallel_size", "gpu_memory_utilization", "attention_backend", "kv_cache_dtype",
                "max_num_seqs", "dtype"},
    "train": {"nproc", "total_seq_len", "attn_impl", "num_workers", "prefetch_factor", "hidden_states_dtype"},
}


def required(cls) -> dict:
    """Placeholder values for a stage's required flags (paths are not opened by the config)."""
    return {name: "x" for name, info in cls.model_fields.items() if info.is_required()}


def resolved(profile: str, stage: str) -> dict:
    cls = STAGE_CONFIGS[stage]
    cfg, _ = build_config(cls, required(cls), profile)
    return cfg.model_dump()


def test_shipped_profiles_include_the_four_machines_and_the_miniature():
    assert {"rtx-pro-6000-8x", "b300-8x", "h200-8x", "one-gpu-smoke", "cpu-mini"} <= set(PROFILES)


def test_profile_beats_default_and_flag_beats_profile():
    flags = {**required(TrainConfig), "total_seq_len": 1024}
    cfg, sources = build_config(TrainConfig, flags, "rtx-pro-6000-8x")
    assert (cfg.total_seq_len, sources["total_seq_len"]) == (1024, "flag")  # flag over profile's 32768
    assert (cfg.nproc, sources["nproc"]) == (8, "profile:rtx-pro-6000-8x")  # profile over default 1
    assert (cfg.lr, sources["lr"]) == (1e-3, "default")
    cfg, sources = build_config(TrainConfig, required(TrainConfig))
    assert (cfg.nproc, cfg.total_seq_len, sources["nproc"]) == (1, 32768, "default")


def test_flags_parsed_from_argv_override_the_profile_only_when_given():
    argv = ["--target", "t", "--data", "d", "--profile", "b300-8x", "--max-num-seqs", "7"]
    cfg, sources = resolve_stage_config(ExtractConfig, argv)
    assert (cfg.max_num_seqs, sources["max_num_seqs"]) == (7, "flag")
    assert (cfg.tensor_parallel_size, sources["tensor_parallel_size"]) == (8, "profile:b300-8x")
    assert sources["gpu_memory_utilization"] == "default"  # an argparse default must not mask the profile


@pytest.mark.parametrize("profile", PROFILES)
def test_every_shipped_profile_validates_for_every_stage(profile):
    sections = load_profile(profile)
    for stage, cls in STAGE_CONFIGS.items():
        cfg, sources = build_config(cls, required(cls), profile)
        for key, value in sections.get(stage, {}).items():
            assert sources[key] == f"profile:{profile}"
            assert getattr(cfg, key) == value


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_reasons_name_values_the_profile_sets(profile):
    data = json.loads((PROFILES_DIR / f"{profile}.json").read_text())
    assert data.get("description"), "a profile says which machine it is for"
    set_keys = {f"{stage}.{key}" for stage, values in load_profile(profile).items() for key in values}
    reasons = {key: why for key, why in data.get("_why", {}).items() if not key.startswith("_")}
    if "_hardware" in data:  # the machine's facts the scaling prediction reads: their source is a reason too
        assert data["_why"].get("_hardware"), "the _hardware block says where its figures come from"
    assert set(reasons) <= set_keys, f"reasons for values the profile does not set: {set(reasons) - set_keys}"
    if profile in EIGHT_GPU:
        assert set(reasons) == set_keys, f"values without a reason: {set_keys - set(reasons)}"


@pytest.mark.parametrize("profile", PROFILES)
def test_no_row_is_longer_than_a_training_step(profile):
    assert resolved(profile, "train")["total_seq_len"] >= resolved(profile, "prepare")["max_seq_len"]


def test_eight_gpu_profiles_differ_only_in_machine_settings():
    for stage in STAGE_CONFIGS:
        for other in EIGHT_GPU[1:]:
            a, b = resolved(EIGHT_GPU[0], stage), resolved(other, stage)
            differing = {key for key in a if a[key] != b[key]}
            assert differing <= MACHINE_FIELDS.get(stage, set()), (stage, other, differing)
    # ...and the same recipe: same global batch (GPUs x tokens per step)
    globals_ = {p: resolved(p, "train")["nproc"] * resolved(p, "train")["total_seq_len"] for p in EIGHT_GPU}
    assert len(set(globals_.values())) == 1, (
        f"{globals_}: a different global batch is a different training recipe, not a port; if that is "
        "intended (e.g. after throughput measurements), say so in NOTES and relax this check")


def test_print_config_shows_each_value_and_its_source(capsys):
    argv = ["--target", "t", "--data", "d", "--vocab", "v", "--output", "o", "--profile", "rtx-pro-6000-8x",
            "--total-seq-len", "1024", "--print-config"]
    with pytest.raises(SystemExit) as stop:
        resolve_stage_config(TrainConfig, argv)
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "total_seq_len = 1024  # flag" in lines
    assert "nproc = 8  # profile:rtx-pro-6000-8x" in lines
    assert "lr = 0.001  # default" in lines
    assert 'target = "t"  # flag' in lines


def test_unknown_keys_and_sections_in_a_profile_are_refused(tmp_path):
    bad_key = tmp_path / "bad-key.json"
    bad_key.write_text(json.dumps({"train": {"nproc": 8, "n_proc": 8}}))
    with pytest.raises(ConfigError, match=r"unknown keys \['n_proc'\]"):
        build_config(TrainConfig, required(TrainConfig), str(bad_key))
    bad_section = tmp_path / "bad-section.json"
    bad_section.write_text(json.dumps({"training": {"nproc": 8}}))
    with pytest.raises(ConfigError, match="unknown section 'training'"):
        load_profile(str(bad_section))


def test_a_bad_profile_value_names_the_flag_and_the_profile(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"train": {"nproc": "eight"}}))
    with pytest.raises(ConfigError, match=r"--nproc \(profile:.*typo.json\)"):
        build_config(TrainConfig, required(TrainConfig), str(path))


@pytest.mark.parametrize("value, reason", [(True, "Input should be a valid number"),
                                           ("1e-3", "Input should be a valid number")])
def test_a_profile_value_of_the_wrong_type_is_refused_not_coerced(value, reason, tmp_path):
    """Issue 64: "lr": true trained at lr 1.0 and "1e-3" at 0.001 (coerced); a profile is typed as written."""
    path = tmp_path / "typed.json"
    path.write_text(json.dumps({"train": {"lr": value}}))
    with pytest.raises(ConfigError) as refused:
        build_config(TrainConfig, required(TrainConfig), str(path))
    assert str(refused.value) == (f"{path}: train.lr = {json.dumps(value)}: {reason} (stage train's --lr (profile: "
                                  f"{path}))")
    path.write_text(json.dumps({"train": {"lr": 1, "epochs": 2}}))  # an int where a float goes is still a number
    assert build_config(TrainConfig, required(TrainConfig), str(path))[0].lr == 1.0


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "-1", "--lr (flag): Input should be greater than 0"),
    ("--lr", "0", "--lr (flag): Input should be greater than 0"),
    ("--lr", "nan", "--lr (flag): Input should be a finite number"),
    ("--max-steps", "0", "--max-steps (flag): Input should be greater than or equal to 1"),
    # issue 64 T: non-finite or negative values of every numeric flag, by one rule (StageConfig), not per flag
    ("--noise-std", "inf", "--noise-std (flag): Input should be a finite number (got inf)"),
    ("--noise-std", "-0.5", "--noise-std (flag): Input should be greater than or equal to 0 (got -0.5)"),
    ("--stall-minutes", "nan", "--stall-minutes (flag): Input should be a finite number (got nan)"),
    ("--vllm-request-timeout", "inf", "--vllm-request-timeout (flag): Input should be a finite number (got inf)"),
    ("--checkpoint-freq", "inf", "--checkpoint-freq (flag): Input should be a finite number (got inf)"),
    ("--seed", "-1", "--seed (flag): must not be negative (got -1)"),
    # issue 64 N: a logger speculators does not have, refused before anything (it failed in three tracebacks)
    ("--logger", "tensorbord", "--logger (flag): unknown logger 'tensorbord' in 'tensorbord' (accepted: tensorboard, "
                               "wandb, trackio, mlflow, several comma-separated, or none)"),
])
def test_a_learning_rate_or_step_count_torch_or_speculators_would_refuse_is_one_line_first(flag, value, message,
                                                                                           capsys):
    """Before: --lr -1 passed --print-config and the run died in torch's optimizer with a traceback, leaving files;
    --max-steps 0 ended in speculators' 98-line usage text."""
    with pytest.raises(SystemExit) as stop:
        resolve_stage_config(TrainConfig, ["--target", "t", "--data", "d", "--vocab", "v", "--output", "o", flag, value])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {message}"), errors


def test_every_numeric_setting_of_every_stage_is_finite_and_not_negative_by_one_rule(tmp_path):
    """Every int/float field of every stage (flag or profile) goes through StageConfig's one rule; a field that means
    something below 0 says so (negative_ok: 02's --validate-sample -1 = all)."""
    from eagle3_pipeline.config.resolution import _unwrap_optional

    for stage, cls in STAGE_CONFIGS.items():
        for name, info in cls.model_fields.items():
            kind = _unwrap_optional(info.annotation)
            if kind is float:
                with pytest.raises(ConfigError, match=r"finite number \(got inf\)"):
                    build_config(cls, {**required(cls), name: float("inf")})
            if kind in (int, float, list[int]) and not field_meta(cls, name).get("negative_ok"):
                with pytest.raises(ConfigError, match=r"\(got -[0-9]"):
                    build_config(cls, {**required(cls), name: [-2] if kind == list[int] else -2})
    assert build_config(ExtractConfig, {**required(ExtractConfig), "validate_sample": -1})[0].validate_sample == -1
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"train": {"noise_std": -1}}))
    with pytest.raises(ConfigError, match=r"--noise-std \(profile:.*\): .*\(got -1\)"):
        build_config(TrainConfig, required(TrainConfig), str(profile))


@pytest.mark.parametrize("value", ["", "none", "None", "''", '""'])
def test_no_logger_is_written_every_way_help_and_run_all_give_it(value):
    """'' and none are one thing (speculators takes ""); through run_all.sh --args-04 "--logger ''" the quotes arrive."""
    assert build_config(TrainConfig, {**required(TrainConfig), "logger": value})[0].logger == ""
    assert build_config(TrainConfig, {**required(TrainConfig), "logger": "TensorBoard, wandb"})[0].logger == \
        "tensorboard,wandb"


def test_an_unknown_profile_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="rtx-pro-6000-8x"):
        load_profile("rtx-pro-6000")


def test_unknown_flag_is_an_argparse_error():
    with pytest.raises(SystemExit) as stop:
        resolve_stage_config(TrainConfig, ["--target", "t", "--nprocs", "8"])
    assert stop.value.code == 2


def test_draft_config_json_validates_and_refuses_unknown_keys(tmp_path):
    draft = load_draft_config(DEFAULT_DRAFT_CONFIG)
    assert draft.draft_vocab_size == 32000 and draft.num_speculative_tokens <= draft.ttt_steps
    bad = tmp_path / "draft.json"
    bad.write_text(json.dumps({**draft.model_dump(), "num_layer": 2}))
    with pytest.raises(ConfigError, match="num_layer"):
        load_draft_config(bad)


def test_the_default_draft_has_eagle_3_1s_per_layer_norms_and_an_older_file_gets_them(tmp_path):
    """fc_norm / norm_before_fc: typed, defaulted (a draft_config.json written before they existed keeps working,
    with the new default), both true refused in one line (speculators refuses it only after loading the target)."""
    shipped = load_draft_config(DEFAULT_DRAFT_CONFIG)
    assert (shipped.fc_norm, shipped.norm_before_fc) == (True, False) == (DraftConfig().fc_norm, DraftConfig().norm_before_fc)
    older = tmp_path / "older.json"
    older.write_text(json.dumps({k: v for k, v in json.loads(DEFAULT_DRAFT_CONFIG.read_text()).items()
                                 if k not in ("fc_norm", "norm_before_fc", "_fc_norm")}))
    assert (load_draft_config(older).fc_norm, load_draft_config(older).norm_before_fc) == (True, False)
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"fc_norm": True, "norm_before_fc": True}))
    with pytest.raises(ConfigError) as refused:
        load_draft_config(both)
    assert str(refused.value).startswith(f"{both}: fc_norm and norm_before_fc are both true: choose one")
    assert "\n" not in str(refused.value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fc_norm": "yes"}))
    with pytest.raises(ConfigError, match=r"fc_norm: Input should be a valid boolean"):
        load_draft_config(bad)


def test_the_draft_norms_reach_speculators_explicitly_before_the_users_extra_args():
    """speculators 0.9.0 resolves an unset --norm-before-fc to true for eagle3: the flag is always passed, and
    --fc-norm (store_true, no --no- form) only when on; --extra-args still come last and so still win."""
    from speculators.train.config.resolution import build_parser as speculators_parser

    cfg, _ = build_config(TrainConfig, {**required(TrainConfig), "extra_args": ["--norm-before-fc"]})
    argv = speculators_argv(cfg, DraftConfig(), "/t", [2, 30, 58], 32000, 0.9, 0)
    assert argv[-3:] == ["--no-norm-before-fc", "--fc-norm", "--norm-before-fc"]
    old = speculators_argv(cfg, DraftConfig(fc_norm=False, norm_before_fc=True), "/t", [2, 30, 58], 32000, 0.9, 0)
    assert "--fc-norm" not in old and old[-2:] == ["--norm-before-fc", "--norm-before-fc"]
    none = speculators_argv(cfg, DraftConfig(fc_norm=False), "/t", [2, 30, 58], 32000, 0.9, 0)
    assert "--fc-norm" not in none and "--no-norm-before-fc" in none
    known = {flag for action in speculators_parser()._actions for flag in action.option_strings}
    assert {"--fc-norm", "--norm-before-fc", "--no-norm-before-fc"} <= known  # the installed trainer's flags


def test_a_run_made_before_the_draft_norm_keys_keeps_its_identity_with_the_old_norms():
    """04's identity holds the draft config: a run trained with speculators' old resolution (no fc_norm, one norm
    over the concatenation) resumes when draft_config.json says so, and is refused under the new default."""
    # (speculator_type and block_size came later still: an eagle3 identity has neither, test_04_kinds.py)
    old_identity = DraftConfig().model_dump(exclude={"description", "fc_norm", "norm_before_fc", "speculator_type",
                                                     "block_size"})
    assert DraftConfig(fc_norm=False, norm_before_fc=True).identity_settings() == old_identity
    assert DraftConfig().identity_settings() == {**old_identity, "fc_norm": True, "norm_before_fc": False}


def test_print_config_shows_the_draft_norms_speculators_receives(capsys):
    lines = _printed(capsys, TrainConfig, [])
    line = next(line for line in lines if line.startswith("draft_config = "))
    assert line.endswith("# default -> its fc_norm true, norm_before_fc false -> speculators --fc-norm --no-norm-before-fc")


@pytest.mark.parametrize("stage", list(STAGE_CONFIGS))
def test_every_stage_help_shows_an_example_and_the_profile_flag(stage):
    cls = STAGE_CONFIGS[stage]
    text = build_parser(cls).format_help()
    assert "example:" in text and cls.EXAMPLE.split()[1] in text
    assert "--profile" in text and "--print-config" in text


# --- --print-config without paths, with what the stage resolves ----------------------------------

def _printed(capsys, cls, argv) -> list[str]:
    from eagle3_pipeline.training import resolved_for_print_config  # what 04_train.py passes

    notes = resolved_for_print_config if cls is TrainConfig else None
    with pytest.raises(SystemExit) as stop:
        resolve_stage_config(cls, argv + ["--print-config"], run_time_notes=notes)
    assert stop.value.code == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("stage", list(STAGE_CONFIGS))
def test_print_config_needs_no_paths_shows_placeholders_and_writes_nothing(stage, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cls = STAGE_CONFIGS[stage]
    lines = _printed(capsys, cls, ["--profile", "cpu-mini"])
    for name, info in cls.model_fields.items():
        if info.is_required():
            flag = "--" + name.replace("_", "-")
            assert f'{name} = "<{flag}>"  # required, not given' in lines
    assert not list(tmp_path.iterdir())


def test_print_config_gives_the_profiles_reason_under_each_value_it_sets(capsys):
    profile = json.loads((PROFILES_DIR / "rtx-pro-6000-8x.json").read_text())
    lines = _printed(capsys, TrainConfig, ["--profile", "rtx-pro-6000-8x"])
    assert lines[1] == f"# profile rtx-pro-6000-8x: {profile['description']}"
    nproc = lines.index("nproc = 8  # profile:rtx-pro-6000-8x")
    assert lines[nproc + 1] == f"#   why: {profile['_why']['train.nproc']}"
    assert not any(line.startswith("#   why") for line in _printed(capsys, TrainConfig, ["--nproc", "8"]))


def test_print_config_shows_what_speculators_receives_for_the_run_time_fields(capsys):
    from eagle3_pipeline.training import hidden_states_dtype, on_gpu, resolve_kernels

    lines = _printed(capsys, TrainConfig, [])
    cfg, _ = build_config(TrainConfig, required(TrainConfig))
    attn, loss = resolve_kernels(cfg)
    by_name = {line.split(" = ")[0]: line for line in lines if " = " in line and not line.startswith("#")}
    ttt = load_draft_config(DEFAULT_DRAFT_CONFIG).ttt_steps
    assert by_name["ttt_steps"].startswith(f"ttt_steps = null  # default -> {ttt} (")
    assert by_name["attn_impl"].startswith(f'attn_impl = "auto"  # default -> "{attn}" (')
    assert by_name["loss_impl"].startswith(f'loss_impl = "auto"  # default -> "{loss}" (')
    assert by_name["hidden_states_dtype"].startswith(f'hidden_states_dtype = "auto"  # default -> "{hidden_states_dtype(cfg)}" (')
    assert ("-> 0 (" in by_name["num_workers"]) == (not on_gpu())  # the CPU trains without loader workers
    explicit = _printed(capsys, TrainConfig, ["--attn-impl", "eager", "--ttt-steps", "2"])
    assert 'attn_impl = "eager"  # flag' in explicit and "ttt_steps = 2  # flag" in explicit


# --- per-field facts: declared with the field ---------------------------------------------------------

@pytest.mark.parametrize("stage", list(STAGE_CONFIGS))
def test_every_config_field_declares_whether_it_is_part_of_the_identity(stage):
    """`identity=` has no default: a new field cannot join or leave a stage's identity without saying so."""
    cls = STAGE_CONFIGS[stage]
    undeclared = [name for name in cls.model_fields if not isinstance(field_meta(cls, name).get("identity"), bool)]
    assert not undeclared, f"{stage}: fields without identity=True/False: {undeclared}"
    with pytest.raises(TypeError, match="identity"):
        _field(0, "a field that does not say whether it is identity")


def test_the_identity_is_exactly_the_fields_declared_identity():
    cfg, _ = build_config(TrainConfig, required(TrainConfig))
    declared = {name for name in TrainConfig.model_fields if field_meta(TrainConfig, name)["identity"]}
    assert set(cfg.identity_settings()) == declared
    assert stage_identity(cfg, {"prepare": "sha"}, ttt_steps=3)["settings"] == {**cfg.identity_settings(), "ttt_steps": 3}


def test_fields_declared_with_a_speculators_flag_reach_speculators_verbatim():
    flags = {**required(TrainConfig), "epochs": 7, "lr": 2e-4, "max_steps": 5, "fsdp": True, "logger": ""}
    cfg, _ = build_config(TrainConfig, flags)
    argv = speculators_argv(cfg, DraftConfig(), "/t", [2, 30, 58], 32000, 0.9, 0)
    passed = {name: field_meta(TrainConfig, name)["speculators"] for name in TrainConfig.model_fields
              if "speculators" in field_meta(TrainConfig, name)}
    assert {"epochs", "lr", "total_seq_len", "seed", "max_steps", "fsdp"} <= set(passed)
    for name, flag in passed.items():
        value = getattr(cfg, name)
        if isinstance(value, bool):
            assert (flag in argv) == value, name
        else:
            assert argv.count(flag) == 1 and argv[argv.index(flag) + 1] == str(value), name
    assert argv[argv.index("--max-steps") + 1] == "5" and argv[argv.index("--logger") + 1] == ""
    assert "--dry-run" not in argv  # a false bool passes nothing


def test_stage_04_print_config_runs_without_torch_and_prints_the_config(capsys, tmp_path):
    """`--print-config` answers in seconds: torch is made unimportable for the script (a sitecustomize
    that refuses it, on PYTHONPATH for this subprocess only), and the config prints as it does in-process."""
    shim = tmp_path / "no_torch"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n\n\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            sys.stderr.write(f'torch import attempted: {name}\\n')\n"
        "            raise ImportError(f'{name} is made unimportable by this test')\n\n\n"
        "sys.meta_path.insert(0, NoTorch())\n")
    # this checkout's library first (as the scripts find it), after the shim
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), str(SCRIPTS_DIR), os.environ.get("PYTHONPATH")]))}
    shimmed = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env={**os.environ, **env})
    assert shimmed.returncode != 0 and "torch import attempted: torch" in shimmed.stderr  # the shim is in force
    result = run_stage("train", "--profile", "h200-8x", "--print-config", check=False, env=env, timeout=120)
    assert "torch import attempted" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 0, result.stderr[-2000:]
    expected = _printed(capsys, TrainConfig, ["--profile", "h200-8x"])
    assert result.stdout.splitlines() == expected
    assert 'nproc = 8  # profile:h200-8x' in expected and any(line.startswith('attn_impl = "auto"  # default -> ')
                                                               for line in expected)
