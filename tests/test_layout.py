"""Repository layout promises: thin scripts that import the library, never each other."""

import re
import subprocess
import sys

import pytest

from conftest import SCRIPTS, STAGE_SCRIPTS


def test_no_script_imports_another_script():
    for script in SCRIPTS.glob("0*.py"):
        text = script.read_text()
        assert not re.search(r"^\s*(from|import)\s+(0[1-5]_|eagle3-train)", text, re.M), script.name
        assert "importlib" not in text, script.name


def test_library_never_imports_a_script():
    for module in (SCRIPTS / "eagle3_pipeline").rglob("*.py"):
        text = module.read_text()
        assert not re.search(r"^\s*(from|import)\s+(0[1-5]_|eagle3-train)", text, re.M), module
        assert not re.search(r"(runpy|import_module|spec_from_file_location)\(.*0[1-5]_", text), module


@pytest.mark.parametrize("script", sorted(STAGE_SCRIPTS.values()))
def test_every_script_help_shows_an_example(script):
    result = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "example:" in result.stdout and "--profile" in result.stdout
