"""When a spinning poller should stop spinning: ``SpinGovernor``, sans-IO.

The reactor's poll schedule (``poll_schedule.py``) spins -- keeps its event loop polling the CQs for
``spin_us`` after activity (``hybrid``), or waits in place for an operation (``polling``)
-- and asks this governor whether it may. The governor sends the spin *quiet* (the
reactor then behaves as ``blocking``) for a back-off time when

- it was **preempted**: a gap of more than ``PREEMPT_GAP_S`` between two spin ticks
  makes the reactor ask ``preempted``, which reads the thread's CPU time
  (``time.thread_time``). A spinning thread never sleeps, so wall time minus CPU time
  is time it waited for a core ("stolen"). Summed over the spin time since the last
  quiet period (both sums halved whenever the spin time passes ``_WINDOW_S``), stolen
  time above ``_STOLEN_MIN_S`` and above ``_STOLEN_SHARE`` of the spin time means the
  cores are oversubscribed: a spinner then holds a core that someone (often its peer,
  or the process that will answer it) is waiting for. Only **long** waits count: an
  interval between two checks in which the thread was off its core for less than
  ``LONG_PREEMPTION_S`` adds nothing. Short ones are the kernel's own work on this
  core (interrupts, softirqs, kernel workers): it ends by itself, and is often what
  delivers the completion the spin waits for. Soft-RoCE (rxe) runs its requester,
  responder and completer in kernel workers beside the application; in a 2-vCPU guest
  they preempt a spinning client on nearly every round trip, for tens to a hundred-odd
  microseconds each, and counting that kept the spin quiet and the client blocking on
  most round trips. A task that needs the core the spinner holds takes it for a
  scheduler slice instead (300-900 us waits beside busy loops, or with both sides on
  one core), which still counts (docs/history/rxe-spin-long-preemption-2026-12-07.json);
- it **missed** ``MISS_LIMIT`` times in a row: spins (or in-place waits) that ran out
  their budget without the completion they waited for. Either the peer answers slower
  than the budget, and every spin is wasted CPU, or the peer cannot answer *because*
  of the spin: it waits for the core the spinner holds (the spinner is not preempted,
  the peer starves).

The back-off starts at ``_BACKOFF_MIN_S`` and doubles (up to ``_BACKOFF_MAX_S``) while
the first spin after a quiet period is preempted or misses again (within one back-off
of its end); a later one starts from the minimum again.

Time is the caller's (``time.perf_counter`` seconds, passed in as ``now``); the CPU
clock is ``thread_time``, replaceable (tests freeze it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

PREEMPT_GAP_S: Final = 100e-6
MISS_LIMIT: Final = 8
_BACKOFF_MIN_S: Final = 5e-3
_BACKOFF_MAX_S: Final = 0.5
_STOLEN_MIN_S: Final = 500e-6
_STOLEN_SHARE: Final = 0.1
_WINDOW_S: Final = 0.05
#: an interval's time off the core counts as preemption from this long (the module
#: docstring: shorter ones are the kernel's own work, longer ones a scheduler slice)
LONG_PREEMPTION_S: Final = 250e-6


class SpinGovernor:
    """The quiet/back-off state of one reactor's spin (module docstring).

    ``quiet_until``: no spin before this time (``-inf``: spin). ``quiet_periods``
    counts the times it went quiet.
    """

    def __init__(self) -> None:
        self.quiet_until = float("-inf")
        self.backoff = _BACKOFF_MIN_S
        self.misses = 0  # spins in a row that ran out without a completion
        self.quiet_periods = 0
        self.thread_time: Callable[[], float] = time.thread_time
        self._cpu = 0.0  # thread CPU time at the last preemption check
        self._wall = 0.0  # and wall time then
        self._stolen_sum = 0.0  # time spent waiting for a core while spinning
        self._spun_sum = 0.0  # time spent spinning (both since the last quiet period)

    def start(self, now: float) -> None:
        """A spin starts at ``now``: the baseline of the next ``preempted`` check."""
        self._wall = now
        self._cpu = self.thread_time()

    def preempted(self, now: float) -> bool:
        """Has this thread waited for a core for a large share of its recent spinning,
        in waits of at least ``LONG_PREEMPTION_S`` each (the module docstring)? Moves
        the check's baseline to ``now``."""
        cpu = self.thread_time()
        wall = now - self._wall
        waited = wall - (cpu - self._cpu)  # this interval's time off the core
        stolen = self._stolen_sum + (waited if waited >= LONG_PREEMPTION_S else 0.0)
        spun = self._spun_sum + wall
        self._wall = now
        self._cpu = cpu
        if spun > _WINDOW_S:
            spun *= 0.5
            stolen *= 0.5
        self._spun_sum = spun
        self._stolen_sum = stolen
        return stolen > _STOLEN_MIN_S and stolen > _STOLEN_SHARE * spun

    def hit(self) -> None:
        """A spin or wait caught its completion: the misses in a row start again."""
        self.misses = 0

    def missed(self, now: float) -> None:
        """A spin, or an in-place wait, ran out its whole budget without the completion
        it waited for: the ``MISS_LIMIT``-th in a row goes quiet; ``hit`` resets the
        count."""
        self.misses += 1
        if self.misses >= MISS_LIMIT:
            self.misses = MISS_LIMIT - 1  # the probe after the quiet decides
            self.go_quiet(now)

    def go_quiet(self, now: float) -> None:
        """Stop spinning until ``now`` + the back-off: doubled when the last quiet
        period ended less than one back-off ago (the probe after it failed too), the
        minimum again otherwise."""
        if now - self.quiet_until < self.backoff:
            self.backoff = min(self.backoff * 2, _BACKOFF_MAX_S)
        else:
            self.backoff = _BACKOFF_MIN_S
        self.quiet_until = now + self.backoff
        self._stolen_sum = self._spun_sum = 0.0
        self.quiet_periods += 1
