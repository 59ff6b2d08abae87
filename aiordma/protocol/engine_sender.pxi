# The send side of the message engine (included by engine.pyx): queued operations,
# what to post when, and the posts. The frames are built by engine_frames.pxi; what
# each send completion finishes is in engine_sent.pxi.
#
# Three queues feed the send queue of the QP, in this order at every pump: control
# frames (CLOSE, RNDV_DONE, CREDIT), one-sided work (READ, WRITE, atomics, the READs of
# rendezvous receives), then two-sided messages (DATA, RNDV, WRITE_WITH_IMM and the
# WRITE pieces before it). Each takes send-queue room; frames take an eager send buffer
# and a receive credit of the peer (engine_credits.pxi: CLOSE has its own, control frames
# may use the reserve). A pump posts everything it can as one chain.
#
# Posting policy (``kick``): post at once (the latency fast path) unless something was
# posted that way since the last completion came in; then post at the end of this loop
# iteration, everything queued meanwhile together (batching: a burst of sends woken by
# one completion shares work requests and BATCH frames). A DATA message that goes at once
# with nothing queued before it is built and posted directly (``_post_alone_c``), not
# through the send queue and a pump.
#
# Signaling (``_post``): the last operation somebody waits for is signaled (every one
# before it completes with it), plus what ``SendQueue.push`` asks for. Frames nobody
# waits for (RNDV, whose sender waits for RNDV_DONE; CREDIT; RNDV_DONE) go unsignaled
# after it, until our CLOSE: a later signaled WR retires them, and a failed one
# completes anyway.

# ibv_send_flags / ibv_wc_status values (verbs enums; protocol/ imports no provider)
SIGNALED = 2
INLINE = 8
cdef enum:
    F_SIGNALED = 2
    F_INLINE = 8
    WC_SUCCESS_ = 0
    WC_FLUSHED_ = 5
    WC_RETRY_EXC_ = 12
    WC_RNR_RETRY_EXC_ = 13



