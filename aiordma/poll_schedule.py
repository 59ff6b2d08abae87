"""When the completion reactor polls besides its wake-ups: the poll modes.

``CQReactor`` (cq_reactor.py) reads a channel's event, re-arms and drains a CQ on every
wake-up; its ``PollSchedule`` decides what happens around that -- whether a polled CQ is
re-armed at once or later, and when the reactor polls without a wake-up.

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
  and the tick that ends the spin arms it and polls it once more (fact 1 of
  cq_reactor.py), so nothing is lost. The spin costs CPU only for ``spin_us`` after the
  last activity. The spin must outlast the peer's turnaround to save its wake-up.

  The spin adapts (``spin_policy.SpinGovernor``): it goes *quiet* (behaves as
  ``blocking``) for a back-off time when it was preempted (the cores are
  oversubscribed) or missed ``MISS_LIMIT`` times in a row. ``statistics()`` counts
  ``spin_preempted``, ``spin_missed`` and ``quiet_periods``.

  Why it is the default: on free cores it saves the wake-up of a sleeping process,
  which costs more than the spin, and a spin that does not adapt falls off a cliff
  when the cores are shared (each side spins out its budget while the other waits for
  a core); docs/benchmarks.md, "Poll mode", has the measurements.
* ``polling``: while operations are outstanding -- WRs in the reactor's table, or a
  task suspended in ``wait`` on an operation's future (a send in flight, a receive
  awaited: the message engine tracks its own WRs) -- poll once per loop iteration
  (``call_soon``), never arming; when nothing is outstanding, arm and block. (A polled
  CQ's event is read and it is left disarmed, as in ``hybrid``'s spin; the tick that
  finds nothing outstanding arms it and polls it once more.)

  And it **waits in place** (``wait_in_place``, like a socket's ``SO_BUSY_POLL``): an
  endpoint about to suspend a task on an operation's future first polls the CQs itself,
  in the task, for up to its budget (``spin_us``; see below), dispatching what it finds
  -- when no other task is suspended on an operation of this reactor (``wait`` counts
  them): one that is may be ready to run (uvloop does not show its ready queue), or be
  woken by what the poll finds, and must not wait behind the hold. So a window of
  concurrent operations, or a peer on the same loop, never waits in place. When its own
  completion comes in that time the future is done and the ``await`` does not suspend:
  no task switch and no loop iteration (its ``epoll_wait``) for that operation. The loop
  is held meanwhile, so the holds are bounded: **in-place waits stop polling once they
  have held the loop for their budget in all since its last iteration** (a marker
  callback scheduled with the first hold notes each iteration; the handlers a poll
  dispatched finish first); past that, tasks suspend as usual until the loop has turned.
  A wait that runs out its whole budget is a miss, counted as in ``hybrid``:
  ``MISS_LIMIT`` in a row make the waits quiet for a back-off (the peer answers slower
  than the budget, or it shares this process's loop and cannot answer while the loop is
  held). A CQ with manual progress (``soft``) has its bytes moved first, as the poll
  loop does. Never from inside a dispatch (an eager task started by a completion
  handler): that would reorder completions. ``statistics()`` counts ``in_place_waits``,
  ``in_place_hits`` and ``in_place_missed``.

  The in-place budget **follows the peer's turnaround**: it is 1.5x a decaying maximum
  of how long recent waits took -- a hit's time, or, for a wait that spent the budget
  (its own or the loop's hold), the time until its task resumed with the result (see
  below) -- at least ``spin_us`` and at most ``IN_PLACE_GROWTH`` times it (3 ms by
  default). Where answers come back within ``spin_us`` (a NIC, free cores) nothing
  changes; where a round trip takes longer (emulated or oversubscribed hosts: Soft-RoCE
  under qemu answers in 0.3-1 ms) the waits still catch their completions instead of
  running out and paying a loop iteration each. Such a wait counts only when its result
  came at least half the time it polled after it suspended: a peer on the same loop
  answers soon after the loop is let go, and a longer budget would not have caught that
  answer. The budget also bounds the hold of the loop per iteration. ``statistics()``
  reports it as ``in_place_budget_us``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .spin_policy import PREEMPT_GAP_S, SpinGovernor

if TYPE_CHECKING:
    from .cq_reactor import CQReactor

T = TypeVar("T")

MODES: Final = ("blocking", "hybrid", "polling")
#: the in-place budget of ``polling`` grows with the turnaround up to this many
#: times ``spin_us`` (module docstring)
IN_PLACE_GROWTH: Final = 10
_TURNAROUND_DECAY: Final = 0.125  # a shorter turnaround pulls the estimate down by 1/8
DEFAULT_MODE: Final = "hybrid"
DEFAULT_SPIN_US: Final = 300


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


class PollSchedule:
    """The poll mode of one reactor (the module docstring): its spin (hybrid), its
    poll ticks (polling) and its in-place waits (polling). Everything runs on the
    loop's thread; the reactor calls ``woke`` and ``poke`` around each wake-up's
    work, and the endpoints call ``poke`` after posting and ``wait`` to await an
    operation's future."""

    def __init__(self, reactor: CQReactor, mode: str, spin_us: int) -> None:
        self.r = reactor
        self.loop = reactor.loop
        self.mode = mode
        self.spin_us = spin_us
        self.hybrid = mode == "hybrid" and spin_us > 0
        self.polling = mode == "polling"
        self.spin = SpinGovernor()  # when the spin (and the in-place wait) goes quiet
        self.poll_scheduled = False
        self.spin_scheduled = False
        self.spin_deadline = 0.0
        self._spin_last = 0.0  # time of the spin's last tick
        self._spin_hit = False  # a completion arrived during this spin
        self.in_place = False  # polling mode, a spin budget and a CQ to poll in place
        self.suspended = 0  # tasks suspended in ``wait`` (they may be ready to run)
        self._held_since = -1.0  # in-place waits hold the loop since (-1: it has turned)
        self._budget = spin_us * 1e-6  # the in-place budget (s): follows the turnaround
        self._turnaround = 0.0  # decaying maximum of recent waits' durations (s)
        # (began, ended) of the in-place wait that just ran out its budget (take_miss)
        self._miss: tuple[float, float] | None = None
        # the callbacks of every tick, bound once (not a bound method made per tick)
        self._call_soon: Callable[..., Any] = self.loop.call_soon
        self._spin_tick_cb: Callable[[], None] = self._spin_tick
        self._poll_tick_cb: Callable[[], None] = self._poll_tick
        self._loop_turned_cb: Callable[[], None] = self._loop_turned
        # statistics
        self.in_place_waits = 0
        self.in_place_hits = 0
        self.in_place_missed = 0
        self.spins = 0
        self.spin_preempted = 0
        self.spin_missed = 0
        self.spin_hits = 0

    def cqs_changed(self, count: int) -> None:
        """The reactor now has ``count`` CQs (0: closed): in-place waits need one."""
        self.in_place = count > 0 and self.polling and self.spin_us > 0

    # -- around a wake-up ------------------------------------------------------------
    def woke(self) -> None:
        """A wake-up begins (a channel event): a spin in progress saved its sleep."""
        if self.spin_scheduled:
            self._spin_hit = True
            self.spin_hits += 1

    def arms_lazily(self) -> bool:
        """True when a polled CQ stays disarmed after its event: the spin (hybrid, not
        quiet) or the poll ticks (polling) poll it, and ``_arm_idle`` arms it when they
        end."""
        return self.polling or (self.hybrid and time.perf_counter() >= self.spin.quiet_until)

    def poke(self) -> None:
        """Called after posting work, and once a wake-up's completions are dispatched:
        polling mode: make sure a poll is scheduled; hybrid: spin for what comes next."""
        if self.hybrid:
            self._spin_from_now()
        elif self.polling:
            self._schedule_poll()

    # -- in-place waits (polling) ----------------------------------------------------
    async def wait(self, fut: asyncio.Future[T], spin: bool = True) -> T:
        """``await fut``, in polling mode: first ``wait_in_place(fut)``
        (unless ``spin`` is false: the completion needs the loop first, e.g. an
        operation not posted yet), and counted in ``suspended`` while the task is
        suspended. Returns or raises what ``await fut`` does; cancellation too."""
        if spin and self.wait_in_place(fut):
            return fut.result()
        miss = self.take_miss() if spin else None
        self.suspended += 1
        self._schedule_poll()  # polled while it waits (the poll ticks look at suspended)
        try:
            result = await fut
        finally:
            self.suspended -= 1
        if miss is not None:
            self.resumed(miss)
        return result

    def wait_in_place(self, fut: asyncio.Future[Any]) -> bool:
        """polling mode: poll the CQs here, dispatching their completions, until ``fut``
        is done or the in-place budget is spent (see the module docstring); returns
        ``fut.done()``. Called by a task just before it awaits ``fut``; it never
        suspends, never raises what a handler raises (the loop's exception handler gets
        it, as in every dispatch), and does nothing (returns at once) when the mode does
        not wait in place, another task is suspended in ``wait`` (it may be ready to run,
        or be woken by what this poll finds), the waits are quiet, the loop has been
        held for the budget since its last iteration, or a dispatch is on the stack.
        """
        self._miss = None
        if fut.done():
            return True
        r = self.r
        if not self.in_place or self.suspended or r.dispatching or r.closed:
            return False
        now = time.perf_counter()
        if now < self.spin.quiet_until:
            return False
        budget = self._budget
        held = self._held_since
        whole = held < 0.0  # the loop has turned: this wait has the whole budget
        if whole:
            self._held_since = held = now
            self._call_soon(self._loop_turned_cb)
        deadline = held + budget
        if now >= deadline:  # the loop was held long enough: the caller may time the wait
            self._miss = (now, now)
            return False
        self.in_place_waits += 1
        while True:
            r.progress_and_drain(False)  # a short batch: look at fut before polling again
            if fut.done():
                self.in_place_hits += 1
                self.spin.hit()
                self._turned_around(time.perf_counter() - now)
                return True
            if r.closed or time.perf_counter() >= deadline:
                break
        ended = time.perf_counter()
        if whole:  # it ran out its whole budget: a miss
            self.in_place_missed += 1
            self.spin.missed(ended)
        self._miss = (now, ended)  # the caller times the rest of it
        return False

    def take_miss(self) -> tuple[float, float] | None:
        """After ``wait_in_place`` returned False: ``(began, ended)`` when that wait
        polled in place until the budget was spent (its own, or the loop's hold), for
        the caller to pass to ``resumed`` once its result has come; else None (it did
        not poll: quiet, another task suspended, a dispatch on the stack). Clears it
        (the next ``wait_in_place`` does too)."""
        miss, self._miss = self._miss, None
        return miss

    def resumed(self, miss: tuple[float, float]) -> None:
        """The result of the wait of ``miss`` (``take_miss``) came now: the in-place
        budget follows that turnaround if the result came at least half the budget it
        spent after it gave up (module docstring). A result that came sooner may have
        needed the loop (a peer on it), and a longer budget would not have caught it."""
        began, ended = miss
        now = time.perf_counter()
        if 2.0 * (now - ended) >= ended - began:
            self._turned_around(now - began)

    def _turned_around(self, took: float) -> None:
        """A wait took ``took`` seconds in all: the in-place budget follows (module
        docstring)."""
        est = self._turnaround
        est = took if took >= est else est - (est - took) * _TURNAROUND_DECAY
        self._turnaround = est
        floor = self.spin_us * 1e-6
        self._budget = min(max(1.5 * est, floor), IN_PLACE_GROWTH * floor)

    def _loop_turned(self) -> None:
        self._held_since = -1.0

    # -- the spin (hybrid) -----------------------------------------------------------
    def _spin_from_now(self) -> None:
        """hybrid: keep the loop polling for ``spin_us`` from now (unless quiet)."""
        now = time.perf_counter()
        if now < self.spin.quiet_until:
            return
        self.spin_deadline = now + self.spin_us * 1e-6
        if not self.spin_scheduled and not self.r.closed:
            self.spin_scheduled = True
            self._spin_last = now
            self._spin_hit = False
            self.spin.start(now)
            self.spins += 1
            self._call_soon(self._spin_tick_cb)

    def _spin_tick(self) -> None:
        self.spin_scheduled = False
        r = self.r
        if r.closed:
            return
        now = time.perf_counter()
        if now - self._spin_last > PREEMPT_GAP_S and self.spin.preempted(now):
            self.spin_preempted += 1
            self.spin.go_quiet(now)
            r.arm_idle()
            return
        found = r.drain_polled()  # (manual progress: the loop's own poll sees the fd)
        now = time.perf_counter()
        if not found and now >= self.spin_deadline:
            found = r.arm_idle()  # the last look, after arming
            now = time.perf_counter()
        self._spin_last = now
        if found:
            self._spin_hit = True
            self.spin_hits += 1
            self.spin_deadline = now + self.spin_us * 1e-6
        if now < self.spin_deadline:
            self.spin_scheduled = True
            self._call_soon(self._spin_tick_cb)
        elif self._spin_hit:
            self.spin.hit()
        else:
            self.spin_missed += 1
            self.spin.missed(now)

    # -- the poll ticks (polling) ----------------------------------------------------
    def _schedule_poll(self) -> None:
        if not self.poll_scheduled and not self.r.closed:
            self.poll_scheduled = True
            self._call_soon(self._poll_tick_cb)

    def _poll_tick(self) -> None:
        """polling: one poll of every CQ per loop iteration while operations are
        outstanding (WRs in the reactor's table, or tasks suspended in ``wait``). When
        none are, the loop stops: the CQs it polled disarmed are armed and drained once
        more (``arm_idle``), so the next completion wakes the loop."""
        self.poll_scheduled = False
        r = self.r
        if r.closed:
            return
        r.progress_and_drain(True)
        if not (r.outstanding or self.suspended):
            r.arm_idle()
        if r.outstanding or self.suspended:
            self._schedule_poll()

    def statistics(self) -> dict[str, Any]:
        """The schedule's counters (``CQReactor.statistics`` documents them)."""
        return {
            "mode": self.mode,
            "spin_us": self.spin_us,
            "spins": self.spins,
            "spin_hits": self.spin_hits,
            "spin_preempted": self.spin_preempted,
            "spin_missed": self.spin_missed,
            "quiet_periods": self.spin.quiet_periods,
            "in_place_waits": self.in_place_waits,
            "in_place_hits": self.in_place_hits,
            "in_place_missed": self.in_place_missed,
            "in_place_budget_us": round(self._budget * 1e6),
        }
