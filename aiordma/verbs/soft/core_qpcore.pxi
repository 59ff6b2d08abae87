# State shared by the requester and responder halves of a soft RC QP (included by
# _core.pyx): the work queues as C rings, completion generation (with the send-queue
# slot accounting of unsignaled WRs), local SGE resolution and the transition to ERR
# with its flush. Every function here runs with the device lock held.

#: connections a QP admits in its life (each direction may reconnect a few times)
MAX_HELLOS = 16


cdef int qp_alloc(SoftQP qp, object cap) except -1:
    """The QP's rings, sized by ``cap`` (fixed at creation, as a device's)."""
    cdef int i, n
    qp._max_send_wr = cap.max_send_wr
    qp._max_recv_wr = cap.max_recv_wr
    qp._max_inline = cap.max_inline_data
    qp._send_sge = max(cap.max_send_sge, 1)
    qp._recv_sge = max(cap.max_recv_sge, 1)
    n = max(qp._max_send_wr, 1)
    qp._sq = <swqe_t *>calloc(n, sizeof(swqe_t))
    qp._sq_segs = <seg_t *>calloc(n * qp._send_sge, sizeof(seg_t))
    qp._sq_inline = <unsigned char *>malloc(n * max(qp._max_inline, 1))
    m = max(qp._max_recv_wr, 1)
    qp._rq = <rwqe_t *>calloc(m, sizeof(rwqe_t))
    qp._rq_sges = <sge_t *>calloc(m * qp._recv_sge, sizeof(sge_t))
    if (qp._sq == NULL or qp._sq_segs == NULL or qp._sq_inline == NULL or qp._rq == NULL
            or qp._rq_sges == NULL):
        raise MemoryError()
    for i in range(n):
        qp._sq[i].segs = &qp._sq_segs[i * qp._send_sge]
    for i in range(m):
        qp._rq[i].sges = &qp._rq_sges[i * qp._recv_sge]
    qp._sq_head = qp._sq_nsent = qp._sq_count = 0
    qp._rq_head = qp._rq_count = 0
    qp._rq_seq = 0
    return 0


cdef void qp_free(SoftQP qp) noexcept:
    free(qp._sq)
    free(qp._sq_segs)
    free(qp._sq_inline)
    free(qp._rq)
    free(qp._rq_sges)
    qp._sq = NULL
    qp._rq = NULL


cdef inline swqe_t *sq_at(SoftQP qp, int i) noexcept:
    """The send queue's ``i``-th entry from its head (in flight first)."""
    return &qp._sq[(qp._sq_head + i) % qp._max_send_wr]


cdef inline rwqe_t *rq_at(SoftQP qp, int i) noexcept:
    return &qp._rq[(qp._rq_head + i) % qp._max_recv_wr]


cdef inline unsigned char *inline_buf(SoftQP qp, swqe_t *w) noexcept:
    return qp._sq_inline + (w - qp._sq) * max(qp._max_inline, 1)


cdef void unpin_segs(seg_t *segs, int n):
    cdef int i
    for i in range(n):
        if segs[i].mr != NULL:
            (<SoftMR>segs[i].mr).unpin()
            segs[i].mr = NULL


cdef void sq_pop(SoftQP qp):
    """Remove the send queue's head (in flight, else the oldest not transmitted)."""
    cdef swqe_t *w = &qp._sq[qp._sq_head]
    unpin_segs(w.segs, w.nsegs)
    w.nsegs = 0
    qp._sq_head = (qp._sq_head + 1) % qp._max_send_wr
    qp._sq_count -= 1
    if qp._sq_nsent:
        qp._sq_nsent -= 1


cdef inline void rq_pop(SoftQP qp) noexcept:
    qp._rq_head = (qp._rq_head + 1) % qp._max_recv_wr
    qp._rq_count -= 1
    qp._rq_seq += 1


cdef void queues_clear(SoftQP qp):
    """Drop every WQE of both queues without a completion (reset, close)."""
    while qp._sq_count:
        sq_pop(qp)
    qp._sq_head = qp._sq_nsent = 0
    while qp._rq_count:
        rq_pop(qp)


# --- connection owner (a Conn calls them with the device lock held) -------------------
cdef int conn_header(SoftQP qp, Conn conn, const hdr_t *h) except -1:
    """``conn`` parsed the header ``h``: point its sink where the payload goes (or fail
    the connection)."""
    # One connection may carry both directions (see wire: the peer adopted ours):
    # requests go to the responder half, responses to the requester half.
    cdef int op = h.op
    if is_request(op):
        if conn is not qp._resp_conn:
            if conn is qp._req_conn:
                # the peer sends its requests on our connection (it dropped its own)
                if qp._resp_conn is not None:
                    flush_ack(qp)
                qp._resp_conn = conn
            else:
                conn.fail()  # not our protocol: drop the connection
                return 0
        return on_request(qp, conn, h)
    if is_response(op) and conn is qp._req_conn:
        return on_response(qp, conn, h)
    if conn is qp._req_conn or conn is qp._resp_conn:
        conn.fail()
        return 0
    sink_discard(conn, payload_len(h))
    return 0


