"""Connection setup as a security boundary, on the provider under test and both loops:
the shared secret (mutual), TLS on the setup connection, a peer that is not aiordma,
the cap on handshakes in progress, and (soft) the device never connecting to an
address its handshake peer does not have."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.server
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from _pairs import HOST, T, pair

import aiordma
from aiordma.protocol import auth
from aiordma.protocol.handshake import (
    PREAMBLE,
    Greeting,
    HandshakeDecoder,
    Hello,
    Reject,
    RejectCode,
    encode_hello,
)

SECRET = b"a shared secret of 32 bytes....."


@pytest.fixture
def opts(provider_name: str) -> dict:
    return {"provider": provider_name}


async def _echo(ep: aiordma.Endpoint) -> None:
    with contextlib.suppress(aiordma.ConnectionClosed):
        while True:
            await ep.send(await ep.recv())


@contextlib.asynccontextmanager
async def listening(opts: dict, **extra: object) -> AsyncIterator[aiordma.Listener]:
    listener = await aiordma.listen(_echo, HOST, 0, **opts, **extra)
    try:
        yield listener
    finally:
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)


async def _roundtrip(ep: aiordma.Endpoint) -> None:
    async with ep:
        await asyncio.wait_for(ep.send(b"ping"), T)
        assert await asyncio.wait_for(ep.recv(), T) == b"ping"


# -- the shared secret -----------------------------------------------------------------------


async def test_shared_secret_both_sides(opts: dict) -> None:
    async with listening(opts, secret=SECRET) as listener:
        await _roundtrip(await aiordma.connect(HOST, listener.port, secret=SECRET, **opts))
        assert listener.accepted == 1


@pytest.mark.parametrize(("server", "client", "match"), [
    (SECRET, SECRET[::-1], "did not prove the shared secret"),
    (SECRET, None, "requires a shared secret"),
    (None, SECRET, "has no shared secret"),
])
async def test_secret_mismatch_is_an_authentication_error(
        opts: dict, server: bytes | None, client: bytes | None, match: str) -> None:
    """Wrong or missing on either side: AuthenticationError on the client, no endpoint
    on the listener, which keeps serving."""
    extra = {"secret": server} if server else {}
    async with listening(opts, **extra) as listener:
        with pytest.raises(aiordma.AuthenticationError, match=match):
            await asyncio.wait_for(aiordma.connect(HOST, listener.port, secret=client, **opts), T)
        assert listener.accepted == 0
        await _roundtrip(await aiordma.connect(HOST, listener.port, **opts, **extra))


async def test_no_endpoint_is_made_for_an_unauthenticated_client(opts: dict) -> None:
    """A client that does not know the secret sends a well-formed HELLO: the listener
    refuses it (REJECT, authentication) before it makes a QP for it."""
    made: list[object] = []
    async with listening(opts, secret=SECRET) as listener:
        real = aiordma.listener.Endpoint

        def spy(*a: object, **kw: object) -> object:
            made.append(a)
            return real(*a, **kw)  # type: ignore[arg-type]

        aiordma.listener.Endpoint = spy  # type: ignore[assignment,misc]
        try:
            reply = await _raw_handshake(listener.port, mac=bytes(range(32)))
        finally:
            aiordma.listener.Endpoint = real  # type: ignore[misc]
        assert isinstance(reply, Reject) and reply.code == RejectCode.AUTH, reply
        assert not made and listener.accepted == 0 and listener.handshake_errors == 1


async def _raw_handshake(port: int, *, gid: bytes | None = None, lid: int = 1,
                         mac: bytes = bytes(32), provider: str = "soft") -> object:
    """A hand-made client: preamble, GREETING, a HELLO of our choosing; the reply."""
    r, w = await asyncio.open_connection(HOST, port)
    dec = HandshakeDecoder()

    async def next_message() -> object:
        while True:
            data = await asyncio.wait_for(r.read(4096), T)
            assert data, "listener closed"
            msgs = dec.feed(data)
            if msgs:
                return msgs[0]

    try:
        w.write(PREAMBLE)
        assert isinstance(await next_message(), Greeting)
        w.write(encode_hello(Hello(
            qp_num=0x1234, psn=1, gid=gid or _gid("127.0.0.1"), lid=lid, mtu=5,
            recv_credits=64, eager_size=16384, max_message_size=1 << 20, provider=provider,
            nonce=auth.new_nonce(), mac=mac)))
        return await next_message()
    finally:
        w.close()


def _gid(ip: str) -> bytes:
    return b"\0" * 10 + b"\xff\xff" + socket.inet_aton(ip)


# -- TLS on the setup connection -------------------------------------------------------------


@pytest.fixture
def tls() -> Iterator[tuple[ssl.SSLContext, ssl.SSLContext]]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", HOST).configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    yield server, client


async def test_ssl_setup_connection(opts: dict, tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_ctx, client_ctx = tls
    async with listening(opts, ssl=server_ctx, secret=SECRET) as listener:
        ep = await aiordma.connect(HOST, listener.port, ssl=client_ctx, secret=SECRET, **opts)
        assert ep._control is not None and ep._control.get_extra_info("ssl_object") is not None
        await _roundtrip(ep)
        with pytest.raises(aiordma.HandshakeError, match="not an aiordma listener"):
            await asyncio.wait_for(aiordma.connect(HOST, listener.port, **opts), T)
        untrusting = ssl.create_default_context()
        with pytest.raises(aiordma.HandshakeError, match="TLS"):
            await asyncio.wait_for(aiordma.connect(HOST, listener.port, ssl=untrusting,
                                                   **opts), T)
        await _roundtrip(await aiordma.connect(HOST, listener.port, ssl=client_ctx,
                                               secret=SECRET, **opts))


# -- a peer that is not aiordma ----------------------------------------------------------------


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


async def test_http_server_is_named_at_once(opts: dict) -> None:
    """An HTTP server answers the preamble: the client names it without waiting for
    the handshake timeout (30 s here; the test allows 10)."""
    srv = http.server.ThreadingHTTPServer((HOST, 0), _Quiet)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(aiordma.HandshakeError,  # (http.server answers in HTTP/0.9 style)
                           match="is not an aiordma listener: it answered b'<!DOCTYPE") as ei:
            await asyncio.wait_for(aiordma.connect(HOST, srv.server_address[1], timeout=30,
                                                   handshake_timeout=30, **opts), 10)
        assert not isinstance(ei.value, TimeoutError)
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(T)


# -- handshakes in progress are bounded --------------------------------------------------------


async def test_silent_clients_beyond_max_handshakes_are_dropped(opts: dict) -> None:
    async with listening(opts, max_handshakes=4, handshake_timeout=30) as listener:
        silent = [await asyncio.open_connection(HOST, listener.port) for _ in range(12)]
        try:
            deadline = asyncio.get_running_loop().time() + T
            while listener.dropped < 8 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert listener.dropped >= 8
            await _roundtrip(await aiordma.connect(HOST, listener.port, **opts))
            busy = 0
            for r, _w in silent[:8]:  # the oldest eight (the newest wait for their timeout)
                with contextlib.suppress(ConnectionError):
                    data = await asyncio.wait_for(r.read(), T)
                    busy += bytes([RejectCode.BUSY]) in data and b"too many handshakes" in data
            assert busy >= 8
        finally:
            for _r, w in silent:
                w.close()


# -- soft: the device connects only where the peer is -------------------------------------------


async def test_soft_never_connects_to_an_address_the_peer_lacks(provider_name: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A handshake that names a third party's address (not the client's, not this
    host's) is refused, and the soft device opens no connection to it."""
    if provider_name != "soft":
        pytest.skip("the soft device's own connections")
    from aiordma.verbs.soft import dial

    async with pair({"provider": "soft"}) as (_ep, _q):
        opened: list[tuple[bytes, int]] = []
        real = dial.open_socket

        def record(engine, gid: bytes, port: int):  # type: ignore[no-untyped-def]
            opened.append((gid, port))
            return real(engine, gid, port)

        monkeypatch.setattr(dial, "open_socket", record)
        async with listening({"provider": "soft"}) as listener:
            third = _gid("192.0.2.7")  # TEST-NET-1: nobody's address here
            reply = await _raw_handshake(listener.port, gid=third, lid=22)
            assert isinstance(reply, Reject), reply
            assert "192.0.2.7 is not the address 127.0.0.1" in reply.reason
            assert not [o for o in opened if o[0] == third]
            assert listener.accepted == 0
            await _roundtrip(await aiordma.connect(HOST, listener.port, provider="soft"))


