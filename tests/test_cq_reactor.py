"""The reactor's arm/drain protocol against a fake CQ with exact verbs semantics.

No provider, no timer: a completion that lands between the last empty poll and the
re-arm must still be dispatched (the re-arm-then-drain rule), and the tests would hang
(caught by the timeout) on a missed wake-up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from aiordma.bench.fakecq import FakeCQ, FakeCtx
from aiordma.cq_reactor import CQReactor, future_handler, poll_settings
from aiordma.errors import RemoteAccessError
from aiordma.poll_schedule import IN_PLACE_GROWTH
from aiordma.spin_policy import MISS_LIMIT as _MISS_LIMIT
from aiordma.verbs import WC, WCOpcode, WCStatus


def _wc(wr_id: int, status: WCStatus = WCStatus.SUCCESS) -> WC:
    return WC(wr_id, status, WCOpcode.SEND)


@pytest.mark.parametrize("mode", ["blocking", "hybrid", "polling"])
async def test_completion_in_the_arm_window_is_not_lost(mode: str) -> None:
    loop = asyncio.get_running_loop()
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode=mode, spin_us=5)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    futs = [loop.create_future() for _ in range(3)]
    ids = [r.register(future_handler, f) for f in futs]
    # during the wake-up, the second completion lands just after the poll that takes
    # the first: the reactor must have re-armed before that poll, or nothing wakes it
    cq.after_poll = lambda: cq.add(_wc(ids[1]))
    cq.add(_wc(ids[0]))  # wakes the reactor (armed at creation)
    await asyncio.wait_for(futs[0], 2)
    await asyncio.wait_for(futs[1], 2)  # would hang with poll-then-arm
    cq.add(_wc(ids[2]))
    await asyncio.wait_for(futs[2], 2)
    st = r.statistics()
    assert st["completions"] == 3 and st["outstanding"] == 0
    r.close()
    assert cq.closed and cq.acked == cq.events


async def test_errors_become_typed_exceptions_and_cancelled_waiters_are_dropped() -> None:
    loop = asyncio.get_running_loop()
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode="blocking")  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    pinned = bytearray(10)
    cancelled = loop.create_future()
    a = r.register(future_handler, cancelled)
    bad = loop.create_future()
    b = r.register(future_handler, bad)
    cancelled.cancel()  # the awaiting task went away; the entry keeps the buffers
    assert r.outstanding == 2
    del pinned
    cq.add(_wc(a))
    cq.add(_wc(b, WCStatus.REM_ACCESS_ERR))
    with pytest.raises(RemoteAccessError) as ei:
        await asyncio.wait_for(bad, 2)
    assert ei.value.wr_id == b and str(ei.value.status) == "IBV_WC_REM_ACCESS_ERR"
    assert r.outstanding == 0
    r.close()


async def test_handler_exception_does_not_stop_dispatch() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda lp, c: errors.append(c))
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode="blocking")  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]

    def boom(wc: WC, arg: Any) -> None:
        raise RuntimeError("handler bug")

    ok = loop.create_future()
    cq.add(_wc(r.register(boom, None)))
    cq.add(_wc(r.register(future_handler, ok)))
    await asyncio.wait_for(ok, 2)
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)
    r.close()


async def test_cq_capacity_is_reserved_twice_the_work() -> None:
    loop = asyncio.get_running_loop()
    ctx = FakeCtx()
    r = CQReactor(ctx, loop, mode="blocking", cq_size=100)  # type: ignore[arg-type]
    a = r.acquire_cq(30)
    assert r.acquire_cq(20) is a  # 60 + 40 = 100
    c = r.acquire_cq(1)  # no room left: a second CQ with its own channel
    assert c is not a and len(ctx.cqs) == 2
    r.release_cq(a, 30)
    assert r.acquire_cq(30) is a
    r.close()


def test_poll_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_POLL_MODE", "hybrid")
    monkeypatch.setenv("AIORDMA_SPIN_US", "7")
    assert poll_settings() == ("hybrid", 7)
    assert poll_settings("blocking") == ("blocking", 0)
    with pytest.raises(ValueError):
        poll_settings("fast")
    with pytest.raises(ValueError):
        poll_settings("hybrid", -1)


async def _complete(r: CQReactor, cq: FakeCQ) -> None:
    """Add one completion to ``cq`` and wait (bounded) until the reactor dispatched it."""
    fut = asyncio.get_running_loop().create_future()
    cq.add(_wc(r.register(future_handler, fut)))
    await asyncio.wait_for(fut, 2)


# -- hybrid's adaptive spin ------------------------------------------------------------
async def _yield_while(busy: Callable[[], object], what: str, limit_s: float = 2.0) -> None:
    """Yield to the loop while ``busy()`` is true (bounded: fails after ``limit_s``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while busy():
        assert loop.time() < deadline, f"{what} never ended"
        await asyncio.sleep(0)


async def _spin_ends(r: CQReactor) -> None:
    """Yield to the loop until the reactor's spin has stopped (bounded)."""
    await _yield_while(lambda: r.statistics()["spins"] and r.schedule.spin_scheduled, "the spin")


async def test_hybrid_goes_quiet_when_its_spin_waits_for_a_core() -> None:
    """A gap between spin ticks in which the thread got no CPU (here: a thread clock
    that stands still while the loop is held up for 2 ms) ends the spin, and posts
    stop spinning until the back-off has passed; then the spin comes back."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="hybrid", spin_us=1_000_000)  # type: ignore[arg-type]
    r.acquire_cq(8)
    frozen = time.thread_time()
    r.schedule.spin.thread_time = lambda: frozen
    r.poke()
    assert r.statistics()["spins"] == 1
    await asyncio.sleep(0)
    time.sleep(0.002)  # the loop is held up; the thread "waits for a core"
    await _spin_ends(r)
    st = r.statistics()
    assert st["spin_preempted"] == 1 and st["quiet_periods"] == 1
    r.poke()  # quiet: no new spin
    assert r.statistics()["spins"] == 1 and not r.schedule.spin_scheduled
    await asyncio.sleep(0.02)  # past the first back-off (5 ms)
    r.schedule.spin.thread_time = time.thread_time
    r.poke()
    assert r.statistics()["spins"] == 2 and r.schedule.spin_scheduled
    r.close()


async def test_hybrid_keeps_spinning_through_gaps_that_used_the_cpu() -> None:
    """The same gap with the thread clock running (the time went to work on this
    thread, not to waiting for a core) does not end the spin."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="hybrid", spin_us=1_000_000)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    r.schedule.spin.thread_time = time.perf_counter  # every second of wall time was CPU time
    r.poke()
    for _ in range(3):
        await asyncio.sleep(0)
        time.sleep(0.002)
    await _complete(r, cq)
    st = r.statistics()
    assert st["spin_preempted"] == 0 and st["quiet_periods"] == 0 and r.schedule.spin_scheduled
    assert st["spin_hits"] >= 1
    r.close()


async def test_hybrid_goes_quiet_after_missed_spins_and_backs_off_further() -> None:
    """Spins that run out without a completion (_MISS_LIMIT in a row) go quiet; the
    probe after the quiet period misses too, so the next quiet period is twice as long.
    A spin that catches a completion resets the count."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="hybrid", spin_us=200)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    r.schedule.spin.thread_time = time.perf_counter  # no stolen time: only misses count here
    for _ in range(_MISS_LIMIT - 1):
        r.poke()
        await _spin_ends(r)
    fut = loop.create_future()
    r.poke()
    cq.add(_wc(r.register(future_handler, fut)))  # this spin catches a completion
    await asyncio.wait_for(fut, 2)
    await _spin_ends(r)
    assert r.statistics()["quiet_periods"] == 0
    for _ in range(_MISS_LIMIT):
        r.poke()
        await _spin_ends(r)
    st = r.statistics()
    assert st["quiet_periods"] == 1 and st["spin_missed"] == 2 * _MISS_LIMIT - 1
    spins = st["spins"]
    r.poke()
    assert r.statistics()["spins"] == spins  # quiet
    assert r.schedule.spin.backoff == 5e-3  # the first quiet period is the shortest
    # End the quiet period now, with a back-off long enough that the probe's miss falls
    # inside it on a loaded machine too (a stall past it would start from the minimum).
    first = r.schedule.spin.backoff = 0.2
    r.schedule.spin.quiet_until = time.perf_counter()
    r.poke()  # the probe
    await _spin_ends(r)
    st = r.statistics()
    assert st["spins"] == spins + 1 and st["quiet_periods"] == 2
    assert r.schedule.spin.backoff == 2 * first
    r.close()


# -- hybrid's lazy arming ----------------------------------------------------------------
async def _wake_and_spin(r: CQReactor, cq: FakeCQ) -> None:
    """A completion on the armed CQ: the wake-up reads its event and starts a spin."""
    await _complete(r, cq)
    assert cq.events == 1 and r.statistics()["wakeups"] == 1 and r.schedule.spin_scheduled


async def test_polling_polls_while_a_task_waits_on_an_operation() -> None:
    """The message engine's WRs are not in the reactor's table: a task suspended in
    ``wait`` (a send in flight, a receive awaited) keeps the poll ticks going, with
    nothing in the table; once it has returned they stop, and every CQ is armed."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=0)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    assert r.waits and r.outstanding == 0
    fut: asyncio.Future[int] = loop.create_future()
    task = asyncio.ensure_future(r.wait(fut))
    await asyncio.sleep(0)  # the task suspends in wait
    polls = r.statistics()["polls"]
    for _ in range(5):
        await asyncio.sleep(0)
    assert r.statistics()["polls"] >= polls + 4 and r.schedule.suspended == 1
    fut.set_result(7)
    assert await asyncio.wait_for(task, 2) == 7
    await _yield_while(lambda: r.schedule.poll_scheduled, "the poll ticks")
    polls = r.statistics()["polls"]
    for _ in range(3):
        await asyncio.sleep(0)
    assert r.statistics()["polls"] == polls and cq.armed
    r.close()


async def test_hybrid_leaves_the_cq_disarmed_while_its_spin_polls_it() -> None:
    """After the wake-up the spin polls the CQ: it is not re-armed, so the completions
    that the spin catches raise no event. The tick that ends the spin arms it, and a
    completion after that wakes the loop again."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="hybrid", spin_us=1_000_000)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    r.schedule.spin.thread_time = time.perf_counter  # never "preempted"
    await _wake_and_spin(r, cq)
    assert not cq.armed and r.statistics()["arms"] == 0
    for _ in range(3):  # caught by the spin: no event, no arm
        await _complete(r, cq)
    assert cq.events == 1 and not cq.armed and r.statistics()["wakeups"] == 1
    r.schedule.spin_deadline = 0.0  # the budget is spent
    await _spin_ends(r)
    assert cq.armed and r.statistics()["arms"] == 1
    await _complete(r, cq)
    st = r.statistics()
    assert cq.events == 2 and st["wakeups"] == 2 and st["completions"] == 5
    r.close()
    assert cq.acked == cq.events


async def test_completion_between_the_last_spin_poll_and_the_arm_is_not_lost() -> None:
    """The spin's last poll finds nothing; a completion lands before the CQ is armed
    (it raises no event): the poll after arming must take it, or it waits forever."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="hybrid", spin_us=1_000_000)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    r.schedule.spin.thread_time = time.perf_counter
    await _wake_and_spin(r, cq)
    fut = loop.create_future()
    wr_id = r.register(future_handler, fut)
    r.schedule.spin_deadline = 0.0
    cq.after_poll = lambda: cq.add(_wc(wr_id))  # lands just after the empty poll
    await asyncio.wait_for(fut, 2)
    assert cq.events == 1 and cq.armed  # no event: the arm-then-poll took it
    await _spin_ends(r)
    r.close()


async def test_hybrid_arms_when_its_spin_is_preempted() -> None:
    """A spin that goes quiet (preempted) arms the CQ it left disarmed: the next
    completion wakes the loop."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="hybrid", spin_us=1_000_000)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    frozen: list[float] = []  # the thread clock runs with the wall clock until frozen
    r.schedule.spin.thread_time = lambda: frozen[0] if frozen else time.perf_counter()
    await _wake_and_spin(r, cq)  # (never preempted so far, however slow the machine)
    assert not cq.armed
    frozen.append(time.perf_counter())
    time.sleep(0.002)  # the loop is held up; the thread "waits for a core"
    await _spin_ends(r)
    assert r.statistics()["spin_preempted"] == 1 and cq.armed
    await _complete(r, cq)
    assert cq.events == 2
    r.close()


async def test_blocking_rearms_on_every_wakeup() -> None:
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="blocking")  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    for i in range(3):
        await _complete(r, cq)
        assert cq.armed and r.statistics()["arms"] == i + 1
    assert cq.events == 3
    r.close()


# -- polling's lazy arming -----------------------------------------------------------
async def _poll_loop_ends(r: CQReactor) -> None:
    """Yield to the loop until the reactor's poll loop has stopped (bounded)."""
    await asyncio.sleep(0)
    await _yield_while(lambda: r.schedule.poll_scheduled, "the poll loop")


async def test_polling_leaves_the_cq_disarmed_while_operations_are_outstanding() -> None:
    """While something is outstanding the poll loop polls the CQ every iteration and it
    stays disarmed (its completions raise no event). The tick that finds nothing
    outstanding arms it, and the next completion wakes the loop."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="polling")  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    pending = loop.create_future()
    pending_id = r.register(future_handler, pending)  # outstanding throughout
    await _complete(r, cq)  # the wake-up: its event is read, the CQ left disarmed
    assert cq.events == 1 and not cq.armed and r.schedule.poll_scheduled
    for _ in range(3):  # taken by the poll loop: no event, no arm, no wake-up
        await _complete(r, cq)
    st = r.statistics()
    assert cq.events == 1 and not cq.armed and st["wakeups"] == 1 and st["arms"] == 0
    cq.add(_wc(pending_id))
    await asyncio.wait_for(pending, 2)
    await _poll_loop_ends(r)
    assert cq.armed and r.statistics()["arms"] == 1
    await _complete(r, cq)  # wakes the loop through the armed CQ
    st = r.statistics()
    assert cq.events == 2 and st["wakeups"] == 2 and st["completions"] == 6
    await _poll_loop_ends(r)
    r.close()
    assert cq.acked == cq.events


# -- polling's in-place waits ----------------------------------------------------------
def test_only_polling_with_a_budget_waits_in_place() -> None:
    loop = asyncio.new_event_loop()
    try:
        for mode, spin, expected in (("polling", 100, True), ("polling", 0, False),
                                     ("hybrid", 100, False), ("blocking", 100, False)):
            r = CQReactor(FakeCtx(), loop, mode=mode, spin_us=spin)  # type: ignore[arg-type]
            assert not r.in_place  # no CQ yet: nothing to poll
            r.acquire_cq(8)
            assert r.in_place is expected, (mode, spin)
            fut = loop.create_future()
            polls = r.polls
            assert r.wait_in_place(fut) is False
            assert r.polls == polls or expected  # only an in-place reactor polls here
            r.close()
            assert not r.in_place
    finally:
        loop.close()


async def test_wait_in_place_dispatches_in_cq_order_until_its_future_is_done() -> None:
    """The completion the task waits for arrives while it polls in place: every
    completion before it is dispatched first, in CQ order, and the future is done when
    the call returns, so the ``await`` would not suspend."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=500_000)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    order: list[int] = []
    other = [r.register(lambda wc, _a: order.append(wc.wr_id), None) for _ in range(3)]
    mine = loop.create_future()
    mine_id = r.register(future_handler, mine)
    later = loop.create_future()
    later_id = r.register(future_handler, later)
    cq.add(_wc(other[0]))
    polls: list[int] = []

    def arrive() -> None:  # the rest lands while the task polls
        polls.append(r.polls)
        cq.add_batch([_wc(other[1]), _wc(other[2]), _wc(mine_id)])

    cq.after_poll = arrive
    assert r.wait_in_place(mine) is True
    assert mine.done() and mine.result().wr_id == mine_id and not later.done()
    assert order == other
    st = r.statistics()
    assert (st["in_place_waits"], st["in_place_hits"], st["in_place_missed"]) == (1, 1, 0)
    assert st["wakeups"] == 0  # nothing went through the loop
    assert r.wait_in_place(mine) is True  # done already: no poll
    assert r.statistics()["in_place_waits"] == 1
    cq.add(_wc(later_id))
    await asyncio.wait_for(later, 2)  # the loop's own path still works
    r.close()


async def test_in_place_waits_hold_the_loop_at_most_the_budget_between_its_turns() -> None:
    """A wait that runs out its budget returns False after at least ``spin_us``; until
    the loop has turned, the next wait does not poll at all; after a turn it polls
    again. The loop was never held longer than the budget by in-place waits."""
    loop = asyncio.get_running_loop()
    spin_us = 3000
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=spin_us)  # type: ignore[arg-type]
    r.acquire_cq(8)
    fut = loop.create_future()
    r.register(future_handler, fut)
    t0 = time.perf_counter()
    assert r.wait_in_place(fut) is False
    held = time.perf_counter() - t0
    assert held >= spin_us * 1e-6
    st = r.statistics()
    assert (st["in_place_waits"], st["in_place_missed"]) == (1, 1)
    polls = st["polls"]
    assert r.wait_in_place(fut) is False  # the loop has not turned: no poll
    assert r.statistics()["polls"] == polls and r.statistics()["in_place_waits"] == 1
    await asyncio.sleep(0)  # the loop turns
    await asyncio.sleep(0)
    assert r.wait_in_place(fut) is False
    st = r.statistics()
    assert st["in_place_waits"] == 2 and st["polls"] > polls
    # a hit does not end the hold: one that used the budget leaves none to the next
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    cq: FakeCQ = r._slots[0].cq  # type: ignore[assignment]
    hit = loop.create_future()
    hit_id = r.register(future_handler, hit)

    poll = cq.poll

    def late(n: int) -> list[WC]:  # the completion comes as the budget runs out
        if cq.poll is late:
            cq.poll = poll  # type: ignore[method-assign]
            # (the hit's time raises the budget, up to IN_PLACE_GROWTH x spin_us: it
            # comes that late, so the budget it leaves is spent too)
            time.sleep(IN_PLACE_GROWTH * spin_us * 1e-6)
            cq.add(_wc(hit_id))
        return poll(n)

    cq.poll = late  # type: ignore[method-assign]
    assert r.wait_in_place(hit) is True
    polls = r.polls
    assert r.wait_in_place(fut) is False
    assert r.polls == polls and r.statistics()["in_place_waits"] == 3
    fut.cancel()
    r.close()


