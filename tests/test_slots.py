"""protocol/slots.Slots: the eager buffers' bookkeeping (no loop, no provider)."""

from __future__ import annotations

from typing import Any

import pytest

from aiordma.memory import SlotPool
from aiordma.protocol.engine import Slots


def test_slots_hand_out_each_buffer_once_and_take_it_back() -> None:
    s = Slots(memoryview(bytearray(64)), 0x1000, 7, 16, 4)
    got = [s.acquire() for _ in range(4)]
    assert sorted(i for i in got if i is not None) == [0, 1, 2, 3]
    assert s.available == 0 and s.acquire() is None
    s.release(2)
    assert s.available == 1 and s.acquire() == 2 and s.in_use(2)
    s.release(2)
    assert not s.in_use(2)
    with pytest.raises(ValueError, match="not in use"):
        s.release(2)
    assert s.addr(3) == 0x1000 + 48 and s.lkey == 7


def test_a_slot_is_a_view_of_its_part_of_the_region() -> None:
    buf = bytearray(32)
    s = Slots(memoryview(buf), 0, 0, 8, 4)
    s.slot(1)[:] = b"abcdefgh"
    s.slot(2, 3)[:] = b"xyz"
    assert bytes(buf[8:19]) == b"abcdefghxyz" and len(s.slot(0)) == 8
    assert repr(s) == "<Slots 4x8 free=4>"
    got = s.bytes_at(9, 4)
    assert got == b"bcde" and type(got) is bytes
    buf[9] = 0  # a copy, not a view
    assert got == b"bcde"


def test_a_slot_pool_copies_out_of_its_mapping(ctx: Any) -> None:
    pd = ctx.alloc_pd()
    pool = SlotPool(pd, 16, 4)
    try:
        pool.slot(1)[:] = bytes(range(16))
        got = pool.bytes_at(18, 5)
        assert got == bytes(range(2, 7)) and type(got) is bytes
    finally:
        pool.close()
        pd.close()


@pytest.mark.parametrize("size,count,region", [(0, 1, 8), (8, 0, 8), (8, 2, 15)])
def test_bad_geometry_is_refused(size: int, count: int, region: int) -> None:
    with pytest.raises(ValueError):
        Slots(memoryview(bytearray(region)), 0, 0, size, count)
