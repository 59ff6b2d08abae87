"""Completion queues and completion channels of the soft device.

Producers (the NIC thread, or a caller's thread posting to a QP in ERR) call
``SoftCQ.push`` with the device lock held. ``poll`` takes the lock only when the queue
is non-empty, so an idle busy-poll costs no lock traffic.

Manual progress
---------------
By default the NIC thread moves every byte: it reads the sockets, executes requests,
pushes completions and raises the channel's pipe; the application's thread then wakes
up, takes the GIL from the NIC thread and polls. Each message costs two thread
wake-ups and GIL hand-offs. ``SoftCompChannel.start_progress()`` (called by the
reactor on the event loop's thread) switches a channel to *manual progress*, as
libfabric calls it: the sockets of the QPs whose CQs use the channel (created or bound
after the call) go into the channel's own epoll set, whose fd the loop watches next
to the channel fd; ``progress()`` -- called by the loop on that fd's readiness and
while it busy-polls -- reads them on the loop's thread, so the wake-up that
delivers the bytes also delivers the completions, with no thread hand-off and no pipe
write. The one-sided guarantee (a target serves READ/WRITE/atomics without its
application) is kept by the NIC thread's watchdog: when a channel's sockets stay
readable for two watchdog ticks (``engine.WATCHDOG_S``) without a ``progress`` call
(the loop is blocked or gone), the NIC thread takes the channel over until the
application polls again.
"""

from __future__ import annotations

import errno
import select
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Final

from ...errors import CQOverrunError, RDMAError
from ..api import CQ, AsyncEvent, CompChannel
from ..contract import check_cq_close
from ..enums import EventType, WCStatus
from ..wr import WC
from .conn import OPEN
from .notify import PipeFlag

# Enum members and library functions the per-packet path uses, as module constants:
# compiled, each is a C static, where ``QPState.RTS`` or ``time.monotonic`` is an
# attribute lookup per use.
_EV_CQ_ERR: Final = EventType.CQ_ERR
_WC_SUCCESS: Final = WCStatus.SUCCESS
_get_ident: Final = threading.get_ident

if TYPE_CHECKING:
    from .conn import Conn
    from .context import SoftContext
    from .qpcore import QPCore as SoftQP

_EPOLLIN: Final = select.EPOLLIN
_EPOLLOUT: Final = select.EPOLLOUT
_EPOLL_IN_ERR: Final = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP

_ARM_NONE: Final = 0
_ARM_ANY: Final = 1
_ARM_SOLICITED: Final = 2


