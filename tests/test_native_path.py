"""The native build's per-message path runs no interpreted aiordma code.

mypyc compiles the modules of ``aiordma.native.MODULES``. Whatever it cannot pin down
runs interpreted again: a module left out of the list, a dataclass's generated
``__init__``, an ``Enum.__hash__`` (a Python function) behind a dict lookup. Each such
call costs about what a whole compiled layer costs (``docs/history/cost-2026-12-02.json``),
so the native build must run none per message. Skipped on the pure sources.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
from typing import Any

import pytest
from _pairs import T, pair

import aiordma
from aiordma import native

pytestmark = pytest.mark.usefixtures("soft_cma")  # soft: with and without CMA

PKG = os.path.dirname(os.path.abspath(aiordma.__file__)) + os.sep
ROUND_TRIPS = 200
WARMUP = 20


@pytest.mark.parametrize("mode", ["blocking", "hybrid", "polling"])
async def test_native_build_runs_no_interpreted_aiordma_code_per_message(
        provider_name: str, mode: str) -> None:
    if native.build().modules != "mypyc":
        pytest.skip("the native build's property (make test-native)")
    opts = {"provider": provider_name, "poll_mode": mode}
    msg = b"x" * 64
    async with pair(opts) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)

        async def echo() -> None:
            for _ in range(WARMUP + ROUND_TRIPS):
                await srv.send(await srv.recv())

        task = asyncio.create_task(echo())
        for _ in range(WARMUP):
            await asyncio.wait_for(ep.send(msg), T)
            assert await asyncio.wait_for(ep.recv(), T) == msg
        seen: collections.Counter[str] = collections.Counter()

        def hook(frame: Any, event: str, _arg: Any) -> None:
            code = frame.f_code
            if event == "call" and code.co_filename.startswith(PKG):
                seen[f"{code.co_filename[len(PKG):]}:{code.co_firstlineno} {code.co_name}"] += 1

        sys.setprofile(hook)  # this thread: the loop's, which moves the soft device's bytes
        try:
            for _ in range(ROUND_TRIPS):
                await ep.send(msg)
                assert await ep.recv() == msg
        finally:
            sys.setprofile(None)
        await asyncio.wait_for(task, T)
    assert not seen, f"interpreted per {ROUND_TRIPS} round trips: {dict(seen.most_common(10))}"
