# The completion side of the verbs provider's compiled data path, included by
# fastpath.pyx: ``CQPoller`` polls a CQ into a C array of ``struct ibv_wc`` and arms it,
# ``ChannelEvents`` reads and acknowledges a completion channel's events, counting them
# in each CQ's ``CQEvents``.

cdef class _Tracked:
    """A QP whose completions a CQPoller accounts for (CQPoller.track)."""


cdef class CQPoller:
    """Polls one CQ (``struct ibv_cq *`` as an int) into this object's array of
    ``entries`` ``struct ibv_wc``. The caller keeps the CQ alive and calls ``close()``
    before destroying it (``IbvCQ`` does); no Python object held, as ``QPPoster``. One
    thread polls at a time."""

    def __cinit__(self, uintptr_t cq_ptr, int entries=64):
        if cq_ptr == 0:
            raise ValueError("NULL struct ibv_cq *")
        if entries < 1:
            raise ValueError("entries must be at least 1")
        self.wcs = <ibv_wc *>calloc(entries, sizeof(ibv_wc))
        if self.wcs == NULL:
            raise MemoryError()
        self.cq = <ibv_cq *>cq_ptr
        self.entries = entries
        self.tracked = {}

    def __dealloc__(self):
        free(self.wcs)

    def close(self):
        """Poll nothing from now on."""
        self.cq = NULL

    def attach(self, owner):
        """For the C-level poll (``cq_ops``): a weak reference to the ``IbvCQ`` (told
        of an overrun through it)."""
        self.owner = owner

    def track(self, uint32_t qp_num, WorkQueues queues not None, bint send_side,
              bint recv_side, qp):
        """The C-level poll accounts for the completions of QP ``qp_num`` in
        ``queues``; ``send_side``/``recv_side``: whether this CQ is its send and/or
        receive CQ; ``qp``: a weak reference to its ``IbvQP`` (moved to ERR by an error
        completion)."""
        cdef _Tracked t = _Tracked()
        t.qp_num = qp_num
        t.queues = queues
        t.send_side = send_side
        t.recv_side = recv_side
        t.qp = qp
        self.tracked[qp_num] = t
        self.last = None

    def untrack(self, uint32_t qp_num):
        """Forget QP ``qp_num`` (destroyed)."""
        self.tracked.pop(qp_num, None)
        self.last = None

    def tracked_qps(self):
        """The qp_nums ``track`` was given (and not ``untrack``), sorted."""
        return sorted(self.tracked)

    cdef int poll_array(self, int n) noexcept nogil:
        """``ibv_poll_cq`` of up to ``n`` (at most ``entries``) completions into
        ``wcs``: their number, 0 when none (or closed), negative on a CQ error."""
        if self.cq == NULL or n <= 0:
            return 0
        if n > self.entries:
            n = self.entries
        return ibv_poll_cq(self.cq, n, self.wcs)

    cdef int arm(self, int solicited_only) noexcept nogil:
        """``ibv_req_notify_cq``: the next completion queues one event on the CQ's
        channel; 0, or an errno value (EBADF once closed)."""
        if self.cq == NULL:
            return EBADF
        return ibv_req_notify_cq(self.cq, solicited_only)

    def req_notify(self, int solicited_only=0):
        """``arm`` from Python: 0, or an errno value."""
        return self.arm(solicited_only)

    def notify(self):
        """``IbvCQ.req_notify()`` compiled (``CQ.notifier``): one channel event for the
        next completion. Raises RDMAError (EBADF once closed)."""
        cdef int rc = self.arm(0)
        if rc:
            raise RDMAError(rc, f"ibv_req_notify_cq: {os.strerror(rc)}")

    def poll(self, int n):
        """Up to ``n`` completions: ``(count, list of RawWC tuples)`` (``compat.RawWC``:
        wr_id, status, opcode, vendor_err, byte_len, imm_data as on the wire, qp_num,
        src_qp, wc_flags); a negative count is ibv_poll_cq's error, with no tuples."""
        cdef int rc = self.poll_array(n)
        cdef int i
        cdef ibv_wc *w
        if rc <= 0:
            return rc, ()
        out = []
        for i in range(rc):
            w = &self.wcs[i]
            out.append((w.wr_id, w.status, w.opcode, w.vendor_err, w.byte_len, w.imm_data,
                        w.qp_num, w.src_qp, w.wc_flags))
        return rc, out

    def __repr__(self):
        return f"<CQPoller cq={<uintptr_t>self.cq:#x} entries={self.entries}>"