class SoftCompChannel(CompChannel):
    """The soft device's completion channel: manual progress (``CompChannel``) is what
    lets the event loop's own wake-up move the device's bytes."""

    manual_progress = True

    def __init__(self, ctx: SoftContext) -> None:
        self._ctx = ctx
        self._lock = ctx._engine.lock
        self._flag = PipeFlag()
        self.fd = self._flag.fd
        self._events: deque[SoftCQ] = deque()
        self._ncqs = 0
        self._closed = False
        # manual progress (start_progress)
        self._ep: select.epoll | None = None
        self.progress_fd = -1
        self._conns: dict[int, Conn] = {}  # fd -> connection driven by this channel
        self._consumer = 0  # thread id of the poller (the event loop)
        self._quiet = False  # in progress(quiet=True): events need no pipe write
        self._serviced = 0  # progress() calls by the consumer (the watchdog's clock)
        self._seen = -1  # _serviced at the watchdog's last tick
        self._suspect = False
        self.takeover = False  # the NIC thread drives the sockets (consumer stalled)
        self._acks: set[Any] = set()  # QPs whose coalesced ACK waits for flush()

    def _post(self, cq: SoftCQ) -> None:
        """Queue an event for ``cq`` (device lock held)."""
        self._events.append(cq)
        if not (self._quiet and _get_ident() == self._consumer):
            self._flag.raise_()

    # --- manual progress -----------------------------------------------------------------
    def start_progress(self) -> int:
        """Switch to manual progress driven by the calling thread; returns the fd to
        watch (readable when ``progress()`` has work). Idempotent."""
        with self._lock:
            if self._closed:
                raise RDMAError(errno.EBADF, "completion channel is closed")
            if self._ep is None:
                self._ep = select.epoll()
                self.progress_fd = self._ep.fileno()
                self._ctx._engine.add_progress_channel(self)
            self._consumer = _get_ident()
            return self.progress_fd

    @property
    def manual(self) -> bool:
        return self._ep is not None and not self._closed

    def _set_interest(self, conn: Conn, ev: int) -> None:
        """Register ``conn``'s socket for ``ev`` (selectors.EVENT_* bits) in our epoll
        set; 0 removes it. Lock held, any thread."""
        ep = self._ep
        sock = conn.sock
        if ep is None or sock is None:
            return
        fd = sock.fileno()
        if fd < 0:
            return
        mask = (_EPOLLIN if ev & 1 else 0) | (_EPOLLOUT if ev & 2 else 0)
        try:
            if not mask:
                if self._conns.pop(fd, None) is not None:
                    ep.unregister(fd)
            elif fd in self._conns:
                ep.modify(fd, mask)
            else:
                ep.register(fd, mask)
                self._conns[fd] = conn
        except OSError:  # pragma: no cover - closed under us
            self._conns.pop(fd, None)

    def progress(self, quiet: bool = False) -> int:
        """Move the bytes of every ready connection of this channel (reads, requests,
        responses, completions, flushing queued output); returns the number of ready
        sockets. Never blocks. ``quiet``: the caller reads every event with
        ``get_event()`` right after, so events queued meanwhile need no pipe write."""
        ep = self._ep
        if ep is None:
            return 0
        me = _get_ident()
        if me == self._consumer:
            self._serviced += 1
            if self.takeover:
                self._ctx._engine.call_soon(self._end_takeover)
        conns = self._conns
        if quiet and me == self._consumer and len(conns) == 1 and not self.takeover:
            # The loop saw our fd readable and one connection is all there is (the
            # usual case): read it without asking the epoll set which socket is ready
            # (one syscall less per wake-up). Writes pending or a connect in progress
            # take the general path, which tells readable and writable apart.
            try:
                (conn,) = list(conns.values())  # atomic under the GIL
            except ValueError:  # changed under us: the general path
                conn = None
            if conn is not None and conn.state == OPEN and not conn.want_write:
                self._quiet = True
                try:
                    if conn.reading:
                        conn.on_readable()
                finally:
                    self._quiet = False
                return 1
        try:
            ready = ep.poll(0)
        except OSError:  # closed
            return 0
        if not ready:
            return 0
        lock = self._lock
        if quiet and me == self._consumer:
            self._quiet = True
        try:
            for fd, mask in ready:
                conn = conns.get(fd)
                if conn is None:
                    continue
                if mask & _EPOLLOUT:
                    with lock:
                        conn._on_writable()
                if mask & _EPOLL_IN_ERR and conn.reading:
                    conn.on_readable()
        finally:
            self._quiet = False
        return len(ready)

    def defer_ack(self, qp: Any) -> bool:
        """Lock held. Inside the consumer's ``progress(quiet=True)``: keep ``qp``'s ACK
        for ``flush()`` -- the application usually answers first, and the ACK then
        rides in the same write as the answer -- and return True."""
        if self._quiet and _get_ident() == self._consumer:
            self._acks.add(qp)
            return True
        return False

    def ack_sent(self, qp: Any) -> None:
        """Lock held: ``qp``'s deferred ACK went out with other traffic."""
        self._acks.discard(qp)

    @property
    def flush_wanted(self) -> bool:
        """True when ``flush()`` has deferred work (the caller runs it once the
        application has reacted to what ``progress()`` delivered)."""
        return bool(self._acks)

    def flush(self) -> None:
        """Send the deferred ACKs that nothing carried meanwhile."""
        if not self._acks:
            return
        with self._lock:
            acks, self._acks = self._acks, set()
            for qp in acks:
                qp._flush_ack()

    def _watchdog(self) -> bool:
        """NIC thread, lock held, every WATCHDOG_S: True when the consumer has not
        called ``progress`` while our sockets stayed ready for two ticks."""
        if self.takeover or self._ep is None or not self._conns:
            self._suspect = False
            return False
        serviced = self._serviced != self._seen
        self._seen = self._serviced
        if serviced:
            self._suspect = False
            return False
        if self._acks:  # deferred ACKs the stalled consumer never flushed
            acks, self._acks = self._acks, set()
            for qp in acks:
                qp._flush_ack()
        try:
            ready = bool(self._ep.poll(0))
        except OSError:  # pragma: no cover
            return False
        if not ready:
            self._suspect = False
            return False
        if not self._suspect:
            self._suspect = True
            return False
        self._suspect = False
        return True

    def _end_takeover(self) -> None:
        """NIC thread, lock held: the consumer polls again."""
        if self.takeover:
            self.takeover = False
            self._ctx._engine.end_takeover(self)

    def _forget(self, cq: SoftCQ) -> None:
        """Drop the not-yet-read events of a destroyed CQ (device lock held)."""
        if cq in self._events:
            self._events = deque(c for c in self._events if c is not cq)
            if not self._events:
                self._flag.lower()

    def get_event(self) -> SoftCQ | None:
        if not self._events:  # producers append under the lock and raise the fd after
            return None
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
            ep, self._ep = self._ep, None
            if ep is not None:
                engine = self._ctx._engine
                engine.remove_progress_channel(self)
                for conn in list(self._conns.values()):
                    # a closing connection (its QP is gone) lingers on the NIC thread
                    conn.driver = None
                    conn._sel_events = 0
                    engine.call_soon(conn._update_sel)
                self._conns.clear()
        if ep is not None:
            ep.close()
        self._flag.close()
        self._ctx._children_changed(self, alive=False)

    def __repr__(self) -> str:
        return f"<SoftCompChannel fd={self.fd}>"