async def test_in_place_waits_go_quiet_after_missing_in_a_row() -> None:
    """``_MISS_LIMIT`` waits in a row that ran out their budget (the peer answers slower,
    or it needs this loop to answer) make the waits quiet: the next one returns at once
    without polling; a hit in between resets the count."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=200)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    waiting = loop.create_future()
    r.register(future_handler, waiting)

    async def miss() -> None:
        await asyncio.sleep(0)  # a loop turn: a fresh hold
        await asyncio.sleep(0)
        assert r.wait_in_place(waiting) is False

    for _ in range(_MISS_LIMIT - 1):
        await miss()
    hit = loop.create_future()
    hit_id = r.register(future_handler, hit)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    cq.add(_wc(hit_id))  # (there before the first poll: a hit whatever the timing)
    assert r.wait_in_place(hit) is True  # resets the count
    for _ in range(_MISS_LIMIT - 1):
        await miss()
    assert r.statistics()["quiet_periods"] == 0
    before = time.perf_counter()
    await miss()
    st = r.statistics()
    assert st["quiet_periods"] == 1 and st["in_place_missed"] == 2 * _MISS_LIMIT - 1
    assert r.schedule.spin.quiet_until > before  # quiet from the last miss on, for a back-off
    # while quiet, a wait does not poll (the back-off, 5 ms, is stretched here: under
    # emulation the two loop turns below can take longer than that)
    r.schedule.spin.quiet_until = time.perf_counter() + 60
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    polls = r.polls
    assert r.wait_in_place(waiting) is False  # quiet: no poll
    assert r.statistics()["polls"] == polls
    assert r.statistics()["in_place_waits"] == 2 * _MISS_LIMIT
    waiting.cancel()
    r.close()


async def test_no_wait_in_place_from_inside_a_dispatch() -> None:
    """A task started eagerly by a completion handler must not poll in place: the
    dispatch on the stack still holds completions it took from the CQ, and polling
    again would dispatch later ones before them."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=500_000)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    order: list[str] = []
    inner = loop.create_future()
    inner_id = r.register(future_handler, inner)
    results: list[bool] = []

    def first(_wc: WC, _a: Any) -> None:
        order.append("first")
        results.append(r.wait_in_place(inner))  # as an eager task's first step would

    a = r.register(first, None)
    b = r.register(lambda _wc, _a: order.append("second"), None)
    cq.add_batch([_wc(a), _wc(b), _wc(inner_id)])
    await asyncio.wait_for(inner, 2)
    assert results == [False] and order == ["first", "second"]
    assert r.statistics()["in_place_waits"] == 0
    await _poll_loop_ends(r)
    r.close()


