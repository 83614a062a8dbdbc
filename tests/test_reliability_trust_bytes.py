"""No stage trusts a manifest over what is on disk now (issue 26): hidden-state files changed after
stage 02 finished, checkpoints changed or gone, deletion only of what a stage's manifest lists.

Each case runs the stages' real `main(argv)` on a private copy of the shared finished Kimi-miniature
run (`work`, from test_reliability_rerun.py), changes one file the way a careful user might (a NaN,
a copy from another box, a swap, a truncation), and asserts the one error line, the exit code and
that nothing else was lost.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_reliability_bad_input import manifest, recorded_by_02, refused, snapshot, stage_module, succeeded
from test_reliability_rerun import args, lock_holder, logs, ran, work

pytestmark = pytest.mark.reliability
_FIXTURES = (lock_holder, logs, work)  # test_reliability_rerun.py's, used here by name

ROW = 3  # a training-split row of the miniature's 10


def hs(work, row: int = ROW) -> Path:
    return work["hs"] / f"hs_{row}.safetensors"


def rewrite(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _nan(t):
    t["hidden_states"][1, 2, 5] = float("nan")


def _constant_slot(t):
    t["hidden_states"][:, 1, :] = 0.5


def _bf16(t):
    t["hidden_states"] = t["hidden_states"].to(torch.bfloat16)


def _fp8_raw(t):  # an fp8 file read as raw e4m3 without its scales
    t["hidden_states"] = t["hidden_states"].to(torch.float8_e4m3fn)


def _fp8_scaled(t):  # a real fp8 file (stage 02 --storage fp8) copied into a float32 run
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    t["hidden_states"], t[SCALES_KEY] = quantize_tensor_to_fp8(t["hidden_states"])


def _token_ids(t):
    t["token_ids"][2] = (t["token_ids"][2] + 1) % 1000


CHANGES = {
    "nan": (_nan, "hidden_states contain NaN/Inf (layer slot(s) [2])"),
    "constant-slot": (_constant_slot, "hidden_states layer slot(s) [1] hold one constant value (0.5)"),
    "bf16-in-fp32-run": (_bf16, "stored as bfloat16; stage 02 stored float32 (files are never mixed)"),
    "fp8-raw-in-fp32-run": (_fp8_raw, "stored as fp8 (float8_e4m3fn, no scales); stage 02 stored float32"),
    "fp8-in-fp32-run": (_fp8_scaled, "stored as fp8 (float8_e4m3fn); stage 02 stored float32"),
    "token-ids": (_token_ids, "are not the row's input_ids"),
    "swapped": (None, "are not the row's input_ids"),
}


def change_file(work, name: str) -> None:
    change, _ = CHANGES[name]
    if change is None:  # swapped with another row's file
        other = hs(work, ROW + 1)
        tmp = other.with_name("swap")
        other.rename(tmp)
        hs(work).rename(other)
        tmp.rename(hs(work))
    else:
        rewrite(hs(work), change)


@pytest.mark.parametrize("name", list(CHANGES))
def test_training_stops_with_one_line_on_a_hidden_state_file_changed_after_stage_02(name, capsys, work, kimi_target,
                                                                                     tmp_path):
    change_file(work, name)
    recorded_by_02(work["hs"])  # else refused before training, as changed since 02 wrote it
    out = tmp_path / "ckpt"
    code, line = refused(capsys, *args("train", {**work, "checkpoints": out}, kimi_target))
    assert code == 4
    named = (hs(work), hs(work, ROW + 1)) if name == "swapped" else (hs(work),)  # the one read first
    assert line.startswith(tuple(f"{p}: " for p in named)) and CHANGES[name][1] in line, line
    assert "training stopped before it" in line and "--on-bad-sample skip" in line
    assert not list(out.glob("[0-9]*/model.safetensors"))  # no checkpoint was trained on it


def test_on_bad_sample_skip_counts_and_lists_the_files_in_the_manifest(capsys, work, kimi_target, tmp_path):
    change_file(work, "nan")
    recorded_by_02(work["hs"])
    out = tmp_path / "ckpt"
    succeeded(capsys, *args("train", {**work, "checkpoints": out}, kimi_target, "--on-bad-sample", "skip",
                            "--max-bad-fraction", "0.1"))  # 1 of the 15 samples
    bad = manifest(out)["bad_samples"]
    assert bad["count"] == 1 and list(bad["files"]) == [str(hs(work))]
    assert "NaN/Inf" in bad["files"][str(hs(work))]
    assert manifest(out)["complete"]
    trained = manifest(out)["trained"]  # row 3 is a training row: one sample fewer each epoch
    assert trained["optimizer_steps"] > 0 and trained["samples"] == 2 * (13 - 1), trained


def test_a_truncated_hidden_state_file_is_one_line_naming_it(capsys, work, kimi_target, tmp_path):
    data = hs(work).read_bytes()
    hs(work).write_bytes(data[:-1])
    recorded_by_02(work["hs"])
    code, line = refused(capsys, *args("train", {**work, "checkpoints": tmp_path / "ckpt"}, kimi_target))
    assert code == 4 and line.startswith(f"{hs(work)}: unreadable safetensors ("), line


def test_a_non_finite_loss_stops_before_the_optimizer_step_naming_step_and_rows(capsys, work, kimi_target, tmp_path):
    """Finite, valid inputs and a learning rate that diverges: step 0's update makes step 1's loss NaN."""
    import re

    out = tmp_path / "ckpt"
    code, line = refused(capsys, *args("train", {**work, "checkpoints": out}, kimi_target, "--lr", "1e30"))
    assert code == 4 and line.startswith("non-finite training loss (nan) at global step 1, epoch 0 (rows hs_"), line
    assert re.search(r"\(rows (hs_\d+(, )?)+\); stopped before its optimizer step", line), line
    assert not list(out.glob("[0-9]*/model.safetensors"))  # no NaN checkpoint was saved


@pytest.mark.parametrize("name", ["nan", "swapped", "truncated"])
def test_rerunning_02_redoes_a_file_changed_since_by_size_and_fingerprint(name, capsys, logs, work, kimi_target):
    original = hs(work).read_bytes()
    if name == "truncated":
        hs(work).write_bytes(original[:-1])
    else:
        change_file(work, name)
    text = ran(capsys, logs, *args("extract", work, kimi_target))
    assert "changed since stage 02 wrote" in text and "nothing to do" not in text, text
    assert hs(work).read_bytes() == original  # redone (HF extraction is deterministic)
    if name == "swapped":
        assert hs(work, ROW + 1).read_bytes() != original
    text = ran(capsys, logs, *args("extract", work, kimi_target))
    assert "nothing to do" in text


def _finite_value_offset(path: Path) -> int:
    """The byte offset of a hidden-state value outside every block the fingerprint samples (files.file_fingerprint)."""
    from eagle3_pipeline.files import FINGERPRINT_BLOCK, FINGERPRINT_BLOCKS

    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    start, end = json.loads(data[8:8 + header_len])["hidden_states"]["data_offsets"]
    sampled = [(len(data) * k // FINGERPRINT_BLOCKS, len(data) * k // FINGERPRINT_BLOCKS + FINGERPRINT_BLOCK)
               for k in range(FINGERPRINT_BLOCKS)]
    for offset in range(8 + header_len + start, 8 + header_len + end, 4):  # float32 values (cpu-mini)
        if not any(lo - 4 < offset < hi for lo, hi in sampled):
            return offset
    raise AssertionError("every value is in a sampled block")


def test_rerunning_02_redoes_a_file_one_finite_value_of_which_changed_in_place(capsys, logs, work, kimi_target):
    """Issue 64 M: one value became -4.6e37 (finite, so every check passes) in bytes the fingerprint does not sample;
    the rerun must extract the file again, not re-validate it, keep it and record it as its own."""
    original = hs(work).read_bytes()
    offset = _finite_value_offset(hs(work))
    time.sleep(0.01)  # a new modification time
    with open(hs(work), "r+b") as handle:  # in place: the same inode
        handle.seek(offset)
        handle.write(struct.pack("<f", -4.6e37))
    assert hs(work).read_bytes() != original
    text = ran(capsys, logs, *args("extract", work, kimi_target))
    assert f"{hs(work)}: changed since stage 02 wrote it (same size, rewritten since (modification time)); redoing it" in text, text
    assert hs(work).read_bytes() == original  # redone (HF extraction is deterministic)
    assert "nothing to do" in ran(capsys, logs, *args("extract", work, kimi_target))


def test_rerunning_02_re_checks_a_directory_copied_without_modification_times(capsys, logs, work, kimi_target):
    """cp -r: every file has a new mtime and its recorded size and sampled bytes: re-validated and kept, not redone."""
    files = sorted(work["hs"].glob("hs_*.safetensors"))
    before = {path: path.read_bytes() for path in files}
    time.sleep(0.01)
    for path, data in before.items():
        path.with_name("copy").write_bytes(data)
        path.with_name("copy").replace(path)
    text = ran(capsys, logs, *args("extract", work, kimi_target))
    assert "copied without mtimes" in text and "redoing it" not in text, text
    assert {path: path.read_bytes() for path in files} == before
    assert "nothing to do" in ran(capsys, logs, *args("extract", work, kimi_target))


def test_export_refuses_a_checkpoint_with_non_finite_weights(capsys, work, tmp_path):
    best = (work["checkpoints"] / "checkpoint_best").resolve()
    weights = best / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    recorded_as_written(work["checkpoints"], best.name)  # a NaN 04 itself wrote (not a file changed since)
    code, line = refused(capsys, "export", "--profile", "cpu-mini", "--checkpoints", work["checkpoints"],
                         "--output", tmp_path / "draft")
    assert code == 4 and line.startswith(f"{weights}: ") and f"tensor {name!r}" in line and "NaN/Inf" in line, line
    assert not (tmp_path / "draft").exists()


def test_a_recorded_best_checkpoint_that_is_gone_is_an_error_naming_it(capsys, work, kimi_target, tmp_path):
    best = manifest(work["checkpoints"])["best_checkpoint"]["name"]
    shutil.rmtree(work["checkpoints"] / best)
    others = sorted(p.name for p in work["checkpoints"].iterdir() if p.name.isdigit())
    code, line = refused(capsys, *args("train", work, kimi_target))
    assert code == 3 and f"best checkpoint {best!r}" in line and "--checkpoint" in line, line
    code, line = refused(capsys, "export", "--profile", "cpu-mini", "--checkpoints", work["checkpoints"],
                         "--output", tmp_path / "draft")
    assert code == 3 and f"best checkpoint {best!r}" in line and f"--checkpoint {others[-1]}" in line, line
    assert not (tmp_path / "draft").exists()


def test_a_truncated_checkpoint_is_one_line_naming_the_file(capsys, work, kimi_target, tmp_path):
    best = manifest(work["checkpoints"])["best_checkpoint"]["name"]
    weights = work["checkpoints"] / best / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    code, line = refused(capsys, *args("train", work, kimi_target))
    assert code == 3 and line.startswith(f"{weights}: "), line
    code, line = refused(capsys, "export", "--profile", "cpu-mini", "--checkpoints", work["checkpoints"],
                         "--output", tmp_path / "draft")
    assert code == 3 and line.startswith(f"{weights}: ") and "unreadable" in line, line


def recorded_as_written(checkpoints: Path, name: str) -> None:
    """Stage 04's manifest rewritten as if 04 had written checkpoint `name`'s weights as they are now."""
    from eagle3_pipeline.contract import write_manifest
    from eagle3_pipeline.files import sha256_file
    from eagle3_pipeline.manifest import parse_manifest

    trained = parse_manifest(checkpoints / "manifest.json")
    if trained.best_checkpoint.name == name:
        trained.best_checkpoint.model_sha256 = sha256_file(checkpoints / name / "model.safetensors")
    write_manifest(checkpoints, trained, fresh=False, outputs=list(trained.output_files))


def _token_freq(work):
    path = work["data"] / "token_freq.pt"
    counts = torch.load(path)
    counts[max(counts)] += 1000
    torch.save(counts, path)
    return "vocab", path, {**work, "vocab": work["root"] / "vocab2"}, ""


def _dataset_cut_short(work):
    path = next(work["data"].glob("data-*.arrow"))
    path.write_bytes(path.read_bytes()[:-100])
    return "extract", path, work, "cut short: "


def _d2t(work):
    import numpy as np

    path = work["vocab"] / "d2t.npy"
    d2t = np.load(path)
    d2t[-1] += 1
    np.save(path, d2t)
    return "train", path, {**work, "checkpoints": work["root"] / "ckpt2"}, "same size, other bytes"


def _weights(work):
    best = manifest(work["checkpoints"])["best_checkpoint"]["name"]
    path = work["checkpoints"] / best / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-8:] = b"XXXXXXXX"
    path.write_bytes(bytes(data))
    return "export", path, {**work, "draft": work["root"] / "draft2"}, "same size, other bytes"


@pytest.mark.parametrize("change", [_token_freq, _dataset_cut_short, _d2t, _weights], ids=lambda c: c.__name__[1:])
def test_a_file_changed_since_its_stage_wrote_it_is_refused_by_the_stage_reading_it(change, capsys, work, kimi_target):
    """Before: 03 built a vocabulary from a changed token_freq.pt, 05 exported weights changed after 04 recorded them
    (both exit 0, recording the upstream manifest as if nothing had changed), 02 died in a traceback on a cut dataset."""
    stage, path, where, how = change(work)
    before = snapshot(work["root"])
    code, line = refused(capsys, *args(stage, where, kimi_target))
    script = {"vocab": "01_prepare_dataset.py", "extract": "01_prepare_dataset.py", "train": "03_build_vocab_mapping.py",
              "export": "04_train.py"}[stage]
    assert code == 3 and line.startswith(f"{path}: {how}") and line.endswith(f"since {script} wrote it; rerun {script}")
    assert snapshot(work["root"]) == before  # refused before any work


@pytest.mark.parametrize("where", ["field", "field-and-identity"])
def test_a_manifest_whose_recorded_settings_were_edited_is_refused_by_the_stage_reading_it(where, capsys, work,
                                                                                          kimi_target):
    """Before: layer ids edited in stage 02's manifest reached the exported draft's config, extracted at other layers."""
    path = work["hs"] / "manifest.json"
    edited = manifest(work["hs"])
    extracted, changed = list(edited["layer_ids"]), [1, *edited["layer_ids"][1:]]
    edited["layer_ids"] = changed
    if where == "field-and-identity":
        edited["identity"]["settings"]["layer_ids"] = changed
    path.write_text(json.dumps(edited, indent=2))
    code, line = refused(capsys, *args("train", {**work, "checkpoints": work["root"] / "ckpt2"}, kimi_target))
    why = ("what it records no longer matches its content_sha256" if where == "field-and-identity" else
           f"layer_ids {json.dumps(changed)} where its identity records {json.dumps(extracted)}")
    assert (code, line) == (3, f"{path}: edited since 02_extract_hidden_states.py wrote it ({why}); rerun "
                               f"02_extract_hidden_states.py")
    assert not (work["root"] / "ckpt2").exists()


def test_a_manifest_without_its_target_is_one_line_naming_it(capsys, work, kimi_target):
    stripped = manifest(work["data"])
    del stripped["target"]
    (work["data"] / "manifest.json").write_text(json.dumps(stripped))
    code, line = refused(capsys, *args("vocab", {**work, "vocab": work["root"] / "vocab2"}, kimi_target))
    assert (code, line) == (3, f"{work['data'] / 'manifest.json'}: records no target (not written by "
                               f"01_prepare_dataset.py); rerun 01_prepare_dataset.py")


def test_a_row_file_gone_since_02_is_refused_before_training_and_02_redoes_it(capsys, logs, work, kimi_target,
                                                                              monkeypatch):
    """Before: speculators' loader raised 'Failed to load hidden states for sample 3' mid-epoch, a traceback. (04 looks
    again for ROW_FILES_GRACE_S first, as another node's files may be listed late; here not at all.)"""
    from eagle3_pipeline import training

    monkeypatch.setattr(training, "ROW_FILES_GRACE_S", 0.0)
    hs(work).unlink()
    out = work["root"] / "ckpt2"
    for skip in ([], ["--on-bad-sample", "skip"]):
        code, line = refused(capsys, *args("train", {**work, "checkpoints": out}, kimi_target, *skip))
        assert (code, line) == (3, f"{hs(work)}: missing since 02_extract_hidden_states.py wrote it (1 row file(s) "
                                   f"gone: hs_{ROW}); rerun 02_extract_hidden_states.py")
    assert not out.exists()
    ran(capsys, logs, *args("extract", work, kimi_target))
    assert hs(work).is_file()