class SoftCQ(CQ):
    cqe: int  # (its own attribute when compiled, as SoftMR's)

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
            self._ctx._post_async(AsyncEvent(_EV_CQ_ERR, cq=self))
            victims = list(self._qps)
            engine = self._ctx._engine

            def fail_qps() -> None:
                for q in victims:
                    q._to_error(None)

            engine.call_soon(fail_qps)
            return
        self._q.append((wc, qp, gen, release))
        armed = self._armed
        if armed and (armed == _ARM_ANY or solicited or wc.status != _WC_SUCCESS):
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
            ch = self.channel
            if ch is not None and ch._ep is not None and _get_ident() == ch._consumer:
                return []  # manual progress: the consumer calls progress() to move bytes
            # Yield the GIL once: a caller busy-polling in pure Python would otherwise
            # keep the NIC thread (which produces the completions) waiting for the GIL
            # for a whole switch interval (5 ms).
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
        # One attribute store, atomic under the GIL: a producer (lock held) sees the CQ
        # armed or not; a completion it adds just before is caught by the drain that
        # follows every arming (verbs semantics), one after fires the event.
        self._armed = _ARM_SOLICITED if solicited_only else _ARM_ANY

    def ack_events(self, n: int) -> None:
        with self._lock:
            self._events_acked = min(self._events_got, self._events_acked + n)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            check_cq_close(len(self._qps), self._events_got, self._events_acked)
            self._closed = True
            self._q.clear()
            if self.channel is not None:
                self.channel._forget(self)
                self.channel._ncqs -= 1
        self._ctx._children_changed(self, alive=False)

    def __repr__(self) -> str:
        return f"<SoftCQ cqe={self.cqe} queued={len(self._q)}>"
