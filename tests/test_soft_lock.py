"""The soft device's lock (``_core.DeviceLock``): ``threading.Lock``'s contract, a
blocking acquire that lets other threads run, and mutual exclusion between threads."""

from __future__ import annotations

import threading
import time

import pytest

from aiordma.verbs.soft._core import DeviceLock

T = 10.0  # bound on every wait here


def test_acquire_release_locked_and_with() -> None:
    lock = DeviceLock()
    assert not lock.locked()
    assert lock.acquire() is True and lock.locked()
    assert lock.acquire(blocking=False) is False  # held: not taken twice
    lock.release()
    assert not lock.locked()
    with lock:
        assert lock.locked()
        assert lock.acquire(False) is False
    assert not lock.locked()
    assert lock.acquire(blocking=False) is True
    lock.release()
    with pytest.raises(ValueError):
        lock.acquire(timeout=1.0)
    assert not lock.locked()


def test_a_blocked_acquire_lets_the_holder_run_and_another_thread_may_release() -> None:
    """The waiter blocks without the GIL (this thread keeps running Python while it
    waits), gets the lock once it is released, and the lock may be released by a
    thread other than the one that took it (as CPython's lock may)."""
    lock = DeviceLock()
    lock.acquire()
    got = threading.Event()

    def waiter() -> None:
        lock.acquire()
        got.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    spins = 0
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # Python runs here while the waiter is blocked
        spins += 1
    assert spins > 0 and not got.is_set()
    lock.release()
    assert got.wait(T)
    t.join(T)
    assert lock.locked()  # the waiter holds it; this thread releases it
    lock.release()
    assert not lock.locked()


def test_threads_exclude_each_other() -> None:
    """Two threads each add 1 to a shared counter 200 times, reading it, giving up the
    GIL, then writing it back, inside the lock: no update is lost."""
    lock = DeviceLock()
    box = [0]
    rounds = 200

    def add() -> None:
        for _ in range(rounds):
            with lock:
                v = box[0]
                time.sleep(0)  # the other thread runs here; it must wait for the lock
                box[0] = v + 1

    threads = [threading.Thread(target=add, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert not any(t.is_alive() for t in threads)
    assert box[0] == 2 * rounds and not lock.locked()