cdef class Sender:
    """The send queues of one connection and their posting (see above).

    ``spool``: the eager send buffers (``Slots``); ``frame_wrs``: one reusable SEND work
    request per buffer (a provider ``SendWR`` with one SGE: the engine sets its length,
    flags and wr_id)."""

    def __init__(self, MessageEngine engine, Slots spool, list frame_wrs, SendQueue sq):
        self.e = engine
        self.spool = spool
        self.frame_wrs = frame_wrs
        self.sq = sq
        self.ctrlq = Fifo()
        self.oneq = Fifo()
        self.sendq = Fifo()
        self.rndv_out = {}  # msg_id -> its RNDV op, until RNDV_DONE
        self._msg_ids = 0
        self.in_tick = False  # the post fast path was used since the last completion
        self._pump_scheduled = False
        self.messages_batched = 0
        self.work_requests_posted = 0
        self._wr_seq = 0
        self._cwrs = <c_send_wr_t *>calloc(sq.depth, sizeof(c_send_wr_t))
        if self._cwrs == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self._cwrs)

    def next_msg_id(self):
        self._msg_ids += 1
        return self._msg_ids

    @property
    def queued(self):
        return self.sendq.n + self.oneq.n + self.ctrlq.n

    # ---------------------------------------------------------------- posting
    def kick(self):
        """Post now, or at the end of this loop iteration (posting policy, above).
        ``in_tick`` marks the fast path as used; a completion (the loop turned) or the
        end-of-iteration pump clears it, so no callback per request is needed."""
        self.kick_c()

    cdef int kick_c(self) except -1:
        if self._pump_scheduled:
            return 0
        if self.in_tick:
            self._pump_scheduled = True
            self.e.port.later(self._pump_soon)
        else:
            self.in_tick = True
            self.pump_c()
        return 0

    def _pump_soon(self):
        self._pump_scheduled = False
        self.in_tick = False
        self.pump_c()

    def pump(self):
        """Post as much queued work as send-queue room, buffers and credits allow."""
        self.pump_c()

    cdef int pump_c(self) except -1:
        cdef MessageEngine e = self.e
        cdef CreditState credits = e.credits
        cdef Slots spool = self.spool
        cdef int room, slot
        cdef Op op
        cdef int kind
        cdef ConnectionState st = e.state
        if st.failed or st.remote is REMOTE_GONE or credits is None:
            return 0
        batch = []
        room = self.sq.depth - self.sq._n
        while self.ctrlq.n and room > len(batch) and spool._nfree:
            op = self.ctrlq.head_c()
            if op.payload[0] == T_CLOSE:
                credits.consume_close_c()  # its credit is held for it: never waits
            elif credits.can_send_control():
                credits.consume_c(True)
            else:
                break
            self.ctrlq.pop_c()
            build_ctrl(self, op)
            batch.append(op)
        while self.oneq.n and room > len(batch):
            op = self.oneq.head_c()
            if op.kind == K_ATOMIC:  # its result lands in a send buffer
                if not spool._nfree:
                    break
                slot = spool.acquire_c()
                op.slot = slot
                if op.c_wr:
                    op.c_laddr = spool.base_addr + <uint64_t>slot * spool.slot_size
                    op.c_lkey = spool.lkey_c
                else:
                    e.port.set_atomic_target(op.wr, spool.base + slot * spool.slot_size,
                                             spool.lkey)
            self.oneq.pop_c()
            batch.append(op)
        while self.sendq.n and room > len(batch) and credits.can_send_data():
            op = self.sendq.head_c()
            kind = op.kind
            if kind == K_DATA or kind == K_RNDV:
                if not spool._nfree:
                    break
                self.sendq.pop_c()
                credits.consume_c(False)
                if kind == K_RNDV:
                    build_rndv(self, op)
                elif e.batching and self.sendq.n and (<Op>self.sendq.head_c()).kind == K_DATA:
                    op = build_batch(self, op)
                else:
                    build_data(self, op)
            else:  # IMM takes a credit; WRITE (a leading piece of a long one) none
                self.sendq.pop_c()
                if kind == K_IMM:
                    credits.consume_c(False)
            batch.append(op)
        return self._post_batch(batch, room)

    cdef int _post_batch(self, list batch, int room) except -1:
        """The end of a pump: a CREDIT frame added where one is due (and room is left),
        then ``batch`` posted as one chain."""
        cdef MessageEngine e = self.e
        cdef CreditState credits = e.credits
        cdef ConnectionState st = e.state
        cdef Op op
        final_close = st.final and st.local is LOCAL_CLOSE_SENT
        if (credits.should_send_credit_c() and room > len(batch) and self.spool._nfree
                and not final_close):
            op = Op(K_CTRL, None, payload=(FrameType.CREDIT, 0))
            credits.consume_c(True)
            build_ctrl(self, op)
            batch.append(op)
        if batch:
            self._post(batch)
        return 0

    cdef bint _post_alone_c(self, Op op) except -1:
        """``kick``'s fast path for the DATA op ``op`` when nothing else is queued: what
        ``pump_c`` would post for it -- its frame, its credit, a CREDIT frame if one is
        due, one chain -- without going through the send queue. Returns True when it
        posted; False, doing nothing, when ``op`` must be queued instead: the fast path
        used in this iteration, a pump scheduled, anything queued, no send-queue room,
        send buffer or peer credit for it, or the connection down."""
        cdef MessageEngine e = self.e
        cdef CreditState credits = e.credits
        cdef ConnectionState st = e.state
        cdef int room = self.sq.depth - self.sq._n
        if (self.in_tick or self._pump_scheduled or self.sendq.n or self.ctrlq.n
                or self.oneq.n or room < 1 or not self.spool._nfree or credits is None
                or st.failed or st.remote is REMOTE_GONE or not credits.can_send_data()):
            return False
        self.in_tick = True
        credits.consume_c(False)
        build_data(self, op)
        self._post_batch([op], room)
        return True

    cdef int _post(self, list batch) except -1:
        """Post ``batch`` in one call, signaled as the comment above says."""
        cdef MessageEngine e = self.e
        cdef int last = len(batch) - 1, i
        cdef Op op, m
        cdef CreditState credits = e.credits
        cdef bint signal
        cdef int64_t nbytes
        port = e.port
        if credits is not None and credits._held:  # our CLOSE is not sent
            while last >= 0:
                op = batch[last]
                if op.kind == K_RNDV or (op.kind == K_CTRL and op.payload[0] != T_CLOSE):
                    last -= 1
                else:
                    break
        if e._qp_ops != NULL:
            return self._post_c(batch, last)
        wrs = []
        for i in range(len(batch)):
            op = batch[i]
            if op.wr is None and op.c_wr:
                op.wr = send_wr_of_op(op)
            wr = op.wr
            wr_id = port.new_send_id()
            wr.wr_id = wr_id
            sg = wr.sg_list
            if len(sg) == 1:
                nbytes = sg[0].length
            else:
                nbytes = 0
                for s in sg:
                    nbytes += s.length
            signal = self.sq.push_c(wr_id, op, i == last, nbytes)
            flags = int(wr.send_flags)
            wr.send_flags = (flags | F_SIGNALED) if signal else (flags & ~F_SIGNALED)
            op.posted = True
            if op.kind == K_BATCH:
                for m in op.payload:
                    m.posted = True
            wrs.append(wr)
        self.work_requests_posted += len(wrs)
        try:
            port.post_send(wrs)
        except RDMAError as exc:
            for wr in wrs:
                port.drop_send_id(wr.wr_id)
            for _wr_id, op in self.sq.drain():
                sent_finish(self, op, None, exc)
            e.fail(exc)
            return 0
        for i in range(len(batch)):
            op = batch[i]
            if op.slot is not None and op.wr is not None and int(op.wr.send_flags) & F_INLINE:
                self.spool.release_c(<int>op.slot)  # inline: the device copied it at post
                op.slot = None
        if e.poke_posts:
            port.posted()
        return 0

    cdef int _post_c(self, list batch, int last) except -1:
        """``_post`` on the C path: the chain as C work requests (frames from their
        slots, one-sided work from its ``SendWR``), posted through the QP's C-level
        operations, with the engine's own wr_ids."""
        cdef MessageEngine e = self.e
        cdef Slots spool = self.spool
        cdef int i, n = len(batch), flags
        cdef Op op, m
        cdef c_send_wr_t *w
        cdef bint signal
        for i in range(n):
            op = batch[i]
            w = &self._cwrs[i]
            self._wr_seq += 1
            w.wr_id = WR_ENGINE_C | self._wr_seq
            if op.c_wr:  # one-sided work as C fields (rdma_op)
                w.opcode = op.c_opcode
                w.addr = op.c_laddr
                w.length = op.c_length
                w.lkey = op.c_lkey
                w.imm_data = op.c_imm
                w.rkey = op.c_rkey
                w.remote_addr = op.c_raddr
                w.compare_add = op.c_compare_add
                w.swap = op.c_swap
                flags = 0
            elif op.wr is None:  # a frame in its send slot
                w.opcode = 2  # IBV_WR_SEND
                w.addr = spool.base_addr + <uint64_t>(<int>op.slot) * spool.slot_size
                w.length = op.nbytes
                w.lkey = spool.lkey_c
                w.imm_data = w.rkey = 0
                w.remote_addr = w.compare_add = w.swap = 0
                flags = F_INLINE if op.nbytes <= e.inline_cap else 0
            else:
                flags = c_send_wr_of(op.wr, w) & ~F_SIGNALED
            signal = self.sq.push_c(w.wr_id, op, i == last, w.length)
            w.send_flags = (flags | F_SIGNALED) if signal else flags
            op.posted = True
            if op.kind == K_BATCH:
                for m in op.payload:
                    m.posted = True
        self.work_requests_posted += n
        try:
            e._qp_ops.post_send(e._qp, self._cwrs, n)
        except RDMAError as exc:
            for _wr_id, op in self.sq.drain():
                sent_finish(self, op, None, exc)
            e.fail(exc)
            return 0
        for i in range(n):
            op = batch[i]
            if op.slot is not None and self._cwrs[i].send_flags & F_INLINE:
                spool.release_c(<int>op.slot)  # inline: the device copied it at post time
                op.slot = None
        if e.poke_posts:
            e.port.posted()
        return 0

    cdef int _post_marker_c(self) except -1:
        """``post_flush_marker`` on the C path."""
        cdef MessageEngine e = self.e
        cdef c_send_wr_t *w = &self._cwrs[0]
        memset(w, 0, sizeof(c_send_wr_t))
        self._wr_seq += 1
        w.wr_id = WR_ENGINE_C | self._wr_seq
        w.opcode = 2  # IBV_WR_SEND, no SGE
        w.send_flags = F_SIGNALED
        try:
            e._qp_ops.post_send(e._qp, w, 1)
        except RDMAError:  # the QP is gone: the teardown destroys it without waiting
            return 0
        self.work_requests_posted += 1
        self.sq.push_c(w.wr_id, Op(K_CTRL, None, payload=(FrameType.CREDIT, 0)), True, 0)
        return 0

    def queue_data(self, fut, payload):
        """Queue a DATA message (``payload``: its bytes, at most ``eager_payload``; the
        waiter ``fut`` completes when the peer's device has it) and post what can go;
        returns its op (the caller unqueues it if cancelled before it was posted)."""
        return self.queue_data_c(fut, payload)

    cdef Op queue_data_c(self, object fut, object payload):
        return self.queue_op_c(new_op(K_DATA, fut, payload))

    cdef Op queue_op_c(self, Op op):
        """Queue the DATA op ``op`` (its payload set) and post what can go; returns it."""
        if self._post_alone_c(op):
            return op
        self.sendq.push_c(op)
        self.kick_c()
        return op

    def queue_ctrl(self, ftype, arg, fut=None):
        """Queue a control frame (CLOSE completes ``fut``) and post what can go."""
        if self.e.state.failed:
            return
        self.ctrlq.push_c(Op(K_CTRL, fut, payload=(ftype, arg)))
        self.kick_c()

    def unqueue(self, Fifo q, ops):
        """Take the ops of ``ops`` that are still on ``q`` (not posted) off it, in one
        pass whatever their number, releasing a rendezvous' source: they are never
        sent. Ops no longer there (posted, or dropped by a failure) are left alone."""
        drop = {id(op) for op in ops}
        keep = []
        for op in q._snapshot():
            if id(op) not in drop:
                keep.append(op)
            elif (<Op>op).kind == K_RNDV:
                self.e.port.release_source((<Op>op).payload)
        if len(keep) < q.n:
            q._rebuild(keep, len(q._items))

    # ---------------------------------------------------------------- completions
    def on_wc(self, wc, _arg=None):
        """A send completion (the provider's ``WC``): the reactor's handler of every
        send work request (engine_sent.pxi)."""
        sent_wc(self, wc)

    def finish(self, Op op, wc, exc):
        """Complete ``op``: ``wc`` None means an unsignaled success; ``exc`` a local error."""
        sent_finish(self, op, wc, exc)

    # ---------------------------------------------------------------- failure
    def posted_ops(self):
        """The ops on the send queue, the messages of BATCH frames listed one by one."""
        out = []
        for _wr_id, op in self.sq.entries():
            if op.kind == K_BATCH:
                out.extend(op.payload)
            else:
                out.append(op)
        return out

    def fail_queued(self, error):
        """Drop every operation not posted yet (control, one-sided and send queues):
        release its rendezvous source and fail its waiter with ``error()``."""
        cdef Fifo q
        for q in (self.ctrlq, self.oneq, self.sendq):
            while q.n:
                op = q.pop_c()
                if op.kind == K_RNDV:
                    self.e.port.release_source(op.payload)
                if op.fut is not None and not op.fut.done():
                    op.fut.set_exception(error())

    def post_flush_marker(self):
        """The QP is in ERR. Unsignaled WRs after the last signaled one (frames nobody
        waits for) may have finished without a completion: a signaled zero-length SEND
        posted now is flushed after every one of them, so its completion retires them
        and the drain waits for exactly that (the marker WR of the teardown order)."""
        sq = self.sq
        if not sq.used or sq.awaited or not sq.room:
            return
        if self.e._qp_ops != NULL:
            self._post_marker_c()
            return
        port = self.e.port
        wr_id = port.new_send_id()
        try:
            port.post_marker(wr_id)
        except RDMAError:  # the QP is gone: the teardown destroys it without waiting
            port.drop_send_id(wr_id)
            return
        self.work_requests_posted += 1
        sq.push(wr_id, Op(K_CTRL, None, payload=(FrameType.CREDIT, 0)), last_in_batch=True)

