"""Connection setup: the out-of-band TCP handshake that makes two ``Endpoint``s.

Client                                   Server
  TCP connect (TLS with ``ssl=``) ----------> accept
  PREAMBLE ------------------------------->  <-- GREETING(nonce Ns, needs secret?)
  create PD/CQ/QP (INIT) with the connection key, post receives
  HELLO(qpn, psn, gid, lid, mtu, credits, eager, max msg, provider, Nc, MAC) -->
                                           check the MAC (shared secret); create QP
                                           (INIT, same key), post receives, RTR+RTS
  <------------------------------------------ ACCEPT(its parameters, MAC) | REJECT
  check the listener's MAC; RTR+RTS towards the server
  READY --------------------------------->  handler(ep) starts
The TCP connection stays open for the endpoint's life: its EOF tells each side that
the peer is gone (process killed, aborted) even when no work request is outstanding.

The connection key (``protocol.auth``) is fresh per connection: a ``soft`` device
admits a connection to the endpoint's QP only from a device that proves it, and
connects only to the address the peer's setup connection comes from. With a shared
``secret`` both sides prove it (mutual challenge-response) before any endpoint is
made for the peer. Every step has a timeout (``handshake_timeout``): its expiry is a
``HandshakeTimeout`` (a ``TimeoutError``) naming what was waited for. Garbage,
truncated frames, a wrong version or out-of-range fields raise ``HandshakeError`` on
the side that saw them; a server that is not an aiordma listener is named as such as
soon as it answers the preamble (line-based servers answer it at once). The listener
logs failures, answers REJECT where it can (with a code: refused, authentication,
resource limit, busy), and keeps serving; at most ``max_handshakes`` are in progress.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import ipaddress
import logging
import os
import socket
import ssl as _ssl
from collections.abc import Awaitable, Callable
from typing import Any

from .device import Device
from .endpoint import Endpoint
from .errors import (
    AuthenticationError,
    ConnectionRefused,
    HandshakeError,
    HandshakeTimeout,
    PeerUnreachable,
    RDMAError,
    ResourceLimitError,
    fd_limit_error,
)
from .options import EndpointOptions
from .protocol import auth
from .protocol.handshake import (
    FLAG_SECRET,
    MAGIC,
    PREAMBLE,
    Accept,
    Greeting,
    HandshakeDecoder,
    Hello,
    Message,
    Reject,
    RejectCode,
    encode_hello,
    encode_ready,
)
from .tcp_backoff import cap_backoff

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
        cap_backoff(sock)  # the heartbeat's PINGs ride on it
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass


async def _read_message(reader: asyncio.StreamReader, decoder: HandshakeDecoder, timeout: float,
                        what: str) -> Message:
    """The next handshake message. Raises HandshakeError on garbage or EOF,
    HandshakeTimeout when ``timeout`` passes first."""
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
        raise HandshakeTimeout(f"timed out after {timeout:g}s waiting for {what}") from None
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, RDMAError):
            raise
        raise HandshakeError(f"connection lost while waiting for {what}: {exc}") from exc


def _limit(exc: BaseException, what: str) -> BaseException:
    """``exc`` as a ResourceLimitError when it is running out of descriptors."""
    if isinstance(exc, OSError) and not isinstance(exc, RDMAError):
        lim = fd_limit_error(exc, what)
        if lim is not None:
            return lim
    return exc


def _rejected(where: str, rej: Reject) -> RDMAError:
    """The typed error for a listener's REJECT."""
    msg = f"connection to {where} rejected: {rej.reason}"
    if rej.code == RejectCode.AUTH:
        return AuthenticationError(msg)
    if rej.code == RejectCode.LIMIT:
        return ResourceLimitError(rej.errno or errno.ENOMEM, msg)
    return ConnectionRefused(msg)


