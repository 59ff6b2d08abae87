"""Attacks on the soft device by a raw client of its wire format (``soft_raw.py``),
over both of its transports (the same-host Unix socket and TCP), against a process
that holds an aiordma connection with a registered, remote-readable region.

What must hold: a HELLO without its connection's secret binds nothing and gets no
answer that tells a right guess from a wrong one; another uid is refused before its
HELLO is read; accepted sockets cost the device O(bytes) until they authenticate, and
are capped; closed connections keep no staging memory; the victim's connection and
memory are untouched throughout.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import soft_raw
from _pairs import HOST, T, pair

import aiordma
from aiordma.verbs.soft import engine as soft_engine
from aiordma.verbs.soft import wire
from aiordma.verbs.soft._core import CLOSED, Conn, staging_pooled

pytestmark = pytest.mark.skipif(os.environ.get("AIORDMA_PROVIDER", "soft") != "soft",
                                reason="attacks on the soft device")
SECRET = b"top secret bytes" * 256  # 4 KiB


class Victim:
    def __init__(self, client: aiordma.Endpoint, server: aiordma.Endpoint,
                 region: aiordma.MemoryRegion) -> None:
        self.client = client
        self.server = server
        self.region = region
        e = soft_engine.current()
        assert e is not None
        self.engine = e

    def target(self, transport: str) -> str:
        e = self.engine
        if transport == "unix":
            assert e.unix_listener is not None, "no same-host socket"
            return "unix:@" + soft_raw.unix_name(e.host, e.port)[1:]
        return f"tcp:{e.host}:{e.port}"

    async def still_fine(self) -> None:
        """The legitimate connection works and the region is unchanged."""
        await asyncio.wait_for(self.client.send(b"are you there"), T)
        assert await asyncio.wait_for(self.server.recv(), T) == b"are you there"
        local = self.client.register(bytearray(len(SECRET)))
        await asyncio.wait_for(self.client.read(local, self.region.remote()), T)
        assert bytes(local.view) == SECRET == bytes(self.region.view)
        local.close()


@pytest_asyncio.fixture
async def victim() -> AsyncIterator[Victim]:
    async with pair({"provider": "soft"}) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)
        region = srv.register(bytearray(SECRET), remote_read=True, remote_write=True)
        yield Victim(ep, srv, region)


async def _probe(target: str, payload: bytes, wait: float = 3.0) -> dict[str, object]:
    return await asyncio.to_thread(soft_raw.probe, target, payload, wait)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_hello_without_the_secret_binds_nothing(victim: Victim, transport: str) -> None:
    """The right QP pair with a guessed MAC, a wrong pair, a bad version: each is closed
    at once without one byte of answer, and the requests that follow the HELLO (a READ
    of the region, a WRITE over it) are never served."""
    e = victim.engine
    qp, peer = victim.server.qp_num, victim.server.peer_qp_num
    desc = victim.region.remote()
    attack = (soft_raw.read_request(0, desc.rkey, desc.addr, len(SECRET))
              + soft_raw.write_request(1, desc.rkey, desc.addr, b"X" * 64))
    refused = e.admission.refused_hellos
    hellos = [soft_raw.hello(peer, qp), soft_raw.hello(peer ^ 1, qp),
              soft_raw.hello(peer, qp ^ 1), soft_raw.hello(peer, qp, version=2)]
    results = [await _probe(victim.target(transport), h + attack) for h in hellos]
    for r in results:
        assert r["connected"] and r["closed"] and r["answer"] == "", r
        assert float(r["seconds"]) < 2.0, r  # closed, not left to time out
    assert e.admission.refused_hellos == refused + len(hellos)
    await victim.still_fine()


async def test_a_replayed_hello_is_refused(victim: Victim) -> None:
    """A HELLO made with the QP's real key passes once; the same bytes again do not."""
    e = victim.engine
    qp = e.qps[victim.server.qp_num]
    assert qp._auth_key is not None
    raw = wire.pack_hello(1, victim.server.peer_qp_num ^ 0x5A5A, qp.qp_num, b"\0" * 16,
                          qp._auth_key)
    h = wire.HELLO.unpack(raw)
    with e.lock:
        assert e.admission.verify(h) is qp
        assert e.admission.verify(h) is None
        bad = h[:7] + (bytes(16),)
        assert e.admission.verify(bad) is None


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_connect_close_churn_costs_no_staging_memory(victim: Victim,
                                                           transport: str) -> None:
    """3,000 connect+close (and connect+partial HELLO+close) cycles in a few seconds:
    the device's memory does not grow with them (it used to hold 256 KiB per accepted
    connection for 10 s)."""
    target = victim.target(transport)

    def churn(n: int) -> None:
        for i in range(n):
            s = soft_raw.open_socket(target)
            if i % 2:
                s.sendall(soft_raw.hello(1, 2)[:20])
            s.close()

    gc.collect()
    before = _rss()
    deadline = time.monotonic() + 30
    for _ in range(6):
        await asyncio.to_thread(churn, 500)
        assert time.monotonic() < deadline
    await asyncio.sleep(0.2)
    grown = _rss() - before
    assert grown < 48 << 20, f"RSS grew by {grown >> 20} MiB"
    assert len(victim.engine.admission.pending) <= victim.engine.admission.max_pending
    await victim.still_fine()


