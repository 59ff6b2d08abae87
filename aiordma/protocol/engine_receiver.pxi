# The receive side of the message engine (included by engine.pyx): posted receive
# buffers, the frames they bring, the queue of messages for the application, and
# rendezvous READs.
#
# Every receive completion carries one frame (engine_framing.pxi). DATA and BATCH messages
# are queued where they landed (their buffer is re-posted once the application consumed
# the last message in it); a RNDV announcement is queued and its READ started at once
# when the read-ahead budget allows (``rndv_prefetch`` bytes while nobody receives,
# like a TCP receive buffer; while a receive is in progress ``busy_ahead``, or
# ``direct_ahead`` when the receiver's own READ went straight into its buffer), else when
# a receiver asks for it (straight into a registered buffer of its own) or the budget
# frees up. RNDV_DONE finishes one of our rendezvous sends, CLOSE queues the peer's EOF,
# CREDIT only returns credits (every frame may carry some).
#
# Consumed buffers are re-posted ``repost_batch`` at a time with one post for all of
# them (engine_credits.pxi rule 6: so few wait that the peer is never left without credit).

cdef enum:
    WCOP_RECV_RDMA_WITH_IMM_ = 129  # ibv_wc_opcode IBV_WC_RECV_RDMA_WITH_IMM


