"""Liveness on one host: the heartbeat on the setup connection (aiordma/liveness.py)
finds a frozen peer, lets a short pause pass, and a killed peer is noticed by EOF.
The cross-host faults are in tests/test_net_faults.py."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator

import pytest
from _peers import Peer

import aiordma
from aiordma.liveness import heartbeat_for
from aiordma.options import EndpointOptions

T = 30.0


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free now on 127.0.0.1."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def server() -> Iterator[tuple[Peer, int]]:
    port, stream, proto = _free_ports(3)
    srv = Peer.local("serve", "--port", str(port), "--stream-port", str(stream),
                     "--proto-port", str(proto))
    try:
        srv.until(lambda e: e.get("ready", False), T, "the server")
        yield srv, port
    finally:
        srv.close()


def _hold(port: int, *args: str) -> Peer:
    """``net_peer.py hold`` with ``args``, connected."""
    hold = Peer.local("hold", "--port", str(port), *args)
    try:
        hold.until(lambda e: e.get("event") == "connected", T, "connected")
    except BaseException:
        hold.close()
        raise
    return hold


def test_liveness_options_and_negotiation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_LIVENESS_TIMEOUT", raising=False)
    assert EndpointOptions().liveness_timeout == 8.0
    for raw, want in (("60", 60.0), ("0.5", 0.5), ("none", None), ("None", None), ("", 8.0)):
        monkeypatch.setenv("AIORDMA_LIVENESS_TIMEOUT", raw)
        assert EndpointOptions.from_kwargs({}).liveness_timeout == want, raw
    for bad in ("soon", "-1"):
        monkeypatch.setenv("AIORDMA_LIVENESS_TIMEOUT", bad)
        with pytest.raises(ValueError, match="(AIORDMA_)?LIVENESS_TIMEOUT|liveness_timeout"):
            EndpointOptions.from_kwargs({})
    monkeypatch.delenv("AIORDMA_LIVENESS_TIMEOUT")
    assert EndpointOptions.from_kwargs({"liveness_timeout": None}).liveness_timeout is None
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="liveness_timeout"):
            EndpointOptions.from_kwargs({"liveness_timeout": bad})
    o = EndpointOptions()
    # a peer that did not announce the heartbeat gets none (it would not answer)
    assert heartbeat_for(o, peer_answers=False, accepting=True, now=0.0) is None
    hb = heartbeat_for(o, peer_answers=True, accepting=False, now=0.0)
    assert hb is not None and hb.timeout == 8.0 and hb.interval == 2.0


async def test_heartbeat_runs_on_a_healthy_connection() -> None:
    got: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()

    async def handler(ep: aiordma.Endpoint) -> None:
        await got.put(ep)
        try:
            for _ in range(100_000):
                await ep.send(await asyncio.wait_for(ep.recv(), T))
        except aiordma.ConnectionClosed:
            pass

    listener = await aiordma.listen(handler, "127.0.0.1", 0, liveness_timeout=0.4)
    port = listener.sockets[0].getsockname()[1]
    ep = await aiordma.connect("127.0.0.1", port, timeout=T, liveness_timeout=0.4)
    try:
        srv = await asyncio.wait_for(got.get(), T)
        for _ in range(40):  # bounded: 0.05 s steps, a few heartbeat intervals in all
            await asyncio.sleep(0.05)
            await asyncio.wait_for(ep.send(b"x"), T)
            assert await asyncio.wait_for(ep.recv(), T) == b"x"
        for side in (ep, srv):
            st = side.statistics()["heartbeat"]
            assert st["active"] and st["timeout"] == 0.4
            assert st["pings_sent"] >= 2 and st["pongs_received"] >= 1, st
        assert not ep.closed and not srv.closed
    finally:
        await ep.close()
        listener.close()
        await listener.wait_closed()


@pytest.mark.multiprocess
def test_frozen_peer_fails_idle_and_busy_endpoints(server: tuple[Peer, int]) -> None:
    srv, port = server
    timeout = 1.5
    hold = _hold(port, "--idle", "1", "--busy", "1", "--writers", "1", "--liveness", str(timeout))
    try:
        srv.stop()
        t0 = time.monotonic()
        got = hold.failures({"idle0", "busy0"}, T)
        for name in ("idle0", "busy0"):
            ev = got[name]
            assert (ev["error"], ev["cause"]) == ("ConnectionClosed", "PeerUnresponsive"), ev
            # never before three quarters of the timeout (rule 3 of protocol.heartbeat)
            assert ev["t"] - t0 >= 0.5 * timeout, ev
        # without a heartbeat only the retry budget (8.6 s by default) could end it
        assert "write0" not in got
        srv.signal(signal.SIGCONT)
        # the resumed server finds both connections gone (our side closed them)
        for _ in range(2):
            srv.until(lambda e: e.get("event") == "closed", T, "the server's view")
        hold.command("quit", "done", T)
        # and the server serves new connections
        api = Peer.local("api", "--port", str(port), *_stream_args(srv),
                         "--max-size", str(1 << 20))
        try:
            api.finish(T)
        finally:
            api.close()
    finally:
        hold.close()


def _stream_args(srv: Peer) -> list[str]:
    """The ``--stream-port``/``--proto-port`` of ``srv``."""
    args = list(srv.proc.args)  # type: ignore[arg-type]
    return [x for k in ("--stream-port", "--proto-port")
            for x in (k, str(args[args.index(k) + 1]))]


@pytest.mark.multiprocess
def test_short_pause_passes(server: tuple[Peer, int]) -> None:
    srv, port = server
    hold = _hold(port, "--idle", "1", "--busy", "1", "--liveness", "4")
    try:
        before = hold.command("progress", "progress", T)["sent"]["busy0"]
        srv.stop()
        time.sleep(0.5)
        srv.signal(signal.SIGCONT)
        assert hold.command("ping", "pong", T)["alive"] == ["idle0"]
        after = before
        for _ in range(100):  # bounded: the busy endpoint moves on
            ev = hold.command("progress", "progress", T)
            after = ev["sent"]["busy0"]
            if after > before + 8:
                break
            time.sleep(0.05)
        assert after > before + 8 and not ev["failed"], ev
        assert not [e for e in hold.events if e.get("event") == "failed"]
    finally:
        hold.close()


@pytest.mark.multiprocess
def test_killed_peer_is_noticed_by_eof(server: tuple[Peer, int]) -> None:
    srv, port = server
    hold = _hold(port, "--idle", "1", "--busy", "1", "--liveness", "none")
    try:
        srv.proc.kill()
        got = hold.failures({"idle0", "busy0"}, T)
        assert got["idle0"]["error"] == "ConnectionClosed" and got["idle0"]["cause"] is None
        # busy: its soft connection broke under posted work (RETRY_EXC_ERR), or the EOF
        assert got["busy0"]["cause"] in (None, "RetryExceededError"), got
    finally:
        hold.close()
