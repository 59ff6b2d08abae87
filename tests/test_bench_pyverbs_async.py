"""The ``pyverbs-async`` baseline's CQ poller (aiordma/bench/pyverbs_async.py), against a
fake verbs object: completions resolve Futures in order, early receives are kept only
while banking, cancelled waiters are skipped, an error completion fails every waiter,
and the poller stops once nothing waits. (The baseline itself runs on real verbs in
the VM: ``make bench-rxe``.)"""

from __future__ import annotations

import asyncio
import types
from collections import deque
from typing import Any

import pytest

from aiordma.bench.pyverbs_async import _RECV_ID, _SEND_ID, _Poller


class FakeVerbs:
    """cq.poll(n) hands out queued completions; posts are recorded."""

    def __init__(self) -> None:
        self.e = {"IBV_WC_SUCCESS": 0}
        self.wcs: deque[Any] = deque()
        self.posted_sends: list[Any] = []
        self.posted_recvs = 0
        self.polls = 0
        self.cq = types.SimpleNamespace(poll=self._poll)
        self.qp = types.SimpleNamespace(post_send=self.posted_sends.append,
                                        post_recv=self._post_recv)

    def recv_wr(self, wr_id: int) -> str:
        return f"recv-{wr_id}"

    def _post_recv(self, wr: Any) -> None:
        assert wr == f"recv-{_RECV_ID}"
        self.posted_recvs += 1

    def _poll(self, n: int) -> tuple[int, list[Any]]:
        self.polls += 1
        out = [self.wcs.popleft() for _ in range(min(n, len(self.wcs)))]
        return len(out), out

    def complete(self, wr_id: int, byte_len: int = 0, status: int = 0) -> None:
        self.wcs.append(types.SimpleNamespace(wr_id=wr_id, byte_len=byte_len, status=status,
                                              vendor_err=0))


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_sends_resolve_in_order_and_receives_carry_their_length() -> None:
    v = FakeVerbs()
    p = _Poller(v, asyncio.get_running_loop())  # type: ignore[arg-type]
    f1, f2 = p.send_done("a"), p.send_done("b")
    assert v.posted_sends == ["a", "b"]
    r = p.recv()
    assert isinstance(r, asyncio.Future)
    v.complete(_SEND_ID)
    await _turns()
    assert f1.done() and not f2.done()
    v.complete(_RECV_ID, 64)
    v.complete(_SEND_ID)
    await asyncio.wait_for(asyncio.gather(f2, r), 5)
    assert r.result() == 64
    assert v.posted_recvs == 1  # the receive was re-posted


async def test_early_receive_is_banked_then_returned_at_once() -> None:
    v = FakeVerbs()
    p = _Poller(v, asyncio.get_running_loop())  # type: ignore[arg-type]
    p.keep = True
    p.kick()
    v.complete(_RECV_ID, 7)
    await _turns()
    assert p.recv() == 7
    p.bank = False
    v.complete(_RECV_ID, 9)
    counted: list[int] = []
    p.on_recv = lambda: counted.append(1)
    await _turns()
    assert counted == [1] and not p.ready  # counted, not kept
    p.keep = False


async def test_cancelled_receive_waiter_is_skipped() -> None:
    v = FakeVerbs()
    p = _Poller(v, asyncio.get_running_loop())  # type: ignore[arg-type]
    first = p.recv()
    second = p.recv()
    assert isinstance(first, asyncio.Future) and isinstance(second, asyncio.Future)
    first.cancel()
    v.complete(_RECV_ID, 3)
    assert await asyncio.wait_for(second, 5) == 3


async def test_poller_stops_when_nothing_waits() -> None:
    v = FakeVerbs()
    p = _Poller(v, asyncio.get_running_loop())  # type: ignore[arg-type]
    f = p.send_done("a")
    v.complete(_SEND_ID)
    await asyncio.wait_for(f, 5)
    await _turns()
    assert not p.running
    polls = v.polls
    await _turns(20)
    assert v.polls == polls


async def test_error_completion_fails_every_waiter_and_later_calls() -> None:
    v = FakeVerbs()
    p = _Poller(v, asyncio.get_running_loop())  # type: ignore[arg-type]
    s = p.send_done("a")
    r = p.recv()
    v.complete(_SEND_ID, status=5)
    with pytest.raises(RuntimeError, match="status 5"):
        await asyncio.wait_for(s, 5)
    with pytest.raises(RuntimeError, match="status 5"):
        await asyncio.wait_for(r, 5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        p.send_done("b")
    assert v.posted_sends == ["a"]


async def test_closed_poller_polls_no_more() -> None:
    v = FakeVerbs()
    p = _Poller(v, asyncio.get_running_loop())  # type: ignore[arg-type]
    p.keep = True
    p.kick()
    await _turns()
    p.closed = True
    await _turns()
    polls = v.polls
    await _turns(20)
    assert v.polls == polls and not p.running
