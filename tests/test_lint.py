"""mypy and ruff run as part of the test suite."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.lint


def _need(mod: str) -> None:
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} is not installed (it is in the 'test' extra)")


def test_ruff() -> None:
    _need("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "aiordma", "tests", "examples"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy() -> None:
    _need("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
