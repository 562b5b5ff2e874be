"""The package as users get it: every subpackage is in the wheel, and a wheel installed in a
fresh venv finds its presets when run from an empty folder (no checkout around it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import checkpoint_ad

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).parents[1]


def test_every_subpackage_and_the_presets_are_listed_for_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "checkpoint_ad").rglob("__init__.py")}
    assert set(config["packages"]) == found | {"checkpoint_ad._presets"}
    assert config["package-dir"] == {"checkpoint_ad._presets": "strategies"}
    assert "*.toml" in config["package-data"]["checkpoint_ad._presets"]
    assert config["package-data"]["checkpoint_ad"] == ["py.typed"]
    assert (ROOT / "checkpoint_ad" / "py.typed").is_file()


def test_the_license_file_matches_the_declared_license():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = (ROOT / "LICENSE").read_text()
    assert project["license"] == "MIT" and text.startswith("MIT License")
    assert "checkpoint-ad developers" in text


@pytest.mark.slow
def test_an_installed_wheel_finds_its_presets_from_an_empty_folder():
    # the venv is made by this interpreter, whatever python3 on PATH is, with the wheel's
    # dependencies installed: nothing is borrowed from this interpreter's site-packages
    result = subprocess.run([str(ROOT / ".ci" / "wheel-check")], capture_output=True, text=True,
                            check=False, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    origin = next(line for line in out.splitlines() if line.startswith("checkpoint_ad from"))
    assert "/venv/" in origin and str(ROOT) not in origin  # the wheel, not this checkout
    listed = [line.split()[0] for line in out.splitlines() if "lossless" in line or "lossy" in line]
    assert {"keep-all", "revolve-8-int8", "int8"} <= set(listed)
    assert "revolve-4" in out and "grad error" in out
    assert out.count(f"checkpoint-ad {checkpoint_ad.__version__}\n") == 2  # script and -m
    assert "py.typed shipped: True" in out  # type checkers read the package's hints
