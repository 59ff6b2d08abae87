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

Poll policy (``AIORDMA_POLL_MODE``, ``AIORDMA_SPIN_US``):

* ``blocking``: after draining, arm and return to the loop (spin 0). The least CPU
  when nothing is waiting for an answer; every completion costs a wake-up.
* ``hybrid`` (default; ``spin_us`` default 300): after a wake-up or a post, keep the *loop* from
  sleeping for ``spin_us`` microseconds (extended by every completion found): a
  callback re-scheduled with ``call_soon`` polls the CQs (providers with manual progress
  need no poll: the loop's own zero-timeout poll of every iteration sees their fd), so
  the tasks that the completions woke run between polls -- a spin *inside* one callback
  would hold them back until the budget is spent. A polled CQ is armed *lazily*: after
  its event it stays disarmed while the spin polls it (its completions then raise no
  event: no event read and no re-arm per completion, and less work for the device),
  and the tick that ends the spin arms it and polls it once more (fact 1), so nothing
  is lost. The spin costs CPU only for ``spin_us`` after the last activity. The
  spin must outlast the peer's turnaround to save its wake-up.

  The spin adapts (``spin_policy.SpinGovernor``): it goes *quiet* (behaves as
  ``blocking``) for a back-off time when it was preempted (the cores are
  oversubscribed) or missed ``MISS_LIMIT`` times in a row. ``statistics()`` counts
  ``spin_preempted``, ``spin_missed`` and ``quiet_periods``.

  Why it is the default: on free cores it saves the wake-up of a sleeping process,
  which costs more than the spin, and a spin that does not adapt falls off a cliff
  when the cores are shared (each side spins out its budget while the other waits for
  a core); docs/benchmarks.md, "Poll mode", has the measurements.
* ``polling``: while operations are outstanding, poll once per loop iteration
  (``call_soon``), never arming; when nothing is outstanding, arm and block. (A polled
  CQ's event is read and it is left disarmed, as in ``hybrid``'s spin; the tick that
  finds nothing outstanding arms it and polls it once more.)

  And it **waits in place** (``wait_in_place``, like a socket's ``SO_BUSY_POLL``): an
  endpoint about to suspend a task on an operation's future first polls the CQs itself,
  in the task, for up to ``spin_us``, dispatching what it finds -- when no other task
  is suspended on an operation of this reactor (``wait`` counts them): one that is
  may be ready to run (uvloop does not show its ready queue), or be woken by what the
  poll finds, and must not wait behind the hold. So a window of concurrent
  operations, or a peer on the same loop, never waits in place. When its own
  completion comes in that time the future is done and the ``await`` does not suspend:
  no task switch and no loop iteration (its ``epoll_wait``) for that operation. The
  loop is held meanwhile, so the holds are bounded: **in-place waits stop polling once
  they have held the loop for** ``spin_us`` **in all since its last iteration** (a
  marker callback scheduled with the first hold notes each iteration; the handlers a
  poll dispatched finish first); past that, tasks suspend as usual until the loop has
  turned. A wait that runs out its whole budget is a miss, counted as in
  ``hybrid``: ``MISS_LIMIT`` in a row make the waits quiet for a back-off (the peer
  answers slower than the budget, or it shares this process's loop and cannot answer
  while the loop is held). A CQ with manual progress (``soft``) has its bytes moved
  first, as the poll loop does. Never from inside a dispatch (an eager task started
  by a completion handler): that would reorder completions. ``statistics()`` counts
  ``in_place_waits``, ``in_place_hits`` and ``in_place_missed``.

Handlers: ``register(handler, arg) -> wr_id`` stores ``(handler, arg)`` under a
counter-generated wr_id; the completion calls ``handler(wc, arg)`` exactly once, on
the loop thread, in CQ order. ``arg`` keeps the operation's buffers alive until then,
even when the awaiting task was cancelled (``future_handler`` drops the result of a
cancelled future quietly). Exceptions raised by handlers go to the loop's exception
handler and never stop the dispatch of the other completions.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Final, TypeVar

from .errors import CQOverrunError, RDMAError, completion_error
from .spin_policy import PREEMPT_GAP_S, SpinGovernor
from .verbs import CQ, WC, CompChannel, Context, WCStatus

Handler = Callable[[WC, Any], None]
T = TypeVar("T")

MODES: Final = ("blocking", "hybrid", "polling")
DEFAULT_MODE: Final = "hybrid"
DEFAULT_SPIN_US: Final = 300
_POLL_BATCH: Final = 32
_ACK_BATCH: Final = 64


def poll_settings(mode: str | None = None, spin_us: int | None = None) -> tuple[str, int]:
    """Resolve (mode, spin_us) from arguments, then environment, then defaults.

    Raises ValueError for an unknown mode or a negative spin.
    """
    mode = mode or os.environ.get("AIORDMA_POLL_MODE") or DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"poll mode must be one of {', '.join(MODES)}, not {mode!r}")
    if spin_us is None:
        env = os.environ.get("AIORDMA_SPIN_US")
        spin_us = int(env) if env else DEFAULT_SPIN_US
    if spin_us < 0:
        raise ValueError("spin_us must be >= 0")
    if mode == "blocking":
        spin_us = 0
    return mode, spin_us


class _CQSlot:
    """One CQ, its channel, and the capacity reserved on it."""

    __slots__ = ("cq", "channel", "capacity", "reserved", "unacked", "fd", "progress_fd",
                 "progress", "flush_scheduled", "armed")

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


def future_handler(wc: WC, fut: asyncio.Future[WC]) -> None:
    """A handler resolving ``fut`` with the WC, or with the typed CompletionError.

    A future that is already done (cancelled) is left alone: the completion is
    dropped quietly, its buffers are released with the table entry.
    """
    if fut.done():
        return
    if wc.status == WCStatus.SUCCESS:
        fut.set_result(wc)
    else:
        fut.set_exception(completion_error(wc.status, vendor_err=wc.vendor_err,
                                           wr_id=wc.wr_id, opcode=wc.opcode))


class CQReactor:
    """Completion dispatch for one device context on one event loop.

    Use ``CQReactor.for_context(ctx, loop)``; the reactor lives while any CQ it made is
    in use and is closed with ``close()`` (or by the last ``release_cq``).
    """

    _instances: ClassVar[weakref.WeakValueDictionary[tuple[int, int], CQReactor]] = (
        weakref.WeakValueDictionary())

    def __init__(self, ctx: Context, loop: asyncio.AbstractEventLoop, *, mode: str | None = None,
                 spin_us: int | None = None, cq_size: int = 4096) -> None:
        self.ctx = ctx
        self.loop = loop
        self.mode, self.spin_us = poll_settings(mode, spin_us)
        self.cq_size = cq_size
        self._slots: list[_CQSlot] = []
        self._table: dict[int, tuple[Handler, Any]] = {}
        self._next_wr_id = 1
        self._closed = False
        self._poll_scheduled = False
        self._spin_scheduled = False
        self._spin_deadline = 0.0
        self._spin_last = 0.0  # time of the spin's last tick
        self._spin_hit = False  # a completion arrived during this spin
        self.spin = SpinGovernor()  # when the spin (and the in-place wait) goes quiet
        self._expedite = False
        self._dispatching = False  # a dispatch is on the stack (no in-place poll then)
        self.in_place = False  # polling mode, a spin budget and a CQ to poll in place
        self.suspended = 0  # tasks suspended in ``wait`` (they may be ready to run)
        self._held_since = -1.0  # in-place waits hold the loop since (-1: it has turned)
        # statistics
        self.in_place_waits = 0
        self.in_place_hits = 0
        self.in_place_missed = 0
        self.wakeups = 0
        self.spins = 0
        self.spin_preempted = 0
        self.spin_missed = 0
        self.polls = 0
        self.arms = 0
        self.completions = 0
        self.spin_hits = 0
        self.unknown_wr_ids = 0

    @classmethod
    def for_context(cls, ctx: Context, loop: asyncio.AbstractEventLoop | None = None,
                    **opts: Any) -> CQReactor:
        """The reactor of (ctx, loop), created on first use."""
        loop = loop or asyncio.get_running_loop()
        key = (id(ctx), id(loop))
        r = cls._instances.get(key)
        if r is None or r._closed:
            r = cls(ctx, loop, **opts)
            cls._instances[key] = r
        return r

    # -- CQ capacity ---------------------------------------------------------------
    def acquire_cq(self, entries: int) -> CQ:
        """A CQ with room for ``entries`` more outstanding completions (x2 headroom).

        The caller must never have more than ``entries`` WRs outstanding on it and must
        give the reservation back with ``release_cq(cq, entries)``.
        """
        if self._closed:
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
        self.in_place = self.mode == "polling" and self.spin_us > 0
        return cq

    def release_cq(self, cq: CQ, entries: int) -> None:
        """Give back a reservation made by ``acquire_cq``."""
        for slot in self._slots:
            if slot.cq is cq:
                slot.reserved = max(0, slot.reserved - 2 * entries)
                return

    # -- wr_id table ---------------------------------------------------------------
    def register(self, handler: Handler, arg: Any) -> int:
        """A new wr_id whose completion will call ``handler(wc, arg)`` once."""
        wr_id = self._next_wr_id
        self._next_wr_id = wr_id + 1
        self._table[wr_id] = (handler, arg)
        return wr_id

    def unregister(self, wr_id: int) -> None:
        """Forget a wr_id that was never posted (post refused)."""
        self._table.pop(wr_id, None)

    def unregister_owner(self, owner: object) -> int:
        """Forget every wr_id whose handler is a method of ``owner`` (an endpoint that
        destroys its QP before its flush completions arrived). Returns how many; O(table)."""
        mine = [w for w, (h, _a) in self._table.items() if getattr(h, "__self__", None) is owner]
        for wr_id in mine:
            del self._table[wr_id]
        return len(mine)

    @property
    def outstanding(self) -> int:
        return len(self._table)

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
        if slot.channel.flush_wanted:  # type: ignore[attr-defined]
            if self._expedite:
                slot.channel.flush()  # type: ignore[attr-defined]
            elif not slot.flush_scheduled:
                slot.flush_scheduled = True
                self.loop.call_soon(self._flush, slot)

    def expedite(self) -> None:
        """Called by a completion handler: the application will not answer what it was
        just given right away (e.g. a burst of messages to consume), so deferred
        provider work (coalesced acknowledgements the peer waits for) is flushed as
        soon as this dispatch ends instead of after the loop's callbacks."""
        self._expedite = True

    def _flush(self, slot: _CQSlot) -> None:
        slot.flush_scheduled = False
        if not self._closed:
            slot.channel.flush()  # type: ignore[attr-defined]

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
        ends (``_arm_idle``). Meanwhile its completions cost no event: no arm and no
        event read here, and no event for the device to raise (in a pyverbs-only
        ping-pong on rxe, re-arming after every poll doubled the peer's
        ``ibv_post_send``)."""
        self.wakeups += 1
        if self._spin_scheduled:  # the spin saved this wake-up's sleep
            self._spin_hit = True
            self.spin_hits += 1
        if slot.channel.get_event() is not None:
            slot.armed = False  # an event disarms the CQ
            slot.unacked += 1
            if slot.unacked >= _ACK_BATCH:
                slot.cq.ack_events(slot.unacked)
                slot.unacked = 0
        hybrid = self.mode == "hybrid" and self.spin_us > 0
        polling = self.mode == "polling"
        if not (slot.progress is None and (
                polling or (hybrid and time.perf_counter() >= self.spin.quiet_until))):
            self._arm(slot)  # (else it stays disarmed: the spin or the poll loop polls it,
            #                   and _arm_idle arms it when that ends)
        self._drain(slot, until_empty=False)
        if hybrid:
            self._spin_from_now()
        elif polling:
            self._schedule_poll()

    def _arm(self, slot: _CQSlot) -> None:
        slot.cq.req_notify()
        slot.armed = True
        self.arms += 1

    def _arm_idle(self) -> int:
        """The spin ends: arm every polled CQ that the spin left disarmed, then drain it
        (what arrived before the arm raised no event). Returns the completions found;
        afterwards every CQ is armed and was empty when last polled."""
        found = 0
        for slot in self._slots:
            if not slot.armed:
                self._arm(slot)
                found += self._drain(slot, until_empty=False)
        return found

    def _drain(self, slot: _CQSlot, until_empty: bool = True) -> int:
        """Dispatch what the CQ holds. ``until_empty=False`` (after arming): stop after a
        short batch instead of polling once more (a poll returns fewer than asked only
        when the CQ is empty)."""
        total = 0
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

    def drain_cq(self, cq: CQ) -> int:
        """Poll ``cq`` until empty now, dispatching what it holds; returns the count."""
        for slot in self._slots:
            if slot.cq is cq:
                return self._drain(slot)
        return 0

    def _dispatch(self, wcs: list[WC]) -> None:
        table = self._table
        self.completions += len(wcs)
        self._dispatching = True
        try:
            for wc in wcs:
                entry = table.pop(wc.wr_id, None)
                if entry is None:
                    self.unknown_wr_ids += 1
                    continue
                try:
                    entry[0](wc, entry[1])
                except Exception as exc:  # a bug in a handler must not stop the dispatch
                    self.loop.call_exception_handler({
                        "message": "aiordma: completion handler raised",
                        "exception": exc,
                    })
        finally:
            self._dispatching = False

    async def wait(self, fut: asyncio.Future[T], spin: bool = True) -> T:
        """``await fut``, in polling mode (``in_place``): first ``wait_in_place(fut)``
        (unless ``spin`` is false: the completion needs the loop first, e.g. an
        operation not posted yet), and counted in ``suspended`` while the task is
        suspended. Returns or raises what ``await fut`` does; cancellation too."""
        if spin and self.wait_in_place(fut):
            return fut.result()
        self.suspended += 1
        try:
            return await fut
        finally:
            self.suspended -= 1

    def wait_in_place(self, fut: asyncio.Future[Any]) -> bool:
        """polling mode: poll the CQs here, dispatching their completions, until ``fut``
        is done or the in-place budget is spent (see the module docstring); returns
        ``fut.done()``. Called by a task just before it awaits ``fut``; it never
        suspends, never raises what a handler raises (the loop's exception handler gets
        it, as in every dispatch), and does nothing (returns at once) when the mode does
        not wait in place, another task is suspended in ``wait`` (it may be ready to run,
        or be woken by what this poll finds), the waits are quiet, the loop has been
        held for ``spin_us`` since its last iteration, or a dispatch is on the stack.
        """
        if fut.done():
            return True
        if not self.in_place or self.suspended or self._dispatching or self._closed:
            return False
        now = time.perf_counter()
        if now < self.spin.quiet_until:
            return False
        budget = self.spin_us * 1e-6
        held = self._held_since
        whole = held < 0.0  # the loop has turned: this wait has the whole budget
        if whole:
            self._held_since = held = now
            self.loop.call_soon(self._loop_turned)
        deadline = held + budget
        if now >= deadline:
            return False
        self.in_place_waits += 1
        slots = self._slots
        drain = self._drain
        while True:
            for slot in slots:
                if slot.progress is not None:
                    slot.progress(False)
                drain(slot, False)  # a short batch: look at fut before polling again
            if fut.done():
                self.in_place_hits += 1
                self.spin.hit()
                return True
            if self._closed or time.perf_counter() >= deadline:
                break
        if whole:  # it ran out its whole budget: a miss
            self.in_place_missed += 1
            self.spin.missed(time.perf_counter())
        return False

    def _loop_turned(self) -> None:
        self._held_since = -1.0

    def _spin_from_now(self) -> None:
        """hybrid: keep the loop polling for ``spin_us`` from now (unless quiet)."""
        now = time.perf_counter()
        if now < self.spin.quiet_until:
            return
        self._spin_deadline = now + self.spin_us * 1e-6
        if not self._spin_scheduled and not self._closed:
            self._spin_scheduled = True
            self._spin_last = now
            self._spin_hit = False
            self.spin.start(now)
            self.spins += 1
            self.loop.call_soon(self._spin_tick)

    def _spin_tick(self) -> None:
        self._spin_scheduled = False
        if self._closed:
            return
        now = time.perf_counter()
        if now - self._spin_last > PREEMPT_GAP_S and self.spin.preempted(now):
            self.spin_preempted += 1
            self.spin.go_quiet(now)
            self._arm_idle()
            return
        found = 0
        for slot in self._slots:
            if slot.progress is None:  # manual progress: the loop's own poll sees the fd
                found += self._drain(slot)
        now = time.perf_counter()
        if not found and now >= self._spin_deadline:
            found = self._arm_idle()  # the last look, after arming
            now = time.perf_counter()
        self._spin_last = now
        if found:
            self._spin_hit = True
            self.spin_hits += 1
            self._spin_deadline = now + self.spin_us * 1e-6
        if now < self._spin_deadline:
            self._spin_scheduled = True
            self.loop.call_soon(self._spin_tick)
        elif self._spin_hit:
            self.spin.hit()
        else:
            self.spin_missed += 1
            self.spin.missed(now)

    def _schedule_poll(self) -> None:
        if not self._poll_scheduled and not self._closed:
            self._poll_scheduled = True
            self.loop.call_soon(self._poll_tick)

    def _poll_tick(self) -> None:
        """polling: one poll of every CQ per loop iteration while operations are
        outstanding. When none are, the loop stops: the CQs it polled disarmed are armed
        and drained once more (``_arm_idle``), so the next completion wakes the loop."""
        self._poll_scheduled = False
        if self._closed:
            return
        for slot in self._slots:
            if slot.progress is not None:
                slot.progress(False)
            self._drain(slot)
        if not self._table:
            self._arm_idle()
        if self._table:
            self._schedule_poll()

    def poke(self) -> None:
        """Called after posting work: polling mode: make sure a poll is scheduled;
        hybrid: spin for the answer."""
        if self.mode == "hybrid":
            if self.spin_us:
                self._spin_from_now()
        elif self.mode == "polling":
            self._schedule_poll()

    def _fail_all(self, exc: BaseException) -> None:
        """CQ overrun: completions are lost; fail every waiter (never expected)."""
        table, self._table = self._table, {}
        for wr_id, (handler, arg) in table.items():
            wc = WC(wr_id, WCStatus.GENERAL_ERR, 0)  # type: ignore[arg-type]
            try:
                handler(wc, arg)
            except Exception:
                pass
        self.loop.call_exception_handler({"message": "aiordma: CQ overrun", "exception": exc})

    # -- lifecycle -------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Counters: wakeups, spins, spin_hits (completions a spin caught), spin_preempted
        and spin_missed (spins ended by preemption, or run out without a completion),
        quiet_periods (hybrid's and the in-place waits' back-offs), polls, arms (re-arms
        after the first), completions, completions per wake-up, outstanding WRs, CQs,
        mode and spin budget, and polling's in_place_waits, in_place_hits (the future
        was done when the wait returned) and in_place_missed (waits that ran out their
        whole budget)."""
        return {
            "mode": self.mode,
            "spin_us": self.spin_us,
            "wakeups": self.wakeups,
            "spins": self.spins,
            "spin_hits": self.spin_hits,
            "spin_preempted": self.spin_preempted,
            "spin_missed": self.spin_missed,
            "quiet_periods": self.spin.quiet_periods,
            "polls": self.polls,
            "arms": self.arms,
            "completions": self.completions,
            "completions_per_wakeup": self.completions / self.wakeups if self.wakeups else 0.0,
            "outstanding": len(self._table),
            "cqs": len(self._slots),
            "unknown_wr_ids": self.unknown_wr_ids,
            "in_place_waits": self.in_place_waits,
            "in_place_hits": self.in_place_hits,
            "in_place_missed": self.in_place_missed,
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
        if self._closed:
            return
        self._closed = True
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
        self.in_place = False
        self._table.clear()

    def __repr__(self) -> str:
        return (f"<CQReactor {self.ctx.name} mode={self.mode} spin_us={self.spin_us} "
                f"cqs={len(self._slots)} outstanding={len(self._table)}>")
