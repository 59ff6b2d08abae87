"""The completion reactor: the only place where verbs completions meet the event loop.

One ``CQReactor`` per (device context, event loop). It owns completion queues, each
with its own completion channel (an event for a foreign CQ would be consumed and never
acknowledged otherwise), registers each channel's fd with ``loop.add_reader``, and
dispatches every work completion to the handler registered for its ``wr_id``.

Facts about completion channels that this loop relies on (verbs, and our ``soft``
provider, which copies them):

1. ``req_notify`` arms a CQ once. The next completion *added after arming* queues one
   event on the channel and disarms the CQ. Completions already in the CQ when it is
   armed do not produce an event. Hence the order on every wake-up: read events, ack,
   **re-arm, then poll until empty**. Polling before arming only would lose the
   completions that arrive between the last empty poll and the arm: nothing would wake
   us for them, and the program would hang. No timer papers over that here.
2. The channel fd is readable while at least one event is queued; reading an event
   (``get_event``) never blocks because the fd is non-blocking (EAGAIN ends the loop).
3. Every event must be acknowledged before its CQ is destroyed (ibv_destroy_cq blocks
   otherwise). Acks are batched: we count events per CQ and ack them once per wake-up
   (one mutex round-trip in libibverbs instead of one per event) and on close.
4. Spurious wake-ups are harmless: an event whose completions we already drained makes
   the poll return nothing.

The poll mode (``blocking``, ``hybrid``, ``polling``; ``AIORDMA_POLL_MODE``,
``AIORDMA_SPIN_US``) decides when the reactor polls besides its wake-ups and whether a
polled CQ is re-armed at once: ``poll_schedule.PollSchedule`` (``self.schedule``),
documented there.

Who receives each completion (a handler registered for its wr_id, or the message
engine of its QP) is ``wr_table.WRTable``'s (``self.wrs``); the reactor's
``register``/``unregister``/``unregister_owner``/``attach_engine``/``detach_engine``
are that table's, documented there. Exceptions raised by handlers go to the loop's
exception handler and never stop the dispatch of the other completions.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Final, TypeVar

from .errors import CQOverrunError, RDMAError
from .poll_schedule import DEFAULT_MODE, DEFAULT_SPIN_US, MODES, PollSchedule, poll_settings
from .protocol.engine import MessageEngine, poll_dispatch
from .verbs import CQ, WC, CompChannel, Context
from .wr_table import Handler, WRTable, future_handler

__all__ = ["CQReactor", "future_handler", "poll_settings", "MODES", "DEFAULT_MODE",
           "DEFAULT_SPIN_US", "Handler"]

T = TypeVar("T")

_POLL_BATCH: Final = 32
_ACK_BATCH: Final = 64


class _CQSlot:
    """One CQ, its channel, and the capacity reserved on it."""

    __slots__ = ("cq", "channel", "capacity", "reserved", "unacked", "fd", "progress_fd",
                 "progress", "flush_scheduled", "armed", "c_ops", "c_target", "get_event",
                 "req_notify", "flush")

    def __init__(self, cq: CQ, channel: CompChannel, capacity: int) -> None:
        self.cq = cq
        self.channel = channel
        self.capacity = capacity
        self.reserved = 0
        self.unacked = 0
        self.fd = channel.fd
        self.progress_fd = -1
        self.progress: Callable[..., int] | None = None
        self.flush_scheduled = False
        self.armed = False  # req_notify'd since its last event (see _arm_idle)
        # the calls of every wake-up, bound once (not looked up by name each time), the
        # provider's compiled ones where it has them
        self.get_event: Callable[[], CQ | None] = channel.event_reader()
        self.req_notify: Callable[[], None] = cq.notifier()
        # (a manual-progress device's: the work its progress deferred)
        self.flush: Callable[[], None] | None = (channel.flush if channel.manual_progress
                                                 else None)
        # its C-level poll (a capsule) and that poll's first argument, where the
        # provider has one
        ops = cq.c_ops()
        self.c_ops: Any = None if ops is None else ops[0]
        self.c_target: Any = None if ops is None else ops[1]


class CQReactor:
    """Completion dispatch for one device context on one event loop.

    Use ``CQReactor.for_context(ctx, loop)``; the reactor lives while any CQ it made is
    in use and is closed with ``close()`` (or by the last ``release_cq``).
    """

    _instances: ClassVar[weakref.WeakValueDictionary[tuple[int, int], CQReactor]] = (
        weakref.WeakValueDictionary())

    # the wr_id table's (``WRTable``), bound once in __init__
    register: Callable[[Handler, Any], int]
    unregister: Callable[[int], None]
    unregister_owner: Callable[[object], int]
    attach_engine: Callable[[int, MessageEngine], None]
    detach_engine: Callable[[int], None]

    def __init__(self, ctx: Context, loop: asyncio.AbstractEventLoop, *, mode: str | None = None,
                 spin_us: int | None = None, cq_size: int = 4096) -> None:
        self.ctx = ctx
        self.loop = loop
        self.schedule = PollSchedule(self, *poll_settings(mode, spin_us))
        self.cq_size = cq_size
        self._slots: list[_CQSlot] = []
        self.wrs = WRTable(self._handler_raised)
        self._engines = self.wrs.engines  # (poll_dispatch's, read per completion)
        self.register = self.wrs.register
        self.unregister = self.wrs.unregister
        self.unregister_owner = self.wrs.unregister_owner
        self.attach_engine = self.wrs.attach_engine
        self.detach_engine = self.wrs.detach_engine
        self.closed = False
        self._expedite = False
        self.dispatching = False  # a dispatch is on the stack (no in-place poll then)
        # statistics (the schedule keeps those of the spin and the in-place waits)
        self.wakeups = 0
        self.polls = 0
        self.arms = 0
        self.completions = 0
        # what every wake-up passes on, bound once (not a bound method made per call)
        self._dispatch_one_cb: Callable[[WC], None] = self.wrs.dispatch_one
        self._handler_raised_cb: Callable[[BaseException], None] = self._handler_raised
        self._flush_cb: Callable[[_CQSlot], None] = self._flush
        self._call_soon: Callable[..., Any] = loop.call_soon

    @classmethod
    def for_context(cls, ctx: Context, loop: asyncio.AbstractEventLoop | None = None,
                    **opts: Any) -> CQReactor:
        """The reactor of (ctx, loop), created on first use."""
        loop = loop or asyncio.get_running_loop()
        key = (id(ctx), id(loop))
        r = cls._instances.get(key)
        if r is None or r.closed:
            r = cls(ctx, loop, **opts)
            cls._instances[key] = r
        return r

    # -- CQ capacity ---------------------------------------------------------------
    def acquire_cq(self, entries: int) -> CQ:
        """A CQ with room for ``entries`` more outstanding completions (x2 headroom).

        The caller must never have more than ``entries`` WRs outstanding on it and must
        give the reservation back with ``release_cq(cq, entries)``.
        """
        if self.closed:
            raise RDMAError("reactor is closed")
        need = 2 * entries
        for slot in self._slots:
            if slot.capacity - slot.reserved >= need:
                slot.reserved += need
                return slot.cq
        capacity = max(self.cq_size, need)
        channel = self.ctx.create_comp_channel()
        # Manual progress (a provider capability, the soft device: CompChannel): this
        # thread moves the device's bytes when the channel's progress fd is readable.
        try:
            pfd = channel.start_progress() if channel.manual_progress else None
            cq = self.ctx.create_cq(capacity, channel)
        except BaseException:
            channel.close()
            raise
        slot = _CQSlot(cq, channel, capacity)
        slot.reserved = need
        self._slots.append(slot)
        cq.req_notify()
        slot.armed = True
        self.loop.add_reader(slot.fd, self._on_readable, slot)
        if pfd is not None and pfd >= 0:
            slot.progress_fd = pfd
            slot.progress = channel.progress
            self.loop.add_reader(pfd, self._on_progress, slot)
        self.schedule.cqs_changed(len(self._slots))
        return cq

    def release_cq(self, cq: CQ, entries: int) -> None:
        """Give back a reservation made by ``acquire_cq``."""
        for slot in self._slots:
            if slot.cq is cq:
                slot.reserved = max(0, slot.reserved - 2 * entries)
                return

    @property
    def outstanding(self) -> int:
        """How many registered wr_ids have not completed yet."""
        return self.wrs.outstanding()

    @property
    def in_use(self) -> bool:
        """True while some CQ capacity is reserved (an endpoint still has its QP)."""
        return any(slot.reserved for slot in self._slots)

    # -- the completion path ---------------------------------------------------------
    def _on_progress(self, slot: _CQSlot) -> None:
        """The provider has bytes to move (manual progress): move them here, then
        collect the events and completions they produced. Work the provider deferred
        (coalesced acknowledgements) is flushed after the callbacks this dispatch
        scheduled have run, so that it can ride on what the application sends (or at
        once, when a handler asked for it with ``expedite``)."""
        assert slot.progress is not None
        slot.progress(True)
        self._expedite = False
        self._on_readable(slot)
        if slot.channel.flush_wanted:
            if self._expedite and slot.flush is not None:
                slot.flush()
            elif not slot.flush_scheduled:
                slot.flush_scheduled = True
                self._call_soon(self._flush_cb, slot)

    def expedite(self) -> None:
        """Called by a completion handler: the application will not answer what it was
        just given right away (e.g. a burst of messages to consume), so deferred
        provider work (coalesced acknowledgements the peer waits for) is flushed as
        soon as this dispatch ends instead of after the loop's callbacks."""
        self._expedite = True

    def _flush(self, slot: _CQSlot) -> None:
        slot.flush_scheduled = False
        if not self.closed and slot.flush is not None:
            slot.flush()

    def _on_readable(self, slot: _CQSlot) -> None:
        """One wake-up: read the event, ack (batched), re-arm, then poll until a poll
        comes back short -- the CQ was empty at that moment and is armed, so whatever
        arrives later queues an event (fact 1). One ``get_event``: the CQ is armed once
        per wake-up, so it queues at most one event; if another is queued, the fd stays
        readable and the loop calls again. (Per wake-up that is one event read, one arm
        and usually one poll; polling before arming too cost a second poll and a failed
        read, each a system call or a pyverbs call on a real device.)

        hybrid, while it may spin, and polling arm *lazily*: a polled CQ (no manual
        progress) is left disarmed after its event and drained; the spin (the poll loop)
        that follows polls it, and it is armed (then drained once more) only when that
        ends (``arm_idle``). Meanwhile its completions cost no event: no arm and no
        event read here, and no event for the device to raise (in a pyverbs-only
        ping-pong on rxe, re-arming after every poll doubled the peer's
        ``ibv_post_send``)."""
        self.wakeups += 1
        schedule = self.schedule
        schedule.woke()
        if slot.get_event() is not None:
            slot.armed = False  # an event disarms the CQ
            slot.unacked += 1
            if slot.unacked >= _ACK_BATCH:
                slot.cq.ack_events(slot.unacked)
                slot.unacked = 0
        if not (slot.progress is None and schedule.arms_lazily()):
            self._arm(slot)  # (else it stays disarmed: the spin or the poll loop polls it,
            #                   and arm_idle arms it when that ends)
        self._drain(slot, until_empty=False)
        schedule.poke()

    def _arm(self, slot: _CQSlot) -> None:
        slot.req_notify()
        slot.armed = True
        self.arms += 1

    def arm_idle(self) -> int:
        """The spin ends: arm every polled CQ that the spin left disarmed, then drain it
        (what arrived before the arm raised no event). Returns the completions found;
        afterwards every CQ is armed and was empty when last polled."""
        found = 0
        for slot in self._slots:
            if not slot.armed:
                self._arm(slot)
                found += self._drain(slot, until_empty=False)
        return found

    def drain_polled(self) -> int:
        """Drain every CQ without manual progress (the spin's tick: the loop's own poll
        sees the others' fds); returns the completions found."""
        found = 0
        for slot in self._slots:
            if slot.progress is None:
                found += self._drain(slot)
        return found

    def progress_and_drain(self, until_empty: bool) -> None:
        """Move every manual-progress device's bytes, then drain every CQ (``_drain``'s
        ``until_empty``): a poll tick and an in-place wait."""
        for slot in self._slots:
            if slot.progress is not None:
                slot.progress(False)
            self._drain(slot, until_empty)

    def _drain(self, slot: _CQSlot, until_empty: bool = True) -> int:
        """Dispatch what the CQ holds. ``until_empty=False`` (after arming): stop after a
        short batch instead of polling once more (a poll returns fewer than asked only
        when the CQ is empty)."""
        total = 0
        if slot.c_ops is not None:
            return self._drain_c(slot, until_empty)
        poll = slot.cq.poll
        while True:
            self.polls += 1
            try:
                wcs = poll(_POLL_BATCH)
            except CQOverrunError as exc:
                self._fail_all(exc)
                return total
            if not wcs:
                return total
            total += len(wcs)
            self._dispatch(wcs)
            if not until_empty and len(wcs) < _POLL_BATCH:
                return total

    def _drain_c(self, slot: _CQSlot, until_empty: bool) -> int:
        """``_drain`` through the CQ's C-level poll: the engines' completions are
        dispatched in C (``poll_dispatch``), any other one as a ``WC``."""
        total = 0
        self.dispatching = True
        try:
            while True:
                self.polls += 1
                try:
                    n = poll_dispatch(slot.c_target, slot.c_ops, self._engines, _POLL_BATCH,
                                      self._dispatch_one_cb, self._handler_raised_cb)
                except CQOverrunError as exc:
                    self._fail_all(exc)
                    return total
                if not n:
                    return total
                total += n
                self.completions += n
                if not until_empty and n < _POLL_BATCH:
                    return total
        finally:
            self.dispatching = False

    def drain_cq(self, cq: CQ) -> int:
        """Poll ``cq`` until empty now, dispatching what it holds; returns the count."""
        for slot in self._slots:
            if slot.cq is cq:
                return self._drain(slot)
        return 0

    def _dispatch(self, wcs: list[WC]) -> None:
        self.completions += len(wcs)
        self.dispatching = True
        try:
            self.wrs.dispatch(wcs)
        finally:
            self.dispatching = False

    def _handler_raised(self, exc: BaseException) -> None:
        self.loop.call_exception_handler({
            "message": "aiordma: completion handler raised",
            "exception": exc,
        })

    # -- the poll mode (poll_schedule.py) -----------------------------------------------
    @property
    def pokes_after_post(self) -> bool:
        """Whether ``poke()`` after a post does anything in this poll mode (it does
        nothing in ``blocking``)."""
        return self.schedule.hybrid or self.schedule.polling

    @property
    def mode(self) -> str:
        """``blocking``, ``hybrid`` or ``polling``."""
        return self.schedule.mode

    @property
    def spin_us(self) -> int:
        """The spin budget (0 in ``blocking``)."""
        return self.schedule.spin_us

    @property
    def in_place(self) -> bool:
        """True where operations wait in place (``PollSchedule.wait``)."""
        return self.schedule.in_place

    @property
    def waits(self) -> bool:
        """True in ``polling`` mode: operations are awaited through ``wait``, which
        waits in place where it can and keeps the poll ticks going while it is
        suspended."""
        return self.schedule.polling

    def wait(self, fut: asyncio.Future[T], spin: bool = True) -> Coroutine[Any, Any, T]:
        """``PollSchedule.wait``: to await; returns or raises what ``await fut`` does."""
        return self.schedule.wait(fut, spin)

    def wait_in_place(self, fut: asyncio.Future[Any]) -> bool:
        """``PollSchedule.wait_in_place``."""
        return self.schedule.wait_in_place(fut)

    def poke(self) -> None:
        """Called after posting work (``PollSchedule.poke``)."""
        self.schedule.poke()

    def _fail_all(self, exc: BaseException) -> None:
        """CQ overrun: completions are lost; fail every waiter (never expected)."""
        self.wrs.fail_all()
        self.loop.call_exception_handler({"message": "aiordma: CQ overrun", "exception": exc})

    # -- lifecycle -------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Counters: wakeups, spins, spin_hits (completions a spin caught), spin_preempted
        and spin_missed (spins ended by preemption, or run out without a completion),
        quiet_periods (hybrid's and the in-place waits' back-offs), polls, arms (re-arms
        after the first), completions, completions per wake-up, outstanding WRs, CQs,
        mode and spin budget, and polling's in_place_waits, in_place_hits (the future
        was done when the wait returned), in_place_missed (waits that ran out their
        whole budget) and in_place_budget_us (the budget now: it follows the peer's
        turnaround, poll_schedule.py)."""
        return {
            **self.schedule.statistics(),
            "wakeups": self.wakeups,
            "polls": self.polls,
            "arms": self.arms,
            "completions": self.completions,
            "completions_per_wakeup": self.completions / self.wakeups if self.wakeups else 0.0,
            "outstanding": self.wrs.outstanding(),
            "cqs": len(self._slots),
            "unknown_wr_ids": self.wrs.unknown_wr_ids,
        }

    def ack_pending(self) -> None:
        """Acknowledge every event read and not yet acknowledged (acks are batched).
        ``Device`` calls it at interpreter exit for reactors still open: the garbage
        collector's ibv_destroy_cq would block forever on unacknowledged events."""
        for slot in self._slots:
            if slot.unacked:
                slot.cq.ack_events(slot.unacked)
                slot.unacked = 0

    def close(self) -> None:
        """Remove the readers, ack every event, destroy CQs then channels. Idempotent.

        Pending handlers are dropped: callers close their QPs (and collect the flush)
        before closing the reactor.
        """
        if self.closed:
            return
        self.closed = True
        for slot in self._slots:
            if not self.loop.is_closed():
                self.loop.remove_reader(slot.fd)
                if slot.progress_fd >= 0:
                    self.loop.remove_reader(slot.progress_fd)
            while slot.channel.get_event() is not None:
                slot.unacked += 1
        self.ack_pending()
        for slot in self._slots:
            slot.cq.close()
            slot.channel.close()
        self._slots.clear()
        self.schedule.cqs_changed(0)
        self.wrs.clear()

    def __repr__(self) -> str:
        return (f"<CQReactor {self.ctx.name} mode={self.mode} spin_us={self.spin_us} "
                f"cqs={len(self._slots)} outstanding={self.wrs.outstanding()}>")
