"""The futures an endpoint's operations await (aiordma.waiters): made as the loop's
own ``create_future()`` makes them, through a keyword dict kept per loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiordma.protocol.engine import new_waiter
from aiordma.waiters import future_kwargs, new_future


class _OwnFuture(asyncio.Future[Any]):
    pass


class _OwnFutureLoop(asyncio.SelectorEventLoop):
    """A loop that makes its own kind of future, as asyncio lets a loop do."""

    def create_future(self) -> asyncio.Future[Any]:
        return _OwnFuture(loop=self)


async def test_new_future_is_a_pending_future_of_the_loop() -> None:
    loop = asyncio.get_running_loop()
    kw = future_kwargs(loop)
    assert kw == {"loop": loop}
    fut = new_future(loop, kw)
    assert type(fut) is type(loop.create_future()) is asyncio.Future
    assert fut.get_loop() is loop and not fut.done()
    assert kw == {"loop": loop}  # passed on, not changed
    loop.call_soon(fut.set_result, 7)
    assert await fut == 7


def test_a_loop_with_its_own_futures_is_asked_for_them() -> None:
    loop = _OwnFutureLoop()
    try:
        assert future_kwargs(loop) is None
        fut = new_future(loop, None)
        assert type(fut) is _OwnFuture and fut.get_loop() is loop
    finally:
        loop.close()


def test_new_future_needs_no_running_loop() -> None:
    """Made from outside the loop (no running loop at all), the future is still the
    given loop's."""
    loop = asyncio.new_event_loop()
    try:
        fut = new_future(loop, future_kwargs(loop))
        assert fut.get_loop() is loop
        fut.cancel()
    finally:
        loop.close()


def test_new_waiter_passes_the_dict_as_it_is() -> None:
    """``new_waiter(cls, kwargs)`` is ``cls(**kwargs)``; the dict is not changed, and a
    class that refuses the arguments raises as it would."""
    seen: list[dict[str, Any]] = []

    class Recorder:
        def __init__(self, **kw: Any) -> None:
            seen.append(kw)

    kw = {"loop": 1}
    assert isinstance(new_waiter(Recorder, kw), Recorder)
    assert seen == [{"loop": 1}] and kw == {"loop": 1}
    with pytest.raises(TypeError):
        new_waiter(object, kw)
    with pytest.raises(TypeError):
        new_waiter(None, kw)
