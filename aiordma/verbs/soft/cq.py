"""Completion queues and completion channels of the soft device.

Producers (the NIC thread, or a caller's thread posting to a QP in ERR) call
``SoftCQ.push`` with the device lock held. ``poll`` takes the lock only when the queue
is non-empty, so an idle busy-poll costs no lock traffic.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from typing import TYPE_CHECKING

from ...errors import CQOverrunError, RDMAError
from ..api import CQ, AsyncEvent, CompChannel
from ..enums import EventType, WCStatus
from ..wr import WC
from .notify import PipeFlag

if TYPE_CHECKING:
    from .context import SoftContext
    from .qpcore import QPCore as SoftQP

_ARM_NONE = 0
_ARM_ANY = 1
_ARM_SOLICITED = 2


class SoftCompChannel(CompChannel):
    def __init__(self, ctx: SoftContext) -> None:
        self._ctx = ctx
        self._lock = ctx._engine.lock
        self._flag = PipeFlag()
        self.fd = self._flag.fd
        self._events: deque[SoftCQ] = deque()
        self._ncqs = 0
        self._closed = False

    def _post(self, cq: SoftCQ) -> None:
        """Queue an event for ``cq`` (device lock held)."""
        self._events.append(cq)
        self._flag.raise_()

    def _forget(self, cq: SoftCQ) -> None:
        """Drop the not-yet-read events of a destroyed CQ (device lock held)."""
        if cq in self._events:
            self._events = deque(c for c in self._events if c is not cq)
            if not self._events:
                self._flag.lower()

    def get_event(self) -> SoftCQ | None:
        with self._lock:
            if not self._events:
                return None
            cq = self._events.popleft()
            cq._events_got += 1
            if not self._events:
                self._flag.lower()
            return cq

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._ncqs:
                raise RDMAError(errno.EBUSY, f"completion channel still used by {self._ncqs} CQ(s)")
            self._closed = True
            self._events.clear()
        self._flag.close()
        self._ctx._children_changed(self, alive=False)

    def __repr__(self) -> str:
        return f"<SoftCompChannel fd={self.fd}>"


class SoftCQ(CQ):
    def __init__(self, ctx: SoftContext, cqe: int, channel: SoftCompChannel | None) -> None:
        self._ctx = ctx
        self._lock = ctx._engine.lock
        self.cqe = cqe
        self.channel: SoftCompChannel | None = channel
        # entries: (wc, qp, qp generation, send-queue slots released when polled)
        self._q: deque[tuple[WC, SoftQP | None, int, int]] = deque()
        self._armed = _ARM_NONE
        self._overrun = False
        self._events_got = 0
        self._events_acked = 0
        self._qps: dict[SoftQP, int] = {}
        self._closed = False

    # --- producer side (device lock held) -------------------------------------------------
    def push(self, wc: WC, qp: SoftQP | None, gen: int, release: int,
             solicited: bool = False) -> None:
        if self._overrun or self._closed:
            return
        if len(self._q) >= self.cqe:
            self._overrun = True
            self._q.clear()
            self._ctx._post_async(AsyncEvent(EventType.CQ_ERR, cq=self))
            victims = list(self._qps)
            engine = self._ctx._engine

            def fail_qps() -> None:
                for q in victims:
                    q._to_error(None)

            engine.call_soon(fail_qps)
            return
        self._q.append((wc, qp, gen, release))
        armed = self._armed
        if armed and (armed == _ARM_ANY or solicited or wc.status != WCStatus.SUCCESS):
            self._armed = _ARM_NONE
            if self.channel is not None:
                self.channel._post(self)

    def _attach(self, qp: SoftQP) -> None:
        self._qps[qp] = self._qps.get(qp, 0) + 1

    def _detach(self, qp: SoftQP) -> None:
        n = self._qps.get(qp, 0) - 1
        if n <= 0:
            self._qps.pop(qp, None)
        else:
            self._qps[qp] = n

    # --- consumer side ---------------------------------------------------------------------
    def poll(self, n: int = 16) -> list[WC]:
        if not self._q:
            if self._overrun:
                raise CQOverrunError()
            # Yield the GIL once: a caller busy-polling in pure Python would otherwise keep
            # the NIC thread (which produces the completions) waiting for the GIL for a
            # whole switch interval (5 ms).
            time.sleep(0)
            if not self._q:
                return []
        out: list[WC] = []
        with self._lock:
            if self._overrun:
                raise CQOverrunError()
            q = self._q
            while q and len(out) < n:
                wc, qp, gen, release = q.popleft()
                if release and qp is not None and qp._gen == gen:
                    qp._sq_used -= release
                out.append(wc)
        return out

    def req_notify(self, solicited_only: bool = False) -> None:
        with self._lock:
            self._armed = _ARM_SOLICITED if solicited_only else _ARM_ANY

    def ack_events(self, n: int) -> None:
        with self._lock:
            self._events_acked = min(self._events_got, self._events_acked + n)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._qps:
                raise RDMAError(errno.EBUSY, f"CQ still used by {len(self._qps)} QP(s)")
            if self._events_acked < self._events_got:
                raise RDMAError(
                    errno.EBUSY,
                    f"CQ has {self._events_got - self._events_acked} unacknowledged "
                    "completion event(s); ack_events() them first (verbs would block)",
                )
            self._closed = True
            self._q.clear()
            if self.channel is not None:
                self.channel._forget(self)
                self.channel._ncqs -= 1
        self._ctx._children_changed(self, alive=False)

    def __repr__(self) -> str:
        return f"<SoftCQ cqe={self.cqe} queued={len(self._q)}>"