async def _greeting(reader: asyncio.StreamReader, decoder: HandshakeDecoder, timeout: float,
                    where: str) -> Greeting:
    """The listener's GREETING, or the error that names what answered instead."""
    try:
        msg = await _read_message(reader, decoder, timeout, "the listener's GREETING")
    except HandshakeTimeout:
        raise HandshakeTimeout(f"no aiordma GREETING from {where} within {timeout:g}s: is "
                               "it an aiordma listener?") from None
    except HandshakeError as exc:
        got = decoder.first_bytes
        if got and not got.startswith(MAGIC[: len(got)]) and not MAGIC.startswith(got[:4]):
            raise HandshakeError(f"{where} is not an aiordma listener: it answered "
                                 f"{got[:48]!r}") from None
        if not got and "closed" in str(exc):
            raise HandshakeError(f"{where} closed the connection before its GREETING: not an "
                                 "aiordma listener, or one out of resources") from None
        raise
    if isinstance(msg, Reject):
        raise _rejected(where, msg)
    if not isinstance(msg, Greeting):
        raise HandshakeError(f"expected GREETING from {where}, got {type(msg).__name__}")
    return msg


async def connect(host: str, port: int, *, timeout: float = 10.0, **opts: Any) -> Endpoint:
    """Connect to an aiordma listener (``aiordma.listen`` or ``create_server``); returns
    a ready ``Endpoint``.

    ``timeout`` bounds the whole setup, ``handshake_timeout`` each step. Raises
    ConnectionRefused (nothing listening, or the listener refused us),
    AuthenticationError (the shared secret is wrong or missing on either side),
    ResourceLimitError (out of descriptors, here or at the listener: the message
    names the limit), HandshakeError (a bad peer, or not an aiordma listener),
    TimeoutError (the TCP connect, or ``HandshakeTimeout`` for a step, took too long),
    TypeError/ValueError for bad options. Nothing is left behind on failure.
    """
    o = EndpointOptions.from_kwargs(opts)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    where = f"{host}:{port}"
    try:
        tls: dict[str, Any] = {}
        if o.ssl is not None:
            tls = {"ssl": o.ssl, "server_hostname": o.server_hostname or host,
                   "ssl_handshake_timeout": min(timeout, o.handshake_timeout)}
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, **tls),
                                                timeout)
    except ConnectionRefusedError as exc:
        raise ConnectionRefused(f"connection to {where} refused") from exc
    except TimeoutError:
        raise TimeoutError(f"connecting to {where} timed out after {timeout:g}s") from None
    except _ssl.SSLError as exc:
        raise HandshakeError(f"TLS with {where} failed: {exc}") from exc
    except OSError as exc:
        raise _limit(exc, f"connecting to {where}") from None
    ep: Endpoint | None = None

    def step() -> float:
        return max(0.001, min(o.handshake_timeout, deadline - loop.time()))

    try:
        _keepalive(writer)
        writer.write(PREAMBLE)
        decoder = HandshakeDecoder()
        greeting = await _greeting(reader, decoder, step(), where)
        secret = o.secret
        if greeting.flags & FLAG_SECRET and secret is None:
            raise AuthenticationError(f"{where} requires a shared secret (the secret= option)")
        if secret is not None and not greeting.flags & FLAG_SECRET:
            raise AuthenticationError(f"{where} has no shared secret, so it cannot prove "
                                      "one: refused (secret= was given)")
        nonce = auth.new_nonce()
        try:
            device = _device_for(o)
            ep = Endpoint(device, o, loop,
                          auth_key=auth.connection_key(secret, greeting.nonce, nonce))
        except OSError as exc:
            raise _limit(exc, "making an endpoint") from None
        hello = dataclasses.replace(ep.local_hello(writer.get_extra_info("sockname")[0]),
                                    nonce=nonce)
        hello = dataclasses.replace(hello, mac=auth.client_mac(secret, greeting.nonce, hello))
        writer.write(encode_hello(hello))
        msg = await _read_message(reader, decoder, step(), "the listener's ACCEPT")
        if isinstance(msg, Reject):
            raise _rejected(where, msg)
        if not isinstance(msg, Accept):
            raise HandshakeError(f"expected ACCEPT, got {type(msg).__name__}")
        if secret is not None and not auth.same(
                msg.params.mac, auth.server_mac(secret, hello.mac, msg.params)):
            raise AuthenticationError(f"{where} did not prove the shared secret")
        _check_peer(device, ep, msg.params, writer)
        await _establish(ep, msg.params, writer, "connecting the endpoint")
        writer.write(encode_ready())
        await writer.drain()
        ep.start(reader, writer)
        return ep
    except BaseException:
        await _discard(writer, ep)
        raise