async def test_no_wait_in_place_while_another_task_is_suspended_on_an_operation() -> None:
    """``wait`` counts the tasks it suspends: while one is (it may be ready to run, or
    be woken by what a poll finds), nobody polls in place; once it has resumed, or was
    cancelled, waits poll in place again. ``spin=False`` never polls in place."""
    loop = asyncio.get_running_loop()
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=200)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    first = loop.create_future()
    first_id = r.register(future_handler, first)
    task = asyncio.create_task(r.wait(first))
    await _yield_while(lambda: not r.schedule.suspended, "the first wait")
    assert r.statistics()["in_place_missed"] == 1 and r.schedule.suspended == 1
    other = loop.create_future()
    r.register(future_handler, other)
    await asyncio.sleep(0)  # the loop turns: the first wait's hold is over
    await asyncio.sleep(0)
    polls = r.polls
    assert r.wait_in_place(other) is False
    assert r.polls == polls and r.statistics()["in_place_waits"] == 1
    cq.add(_wc(first_id))
    assert (await asyncio.wait_for(task, 2)).wr_id == first_id
    assert r.schedule.suspended == 0
    assert r.wait_in_place(other) is False  # polls again (and misses)
    assert r.statistics()["in_place_waits"] == 2
    # cancelled while suspended: no longer counted
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    third = loop.create_future()
    r.register(future_handler, third)
    task = asyncio.create_task(r.wait(third, spin=False))
    await _yield_while(lambda: not r.schedule.suspended, "the third wait")
    assert r.statistics()["in_place_waits"] == 2  # spin=False: no poll in place
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert r.schedule.suspended == 0 and third.cancelled()
    other.cancel()
    r.close()


