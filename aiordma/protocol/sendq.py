"""Send-queue accounting for one QP with selective signaling (no event loop here).

Hardware frees the send-queue slots of unsignaled WRs only when a later *signaled* WR
of the same QP completes, and an error completion is generated even for unsignaled WRs.
``SendQueue`` mirrors that: ``used`` counts every posted WR until a completion at or
after it is seen; ``complete(wr_id)`` returns the entries it retires, oldest first, so
the caller can resolve the unsignaled ones as successful and the last one with the
completion's own status.

Why the byte bound: an operation's completion is reported only by the next signaled
WR, so the tasks awaiting a batch's operations all resume when its last WR completes.
For small frames that is the point (one completion per batch). For large transfers
it delays every operation of a batch until the whole batch is done, and a window of
them drains completely before anything is posted again. So a WR is also signaled
once ``signal_bytes`` have been posted since the last signaled one. The price is a
completion, usually a wake-up, per large operation (docs/benchmarks.md has the
measurements).
"""

from __future__ import annotations

from collections import deque
from typing import Any


class SendQueue:
    """In-order record of posted send WRs: (wr_id, op) pairs."""

    __slots__ = ("depth", "signal_interval", "signal_bytes", "_q", "_since_signal",
                 "_bytes_since", "_last_signaled")

    def __init__(self, depth: int, signal_interval: int = 16,
                 signal_bytes: int = 64 * 1024) -> None:
        if depth < 1 or signal_interval < 1 or signal_bytes < 1:
            raise ValueError("depth, signal_interval and signal_bytes must be >= 1")
        self.depth = depth
        self.signal_interval = min(signal_interval, depth)
        self.signal_bytes = signal_bytes
        self._q: deque[tuple[int, Any]] = deque()
        self._since_signal = 0
        self._bytes_since = 0
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

    def push(self, wr_id: int, op: Any, *, last_in_batch: bool, nbytes: int = 0) -> bool:
        """Record a WR about to be posted (``wr_id`` larger than any before) that moves
        ``nbytes``; returns whether to signal it.

        Signaled: ``last_in_batch`` (the caller passes it for the last WR of a batch that
        somebody waits for, so each await finishes), every ``signal_interval``-th WR, a
        WR that brings the bytes posted since the last signaled one to ``signal_bytes``,
        and any WR that fills the queue. Raises OverflowError when the queue is full
        (caller bug).
        """
        if len(self._q) >= self.depth:
            raise OverflowError("send queue full")
        self._q.append((wr_id, op))
        self._since_signal += 1
        self._bytes_since += nbytes
        signal = (last_in_batch or self._since_signal >= self.signal_interval
                  or self._bytes_since >= self.signal_bytes or len(self._q) == self.depth)
        if signal:
            self._since_signal = 0
            self._bytes_since = 0
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

    def entries(self) -> deque[tuple[int, Any]]:
        """The posted entries, oldest first (a view: do not change it)."""
        return self._q

    def drain(self) -> list[tuple[int, Any]]:
        """Remove and return every entry (teardown after the QP is destroyed)."""
        out = list(self._q)
        self._q.clear()
        return out
