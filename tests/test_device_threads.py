"""One device used by several event loops in several threads (each loop has its own
reactor): traffic, async events handed to the right loop, reactors of finished loops
closed. Every thread and await is bounded."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from _pairs import HOST, T

import aiordma
from aiordma.verbs import AsyncEvent, EventType

pytestmark = pytest.mark.usefixtures("soft_cma")


def _in_thread(main: Callable[[], Coroutine[Any, Any, Any]]) -> tuple[threading.Thread, list]:
    """Run ``main()`` with ``asyncio.run`` (debug on: a foreign-thread call raises) in a
    thread; the list gets its result or its exception."""
    out: list = []

    def run() -> None:
        async def debugged() -> Any:
            asyncio.get_running_loop().set_debug(True)
            return await main()
        try:
            out.append(asyncio.run(debugged()))
        except BaseException as exc:  # reported by the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


async def _echo_pair(device: aiordma.Device, tag: int, n: int) -> int:
    """A listener and a client on this thread's loop; ``n`` echoed messages."""
    async def handler(ep: aiordma.Endpoint) -> None:
        try:
            while True:
                await ep.send(await ep.recv())
        except aiordma.ConnectionClosed:
            pass

    lst = await aiordma.listen(handler, HOST, 0, device=device)
    try:
        ep = await aiordma.connect(HOST, lst.port, device=device, timeout=T)
        for k in range(n):
            m = bytes([tag]) * (1 + k % 200) + (b"r" * 40_000 if k % 16 == 0 else b"")
            await asyncio.wait_for(ep.send(m), T)
            assert await asyncio.wait_for(ep.recv(), T) == m
        await asyncio.wait_for(ep.close(), T)
    finally:
        lst.close()
        await asyncio.wait_for(lst.wait_closed(), T)
    return n


async def test_loops_in_threads_share_one_device(provider_name: str) -> None:
    device = aiordma.open_device(provider=provider_name)
    try:
        runs = [_in_thread(lambda i=i: _echo_pair(device, i, 60)) for i in range(3)]
        for t, _ in runs:
            await asyncio.to_thread(t.join, 60)
        assert [out for _, out in runs] == [[60], [60], [60]]
        # this loop's own connections work, and the finished loops' reactors (their CQs)
        # are closed when this one makes its reactor
        assert await _echo_pair(device, 9, 10) == 10
        assert len(device._reactors) == 1
    finally:
        device.close()


async def test_async_event_reaches_the_endpoint_on_its_own_loop(
        provider_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's async fd is read by this loop (it used the device first); a QP fatal
    event for a connection of another thread's loop fails that connection there -- its
    loop runs in debug mode, where touching it from this thread would raise."""
    device = aiordma.open_device(provider=provider_name)
    device.reactor()  # this loop reads the device's async events
    ready: queue.Queue[int] = queue.Queue()
    go = threading.Event()

    async def other() -> str:
        async def handler(ep: aiordma.Endpoint) -> None:
            await ep.wait_closed()

        lst = await aiordma.listen(handler, HOST, 0, device=device)
        ep = await aiordma.connect(HOST, lst.port, device=device, timeout=T)
        try:
            pending = asyncio.ensure_future(ep.recv())
            ready.put(ep.qp_num)
            try:
                await asyncio.wait_for(pending, T)
            except aiordma.ConnectionClosed as exc:
                return str(exc)
            return "not failed"
        finally:
            await asyncio.to_thread(go.wait, T)
            ep.abort()
            lst.close()
            await asyncio.wait_for(lst.wait_closed(), T)

    try:
        t, out = _in_thread(other)
        qp_num = await asyncio.to_thread(ready.get, True, T)
        ev = AsyncEvent(EventType.QP_FATAL, qp_num=qp_num)
        monkeypatch.setattr(device.ctx, "get_async_events", lambda: [ev])
        device._on_async_events()
        monkeypatch.undo()
        go.set()
        await asyncio.to_thread(t.join, T)
        assert len(out) == 1 and isinstance(out[0], str) and "QP_FATAL" in out[0], out
    finally:
        go.set()
        device.close()


async def test_closing_the_device_closes_another_threads_reactor_on_its_loop(
        provider_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device is closed from this thread while a loop that used it still runs in
    another: that loop's reactor (and the async-event reader it holds) are closed by
    that loop itself, and the close waits for it."""
    from aiordma.cq_reactor import CQReactor

    device = aiordma.open_device(provider=provider_name)
    ready, stop = threading.Event(), threading.Event()
    closed_on: list[int] = []
    real_close = CQReactor.close

    def recording_close(self: CQReactor) -> None:
        closed_on.append(threading.get_ident())
        real_close(self)

    monkeypatch.setattr(CQReactor, "close", recording_close)

    async def other() -> int:
        device.reactor()  # this loop's reactor; it also reads the device's async events
        ready.set()
        await asyncio.to_thread(stop.wait, T)
        return threading.get_ident()

    t, out = _in_thread(other)
    try:
        assert await asyncio.to_thread(ready.wait, T)
        device.close()  # from this thread, while the other loop runs
        assert device.closed and len(closed_on) == 1
    finally:
        stop.set()
        await asyncio.to_thread(t.join, T)
    assert out == [closed_on[0]] and closed_on[0] != threading.get_ident()
