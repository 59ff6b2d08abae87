# The soft RC QP: public verbs (modify, post_send, post_recv, close) and the state
# machine (included by _core.pyx). The requester and responder halves are the functions
# of core_requester.pxi and core_responder.pxi.

cdef int _WIRE_OP[7]
cdef int _WC_OP_FOR_WR[7]
# indexed by ibv_wr_opcode: RDMA_WRITE, RDMA_WRITE_WITH_IMM, SEND, SEND_WITH_IMM,
# RDMA_READ, ATOMIC_CMP_AND_SWP, ATOMIC_FETCH_AND_ADD
_WIRE_OP[:] = [OP_WRITE, OP_WRITE_IMM, OP_SEND, OP_SEND_IMM, OP_READ, OP_CMP_SWP,
               OP_FETCH_ADD]
_WC_OP_FOR_WR[:] = [int(WC_OPCODE_FOR_WR[WROpcode(i)]) for i in range(7)]

_LEGAL = {
    (QPS_RESET, QPS_INIT),
    (QPS_INIT, QPS_INIT),
    (QPS_INIT, QPS_RTR),
    (QPS_RTR, QPS_RTS),
    (QPS_RTS, QPS_RTS),
}


cdef class SoftQP:
    """A reliable-connected QP of the soft device (``api.QP``)."""

    def __init__(self, pd, SoftCQ send_cq, SoftCQ recv_cq, cap):
        lim = limits.DEVICE_ATTR
        for name, value, top in (
            ("max_send_wr", cap.max_send_wr, lim.max_qp_wr),
            ("max_recv_wr", cap.max_recv_wr, lim.max_qp_wr),
            ("max_send_sge", cap.max_send_sge, lim.max_sge),
            ("max_recv_sge", cap.max_recv_sge, lim.max_sge),
            ("max_inline_data", cap.max_inline_data, lim.max_inline_data),
        ):
            if not 0 <= value <= top:
                raise RDMAError(_errno.EINVAL, f"QP {name}={value} outside 0..{top}")
        if cap.max_send_wr < 1 or cap.max_recv_wr < 0:
            raise RDMAError(_errno.EINVAL, "a QP needs max_send_wr >= 1")
        engine = pd.context._engine
        if send_cq._ctx._engine is not engine or recv_cq._ctx._engine is not engine:
            raise RDMAError(_errno.EINVAL, "CQs of another device")
        cap = api.QPCap(cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge,
                        cap.max_recv_sge, cap.max_inline_data)
        qp_alloc(self, cap)
        self._engine = engine
        self._ctx = pd.context
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        self._lock = engine.lock
        self._keys = engine.keys
        self._state = QPS_RESET
        self._closed = False
        self._gen = 0
        self._sq_used = 0
        self._unsig = 0
        self._access = Access(0)
        self._acc = 0
        self._dest_qpn = 0
        self._ah = None
        self._epsn = 0
        self._next_psn = 0
        self._min_rnr_timer = 12
        self._timeout = 14
        self._retry_cnt = 7
        self._rnr_retry = 7
        # connections: the key a peer device must prove (QPAttr.auth_key), the HELLO
        # nonces already admitted (a replayed HELLO is refused)
        self._auth_key = None
        self._hello_nonces = set()
        self._req_conn = None
        self._resp_conn = None
        # requester / responder progress state
        self._rnr_wait = False
        self._ack_armed = False
        self._progress = 0.0
        # local ACK timer (Retries, core_requester.pxi): when the current try began,
        # retries left, and how many tries ended without progress in the QP's life
        self._try_start = 0.0
        self._retries_left = 7
        self.local_ack_timeouts = 0
        self._ack_pending = -1
        self._conn_wait = False  # requests wait for the peer's connection (requester)
        self._lock.acquire_c()
        try:
            if send_cq._closed or recv_cq._closed:
                raise RDMAError(_errno.EINVAL, "CQ is closed")
            self.qp_num = engine.alloc_qpn()
            engine.qps[self.qp_num] = self
            pd._qps.add(self)
            send_cq._attach(self)
            recv_cq._attach(self)
        finally:
            self._lock.release_c()

    def __dealloc__(self):
        if self._sq != NULL:
            queues_clear(self)
            qp_free(self)

    def __repr__(self):
        return f"<SoftQP qpn={self.qp_num:#x} state={self.state.name}>"

    @property
    def state(self):
        return _QP_STATE[self._state]

    @property
    def modify_releases_gil(self):
        return False

    # --- connections (Python-level: admission, the engine) ----------------------------------
    def _admit_nonce(self, nonce):
        """True the first time a HELLO with ``nonce`` is admitted to this QP; False for a
        replay, or once ``MAX_HELLOS`` were admitted (a pair needs two or three)."""
        seen = self._hello_nonces
        if nonce in seen or len(seen) >= MAX_HELLOS:
            return False
        seen.add(nonce)
        return True

    def _peer_connects(self):
        """Of a QP pair, the QP with the smaller (device port, QPN) opens the connection
        both use; the other one waits for it (wire: Connections)."""
        ah = self._ah
        return (ah.dlid, self._dest_qpn) < (self._engine.port, self.qp_num)

    def _bind_resp(self, Conn conn, src_qpn):
        """Accept ``conn`` as this QP's responder connection if it comes from our peer QP."""
        cdef Conn old, req
        if src_qpn != self._dest_qpn or (self._state != QPS_RTR and self._state != QPS_RTS):
            conn.shutdown(graceful=False)
            return False
        old = self._resp_conn
        if old is not None and old is not conn and old is not self._req_conn:
            old.shutdown(graceful=False)
        conn.owner = self
        self._resp_conn = conn
        ch = self.recv_cq.channel
        conn.set_driver(ch if ch is not None and ch.manual else None)
        req = self._req_conn
        if req is None or req.state >= C_CLOSING:
            self._req_conn = conn  # our requests travel on the peer's connection
            conn.cma_start()
            if self._sq_nsent < self._sq_count and not self._conn_wait:
                pump(self)
        elif req is not conn and not req.requests_sent and self._peer_connects():
            # Both QPs opened a connection (ours before the peer's arrived) and ours
            # carried nothing yet: the one opened by the smaller (port, QPN) serves both
            # directions; drop ours (the peer sees it close before any request).
            self._req_conn = conn
            conn.cma_start()
            req.shutdown(graceful=False)
        return True

    def _flush_ack(self):
        flush_ack(self)

    def _peer_conn_check(self, gen, deadline):
        """NIC thread, lock held: the peer's connection arrived, or it is time to open one."""
        cdef Conn conn
        if gen != self._gen or self._state != QPS_RTS:
            self._conn_wait = False
            return
        conn = self._req_conn
        if conn is None or conn.state >= C_CLOSING:
            conn = connect(self, monotonic() < deadline, False)
            if conn is None:
                self._engine.call_at(min(monotonic() + 0.002, deadline),
                                     functools.partial(self._peer_conn_check, gen, deadline))
                return
        self._conn_wait = False
        pump(self)

    def _ack_check(self, gen):
        """NIC thread, lock held: one try of the local ACK timer ended (Retries)."""
        if gen != self._gen:
            return  # a timer of the QP's life before a RESET
        self._ack_armed = False
        if self._state != QPS_RTS or not self._sq_count:
            return
        t = local_ack_timeout_s(self._timeout)
        if t is None:
            return
        now = monotonic()
        if self._rnr_wait:
            self._progress = now
        last = last_progress(self)
        if last > self._try_start:  # progress since the last try began: all retries back
            self._retries_left = self._retry_cnt
        start = max(last, self._try_start)
        if now < start + t:
            self._ack_armed = True
            self._engine.call_at(start + t, functools.partial(self._ack_check, gen))
            return
        if self._retries_left <= 0:
            fail_send(self, WC_RETRY_EXC_ERR)
            return
        self._retries_left -= 1  # a try without progress: the next one begins now
        self.local_ack_timeouts += 1
        self._try_start = now
        self._ack_armed = True
        self._engine.call_at(now + t, functools.partial(self._ack_check, gen))

    def _rnr_resume(self, gen):
        if gen != self._gen or self._state != QPS_RTS or not self._rnr_wait:
            return
        self._rnr_wait = False
        self._progress = monotonic()
        pump(self)

    # --- same-host copies (core_responder.pxi: FLAG_CMA) ------------------------------------
    def _cma_write(self, Conn conn, int op, uint32_t psn, uint32_t length, uint32_t imm,
                   int flags, uint32_t plen, target):
        gen = self._gen
        seq = self._rq_seq
        takes_rwqe = op == OP_WRITE_IMM
        solicited = bool(flags & FLAG_SOLICITED)
        copy = _CMACopy(conn, [target] if target is not None else [], plen, write=False)

        def write_done():
            cdef rwqe_t *r
            if self._gen != gen or (self._state != QPS_RTR and self._state != QPS_RTS):
                return
            if copy.err:
                nak_error(self, conn, psn, NAK_REM_OP, None)
                return
            if takes_rwqe:
                if not self._rq_count or self._rq_seq != seq:
                    return
                r = rq_at(self, 0)
                rq_complete(self, r, WC_SUCCESS, WCOP_RECV_RDMA_WITH_IMM, length, imm, True,
                            solicited)
                rq_pop(self)
            self._epsn = psn_add(psn, 1)
            self._ack_pending = psn

        cma_sink(conn, copy, write_done)

    def _cma_read(self, Conn conn, uint32_t psn, src, uint32_t plen, shm):
        """A READ with FLAG_CMA: write ``src`` into the requester's SGEs, then answer.
        ``shm`` (FLAG_SHM): ``(fd, inode, offset)`` of the destination's shared buffer."""
        gen = self._gen
        copy = _CMACopy(conn, [src], plen, write=True, shm=shm)
        n = len(src)

        def read_done():
            cdef hdr_t h
            if self._gen != gen or (self._state != QPS_RTR and self._state != QPS_RTS):
                return
            if copy.err:
                nak_error(self, conn, psn, NAK_REM_OP, None)
                return
            self._epsn = psn_add(psn, 1)
            hdr_set(&h, OP_READ_RESP, psn, n)
            h.flags = FLAG_CMA
            respond(self, conn, &h, NULL)

        cma_sink(conn, copy, read_done)

    # --- verbs ---------------------------------------------------------------------------
    def modify(self, attr):
        engine = self._engine
        self._lock.acquire_c()
        try:
            if self._closed:
                raise RDMAError(_errno.EINVAL, "QP is closed")
            cur, new = self._state, int(QPState(attr.qp_state))
            if new == QPS_RESET:
                self._reset()
                return
            if new == QPS_ERR:
                to_error(self, None)
                return
            if (cur, new) not in _LEGAL:
                raise RDMAError(_errno.EINVAL, f"illegal QP state transition "
                                f"{_QP_STATE[cur].name} -> {_QP_STATE[new].name}")
            if new == QPS_INIT:
                if attr.port_num != 1:
                    raise RDMAError(_errno.EINVAL, f"no port {attr.port_num} (soft0 has port 1)")
                key = attr.auth_key
                if key is not None and (not isinstance(key, bytes) or len(key) < 16):
                    raise RDMAError(_errno.EINVAL, "auth_key must be bytes, at least 16")
                if cur == QPS_RESET or key is not None:
                    self._auth_key = key if key is not None else engine.secret
                    if self.qp_num in engine.admission.unkeyed:
                        qpn = self.qp_num  # HELLOs that came first are judged now
                        engine.call_soon(lambda: engine.admission.keyed(qpn))
                self._access = attr.qp_access_flags
                self._acc = int(attr.qp_access_flags)
                self._state = QPS_INIT
            elif new == QPS_RTR:
                ah = attr.ah_attr
                if ah is None or len(bytes(ah.dgid)) != 16 or not 0 < ah.dlid <= 0xFFFF:
                    raise RDMAError(_errno.EINVAL,
                                    "INIT->RTR needs ah_attr with a 16-byte dgid and dlid "
                                    "(TCP port)")
                if not 0 <= attr.min_rnr_timer <= 31:
                    raise RDMAError(_errno.EINVAL, "min_rnr_timer must be 0..31")
                self._ah = ah
                self._dest_qpn = attr.dest_qp_num & 0xFFFFFF
                self._epsn = attr.rq_psn & PSN_MASK
                self._min_rnr_timer = attr.min_rnr_timer
                self._state = QPS_RTR
                try:
                    connect(self, True, True)
                except RDMAError:
                    self._state = cur  # a failed transition changes nothing
                    raise
                qpn = self.qp_num
                engine.call_soon(lambda: engine.release_held(qpn))
            else:  # RTS
                if not 0 <= attr.timeout <= 31 or not 0 <= attr.retry_cnt <= 7 \
                        or not 0 <= attr.rnr_retry <= 7:
                    raise RDMAError(_errno.EINVAL,
                                    "timeout 0..31, retry_cnt and rnr_retry 0..7")
                if cur == QPS_RTR:
                    self._next_psn = attr.sq_psn & PSN_MASK
                self._timeout = attr.timeout
                self._retry_cnt = attr.retry_cnt
                self._retries_left = attr.retry_cnt
                self._rnr_retry = attr.rnr_retry
                self._state = QPS_RTS
                pump(self)
        finally:
            self._lock.release_c()

    def _reset(self):
        drop_conns(self, False)
        queues_clear(self)
        self._gen += 1
        self._sq_used = 0
        self._unsig = 0
        self._rnr_wait = False
        self._ack_armed = False
        self._try_start = 0.0
        self._ack_pending = -1
        self._conn_wait = False
        self._auth_key = None
        self._hello_nonces.clear()
        self._state = QPS_RESET

    def post_send(self, list wrs):
        cdef int n = len(wrs), i, st
        cdef sge_t sges[32]
        cdef int nsge
        cdef int64_t total
        self._lock.acquire_c()
        try:
            st = post_begin(self, n)
            checked = [check_send_wr(wr, self.cap) for wr in wrs]  # all, before any is built
            for i in range(n):
                wr = wrs[i]
                read_sges(wr.sg_list, sges, &nsge, &total)
                build_swqe(self, sq_at(self, self._sq_count + i), int(wr.opcode),
                           int(wr.send_flags), wr.wr_id, sges, nsge, checked[i][1],
                           wr.imm_data & 0xFFFFFFFF, wr.rkey & 0xFFFFFFFF,
                           wr.remote_addr & 0xFFFFFFFFFFFFFFFF,
                           wr.compare_add & 0xFFFFFFFFFFFFFFFF, wr.swap & 0xFFFFFFFFFFFFFFFF)
            post_finish(self, n, st)
        finally:
            self._lock.release_c()

    def post_recv(self, list wrs):
        cdef int n = len(wrs), i, st
        cdef rwqe_t *r
        self._lock.acquire_c()
        try:
            st = post_recv_begin(self, n)
            check_recv_wrs(wrs, self.cap)
            for i in range(n):
                wr = wrs[i]
                r = rq_at(self, self._rq_count) if st != QPS_ERR else NULL
                if r != NULL:
                    r.wr_id = wr.wr_id
                    read_sges(wr.sg_list, r.sges, &r.nsge, &r.length)
                    self._rq_count += 1
                else:
                    recv_flushed(self, wr.wr_id)
        finally:
            self._lock.release_c()

    def c_ops(self):
        """The C-level posts (verbs/cverbs.pxd): a PyCapsule named ``CQP_OPS``, and
        this QP, their first argument."""
        return PyCapsule_New(&_QP_OPS, CQP_OPS, NULL), self

    def close(self):
        self._lock.acquire_c()
        try:
            if self._closed:
                return
            drop_conns(self, False)
            self._closed = True
            queues_clear(self)
            self._gen += 1
            self._engine.qps.pop(self.qp_num, None)
            self.send_cq._detach(self)
            self.recv_cq._detach(self)
            self.pd._qps.discard(self)
        finally:
            self._lock.release_c()


api.QP.register(SoftQP)
