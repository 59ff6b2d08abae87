"""Shared by the tests that run examples as separate processes."""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
HOST = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")


def proc_env(provider: str) -> dict[str, str]:
    """The environment for a child process: the provider under test, this checkout."""
    env = dict(os.environ, AIORDMA_PROVIDER=provider)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env
