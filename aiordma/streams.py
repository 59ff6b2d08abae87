"""asyncio streams over RDMA: ``open_connection`` and ``start_server``.

They return asyncio's own ``StreamReader``/``StreamWriter`` (with its own
``StreamReaderProtocol``) over an ``RDMATransport``, exactly as ``asyncio.open_connection``
/ ``asyncio.start_server`` do over TCP, so stream code runs unchanged:
``writer.drain()`` honours the transport's flow control, ``writer.close()`` +
``await writer.wait_closed()`` close gracefully, ``writer.write_eof()`` half-closes
(the peer's ``reader.read()`` returns ``b""``), ``limit=`` bounds the reader's buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .rdma_server import RDMAServer, create_connection, create_server

_DEFAULT_LIMIT = 2 ** 16  # 64 KiB, as asyncio.streams

ClientConnected = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]


async def open_connection(host: str, port: int, *, limit: int = _DEFAULT_LIMIT,
                          **opts: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to an aiordma server; returns ``(reader, writer)``.

    Options as ``aiordma.create_connection``. Raises as ``aiordma.connect``.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await create_connection(lambda: protocol, host, port, **opts)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    return reader, writer


async def start_server(client_connected_cb: ClientConnected, host: str | None = None,
                       port: int | None = None, *, limit: int = _DEFAULT_LIMIT,
                       **opts: Any) -> RDMAServer:
    """Serve aiordma connections: ``client_connected_cb(reader, writer)`` per
    connection (a coroutine function runs as a task). Returns the server, as
    ``asyncio.start_server``. Options as ``aiordma.create_server``.
    """
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.StreamReaderProtocol:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        return asyncio.StreamReaderProtocol(reader, client_connected_cb, loop=loop)

    return await create_server(factory, host, port, **opts)
