"""Every sample is checked as the training loader reads it (stage 04, files, online and hybrid): one wrapper.

Why: stage 02's manifest says what it wrote, not what is on disk now. A file changed after 02
finished (a NaN; a constant slot; a bf16 file in an fp32 run; an fp8 file read as raw e4m3 without
its scales; another row's file) was trained on (loss nan) or dropped by speculators after a
multi-line tensor dump that nobody counted. So the loader refuses, before the sample is trained
on: an unreadable/truncated file; hidden_states of another shape than [T, n_slots, H]; another
storage than stage 02's (dtype, or fp8 + per-token scales); NaN/Inf; an all-zero or constant layer
slot; `token_ids` that are not the row's `input_ids` (a swapped file).

Where: speculators 0.9.0 reads each row's file (hidden_states.py) in hs_connectors' `FileTransfer.get_cached`
(and `FP8Transfer` dequantizes there), called by `train/data.py ArrowDataset._get_raw_data`;
generated samples (online/hybrid) come from `get_generated`. `apply` wraps
`speculators.train.cli.create_train_val_loaders` so the transfer it is given is a `CheckedTransfer`
(picklable: loader workers are spawned and unpickle the dataset with it). Cost: one min/max pass
per layer slot in the sample's own dtype, no copy (bench/README.md, "Loader check").

Where the value pass runs: on the CPU (no CUDA: cpu-mini, the tests) the workers check everything.
With CUDA and the default `--on-bad-sample stop`, the training loader's workers keep the cheap checks
(readable, storage/dtype, shape, token_ids: no pass over the values) and the value pass (NaN/Inf,
constant slot: most of a worker's CPU time per sample) runs on the GPU on the packed batch, in
compat/device_prefetch.py's copy thread before the batch is handed to the trainer
(`check_values_on_device`, `DeviceBatchCheck`); a hit re-runs this CPU check on that batch's files,
so the line still names the row's file and the reason. `--on-bad-sample skip` keeps the whole
check in the workers: only they can leave a sample out of its batch before it is packed (dropping
it from a packed batch on the GPU would mean re-packing every tensor of the batch), and skip is an
explicit choice for damaged data, where loader time is not the concern. Validation and generated
(online/hybrid) samples keep the whole check in the workers too.

A bad sample stops training with one line naming the file and the reason (stage 04 prints it), or,
with `--on-bad-sample skip`, is left out of its batch, and listed (`bad_samples.jsonl`, then stage
04's manifest). Skipping has a limit, as stage 01's `--on-bad-row skip` has: once more than
`--max-bad-fraction` of the run's samples are left out, or all of them, the worker that left out the
last one stops training with one line (`left_out_problem`: every rank's and worker's lines in
`bad_samples.jsonl` count, each sample once). Settings come from the environment (`ENV`, JSON
written by stage 04), which every rank and loader worker inherits. Gate: `ENV` set and not switched
off with `OFF_ENV=off` (only the throughput bench does that, to measure the check's cost);
speculators 0.9.0 (else it raises).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..files import append_line
from ..hidden_states import HS_DIRNAME, hs_file, rows_label
from .gate import require_speculators

SUPPORTED_SPECULATORS = ("0.9.0",)
ENV = "EAGLE3_SAMPLE_CHECK"
OFF_ENV = "EAGLE3_INPUT_CHECKS"  # "off": no loader check, no loss check (bench/train_throughput.py --loader-check)
BAD_SAMPLE_TAG = "[eagle3 bad sample] "
RECORD_NAME = "bad_samples.jsonl"  # in stage 04's --output (listed in its manifest)
TOO_MANY_BAD = "> --max-bad-fraction"  # in the line of a run stopped for leaving out too many samples
NONE_LEFT = "none is left to train on"  # ... or all of them
_applied = False
_left_out: dict[str, tuple[int, int, dict]] = {}  # record path -> (inode, bytes read, {sample: (file, reason)})


class BadSample(RuntimeError):
    """A sample that must not be trained on; the message (after BAD_SAMPLE_TAG) is one line."""


def settings() -> dict | None:
    if os.environ.get(OFF_ENV) == "off":
        return None
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else None


def apply() -> bool:
    global _applied
    if settings() is None:
        return False
    if _applied:
        return True
    require_speculators("sample_check", SUPPORTED_SPECULATORS,
                        "speculators/train/data.py and hs_connectors/transfer.py")
    import speculators.train.cli as train_cli

    create_loaders = train_cli.create_train_val_loaders

    def create_checked(*args: Any, **kwargs: Any):
        checked = CheckedTransfer(kwargs.get("transfer"), kwargs["data_path"], settings())
        kwargs["transfer"] = checked
        train_loader, val_loader = create_loaders(*args, **kwargs)
        check_values_on_device(train_loader, checked)
        return train_loader, val_loader

    create_checked.__dict__.update(create_loaders.__dict__)  # markers of other wrappers (device_prefetch)
    create_checked._sample_check = True  # type: ignore[attr-defined]
    train_cli.create_train_val_loaders = create_checked
    _applied = True
    return True


# --- the check itself (also what the bench times) ------------------------------------------------

def storage_problem(sample: dict, expected: dict) -> str | None:
    """The file as stored (before any dequantization): stage 02's dtype, or fp8 with its scales."""
    from hs_connectors.fp8_utils import SCALES_KEY

    missing = {"hidden_states", "token_ids"} - sample.keys()
    if missing:
        return f"missing tensors {sorted(missing)}"
    dtype = str(sample["hidden_states"].dtype).removeprefix("torch.")
    has_scales = SCALES_KEY in sample
    if expected.get("storage") == "fp8":
        if dtype != "float8_e4m3fn" or not has_scales:
            return (f"stored as {dtype}{' with' if has_scales else ' without'} fp8 scales; stage 02 stored fp8 "
                    f"(float8_e4m3fn + {SCALES_KEY})")
        return None
    if dtype == "float8_e4m3fn":
        return f"stored as fp8 (float8_e4m3fn{'' if has_scales else ', no scales'}); stage 02 stored {expected.get('dtype')}"
    if expected.get("dtype") and dtype != expected["dtype"]:
        return f"stored as {dtype}; stage 02 stored {expected['dtype']} (files are never mixed)"
    if has_scales:
        return f"{SCALES_KEY} beside {dtype} states (only fp8 files carry scales)"
    return None


