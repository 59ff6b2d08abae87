"""The receivers' turns (aiordma.receiving.ReceiverTurns): asyncio.Lock's contract."""

from __future__ import annotations

import asyncio

import pytest

from aiordma.receiving import ReceiverTurns


async def test_a_free_turn_is_taken_at_once_and_given_back() -> None:
    turns = ReceiverTurns(asyncio.get_running_loop())
    assert turns.take() and turns.held
    assert not turns.take()  # held: nobody else takes it
    turns.give()
    assert not turns.held and turns.take()


async def test_giving_a_turn_not_held_raises() -> None:
    turns = ReceiverTurns(asyncio.get_running_loop())
    with pytest.raises(RuntimeError):
        turns.give()


async def test_waiters_get_the_turn_first_come_first_served() -> None:
    turns = ReceiverTurns(asyncio.get_running_loop())
    order: list[int] = []

    async def receiver(i: int) -> None:
        await turns.wait()
        order.append(i)
        await asyncio.sleep(0)
        turns.give()

    assert turns.take()
    tasks = [asyncio.ensure_future(receiver(i)) for i in range(5)]
    for _ in range(3):
        await asyncio.sleep(0)  # every receiver is in line
    assert not turns.take()  # a newcomer does not jump the line
    turns.give()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2, 3, 4]
    assert not turns.held


async def test_a_waiter_cancelled_in_line_does_not_hold_up_the_next() -> None:
    turns = ReceiverTurns(asyncio.get_running_loop())
    got: list[str] = []

    async def receiver(name: str) -> None:
        await turns.wait()
        got.append(name)
        turns.give()

    assert turns.take()
    first = asyncio.ensure_future(receiver("first"))
    second = asyncio.ensure_future(receiver("second"))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    turns.give()
    await asyncio.wait_for(second, 5)
    assert got == ["second"]
    assert first.cancelled() and not turns.held


async def test_a_waiter_cancelled_after_it_was_woken_hands_the_turn_on() -> None:
    turns = ReceiverTurns(asyncio.get_running_loop())
    got: list[str] = []

    async def receiver(name: str) -> None:
        await turns.wait()
        got.append(name)
        turns.give()

    assert turns.take()
    first = asyncio.ensure_future(receiver("first"))
    second = asyncio.ensure_future(receiver("second"))
    await asyncio.sleep(0)
    turns.give()  # wakes the first ...
    first.cancel()  # ... which is cancelled before it runs
    await asyncio.wait_for(second, 5)
    assert got == ["second"]
    assert first.cancelled() and not turns.held


async def test_a_cancelled_waiter_ahead_does_not_stop_taking_a_free_turn() -> None:
    turns = ReceiverTurns(asyncio.get_running_loop())
    assert turns.take()
    waiter = asyncio.ensure_future(turns.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    turns.give()  # its future is cancelled: it does not count as ahead
    assert turns.take()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 5)
    assert turns.held
