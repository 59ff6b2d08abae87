"""soft: a HELLO that arrives before the QP it names has its key (the QP is still in
RESET: its owner has not reached INIT) waits for the key and is judged then, as
hardware drops requests to a QP that is not ready and the requester's retries find it
ready. Two processes that bring their QPs up at the same time race like this; the peer
that dials first must not lose its connection (its first WR would end with
RETRY_EXC_ERR). What waits is still a pending socket: capped, timed out, and refused
when its MAC does not match the key the QP gets.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from test_verbs_provider import ACC_ALL, Resources, bring_up, poll_n, res, send, sge, statuses

from aiordma.verbs import QPCap, QPState, WCStatus, WROpcode
from aiordma.verbs.api import QP, Context
from aiordma.verbs.soft import engine as soft_engine
from aiordma.verbs.soft import wire
from aiordma.verbs.soft.admission import Admission, Pending

pytestmark = pytest.mark.usefixtures("soft_cma")
__all__ = ["res"]  # the fixture, shared with test_verbs_provider
KEY = b"k" * 32


@pytest.fixture
def adm(provider_name: str, ctx: Context) -> Admission:
    if provider_name != "soft":
        pytest.skip("the soft device's admission")
    e = soft_engine.current()
    assert e is not None
    return e.admission


def _wait_for(cond: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Poll ``cond`` until it holds; fail with ``what`` after ``seconds`` (a synchronous
    ``_stacks.eventually``)."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def test_a_hello_before_the_qp_is_keyed_waits_for_its_key(ctx: Context, res: Resources,
                                                          adm: Admission) -> None:
    pd = res.add(ctx.alloc_pd())
    cq = res.add(ctx.create_cq(64))
    q1 = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
    q2 = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
    dialer, late = (q1, q2) if q1.qp_num < q2.qp_num else (q2, q1)  # smaller QPN dials
    buf = bytearray(4096)
    m = res.add(pd.reg_mr(buf, ACC_ALL))
    refused = adm.refused_hellos
    bring_up(ctx, dialer, late.qp_num, auth_key=KEY)
    _wait_for(lambda: late.qp_num in adm.unkeyed, "the HELLO did not arrive and wait")
    assert adm.refused_hellos == refused
    bring_up(ctx, late, dialer.qp_num, auth_key=KEY)
    buf[:5] = b"hello"
    dialer.post_send([send(1, [sge(m, 0, 5)], WROpcode.RDMA_WRITE, remote_addr=m.addr + 100,
                           rkey=m.rkey),
                      send(2, [sge(m, 200, 5)], WROpcode.RDMA_READ, remote_addr=m.addr + 100,
                           rkey=m.rkey)])
    assert statuses(poll_n(cq, 2)) == [WCStatus.SUCCESS] * 2
    assert bytes(buf[200:205]) == b"hello"
    assert adm.refused_hellos == refused
    assert late.qp_num not in adm.unkeyed


@contextlib.contextmanager
def _waiting_hello(ctx: Context, res: Resources,
                   adm: Admission) -> Iterator[tuple[QP, Pending, socket.socket]]:
    """A QP in RESET and a pending socket whose HELLO (with a key that is not the QP's)
    names it and was read: it waits for the QP's key. Yields the QP, the pending entry
    and the peer's end of the socket."""
    pd = res.add(ctx.alloc_pd())
    cq = res.add(ctx.create_cq(64))
    qp = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        b.sendall(wire.pack_hello(1, 7, qp.qp_num, bytes(16), b"w" * 32))
        p = Pending(adm, a, ("test", 0))
        with adm.engine.lock:
            adm.pending[p] = None
        adm.read(p)
        assert adm.unkeyed.get(qp.qp_num) == [p] and p in adm.pending
        yield qp, p, b
    finally:
        a.close()
        b.close()


def test_a_waiting_hello_with_another_key_is_refused_when_the_key_comes(
        ctx: Context, res: Resources, adm: Admission) -> None:
    with _waiting_hello(ctx, res, adm) as (qp, p, peer):
        refused = adm.refused_hellos
        bring_up(ctx, qp, 7, auth_key=KEY, stop_at=QPState.INIT)
        _wait_for(lambda: p not in adm.pending, "the waiting HELLO was not judged")
        assert adm.refused_hellos == refused + 1
        assert qp.qp_num not in adm.unkeyed
        peer.settimeout(5)
        assert peer.recv(1) == b""  # closed without an answer


def test_a_waiting_hello_still_expires_and_leaves_nothing(ctx: Context, res: Resources,
                                                          adm: Admission) -> None:
    with _waiting_hello(ctx, res, adm) as (qp, p, _):
        timed_out = adm.timed_out
        with adm.engine.lock:  # as its timer runs it
            adm._expire(p)
        assert p not in adm.pending and qp.qp_num not in adm.unkeyed
        assert adm.timed_out == timed_out + 1
