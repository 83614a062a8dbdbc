"""Stage 04's value check on the GPU path (compat/sample_check.py `packed_value_codes`, `DeviceBatchCheck`,
`check_values_on_device`; compat/device_prefetch.py's producer runs them).

With CUDA the loader workers keep the cheap checks and the NaN/Inf / constant-slot pass runs on the
packed batch. These tests run that logic on the CPU through speculators' real dataset, packing
sampler, eagle3 shift and collate: its verdict per packed document equals the CPU check's on the
same samples, and a hit ends in the same one line naming `hs_{i}.safetensors`. The `gpu` test runs
it through DevicePrefetchLoader on a CUDA device.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.compat import device_prefetch, sample_check

SLOTS, HIDDEN, ROWS, TOKENS = 4, 16, 8, 12
STORED_DTYPE = torch.float32


def write_data(root, damage: dict[int, callable] | None = None, lengths=None):
    """A prepared dataset (speculators' layout) with one hidden-state file per row; `damage[row]` edits a row's states."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    lengths = lengths or [TOKENS + i for i in range(ROWS)]
    ids = [torch.randint(0, 1000, (n,), generator=generator) for n in lengths]
    table = Dataset.from_dict({"input_ids": [t.tolist() for t in ids], "loss_mask": [[1] * n for n in lengths],
                               "seq_len": lengths})
    table.set_format(type="torch")
    table.save_to_disk(str(root))
    (root / "hidden_states").mkdir()
    for row, token_ids in enumerate(ids):
        states = torch.randn(len(token_ids), SLOTS, HIDDEN, generator=generator, dtype=STORED_DTYPE)
        if damage and row in damage:
            damage[row](states)
        save_file({"hidden_states": states, "token_ids": token_ids}, str(root / "hidden_states" / f"hs_{row}.safetensors"))
    return root


def config(tmp_path, on_bad="stop") -> dict:
    return {"slots": SLOTS, "hidden": HIDDEN, "dtype": "float32", "storage": "dtype", "on_bad": on_bad,
            "record": str(tmp_path / sample_check.RECORD_NAME)}


def training_loader(data, transfer, total_seq_len=512):
    """speculators' own training loader pieces (no workers): dataset, packing sampler, eagle3 shift, collate."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader

    dataset = ArrowDataset(max_len=total_seq_len, datapath=str(data), on_missing="raise", transfer=transfer,
                           train_ratio=1.0, split="train", hidden_states_dtype=torch.bfloat16)
    return _setup_dataloader(dataset, total_seq_len, HIDDEN, num_workers=0, preprocess=shift_batch)


def produce(prefetch: device_prefetch.DevicePrefetchLoader):
    """What DevicePrefetchLoader's producer thread does per batch, on the CPU (no copy, no stream)."""
    planned = prefetch.planned_batches()
    for position, batch in enumerate(prefetch.loader):
        prefetch.batch_check.verdict(prefetch.batch_check.launch(batch, batch), planned[position])
        yield batch


def cpu_codes(problem: str | None) -> dict[int, int]:
    """The CPU check's verdict as {slot: code}."""
    if problem is None:
        return {}
    slots = [int(s) for s in re.search(r"layer slot\(s\) \[([\d, ]+)\]", problem).group(1).split(",")]
    code = sample_check.NON_FINITE if "NaN/Inf" in problem else sample_check.CONSTANT
    return dict.fromkeys(slots, code)


def _set(token, slot, value, hidden=3):
    def change(states):
        states[token, slot, hidden] = value
    return change


def _fill(slot, value):
    def change(states):
        states[:, slot, :] = value
    return change


# Damage where the trainer reads it (eagle3's shift drops each sample's last aux token and first last-slot token).
DAMAGE = {1: _set(2, 0, float("nan")), 2: _set(5, 3, float("inf")), 3: _set(1, 1, float("-inf")),
          4: _fill(1, 0.5), 5: _fill(3, 0.0), 6: lambda s: (_fill(0, 0.0)(s), _set(4, 2, float("nan"))(s))}


def test_packed_codes_per_document_equal_the_cpu_check_on_the_same_samples(tmp_path):
    data = write_data(tmp_path / "data", DAMAGE)
    loader = training_loader(data, sample_check.CheckedTransfer(None, str(data), config(tmp_path), values_on_device=True))
    (rows,) = loader.batch_sampler._generate_batches(0)  # one packed batch holds every training row
    (batch,) = list(loader)  # the workers' cheap checks pass every file: the values are left to the batch check
    num_docs = int(batch["document_ids"].max()) + 1
    assert num_docs == len(rows) == ROWS
    codes = sample_check.packed_value_codes(batch["hidden_states"], batch["verifier_last_hidden_states"],
                                            batch["document_ids"], num_docs)
    assert codes.shape == (ROWS, SLOTS) and codes.dtype == torch.int8
    for doc, row in enumerate(rows):
        states = load_file(str(data / "hidden_states" / f"hs_{row}.safetensors"))["hidden_states"]
        expected = cpu_codes(sample_check.finite_problem(states, SLOTS, HIDDEN))
        got = {slot: int(code) for slot, code in enumerate(codes[doc].tolist()) if code}
        if expected and next(iter(expected.values())) == sample_check.NON_FINITE:  # the CPU names the NaN slots first
            got = {slot: code for slot, code in got.items() if code == sample_check.NON_FINITE}
        assert got == expected, (row, got, expected)
    assert {row for doc, row in enumerate(rows) if codes[doc].any()} == set(DAMAGE)


def test_padding_and_the_values_training_never_reads_are_not_flagged(tmp_path):
    """The batch is padded to total_seq_len with zeros (document -1), and the shift drops the last token of
    each aux slot: a NaN there is never trained on; the GPU check covers exactly what the trainer reads."""
    data = write_data(tmp_path / "data", {2: _set(-1, 0, float("nan")), 3: _set(0, 3, float("nan"))})
    loader = training_loader(data, sample_check.CheckedTransfer(None, str(data), config(tmp_path), values_on_device=True))
    (batch,) = list(loader)
    assert int((batch["document_ids"] == -1).sum()) > 0  # padding present
    codes = sample_check.packed_value_codes(batch["hidden_states"], batch["verifier_last_hidden_states"],
                                            batch["document_ids"], ROWS)
    assert not codes.any()


def test_a_hit_names_the_file_and_reason_exactly_like_the_worker_side_check(tmp_path):
    data = write_data(tmp_path / "data", {5: _set(3, 2, float("nan"))})
    checked = sample_check.CheckedTransfer(None, str(data), config(tmp_path))
    prefetch = device_prefetch.DevicePrefetchLoader(training_loader(data, checked, total_seq_len=64), "cpu")
    assert sample_check.check_values_on_device(prefetch, checked)
    worker_side = prefetch.loader.dataset.transfer
    assert worker_side is not checked and worker_side.values_on_device and not checked.values_on_device
    assert worker_side.get_cached(5) is not None  # the worker lets the values through ...
    with pytest.raises(sample_check.BadSample) as error:  # ... the batch check stops on them
        list(produce(prefetch))
    path = data / "hidden_states" / "hs_5.safetensors"
    assert sample_check.stop_line(str(error.value)) == f"{path}: hidden_states contain NaN/Inf (layer slot(s) [2])"
    with pytest.raises(sample_check.BadSample) as worker_error:  # the worker-side check's own line
        sample_check.CheckedTransfer(None, str(data), config(tmp_path)).get_cached(5)
    assert str(worker_error.value) == str(error.value)
    entries = [json.loads(line) for line in (tmp_path / sample_check.RECORD_NAME).read_text().splitlines()]
    # the record stamps the file as it was (size, mtime, inode): a file redone since no longer counts (issue 46 G)
    stat = path.stat()
    assert entries[0] == {"file": str(path), "sample": str(path), "row": 5,
                          "reason": "hidden_states contain NaN/Inf (layer slot(s) [2])", "action": "stop",
                          "stamp": [stat.st_size, stat.st_mtime_ns, stat.st_ino]}


def test_clean_batches_pass_and_a_hit_no_file_explains_still_stops_naming_the_rows(tmp_path):
    data = write_data(tmp_path / "data")
    checked = sample_check.CheckedTransfer(None, str(data), config(tmp_path))
    prefetch = device_prefetch.DevicePrefetchLoader(training_loader(data, checked, total_seq_len=64), "cpu")
    assert sample_check.check_values_on_device(prefetch, checked)
    batches = list(produce(prefetch))
    assert len(batches) == len(prefetch.planned_batches()) > 1
    rows = [int(r) for r in prefetch.planned_batches()[0]]
    codes = torch.zeros(len(rows), SLOTS, dtype=torch.int8)
    codes[0, 1] = sample_check.CONSTANT  # e.g. a file changed back after the batch was read
    with pytest.raises(sample_check.BadSample) as error:
        prefetch.batch_check.verdict(codes, rows)
    line = sample_check.stop_line(str(error.value))
    assert line.startswith(f"training batch (rows {', '.join(f'hs_{r}' for r in rows)}): packed document 0 of "
                           f"{len(rows)} holds one constant value in layer slot(s) [1]")


def test_skip_mode_keeps_the_whole_check_in_the_workers(tmp_path):
    data = write_data(tmp_path / "data", {5: _set(3, 2, float("nan"))})
    checked = sample_check.CheckedTransfer(None, str(data), config(tmp_path, on_bad="skip"))
    prefetch = device_prefetch.DevicePrefetchLoader(training_loader(data, checked), "cpu")
    assert not sample_check.check_values_on_device(prefetch, checked)
    assert prefetch.batch_check is None and prefetch.loader.dataset.transfer is checked
    (batch,) = list(prefetch.loader)  # the NaN sample was left out by the worker
    assert int(batch["document_ids"].max()) + 1 == ROWS - 1
    assert not sample_check.check_values_on_device(training_loader(data, checked), checked)  # not prefetched: CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_prefetch_runs_the_value_check_on_the_gpu_and_stops_naming_the_file(tmp_path):
    device = torch.device("cuda", 0)
    data = write_data(tmp_path / "data", DAMAGE)
    loader = training_loader(data, sample_check.CheckedTransfer(None, str(data), config(tmp_path), values_on_device=True))
    (batch,) = list(loader)
    on_cpu = sample_check.packed_value_codes(batch["hidden_states"], batch["verifier_last_hidden_states"],
                                             batch["document_ids"], ROWS)
    moved = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    on_gpu = sample_check.packed_value_codes(moved["hidden_states"], moved["verifier_last_hidden_states"],
                                             moved["document_ids"], ROWS)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
    (rows,) = loader.batch_sampler._generate_batches(0)
    assert {int(row) for doc, row in enumerate(rows) if on_cpu[doc].any()} == set(DAMAGE)

    clean = write_data(tmp_path / "clean")
    checked = sample_check.CheckedTransfer(None, str(clean), config(tmp_path))
    prefetch = device_prefetch.DevicePrefetchLoader(training_loader(clean, checked, total_seq_len=64), device)
    assert sample_check.check_values_on_device(prefetch, checked)
    seen = [b["hidden_states"].device.type for b in prefetch]
    assert seen == ["cuda"] * len(prefetch.planned_batches())

    bad = write_data(tmp_path / "bad", {5: _set(3, 2, float("nan"))})
    checked = sample_check.CheckedTransfer(None, str(bad), config(tmp_path))
    prefetch = device_prefetch.DevicePrefetchLoader(training_loader(bad, checked, total_seq_len=64), device)
    assert sample_check.check_values_on_device(prefetch, checked)
    with pytest.raises(sample_check.BadSample) as error:
        for _ in prefetch:
            pass
    assert sample_check.stop_line(str(error.value)) == \
        f"{bad / 'hidden_states' / 'hs_5.safetensors'}: hidden_states contain NaN/Inf (layer slot(s) [2])"


def test_the_installed_wrappers_move_only_the_training_loaders_value_pass(tmp_path, monkeypatch):
    """compat's order (device_prefetch, then sample_check) around speculators' real create_train_val_loaders,
    as on a CUDA machine: the training loader's workers keep the cheap checks and its batches get the device
    check; the validation loader (not prefetched) keeps the whole check."""
    import speculators.train.cli as train_cli
    from speculators.train import dataloader

    data = write_data(tmp_path / "data")
    monkeypatch.setenv(sample_check.ENV, json.dumps(config(tmp_path)))
    monkeypatch.delenv(sample_check.OFF_ENV, raising=False)
    # speculators' own function (an in-process stage 04 of another test may have wrapped cli's); restored after
    monkeypatch.setattr(train_cli, "create_train_val_loaders", dataloader.create_train_val_loaders)
    monkeypatch.setattr(sample_check, "_applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device_prefetch's gate; nothing is copied here
    assert device_prefetch.apply() and sample_check.apply()
    train_loader, val_loader = train_cli.create_train_val_loaders(
        data_path=str(data), total_seq_len=64, hidden_states_dtype=torch.bfloat16, vllm_endpoint="", on_missing="raise",
        verifier_name_or_path="", request_timeout=None, max_retries=0, generation_validation_retries=0,
        max_consecutive_generation_failures=1, hidden_size=HIDDEN, num_target_layers=SLOTS - 1, num_workers=0,
        prefetch_factor=None, preprocess=None, train_data_ratio=0.75)
    assert isinstance(train_loader, device_prefetch.DevicePrefetchLoader)
    assert isinstance(train_loader.batch_check, sample_check.DeviceBatchCheck)
    assert train_loader.loader.dataset.transfer.values_on_device
    assert train_loader.batch_check.transfer is val_loader.dataset.transfer  # the whole check, for both
    assert not val_loader.dataset.transfer.values_on_device
    assert train_loader.batch_check.file_idx(0) == 0 and val_loader.dataset._map_to_file_idx(0) == 6


@pytest.mark.parametrize("on_bad", ["stop", "skip"])
def test_a_sigterm_raised_while_a_file_is_read_interrupts_training_and_blames_no_file(tmp_path, monkeypatch, on_bad):
    """speculators' SIGTERM/Ctrl-C handler raises TrainingInterruptedError wherever the main process is; with the
    loader in that process it can be inside a file read. That is an interrupt (exit 130, resumable), never a bad
    file: before, the read's `except Exception` called it 'unreadable safetensors (SIGTERM)' (exit 4), and with
    --on-bad-sample skip it would have left the sample out and trained on, the signal lost."""
    from hs_connectors import FileTransfer
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    data = write_data(tmp_path)

    def interrupted_read(self, file_idx):
        raise TrainingInterruptedError("SIGTERM")

    monkeypatch.setattr(FileTransfer, "get_cached", interrupted_read)  # the signal lands mid-read
    checked = sample_check.CheckedTransfer(None, str(data), config(tmp_path, on_bad))
    with pytest.raises(TrainingInterruptedError):
        checked.get_cached(3)
    assert not (tmp_path / sample_check.RECORD_NAME).exists()  # no sample recorded as bad
