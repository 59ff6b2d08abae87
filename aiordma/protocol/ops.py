"""The records of the message engine (sans-IO): operations to post, messages received,
and what the engine asks of the waiters it completes.

A **waiter** is whatever the engine's user waits on (an ``asyncio.Future`` in the
endpoint; a plain recorder in the sans-IO tests): the engine only looks at ``done()``
and calls ``set_result``/``set_exception`` once, so it never touches an event loop.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

from aiordma.verbs.wr import SendWR

# op kinds (BATCH: several DATA ops sent as one BATCH frame; its payload lists them)
DATA: Final = 0
RNDV: Final = 1
CTRL: Final = 2
WRITE: Final = 3
READ: Final = 4
ATOMIC: Final = 5
IMM: Final = 6
RNDV_READ: Final = 7
BATCH: Final = 8

# received message kinds
RX_DATA: Final = 0
RX_RNDV: Final = 1
RX_EOF: Final = 2


class Waiter(Protocol):
    """What the engine completes: resolved at most once."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


class Op:
    """One operation on the send side: queued, then posted as one work request.

    ``wr`` is the provider's work request (a ``SendWR``: the engine sets its ``wr_id``
    and signaled flag and reads its SGE lengths); ``slot`` the eager send buffer a
    frame occupies; ``keep`` what must stay alive until the completion; ``payload``
    the bytes of a DATA op (until copied), the source of a RNDV op, the members of a
    BATCH op or ``(frame type, arg)`` of a CTRL op.
    """

    __slots__ = ("kind", "fut", "slot", "keep", "wr", "payload", "msg_id", "posted")

    def __init__(self, kind: int, fut: Waiter | None, payload: Any = None, *,
                 wr: SendWR | None = None, keep: Any = None, msg_id: int = 0) -> None:
        self.kind = kind
        self.fut = fut
        self.slot: int | None = None
        self.keep = keep
        self.wr = wr
        self.payload = payload
        self.msg_id = msg_id
        self.posted = False

    def __repr__(self) -> str:
        return f"<Op kind={self.kind} slot={self.slot} posted={self.posted}>"


class Rx:
    """A received message waiting for the application (the receive queue's head).

    DATA: ``offset``/``length`` in the receive pool, ``slot`` the buffer to re-post
    once consumed (-1 for all but the last message of a BATCH). RNDV: the sender's
    ``addr``/``rkey``/``length`` and ``msg_id``; ``read`` the waiter of its READ once
    started, ``staging`` the buffer it lands in (None: the receiver's own),
    ``deferred`` not read ahead on arrival (the read-ahead budget was spent).
    """

    __slots__ = ("kind", "slot", "offset", "length", "addr", "rkey", "msg_id", "read",
                 "staging", "done_sent", "deferred")

    def __init__(self, kind: int, slot: int = -1, offset: int = 0, length: int = 0, *,
                 addr: int = 0, rkey: int = 0, msg_id: int = 0) -> None:
        self.kind = kind
        self.slot = slot
        self.offset = offset
        self.length = length
        self.addr = addr
        self.rkey = rkey
        self.msg_id = msg_id
        self.read: Waiter | None = None
        self.staging: Any = None
        self.done_sent = False
        self.deferred = False


def wake(waiters: list[Waiter]) -> None:
    """Resolve every waiter of ``waiters`` (with None) and empty the list."""
    for w in waiters:
        if not w.done():
            w.set_result(None)
    waiters.clear()
