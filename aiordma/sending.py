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
from typing import TYPE_CHECKING, Any, Final

from .errors import ConnectionClosed, MessageTooLarge
from .protocol.engine import RNDV, Op
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

    def queue(self, fut: asyncio.Future[None], data: Any) -> tuple[Op, int]:
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