cdef class Receiver:
    """The receive buffers and received messages of one connection.

    ``rpool``: the receive buffers (``Slots``); the engine's port posts them
    (``post_recv``). ``rx``: messages for the application, oldest first;
    ``rx_waiters``/``imm_waiters``: waiters woken when something arrives."""

    def __init__(self, MessageEngine engine, Slots rpool, int repost_batch, rndv_prefetch,
                 busy_ahead, direct_ahead):
        self.e = engine
        self.rpool = rpool
        self._rslot = rpool.slot_size
        self.repost_batch = repost_batch
        self.rndv_prefetch = rndv_prefetch
        self.busy_ahead = busy_ahead
        self.direct_ahead = direct_ahead
        self._direct = True  # the last receiver's READ went into its buffer (assumed)
        self.posted = 0  # receive WRs posted and not completed
        self._repost_q = []
        self.rx = Fifo()
        self.rx_waiters = []
        self.imm = Fifo()
        self.imm_waiters = []
        self.receivers = 0  # recv/recv_into calls in progress (maintained by the caller)
        self.prefetched = 0  # bytes of rendezvous messages read ahead into staging
        self.deferred = 0  # rendezvous messages queued without a READ (rx.deferred)
        self._prefetch_scheduled = False
        self.messages_received = 0
        self.bytes_received = 0
        self.rndv_staged = 0
        self._crwrs = <c_recv_wr_t *>calloc(rpool.count, sizeof(c_recv_wr_t))
        if self._crwrs == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self._crwrs)

    # ---------------------------------------------------------------- buffers
    def post(self, list slots):
        """Post receive buffers ``slots`` (one post for all). Raises RDMAError (then
        none was posted, and the slots are free again)."""
        self.post_c(slots)

    cdef int post_c(self, list slots) except -1:
        cdef MessageEngine e = self.e
        cdef Slots rpool = self.rpool
        cdef int i, n = len(slots), slot
        cdef c_recv_wr_t *w
        if e._qp_ops == NULL:
            e.port.post_recv(slots)
        else:
            for i in range(n):
                slot = slots[i]
                w = &self._crwrs[i]
                w.wr_id = WR_ENGINE_C | WR_RECV_C | <uint64_t>slot
                w.addr = rpool.base_addr + <uint64_t>slot * rpool.slot_size
                w.length = rpool.slot_size
                w.lkey = rpool.lkey_c
            try:
                e._qp_ops.post_recv(e._qp, self._crwrs, n)
            except RDMAError:
                for slot in slots:
                    rpool.release_c(slot)
                raise
        self.posted += n
        return 0

    def repost(self, int slot):
        """Give a consumed receive buffer back to the peer (one more credit owed)."""
        self.repost_c(slot)

    cdef int repost_c(self, int slot) except -1:
        cdef MessageEngine e = self.e
        if e.state.failed or e.port.destroyed:
            self.rpool.release_c(slot)
            return 0
        self._repost_q.append(slot)
        if len(self._repost_q) >= self.repost_batch:
            self.flush_reposts_c()
        return 0

    def flush_reposts(self):
        self.flush_reposts_c()

    cdef int flush_reposts_c(self) except -1:
        cdef MessageEngine e = self.e
        cdef CreditState credits
        slots = self._repost_q
        if not slots:
            return 0
        self._repost_q = []
        if e.state.failed or e.port.destroyed:
            for slot in slots:
                self.rpool.release_c(slot)
            return 0
        try:
            self.post_c(slots)
        except RDMAError as exc:
            e.fail(exc)
            return 0
        credits = e.credits
        if credits is not None:
            credits.on_reposted_c(len(slots))
            if credits.should_send_credit_c():
                e.tx.kick_c()
        return 0

    # ---------------------------------------------------------------- completions
    def on_wc(self, wc, int slot):
        """The receive completion ``wc`` of buffer ``slot``: the reactor's handler of
        every receive work request."""
        cdef MessageEngine e = self.e
        e.tx.in_tick = False
        self.posted -= 1
        status = wc.status
        if status != WC_SUCCESS_:
            self.rpool.release_c(slot)
            if status != WC_FLUSHED_ or not e.state.failed:
                e.fail(completion_error(status, vendor_err=wc.vendor_err, wr_id=wc.wr_id,
                                        opcode=wc.opcode))
            e.port.check_drained()
            return
        self._on_frame(slot, wc.opcode, wc.imm_data, wc.byte_len)

    cdef int on_wc_c(self, const c_wc_t *wc, int slot) except -1:
        """``on_wc`` for a completion as a C struct (a failed one goes through ``on_wc``
        as a ``WC``)."""
        if wc.status != WC_SUCCESS_:
            self.on_wc(make_wc(wc), slot)
            return 0
        self.e.tx.in_tick = False
        self.posted -= 1
        return self._on_frame(slot, wc.opcode, wc.imm_data, wc.byte_len)

    cdef int _on_frame(self, int slot, int opcode, uint32_t imm, Py_ssize_t byte_len) except -1:
        """A receive completed successfully: the frame in buffer ``slot``."""
        cdef MessageEngine e = self.e
        cdef CreditState credits
        cdef frame_t f
        cdef Py_ssize_t base, off, n
        cdef const unsigned char *p
        cdef uint32_t i, last
        cdef int ftype
        cdef ConnectionState st = e.state
        if st.failed:
            self.rpool.release_c(slot)
            e.port.check_drained()
            return 0
        if opcode == WCOP_RECV_RDMA_WITH_IMM_:
            self.imm.push_c(imm)
            wake_c(self.imm_waiters)
            self.repost_c(slot)
            return 0
        base = slot * self._rslot
        credits = e.credits
        try:
            if self.rpool.mem == NULL:
                raise RemoteProtocolError("a frame arrived after the receive buffers went")
            parse_c(self.rpool.ptr(slot), self._rslot, byte_len, e.max_message_size, &f)
            if f.credits:
                credits.on_credits_c(f.credits)
            ftype = f.type
            if ftype == T_CLOSE:
                st.handle(EV_RECV_CLOSE)
            elif ftype == T_DATA or ftype == T_BATCH or ftype == T_RNDV:
                if not st.can_receive_c():  # (else RECV_DATA changes nothing)
                    st.handle(EV_RECV_DATA)
        except RemoteProtocolError as exc:
            self.rpool.release_c(slot)
            e.fail(exc)
            return 0
        if ftype == T_DATA:
            self.rx.push_c(new_rx(R_DATA, slot, base + f.payload_offset, f.payload_len))
            if self.rx_waiters:
                wake_c(self.rx_waiters)
        elif ftype == T_BATCH:
            p = self.rpool.ptr(slot)
            try:  # the whole frame is checked before any of its messages is queued
                batch_check_c(p, byte_len, f.aux, e.max_message_size)
            except RemoteProtocolError as exc:
                self.rpool.release_c(slot)
                e.fail(exc)
                return 0
            # one buffer, many messages: the last one's consumption re-posts it
            off = C_HEADER_SIZE
            last = f.aux - 1
            for i in range(f.aux):
                n = batch_next_c(p, &off)
                self.rx.push_c(new_rx(R_DATA, slot if i == last else -1, base + off, n))
                off += n
            wake_c(self.rx_waiters)
            # a burst: the sender waits for this frame's acknowledgement to send more,
            # and no answer will carry it soon
            e.port.expedite()
        elif ftype == T_RNDV:
            rx = Rx(R_RNDV, length=f.rndv_length, addr=f.rndv_addr, rkey=f.rndv_rkey,
                    msg_id=f.aux)
            self._on_rndv(rx, slot)
        elif ftype == T_RNDV_DONE:
            self.repost_c(slot)
            op = e.tx.rndv_out.pop(f.aux, None)
            if op is None:
                e.fail(RemoteProtocolError(f"RNDV_DONE for unknown message {f.aux}"))
                return 0
            e.port.release_source(op.payload)
            if op.fut is not None and not op.fut.done():
                op.fut.set_result(None)
            if e.close_watch:
                e.port.maybe_closed()
        elif ftype == T_CLOSE:
            self.rx.push_c(new_rx(R_EOF, -1, 0, 0))
            self.repost_c(slot)
            wake_c(self.rx_waiters)
            wake_c(self.imm_waiters)
        else:  # CREDIT
            self.repost_c(slot)
        tx = e.tx
        if tx.sendq.n or tx.ctrlq.n:
            tx.pump_c()
        return 0

    def _on_rndv(self, rx, slot):
        self.rx.push_c(rx)
        self.repost_c(slot)
        if self.rx_waiters:
            wake(self.rx_waiters)  # the waiting receiver picks the destination
        elif self.prefetched + rx.length <= (self.ahead_c() if self.receivers
                                             else self.rndv_prefetch):
            # buffer it now, like a TCP receive buffer (while a receive is in progress,
            # within the smaller budget that keeps the link busy)
            self.start_read(rx, None)
        else:
            # the read-ahead budget is spent: a receiver READs it straight into its
            # buffer, or it is read ahead once there is room (read_ahead)
            rx.deferred = True
            self.deferred += 1

    # ---------------------------------------------------------------- consuming
    def take_data(self):
        """The next message as bytes when it is a DATA message already here (consumed:
        its buffer goes back to the peer), else None (nothing taken). The caller makes
        sure that no receive is waiting before it (or holds the receivers' turn)."""
        cdef Rx rx = self.data_head_c()
        if rx is None:
            return None
        data = PyBytes_FromStringAndSize(<char *>self.rpool.mem + rx.offset, rx.length)
        self.consume_data_c(rx)
        return data

    def take_into(self, buffer):
        """Copy the next message into ``buffer`` when it is a DATA message already here
        that fits, no receive is waiting and the connection has not failed (consumed:
        its buffer goes back to the peer); returns its length. Returns -1 with nothing
        taken otherwise, and for a ``buffer`` that is not one writable, contiguous run
        of memory (the caller's checks then name the error)."""
        if self.receivers:
            return -1
        return self.take_into_c(buffer)

    def take_into_in_turn(self, buffer):
        """``take_into`` for the receive that holds the receivers' turn (counted in
        ``receivers``): nobody is before it."""
        return self.take_into_c(buffer)

    cdef Py_ssize_t take_into_c(self, object buffer) except -2:
        cdef Rx rx
        cdef Py_buffer dst
        cdef Py_ssize_t n
        rx = self.data_head_c()
        if rx is None:
            return -1
        try:
            PyObject_GetBuffer(buffer, &dst, PyBUF_WRITABLE)
        except Exception:
            return -1
        n = rx.length
        if n > dst.len:
            PyBuffer_Release(&dst)
            return -1
        memcpy(dst.buf, self.rpool.mem + rx.offset, n)
        PyBuffer_Release(&dst)
        self.consume_data_c(rx)
        return n

    cdef Rx data_head_c(self):
        """The receive queue's head when it is a DATA message and the connection has not
        failed, else None; raises ValueError once the receive buffers are gone."""
        cdef Rx rx
        cdef Slots rpool = self.rpool
        if not self.rx.n or self.e.state.failed:
            return None
        rx = self.rx.head_c()
        if rx.kind != R_DATA:
            return None
        if rpool.mem == NULL or rx.offset + rx.length > rpool._size:
            raise ValueError("the receive buffers are gone")
        return rx

    def consume_data(self, Rx rx):
        """The application took DATA message ``rx`` (the receive queue's head)."""
        self.consume_data_c(rx)

    cdef int consume_data_c(self, Rx rx) except -1:
        self.rx.pop_c()
        self.messages_received += 1
        self.bytes_received += rx.length
        if rx.slot >= 0:  # -1: a BATCH message whose buffer a later one re-posts
            self.repost_c(rx.slot)
        return 0

    def consume_rndv(self, Rx rx):
        """The application took rendezvous message ``rx``: release its staging, tell the
        sender (RNDV_DONE) unless that went already."""
        self.rx.pop_c()
        self.messages_received += 1
        self.bytes_received += rx.length
        if rx.staging is not None:
            self.prefetched -= rx.length
            rx.staging.release()
            rx.staging = None
        if not rx.done_sent:
            rx.done_sent = True
            self.e.tx.queue_ctrl(FrameType.RNDV_DONE, rx.msg_id)

    # ---------------------------------------------------------------- rendezvous reads
    def start_read(self, rx, span):
        """Queue the READ of rendezvous message ``rx`` into ``span`` (a LocalSpan: addr,
        length, lkey) or a staging lease; returns the waiter of its completion."""
        e = self.e
        port = e.port
        if rx.deferred:
            rx.deferred = False
            self.deferred -= 1
        if span is None:
            self.rndv_staged += 1
            rx.staging = port.lease_staging(rx.length)
            self.prefetched += rx.length
            target = port.staging_span(rx.staging, rx.length)
        else:
            rx.staging = None
            target = span
        fut = port.new_waiter(quiet=True)
        rx.read = fut
        wrs = port.read_wrs(target, rx.length, rx.addr, rx.rkey)
        tx = e.tx
        last = len(wrs) - 1
        for i, wr in enumerate(wrs):
            tx.oneq.push_c(Op(K_RNDV_READ, fut if i == last else None, wr=wr, keep=target))
        tx.kick()
        if rx.staging is not None:
            port.when_done(fut, lambda ok: self._staged(rx, ok))
        return fut

    def _staged(self, rx, ok):
        """The message is in our staging buffer: release the sender's source now."""
        if ok and not rx.done_sent:
            rx.done_sent = True
            self.e.tx.queue_ctrl(FrameType.RNDV_DONE, rx.msg_id)

    def read_for_receiver(self, rx, span):
        """A receiver's READ of rendezvous message ``rx`` (``start_read``): into
        ``span``, its own buffer, or into staging (None); the messages behind it are
        read ahead meanwhile within the budget of a receive in progress (``busy_ahead``,
        or ``direct_ahead`` for a READ into the receiver's buffer: the next receive is
        expected to be alike). Returns the waiter of its completion."""
        self._direct = span is not None
        fut = self.start_read(rx, span)
        self.read_ahead(self.ahead_c())
        return fut

    cdef int64_t ahead_c(self) noexcept:
        return self.direct_ahead if self._direct else self.busy_ahead

    def read_ahead(self, limit):
        """READ the deferred rendezvous messages into staging, in order, while the staged
        bytes stay within ``limit``."""
        for rx in self.rx:
            if not self.deferred:
                return
            if rx.deferred and rx.read is None:
                if self.prefetched + rx.length > limit:
                    return
                self.start_read(rx, None)

    def receive_done(self):
        """A recv/recv_into call ended (``receivers`` already lowered): with nobody
        receiving, read ahead what was deferred, at the end of this loop iteration (an
        application that receives again at once gets it READ into its buffer instead)."""
        if not self.receivers and self.deferred and not self._prefetch_scheduled:
            self._prefetch_scheduled = True
            self.e.port.later(self._prefetch_deferred)

    def _prefetch_deferred(self):
        self._prefetch_scheduled = False
        cdef ConnectionState st = self.e.state
        if self.receivers or st.failed or st.remote is REMOTE_GONE:
            return
        self.read_ahead(self.rndv_prefetch)
