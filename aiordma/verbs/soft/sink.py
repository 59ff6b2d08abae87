"""Where a payload goes: a ``Sink`` of registered-memory slices (or nowhere).

The connection's input parser (conn.py) copies staged bytes into a sink, or receives
the rest of a large payload straight into its ``target()``; when all ``length`` bytes
are in, it runs the sink's ``job`` (device lock released) and then its ``on_done``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

#: the size of a connection's input staging buffer (conn.py); discarded payloads are
#: received into one shared scratch buffer of that size
STAGE_SIZE: Final = 256 * 1024
_scratch = memoryview(bytearray(STAGE_SIZE))
#: pieces up to this size are copied through a temporary bytes slice (cheaper than a
#: memoryview per packet); larger ones from a memoryview of the staging buffer
SMALL_COPY: Final = 4096


class Sink:
    """Destination of ``length`` payload bytes: ``segs`` (None = discard), then ``job``
    (device lock released), then ``on_done`` (lock held)."""

    __slots__ = ("segs", "idx", "off", "remaining", "on_done", "job")

    def __init__(self, segs: list[memoryview] | None, length: int,
                 on_done: Callable[[], None] | None = None,
                 job: Callable[[], None] | None = None) -> None:
        self.segs = segs
        self.idx = 0
        self.off = 0
        self.remaining = length
        self.on_done = on_done
        self.job = job

    def target(self) -> memoryview:
        """Where the next bytes go (at most ``remaining``)."""
        if self.segs is None:
            return _scratch[: min(self.remaining, STAGE_SIZE)]
        seg = self.segs[self.idx]
        while self.off >= len(seg):
            self.idx += 1
            self.off = 0
            seg = self.segs[self.idx]
        return seg[self.off:]

    def advance(self, n: int) -> None:
        self.remaining -= n
        if self.segs is not None:
            self.off += n

    def feed(self, stage: bytearray, view: memoryview, start: int, end: int) -> int:
        """Copy from the staged bytes ``stage[start:end]`` (``view``: a memoryview of
        ``stage``); returns how many were consumed. A small piece is copied through a
        bytearray slice (no memoryview made per packet), a large one from ``view``
        (no second copy)."""
        used = start
        segs = self.segs
        while end > used and self.remaining:
            if segs is None:
                k = min(end - used, self.remaining)
            else:
                seg = segs[self.idx]
                off = self.off
                while off >= len(seg):
                    self.idx += 1
                    off = self.off = 0
                    seg = segs[self.idx]
                k = min(min(end - used, len(seg) - off), self.remaining)  # (2-arg min: C)
                seg[off:off + k] = (stage[used:used + k] if k <= SMALL_COPY
                                    else view[used:used + k])
            self.advance(k)
            used += k
        return used - start


def discard(length: int) -> Sink | None:
    return Sink(None, length) if length else None
