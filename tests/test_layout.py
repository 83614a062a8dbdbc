"""Repository layout promises: thin scripts that import the library, never each other; the
product (eagle3-train/) never imports benchmark code (bench/, benchlib) and needs no path hacks."""

import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, STAGE_SCRIPTS

# Benchmark code: bench/'s library and the modules that moved there out of eagle3_pipeline.
BENCH_MODULES = {"bench", "benchlib"} | {f"eagle3_pipeline.{name}" for name in ("throughput", "acceptance", "organism")}


def test_no_script_imports_another_script():
    for script in SCRIPTS.glob("0*.py"):
        text = script.read_text()
        assert not re.search(r"^\s*(from|import)\s+(0[1-6]_|eagle3-train)", text, re.M), script.name
        assert "importlib" not in text, script.name


def test_library_never_imports_a_script():
    for module in (SCRIPTS / "eagle3_pipeline").rglob("*.py"):
        text = module.read_text()
        assert not re.search(r"^\s*(from|import)\s+(0[1-6]_|eagle3-train)", text, re.M), module
        assert not re.search(r"(runpy|import_module|spec_from_file_location)\(.*0[1-6]_", text), module


@pytest.mark.parametrize("script", sorted(STAGE_SCRIPTS.values()))
def test_every_script_help_shows_an_example(script):
    result = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "example:" in result.stdout and "--profile" in result.stdout


def _imported_modules(source: str, package: str):
    """Absolute module names `source` imports; relative imports resolved against `package`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(filter(None, [*parts[: len(parts) - node.level + 1], base]))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _is_bench(module: str) -> bool:
    return any(module == banned or module.startswith(banned + ".") for banned in BENCH_MODULES)


def test_the_product_never_imports_benchmark_code():
    offenders = []
    for path in sorted(SCRIPTS.rglob("*.py")):
        package = ".".join(path.relative_to(SCRIPTS).parts[:-1])
        source = path.read_text()
        offenders += [f"{path.relative_to(REPO)}: {m}" for m in _imported_modules(source, package) if _is_bench(m)]
        offenders += [f"{path.relative_to(REPO)}: {line.strip()}" for line in source.splitlines()
                      if re.search(r"(import_module|spec_from_file_location|run_path|run_module)\(.*bench", line)]
    assert not offenders, offenders


def test_the_import_check_sees_relative_absolute_and_moved_module_imports():
    source = "from ..throughput import x\nfrom benchlib import acceptance\nimport eagle3_pipeline.organism\nfrom . import files\n"
    modules = set(_imported_modules(source, "eagle3_pipeline.compat"))
    assert {"eagle3_pipeline.throughput", "benchlib", "eagle3_pipeline.organism", "eagle3_pipeline.compat.files"} <= modules
    assert [m for m in modules if _is_bench(m)] and not _is_bench("eagle3_pipeline.compat.files")


def test_the_product_needs_no_sys_path_edits():
    edits = [f"{path.relative_to(REPO)}:{number}" for path in sorted(SCRIPTS.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if "sys.path" in line]
    assert not edits, edits
