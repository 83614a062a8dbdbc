"""hidden_states.py: the hidden-state format's one home (names, slots, storage, dtypes, bytes)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.config import ExtractConfig
from eagle3_pipeline.hidden_states import (
    FILE_PATTERN,
    HS_DIRNAME,
    StateFormat,
    dtype_name,
    hs_file,
    hs_files,
    hs_name,
    row_of,
)
from eagle3_pipeline.manifest import ExtractManifest

REPO = Path(__file__).resolve().parents[1]


def test_row_file_names_round_trip_and_other_names_are_no_row():
    assert hs_name(5) == "hs_5.safetensors" and hs_file(Path("d"), 5) == Path("d") / "hs_5.safetensors"
    assert [row_of(hs_name(i)) for i in (0, 7, 123)] == [0, 7, 123]
    for other in (".hs_5.safetensors.tmp-12", "hs_5.safetensors.lock", "hs_x.safetensors", "manifest.json", "hs_5.pt"):
        assert row_of(other) is None, other


def test_hs_files_lists_only_row_files(tmp_path):
    for name in (hs_name(2), hs_name(10), ".hs_3.safetensors.tmp-1", "manifest.json"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in hs_files(tmp_path)] == ["hs_10.safetensors", "hs_2.safetensors"]


def test_every_dtype_spelling_names_one_format():
    for spelling in ("bfloat16", "torch.bfloat16", "BF16", "bf16"):
        assert dtype_name(spelling) == "bfloat16"
    for spelling in ("fp8", "float8_e4m3fn", "torch.float8_e4m3fn", "F8_E4M3"):
        assert dtype_name(spelling) == "fp8"
    assert dtype_name("F32") == "float32" and dtype_name("f16") == "float16"
    with pytest.raises(ValueError, match="int8"):
        dtype_name("int8")


def test_a_format_from_the_config_the_manifest_and_the_files_agree():
    for storage, dtype, stored in (("dtype", "bfloat16", torch.bfloat16), ("dtype", "float32", torch.float32),
                                   ("fp8", "bfloat16", torch.float8_e4m3fn)):
        cfg = ExtractConfig(target="t", data="d", storage=storage, dtype=dtype)
        from_config = StateFormat.from_config(cfg)
        from_manifest = StateFormat.from_manifest(ExtractManifest(storage=storage, dtype=dtype))
        assert from_config == from_manifest and from_config.torch_dtype == stored
        assert StateFormat.from_stored(str(stored)).name == from_config.name
        assert from_config.compute_torch_dtype == getattr(torch, dtype)
    with pytest.raises(ValueError, match="storage"):
        StateFormat("bf16")


def test_bytes_per_token_are_kimis_57344_in_bf16_and_half_plus_a_scale_in_fp8():
    assert StateFormat().bytes_per_token(7168) == 4 * 7168 * 2 == 57_344
    assert StateFormat("fp8").bytes_per_token(7168) == 4 * 7168 + 4 == 28_676
    assert StateFormat("dtype", "float32").bytes_per_token(128, 3) == 3 * 128 * 4
    assert StateFormat("fp8").value_text() == "1 B + a 4 B scale per token, fp8" and StateFormat().value_text() == "2 B"


def test_the_format_module_imports_no_torch():
    code = "import sys, eagle3_pipeline.hidden_states; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_file_name_is_spelled_only_in_hidden_states_py():
    """The format's one home: no other library, script or bench file spells the row file's name."""
    spelled = []
    for root in (REPO / "eagle3-train", REPO / "bench"):
        for path in root.rglob("*"):
            if path.suffix in (".py", ".sh") and path.name != "hidden_states.py" and "hs_{" in path.read_text():
                spelled.append(str(path.relative_to(REPO)))
    assert spelled == []
    assert HS_DIRNAME == "hidden_states" and re.fullmatch(r"hs_\{i\}\.safetensors", FILE_PATTERN)
