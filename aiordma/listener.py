"""The listening side of connection setup: ``listen`` and ``Listener``.

The handshake itself is described in ``connection.py``; this is its server half: the
accept loop (``acceptor.py``: out of descriptors, refuse with a reason), the bound on
handshakes in progress, and a task per accepted connection that runs the handler.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import socket
import ssl as _ssl
from typing import Any

from .acceptor import Acceptor, bind
from .connection import (
    Handler,
    _check_peer,
    _device_for,
    _discard,
    _establish,
    _keepalive,
    _limit,
    _quiet,
    _read_message,
    _reply,
)
from .endpoint import Endpoint
from .errors import AuthenticationError, HandshakeError, ResourceLimitError, fd_limit_error
from .options import EndpointOptions
from .protocol import auth
from .protocol.handshake import (
    FLAG_SECRET,
    Greeting,
    HandshakeDecoder,
    Hello,
    Ready,
    RejectCode,
    encode_accept,
    encode_greeting,
    encode_reject,
)

log = logging.getLogger("aiordma")


async def _streams(sock: socket.socket, tls: _ssl.SSLContext | None,
                   timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio streams over an accepted socket (TLS server side with ``tls``)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    kw: dict[str, Any] = {"ssl": tls, "ssl_handshake_timeout": timeout} if tls else {}
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock, **kw)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class Listener:
    """Accepts aiordma connections; each one runs ``handler(ep)`` in its own task.

    ``port`` is the bound TCP port. ``close()`` stops accepting (existing endpoints
    live on); ``wait_closed()`` waits for the listening socket, the in-progress
    handshakes and the handlers of accepted connections. An endpoint still open when
    its handler returns is closed gracefully; an exception from the handler is logged
    and the endpoint aborted. At most ``max_handshakes`` handshakes run at once: a new
    connection beyond that drops the oldest one (REJECT, busy). Counters:
    ``accepted``, ``handshake_errors``, ``dropped`` (busy), ``refused_limit`` (out of
    descriptors).
    """

    def __init__(self, handler: Handler, opts: EndpointOptions) -> None:
        self._handler = handler
        self._opts = opts
        self._acceptor: Acceptor | None = None
        self._closed: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # handshakes in progress, oldest first: the socket, then its streams' writer
        self._handshaking: collections.OrderedDict[
            asyncio.Task[None], tuple[socket.socket, asyncio.StreamWriter | None]] = (
            collections.OrderedDict())
        self.handshake_errors = 0
        self.accepted = 0
        self.dropped = 0
        self.refused_limit = 0

    async def _start(self, host: str | None, port: int, start_serving: bool) -> None:
        loop = asyncio.get_running_loop()
        self._closed = loop.create_future()
        self._acceptor = Acceptor(loop, bind(host, port), self._on_socket, self._refuse)
        if start_serving:
            self._acceptor.start()

    @property
    def port(self) -> int:
        assert self._acceptor is not None
        port: int = self._acceptor.sockets[0].getsockname()[1]
        return port

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._acceptor.sockets) if self._acceptor else ()

    def _on_socket(self, sock: socket.socket) -> None:
        while len(self._handshaking) >= self._opts.max_handshakes:
            oldest, (old_sock, writer) = self._handshaking.popitem(last=False)
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("aiordma: %d handshakes in progress (max_handshakes): dropping "
                            "the oldest (%d dropped so far)", self._opts.max_handshakes,
                            self.dropped)
            busy = encode_reject("too many handshakes in progress", RejectCode.BUSY)
            if writer is not None:
                _reply(writer, busy)
            elif self._opts.ssl is None:
                with contextlib.suppress(OSError):
                    old_sock.send(busy)
            oldest.cancel()
        task = asyncio.get_running_loop().create_task(self._serve(sock))
        self._tasks.add(task)
        self._handshaking[task] = (sock, None)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, sock: socket.socket, exc: OSError) -> None:
        """An accepted socket while out of descriptors: REJECT (LIMIT) and close."""
        self.refused_limit += 1
        if self._opts.ssl is None:
            lim = fd_limit_error(exc, "the listener is out of file descriptors")
            reason = str(lim.strerror) if lim is not None else str(exc)
            try:
                sock.send(encode_reject(reason[:200], RejectCode.LIMIT, exc.errno or 0))
            except OSError:
                pass
        sock.close()

    async def _serve(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            try:
                reader, writer = await _streams(sock, self._opts.ssl, self._opts.handshake_timeout)
            except (OSError, TimeoutError) as exc:
                self.handshake_errors += 1
                log.info("aiordma: setup connection failed: %s", exc)
                sock.close()
                return
            except BaseException:  # cancelled (dropped for a newer one, or shutting down)
                sock.close()
                raise
            if task in self._handshaking:
                self._handshaking[task] = (sock, writer)
            try:
                ep = await self._accept(reader, writer)
            except HandshakeError as exc:
                self.handshake_errors += 1
                log.info("aiordma: handshake with %s failed: %s",
                         writer.get_extra_info("peername"), exc)
                return
            except ResourceLimitError as exc:
                self.refused_limit += 1
                log.warning("aiordma: accepting a connection failed: %s", exc)
                return
            except Exception as exc:  # e.g. device out of resources: reject, keep serving
                log.warning("aiordma: accepting a connection failed: %r", exc)
                return
        finally:
            self._handshaking.pop(task, None)
        self.accepted += 1
        try:
            await self._handler(ep)
        except asyncio.CancelledError:
            ep._abort_now()  # a teardown task started now might never run (loop shutdown)
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
        secret = o.secret
        nonce = auth.new_nonce()
        writer.write(encode_greeting(Greeting(nonce, FLAG_SECRET if secret else 0)))
        decoder = HandshakeDecoder(preamble=True)
        ep: Endpoint | None = None
        try:
            try:
                msg = await _read_message(reader, decoder, o.handshake_timeout, "HELLO")
                if not isinstance(msg, Hello):
                    raise HandshakeError(f"expected HELLO, got {type(msg).__name__}")
                if secret is not None and not auth.same(
                        msg.mac, auth.client_mac(secret, nonce, msg)):
                    raise AuthenticationError("the client did not prove the shared secret")
                try:
                    device = _device_for(o)
                    ep = Endpoint(device, o, loop,
                                  auth_key=auth.connection_key(secret, nonce, msg.nonce))
                except OSError as exc:
                    raise _limit(exc, "the listener cannot make an endpoint") from None
                _check_peer(device, ep, msg, writer)
                hello = dataclasses.replace(ep.local_hello(writer.get_extra_info("sockname")[0]),
                                            nonce=nonce)
                hello = dataclasses.replace(hello, mac=auth.server_mac(secret, msg.mac, hello))
                await _establish(ep, msg, writer, "the listener cannot connect the endpoint")
            except (HandshakeError, ResourceLimitError) as exc:
                _reply(writer, _reject_for(exc))
                raise
            writer.write(encode_accept(hello))
            await writer.drain()
            ready = await _read_message(reader, decoder, o.handshake_timeout, "READY")
            if not isinstance(ready, Ready):
                raise HandshakeError(f"expected READY, got {type(ready).__name__}")
            ep.start(reader, writer, accepting=True)
            return ep
        except BaseException:
            await _discard(writer, ep)
            raise

    def close(self) -> None:
        """Stop accepting new connections. Idempotent."""
        if self._acceptor is not None:
            self._acceptor.close()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    async def start_serving(self) -> None:
        """Start accepting connections (after ``listen(..., start_serving=False)``).
        Idempotent."""
        if self._acceptor is not None:
            self._acceptor.start()

    def is_serving(self) -> bool:
        return self._acceptor is not None and self._acceptor.is_serving()

    async def wait_closed(self) -> None:
        """Wait until the listener is closed and every connection it accepted has
        finished its handler and been torn down (like asyncio 3.12's Server)."""
        if self._closed is not None:
            await asyncio.shield(self._closed)
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()

    def __repr__(self) -> str:
        where = self.sockets[0].getsockname() if self.sockets else None
        return f"<aiordma.Listener {where} accepted={self.accepted}>"


def _reject_for(exc: BaseException) -> bytes:
    if isinstance(exc, AuthenticationError):
        return encode_reject(str(exc.strerror)[:200], RejectCode.AUTH)
    if isinstance(exc, ResourceLimitError):
        return encode_reject(str(exc.strerror)[:200], RejectCode.LIMIT, exc.errno or 0)
    return encode_reject(str(getattr(exc, "strerror", None) or exc)[:200])


async def listen(handler: Handler, host: str | None = "127.0.0.1", port: int = 0, *,
                 start_serving: bool = True, **opts: Any) -> Listener:
    """Listen for aiordma connections on ``host:port`` (0 = any free port; host None or
    "": every interface).

    ``handler(ep)`` runs in its own task per connection. Options as ``connect``
    (``secret=`` makes every client prove it; ``ssl=`` a server-side SSLContext).
    ``start_serving=False`` binds and listens but accepts nothing until
    ``listener.start_serving()`` (as asyncio's ``create_server``).
    Raises OSError if the address is in use, TypeError/ValueError for bad options.
    """
    o = EndpointOptions.from_kwargs(opts)
    listener = Listener(handler, o)
    await listener._start(host, port, start_serving)
    return listener