def value_problem(hidden_states, token_ids, expected_ids, num_slots: int, hidden_size: int) -> str | None:
    """Shape, token ids, NaN/Inf, zero/constant slots (the CPU check: `layout_problem`, then `finite_problem`)."""
    return (layout_problem(hidden_states, token_ids, expected_ids, num_slots, hidden_size)
            or finite_problem(hidden_states, num_slots, hidden_size))


def layout_problem(hidden_states, token_ids, expected_ids, num_slots: int, hidden_size: int) -> str | None:
    """Token ids against the row, then the shape: T integers and a shape, no pass over the values."""
    import torch

    if token_ids.numel() != len(expected_ids) or not torch.equal(token_ids.reshape(-1).to(torch.long), expected_ids):
        return (f"token_ids ({token_ids.numel()} tokens) are not the row's input_ids ({len(expected_ids)} tokens): "
                f"another row's file, or the data was re-prepared")
    shape = (len(expected_ids), num_slots, hidden_size)
    if tuple(hidden_states.shape) != shape:
        return f"hidden_states shape {list(hidden_states.shape)}, expected {list(shape)}"
    return None


def finite_problem(hidden_states, num_slots: int, hidden_size: int) -> str | None:
    """NaN/Inf, zero/constant slots of one [T, slots, H] sample: one min/max pass, in the states' own dtype."""
    import torch

    # One pass over the sample: per-column max and min over the tokens (contiguous rows: the fastest
    # reduction on a CPU; NaN propagates through both, +Inf shows in the max, -Inf in the min), then per slot.
    flat = hidden_states.reshape(hidden_states.shape[0], -1)
    high = flat.amax(dim=0).float().reshape(num_slots, hidden_size)
    low = flat.amin(dim=0).float().reshape(num_slots, hidden_size)
    bad = ~(torch.isfinite(high).all(dim=1) & torch.isfinite(low).all(dim=1))
    if bad.any():
        return f"hidden_states contain NaN/Inf (layer slot(s) {bad.nonzero().flatten().tolist()})"
    slot_high, slot_low = high.amax(dim=1), low.amin(dim=1)
    constant = (slot_high == slot_low).nonzero().flatten().tolist()
    if constant:
        return f"hidden_states layer slot(s) {constant} hold one constant value ({slot_low[constant[0]].item():.6g})"
    return None