def test_a_row_file_another_node_lists_late_is_waited_for_not_refused(work, monkeypatch):
    """Node 1's listing of the shared folder may lack a file node 0 landed a moment ago (NFS caches listings): 04
    lists again before refusing, as stage 02's ranks do."""
    import threading

    from eagle3_pipeline import training
    from eagle3_pipeline.manifest import parse_manifest

    monkeypatch.setattr(training, "ROW_FILES_GRACE_S", 30.0)
    monkeypatch.setattr(training, "ROW_FILES_POLL_S", 0.05)
    monkeypatch.setattr(training, "filesystem_type", lambda path: "nfs4")  # the shared folder: a network filesystem
    late = hs(work).rename(work["root"] / "not-listed-yet")
    threading.Timer(0.5, late.rename, args=(hs(work),)).start()
    started = time.monotonic()
    training.require_every_row_file(parse_manifest(work["hs"] / "manifest.json"), manifest(work["data"])["counts"]["rows"])
    assert hs(work).is_file() and 0.4 < time.monotonic() - started < 30


def test_a_row_file_gone_on_a_local_disk_is_refused_at_once(work, tmp_path):
    """Issue 64: a deleted row file was refused only after 75 s even on a local disk, where no listing is late: the
    wait is for network filesystems (machine.NETWORK_FILESYSTEMS; one the mount table does not name waits too)."""
    from eagle3_pipeline import training
    from eagle3_pipeline.errors import ContractError
    from eagle3_pipeline.machine import NETWORK_FILESYSTEMS, filesystem_type
    from eagle3_pipeline.manifest import parse_manifest

    assert training.ROW_FILES_GRACE_S >= 60  # the real wait, not a patched one
    local = filesystem_type(work["hs"])
    if local is None or local in NETWORK_FILESYSTEMS:
        pytest.skip(f"{work['hs']} is on {local or 'an unknown filesystem'} here")
    hs(work).unlink()
    started = time.monotonic()
    with pytest.raises(ContractError, match=f"{hs(work)}: missing since 02_extract_hidden_states.py wrote it"):
        training.require_every_row_file(parse_manifest(work["hs"] / "manifest.json"),
                                        manifest(work["data"])["counts"]["rows"])
    assert time.monotonic() - started < 10
    mounts = tmp_path / "mountinfo"  # the mount table's format, a space escaped as \040
    (tmp_path / "my share" / "data").mkdir(parents=True)
    mounts.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                      f"40 22 0:50 / {tmp_path}/my\\040share rw,relatime - nfs4 srv:/export rw\n")
    assert filesystem_type(tmp_path / "my share" / "data", mounts) == "nfs4"
    assert filesystem_type(tmp_path, mounts) == "ext4"


