"""``create_connection`` and ``create_server``: asyncio Protocols over new endpoints, and
``RDMAServer``, what ``create_server`` returns (``asyncio.Server`` semantics). The
transport itself, and how it maps asyncio's callbacks onto an Endpoint, is
``rdma_transport.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .connection import connect
from .endpoint import Endpoint
from .listener import Listener, listen
from .rdma_transport import RDMATransport

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class RDMAServer(asyncio.AbstractServer):
    """What ``create_server`` returns: ``asyncio.Server`` semantics over aiordma.

    ``close()`` stops accepting (connections live on; ``close_clients()`` /
    ``abort_clients()`` end them); ``wait_closed()`` waits until closed and every
    connection is lost (asyncio 3.12+); ``sockets`` are the listening TCP sockets of
    connection setup; ``async with server:`` closes and waits.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol_factory: ProtocolFactory,
                 write_chunk_size: int | None) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._chunk = write_chunk_size
        self._listener: Listener | None = None
        self._transports: set[RDMATransport] = set()
        self._closed = False
        self._waiters: list[asyncio.Future[None]] | None = []
        self._serving_forever_fut: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"<RDMAServer sockets={self.sockets!r}>"

    async def _handle(self, ep: Endpoint) -> None:
        """Listener handler: one transport per accepted endpoint, until it is lost."""
        try:
            protocol = self._factory()
        except Exception as exc:
            self._loop.call_exception_handler({
                "message": "Error on transport creation for incoming connection",
                "exception": exc,
            })
            ep.abort()
            return
        transport = RDMATransport(self._loop, ep, protocol, server=self,
                                  write_chunk_size=self._chunk)
        await transport._wait_lost()

    def _attach(self, transport: RDMATransport) -> None:
        self._transports.add(transport)

    def _detach(self, transport: RDMATransport) -> None:
        self._transports.discard(transport)
        if not self._transports and self._closed:
            self._wakeup()

    def _wakeup(self) -> None:
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        """Stop listening; existing connections stay open. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        if self._serving_forever_fut is not None and not self._serving_forever_fut.done():
            self._serving_forever_fut.cancel()
            self._serving_forever_fut = None
        if not self._transports:
            self._wakeup()

    def close_clients(self) -> None:
        for transport in list(self._transports):
            transport.close()

    def abort_clients(self) -> None:
        for transport in list(self._transports):
            transport.abort()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return not self._closed and self._listener is not None and self._listener.is_serving()

    @property
    def sockets(self) -> tuple[Any, ...]:
        if self._closed or self._listener is None:
            return ()
        return self._listener.sockets

    async def start_serving(self) -> None:
        """Start accepting connections. Idempotent; raises RuntimeError if closed."""
        if self._closed or self._listener is None:
            raise RuntimeError(f"server {self!r} is closed")
        await self._listener.start_serving()
        await asyncio.sleep(0)

    async def serve_forever(self) -> None:
        """Accept until cancelled; then close and wait (as ``asyncio.Server``)."""
        if self._serving_forever_fut is not None:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        if self._closed:
            raise RuntimeError(f"server {self!r} is closed")
        await self.start_serving()
        self._serving_forever_fut = self._loop.create_future()
        try:
            await self._serving_forever_fut
        except asyncio.CancelledError:
            try:
                self.close()
                await self.wait_closed()
            finally:
                raise
        finally:
            self._serving_forever_fut = None

    async def wait_closed(self) -> None:
        """Wait until ``close()`` was called and every connection is lost."""
        if self._waiters is not None:
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            await waiter
        if self._listener is not None:
            await self._listener.wait_closed()

    async def __aenter__(self) -> RDMAServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def create_connection(protocol_factory: ProtocolFactory, host: str, port: int, *,
                            timeout: float = 10.0, write_chunk_size: int | None = None,
                            **opts: Any) -> tuple[RDMATransport, asyncio.BaseProtocol]:
    """Connect to an aiordma server (``create_server``, ``start_server`` or ``listen``);
    returns ``(transport, protocol)`` once ``protocol.connection_made`` has run.

    Options as ``aiordma.connect``, plus ``write_chunk_size`` (largest message that
    writes are coalesced into; default the endpoint's ``eager_payload``). Raises as
    ``connect``, ValueError for a bad ``write_chunk_size``, and whatever
    ``protocol_factory`` raises (the endpoint is aborted then).
    """
    loop = asyncio.get_running_loop()
    ep = await connect(host, port, timeout=timeout, **opts)
    try:
        protocol = protocol_factory()
        waiter: asyncio.Future[None] = loop.create_future()
        transport = RDMATransport(loop, ep, protocol, waiter=waiter,
                                  write_chunk_size=write_chunk_size)
    except BaseException:
        ep.abort()
        raise
    try:
        await waiter
    except BaseException:
        transport.close()
        raise
    return transport, protocol


async def create_server(protocol_factory: ProtocolFactory, host: str | None = None,
                        port: int | None = None, *, start_serving: bool = True,
                        write_chunk_size: int | None = None, **opts: Any) -> RDMAServer:
    """Listen on ``host:port`` (None: all interfaces, as asyncio; port None or 0: any
    free port); each connection gets ``protocol_factory()`` and an ``RDMATransport``.

    Options as ``aiordma.listen``, plus ``start_serving`` and ``write_chunk_size``.
    Raises OSError if the address is in use, TypeError/ValueError for bad options.
    """
    if write_chunk_size is not None and write_chunk_size < 1:
        raise ValueError("write_chunk_size must be >= 1")
    loop = asyncio.get_running_loop()
    server = RDMAServer(loop, protocol_factory, write_chunk_size)
    server._listener = await listen(server._handle, host, port or 0,
                                    start_serving=start_serving, **opts)
    return server
