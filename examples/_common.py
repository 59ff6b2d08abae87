"""Shared bits of the examples: loop choice and size parsing."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def parse_size(text: str) -> int:
    """'64' -> 64, '4K' -> 4096, '1M' -> 1048576, '64MiB' -> 67108864."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    return int(t) * mult


def run(main: Coroutine[Any, Any, int], loop: str = "auto") -> int:
    """Run ``main`` on uvloop when installed (or asked for), else asyncio."""
    if loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise
        else:
            if hasattr(uvloop, "run"):
                result: int = uvloop.run(main)
                return result
            uvloop.install()  # uvloop < 0.18 (e.g. Debian bookworm's) has no run()
    return asyncio.run(main)