def test_same_host_rules() -> None:
    from aiordma.verbs.soft import addr

    assert addr.same_host("10.1.2.3", "10.1.2.3")
    assert addr.same_host("::ffff:127.0.0.1", "127.0.0.1")
    assert addr.same_host("127.0.0.1", "127.0.0.5")  # both this host
    assert not addr.same_host("192.0.2.7", "127.0.0.1")
    assert not addr.same_host("10.1.2.3", "10.1.2.4")



@pytest.mark.parametrize("side", ["client", "listener"])
async def test_no_path_to_the_peers_gid_is_named(opts: dict, side: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that finds no path to the peer's GID when connecting the QP (RoCE:
    ibv_modify_qp to RTR fails with ENETUNREACH; here simulated on the side under test)
    makes the client raise PeerUnreachable naming both GIDs and the setup connection;
    on the listener's side the client gets a REJECT that says so. (Two real hosts:
    tests/test_rxe_two_hosts.py.)"""
    from aiordma.endpoint import Endpoint

    real = Endpoint.establish
    calls: list[str] = []

    async def establish(self: Endpoint, peer: Hello) -> None:
        calls.append("listener" if not calls else "client")  # the listener's comes first
        if calls[-1] == side:
            raise aiordma.RDMAError(errno.ENETUNREACH,
                                    "ibv_modify_qp INIT->RTR: Network is unreachable")
        await real(self, peer)

    monkeypatch.setattr(Endpoint, "establish", establish)
    async with listening(opts) as listener:
        want = aiordma.PeerUnreachable if side == "client" else aiordma.ConnectionRefused
        with pytest.raises(want) as info:
            await asyncio.wait_for(aiordma.connect(HOST, listener.port, **opts), T)
    text = str(info.value)
    assert "no RDMA path to the peer's GID" in text, text
    if side == "client":
        assert info.value.errno == errno.ENETUNREACH
        assert isinstance(info.value, aiordma.HandshakeError)
        assert f"{HOST} -> {HOST}" in text and "Network is unreachable" in text, text
