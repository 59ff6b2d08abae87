"""``Endpoint.establish`` runs a QP's RTR transition in a thread where that transition
releases the GIL (``QP.modify_releases_gil``: the compiled verbs path, in which the
kernel may wait seconds for the peer's address). On soft, here, the QPs claim it, and
``Resources.connect`` (the transitions) is wrapped: the wrapper runs in the executor's
thread, records it, and hands the real work (soft's QPs belong to the loop) back to the
loop, which therefore must keep running meanwhile. The compiled call itself:
tests/test_ibverbs_fastpath.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from _pairs import HOST, T

import aiordma
from aiordma.resources import Resources
from aiordma.verbs.soft import mr as soft_mr
from aiordma.verbs.soft._core import SoftQP


async def _echo(ep: aiordma.Endpoint) -> None:
    with contextlib.suppress(aiordma.ConnectionClosed):
        while True:
            await ep.send(await ep.recv())


@contextlib.asynccontextmanager
async def _listening() -> AsyncIterator[aiordma.Listener]:
    listener = await aiordma.listen(_echo, HOST, 0, provider="soft")
    try:
        yield listener
    finally:
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)


def _threaded_connect(monkeypatch: pytest.MonkeyPatch, loop: asyncio.AbstractEventLoop,
                      before: Callable[[int], None]) -> list[int]:
    """Make soft QPs claim a GIL-free RTR and wrap ``Resources.connect``: each call
    records its thread, runs ``before(call number)`` there, then the real connect on the
    loop (bounded wait). Returns the list of recorded thread idents."""
    threads: list[int] = []
    real = Resources.connect
    class Claiming(SoftQP):
        """A soft QP that claims a GIL-free RTR transition."""

        @property
        def modify_releases_gil(self) -> bool:
            return True

    monkeypatch.setattr(soft_mr, "SoftQP", Claiming)

    def connect(self: Resources, *args: Any, **kw: Any) -> None:
        threads.append(threading.get_ident())
        before(len(threads))
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def on_loop() -> None:
            try:
                real(self, *args, **kw)
            except BaseException as exc:  # handed back to the thread
                done.set_exception(exc)
            else:
                done.set_result(None)
        loop.call_soon_threadsafe(on_loop)
        done.result(timeout=T)  # a blocked loop would never run on_loop

    monkeypatch.setattr(Resources, "connect", connect)
    return threads


async def test_the_transition_runs_in_a_thread_while_the_loop_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    threads = _threaded_connect(monkeypatch, loop, lambda n: None)
    async with _listening() as listener:
        ep = await asyncio.wait_for(aiordma.connect(HOST, listener.port, provider="soft"), T)
        async with ep:
            await asyncio.wait_for(ep.send(b"ping"), T)
            assert await asyncio.wait_for(ep.recv(), T) == b"ping"
    assert len(threads) == 2  # the listener's endpoint, then the client's
    assert threading.get_ident() not in threads


async def test_a_cancelled_connect_waits_for_the_transition_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the client's transition runs in its thread, ``connect`` does not
    return (and destroy the QP) before that thread is done; then it is cancelled."""
    loop = asyncio.get_running_loop()
    entered = threading.Event()
    release = threading.Event()

    def before(n: int) -> None:
        if n == 2:  # the client's
            entered.set()
            assert release.wait(T), "the test never released the transition"

    _threaded_connect(monkeypatch, loop, before)
    async with _listening() as listener:
        task = asyncio.create_task(aiordma.connect(HOST, listener.port, provider="soft"))
        for _ in range(int(T / 0.01)):
            if entered.is_set():
                break
            await asyncio.sleep(0.01)
        assert entered.is_set()
        task.cancel()
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert not task.done()  # still waiting for the thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, T)
    # nothing left "being handled" (a compiled coroutine that awaited inside an except
    # block left the CancelledError as the thread's current exception, the context of
    # every exception raised after it)
    assert sys.exc_info() == (None, None, None)