def test_redoing_an_export_refuses_to_replace_a_folder_holding_a_users_files(capsys, work, kimi_target):
    """Before: 05 replaced the whole draft folder, the user's notes and bench results with it, saying nothing."""
    (work["draft"] / "notes.txt").write_text("served on box 3\n")
    (work["draft"] / "bench").mkdir()
    (work["draft"] / "bench" / "run1.json").write_text("{}")
    weights = work["draft"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])  # the export is redone
    before = snapshot(work["draft"])
    code, line = refused(capsys, *args("export", work, kimi_target))
    assert (code, line) == (2, f"{work['draft'] / 'bench'}: not written by 05_export.py (2 such entries), and redoing "
                               f"the export replaces {work['draft']} as a whole; move them out or choose another --output")
    assert snapshot(work["draft"]) == before


def test_export_refuses_a_checkpoint_changed_while_it_ran(capsys, work, tmp_path, monkeypatch):
    export = stage_module("export")  # the script's own binding of eagle3_pipeline.export.write_draft_dir
    write = export.write_draft_dir

    def retrained_meanwhile(checkpoint, staging, *a, **k):  # what `04 --overwrite` elsewhere would do
        weights = checkpoint / "model.safetensors"
        tensors = load_file(str(weights))
        key = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
        tensors[key].view(-1)[0] += 1.0
        save_file(tensors, str(weights), metadata={"format": "pt"})
        return write(checkpoint, staging, *a, **k)

    monkeypatch.setattr(export, "write_draft_dir", retrained_meanwhile)
    code, line = refused(capsys, "export", "--profile", "cpu-mini", "--checkpoints", work["checkpoints"],
                         "--output", tmp_path / "draft")
    assert code == 3 and "changed while this export ran" in line, line
    assert not (tmp_path / "draft").exists()


