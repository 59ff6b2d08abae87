# Posting work requests to the soft QP (included by _core.pyx, after core_qp.pxi): the
# checks of a post, the send WQE built from a work request (its opcode, local memory and
# remote target in C), a flushed receive, and the C-level entry points that the message
# engine calls through ``SoftQP.c_ops()`` (``_QP_OPS``: C work requests, no Python
# objects). ``SoftQP.post_send``/``post_recv`` (core_qp.pxi) are the Python-level ones.


cdef int read_sges(list sg_list, sge_t *out, int *n, int64_t *total) except -1:
    """The SGE objects ``sg_list`` (checked by the contract: at most the QP's SGE count,
    no negative length) as C SGEs."""
    cdef int i = 0
    total[0] = 0
    for s in sg_list:
        out[i].addr = s.addr
        out[i].length = s.length
        out[i].lkey = s.lkey
        total[0] += out[i].length
        i += 1
    n[0] = i
    return 0


cdef int post_begin(SoftQP qp, int n) except -1:
    """The checks of a post of ``n`` send WRs (lock held); returns the QP's state."""
    cdef int st = qp._state
    if qp._closed or st == QPS_RESET or st == QPS_INIT or st == QPS_RTR:
        raise PostError(_errno.EINVAL, f"post_send on a QP in {_QP_STATE[st].name}")
    if qp._sq_used + n > qp._max_send_wr:
        raise PostError(_errno.ENOMEM,
                        f"send queue full ({qp._sq_used} of {qp._max_send_wr} "
                        f"in use, {n} more posted)")
    return st


cdef int post_finish(SoftQP qp, int n, int st) except -1:
    """The ``n`` WQEs built after the send queue's entries are posted (lock held): in
    ERR they complete flushed at once, else they are transmitted in order."""
    cdef int i
    cdef swqe_t *w
    cdef uint32_t psn
    qp._sq_used += n
    if st == QPS_ERR:
        for i in range(n):
            sq_complete(qp, &qp._sq[qp._sq_head], WC_WR_FLUSH_ERR, 0)
            qp._sq_count += 1
            sq_pop(qp)
        return 0
    psn = qp._next_psn
    for i in range(n):
        w = sq_at(qp, qp._sq_count + i)
        w.psn = psn
        _put32(w.hdr + 4, psn)  # (build_swqe encoded the rest of the header)
        psn = (psn + 1) & PSN_MASK
    qp._sq_count += n
    qp._next_psn = psn
    return pump(qp)


cdef int post_recv_begin(SoftQP qp, int n) except -1:
    cdef int st = qp._state
    if qp._closed or st == QPS_RESET:
        raise PostError(_errno.EINVAL, f"post_recv on a QP in {_QP_STATE[st].name}")
    if qp._rq_count + n > qp._max_recv_wr:
        raise PostError(_errno.ENOMEM,
                        f"receive queue full ({qp._rq_count} of "
                        f"{qp._max_recv_wr} in use, {n} more posted)")
    return st


cdef void recv_flushed(SoftQP qp, uint64_t wr_id):
    """A receive WR posted to a QP in ERR completes flushed at once."""
    cdef rwqe_t tmp
    tmp.wr_id = wr_id
    tmp.nsge = 0
    tmp.length = 0
    rq_complete(qp, &tmp, WC_WR_FLUSH_ERR, WCOP_RECV, 0, 0, False, False)


cdef int _c_post_send(object o, c_send_wr_t *wrs, int n) except -1:
    cdef SoftQP qp = <SoftQP>o
    cdef sge_t sge
    cdef int i, st
    cdef c_send_wr_t *wr
    qp._lock.acquire_c()
    try:
        st = post_begin(qp, n)
        for i in range(n):
            wr = &wrs[i]
            if not 0 <= wr.opcode <= 6:
                raise PostError(_errno.EINVAL, f"unknown send opcode {wr.opcode}")
            sge.addr = wr.addr
            sge.length = wr.length
            sge.lkey = wr.lkey
            build_swqe(qp, sq_at(qp, qp._sq_count + i), wr.opcode, wr.send_flags, wr.wr_id,
                       &sge, 1 if wr.length else 0, wr.length, wr.imm_data, wr.rkey,
                       wr.remote_addr, wr.compare_add, wr.swap)
        post_finish(qp, n, st)
    finally:
        qp._lock.release_c()
    return 0


