"""The hidden-state format's one home: where stage 02 puts each row's states and how they are stored.

Per dataset row i, `DATA/hidden_states/hs_{i}.safetensors` (speculators' layout) holds
`hidden_states` [T, NUM_SLOTS, H] (the residual stream after each aux layer, then the final decoder
layer's output before the final norm) and `token_ids` [T]; with `--storage fp8` (speculators' fp8
format) the values are float8_e4m3fn plus one float32 scale per token (extract/common.py writes and
checks the tensors). Stage 02, preflight, the run plan, online/hybrid training, the loader's sample
check and bench/ take names, sizes and dtypes from here.

Storage is spelled as stage 02's flag and manifest spell it: `storage` "dtype" (values in `dtype`)
or "fp8"; a `StateFormat` holds both and names what the files hold (`name`: "bfloat16", "float16",
"float32" or "fp8"). Torch-free at import: the run plan and `--print-config` never load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .manifest import ExtractManifest

HS_DIRNAME = "hidden_states"  # inside stage 01's output directory
FILE_PATTERN = "hs_{i}.safetensors"  # one file per dataset row i (speculators' FileTransfer reads this name)
FILE_GLOB = "hs_*.safetensors"
# What a token's hidden states hold by default: 3 aux layers + the final layer (pre-norm).
NUM_SLOTS = 4
FP8 = "fp8"
FP8_SCALE_BYTES = 4  # speculators' fp8 files: one float32 scale per token beside 1 B a value


class _Dtype(NamedTuple):
    value_bytes: int
    safetensors: str  # the header's name (safe_open's `get_dtype()`)
    torch: str  # the attribute of `torch`


# The one dtype-name map: a stored format's name -> its sizes and other spellings.
DTYPES: dict[str, _Dtype] = {
    "bfloat16": _Dtype(2, "BF16", "bfloat16"),
    "float16": _Dtype(2, "F16", "float16"),
    "float32": _Dtype(4, "F32", "float32"),
    FP8: _Dtype(1, "F8_E4M3", "float8_e4m3fn"),
}
_SPELLINGS = {spelling.lower(): name for name, dtype in DTYPES.items()
              for spelling in (name, dtype.safetensors, dtype.torch, f"torch.{dtype.torch}")}
_SPELLINGS.update({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"})


def dtype_name(spelling: str) -> str:
    """'bfloat16', 'torch.bfloat16', 'BF16' or 'bf16' -> 'bfloat16'; 'float8_e4m3fn' or 'F8_E4M3' -> 'fp8'."""
    try:
        return _SPELLINGS[str(spelling).lower()]
    except KeyError:
        raise ValueError(f"hidden-state dtype {spelling!r}: one of {', '.join(DTYPES)}") from None


def hs_name(index: int) -> str:
    return FILE_PATTERN.format(i=index)


def hs_file(hs_dir: Path, index: int) -> Path:
    return Path(hs_dir) / hs_name(index)


def rows_label(rows, limit: int = 8) -> str:
    """Rows as a one-line error names them: `hs_3, hs_7, ...` (their files' stems; the first `limit`)."""
    rows = list(rows or [])
    if not rows:
        return "unknown"
    return ", ".join(Path(hs_name(int(i))).stem for i in rows[:limit]) + (" ..." if len(rows) > limit else "")


def hs_files(hs_dir: Path) -> list[Path]:
    """Every row file in `hs_dir`, sorted by name."""
    return sorted(Path(hs_dir).glob(FILE_GLOB))


def row_of(file_name: str) -> int | None:
    """`hs_5.safetensors` -> 5 (None for any other name)."""
    prefix, suffix = FILE_PATTERN.split("{i}")
    stem = file_name.removeprefix(prefix).removesuffix(suffix)
    return int(stem) if file_name.startswith(prefix) and file_name.endswith(suffix) and stem.isdigit() else None


@dataclass(frozen=True)
class StateFormat:
    """How stage 02 stores the states: `storage` "dtype" (values in `dtype`) or "fp8" (`dtype` is then only
    the compute dtype of the HF backend)."""

    storage: str = "dtype"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.storage not in ("dtype", FP8):
            raise ValueError(f"hidden-state storage {self.storage!r}: 'dtype' or 'fp8'")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @classmethod
    def from_config(cls, cfg) -> StateFormat:
        """Stage 02's --storage and --dtype."""
        return cls(cfg.storage, cfg.dtype)

    @classmethod
    def from_manifest(cls, manifest: ExtractManifest) -> StateFormat:
        """Stage 02's manifest (its `storage` and `dtype`)."""
        return cls(manifest.storage, manifest.dtype)

    @classmethod
    def from_stored(cls, spelling: str) -> StateFormat:
        """The format of files whose `hidden_states` are in this dtype (any spelling, e.g. a vLLM file's header)."""
        name = dtype_name(spelling)
        return cls(FP8) if name == FP8 else cls("dtype", name)

    @property
    def name(self) -> str:
        """What the files hold: 'fp8', or the values' dtype."""
        return FP8 if self.storage == FP8 else self.dtype

    @property
    def is_fp8(self) -> bool:
        return self.storage == FP8

    @property
    def safetensors_dtype(self) -> str:
        return DTYPES[self.name].safetensors

    @property
    def torch_dtype(self):
        import torch  # local: this module stays torch-free for the run plan and --print-config

        return getattr(torch, DTYPES[self.name].torch)

    @property
    def compute_torch_dtype(self):
        """The HF backend's forward-pass dtype (--dtype, whatever the storage)."""
        import torch  # local: as torch_dtype

        return getattr(torch, DTYPES[self.dtype].torch)

    def bytes_per_token(self, hidden_size: int, num_slots: int = NUM_SLOTS) -> int:
        """Bytes of one token's states on disk: 4 x 7168 x 2 = 57,344 for Kimi-K2.5 in bf16, 4 x 7168 + 4 =
        28,676 in fp8."""
        per_value = num_slots * hidden_size * DTYPES[self.name].value_bytes
        return per_value + FP8_SCALE_BYTES if self.is_fp8 else per_value

    def value_text(self) -> str:
        """How one value is stored, for a size line: '2 B', or '1 B + a 4 B scale per token, fp8'."""
        return f"1 B + a {FP8_SCALE_BYTES} B scale per token, fp8" if self.is_fp8 else f"{DTYPES[self.name].value_bytes} B"
