"""soft across two hosts: server and client in two network namespaces joined by a veth
pair (aiordma/bench/netns.py), ``soft`` over TCP between them (``AIORDMA_SOFT_ADDR``), the
endpoint API end to end, then the same traffic under loss, delay, reordering and
duplication: every message exactly once, in order, intact, and no connection failure
(the retry budget is not exhausted by a lossy link).

Root, iproute2 and iptables (``make net-prereqs``); skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest
from _peers import PROTO_PORT, STREAM_PORT, Peer, client, figure, net_fixture, server_fixture

from aiordma.bench.netns import NetPair

pytestmark = [pytest.mark.netns, pytest.mark.multiprocess]

T = 120.0
MiB = 1 << 20
net = net_fixture()
server = server_fixture()


def test_endpoint_api_across_hosts(net: NetPair, server: Peer) -> None:
    """0 B to 64 MiB, pipelined order, WRITE/READ, atomics, streams, Transport."""
    c = client(net, "api", "--stream-port", str(STREAM_PORT), "--proto-port", str(PROTO_PORT))
    try:
        res = c.finish(T)
    finally:
        c.close()
    assert res["sizes"][0] == 0 and res["sizes"][-1] == 64 * MiB
    assert res["local"] == "198.18.0.2" and res["peer"] == "198.18.0.1"
    tcp = net.tcp_counters("b")
    assert tcp["Tcp.OutSegs"] > 64 * MiB // 1500  # it went over the link, not elsewhere


FAULTS = {
    "loss 10%": dict(loss=0.10),
    "delay 20 ms": dict(delay_ms=20.0),
    "reorder 10% by 3 ms": dict(fraction=0.10, delay_ms=3.0),
    "duplicate 5%": dict(dup=0.05),
    "jitter 0-4 ms, duplicate 2%, loss 2%": dict(jitter_ms=4.0, dup=0.02, loss=0.02),
}
#: bytes per direction of each run: 10% loss on MTU-sized packets slows TCP to a crawl
AMOUNT = {"loss 10%": MiB}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_traffic_exactly_once_in_order_under(net: NetPair, server: Peer, fault: str) -> None:
    spec = dict(FAULTS[fault])
    loss = float(spec.pop("loss", 0.0))
    if loss:
        net.loss(loss)
    if spec:
        net.netem("both", seed=1, **spec)
    before = {s: net.tcp_counters(s) for s in ("a", "b")}
    c = client(net, "traffic", "--bytes", str(AMOUNT.get(fault, 8 * MiB)))
    try:
        res = c.finish(T)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the server's events: {server.drain(1.0)}") from None
    finally:
        c.close()
    after = {s: net.tcp_counters(s) for s in ("a", "b")}
    stats = net.clear()

    def delta(name: str) -> int:
        return sum(after[s].get(name, 0) - before[s].get(name, 0) for s in ("a", "b"))

    retrans = delta("Tcp.RetransSegs")
    dups = delta("TcpExt.TCPDSACKOldSent")  # a receiver got a segment it already had
    figure(f"soft across hosts, {fault}: {res['messages']} messages, "
           f"{res['bytes'] / MiB:.1f} MiB echoed in {res['seconds']:.1f} s, exactly once "
           f"in order; TCP retransmitted {retrans} segments, received {dups} duplicates; "
           f"netem {stats}")
    # the fault really happened
    if loss:
        assert retrans > 0
    if spec.get("dup"):
        assert dups > 0
    if spec.get("delay_ms") or spec.get("jitter_ms"):
        assert all(s is not None and s["packets"] > 0 for s in stats.values()), stats