cdef int _c_post_recv(object o, c_recv_wr_t *wrs, int n) except -1:
    cdef SoftQP qp = <SoftQP>o
    cdef int i, st
    cdef rwqe_t *r
    qp._lock.acquire_c()
    try:
        st = post_recv_begin(qp, n)
        for i in range(n):
            if st == QPS_ERR:
                recv_flushed(qp, wrs[i].wr_id)
                continue
            r = rq_at(qp, qp._rq_count)
            r.wr_id = wrs[i].wr_id
            r.nsge = 1 if wrs[i].length else 0
            r.sges[0].addr = wrs[i].addr
            r.sges[0].length = wrs[i].length
            r.sges[0].lkey = wrs[i].lkey
            r.length = wrs[i].length
            qp._rq_count += 1
    finally:
        qp._lock.release_c()
    return 0


cdef c_qp_ops_t _QP_OPS
_QP_OPS.post_send = _c_post_send
_QP_OPS.post_recv = _c_post_recv


cdef int build_swqe(SoftQP qp, swqe_t *w, int wrop, int flags, uint64_t wr_id, sge_t *sges,
                    int nsge, int64_t length, uint32_t imm, uint32_t rkey, uint64_t raddr,
                    uint64_t compare_add, uint64_t swap) except -1:
    """Fill ``w`` from a checked send WR (``length``: its SGEs' total): local memory
    resolved (and pinned) or, INLINE, copied now; its header encoded but for the PSN
    (``post_finish``)."""
    cdef int i
    cdef unsigned char *buf
    cdef SoftMR mr
    cdef int64_t off
    cdef Py_ssize_t at = 0
    cdef hdr_t h
    w.wr_id = wr_id
    w.op = _WIRE_OP[wrop]
    w.wc_opcode = _WC_OP_FOR_WR[wrop]
    w.length = <uint32_t>length
    w.rd_atomic = is_rd_atomic(w.op)
    w.signaled = (flags & SF_SIGNALED) != 0
    w.fence = (flags & SF_FENCE) != 0
    w.rnr_left = -1
    w.error = -1
    w.nsegs = 0
    if flags & SF_INLINE:
        buf = inline_buf(qp, w)
        for i in range(nsge):
            if not sges[i].length:
                continue
            mr = qp._keys.lookup(sges[i].lkey)
            off = (<int64_t>sges[i].addr - <int64_t>mr.addr) if mr is not None else -1
            if mr is not None and 0 <= off and off + sges[i].length <= mr.length:
                memcpy(buf + at, mr.base + off, sges[i].length)
            else:  # inline data needs no registration: read the caller's memory
                memcpy(buf + at, <void *><uintptr_t>sges[i].addr, sges[i].length)
            at += sges[i].length
        if at:
            w.segs[0].ptr = <char *>buf
            w.segs[0].len = at
            w.segs[0].mr = NULL
            w.nsegs = 1
    else:
        w.nsegs = resolve(qp, sges, nsge, w.rd_atomic, w.segs)
        if w.nsegs < 0:
            w.nsegs = 0
            w.error = WC_LOC_PROT_ERR
        else:
            pin_segs(w.segs, w.nsegs)
    if length > WIRE_MAX_MSG:
        w.error = WC_LOC_LEN_ERR
    hdr_set(&h, w.op, 0, w.length)
    if flags & SF_SOLICITED:
        h.flags = FLAG_SOLICITED
    h.imm = imm
    h.rkey = rkey
    h.raddr = raddr
    h.compare_add = compare_add
    h.swap = swap
    hdr_encode(&h, w.hdr)
    return 0
