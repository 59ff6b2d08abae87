"""The waiting half of an endpoint's receives (``Receiving``).

``Endpoint.recv``/``recv_into`` take a message that is already there and nobody waits
before them without a lock and without an await. Otherwise they come here: receivers
are served in FIFO order (``ReceiverTurns``: ``asyncio.Lock``'s contract, compiled with
the rest), and the one whose turn it is waits for the next frame in its own coroutine
(no coroutine per wait: each level of one costs a frame made and resumed per message)
and takes a DATA message as it comes, copied by the engine in one call. What else comes
first -- a message too large for the buffer, the peer's EOF, a closed connection -- goes
through ``next_rx``; a rendezvous message is RDMA-READ into the caller's registered
buffer or into staging first. Cancellation never loses a message:
a message is consumed only once it was handed over, and an interrupted READ into
staging is reused by the next receiver.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from .errors import ConnectionClosed, MessageTooLarge
from .lifecycle import uncancelled
from .memory import LocalSpan
from .protocol.engine import RX_EOF, RX_RNDV, Rx
from .waiters import new_future

if TYPE_CHECKING:
    from .endpoint import Endpoint


def writable_view(buffer: Any) -> memoryview:
    """``buffer`` as a one-dimensional writable memoryview of bytes (what ``recv_into``
    fills). Raises TypeError for a non-bytes-like object or a read-only buffer."""
    try:
        out = memoryview(buffer)
    except TypeError:
        raise TypeError(f"a writable bytes-like object is required, not "
                        f"{type(buffer).__name__!r}") from None
    if out.readonly:
        raise TypeError("recv_into needs a writable buffer")
    if out.ndim != 1 or out.format != "B":
        out = out.cast("B")
    return out


class ReceiverTurns:
    """The receivers' turns: ``asyncio.Lock``'s contract (first come, first served; a
    waiter cancelled before its turn leaves the line without holding up the next),
    compiled with the endpoint's modules where asyncio's lock is interpreted Python
    (five interpreted calls per contended receive).

    ``take()`` takes the turn at once when it is free and nobody waits (True), else
    returns False and the caller awaits ``wait()``; whoever took the turn calls
    ``give()`` once, after which the first waiter gets it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._held = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def held(self) -> bool:
        return self._held

    def take(self) -> bool:
        """Take the turn if it is free and no waiter is ahead (one whose wait was
        cancelled does not count); returns whether it was taken."""
        if self._held:
            return False
        for w in self._waiters:
            if not w.cancelled():
                return False
        self._held = True
        return True

    async def wait(self) -> None:
        """Wait for the turn, then hold it. Cancelled while waiting: raises
        CancelledError without holding it (and hands a free turn to the next)."""
        if self.take():
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(fut)
        try:
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        except asyncio.CancelledError:
            if not self._held:
                self._wake_first()
            raise
        self._held = True

    def give(self) -> None:
        """Give the turn up: the first waiter gets it. Raises RuntimeError when it is
        not held."""
        if not self._held:
            raise RuntimeError("the receivers' turn is not held")
        self._held = False
        self._wake_first()

    def _wake_first(self) -> None:
        if self._waiters:
            fut = self._waiters[0]
            if not fut.done():
                fut.set_result(None)