def test_export_and_training_share_the_checkpoints_lock(capsys, work, tmp_path, lock_holder):
    holder = lock_holder(work["checkpoints"] / ".eagle3.lock")  # 04 training there (exclusive)
    code, line = refused(capsys, "export", "--profile", "cpu-mini", "--checkpoints", work["checkpoints"],
                         "--output", tmp_path / "draft")
    assert code == 75 and ".eagle3.lock" in line, line
    holder.kill()
    holder.wait()
    succeeded(capsys, "export", "--profile", "cpu-mini", "--checkpoints", work["checkpoints"],
              "--output", tmp_path / "draft")


# --- deletion only by manifest (D2, D3) ------------------------------------------------------------

def test_train_overwrite_into_a_work_directory_deletes_nothing_and_says_what_is_there(capsys, work, kimi_target):
    root = work["root"]
    (root / "logs").mkdir()
    (root / "logs" / "04_train.log").write_text("a stage log\n")
    (root / "run_all.log").write_text("run_all\n")
    (root / ".run_all.lock").write_text("")
    before = snapshot(root)
    for extra in ((), ("--overwrite",)):
        code, line = refused(capsys, *args("train", {**work, "checkpoints": root}, kimi_target, *extra))
        assert code == 3 and "--overwrite" not in line, line
        assert "04_train.py did not write" in line and "logs/" in line and "run_all.log" in line, line
        assert snapshot(root) == before