def record(path: str | None, entry: dict) -> None:
    """One line per bad sample (loader workers append: O_APPEND lines this short are not interleaved). A full
    disk is DiskFull naming this file and the sample; in a loader worker stage 04 reads that line back from the
    worker's traceback (files.disk_full_line), so it is never worded as a checkpoint save."""
    if not path:
        return
    if entry.get("file") is None:  # the stop line (too many left out; a batch's values on the GPU)
        what = f"the loader recorded why training stops ({entry.get('reason')})"
    else:
        row = f"row {entry['row']}: " if entry.get("row") is not None and entry["file"] != f"row {entry['row']}" else ""
        what = f"the loader recorded bad sample {entry['file']} ({row}{entry.get('reason')})"
    append_line(path, json.dumps(entry, default=int), what)


def sample_key(entry: dict) -> str:
    """The sample a record is about, however many epochs or ranks read it: stage 02's file (a sliced run's
    view links resolved) or, for generated samples, the row."""
    return str(entry.get("sample") or entry.get("file"))


def left_out_samples(record_path: str | Path) -> dict[str, tuple[str, str]]:
    """{sample: (file, reason)} of every sample left out so far, by any rank or worker. Each call reads
    only the lines added since this process's last call (a run that skips many samples reads its
    record once, not once per skip); a line still being written is read next time."""
    path = str(record_path)
    inode, offset, found = _left_out.get(path, (None, 0, {}))
    try:
        with open(path, "rb") as handle:
            stat = os.fstat(handle.fileno())
            if stat.st_ino != inode or stat.st_size < offset:  # another record (--overwrite): read it anew
                inode, offset, found = stat.st_ino, 0, {}
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return {}
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if entry.get("action") == "skip":
            found.setdefault(sample_key(entry), (str(entry.get("file")), str(entry.get("reason"))))
    _left_out[path] = (inode, offset + end, found)
    return found


def left_out_problem(config: dict) -> str | None:
    """--on-bad-sample skip: the one line that stops training once the samples left out are more than
    --max-bad-fraction of the run's (`samples`: stage 01's rows, both splits), or are all of them."""
    total, limit = config.get("samples"), config.get("max_bad_fraction")
    if not total or limit is None or not config.get("record"):
        return None
    found = left_out_samples(config["record"])
    count = len(found)
    if not found or (count <= limit * total and count < total):
        return None
    first = "; first: {}: {}".format(*next(iter(found.values())))
    data = config.get("data", "the training data")
    if count / total <= limit:  # --max-bad-fraction 1 and every sample bad
        return f"{data}: all {total} samples are bad, {NONE_LEFT}{first}"
    return f"{data}: {count} of {total} samples are bad ({count / total:.1%} {TOO_MANY_BAD} {limit:.1%}){first}"


def too_many_bad(problem: str) -> bool:
    """Whether a stop line is `left_out_problem`'s (not one bad file's)."""
    return TOO_MANY_BAD in problem or NONE_LEFT in problem


def file_stamp(path: Path | None) -> list[int] | None:
    """[size, mtime_ns, inode] of a sample's file (through a sliced run's view link) as it was found bad:
    a file redone since (02 rewrites it: a new inode and mtime) differs (`forget_redone`)."""
    try:
        stat = os.stat(path) if path is not None else None
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino] if stat else None


def forget_redone(out_dir: str | Path) -> tuple[int, int]:
    """Before a run (re)starts (stage 04, the one writer, no rank running): drop from the record the samples
    left out whose files were redone since (02 --validate then 02, as the stop line advises: the loader checks
    them again as it reads them, and lists them again if still bad), and the stop lines of earlier attempts
    (each was reported when it stopped; a later stop must not be read as one of them). Returns (samples
    forgotten, stop lines dropped); the record is rewritten (temp + rename) only when one was."""
    from ..files import atomic_write_text

    path = Path(out_dir) / RECORD_NAME
    kept, forgotten, stops = [], set(), 0
    for entry in read_records(out_dir):
        if entry.get("action") == "stop":
            stops += 1
            continue
        stamp = entry.get("stamp")
        if entry.get("action") == "skip" and stamp is not None:  # a file (not a generated sample) as it was found
            now = file_stamp(Path(str(entry.get("sample") or entry.get("file"))))
            if now != stamp:
                forgotten.add(sample_key(entry))
                continue
        kept.append(entry)
    if forgotten or stops:
        atomic_write_text(path, "".join(json.dumps(entry, default=int) + "\n" for entry in kept))
    return len(forgotten), stops