def _arrives_after(cq: FakeCQ, wc: WC, delay_s: float) -> float:
    """Make ``wc`` land on ``cq`` at the first poll ``delay_s`` after now; returns now."""
    poll = cq.poll
    t0 = time.perf_counter()

    def late(n: int) -> list[WC]:
        if time.perf_counter() - t0 >= delay_s:
            cq.poll = poll  # type: ignore[method-assign]
            cq.add(wc)
        return poll(n)

    cq.poll = late  # type: ignore[method-assign]
    return t0


async def test_the_in_place_budget_follows_a_slow_peers_turnaround() -> None:
    """A wait that ran out its budget and got its result long after it suspended (a
    peer slower than ``spin_us``) raises the budget to 1.5x that turnaround, at most
    ``IN_PLACE_GROWTH`` times ``spin_us``: the next wait catches an answer later than
    ``spin_us`` in place. Waits that hit at once bring it back down to ``spin_us``."""
    loop = asyncio.get_running_loop()
    spin_us = 200
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=spin_us)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    assert r.statistics()["in_place_budget_us"] == spin_us
    slow = loop.create_future()
    slow_id = r.register(future_handler, slow)
    task = asyncio.create_task(r.wait(slow))
    await _yield_while(lambda: not r.schedule.suspended, "the slow wait")
    assert r.statistics()["in_place_missed"] == 1
    await asyncio.sleep(0.005)  # the answer comes 5 ms later
    cq.add(_wc(slow_id))
    assert (await asyncio.wait_for(task, 2)).wr_id == slow_id
    cap = IN_PLACE_GROWTH * spin_us
    assert r.statistics()["in_place_budget_us"] == cap  # 1.5 x 5 ms, capped
    # the next answer, 4x spin_us after the wait began, is caught in place
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    later = loop.create_future()
    _arrives_after(cq, _wc(r.register(future_handler, later)), 4 * spin_us * 1e-6)
    assert r.wait_in_place(later) is True
    assert r.statistics()["in_place_missed"] == 1
    # answers already there: the budget decays back to spin_us (bounded)
    for _ in range(400):
        if r.statistics()["in_place_budget_us"] == spin_us:
            break
        await asyncio.sleep(0)  # a loop turn: a fresh hold
        await asyncio.sleep(0)
        quick = loop.create_future()
        cq.add(_wc(r.register(future_handler, quick)))
        assert r.wait_in_place(quick) is True
    assert r.statistics()["in_place_budget_us"] == spin_us
    await _poll_loop_ends(r)
    r.close()


async def test_the_in_place_budget_stays_when_the_answer_needs_the_loop() -> None:
    """A peer on the same loop answers as soon as the loop turns, however long the wait
    held it: such a miss (its answer came soon after it suspended) leaves the budget
    alone, so it does not grow the time every later miss wastes."""
    loop = asyncio.get_running_loop()
    spin_us = 5000
    r = CQReactor(FakeCtx(), loop, mode="polling", spin_us=spin_us)  # type: ignore[arg-type]
    cq: FakeCQ = r.acquire_cq(8)  # type: ignore[assignment]
    fut = loop.create_future()
    fut_id = r.register(future_handler, fut)
    task = asyncio.create_task(r.wait(fut))
    await _yield_while(lambda: not r.schedule.suspended, "the wait")
    cq.add(_wc(fut_id))  # the peer's answer, on the loop's first turn
    assert (await asyncio.wait_for(task, 2)).wr_id == fut_id
    st = r.statistics()
    assert st["in_place_missed"] == 1 and st["in_place_budget_us"] == spin_us
    await _poll_loop_ends(r)
    r.close()
