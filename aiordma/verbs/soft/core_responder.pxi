# The responder half of a soft RC QP (included by _core.pyx): execute incoming requests
# in PSN order.
#
# Runs on the thread that reads the connection (the NIC thread, or the event loop in
# manual progress) with the device lock held. SEND/WRITE payloads are received by the
# connection straight into the receive buffer / the target MR (its sink); READ responses
# are written from the MR; atomics execute here, under the device lock, so they are
# atomic across every QP of the device. Successful SEND/WRITE requests are acknowledged
# once per batch of input (coalesced ACK). A WRITE or READ with FLAG_CMA (wire, ``cma``)
# is validated the same way; then the data moves by one cross-memory copy between the
# MR and the requester's process, run by the connection with the device lock released
# (the sink's job), and the request completes as its socket form would. A READ into the
# requester's shared memory (FLAG_SHM) is copied with ``memmove`` into this process's
# mapping of it instead, where that mapping can be made (else by CMA as above). A failed
# copy (the requester's memory is gone) is answered with a remote operational error NAK.

# the done parameters' flags (Conn._d_flags)
cdef enum:
    DF_WITH_IMM = 1
    DF_SOLICITED = 2
    DF_TAKES_RWQE = 4  # WRITE_WITH_IMM: completes the receive WQE named by _d_seq


cdef int resp_batch_end(SoftQP qp, Conn conn) except -1:
    cdef SoftCompChannel ch
    if qp._ack_pending >= 0:
        ch = conn.driver
        if ch is not None and ch.defer_ack(qp):
            return 0  # the loop answers soon: the ACK rides on that, or is flushed
        send_ack(qp, conn, <uint32_t>qp._ack_pending)
        qp._ack_pending = -1
    return 0


cdef int flush_ack(SoftQP qp) except -1:
    """Send the coalesced ACK now, unless something already carried it (lock held)."""
    cdef Conn conn = qp._resp_conn
    if qp._ack_pending >= 0 and conn is not None:
        send_ack(qp, conn, <uint32_t>qp._ack_pending)
        qp._ack_pending = -1
    return 0


cdef int send_ack(SoftQP qp, Conn conn, uint32_t psn) except -1:
    cdef hdr_t h
    cdef unsigned char raw[HDR_SIZE]
    cdef seg_t seg
    hdr_set(&h, OP_ACK, psn, 0)
    hdr_encode(&h, raw)
    seg.ptr = <char *>raw
    seg.len = HDR_SIZE
    seg.mr = NULL
    return conn.send_segs(&seg, 1, HDR_SIZE)


cdef int respond(SoftQP qp, Conn conn, const hdr_t *h, seg_t *payload) except -1:
    """Send the response ``h`` (with ``payload``, a READ's data, where not NULL); any
    response acknowledges everything before it."""
    cdef unsigned char raw[HDR_SIZE]
    cdef seg_t segs[2]
    qp._ack_pending = -1
    hdr_encode(h, raw)
    segs[0].ptr = <char *>raw
    segs[0].len = HDR_SIZE
    segs[0].mr = NULL
    if payload != NULL and payload.len:
        segs[1] = payload[0]
        return conn.send_segs(segs, 2, HDR_SIZE + payload.len)
    return conn.send_segs(segs, 1, HDR_SIZE)


cdef int nak_error(SoftQP qp, Conn conn, uint32_t psn, int syndrome, object event) except -1:
    cdef hdr_t h
    hdr_set(&h, OP_NAK, psn, 0)
    h.aux = <uint16_t>syndrome
    respond(qp, conn, &h, NULL)
    return to_error(qp, event)


cdef int rkey_seg(SoftQP qp, uint32_t rkey, uint64_t raddr, uint32_t length, int right,
                  seg_t *out) except -2:
    """``out`` = the ``length`` bytes at ``raddr`` of the MR of ``rkey`` (not pinned);
    0, or -1 when the key, the range or the right does not allow it."""
    cdef SoftMR mr = qp._keys.lookup(rkey)
    cdef int64_t off
    if mr is None or mr.pd is not qp.pd:
        return -1
    if not (mr.acc & right) or not (qp._acc & right):
        return -1
    off = <int64_t>raddr - <int64_t>mr.addr
    if off < 0 or off + length > mr.length:
        return -1
    out.ptr = mr.base + off
    out.len = length
    out.mr = <void *>mr
    return 0


cdef inline int qp_right(int op) noexcept:
    """The QP access flag a remote operation needs (checked before any MR); 0: none."""
    if op == OP_WRITE or op == OP_WRITE_IMM:
        return ACC_REMOTE_WRITE
    if op == OP_READ:
        return ACC_REMOTE_READ
    if op == OP_CMP_SWP or op == OP_FETCH_ADD:
        return ACC_REMOTE_ATOMIC
    return 0


