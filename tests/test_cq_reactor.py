"""The reactor's arm/drain protocol against a fake CQ with exact verbs semantics.

No provider, no timer: a completion that lands between the last empty poll and the
re-arm must still be dispatched (the re-arm-then-drain rule), and the tests would hang
(caught by the timeout) on a missed wake-up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiordma.cq_reactor import CQReactor, future_handler, poll_settings
from aiordma.errors import RemoteAccessError
from aiordma.verbs import WC, WCOpcode, WCStatus
from benchmarks.fakecq import FakeCQ, FakeCtx


def _wc(wr_id: int, status: WCStatus = WCStatus.SUCCESS) -> WC:
    return WC(wr_id, status, WCOpcode.SEND)


@pytest.mark.parametrize("mode", ["blocking", "hybrid", "polling"])
async def test_completion_in_the_arm_window_is_not_lost(mode: str) -> None:
    loop = asyncio.get_running_loop()
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode=mode, spin_us=5)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    futs = [loop.create_future() for _ in range(3)]
    ids = [r.register(future_handler, f) for f in futs]
    # during the wake-up, the second completion lands just after the poll that takes
    # the first: the reactor must have re-armed before that poll, or nothing wakes it
    cq.after_poll = lambda: cq.add(_wc(ids[1]))
    cq.add(_wc(ids[0]))  # wakes the reactor (armed at creation)
    await asyncio.wait_for(futs[0], 2)
    await asyncio.wait_for(futs[1], 2)  # would hang with poll-then-arm
    cq.add(_wc(ids[2]))
    await asyncio.wait_for(futs[2], 2)
    st = r.statistics()
    assert st["completions"] == 3 and st["outstanding"] == 0
    r.close()
    assert cq.closed and cq.acked == cq.events


async def test_errors_become_typed_exceptions_and_cancelled_waiters_are_dropped() -> None:
    loop = asyncio.get_running_loop()
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode="blocking")  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    pinned = bytearray(10)
    cancelled = loop.create_future()
    a = r.register(future_handler, cancelled)
    bad = loop.create_future()
    b = r.register(future_handler, bad)
    cancelled.cancel()  # the awaiting task went away; the entry keeps the buffers
    assert r.outstanding == 2
    del pinned
    cq.add(_wc(a))
    cq.add(_wc(b, WCStatus.REM_ACCESS_ERR))
    with pytest.raises(RemoteAccessError) as ei:
        await asyncio.wait_for(bad, 2)
    assert ei.value.wr_id == b and str(ei.value.status) == "IBV_WC_REM_ACCESS_ERR"
    assert r.outstanding == 0
    r.close()


async def test_handler_exception_does_not_stop_dispatch() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda lp, c: errors.append(c))
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode="blocking")  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]

    def boom(wc: WC, arg: Any) -> None:
        raise RuntimeError("handler bug")

    ok = loop.create_future()
    cq.add(_wc(r.register(boom, None)))
    cq.add(_wc(r.register(future_handler, ok)))
    await asyncio.wait_for(ok, 2)
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)
    r.close()


async def test_cq_capacity_is_reserved_twice_the_work() -> None:
    loop = asyncio.get_running_loop()
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode="blocking", cq_size=100)  # type: ignore[arg-type]
    a = r.acquire_cq(30)
    assert r.acquire_cq(20) is a  # 60 + 40 = 100
    c = r.acquire_cq(1)  # no room left: a second CQ with its own channel
    assert c is not a and len(ctx.cqs) == 2
    r.release_cq(a, 30)
    assert r.acquire_cq(30) is a
    r.close()


def test_poll_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_POLL_MODE", "hybrid")
    monkeypatch.setenv("AIORDMA_SPIN_US", "7")
    assert poll_settings() == ("hybrid", 7)
    assert poll_settings("blocking") == ("blocking", 0)
    with pytest.raises(ValueError):
        poll_settings("fast")
    with pytest.raises(ValueError):
        poll_settings("hybrid", -1)
