# Completion queues and completion channels of the soft device (included by _core.pyx).
#
# Manual progress (``SoftCompChannel.start_progress``): the channel keeps an epoll set of
# the sockets of connections whose completions land on its CQs, and exposes its fd
# (``progress_fd``). The completion reactor registers that fd with the event loop and
# calls ``progress()`` when it is readable (and while it busy-polls): the loop's thread
# then reads the sockets itself, so the wake-up that delivers the bytes also delivers
# the completions, with no thread hand-off and no pipe write. The one-sided guarantee (a
# target serves READ/WRITE/atomics without its application) is kept by the NIC thread's
# watchdog: when a channel's sockets stay readable for two watchdog ticks
# (``engine.WATCHDOG_S``) without a ``progress`` call (the loop is blocked or gone), the
# NIC thread takes the channel over until the application polls again.

cdef enum:
    _ARM_NONE = 0
    _ARM_ANY = 1
    _ARM_SOLICITED = 2
    _EPOLL_BATCH = 64


cdef class SoftCompChannel:
    """The soft device's completion channel: manual progress (``CompChannel``) is what
    lets the event loop's own wake-up move the device's bytes."""

    manual_progress = True

    def __init__(self, ctx):
        self._ctx = ctx
        self._lock = ctx._engine.lock
        self._flag = PipeFlag()
        self.fd = self._flag.fd
        self._events = collections.deque()  # (never replaced: its bound methods are kept)
        self._events_append = self._events.append
        self._events_popleft = self._events.popleft
        self._ncqs = 0
        self._closed = False
        self._ep = -1
        self.progress_fd = -1
        self._conns = {}  # fd -> connection driven by this channel
        self._consumer = 0  # thread id of the poller (the event loop)
        self._quiet = False  # in progress(quiet=True): events need no pipe write
        self._serviced = 0  # progress() calls by the consumer (the watchdog's clock)
        self._seen = -1  # _serviced at the watchdog's last tick
        self._suspect = False
        self.takeover = False  # the NIC thread drives the sockets (consumer stalled)
        self._acks = set()  # QPs whose coalesced ACK waits for flush()

    def __dealloc__(self):
        if self._ep >= 0:
            close(self._ep)

    cdef bint is_consumer(self) noexcept:
        return <long>PyThread_get_thread_ident() == self._consumer

    cdef void post_event(self, SoftCQ cq):
        """Queue an event for ``cq`` (device lock held)."""
        self._events_append(cq)
        if not (self._quiet and self.is_consumer()):
            self._flag.raise_c()

    # --- manual progress ------------------------------------------------------------------
    def start_progress(self):
        """Switch to manual progress driven by the calling thread; returns the fd to
        watch (readable when ``progress()`` has work). Idempotent."""
        self._lock.acquire_c()
        try:
            if self._closed:
                raise RDMAError(_errno.EBADF, "completion channel is closed")
            if self._ep < 0:
                self._ep = epoll_create1(EPOLL_CLOEXEC)
                if self._ep < 0:  # (as select.epoll(): EMFILE is the caller's to name)
                    raise OSError(errno, os.strerror(errno))
                self.progress_fd = self._ep
                self._ctx._engine.add_progress_channel(self)
            self._consumer = <long>PyThread_get_thread_ident()
            return self.progress_fd
        finally:
            self._lock.release_c()

    @property
    def manual(self):
        return self._ep >= 0 and not self._closed

    cdef void set_interest(self, Conn conn, int ev):
        """Register ``conn``'s socket for ``ev`` (selectors.EVENT_* bits) in our epoll
        set; 0 removes it. Lock held, any thread."""
        cdef epoll_event e
        cdef int fd = conn.fd
        if self._ep < 0 or conn.sock is None or fd < 0:
            return
        e.events = (EPOLLIN if ev & 1 else 0) | (EPOLLOUT if ev & 2 else 0)
        e.data.u64 = 0
        e.data.fd = fd
        if not e.events:
            if self._conns.pop(fd, None) is not None:
                epoll_ctl(self._ep, EPOLL_CTL_DEL, fd, &e)
        elif fd in self._conns:
            epoll_ctl(self._ep, EPOLL_CTL_MOD, fd, &e)
        else:
            if epoll_ctl(self._ep, EPOLL_CTL_ADD, fd, &e) == 0:
                self._conns[fd] = conn

    def progress(self, bint quiet=False):
        """Move the bytes of every ready connection of this channel (reads, requests,
        responses, completions, flushing queued output); returns the number of ready
        sockets. Never blocks. ``quiet``: the caller reads every event with
        ``get_event()`` right after, so events queued meanwhile need no pipe write."""
        cdef epoll_event events[_EPOLL_BATCH]
        cdef int n, i
        cdef Conn conn
        cdef bint me
        if self._ep < 0:
            return 0
        me = self.is_consumer()
        if me:
            self._serviced += 1
            if self.takeover:
                self._ctx._engine.call_soon(self._end_takeover)
        conns = self._conns
        if quiet and me and len(conns) == 1 and not self.takeover:
            # The loop saw our fd readable and one connection is all there is (the
            # usual case): read it without asking the epoll set which socket is ready
            # (one system call less per wake-up). Writes pending or a connect in progress
            # take the general path, which tells readable and writable apart.
            for c in conns.values():
                conn = <Conn>c
            if conn.state == OPEN and not conn.want_write:
                self._quiet = True
                try:
                    if conn.reading:
                        conn.on_readable_c()
                finally:
                    self._quiet = False
                return 1
        n = epoll_wait(self._ep, events, _EPOLL_BATCH, 0)
        if n <= 0:
            return 0
        if quiet and me:
            self._quiet = True
        try:
            for i in range(n):
                c = conns.get(events[i].data.fd)
                if c is None:
                    continue
                conn = <Conn>c
                if events[i].events & EPOLLOUT:
                    self._lock.acquire_c()
                    try:
                        conn._on_writable()
                    finally:
                        self._lock.release_c()
                if events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP) and conn.reading:
                    conn.on_readable_c()
        finally:
            self._quiet = False
        return n

    cdef bint defer_ack(self, SoftQP qp):
        """Lock held. Inside the consumer's ``progress(quiet=True)``: keep ``qp``'s ACK
        for ``flush()`` -- the application usually answers first, and the ACK then
        rides in the same write as the answer -- and return True."""
        if self._quiet and self.is_consumer():
            self._acks.add(qp)
            return True
        return False

    cdef void ack_sent(self, SoftQP qp):
        """Lock held: ``qp``'s deferred ACK went out with other traffic."""
        if self._acks:
            self._acks.discard(qp)

    @property
    def flush_wanted(self):
        """True when ``flush()`` has deferred work (the caller runs it once the
        application has reacted to what ``progress()`` delivered)."""
        return bool(self._acks)

    def flush(self):
        """Send the deferred ACKs that nothing carried meanwhile."""
        if not self._acks:
            return
        self._lock.acquire_c()
        try:
            acks, self._acks = self._acks, set()
            for qp in acks:
                flush_ack(<SoftQP>qp)
        finally:
            self._lock.release_c()

    def _watchdog(self):
        """NIC thread, lock held, every WATCHDOG_S: True when the consumer has not
        called ``progress`` while our sockets stayed ready for two ticks."""
        cdef epoll_event ev
        if self.takeover or self._ep < 0 or not self._conns:
            self._suspect = False
            return False
        serviced = self._serviced != self._seen
        self._seen = self._serviced
        if serviced:
            self._suspect = False
            return False
        if self._acks:  # deferred ACKs the stalled consumer never flushed
            acks, self._acks = self._acks, set()
            for qp in acks:
                flush_ack(<SoftQP>qp)
        if epoll_wait(self._ep, &ev, 1, 0) <= 0:
            self._suspect = False
            return False
        if not self._suspect:
            self._suspect = True
            return False
        self._suspect = False
        return True

    def _end_takeover(self):
        """NIC thread, lock held: the consumer polls again."""
        if self.takeover:
            self.takeover = False
            self._ctx._engine.end_takeover(self)

    def _forget(self, cq):
        """Drop the not-yet-read events of a destroyed CQ (device lock held)."""
        if cq in self._events:
            kept = [c for c in self._events if c is not cq]
            self._events.clear()
            self._events.extend(kept)
            if not self._events:
                self._flag.lower_c()

    def event_reader(self):
        """``get_event``, compiled already (``CompChannel.event_reader``)."""
        return self.get_event

    def get_event(self):
        if not self._events:  # producers append under the lock and raise the fd after
            return None
        self._lock.acquire_c()
        try:
            if not self._events:
                return None
            cq = <SoftCQ>self._events_popleft()
            cq._events_got += 1
            if not self._events:
                self._flag.lower_c()
            return cq
        finally:
            self._lock.release_c()

    def close(self):
        cdef int ep
        self._lock.acquire_c()
        try:
            if self._closed:
                return
            if self._ncqs:
                raise RDMAError(_errno.EBUSY,
                                f"completion channel still used by {self._ncqs} CQ(s)")
            self._closed = True
            self._events.clear()
            ep, self._ep = self._ep, -1
            if ep >= 0:
                engine = self._ctx._engine
                engine.remove_progress_channel(self)
                for c in list(self._conns.values()):
                    # a closing connection (its QP is gone) lingers on the NIC thread
                    (<Conn>c).driver = None
                    (<Conn>c)._sel_events = 0
                    engine.call_soon((<Conn>c)._update_sel)
                self._conns.clear()
        finally:
            self._lock.release_c()
        if ep >= 0:
            close(ep)
        self._flag.close()
        self._ctx._children_changed(self, alive=False)

    def __repr__(self):
        return f"<SoftCompChannel fd={self.fd}>"