class Receiving:
    """The waits of one endpoint's receives (the module docstring). Uses the
    endpoint's engine, reactor, regions and lifecycle; keeps the receivers' turns."""

    def __init__(self, ep: Endpoint) -> None:
        self._engine = ep._engine
        self._loop = ep._loop
        self._reactor = ep._reactor
        self._schedule = ep._reactor.schedule
        self._regions = ep._regions
        self._life = ep._life
        self._turns = ReceiverTurns(ep._loop)
        self._future_kw = ep._future_kw

    def wait_in_place(self) -> tuple[float, float] | None:
        """polling mode, nothing received yet and nobody else receiving: wait in place
        (``PollSchedule.wait_in_place``) for the next frame, so that a message that
        comes in time takes the no-lock path of ``recv``/``recv_into`` instead of the
        waiter machinery. The caller then looks at the receive queue; this never
        suspends. Returns the wait's ``PollSchedule.take_miss()``: not None when it ran
        out its budget, for the caller to pass to ``resumed`` once a message came."""
        if self._engine.state.failed or self._life.closing is not None:
            return None
        fut: asyncio.Future[None] = new_future(self._loop, self._future_kw)
        waiters = self._engine.rx.rx_waiters
        waiters.append(fut)
        if self._schedule.wait_in_place(fut):
            return None
        if fut in waiters:
            waiters.remove(fut)
        return self._schedule.take_miss()

    def resumed(self, miss: tuple[float, float]) -> None:
        """A receive whose in-place wait ran out (``wait_in_place``) got its message
        (``PollSchedule.resumed``)."""
        self._schedule.resumed(miss)

    async def recv(self) -> bytes:
        """``Endpoint.recv`` once it must wait: in turn, the next message as bytes."""
        turns = self._turns
        if not turns.take():
            await turns.wait()
        try:
            rx = self._engine.rx
            take = rx.take_data
            while True:  # a DATA message, as it comes: one wait, no frame of its own
                data = take()
                if data is not None:
                    return data
                if not self._sleep_ready():
                    break  # something else at the head, or closed: the general path
                fut = self._sleeper(rx.rx_waiters)  # (inline: a coroutine per wait costs)
                try:
                    await self._sleep_on(fut)
                finally:
                    self._woke(rx.rx_waiters, fut)
            m = await self.next_rx()  # a rendezvous message: a DATA one was taken above
            assert m.kind == RX_RNDV
            st = await self.rndv_fetch(m, None)
            assert st is not None
            data = bytes(st.view)
            rx.consume_rndv(m)
            return data
        finally:
            turns.give()

    async def recv_into(self, out: memoryview) -> int:
        """``Endpoint.recv_into`` once it must wait: in turn, the next message into
        ``out`` (1-D, writable); returns its length."""
        turns = self._turns
        if not turns.take():
            await turns.wait()
        try:
            rx = self._engine.rx
            take = rx.take_into_in_turn
            while True:  # a DATA message that fits, as it comes: one wait, copied in C
                n = take(out)
                if n >= 0:
                    return n
                if not self._sleep_ready():
                    break  # too large, something else at the head, or closed
                fut = self._sleeper(rx.rx_waiters)  # (inline: a coroutine per wait costs)
                try:
                    await self._sleep_on(fut)
                finally:
                    self._woke(rx.rx_waiters, fut)
            m = await self.next_rx()  # too large, or a rendezvous message
            if m.length > out.nbytes:
                raise MessageTooLarge(f"message of {m.length} bytes does not fit a buffer of "
                                      f"{out.nbytes}; it is kept for the next receive", m.length)
            assert m.kind == RX_RNDV  # a DATA one that fits was taken above
            span: LocalSpan | None
            try:
                span = self._regions.resolve(out[: m.length], writable=True)
            except ValueError:
                span = None
            st = await self.rndv_fetch(m, span)
            if st is not None:
                out[: m.length] = st.view
            n = m.length
            rx.consume_rndv(m)
            return n
        finally:
            turns.give()

    def _sleep_ready(self) -> bool:
        """Whether the turn's holder may simply wait for the next frame: nothing is at
        the head of the receive queue (a message there that the fast take left is an
        EOF, a rendezvous or too large: ``next_rx``'s) and the connection is open."""
        e = self._engine
        return not e.rx.rx and not e.state.failed and self._life.closing is None

    def _sleeper(self, waiters: list[Any]) -> asyncio.Future[None]:
        """A new future in ``waiters`` (the engine's), which the engine resolves when
        something arrives; its waiter calls ``_woke`` after awaiting it, however that
        ended."""
        fut: asyncio.Future[None] = new_future(self._loop, self._future_kw)
        waiters.append(fut)
        return fut

    def _sleep_on(self, fut: asyncio.Future[None]) -> Awaitable[None]:
        """What a sleeper awaits for ``fut`` (``_sleeper``'s): the future itself, or in
        polling mode the reactor's ``wait`` on it, which polls while the task is
        suspended. Returns or raises what ``await fut`` does."""
        return self._reactor.wait(fut) if self._reactor.waits else fut

    @staticmethod
    def _woke(waiters: list[Any], fut: asyncio.Future[None]) -> None:
        """``fut`` (``_sleeper``'s) is no longer awaited: a sleeper cancelled or failed
        leaves ``waiters`` clean (a resolved one is already out: the engine empties
        the list as it wakes it)."""
        if fut in waiters:
            waiters.remove(fut)

    async def next_rx(self) -> Rx:
        """The message at the head of the receive queue (left there); raises
        ConnectionClosed after the peer's EOF or when the connection failed."""
        rx = self._engine.rx
        while True:
            if self._engine.state.failed:
                raise self._engine.closed_error()
            if rx.rx:
                m = rx.rx[0]
                if m.kind == RX_EOF:
                    raise ConnectionClosed("the peer closed the connection")
                return m
            if self._life.closing is not None:
                raise self._engine.closed_error()
            await self.wait_on(rx.rx_waiters)

    async def wait_on(self, waiters: list[Any]) -> None:
        """Sleep until the engine wakes ``waiters``; a cancelled sleeper leaves the list
        clean."""
        fut = self._sleeper(waiters)
        try:
            await self._sleep_on(fut)
        finally:
            self._woke(waiters, fut)

    async def rndv_fetch(self, m: Rx, span: LocalSpan | None) -> Any:
        """READ the rendezvous message ``m`` into ``span`` or into staging (returned).

        Survives cancellation: an interrupted READ into staging is reused by the next
        receiver; one into a (cancelled) caller's buffer is simply read again.
        """
        rx = self._engine.rx
        if m.read is not None:
            await uncancelled(m.read)  # type: ignore[arg-type]
            if m.staging is None:
                m.read = None  # landed in a cancelled caller's buffer: read again
        if m.read is None:
            # While it lands, the next few messages are read into staging (within the
            # budget of a receive in progress), so the READs overlap the application's
            # work instead of one READ per receive call.
            fut = rx.read_for_receiver(m, span)
            await uncancelled(fut)  # type: ignore[arg-type]
        return m.staging
