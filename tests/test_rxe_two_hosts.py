"""``verbs`` between two hosts: two Soft-RoCE guests joined by one Ethernet link
(``tests/rxe/run-two-vms.sh``, ``make test-rxe-two``). These tests run in guest b
(10.77.0.2); guest a (``AIORDMA_RXE_PEER``, 10.77.0.1) runs ``tests/rxe/two_host_peer.py``,
whose control port starts, inspects and kills ``tests/net_peer.py`` servers there.

What they check across the link: the endpoint API (messages of 0 B to 16 MiB, one-sided
WRITE/READ, atomics, EOF and close), the RoCE v2 GID each side picks (the one whose
address is the local end of the setup connection), the path MTU (the smaller of the two
ports' active MTUs: the guests' NICs have different MTUs), a typed error naming the GIDs
when no neighbour answers for the peer's GID, and a peer killed while operations are pending; and
the figures of a bulk transfer over the link (aiordma on verbs, plain TCP).

Skipped (saying why) anywhere else: they need the second guest.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _peers import figure
from net_peer import check_atomics, rdma_path

import aiordma

PEER = os.environ.get("AIORDMA_RXE_PEER", "")
LOCAL = os.environ.get("AIORDMA_RXE_ADDR", "")
DEVICE = os.environ.get("AIORDMA_RXE_DEVICE", "rxe0")
NETDEV = os.environ.get("AIORDMA_RXE_NETDEV", "")
CONTROL_PORT = 7470  # tests/rxe/run-two-vms.sh starts two_host_peer.py there
MAIN_PORT, VICTIM_PORT, WRONG_GID_PORT, BENCH_PORT = 7471, 7472, 7473, 7474
#: an address added to guest a's NIC, on a network guest b has no route to, which a does
#: not answer ARP for from b's subnet (arp_ignore=2)
UNREACHABLE = "10.78.0.1"
KiB, MiB = 1024, 1024 * 1024
T = 120.0  # bound of any single wait (an emulated guest on a shared host is slow)

pytestmark = [
    pytest.mark.rxe_two,
    pytest.mark.skipif(not PEER or os.environ.get("AIORDMA_PROVIDER") != "verbs",
                       reason="needs two Soft-RoCE guests joined by a link, the verbs "
                              "provider in each: make test-rxe-two (tests/rxe/run-two-vms.sh)"),
    pytest.mark.timeout(600),
]


class Control:
    """A connection to guest a's ``two_host_peer.py``: one JSON request, one reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file = sock.makefile("rwb")

    def __call__(self, cmd: str, **kw: Any) -> dict[str, Any]:
        """Send a request; its reply. Fails the test when the peer reports an error."""
        self.file.write(json.dumps({"cmd": cmd, **kw}).encode() + b"\n")
        self.file.flush()
        line = self.file.readline()
        assert line, f"guest a's control connection closed during {cmd!r}"
        reply: dict[str, Any] = json.loads(line)
        assert reply.get("ok"), f"guest a: {cmd!r} failed: {reply.get('error')}"
        return reply


@pytest.fixture(scope="module")
def control() -> Iterator[Control]:
    """Guest a's control server, waited for while that guest boots (at most 600 s:
    both guests boot at once, a may boot again after a crash); told to quit at the end,
    which ends guest a's command."""
    deadline = time.monotonic() + 600
    sock = None
    for _ in range(1200):  # bounded in count and in time
        try:
            sock = socket.create_connection((PEER, CONTROL_PORT), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert sock is not None, f"guest a's control port {PEER}:{CONTROL_PORT} never answered"
    sock.settimeout(T * 2)
    ctl = Control(sock)
    try:
        yield ctl
    finally:
        ctl("quit")
        sock.close()


@pytest.fixture(scope="module")
def server(control: Control) -> int:
    """The port of a ``net_peer.py serve`` on guest a (echo, region and path services)."""
    control("serve", name="main", port=MAIN_PORT)
    return MAIN_PORT


def sysfs_gids() -> dict[int, str]:
    """This host's non-zero GIDs of ``DEVICE`` port 1 by index."""
    base = f"/sys/class/infiniband/{DEVICE}/ports/1/gids"
    out = {}
    for name in os.listdir(base):
        try:
            with open(os.path.join(base, name)) as f:
                gid = f.read().strip()
        except OSError:
            continue
        if ipaddress.IPv6Address(gid) != ipaddress.IPv6Address(0):
            out[int(name)] = gid
    return out


def index_of(gids: dict[Any, str], ip: str) -> int:
    """The index of the IPv4-mapped GID of ``ip`` in ``gids`` (sysfs spelling)."""
    want = ipaddress.IPv6Address(f"::ffff:{ip}")
    found = [int(i) for i, g in gids.items() if ipaddress.IPv6Address(g) == want]
    assert len(found) == 1, f"GIDs of {ip} in {gids}: {found}"
    return found[0]


def hw_counters() -> dict[str, int]:
    """This host's ``DEVICE`` port 1 hardware counters (rxe: packets sent and received,
    retries, sequence errors ...), by name; empty where sysfs has none."""
    base = f"/sys/class/infiniband/{DEVICE}/ports/1/hw_counters"
    out = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, name)) as f:
                out[name] = int(f.read())
        except (OSError, ValueError):
            continue
    return out