def read_records(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / RECORD_NAME
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


class CheckedTransfer:
    """hs_connectors' transfer with every sample checked as it is read (see the module docstring)."""

    def __init__(self, inner, data_path: str, config: dict, values_on_device: bool = False):
        from hs_connectors import FileTransfer

        self.inner = inner if inner is not None else FileTransfer(Path(data_path) / HS_DIRNAME)
        self.data_path = str(data_path)
        self.config = config
        # True: a read file gets the cheap checks only; its values are checked on the GPU, in the
        # packed batch (`check_values_on_device`). Generated samples always get the whole check.
        self.values_on_device = values_on_device
        self._rows = None
        self._current: tuple[int, Any] | None = None

    def __getattr__(self, name: str):  # setup(), hidden_states_path, ...: the wrapped transfer's
        if name in ("inner", "__setstate__", "__getstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getstate__(self):
        return {**self.__dict__, "_rows": None}  # workers reopen the (memory-mapped) dataset

    def _row_ids(self, file_idx: int):
        import torch

        if self._rows is None:
            from datasets import load_from_disk

            self._rows = load_from_disk(self.data_path).select_columns(["input_ids"])
        return torch.as_tensor(self._rows[file_idx]["input_ids"], dtype=torch.long).reshape(-1)

    def _problem(self, sample: dict, file_idx: int, raw: dict | None, values: bool = True) -> str | None:
        expected = self.config
        if raw is not None:
            problem = storage_problem(raw, expected)
            if problem:
                return problem
        problem = layout_problem(sample["hidden_states"], sample["token_ids"], self._row_ids(file_idx),
                                 expected["slots"], expected["hidden"])
        if problem or not values:
            return problem
        return finite_problem(sample["hidden_states"], expected["slots"], expected["hidden"])

    def _bad(self, where: str, file_idx: int, problem: str, path: Path | None = None):
        from speculators.train.recovery import SampleUnavailable

        action = self.config.get("on_bad", "stop")
        sample = str(path.resolve()) if path is not None and path.is_symlink() else where  # a sliced run's view
        record(self.config.get("record"), {"file": where, "sample": sample, "row": file_idx, "reason": problem,
                                           "action": action, "stamp": file_stamp(path)})
        if action != "skip":
            raise BadSample(f"{BAD_SAMPLE_TAG}{where}: {problem}")
        too_many = left_out_problem(self.config)
        if too_many:
            record(self.config.get("record"), {"file": None, "reason": too_many, "action": "stop"})
            raise BadSample(f"{BAD_SAMPLE_TAG}{too_many}")
        return SampleUnavailable(reason=f"{where}: {problem}")

    def get_cached(self, file_idx: int):
        from hs_connectors import FileTransfer
        from speculators.train.graceful_shutdown import TrainingInterruptedError

        self._current = (file_idx, None)
        if not isinstance(self.inner, FileTransfer):
            sample = self.inner.get_cached(file_idx)
            problem = sample is not None and self._problem(sample, file_idx, None, values=not self.values_on_device)
            return self._bad(f"row {file_idx}", file_idx, problem) if problem else sample
        path = hs_file(self.inner.hidden_states_path, file_idx)
        if not path.is_file():
            return self.inner.get_cached(file_idx)  # None: --on-missing decides (raise, or generate)
        try:
            raw = FileTransfer.get_cached(self.inner, file_idx)  # the file as stored (plain load_file)
        except TrainingInterruptedError:  # SIGTERM / Ctrl-C raised mid-read (loading in this process): not the file's
            raise
        except Exception as exc:  # safetensors raises several types for truncated/garbled files
            return self._bad(str(path), file_idx, f"unreadable safetensors ({str(exc).splitlines()[0][:120]})", path)
        if raw is None:
            return None
        problem = storage_problem(raw, self.config)
        if problem:
            return self._bad(str(path), file_idx, problem, path)
        dequantize = getattr(self.inner, "_dequantize", None)  # FP8Transfer: scales -> dequantize_dtype
        sample = dequantize(raw) if dequantize else raw
        problem = self._problem(sample, file_idx, None, values=not self.values_on_device)
        return self._bad(str(path), file_idx, problem, path) if problem else sample

    def get_generated(self, hs_transfer_params: dict):
        sample = self.inner.get_generated(hs_transfer_params)
        if sample is None or self._current is None:
            return sample
        file_idx = self._current[0]
        handle = hs_transfer_params.get("hidden_states_path") or hs_transfer_params.get("handle")
        problem = self._problem(sample, file_idx, None)
        if problem:  # speculators retries the round trip; after its retries the reason carries the tag
            raise BadSample(f"{BAD_SAMPLE_TAG}row {file_idx} (generated by vLLM, {handle}): {problem}")
        return sample

    def delete(self, handle: str) -> None:
        return self.inner.delete(handle)

    def setup(self) -> None:
        return self.inner.setup()


# --- the value half on the GPU (CUDA training: compat/device_prefetch.py's producer thread) -------

OK, NON_FINITE, CONSTANT = 0, 1, 2  # packed_value_codes' codes


def packed_value_codes(hidden_states, last_hidden_states, document_ids, num_docs: int):
    """Per packed document and layer slot of one training batch: OK, NON_FINITE or CONSTANT (int8 [docs, slots]).

    The batch as speculators' CollateFn packs it (after eagle3's shift_batch): `hidden_states`
    [1, L, (slots-1)*H] (the aux slots side by side), `last_hidden_states` [1, L, H] (the last slot),
    `document_ids` [1, L] (document k's tokens, -1 for padding). One fused min/max over H per token
    and slot (no copy of the batch), then per document: any NaN/Inf (NaN propagates through min/max,
    +Inf shows in the max, -Inf in the min), else max == min over all its tokens (all-zero included),
    as `finite_problem` decides per sample on the CPU. Runs on any device (the tests run it on the CPU)."""
    import torch

    hidden = last_hidden_states.shape[-1]
    length = document_ids.shape[-1]
    aux_low, aux_high = torch.aminmax(hidden_states.reshape(length, -1, hidden), dim=-1)
    last_low, last_high = torch.aminmax(last_hidden_states.reshape(length, 1, hidden), dim=-1)
    low = torch.cat([aux_low, last_low], dim=1).float()  # [L, slots]
    high = torch.cat([aux_high, last_high], dim=1).float()
    non_finite = ~(torch.isfinite(low) & torch.isfinite(high))
    docs = document_ids.reshape(length).long()
    bucket = torch.where(docs >= 0, docs, torch.full_like(docs, num_docs))  # padding: a bucket of its own
    shape = (num_docs + 1, low.shape[1])
    bad = torch.zeros(shape, device=low.device).index_add_(0, bucket, non_finite.float()) > 0
    index = bucket.unsqueeze(1).expand_as(low)
    doc_low = torch.full(shape, float("inf"), device=low.device).scatter_reduce_(
        0, index, torch.where(non_finite, 0.0, low), "amin")
    doc_high = torch.full(shape, float("-inf"), device=low.device).scatter_reduce_(
        0, index, torch.where(non_finite, 0.0, high), "amax")
    codes = torch.where(bad, NON_FINITE, torch.where(doc_high == doc_low, CONSTANT, OK))
    return codes[:num_docs].to(torch.int8)


def check_values_on_device(train_loader, checked: CheckedTransfer) -> bool:
    """CUDA, stop mode: the training loader's workers keep the cheap checks (readable, storage,
    token_ids, shape) and the value pass (NaN/Inf, constant slot: most of a loader worker's CPU time
    per sample, bench/README.md "Loader check") runs on the GPU, where the batch lands anyway: in the
    device-prefetch thread, on its copy stream, ahead of the trainer (`DeviceBatchCheck`).

    Not in skip mode: a skipped sample must be left out of its batch before packing, and only the
    workers can do that, so `--on-bad-sample skip` keeps the whole check in the workers (its
    explicit choice costs loader time). Not for validation: the validation loader is not
    prefetched and keeps the whole check. Returns whether the value pass moved."""
    from .device_prefetch import DevicePrefetchLoader

    if not isinstance(train_loader, DevicePrefetchLoader) or checked.config.get("on_bad", "stop") != "stop":
        return False
    dataset = getattr(train_loader.loader, "dataset", None)
    if getattr(dataset, "transfer", None) is not checked:
        return False
    # train and validation datasets share `checked`: the training one gets its own (workers are
    # spawned on the first iter(), so they unpickle this one)
    dataset.transfer = CheckedTransfer(checked.inner, checked.data_path, checked.config, values_on_device=True)
    train_loader.batch_check = DeviceBatchCheck(checked, getattr(dataset, "_map_to_file_idx", int))
    if os.environ.get("RANK", "0") == "0":  # the run's log says where the value pass ran
        print("[eagle3] sample check: loader workers check storage, shape and token_ids; NaN/Inf and constant "
              "slots are checked on the GPU in each packed training batch", file=sys.stderr, flush=True)
    return True


class DeviceBatchCheck:
    """`packed_value_codes` on a batch on the GPU; on a hit, the precise CPU check of that batch's files.

    `launch` runs on the producer's copy stream right after the batch's copy and starts the small
    result's copy back; the producer waits for it (`verdict`) before it hands the batch on, so no
    batch with a bad value reaches the trainer. On a hit (failure path only) the batch's rows (the
    batch sampler's) are re-read and checked on the CPU one by one, flagged documents first: the
    first bad file stops training with the same one line as the worker-side check, naming
    the row's file and the reason. What the GPU sees is what the trainer reads: the tokens
    packed into the batch (a sample cut at the batch's end is checked up to the cut; eagle3's shift
    drops each sample's last aux token and first last-slot token, never read) in the training dtype.
    A hit no file explains (the file changed back, or a difference only in what is trained on) still
    stops, naming the batch's rows and the packed document."""

    def __init__(self, transfer: CheckedTransfer, file_idx):
        self.transfer = transfer  # the whole check (stop mode), for the failure path
        self.file_idx = file_idx  # dataset index -> the index in the row's file name

    def launch(self, batch: dict, moved: dict):
        import torch

        docs = batch.get("document_ids")
        if not isinstance(docs, torch.Tensor) or "verifier_last_hidden_states" not in moved or not docs.numel():
            return None
        num_docs = int(docs.max()) + 1
        if num_docs <= 0:  # an empty batch (every sample unavailable)
            return None
        codes = packed_value_codes(moved["hidden_states"], moved["verifier_last_hidden_states"],
                                   moved["document_ids"], num_docs)
        host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=codes.is_cuda)
        host.copy_(codes, non_blocking=True)
        return host

    def verdict(self, codes, rows) -> None:
        """After the copy stream's event: raise BadSample (one line) when any document is bad."""
        if codes is None or not bool(codes.any()):
            return
        files = [self.file_idx(int(row)) for row in rows] if rows is not None else []
        flagged = [doc for doc in range(codes.shape[0]) if codes[doc].any()]
        first = [files[doc] for doc in flagged if len(files) == codes.shape[0]]
        for file_idx in dict.fromkeys(first + files):
            self.transfer.get_cached(file_idx)  # a bad file raises BadSample naming it (and records it)
        doc = flagged[0]
        code = NON_FINITE if bool((codes[doc] == NON_FINITE).any()) else CONSTANT
        slots = (codes[doc] == code).nonzero().flatten().tolist()
        what = "NaN/Inf" if code == NON_FINITE else "one constant value"
        problem = (f"training batch (rows {rows_label(files)}): packed document {doc} of {codes.shape[0]} holds {what} in layer "
                   f"slot(s) {slots} as read for training, though each file passes the CPU check now")
        record(self.transfer.config.get("record"), {"file": None, "rows": files, "reason": problem, "action": "stop"})
        raise BadSample(f"{BAD_SAMPLE_TAG}{problem}")


def generated_bad(reason: str, file_idx: int):
    """online/hybrid: a generated sample that failed this check after speculators' retries (the server
    answers): stop (a fatal SampleUnavailable: the run stops at that batch) or skip and list it."""
    from speculators.train.recovery import SampleUnavailable

    config = settings() or {}
    problem = reason.split(BAD_SAMPLE_TAG, 1)[1].splitlines()[0]
    action = config.get("on_bad", "stop")
    record(config.get("record"), {"file": problem.split(": ", 1)[0], "sample": f"row {file_idx}", "row": file_idx,
                                  "reason": problem.split(": ", 1)[-1], "action": action})
    if action == "skip" and (too_many := left_out_problem(config)):
        record(config.get("record"), {"file": None, "reason": too_many, "action": "stop"})
        problem = too_many
    elif action == "skip":
        return SampleUnavailable(reason=problem)
    return SampleUnavailable(reason=BAD_SAMPLE_TAG + problem, counts_as_failure=True, fatal=True)


def stop_line(text: str) -> str | None:
    """The one line a stopped run reports, from an exception's text (worker tracebacks included)."""
    if BAD_SAMPLE_TAG not in text:
        return None
    return text.split(BAD_SAMPLE_TAG, 1)[1].splitlines()[0].strip()
