"""Fixed-size buffer slots in one memory region: which are free (no loop, no provider).

The engine's eager buffers (the send frames and the receive buffers) are slots of one
registered region each; ``Slots`` keeps their bookkeeping over the region's view, its
address and its key. ``aiordma.memory.SlotPool`` makes and registers the region.
"""

from __future__ import annotations

__all__ = ["Slots"]


class Slots:
    """``count`` slots of ``slot_size`` bytes in ``view``, the memory at address ``base``
    with local key ``lkey``.

    ``acquire()`` returns a free slot index, or None when none is free; ``release(i)``
    gives slot ``i`` back and raises ValueError when it is not in use. Not thread-safe
    (the loop thread only). Raises ValueError for a non-positive size or count, or a
    view too small for them.
    """

    def __init__(self, view: memoryview, base: int, lkey: int, slot_size: int,
                 count: int) -> None:
        if slot_size <= 0 or count <= 0:
            raise ValueError("slot_size and count must be positive")
        if len(view) < slot_size * count:
            raise ValueError(f"{count} slots of {slot_size} bytes do not fit in {len(view)}")
        self.view = view
        self.base = base
        self.lkey = lkey
        self.slot_size = slot_size
        self.count = count
        self._free = list(range(count - 1, -1, -1))
        self._used = bytearray(count)

    @property
    def available(self) -> int:
        """How many slots are free."""
        return len(self._free)

    def acquire(self) -> int | None:
        if not self._free:
            return None
        i = self._free.pop()
        self._used[i] = 1
        return i

    def release(self, i: int) -> None:
        if not self._used[i]:
            raise ValueError(f"slot {i} is not in use")
        self._used[i] = 0
        self._free.append(i)

    def in_use(self, i: int) -> bool:
        return bool(self._used[i])

    def bytes_at(self, offset: int, length: int) -> bytes:
        """A copy of ``length`` bytes at ``offset`` in the region."""
        return bytes(self.view[offset: offset + length])

    def addr(self, i: int) -> int:
        """The address of slot ``i``."""
        return self.base + i * self.slot_size

    def slot(self, i: int, length: int | None = None) -> memoryview:
        """The first ``length`` bytes (default: all) of slot ``i``, a view."""
        off = i * self.slot_size
        return self.view[off: off + (self.slot_size if length is None else length)]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.count}x{self.slot_size} free={len(self._free)}>"