def local_active_mtu() -> int:
    dev = aiordma.open_device(DEVICE, provider="verbs")
    try:
        return dev.ctx.query_port(1).active_mtu.bytes
    finally:
        dev.close()


def payload(n: int, seed: int) -> bytes:
    return (seed.to_bytes(4, "little") * (n // 4 + 1))[:n] if n < 4096 else os.urandom(n)


async def echo(ep: aiordma.Endpoint, data: bytes) -> None:
    await asyncio.wait_for(ep.send(data), T)
    got = await asyncio.wait_for(ep.recv(), T)
    assert got == data, f"echo of {len(data)} bytes: {len(got)} bytes came back, or differ"


async def test_endpoint_api_across_hosts(server: int) -> None:
    """0 B to 16 MiB echoed byte for byte, pipelined order, RDMA WRITE/READ, atomics,
    over the link between the guests (the setup connection's ends are the two NICs)."""
    ep = await aiordma.connect(PEER, server, timeout=60)
    async with ep:
        assert ep.local_address and ep.local_address[0] == LOCAL
        assert ep.peer_address and ep.peer_address[0] == PEER
        await asyncio.wait_for(ep.send(b"region"), T)
        desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
        sizes = [0, 1, 63, ep.eager_payload, ep.eager_payload + 1, 64 * KiB, MiB + 3,
                 16 * MiB]
        t0 = time.monotonic()
        for n in sizes:
            await echo(ep, payload(n, n))
        took = time.monotonic() - t0
        window = [asyncio.ensure_future(ep.send(i.to_bytes(4, "little"))) for i in range(100)]
        await asyncio.wait_for(asyncio.gather(*window), T)
        got = [int.from_bytes(await asyncio.wait_for(ep.recv(), T), "little")
               for _ in range(100)]
        assert got == list(range(100)), "pipelined messages out of order"
        src = bytearray(os.urandom(64 * KiB))
        back = bytearray(len(src))
        await asyncio.wait_for(ep.write(ep.register(src), desc.slice(0, len(src))), T)
        await asyncio.wait_for(ep.read(ep.register(back), desc.slice(0, len(src))), T)
        assert back == src, "RDMA READ after WRITE differs"
        word = desc.slice(MiB - 8, 8)
        await check_atomics(ep, word)
        assert await asyncio.wait_for(ep.fetch_add(word, 0), T) == 42
    figure(f"verbs across two guests: messages of {sizes[0]} B to {sizes[-1] // MiB} MiB "
           f"echoed in {took:.1f} s ({2 * sum(sizes) / MiB / took:.1f} MiB/s both ways)")


async def test_gid_by_address_and_path_mtu_the_smaller(control: Control, server: int) -> None:
    """Each side's QP uses the RoCE v2 GID of its own end of the setup connection and
    addresses the other's; both QPs have the smaller active MTU of the two ports as
    their path MTU; a 16 MiB message (8192 packets at 2048 B) still arrives whole."""
    far = control("info")
    near = {"active_mtu": local_active_mtu(), "gids": sysfs_gids()}
    ep = await aiordma.connect(PEER, server, timeout=60)
    async with ep:
        await asyncio.wait_for(ep.send(b"path"), T)
        theirs = json.loads(await asyncio.wait_for(ep.recv(), T))
        ours = rdma_path(ep)
        big = os.urandom(16 * MiB)
        await echo(ep, big)
    our_index, their_index = index_of(near["gids"], LOCAL), index_of(far["gids"], PEER)
    assert ours["gid_index"] == ours["sgid_index"] == our_index, (ours, near["gids"])
    assert theirs["gid_index"] == theirs["sgid_index"] == their_index, (theirs, far["gids"])
    assert ipaddress.IPv6Address(ours["dgid"]) == ipaddress.IPv6Address(f"::ffff:{PEER}")
    assert ipaddress.IPv6Address(theirs["dgid"]) == ipaddress.IPv6Address(f"::ffff:{LOCAL}")
    assert ours["active_mtu"] == near["active_mtu"]
    assert theirs["active_mtu"] == far["active_mtu"]
    smaller = min(near["active_mtu"], far["active_mtu"])
    assert near["active_mtu"] != far["active_mtu"], "the guests' ports have one MTU: no test"
    assert ours["path_mtu"] == theirs["path_mtu"] == smaller, (ours, theirs)
    figure(f"GIDs: b uses index {our_index} (::ffff:{LOCAL}), a index {their_index} "
           f"(::ffff:{PEER}); active MTU b {near['active_mtu']} (netdev "
           f"{os.environ.get('AIORDMA_RXE_MTU')}), a {far['active_mtu']} (netdev "
           f"{far['netdev_mtu']}): path MTU {ours['path_mtu']} on both QPs")


async def test_eof_then_close_across_hosts(server: int) -> None:
    """send_eof: the far side's recv ends (its handler returns, its endpoint closes),
    ours then raises ConnectionClosed; messages sent before the EOF arrive first."""
    ep = await aiordma.connect(PEER, server, timeout=60)
    await asyncio.wait_for(ep.send(b"echo"), T)
    await echo(ep, b"before the EOF")
    await asyncio.wait_for(ep.send(b"last"), T)
    await asyncio.wait_for(ep.send_eof(), T)
    assert await asyncio.wait_for(ep.recv(), T) == b"last"
    with pytest.raises(aiordma.ConnectionClosed):
        await asyncio.wait_for(ep.recv(), T)
    await asyncio.wait_for(ep.close(), T)
    assert ep.closed


async def test_peer_killed_across_hosts(control: Control) -> None:
    """SIGKILL of the far server while a receive and 8 RDMA WRITEs are pending: every
    pending operation raises ConnectionClosed within 30 s of the kill (the bound checks
    that the kill is noticed by the setup connection's EOF or the QP's retries, not by
    the guests' 60 s heartbeat); the figures say which error and how fast."""
    control("serve", name="victim", port=VICTIM_PORT)
    ep = await aiordma.connect(PEER, VICTIM_PORT, timeout=60)
    await asyncio.wait_for(ep.send(b"region"), T)
    desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
    src = ep.register(bytearray(64 * KiB))
    done = {"writes": 0}
    ended: dict[str, tuple[float, BaseException | None]] = {}

    async def writer(i: int) -> None:
        try:
            for _ in range(1_000_000):  # ended by the failure; bounded by the wait below
                await ep.write(src, desc.slice(0, 64 * KiB))
                done["writes"] += 1
        except BaseException as exc:
            ended[f"write{i}"] = (time.monotonic(), exc)

    async def receiver() -> None:
        try:
            await ep.recv()
        except BaseException as exc:
            ended["recv"] = (time.monotonic(), exc)

    tasks = [asyncio.ensure_future(writer(i)) for i in range(8)]
    tasks.append(asyncio.ensure_future(receiver()))
    for _ in range(1200):  # writes are flowing before the kill (at most 120 s)
        if done["writes"] >= 16:
            break
        await asyncio.sleep(0.1)
    assert done["writes"] >= 16, f"only {done['writes']} writes in 120 s"
    asked = time.monotonic()
    control("kill", name="victim")  # answered once the server is dead and reaped
    finished, pending = await asyncio.wait(tasks, timeout=30)
    for t in pending:
        t.cancel()
    assert not pending, f"{len(pending)} operations still pending 30 s after the kill"
    for name, (_t, exc) in ended.items():
        assert isinstance(exc, aiordma.ConnectionClosed), f"{name}: {exc!r}"
    latest = max(t for t, _e in ended.values()) - asked
    kinds = sorted({f"{type(e).__name__} (cause: "
                    f"{type(e.__cause__).__name__ if e.__cause__ else 'none, an EOF'})"
                    for _t, e in ended.values() if e is not None})
    figure(f"peer killed across hosts: {done['writes']} writes done, then the recv and "
           f"8 writes failed within {latest:.2f} s of asking guest a to kill it: "
           f"{', '.join(kinds)}")
    ep.abort()


async def test_unreachable_peer_gid_is_peer_unreachable(control: Control) -> None:
    """A server whose announced GID (forced by AIORDMA_GID_INDEX) is an address that no
    neighbour of guest b answers for: the setup connection works, connecting the QP
    cannot, and connect raises PeerUnreachable naming that GID, ours and the setup
    connection. The event loop runs on meanwhile: the compiled path makes the blocking
    transition (the kernel waits for an ARP answer) in a thread, with the GIL released.

    (Measured: with a answering ARP for it, the address is reachable although b has no
    route to it: the kernel resolves a RoCE GID with a route lookup bound to the GID's
    netdev, which assumes an unrouted destination on-link, and the connection worked.
    So a answers ARP only from the address's own subnet here: arp_ignore=2.)"""
    index = control("add_addr", cidr=f"{UNREACHABLE}/24", arp_ignore=2)["gid_index"]
    control("serve", name="wrong-gid", port=WRONG_GID_PORT,
            env={"AIORDMA_GID_INDEX": str(index)})
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    ticker = asyncio.create_task(tick())
    t0 = time.monotonic()
    try:
        with pytest.raises(aiordma.PeerUnreachable) as info:
            await aiordma.connect(PEER, WRONG_GID_PORT, timeout=60)
    finally:
        ticker.cancel()
    took = time.monotonic() - t0
    figure(f"unreachable peer GID: the loop's longest stall while connecting "
           f"{max(gaps, default=took):.2f} s of {took:.2f} s")
    # blocked, the loop would stall for the whole ARP wait (seconds)
    assert max(gaps, default=took) < took / 2, gaps
    err = info.value
    assert isinstance(err, aiordma.HandshakeError)
    assert err.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT), err.errno
    text = str(err)
    assert f"::ffff:{UNREACHABLE}" in text and f"::ffff:{LOCAL}" in text, text
    assert f"{LOCAL} -> {PEER}" in text, text
    figure(f"unreachable peer GID: {type(err).__name__} [{errno.errorcode[err.errno]}] after "
           f"{took:.2f} s: {text}")
    events = control("events", name="wrong-gid")["events"]
    figure(f"the server with the unreachable GID saw: {events[1:]}")


@pytest.mark.parametrize("kind", ["tcp", "rdma"])
def test_bulk_transfer_figures(control: Control, kind: str) -> None:
    """``aiordma.bench.netpeer`` across the link for 5 s: 1 MiB messages, 8 in flight
    (``rdma``: an aiordma endpoint on verbs; ``tcp``: plain asyncio TCP on the same link,
    the baseline). Figures, not assertions: it must only move data without an error."""
    port = BENCH_PORT + (kind == "rdma")
    control("bench_server", name=f"bench-{kind}", kind=kind, port=port)
    before = hw_counters()
    try:
        r = subprocess.run([sys.executable, "-m", "aiordma.bench.netpeer", "client", kind,
                            PEER, str(port), "5", str(MiB), "8"],
                           capture_output=True, text=True, timeout=T * 2)
    finally:
        control("kill", name=f"bench-{kind}")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["error"] is None and res["bytes"] > 0, res
    after = hw_counters()
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    figure(f"bulk transfer b -> a over the link, {kind}: {res['mib_s']:.1f} MiB/s "
           f"({res['bytes'] / MiB:.0f} MiB in {res['seconds']:.1f} s, 1 MiB x 8 in flight); "
           f"b's {DEVICE} counters moved: {moved}")