cdef int on_request(SoftQP qp, Conn conn, const hdr_t *h) except -1:
    cdef int op = h.op, right, n
    cdef uint32_t plen = payload_len(h), psn = h.psn
    cdef rwqe_t *r
    cdef seg_t segs[MAX_SINK_SEGS]
    cdef seg_t target
    cdef hdr_t resp
    cdef uint64_t old
    cdef unsigned char le[8]
    if (qp._state != QPS_RTR and qp._state != QPS_RTS) or psn != qp._epsn \
            or not is_request(op):
        # out of sequence (e.g. behind an RNR NAK'd request): drop, the requester resends
        sink_discard(conn, plen)
        return 0
    if (op == OP_SEND or op == OP_SEND_IMM or op == OP_WRITE_IMM) and not qp._rq_count:
        hdr_set(&resp, OP_NAK, psn, 0)
        resp.aux = NAK_RNR
        resp.flags = qp._min_rnr_timer & 31
        respond(qp, conn, &resp, NULL)
        sink_discard(conn, plen)
        return 0
    right = qp_right(op)
    if right and not (qp._acc & right):
        # The QP itself does not allow this operation: an invalid request (rxe:
        # REM_INV_REQ_ERR at the requester, no async event), not an access error.
        nak_error(qp, conn, psn, NAK_INV_REQ, None)
        sink_discard(conn, plen)
        return 0
    if op == OP_SEND or op == OP_SEND_IMM:
        r = rq_at(qp, 0)
        if h.length > r.length:
            rq_complete(qp, r, WC_LOC_LEN_ERR, WCOP_RECV, 0, 0, False, False)
            rq_pop(qp)
            # rxe answers a too-long SEND with a remote operational error NAK
            nak_error(qp, conn, psn, NAK_REM_OP, EventType.QP_REQ_ERR)
            sink_discard(conn, h.length)
            return 0
        n = resolve(qp, r.sges, r.nsge, True, segs)
        if n < 0:
            rq_complete(qp, r, WC_LOC_PROT_ERR, WCOP_RECV, 0, 0, False, False)
            rq_pop(qp)
            nak_error(qp, conn, psn, NAK_REM_OP, None)
            sink_discard(conn, h.length)
            return 0
        sink_set(conn, segs, scatter(segs, n, h.length), h.length, D_SEND)
        conn._d_qp = qp
        conn._d_gen = qp._gen
        conn._d_seq = qp._rq_seq
        conn._d_psn = psn
        conn._d_length = h.length
        conn._d_imm = h.imm
        conn._d_flags = ((DF_WITH_IMM if op == OP_SEND_IMM else 0)
                         | (DF_SOLICITED if h.flags & FLAG_SOLICITED else 0))
        return 0
    if op == OP_WRITE or op == OP_WRITE_IMM:
        n = 0
        if h.length:
            if rkey_seg(qp, h.rkey, h.raddr, h.length, ACC_REMOTE_WRITE, &target) < 0:
                nak_error(qp, conn, psn, NAK_REM_ACCESS, EventType.QP_ACCESS_ERR)
                sink_discard(conn, plen)
                return 0
            n = 1
        if h.flags & FLAG_CMA:
            qp._cma_write(conn, op, psn, h.length, h.imm, h.flags, plen,
                          _seg_view(&target) if n else None)
            return 0
        sink_set(conn, &target, n, h.length, D_WRITE)
        conn._d_qp = qp
        conn._d_gen = qp._gen
        conn._d_seq = qp._rq_seq
        conn._d_psn = psn
        conn._d_length = h.length
        conn._d_imm = h.imm
        conn._d_flags = ((DF_WITH_IMM | DF_TAKES_RWQE if op == OP_WRITE_IMM else 0)
                         | (DF_SOLICITED if h.flags & FLAG_SOLICITED else 0))
        return 0
    if op == OP_READ:
        hdr_set(&resp, OP_READ_RESP, psn, h.length)
        if h.length:
            if rkey_seg(qp, h.rkey, h.raddr, h.length, ACC_REMOTE_READ, &target) < 0:
                nak_error(qp, conn, psn, NAK_REM_ACCESS, EventType.QP_ACCESS_ERR)
                sink_discard(conn, plen)
                return 0
            if h.flags & FLAG_CMA:
                shm = (h.imm, h.swap, h.compare_add) if h.flags & FLAG_SHM else None
                qp._cma_read(conn, psn, _seg_view(&target), plen, shm)
                return 0
            qp._epsn = psn_add(psn, 1)
            respond(qp, conn, &resp, &target)
        else:
            qp._epsn = psn_add(psn, 1)
            respond(qp, conn, &resp, NULL)
        sink_discard(conn, plen)  # a zero-length READ never uses CMA: normally nothing
        return 0
    # atomics
    if rkey_seg(qp, h.rkey, h.raddr, 8, ACC_REMOTE_ATOMIC, &target) < 0:
        nak_error(qp, conn, psn, NAK_REM_ACCESS, EventType.QP_ACCESS_ERR)
        return 0
    if h.raddr % 8:
        nak_error(qp, conn, psn, NAK_INV_REQ, EventType.QP_REQ_ERR)
        return 0
    memcpy(le, target.ptr, 8)
    old = _get64(le)
    if op == OP_FETCH_ADD:
        _put64(le, old + h.compare_add)
        memcpy(target.ptr, le, 8)
    elif old == h.compare_add:
        _put64(le, h.swap)
        memcpy(target.ptr, le, 8)
    qp._epsn = psn_add(psn, 1)
    hdr_set(&resp, OP_ATOMIC_RESP, psn, 0)
    resp.compare_add = old
    return respond(qp, conn, &resp, NULL)


