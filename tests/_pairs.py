"""A connected pair of endpoints in one process, for the Endpoint-level tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import aiordma

HOST = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")
T = 20.0  # bound for every await in these tests


@contextlib.asynccontextmanager
async def pair(opts: dict, handler: Callable[[aiordma.Endpoint], Awaitable[None]] | None = None,
               **extra: object) -> AsyncIterator[tuple[aiordma.Endpoint, asyncio.Queue]]:
    """(client endpoint, queue that receives the server endpoint). The server's
    handler waits until the test is done unless ``handler`` is given. On exit the
    client is aborted and the listener closed."""
    q: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def default(ep: aiordma.Endpoint) -> None:
        await q.put(ep)
        await done.wait()

    listener = await aiordma.listen(handler or default, HOST, 0, **opts, **extra)
    try:
        ep = await aiordma.connect(HOST, listener.port, timeout=T, **opts, **extra)
        try:
            yield ep, q
        finally:
            done.set()
            ep.abort()
            await asyncio.wait_for(ep.wait_closed(), T)
    finally:
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)