async def test_half_open_connections_are_capped(victim: Victim) -> None:
    """300 connections that never send a HELLO: at most ``max_pending`` are kept (the
    oldest go first), and a new aiordma connection is made meanwhile."""
    adm = victim.engine.admission
    target = victim.target("tcp")
    evicted = adm.evicted
    socks = [soft_raw.open_socket(target) for _ in range(300)]
    try:
        deadline = time.monotonic() + T
        while adm.evicted - evicted < 300 - adm.max_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(adm.pending) <= adm.max_pending
        assert adm.evicted - evicted >= 300 - adm.max_pending
        async with pair({"provider": "soft"}) as (ep, q):
            srv = await asyncio.wait_for(q.get(), T)
            await asyncio.wait_for(ep.send(b"through"), T)
            assert await asyncio.wait_for(srv.recv(), T) == b"through"
    finally:
        for s in socks:
            s.close()
    await victim.still_fine()


async def test_silent_connection_times_out(victim: Victim, monkeypatch: pytest.MonkeyPatch) -> None:
    adm = victim.engine.admission
    monkeypatch.setattr(adm, "hello_timeout", 0.2)
    timed_out = adm.timed_out
    r = await _probe(victim.target("tcp"), b"", wait=5.0)
    assert r["closed"] and r["answer"] == "" and float(r["seconds"]) < 3.0, r
    assert adm.timed_out == timed_out + 1


async def test_closed_connections_hold_no_staging_buffer(victim: Victim) -> None:
    """After 50 ordinary connect/echo/close cycles no closed connection of the device
    keeps a staging buffer (they used to, for the 10 s of a timer)."""
    async def echo(ep: aiordma.Endpoint) -> None:
        await ep.send(await ep.recv())

    listener = await aiordma.listen(echo, HOST, 0, provider="soft")
    try:
        for i in range(50):
            ep = await aiordma.connect(HOST, listener.port, timeout=T, provider="soft")
            async with ep:
                await asyncio.wait_for(ep.send(b"%d" % i), T)
                assert await asyncio.wait_for(ep.recv(), T) == b"%d" % i
    finally:
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)
    await asyncio.sleep(0.1)
    gc.collect()
    held = [o for o in gc.get_objects()
            if isinstance(o, Conn) and o.state == CLOSED and o.staged]
    assert not held
    assert staging_pooled() <= 4
    await victim.still_fine()


#: an interpreter another uid can run (the test's own may live in root's home)
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root and a system python3 to run a client as another uid")
async def test_another_uid_is_refused_before_its_hello(victim: Victim) -> None:
    """uid 65534 connects to the same-host socket (abstract names have no permissions):
    it is closed before its HELLO is read; once its uid is allowed, it gets as far as
    the HELLO check (and fails there, having no secret)."""
    adm = victim.engine.admission
    target = victim.target("unix")
    with open(soft_raw.__file__) as f:
        script = f.read()

    def run_as_nobody() -> dict[str, object]:
        out = subprocess.run([SYSTEM_PYTHON, "-", "probe", "--target", target,
                              "--src", str(victim.server.peer_qp_num),
                              "--dst", str(victim.server.qp_num)], input=script, cwd="/",
                             user=65534, group=65534, capture_output=True, text=True,
                             timeout=T, check=True)
        result: dict[str, object] = json.loads(out.stdout)
        return result

    refused, bad = adm.refused_credentials, adm.refused_hellos
    r = await asyncio.to_thread(run_as_nobody)
    assert r["closed"] and r["answer"] == "", r
    assert adm.refused_credentials == refused + 1 and adm.refused_hellos == bad
    uids = adm.uids
    adm.uids = uids | {65534}
    try:
        r = await asyncio.to_thread(run_as_nobody)
    finally:
        adm.uids = uids
    assert r["closed"] and r["answer"] == "", r
    assert adm.refused_credentials == refused + 1 and adm.refused_hellos == bad + 1
    await victim.still_fine()


def test_allowed_uids_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma.errors import DeviceError
    from aiordma.verbs.soft.admission import allowed_uids

    monkeypatch.setenv("AIORDMA_SOFT_ALLOW_UIDS", "1000, 1001")
    assert allowed_uids() == {os.geteuid(), 1000, 1001}
    monkeypatch.setenv("AIORDMA_SOFT_ALLOW_UIDS", "nobody")
    with pytest.raises(DeviceError, match="not a uid"):
        allowed_uids()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")



async def test_a_hello_that_came_during_a_pause_is_read_before_it_expires(
        victim: Victim) -> None:
    """After a pause of the process (SIGSTOP, a loaded machine) its timers run late,
    maybe before the selector reports the socket readable: the HELLO expiry reads
    what arrived first, and judges the HELLO (here: one for no QP, refused) instead of
    timing out a connection whose HELLO is there."""
    import socket as _socket

    from aiordma.verbs.soft.admission import Pending

    adm = victim.engine.admission
    a, b = _socket.socketpair()
    try:
        a.setblocking(False)
        b.sendall(wire.pack_hello(1, 2, 3, bytes(16), bytes(32)))
        p = Pending(adm, a, ("test", 0))
        timed_out, refused = adm.timed_out, adm.refused_hellos
        with victim.engine.lock:  # as a timer runs it
            adm.pending[p] = None
            adm._expire(p)
        assert p not in adm.pending
        assert (adm.timed_out, adm.refused_hellos) == (timed_out, refused + 1)
    finally:
        a.close()
        b.close()
    await victim.still_fine()
