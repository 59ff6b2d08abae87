# Send-queue accounting for one QP with selective signaling (included by engine.pyx).
#
# Hardware frees the send-queue slots of unsignaled WRs only when a later *signaled* WR
# of the same QP completes, and an error completion is generated even for unsignaled WRs.
# ``SendQueue`` mirrors that: ``used`` counts every posted WR until a completion at or
# after it is seen; ``complete(wr_id)`` returns the entries it retires, oldest first, so
# the caller can resolve the unsignaled ones as successful and the last one with the
# completion's own status.
#
# Why the byte bound: an operation's completion is reported only by the next signaled
# WR, so the tasks awaiting a batch's operations all resume when its last WR completes.
# For small frames that is the point (one completion per batch). For large transfers
# it delays every operation of a batch until the whole batch is done, and a window of
# them drains completely before anything is posted again. So a WR is also signaled
# once ``signal_bytes`` have been posted since the last signaled one. The price is a
# completion, usually a wake-up, per large operation (docs/benchmarks.md has the
# measurements).


cdef class SendQueue:
    """In-order record of posted send WRs: (wr_id, op) pairs, a C ring of ``depth``."""

    def __init__(self, int depth, int signal_interval=16, signal_bytes=64 * 1024):
        if depth < 1 or signal_interval < 1 or signal_bytes < 1:
            raise ValueError("depth, signal_interval and signal_bytes must be >= 1")
        if self._q != NULL:
            raise RuntimeError("SendQueue is initialised once")
        self.depth = depth
        self.signal_interval = min(signal_interval, depth)
        self.signal_bytes = signal_bytes
        self._q = <sq_entry_t *>calloc(depth, sizeof(sq_entry_t))
        if self._q == NULL:
            raise MemoryError()
        self._head = 0
        self._n = 0
        self._since_signal = 0
        self._bytes_since = 0
        self._last_signaled = 0
        self._signaled_any = False

    def __dealloc__(self):
        cdef int i
        if self._q != NULL:
            for i in range(self._n):
                Py_DECREF(<object>self._q[(self._head + i) % self.depth].op)
            free(self._q)

    @property
    def used(self):
        return self._n

    @property
    def awaited(self):
        """True while a signaled WR is outstanding. The unsignaled WRs after the last
        signaled one may have finished without a completion, and only a later signaled
        WR (or their own error) retires them: nobody can wait for them."""
        # (unsigned: the engine's own wr_ids have the top bit set, which as a signed
        # number would compare below every earlier one)
        return (self._n > 0 and self._signaled_any
                and self._q[self._head].wr_id <= self._last_signaled)

    @property
    def room(self):
        return self.depth - self._n

    cdef bint push_c(self, uint64_t wr_id, object op, bint last_in_batch, int64_t nbytes) except -1:
        cdef bint signal
        cdef sq_entry_t *e
        if self._n >= self.depth:
            raise OverflowError("send queue full")
        e = &self._q[(self._head + self._n) % self.depth]
        e.wr_id = wr_id
        Py_INCREF(op)
        e.op = <void *>op
        self._n += 1
        self._since_signal += 1
        self._bytes_since += nbytes
        signal = (last_in_batch or self._since_signal >= self.signal_interval
                  or self._bytes_since >= self.signal_bytes or self._n == self.depth)
        if signal:
            self._since_signal = 0
            self._bytes_since = 0
            self._last_signaled = wr_id
            self._signaled_any = True
        return signal

    def push(self, wr_id, op, *, bint last_in_batch, nbytes=0):
        """Record a WR about to be posted (``wr_id`` larger than any before) that moves
        ``nbytes``; returns whether to signal it.

        Signaled: ``last_in_batch`` (the caller passes it for the last WR of a batch that
        somebody waits for, so each await finishes), every ``signal_interval``-th WR, a
        WR that brings the bytes posted since the last signaled one to ``signal_bytes``,
        and any WR that fills the queue. Raises OverflowError when the queue is full
        (caller bug)."""
        return self.push_c(wr_id, op, last_in_batch, nbytes)

    cdef int count_to(self, uint64_t wr_id) noexcept:
        """How many entries ``complete(wr_id)`` retires (0: not queued)."""
        cdef int i
        if not self._n or wr_id < self._q[self._head].wr_id:
            return 0
        for i in range(self._n):
            if self._q[(self._head + i) % self.depth].wr_id == wr_id:
                return i + 1
        return self._n

    cdef object pop_c(self, uint64_t *wr_id):
        """Remove the oldest entry; its op (the queue's reference passes to the caller)."""
        cdef sq_entry_t *e = &self._q[self._head]
        op = <object>e.op
        wr_id[0] = e.wr_id
        Py_DECREF(op)  # (the local reference keeps it)
        e.op = NULL
        self._head = (self._head + 1) % self.depth
        self._n -= 1
        return op

    def complete(self, wr_id):
        """Retire every entry up to and including ``wr_id`` (oldest first).

        Returns [] when ``wr_id`` is not queued (already retired)."""
        cdef int k = self.count_to(wr_id)
        cdef uint64_t w
        out = []
        while k:
            op = self.pop_c(&w)
            out.append((w, op))
            k -= 1
        return out

    def entries(self):
        """The posted entries, oldest first (a copy)."""
        return [(self._q[(self._head + i) % self.depth].wr_id,
                 <object>self._q[(self._head + i) % self.depth].op) for i in range(self._n)]

    def drain(self):
        """Remove and return every entry (teardown after the QP is destroyed)."""
        cdef uint64_t w
        out = []
        while self._n:
            op = self.pop_c(&w)
            out.append((w, op))
        return out
