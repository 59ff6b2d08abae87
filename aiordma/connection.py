"""Connection setup: the out-of-band TCP handshake that makes two ``Endpoint``s.

Client                                   Server
  TCP connect ---------------------------> accept
  create PD/CQ/QP (INIT), post receives
  HELLO(qpn, psn, gid, lid, mtu, credits, eager, max msg, provider) -->
                                           validate; create QP (INIT), post receives,
                                           RTR+RTS towards the client
  <------------------------------------------ ACCEPT(its parameters) | REJECT(reason)
  RTR+RTS towards the server
  READY --------------------------------->  handler(ep) starts
The TCP connection stays open for the endpoint's life: its EOF tells each side that
the peer is gone (process killed, aborted) even when no work request is outstanding.

Every step has a timeout (``handshake_timeout``). Garbage, truncated frames, a wrong
version, out-of-range fields or silence raise ``HandshakeError`` on the side that saw
them; the listener logs it, answers REJECT where it can, and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from .device import Device
from .endpoint import Endpoint
from .errors import ConnectionRefused, HandshakeError, RDMAError
from .options import EndpointOptions
from .protocol.handshake import (
    Accept,
    HandshakeDecoder,
    Hello,
    Message,
    Ready,
    Reject,
    encode_accept,
    encode_hello,
    encode_ready,
    encode_reject,
)

log = logging.getLogger("aiordma")

Handler = Callable[[Endpoint], Awaitable[None]]


def _device_for(opts: EndpointOptions) -> Device:
    dev = opts.device
    if isinstance(dev, Device):
        return dev.ref()
    return Device.acquire(dev, opts.provider)


def _keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass


async def _read_message(reader: asyncio.StreamReader, decoder: HandshakeDecoder, timeout: float,
                        what: str) -> Message:
    """The next handshake message. Raises HandshakeError on garbage, EOF or timeout."""
    async def read() -> Message:
        while True:
            data = await reader.read(4096)
            if not data:
                decoder.eof()
                raise HandshakeError(f"connection closed while waiting for {what}")
            msgs = decoder.feed(data)
            if msgs:
                if len(msgs) > 1:
                    raise HandshakeError(f"unexpected extra handshake messages after {what}")
                return msgs[0]

    try:
        return await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise HandshakeError(f"timed out after {timeout:g}s waiting for {what}") from None
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, RDMAError):
            raise
        raise HandshakeError(f"connection lost while waiting for {what}: {exc}") from exc


async def connect(host: str, port: int, *, timeout: float = 10.0, **opts: Any) -> Endpoint:
    """Connect to an ``aiordma.listen`` listener; returns a ready ``Endpoint``.

    ``timeout`` bounds the whole setup. Raises ConnectionRefused (nothing listening, or
    the server rejected us), HandshakeError (bad or silent peer), TimeoutError (the
    TCP connect took longer than ``timeout``), TypeError/ValueError for bad options.
    """
    o = EndpointOptions.from_kwargs(opts)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError as exc:
        raise ConnectionRefused(f"connection to {host}:{port} refused") from exc
    except TimeoutError:
        raise TimeoutError(f"connecting to {host}:{port} timed out after {timeout:g}s") from None
    ep: Endpoint | None = None
    try:
        _keepalive(writer)
        device = _device_for(o)
        ep = Endpoint(device, o, loop)
        local_ip = writer.get_extra_info("sockname")[0]
        writer.write(encode_hello(ep.local_hello(local_ip)))
        decoder = HandshakeDecoder()
        remaining = max(0.001, min(o.handshake_timeout, deadline - loop.time()))
        msg = await _read_message(reader, decoder, remaining, "the server's ACCEPT")
        if isinstance(msg, Reject):
            raise ConnectionRefused(f"connection to {host}:{port} rejected: {msg.reason}")
        if not isinstance(msg, Accept):
            raise HandshakeError(f"expected ACCEPT, got {type(msg).__name__}")
        _check_peer(ep, msg.params)
        ep.establish(msg.params)
        writer.write(encode_ready())
        await writer.drain()
        ep.start(reader, writer)
        return ep
    except BaseException:
        await _discard(writer, ep)
        raise


def _check_peer(ep: Endpoint, peer: Hello) -> None:
    if peer.provider != ep.provider:
        raise HandshakeError(f"provider mismatch: peer uses {peer.provider!r}, we use "
                             f"{ep.provider!r}")


async def _discard(writer: asyncio.StreamWriter, ep: Endpoint | None) -> None:
    """Undo a half-made connection: drop the TCP side, abort and destroy the endpoint."""
    writer.close()
    if ep is not None:
        ep.abort()
        await _quiet(ep.wait_closed())


async def _quiet(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except Exception:
        pass


class Listener:
    """Accepts aiordma connections; each one runs ``handler(ep)`` in its own task.

    ``port`` is the bound TCP port. ``close()`` stops accepting (existing endpoints
    live on); ``wait_closed()`` waits for the listening socket, the in-progress
    handshakes and the handlers of accepted connections. An endpoint still open when its handler returns is closed gracefully;
    an exception from the handler is logged and the endpoint aborted.
    """

    def __init__(self, handler: Handler, opts: EndpointOptions) -> None:
        self._handler = handler
        self._opts = opts
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.handshake_errors = 0
        self.accepted = 0

    async def _start(self, host: str | None, port: int, **server_kw: Any) -> None:
        self._server = await asyncio.start_server(self._on_client, host, port, **server_kw)

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def sockets(self) -> tuple[Any, ...]:
        return tuple(self._server.sockets) if self._server else ()

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ep = await self._accept(reader, writer)
        except HandshakeError as exc:
            self.handshake_errors += 1
            log.info("aiordma: handshake with %s failed: %s",
                     writer.get_extra_info("peername"), exc)
            return
        except Exception as exc:  # e.g. device out of resources: reject, keep serving
            log.warning("aiordma: accepting a connection failed: %r", exc)
            return
        self.accepted += 1
        try:
            await self._handler(ep)
        except asyncio.CancelledError:
            ep.abort()
            raise
        except Exception:
            log.exception("aiordma: connection handler raised; aborting its endpoint")
            ep.abort()
        if not ep.closed:
            await _quiet(ep.close())
        await _quiet(ep.wait_closed())

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Endpoint:
        o = self._opts
        loop = asyncio.get_running_loop()
        _keepalive(writer)
        decoder = HandshakeDecoder()
        ep: Endpoint | None = None
        try:
            try:
                msg = await _read_message(reader, decoder, o.handshake_timeout, "HELLO")
                if not isinstance(msg, Hello):
                    raise HandshakeError(f"expected HELLO, got {type(msg).__name__}")
                device = _device_for(o)
                ep = Endpoint(device, o, loop)
                _check_peer(ep, msg)
            except HandshakeError as exc:
                _reply(writer, encode_reject(str(exc)[:200]))
                raise
            local_ip = writer.get_extra_info("sockname")[0]
            hello = ep.local_hello(local_ip)
            ep.establish(msg)
            writer.write(encode_accept(hello))
            await writer.drain()
            ready = await _read_message(reader, decoder, o.handshake_timeout, "READY")
            if not isinstance(ready, Ready):
                raise HandshakeError(f"expected READY, got {type(ready).__name__}")
            ep.start(reader, writer)
            return ep
        except BaseException:
            await _discard(writer, ep)
            raise

    def close(self) -> None:
        """Stop accepting new connections. Idempotent."""
        if self._server is not None:
            self._server.close()

    async def start_serving(self) -> None:
        """Start accepting connections (after ``listen(..., start_serving=False)``).
        Idempotent."""
        if self._server is not None:
            await self._server.start_serving()

    def is_serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    async def wait_closed(self) -> None:
        """Wait until the listening socket is closed and every connection it accepted
        has finished its handler and been torn down (like asyncio 3.12's Server)."""
        if self._server is not None:
            await self._server.wait_closed()
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()

    def __repr__(self) -> str:
        where = self._server.sockets[0].getsockname() if self._server and self._server.sockets else None
        return f"<aiordma.Listener {where} accepted={self.accepted}>"


def _reply(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
    except (ConnectionError, OSError, RuntimeError):
        pass


async def listen(handler: Handler, host: str | None = "127.0.0.1", port: int = 0, *,
                 start_serving: bool = True, **opts: Any) -> Listener:
    """Listen for aiordma connections on ``host:port`` (0 = any free port).

    ``handler(ep)`` runs in its own task per connection. Options as ``connect``.
    ``start_serving=False`` binds and listens but accepts nothing until
    ``listener.start_serving()`` (as asyncio's ``create_server``).
    Raises OSError if the address is in use, TypeError/ValueError for bad options.
    """
    o = EndpointOptions.from_kwargs(opts)
    listener = Listener(handler, o)
    await listener._start(host, port, start_serving=start_serving)
    return listener
