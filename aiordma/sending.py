"""The send side's slow paths (``Sending``): what ``Endpoint.send`` does when the
engine's ``send_eager`` did not take the message in one call.

That is: the precise error when the endpoint cannot send (closing, EOF sent, the peer
gone, not connected); a buffer that is not flat unsigned bytes (cast to one); a message
larger than ``eager_payload``, which goes by rendezvous from a registered source -- the
caller's own region when its bytes lie in one registered for remote read, else a
staging copy. ``Endpoint.send`` itself keeps the one call of the usual case and the
wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .errors import ConnectionClosed, MessageTooLarge
from .protocol.engine import RNDV, Op, check_messages
from .protocol.state import Local, Remote
from .verbs import Access

if TYPE_CHECKING:
    from .endpoint import Endpoint

_REMOTE_READ: Final = int(Access.REMOTE_READ)


def flat_view(data: Any) -> memoryview:
    """``data`` as a one-dimensional memoryview of bytes. Raises TypeError for a
    non-bytes-like object or a buffer that is not C-contiguous."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not {type(data).__name__!r}") from None
    if not mv.c_contiguous:
        raise TypeError("a C-contiguous buffer is required")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


class Sending:
    """The send side's slow paths of one endpoint (the module docstring). Uses the
    endpoint's engine, regions, resources, lifecycle and open check; holds no state of
    its own."""

    def __init__(self, ep: Endpoint) -> None:
        self._ep = ep
        self._engine = ep._engine
        self._regions = ep._regions
        self._res = ep._res
        self._life = ep._life

    def check(self) -> None:
        """Raise the precise ConnectionClosed when this endpoint cannot send now (the
        connection failed or is closing, ``send_eof()`` was called, the peer closed,
        not connected); return otherwise."""
        self._ep._check_open()
        e = self._engine
        st = e.state
        if st.local is not Local.OPEN:
            raise ConnectionClosed("cannot send after send_eof()")
        if st.remote is Remote.GONE:
            raise ConnectionClosed("the peer closed the connection")
        if e.credits is None:
            raise ConnectionClosed("endpoint is not connected")

    def queue(self, fut: asyncio.Future[None] | None, data: Any) -> tuple[Op, int]:
        """Queue ``data`` where ``MessageEngine.send_eager`` did not: eagerly, or by
        rendezvous; ``fut`` completes as ``Endpoint.send`` says. Returns its op and
        size. Raises what ``Endpoint.send`` raises (TypeError, MessageTooLarge,
        ConnectionClosed), queueing nothing."""
        e = self._engine
        if not e.state.can_send or self._life.closing is not None or e.credits is None:
            self.check()  # raises the precise error
        cls = type(data)
        if cls is bytes or cls is bytearray:  # flat bytes already
            mv = memoryview(data)
            n = len(data)
        else:
            mv = flat_view(data)
            n = mv.nbytes
        if n > e.max_message_size:
            raise MessageTooLarge(f"message of {n} bytes exceeds max_message_size "
                                  f"{e.max_message_size}", n)
        tx = e.tx
        if n <= e.eager_payload:
            return tx.queue_data(fut, mv), n
        op = Op(RNDV, fut, payload=self._rndv_source(mv), msg_id=tx.next_msg_id())
        tx.sendq.append(op)
        tx.kick()
        return op, n

    def queue_many(self, msgs: list[Any], new_future: Callable[[], asyncio.Future[None]]
                   ) -> tuple[list[Op], list[asyncio.Future[None]], int]:
        """Queue each of ``msgs`` as one message, in order (``Endpoint.send_many``).

        Every one is checked first (in C: ``check_messages``): raises TypeError (not
        bytes-like, or not C-contiguous), MessageTooLarge or ConnectionClosed with
        nothing queued. Then each is queued as ``send`` queues it, the engine's eager
        path first; only the last one and those that path does not take (a rendezvous,
        a buffer to cast) get a waiter (``new_future()``): eager messages complete in
        order, each before the last, and a rendezvous completes on its own (the peer's
        RNDV_DONE). Returns (the ops in order, the waiters, the bytes). A failure while
        queueing (a staging buffer for a rendezvous, the connection failing) unqueues
        what is not posted yet and raises: the messages posted by then are a prefix."""
        e = self._engine
        if not e.state.can_send or self._life.closing is not None or e.credits is None:
            self.check()  # raises the precise error
        limit = e.max_message_size
        total, bad = check_messages(msgs, limit)
        if bad >= 0:
            n = flat_view(msgs[bad]).nbytes  # raises a bad item's TypeError
            if n > limit:
                raise MessageTooLarge(f"message {bad} of {n} bytes exceeds "
                                      f"max_message_size {limit}", n)
            raise TypeError("a C-contiguous buffer is required")
        send_eager = e.send_eager
        queue = self.queue
        ops: list[Op] = []
        futs: list[asyncio.Future[None]] = []
        try:
            for i in range(len(msgs) - 1):
                m = msgs[i]
                op = send_eager(None, m)
                if op is None:  # a rendezvous (or a buffer to cast): a waiter of its own
                    fut = new_future()
                    futs.append(fut)
                    op = queue(fut, m)[0]
                ops.append(op)
            fut = new_future()
            futs.append(fut)
            op = send_eager(fut, msgs[-1])
            if op is None:
                op = queue(fut, msgs[-1])[0]
            ops.append(op)
        except BaseException:
            e.tx.unqueue(e.tx.sendq, ops)
            for f in futs:
                f.cancel()
            raise
        return ops, futs, total

    def _rndv_source(self, mv: memoryview) -> Any:
        """A registered, remotely readable copy of (or view on) ``mv`` for rendezvous."""
        try:
            span = self._regions.resolve(mv, writable=False)
        except (ValueError, TypeError):
            span = None
        if span is not None and isinstance(span.keep, tuple):
            region = span.keep[1]
            if int(region.access) & _REMOTE_READ:  # (no flag-enum arithmetic per send)
                return span
        st = self._res.staging_out.lease(mv.nbytes)
        st.view[:] = mv
        return st