def _check_peer(device: Device, ep: Endpoint, peer: Hello, writer: asyncio.StreamWriter) -> None:
    """Refuse a peer of another provider, or (soft) one whose device address is not
    where its setup connection comes from. Raises HandshakeError."""
    if peer.provider != ep.provider:
        raise HandshakeError(f"provider mismatch: peer uses {peer.provider!r}, we use "
                             f"{ep.provider!r}")
    peername = writer.get_extra_info("peername")
    if peername:
        problem = device.ctx.peer_address_problem(peer.gid, peer.lid, peername[0])
        if problem is not None:
            raise HandshakeError(f"refused: {problem}")


#: ibv_modify_qp's errors (INIT->RTR) when the kernel finds no path to the destination
#: GID. For RoCE it resolves the GID's IP address to a MAC address there: a route lookup
#: bound to the netdev of our GID (which takes a destination without a route as on-link:
#: between two Soft-RoCE guests such a GID was reachable whenever its host answered ARP
#: for it), then neighbour resolution, waiting for an ARP answer (ETIMEDOUT or
#: EHOSTUNREACH when none comes: ETIMEDOUT there, connect failing after 7 s;
#: ENETUNREACH where the lookup fails). The compiled verbs path makes that call in a
#: thread with the GIL released (``Endpoint.establish``); pyverbs' own modify holds the
#: GIL, and the event loop then waits as long.
_UNREACHABLE = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT})


async def _establish(ep: Endpoint, peer: Hello, writer: asyncio.StreamWriter,
                     what: str) -> None:
    """``await ep.establish(peer)``. Raises PeerUnreachable when the device finds no
    path to the peer's GID (the message says which GIDs and which setup connection),
    ResourceLimitError when out of descriptors, else what establish raised."""
    try:
        await ep.establish(peer)
    except OSError as exc:
        if isinstance(exc, RDMAError) and exc.errno in _UNREACHABLE:
            raise _unreachable(ep, peer, writer, exc) from exc
        raise _limit(exc, what) from None


def _gid_text(gid: bytes) -> str:
    """A GID as an address: ``::ffff:a.b.c.d`` for an IPv4-mapped (RoCE v2) one."""
    try:
        a = ipaddress.IPv6Address(bytes(gid))
    except ValueError:
        return bytes(gid).hex()
    return f"::ffff:{a.ipv4_mapped}" if a.ipv4_mapped else str(a)


def _unreachable(ep: Endpoint, peer: Hello, writer: asyncio.StreamWriter,
                 exc: RDMAError) -> PeerUnreachable:
    code = exc.errno or errno.EHOSTUNREACH
    ours = ep._gid_index
    try:
        our_gid = _gid_text(ep._device.ctx.query_gid(1, ours))
    except OSError:
        our_gid = "?"
    local = writer.get_extra_info("sockname")
    remote = writer.get_extra_info("peername")
    return PeerUnreachable(code, (
        f"no RDMA path to the peer's GID {_gid_text(peer.gid)} from {ep.device_name} port 1 "
        f"(our GID index {ours}: {our_gid}): {os.strerror(code)} "
        f"[{errno.errorcode.get(code, code)}]; the setup connection "
        f"{local[0] if local else '?'} -> {remote[0] if remote else '?'} works, so the "
        f"peer's GID is on a network this device does not reach (check the peer's RDMA "
        f"device, its addresses and AIORDMA_GID_INDEX); the device said: {exc.strerror}"))


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


def _reply(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
    except (ConnectionError, OSError, RuntimeError):
        pass
