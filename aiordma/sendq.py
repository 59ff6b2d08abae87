"""Send-queue accounting for one QP with selective signaling (no event loop here).

Hardware frees the send-queue slots of unsignaled WRs only when a later *signaled* WR
of the same QP completes, and an error completion is generated even for unsignaled WRs.
``SendQueue`` mirrors that: ``used`` counts every posted WR until a completion at or
after it is seen; ``complete(wr_id)`` returns the entries it retires, oldest first, so
the caller can resolve the unsignaled ones as successful and the last one with the
completion's own status.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class SendQueue:
    """In-order record of posted send WRs: (wr_id, op) pairs."""

    __slots__ = ("depth", "signal_interval", "_q", "_since_signal", "_last_signaled")

    def __init__(self, depth: int, signal_interval: int = 16) -> None:
        if depth < 1 or signal_interval < 1:
            raise ValueError("depth and signal_interval must be >= 1")
        self.depth = depth
        self.signal_interval = min(signal_interval, depth)
        self._q: deque[tuple[int, Any]] = deque()
        self._since_signal = 0
        self._last_signaled = -1

    @property
    def used(self) -> int:
        return len(self._q)

    @property
    def awaited(self) -> bool:
        """True while a signaled WR is outstanding. The unsignaled WRs after the last
        signaled one may have finished without a completion, and only a later signaled
        WR (or their own error) retires them: nobody can wait for them."""
        q = self._q
        return bool(q) and q[0][0] <= self._last_signaled

    @property
    def room(self) -> int:
        return self.depth - len(self._q)

    def push(self, wr_id: int, op: Any, *, last_in_batch: bool) -> bool:
        """Record a WR about to be posted (``wr_id`` larger than any before); returns
        whether to signal it.

        Signaled: ``last_in_batch`` (the caller passes it for the last WR of a batch that
        somebody waits for, so each await finishes), every ``signal_interval``-th WR, and
        any WR that fills the queue. Raises OverflowError when the queue is full (caller
        bug).
        """
        if len(self._q) >= self.depth:
            raise OverflowError("send queue full")
        self._q.append((wr_id, op))
        self._since_signal += 1
        signal = (last_in_batch or self._since_signal >= self.signal_interval
                  or len(self._q) == self.depth)
        if signal:
            self._since_signal = 0
            self._last_signaled = wr_id
        return signal

    def complete(self, wr_id: int) -> list[tuple[int, Any]]:
        """Retire every entry up to and including ``wr_id`` (oldest first).

        Returns [] when ``wr_id`` is not queued (already retired).
        """
        q = self._q
        if not q or wr_id < q[0][0]:  # wr_ids come from a counter: increasing per QP
            return []
        out = []
        while q:
            item = q.popleft()
            out.append(item)
            if item[0] == wr_id:
                break
        return out

    def drain(self) -> list[tuple[int, Any]]:
        """Remove and return every entry (teardown after the QP is destroyed)."""
        out = list(self._q)
        self._q.clear()
        return out
