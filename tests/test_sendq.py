"""Send-queue accounting with selective signaling (aiordma.protocol.engine), no loop or provider."""

from __future__ import annotations

import pytest

from aiordma.protocol.engine import SendQueue


def test_signals_last_in_batch_interval_and_full_queue() -> None:
    sq = SendQueue(depth=8, signal_interval=3)
    got = [sq.push(i, f"op{i}", last_in_batch=False) for i in range(1, 4)]
    assert got == [False, False, True]  # the interval
    assert sq.push(4, "op4", last_in_batch=True)  # the batch end
    got = [sq.push(i, f"op{i}", last_in_batch=False) for i in range(5, 9)]
    assert got == [False, False, True, True]  # 7: interval; 8 fills the queue
    assert sq.used == 8 and sq.room == 0
    with pytest.raises(OverflowError):
        sq.push(9, "op9", last_in_batch=True)


def test_complete_retires_everything_up_to_the_completion() -> None:
    sq = SendQueue(depth=8, signal_interval=8)
    for i in (1, 2, 3):
        sq.push(i, f"op{i}", last_in_batch=i == 3)
    assert sq.complete(0) == []
    assert sq.complete(2) == [(1, "op1"), (2, "op2")]  # an error of unsignaled 2
    assert sq.complete(2) == []  # already retired
    assert sq.complete(3) == [(3, "op3")]
    assert sq.used == 0 and sq.drain() == []


def test_awaited_ignores_an_unsignaled_tail() -> None:
    """WRs nobody waits for may be posted unsignaled after the last signaled one: they
    can finish without a completion, so they must not count as outstanding work."""
    sq = SendQueue(depth=8, signal_interval=8)
    assert not sq.awaited
    assert sq.push(10, "data", last_in_batch=True)
    assert not sq.push(11, "credit", last_in_batch=False)
    assert sq.awaited and sq.used == 2
    assert sq.complete(10) == [(10, "data")]
    assert not sq.awaited and sq.used == 1  # only the unsignaled CREDIT is left
    assert not sq.push(12, "rndv", last_in_batch=False)
    assert sq.push(13, "close", last_in_batch=True)
    assert sq.awaited
    assert [w for w, _ in sq.complete(13)] == [11, 12, 13]  # the tail retires with it
    assert not sq.awaited and sq.used == 0


@pytest.mark.parametrize("base", [0, 1 << 63], ids=["small", "engine-c-path"])
def test_awaited_with_wr_ids_of_the_top_bit(base: int) -> None:
    """The engine's C path numbers its WRs with the top bit of 64 set: an unsignaled
    WR, alone or after a retired signaled one, is still not awaited (compared as signed
    numbers every such wr_id looked below the last signaled one)."""
    sq = SendQueue(depth=8, signal_interval=8)
    assert not sq.push(base + 1, "credit", last_in_batch=False)
    assert not sq.awaited and sq.used == 1
    assert sq.push(base + 2, "data", last_in_batch=True)
    assert sq.awaited
    assert [w for w, _ in sq.complete(base + 2)] == [base + 1, base + 2]
    assert not sq.push(base + 3, "credit", last_in_batch=False)
    assert not sq.awaited and sq.used == 1


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        SendQueue(0)
    with pytest.raises(ValueError):
        SendQueue(4, 0)
    assert SendQueue(4, 16).signal_interval == 4


def test_signals_once_signal_bytes_were_posted_unsignaled() -> None:
    """Large transfers in one batch each report their own completion: a WR is signaled
    once the bytes since the last signaled one reach ``signal_bytes``."""
    sq = SendQueue(depth=16, signal_interval=16, signal_bytes=64 * 1024)
    got = [sq.push(i, "w", last_in_batch=i == 4, nbytes=64 * 1024) for i in range(1, 5)]
    assert got == [True, True, True, True]
    got = [sq.push(i, "w", last_in_batch=i == 12, nbytes=16 * 1024) for i in range(5, 13)]
    assert got == [False, False, False, True, False, False, False, True]  # 64 KiB, end
    # small frames: the batch end and the interval only; the counter restarts at a signal
    got = [sq.push(i, "f", last_in_batch=False, nbytes=60 * 1024) for i in (13, 14)]
    assert got == [False, True]
    with pytest.raises(ValueError):
        SendQueue(4, 4, 0)