def test_prepare_replacing_its_run_deletes_only_the_files_its_manifest_lists(capsys, work, kimi_target):
    """Issue 64: 01 deleted whatever in its --output matched its files' names (data-*.arrow, state.json, ...), not what
    its manifest says it wrote. A file of that shape it never wrote is kept; 02's hidden_states/ beside it too."""
    stray = work["data"] / "data-00007-of-00009.arrow"
    stray.write_bytes(b"not written by 01")
    succeeded(capsys, *args("prepare", work, kimi_target, "--val-ratio", "0.3", "--overwrite"))
    assert stray.read_bytes() == b"not written by 01"
    written = manifest(work["data"])
    assert written["complete"] and stray.name not in written["output_files"] and "outputs" not in written
    assert (work["hs"] / "manifest.json").is_file()


def test_prepare_refuses_an_output_holding_a_users_own_dataset(capsys, kimi_target, tmp_path):
    from datasets import Dataset

    from conftest import SAMPLES

    own = tmp_path / "mine"
    Dataset.from_dict({"text": ["a user's own rows"]}).save_to_disk(str(own))
    before = snapshot(own)
    code, line = refused(capsys, "prepare", "--profile", "cpu-mini", "--target", kimi_target,
                         "--data", SAMPLES / "conversations.jsonl", "--output", own)
    assert code == 3 and "did not write" in line and "dataset_info.json" in line and "--overwrite" not in line, line
    assert snapshot(own) == before