cdef class CQEvents:
    """The channel-event counts of one CQ (``IbvCQ._events``): events read (``got``),
    acknowledged (``acked``), and the ``struct ibv_cq *`` (``cq_ptr``: 0 until probed or
    told by an event). C fields, so that ``ChannelEvents.next_cq`` counts an event with
    two stores and no attribute lookup on the CQ. ``cq`` is the ``IbvCQ`` it belongs to
    (what ``next_cq`` returns)."""

    def __cinit__(self, cq, uintptr_t cq_ptr=0):
        self.cq = cq
        self.cq_ptr = cq_ptr
        self.got = 0
        self.acked = 0

    def __repr__(self):
        return f"<CQEvents got={self.got} acked={self.acked}>"


cdef class ChannelEvents:
    """The events of one completion channel (``struct ibv_comp_channel *`` as an int),
    read and acknowledged through the process's ``ibv_get_cq_event`` and
    ``ibv_ack_cq_events`` (their addresses, from ``clib.libibverbs``): what
    ``clib.ChannelReader`` does through ctypes, with the same methods, at the cost of a C
    call. The caller keeps the channel alive while it uses this object, and reads from
    one thread at a time."""

    def __cinit__(self, uintptr_t channel_ptr, uintptr_t get_fn, uintptr_t ack_fn):
        if channel_ptr == 0 or get_fn == 0 or ack_fn == 0:
            raise ValueError("NULL channel or function")
        self.channel = <void *>channel_ptr
        self.get_fn = <ibv_get_cq_event_fn>get_fn
        self.ack_fn = <ibv_ack_cq_events_fn>ack_fn

    cdef int _read(self, ibv_cq **cq, void **ctx) except -1:
        """1 with the next event in ``cq`` and ``ctx``; 0 when none is queued (the
        channel's fd is non-blocking) or once closed. Raises RDMAError (an OSError) for
        a failure other than EAGAIN (EINTR is retried)."""
        cdef int err
        while self.channel != NULL:
            if self.get_fn(self.channel, cq, ctx) == 0:
                return 1
            err = errno
            if err == EINTR:
                continue
            if err == EAGAIN or err == EWOULDBLOCK:
                return 0
            raise RDMAError(err or EIO, f"ibv_get_cq_event: {_errno_name(err)}")
        return 0

    def get(self):
        """``(struct ibv_cq *, cq_context)`` of the next event; None when none is queued
        (the channel's fd is non-blocking) or once closed. Raises RDMAError (an OSError)
        for a failure other than EAGAIN (EINTR is retried)."""
        cdef ibv_cq *cq = NULL
        cdef void *ctx = NULL
        if self._read(&cq, &ctx):
            return <uintptr_t>cq, <uintptr_t>ctx
        return None

    def attach(self, dict cqs):
        """For ``next_cq``: the channel's CQs by token (``IbvCompChannel``'s table: the
        ``cq_context`` of each, as an int, to its ``CQEvents``), kept current by the
        channel."""
        self.cqs = cqs

    def close(self):
        """Read nothing from now on (``get`` and ``next_cq``): the channel was
        destroyed."""
        self.channel = NULL

    def next_cq(self):
        """``IbvCompChannel.get_event`` compiled (``CompChannel.event_reader``): the
        ``IbvCQ`` of the next event -- counted in its ``CQEvents`` (``got``, and its
        ``cq_ptr`` learnt) -- or None when none is queued (the fd is non-blocking) or
        once closed. An event of a CQ not in the table (cannot happen) is acknowledged
        at once, to keep libibverbs' count right, and skipped. Raises RDMAError for a
        failure other than EAGAIN (EINTR is retried)."""
        cdef ibv_cq *cq = NULL
        cdef void *ctx = NULL
        cdef CQEvents ev
        while self._read(&cq, &ctx):
            found = None if self.cqs is None else self.cqs.get(<uintptr_t>ctx)
            if found is None:
                self.ack_fn(cq, 1)
                continue
            ev = <CQEvents?>found
            ev.cq_ptr = <uintptr_t>cq
            ev.got += 1
            return ev.cq
        return None

    def ack(self, uintptr_t cq_ptr, unsigned int n):
        """``ibv_ack_cq_events(cq, n)``."""
        if cq_ptr == 0:
            raise ValueError("NULL struct ibv_cq *")
        self.ack_fn(<ibv_cq *>cq_ptr, n)

    def __repr__(self):
        return f"<ChannelEvents channel={<uintptr_t>self.channel:#x}>"


def _errno_name(int err):
    return _errno.errorcode.get(err, str(err))