cdef object _seg_view(seg_t *s):
    """A memoryview of segment ``s`` of an MR (it keeps the MR's memory exported)."""
    cdef SoftMR mr = <SoftMR>s.mr
    cdef Py_ssize_t off = s.ptr - mr.base
    return mr.view[off:off + s.len]


cdef int send_done(SoftQP qp, Conn conn) except -1:
    """A SEND's payload is in the receive WQE it took."""
    cdef rwqe_t *r
    if qp._gen != conn._d_gen or not qp._rq_count or qp._rq_seq != conn._d_seq:
        return 0
    r = rq_at(qp, 0)
    qp._epsn = psn_add(conn._d_psn, 1)
    qp._ack_pending = conn._d_psn
    rq_complete(qp, r, WC_SUCCESS, WCOP_RECV, conn._d_length, conn._d_imm,
                conn._d_flags & DF_WITH_IMM, conn._d_flags & DF_SOLICITED)
    rq_pop(qp)
    return 0


cdef int write_done(SoftQP qp, Conn conn) except -1:
    """A WRITE's payload is in the target MR (WRITE_WITH_IMM: it completes a receive)."""
    cdef rwqe_t *r
    if qp._gen != conn._d_gen or (qp._state != QPS_RTR and qp._state != QPS_RTS):
        return 0
    if conn._d_flags & DF_TAKES_RWQE:
        if not qp._rq_count or qp._rq_seq != conn._d_seq:
            return 0
        r = rq_at(qp, 0)
        rq_complete(qp, r, WC_SUCCESS, WCOP_RECV_RDMA_WITH_IMM, conn._d_length,
                    conn._d_imm, True, conn._d_flags & DF_SOLICITED)
        rq_pop(qp)
    qp._epsn = psn_add(conn._d_psn, 1)
    qp._ack_pending = conn._d_psn
    return 0


cdef int cma_sink(Conn conn, object copy, object on_done) except -1:
    """Point ``conn``'s sink at ``copy``'s iovec records (the request's payload), with
    its copy as the job and ``on_done`` after it."""
    cdef seg_t seg
    cdef Py_buffer buf
    iov = copy.iov
    PyObject_GetBuffer(iov, &buf, PyBUF_WRITABLE)
    seg.ptr = <char *>buf.buf
    seg.len = buf.len
    seg.mr = NULL
    PyBuffer_Release(&buf)  # (the copy keeps the bytearray alive and unresized)
    sink_set(conn, &seg, 1 if seg.len else 0, seg.len, D_PY)
    conn._d_job = copy.run
    conn._d_call = on_done
    conn._d_keep = copy
    return 0


class _CMACopy:
    """One CMA request's data movement: collect the requester's iovec records (the
    request's payload), then copy between them and ``local`` (MR slices, kept alive
    here) with the device lock released. ``err``: 0, or the errno of a failed copy
    (also EINVAL when the records do not add up to the local length)."""

    __slots__ = ("pid", "local", "write", "iov", "err", "conn", "shm")

    def __init__(self, conn, local, plen, write, shm=None):
        self.pid = conn.peer_pid()
        self.local = local
        self.write = write
        self.iov = bytearray(plen)
        self.err = 0
        self.conn = conn
        self.shm = shm  # READ into a shared buffer: (fd, inode, offset), wire FLAG_SHM

    def run(self):
        local = [(cma.address_of(v), len(v)) for v in self.local if len(v)]
        remote = cma.unpack_iov(self.iov)
        shm = self.shm
        if shm is not None and len(local) == 1 and self.pid > 0:
            addr, n = local[0]
            if sum(k for _, k in remote) == n:  # the records agree on the length
                hit = self.conn.peer_maps().target(shm[0], shm[1], shm[2], n)
                if hit is not None:
                    cma.memmove(hit[1], addr, n)
                    return
        self.err = (cma.copy(self.pid, local, remote, self.write) if self.pid > 0
                    else _errno.EPERM)