api.CompChannel.register(SoftCompChannel)


cdef class SoftCQ:
    """A completion queue: a C ring of ``cqe`` entries (``cqe_t``)."""

    def __init__(self, ctx, int cqe, channel):
        self._ctx = ctx
        self._lock = ctx._engine.lock
        self.cqe = cqe
        self.channel = channel
        self._ring = <cqe_t *>calloc(cqe, sizeof(cqe_t))
        if self._ring == NULL:
            raise MemoryError()
        self._head = 0
        self._count = 0
        self._armed = _ARM_NONE
        self._overrun = False
        self._events_got = 0
        self._events_acked = 0
        self._qps = {}
        self._closed = False

    def __dealloc__(self):
        if self._ring != NULL:
            self._clear()
            free(self._ring)
            self._ring = NULL

    cdef void _clear(self):
        """Drop every queued entry (and the QP reference each holds)."""
        cdef int i
        cdef cqe_t *e
        for i in range(self._count):
            e = &self._ring[(self._head + i) % self.cqe]
            if e.qp != NULL:
                Py_DECREF(<object>e.qp)
                e.qp = NULL
        self._head = 0
        self._count = 0

    # --- producer side (device lock held) -----------------------------------------------
    cdef void push(self, const cqe_t *e, SoftQP qp, bint solicited):
        cdef cqe_t *slot
        cdef int armed
        if self._overrun or self._closed:
            return
        if self._count >= self.cqe:
            self._overrun = True
            self._clear()
            self._ctx._post_async(api.AsyncEvent(EventType.CQ_ERR, cq=self))
            victims = list(self._qps)
            self._ctx._engine.call_soon(_FailQPs(victims).run)
            return
        slot = &self._ring[(self._head + self._count) % self.cqe]
        slot[0] = e[0]
        if qp is not None:
            Py_INCREF(qp)
            slot.qp = <void *>qp
        else:
            slot.qp = NULL
        self._count += 1
        armed = self._armed
        if armed and (armed == _ARM_ANY or solicited or e.status != WC_SUCCESS):
            self._armed = _ARM_NONE
            if self.channel is not None:
                self.channel.post_event(self)

    def _attach(self, qp):
        self._qps[qp] = self._qps.get(qp, 0) + 1

    def _detach(self, qp):
        n = self._qps.get(qp, 0) - 1
        if n <= 0:
            self._qps.pop(qp, None)
        else:
            self._qps[qp] = n

    # --- consumer side ----------------------------------------------------------------------
    cdef int poll_c(self, c_wc_t *out, int n) except -1:
        """Move up to ``n`` completions into ``out`` (oldest first) and release the
        send-queue slots they account for; returns how many. Raises CQOverrunError. Any
        thread; needs no lock: producers and consumers change the ring only in C, under
        the GIL."""
        cdef int got = 0
        cdef cqe_t *e
        cdef c_wc_t *w
        cdef SoftQP qp
        if self._overrun:
            raise CQOverrunError()
        while self._count and got < n:
            e = &self._ring[self._head]
            w = &out[got]
            w.wr_id = e.wr_id
            w.status = e.status
            w.opcode = e.opcode
            w.byte_len = e.byte_len
            w.imm_data = e.imm_data
            w.qp_num = e.qp_num
            w.src_qp = e.src_qp
            w.wc_flags = e.wc_flags
            w.vendor_err = e.vendor_err
            if e.qp != NULL:
                qp = <SoftQP>e.qp
                if e.release and qp._gen == e.gen:
                    qp._sq_used -= e.release
                e.qp = NULL
                Py_DECREF(qp)
            self._head = (self._head + 1) % self.cqe
            self._count -= 1
            got += 1
        return got

    def c_ops(self):
        """The C-level poll (verbs/cverbs.pxd): a PyCapsule named ``CCQ_OPS``, and
        this CQ, its first argument."""
        return PyCapsule_New(&_CQ_OPS, CCQ_OPS, NULL), self

    def poll(self, int n=16):
        cdef c_wc_t buf[32]
        cdef int got, i, take
        cdef c_wc_t *e
        if not self._count:
            if self._overrun:
                raise CQOverrunError()
            ch = self.channel
            if ch is not None and (<SoftCompChannel>ch)._ep >= 0 \
                    and (<SoftCompChannel>ch).is_consumer():
                return []  # manual progress: the consumer calls progress() to move bytes
            # Yield the GIL once: a caller busy-polling in pure Python would otherwise
            # keep the NIC thread (which produces the completions) waiting for the GIL
            # for a whole switch interval (5 ms).
            time.sleep(0)
            if not self._count:
                return []
        out = []
        while n > 0:
            take = n if n < 32 else 32
            got = self.poll_c(buf, take)
            for i in range(got):
                e = &buf[i]
                out.append(WC(e.wr_id, _STATUS[e.status], _OPCODE[e.opcode & 0xFF],
                              e.byte_len, e.vendor_err, e.imm_data, e.qp_num, e.src_qp,
                              _WITH_IMM if e.wc_flags else 0))
            if got < take:
                break
            n -= got
        return out

    def notifier(self):
        """``req_notify``, compiled already (``CQ.notifier``)."""
        return self.req_notify

    def req_notify(self, bint solicited_only=False):
        # One C store, atomic under the GIL: a producer (lock held) sees the CQ armed or
        # not; a completion it adds just before is caught by the drain that follows
        # every arming (verbs semantics), one after fires the event.
        self._armed = _ARM_SOLICITED if solicited_only else _ARM_ANY

    def ack_events(self, int n):
        self._lock.acquire_c()
        try:
            self._events_acked = min(self._events_got, self._events_acked + n)
        finally:
            self._lock.release_c()

    def close(self):
        self._lock.acquire_c()
        try:
            if self._closed:
                return
            check_cq_close(len(self._qps), self._events_got, self._events_acked)
            self._closed = True
            self._clear()
            if self.channel is not None:
                self.channel._forget(self)
                self.channel._ncqs -= 1
        finally:
            self._lock.release_c()
        self._ctx._children_changed(self, alive=False)

    def __repr__(self):
        return f"<SoftCQ cqe={self.cqe} queued={self._count}>"


api.CQ.register(SoftCQ)


cdef int _c_poll(object cq, c_wc_t *out, int n) except -1:
    return (<SoftCQ>cq).poll_c(out, n)


cdef c_cq_ops_t _CQ_OPS
_CQ_OPS.poll = _c_poll


cdef class _FailQPs:
    """A CQ overran: its QPs go to ERR (on the NIC thread, lock held)."""

    cdef list victims

    def __init__(self, list victims):
        self.victims = victims

    def run(self):
        for q in self.victims:
            to_error(<SoftQP>q, None)