cdef void conn_batch_end(SoftQP qp, Conn conn) except *:
    """``conn`` parsed what one read brought (the coalesced ACK's moment)."""
    if conn is qp._resp_conn:
        resp_batch_end(qp, conn)


cdef void conn_closed(SoftQP qp, Conn conn) except *:
    """``conn`` is closed (after it left the owner's connections)."""
    if conn is qp._resp_conn:
        qp._resp_conn = None
    if conn is qp._req_conn:
        req_conn_closed(qp, conn)


# --- completions -------------------------------------------------------------------------
cdef void sq_complete(SoftQP qp, swqe_t *w, int status, uint32_t byte_len):
    cdef cqe_t e
    if status == WC_SUCCESS and not w.signaled:
        qp._unsig += 1
        return
    memset(&e, 0, sizeof(e))
    e.wr_id = w.wr_id
    e.status = status
    e.opcode = w.wc_opcode
    e.byte_len = byte_len
    e.qp_num = qp.qp_num
    e.gen = qp._gen
    e.release = 1 + qp._unsig
    qp._unsig = 0
    qp.send_cq.push(&e, qp, False)


cdef void rq_complete(SoftQP qp, rwqe_t *r, int status, int opcode, uint32_t byte_len,
                      uint32_t imm, bint with_imm, bint solicited):
    cdef cqe_t e
    memset(&e, 0, sizeof(e))
    e.wr_id = r.wr_id
    e.status = status
    e.opcode = opcode
    e.byte_len = byte_len
    e.qp_num = qp.qp_num
    e.src_qp = qp._dest_qpn
    e.imm_data = imm
    e.wc_flags = 2 if with_imm else 0  # IBV_WC_WITH_IMM
    e.gen = qp._gen
    qp.recv_cq.push(&e, qp, solicited)


# --- local memory ----------------------------------------------------------------------
cdef int resolve(SoftQP qp, sge_t *sges, int nsge, bint need_write, seg_t *out) except -2:
    """SGEs -> segments of their MRs (zero-length ones left out; not pinned); returns how
    many, or -1 on a protection error (LOC_PROT_ERR)."""
    cdef int i, k = 0
    cdef SoftMR mr
    cdef int64_t off
    for i in range(nsge):
        if sges[i].length == 0:
            continue
        mr = qp._keys.lookup(sges[i].lkey)
        if mr is None or mr.pd is not qp.pd:
            return -1
        if need_write and not mr.acc & ACC_LOCAL_WRITE:
            return -1
        off = <int64_t>sges[i].addr - <int64_t>mr.addr
        if off < 0 or off + sges[i].length > mr.length:
            return -1
        out[k].ptr = mr.base + off
        out[k].len = sges[i].length
        out[k].mr = <void *>mr
        k += 1
    return k


cdef int scatter(seg_t *segs, int n, Py_ssize_t length) noexcept:
    """Trim ``segs`` to their first ``length`` bytes; returns how many segments that is."""
    cdef int i
    cdef Py_ssize_t left = length
    for i in range(n):
        if left <= 0:
            return i
        if segs[i].len > left:
            segs[i].len = left
            return i + 1
        left -= segs[i].len
    return n


cdef void pin_segs(seg_t *segs, int n) noexcept:
    cdef int i
    for i in range(n):
        if segs[i].mr != NULL:
            (<SoftMR>segs[i].mr).pin()


# --- errors ----------------------------------------------------------------------------
cdef int fail_send(SoftQP qp, int status) except -1:
    """The oldest outstanding send WR fails with ``status``; the QP goes to ERR."""
    if qp._sq_count:
        sq_complete(qp, &qp._sq[qp._sq_head], status, 0)
        sq_pop(qp)
    return to_error(qp, None)


cdef int to_error(SoftQP qp, object event) except -1:
    cdef rwqe_t *r
    if qp._closed or qp._state == QPS_ERR:
        return 0
    qp._state = QPS_ERR
    qp._rnr_wait = False
    while qp._sq_count:  # in flight, then not transmitted: posting order
        sq_complete(qp, &qp._sq[qp._sq_head], WC_WR_FLUSH_ERR, 0)
        sq_pop(qp)
    qp._sq_nsent = 0
    while qp._rq_count:
        r = rq_at(qp, 0)
        rq_complete(qp, r, WC_WR_FLUSH_ERR, WCOP_RECV, 0, 0, False, False)
        rq_pop(qp)
    drop_conns(qp, True)
    if event is not None:
        qp._ctx._post_async(api.AsyncEvent(event, qp_num=qp.qp_num))
    return 0


cdef int drop_conns(SoftQP qp, bint graceful) except -1:
    cdef Conn req = qp._req_conn, resp = qp._resp_conn
    qp._req_conn = None
    qp._resp_conn = None
    if graceful and resp is not None and qp._ack_pending >= 0:
        # Requests executed (and maybe already consumed by the application) but not
        # acknowledged yet, because the thread that ran them has not reached the end of
        # its input batch: acknowledge them before the connection goes.
        send_ack(qp, resp, <uint32_t>qp._ack_pending)
        qp._ack_pending = -1
    if req is not None and req is not resp:
        req.shutdown(graceful=False)
    if resp is not None:
        resp.shutdown(graceful=graceful)
    qp._engine.drop_held(qp.qp_num)
    return 0
