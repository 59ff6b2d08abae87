"""The engine's queues (``Fifo``): deque's behaviour for what the engine and the endpoint
use, through growth and wrap-around, and items the garbage collector can reach."""

from __future__ import annotations

import gc
import random
import weakref
from collections import deque
from typing import Any

import pytest

from aiordma.protocol.engine import Fifo


def test_it_behaves_as_a_deque_through_growth_and_wrap_around() -> None:
    rng = random.Random(7)
    q: Fifo[int] = Fifo()
    ref: deque[int] = deque()
    for step in range(5000):  # bounded: capacities 8 to 512 and back, many wraps
        r = rng.random()
        if r < 0.5 or not ref:
            q.append(step)
            ref.append(step)
        elif r < 0.9:
            assert q.popleft() == ref.popleft()
        elif r < 0.95:
            items = [step + 0.5, step + 0.25]
            q.extend(iter(items))  # type: ignore[arg-type]
            ref.extend(items)  # type: ignore[arg-type]
        else:
            victim = ref[rng.randrange(len(ref))]
            q.remove(victim)
            ref.remove(victim)
        assert len(q) == q.n == len(ref) and bool(q) == bool(ref)
        if ref:
            assert q[0] == ref[0] and q[-1] == ref[-1]
            i = rng.randrange(len(ref))
            assert q[i] == ref[i] and q[-1 - i] == ref[-1 - i]
        if step % 97 == 0:
            assert list(q) == list(ref)
    q.clear()
    assert len(q) == 0 and not q and list(q) == []
    q.append(1)
    assert list(q) == [1] and repr(q) == "Fifo([1])"


def test_errors_are_deque_s() -> None:
    q: Fifo[Any] = Fifo()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(IndexError):
        q[0]
    q.append("a")
    with pytest.raises(IndexError):
        q[1]
    with pytest.raises(IndexError):
        q[-2]
    with pytest.raises(ValueError):
        q.remove("b")
    assert list(q) == ["a"]  # a failed remove changes nothing


def test_iteration_is_over_a_snapshot() -> None:
    q: Fifo[int] = Fifo()
    q.extend(range(20))
    seen = []
    for x in q:
        seen.append(x)
        if x < 5:
            q.popleft()
            q.append(100 + x)
    assert seen == list(range(20))
    assert list(q) == [*range(5, 20), *range(100, 105)]


def test_a_cycle_through_the_queue_is_collected() -> None:
    class Item:
        q: Any = None

    q: Fifo[Item] = Fifo()
    item = Item()
    item.q = q  # the queue holds the item, the item the queue
    q.append(item)
    gone = weakref.ref(item)
    del q, item
    gc.collect()
    assert gone() is None