# --- profiles (D7) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("profile, key", [
    ("[1, 2]", "(top level)"),
    ('{"vocab": 256}', "vocab"),
    ('{"train": "fast"}', "train"),
    ('{"train": {"epochs": "many"}}', "train.epochs"),
])
def test_a_profile_of_the_wrong_shape_is_one_line_naming_the_file_and_key(profile, key, capsys, work, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(profile)
    code, line = refused(capsys, "vocab", "--profile", path, "--data", work["data"], "--output", tmp_path / "v")
    assert code == 2 and line.startswith(f"{path}: ") and f"{key}" in line, line
    assert "['a', 'f', 's', 't']" not in line


# --- run_all --status (D8) -------------------------------------------------------------------------

def test_status_uses_the_stages_finished_rule(work):
    from eagle3_pipeline.status import stage_states

    root = work["root"]
    states = stage_states(root)
    assert all(s["state"] == "finished" for s in states.values()), states
    m = manifest(work["data"])  # stage 01 redone on other data: its content changes
    m["content_sha256"] = "0" * 64
    (work["data"] / "manifest.json").write_text(json.dumps(m))
    states = stage_states(root)
    assert states["prepare"]["state"] == "finished"
    for stage in ("extract", "vocab", "train", "export"):
        assert states[stage]["state"] == "stale", (stage, states[stage])


def test_a_generated_sample_is_checked_like_a_file_and_stops_or_is_skipped(work, tmp_path, monkeypatch):
    """online/hybrid: what vLLM generated passes the same check (hs_connectors' real FileTransfer reads the
    file vLLM would name); after speculators' retries the reason carries the tag, and the run stops
    (a fatal sample: speculators' recovery stops at that batch) or, with skip, the sample is listed."""
    import json as _json

    from hs_connectors import FileTransfer

    from eagle3_pipeline.compat import sample_check

    generated = tmp_path / "staging" / "req-1.safetensors"
    generated.parent.mkdir()
    shutil.copy(hs(work), generated)
    rewrite(generated, _nan)
    config = {"slots": 4, "hidden": load_file(str(hs(work)))["hidden_states"].shape[2], "dtype": None,
              "storage": "any", "on_bad": "stop", "record": str(tmp_path / "bad.jsonl")}
    transfer = sample_check.CheckedTransfer(FileTransfer(tmp_path / "cache"), str(work["data"]), config)
    assert transfer.get_cached(ROW) is None  # nothing cached: speculators generates it
    with pytest.raises(sample_check.BadSample) as error:
        transfer.get_generated({"hidden_states_path": str(generated)})
    assert sample_check.stop_line(str(error.value)) == f"row {ROW} (generated by vLLM, {generated}): " \
        f"hidden_states contain NaN/Inf (layer slot(s) [2])"
    reason = f"Hidden-state round trip failed (attempt 3/3): BadSample: {error.value}"
    for action, fatal in (("stop", True), ("skip", False)):
        monkeypatch.setenv(sample_check.ENV, _json.dumps({**config, "on_bad": action}))
        result = sample_check.generated_bad(reason, ROW)
        assert result.fatal is fatal and "NaN/Inf" in result.reason
    entries = [_json.loads(line) for line in (tmp_path / "bad.jsonl").read_text().splitlines()]
    assert [e["action"] for e in entries] == ["stop", "skip"] and {e["row"] for e in entries} == {ROW}
