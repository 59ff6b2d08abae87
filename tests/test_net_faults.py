"""The faults of a network between two hosts (network namespaces, aiordma/bench/netns.py),
with the default settings (``liveness_timeout`` 8 s; soft's ``ack_timeout`` 18 with 7
retries, 8.6 s without progress): what fails, with which error, how fast (printed as
figures, never asserted on), and that new connections work once the fault is gone.

Each test holds three endpoints from side b to a server on side a (tests/net_peer.py
``hold``): ``idle0`` (nothing outstanding), ``busy0`` (64 KiB sends, 8 in flight) and ``write0``
(64 KiB RDMA WRITEs, 8 in flight, without heartbeat: only the retry budget can end it).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from _peers import Peer, api_works, client, figure, net_fixture, server_fixture, start_server

from aiordma.bench.netns import NetPair

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]

T = 60.0  # bound of each wait
ALL = {"idle0", "busy0", "write0"}
net = net_fixture()
server = server_fixture()


def hold(net: NetPair) -> Peer:
    h = client(net, "hold", "--idle", "1", "--busy", "1", "--writers", "1")
    h.until(lambda e: e.get("event") == "connected", T, "connected")
    return h


def _causes(got: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str | None]]:
    return {n: (e["error"], e["cause"]) for n, e in got.items()}


def _report(what: str, t0: float, got: dict[str, dict[str, Any]]) -> None:
    figure(f"{what}: " + ", ".join(f"{n} {e['cause'] or e['error']} after {e['t'] - t0:.1f} s"
                                   for n, e in sorted(got.items())))


def _survived(h: Peer, what: str) -> None:
    """Every endpoint of ``h`` is alive: the idle one answers, the busy ones move on."""
    before = h.command("progress", "progress", T)["sent"]
    assert h.command("ping", "pong", T)["alive"] == ["idle0"]
    after = before
    for _ in range(200):  # bounded
        after = h.command("progress", "progress", T)["sent"]
        if all(after[n] > before[n] for n in before):
            break
        time.sleep(0.05)
    failed = [e for e in h.events if e.get("event") == "failed"]
    assert not failed, failed
    assert all(after[n] > before[n] for n in before), (before, after)
    figure(f"{what}: no endpoint failed; afterwards {after} 64 KiB operations done in all")


def _silent_peer_fails(h: Peer, what: str, t0: float) -> None:
    """A silent peer (cut off, frozen, gone): the heartbeat fails the idle endpoint and
    the busy one (or its retries do), the retry budget the writer without heartbeat."""
    got = h.failures(ALL, T)
    _report(what, t0, got)
    causes = _causes(got)
    assert causes["idle0"] == ("ConnectionClosed", "PeerUnresponsive")
    assert causes["busy0"] in {("ConnectionClosed", "PeerUnresponsive"),
                               ("ConnectionClosed", "RetryExceededError")}
    assert causes["write0"] == ("ConnectionClosed", "RetryExceededError")


def _cut(net: NetPair, server: Peer, what: str, cut: Any) -> None:
    h = hold(net)
    try:
        t0 = time.monotonic()
        cut()
        _silent_peer_fails(h, what, t0)
        # the server gives up on the client the same way
        seen = [server.until(lambda e: e.get("event") == "closed", T, "the server's view")
                for _ in ALL]
        assert all(e["cause"] in ("PeerUnresponsive", "RetryExceededError") for e in seen), seen
        h.command("quit", "done", T)
    finally:
        h.close()
    net.clear()
    api_works(net)


def test_link_down(net: NetPair, server: Peer) -> None:
    _cut(net, server, "link down", net.link_down)


def test_total_loss(net: NetPair, server: Peer) -> None:
    _cut(net, server, "100% loss", lambda: net.loss(1.0))


@pytest.mark.parametrize("fault", ["loss 10%", "reorder 10% by 3 ms"])
def test_a_poor_link_keeps_every_connection(net: NetPair, server: Peer, fault: str) -> None:
    h = hold(net)
    try:
        if fault.startswith("loss"):
            net.loss(0.10)
        else:
            net.netem("both", fraction=0.10, delay_ms=3.0, seed=2)
        for _ in range(10):  # 10 s of traffic on it, watching for failures
            assert h.line(1.0) is None, h.events[-1]
        _survived(h, f"10 s of {fault}")
        h.command("quit", "done", T)
    finally:
        h.close()


@pytest.mark.parametrize("pause", [0.5, 3.0])
def test_peer_paused_briefly(net: NetPair, server: Peer, pause: float) -> None:
    h = hold(net)
    try:
        server.stop()
        time.sleep(pause)
        server.signal(signal.SIGCONT)
        _survived(h, f"peer paused {pause:g} s")
        h.command("quit", "done", T)
    finally:
        h.close()


def test_peer_paused_30s(net: NetPair, server: Peer) -> None:
    h = hold(net)
    try:
        server.stop()
        t0 = time.monotonic()
        _silent_peer_fails(h, "peer paused 30 s", t0)
        time.sleep(max(0.0, t0 + 30.0 - time.monotonic()))
        server.signal(signal.SIGCONT)
        # resumed, it finds every connection gone (our side closed them), and serves
        for _ in ALL:
            server.until(lambda e: e.get("event") == "closed", T, "the server's view")
        h.command("quit", "done", T)
    finally:
        h.close()
    api_works(net)


def test_peer_killed(net: NetPair, server: Peer) -> None:
    h = hold(net)
    try:
        t0 = time.monotonic()
        server.proc.kill()
        got = h.failures(ALL, T)
        _report("peer killed", t0, got)
        causes = _causes(got)
        # its kernel closed the setup connection (EOF), or a busy QP's connection broke
        # under posted work (RETRY_EXC_ERR, as a NIC's retries into a dead port end)
        assert causes["idle0"] == ("ConnectionClosed", None)
        for name in ("busy0", "write0"):
            assert causes[name] in {("ConnectionClosed", None),
                                    ("ConnectionClosed", "RetryExceededError")}
        h.command("quit", "done", T)
    finally:
        h.close()
    srv = start_server(net)
    try:
        api_works(net)
    finally:
        srv.close()


def test_host_gone(net: NetPair, server: Peer) -> None:
    h = hold(net)
    try:
        t0 = time.monotonic()
        net.remove_host("a")  # its link, then its processes, then its namespace
        _silent_peer_fails(h, "host gone", t0)
        h.command("quit", "done", T)
    finally:
        h.close()
    net.recreate()  # the host comes back (a new one at the same address)
    srv = start_server(net)
    try:
        api_works(net)
    finally:
        srv.close()
