# The requester half of a soft RC QP (included by _core.pyx): transmit send WRs, handle
# responses, RNR back-off (go-back-N), the local ACK timer and its retries, and the
# requester connection's life.
#
# Retries (the QP's ``timeout`` and ``retry_cnt``, with their hardware meaning): one try
# of the local ACK timer lasts ``4.096 us * 2**timeout`` (``timeout`` 0: wait forever).
# A try that ends without any progress -- no response, and no byte of ours taken by or
# of the peer's read from the connection -- uses one retry; the next progress restores
# all ``retry_cnt`` of them. The try after the last retry ends the oldest outstanding WR
# with RETRY_EXC_ERR (so ``(retry_cnt + 1) * 4.096 us * 2**timeout`` without progress).
# Nothing is sent again on a retry: the stream underneath (TCP, or a Unix socket)
# retransmits lost segments itself, and a request resent on it would run twice. A
# connection that breaks (the peer's device closed it, or was killed) fails the QP's
# outstanding WRs at once with RETRY_EXC_ERR, as a NIC's retries into a dead port end.
#
# These run with the device lock held, on the caller's thread (``post_send``: the fast
# path writes straight to the socket) or on the NIC thread.

from ..buffers import SharedMemory

#: smallest ``timeout`` code a try honours (134 ms): the soft responder is a thread of
#: the peer's process, which can stall (GIL, GC, a loaded machine) for tens of
#: milliseconds where a NIC answers in microseconds; a smaller code acts as this one
MIN_TIMEOUT_CODE = 15
#: how long requests wait for the connection the peer QP opens (wire: Connections)
#: before this QP opens one itself
PEER_CONNECT_WAIT_S = 0.05

_NAK_STATUS = {
    NAK_INV_REQ: WC_REM_INV_REQ_ERR,
    NAK_REM_ACCESS: WC_REM_ACCESS_ERR,
    NAK_REM_OP: WC_REM_OP_ERR,
}


def local_ack_timeout_s(timeout):
    """Seconds of one try of the local ACK timer for the QP attribute ``timeout``
    (IBTA: 4.096 us * 2**timeout; codes below ``MIN_TIMEOUT_CODE`` act as it); None for
    0 (wait forever)."""
    if timeout == 0:
        return None
    return 4.096e-6 * (1 << max(timeout, MIN_TIMEOUT_CODE))


# --- connection ----------------------------------------------------------------------
cdef object connect(SoftQP qp, bint lazy, bint at_rtr):
    """The requester connection to the peer QP: the peer's own connection to us when it
    has one (one TCP stream then carries both directions), else a new one (its socket
    made and its non-blocking connect started here, registered on the NIC thread).
    ``lazy``: None when the peer is the one to connect -- the first request connects
    anyway if it has not.

    ``at_rtr`` (``modify`` to RTR): a socket that cannot be made raises
    ``ResourceLimitError`` (out of descriptors) or ``RDMAError``, and when the peer is to
    connect, one descriptor is probed for (its connection will need one), so that a QP
    that could not connect fails its transition rather than its first request.
    Otherwise such a connection fails at once: the QP's requests complete with
    RETRY_EXC_ERR."""
    cdef Conn c, conn
    ah = qp._ah
    engine = qp._engine
    dest = qp._dest_qpn
    cands = ([qp._resp_conn] if qp._resp_conn is not None else []) + engine._held.get(
        qp.qp_num, [])
    for c in cands:
        if c.state == C_OPEN and c.hello is not None and c.hello[0] == dest:
            c.owner = qp  # bound as our responder connection too (release_held)
            qp._req_conn = c
            c.cma_start()
            return c
    if lazy and qp._peer_connects():
        if at_rtr:
            dial.probe_descriptor(engine)
        return None
    gids = engine.gids
    sgid = gids[ah.sgid_index] if 0 <= ah.sgid_index < len(gids) else gids[0]
    conn = Conn(engine, None, qp, state=C_CONNECTING)
    ch = qp.send_cq.channel
    if ch is not None and ch.manual:
        conn.driver = ch  # responses complete on the send CQ: its poller reads them
    conn.send_c([wire.pack_hello(engine.port, qp.qp_num, qp._dest_qpn, sgid,
                                 qp._auth_key or engine.secret)])
    try:
        opened = dial.open_socket(engine, bytes(ah.dgid), ah.dlid)
    except RDMAError:
        conn.fail()
        if at_rtr:
            raise
        qp._req_conn = conn
        return conn
    engine.call_soon(functools.partial(start_connect, engine, conn, *opened))
    qp._req_conn = conn
    return conn


cdef int await_peer_conn(SoftQP qp) except -1:
    """Requests are queued and the peer is the one to connect: give its connection a
    moment to arrive (the NIC thread accepts it and binds it), then connect."""
    if qp._conn_wait:
        return 0
    qp._conn_wait = True
    qp._engine.call_soon(functools.partial(qp._peer_conn_check, qp._gen,
                                           monotonic() + PEER_CONNECT_WAIT_S))
    return 0


cdef int req_conn_closed(SoftQP qp, Conn conn) except -1:
    qp._req_conn = None
    if qp._state == QPS_RTS and qp._sq_count:
        # the peer is gone (killed, reset, refused, or its QP went to ERR)
        fail_send(qp, WC_RETRY_EXC_ERR)
    return 0


# --- transmit ------------------------------------------------------------------------
cdef int pump(SoftQP qp) except -1:
    """Transmit queued WRs in order, as far as RNR wait, fences and errors allow; the
    headers and payloads of a batch go in one write."""
    cdef seg_t out[IOV_CHUNK]
    cdef unsigned char ack[HDR_SIZE]
    cdef hdr_t h
    cdef int k = 0, i, j, cma_min
    cdef Py_ssize_t total = 0
    cdef swqe_t *w
    cdef Conn conn
    cdef bint fenced
    if qp._state != QPS_RTS or qp._rnr_wait or qp._sq_nsent == qp._sq_count:
        return 0
    conn = qp._req_conn
    if conn is None or conn.state >= C_CLOSING:
        conn = connect(qp, True, False)
        if conn is None:
            await_peer_conn(qp)
            return 0
    cma_min = conn.cma_min if conn.cma_ready_c() else -1
    if not qp._sq_nsent:
        qp._progress = monotonic()
    if qp._ack_pending >= 0 and conn is qp._resp_conn:
        hdr_set(&h, OP_ACK, <uint32_t>qp._ack_pending, 0)  # piggybacked on the requests
        hdr_encode(&h, ack)
        out[0].ptr = <char *>ack
        out[0].len = HDR_SIZE
        out[0].mr = NULL
        k = 1
        total = HDR_SIZE
        qp._ack_pending = -1
        if conn.driver is not None:
            conn.driver.ack_sent(qp)  # nothing left for its flush()
    while qp._sq_nsent < qp._sq_count:
        w = sq_at(qp, qp._sq_nsent)
        if w.error >= 0:
            if qp._sq_nsent:
                break  # completes after everything before it
            sq_complete(qp, w, w.error, 0)
            sq_pop(qp)
            to_error(qp, None)
            return 0
        if w.fence:
            fenced = False
            for j in range(qp._sq_nsent):
                if sq_at(qp, j).rd_atomic:
                    fenced = True
                    break
            if fenced:
                break
        if k + 1 + w.nsegs > IOV_CHUNK:  # this batch is full: write it
            conn.requests_sent = True
            conn.send_segs(out, k, total)
            k = 0
            total = 0
        qp._sq_nsent += 1
        if cma_min >= 0 and is_cma_op(w.op) and (
                cma_min <= w.length or (w.op == OP_READ and cma.SHM_MIN <= w.length)):
            if k:  # what came before it goes first
                conn.requests_sent = True
                conn.send_segs(out, k, total)
                k = 0
                total = 0
            if ((cma_min <= w.length and cma_request(qp, w, False))
                    or (w.op == OP_READ and cma.SHM_MIN <= w.length < cma_min
                        and cma_request(qp, w, True))):
                continue
        out[k].ptr = <char *>w.hdr
        out[k].len = HDR_SIZE
        out[k].mr = NULL
        k += 1
        total += HDR_SIZE
        if has_payload(w.op):
            for i in range(w.nsegs):
                out[k] = w.segs[i]
                k += 1
                total += w.segs[i].len
    if k:
        conn.requests_sent = True
        conn.send_segs(out, k, total)
    arm_ack_timer(qp)
    return 0


cdef bint cma_request(SoftQP qp, swqe_t *w, bint shm_only) except -1:
    """Send ``w``'s request in its CMA form (header with FLAG_CMA, the addresses of its
    local SGEs as payload; wire: cross-memory attach); False when ``w`` cannot use it
    (too many SGEs, an inline copy) -- or, with ``shm_only`` (a READ below the CMA
    threshold), when its destination is not shared memory. The caller wrote the
    requests before it first.""" 
    cdef int i
    cdef hdr_t h
    cdef unsigned char raw[HDR_SIZE]
    cdef Conn conn = qp._req_conn
    if w.nsegs > cma.IOV_MAX:
        return False
    for i in range(w.nsegs):
        if w.segs[i].mr == NULL:  # an inline copy: not the requester's memory
            return False
    pairs = [(<uintptr_t>w.segs[i].ptr, w.segs[i].len) for i in range(w.nsegs)]
    shared = (SharedMemory.backing(pairs[0][0], pairs[0][1])
              if w.op == OP_READ and len(pairs) == 1 else None)
    if shared is None and shm_only:
        return False
    hdr_decode(w.hdr, &h)
    h.flags |= FLAG_CMA
    h.aux = <uint16_t>w.nsegs
    if shared is not None:  # wire: FLAG_SHM (fd, offset, inode in imm/compare_add/swap)
        sm, off = shared
        h.flags |= FLAG_SHM
        h.imm = sm.fd
        h.compare_add = off
        h.swap = sm.ino
    hdr_encode(&h, raw)
    conn.send_c([PyBytes_FromStringAndSize(<char *>raw, HDR_SIZE), cma.pack_iov(pairs)])
    return True


# --- local ACK timer (Retries, above) ------------------------------------------------------
cdef double last_progress(SoftQP qp):
    cdef Conn conn = qp._req_conn
    if conn is None:
        return qp._progress
    return max(max(qp._progress, conn.last_tx), conn.last_rx)


cdef int arm_ack_timer(SoftQP qp) except -1:
    if qp._ack_armed or not qp._sq_count:
        return 0
    t = local_ack_timeout_s(qp._timeout)
    if t is None:
        return 0
    qp._ack_armed = True
    start = max(last_progress(qp), qp._try_start)
    qp._engine.call_at(start + t, functools.partial(qp._ack_check, qp._gen))
    return 0


# --- responses -----------------------------------------------------------------------
cdef int on_response(SoftQP qp, Conn conn, const hdr_t *h) except -1:
    cdef int op = h.op
    cdef swqe_t *w
    cdef uint64_t value
    cdef unsigned char le[8]
    if qp._state != QPS_RTS or not is_response(op):
        sink_discard(conn, payload_len(h))
        return 0
    qp._progress = monotonic()
    # implicit acknowledgement of everything before psn (and psn itself for an ACK)
    while qp._sq_nsent:
        w = &qp._sq[qp._sq_head]
        if psn_before(w.psn, h.psn) or (op == OP_ACK and w.psn == h.psn):
            if w.rd_atomic:  # its response cannot be skipped
                break
            sq_complete(qp, w, WC_SUCCESS, w.length)
            sq_pop(qp)
        else:
            break
    if op == OP_ACK:
        if qp._sq_nsent < qp._sq_count:
            pump(qp)
        return 0
    if not qp._sq_nsent or qp._sq[qp._sq_head].psn != h.psn:
        # stale (cannot happen on one TCP stream)
        sink_discard(conn, payload_len(h))
        return 0
    w = &qp._sq[qp._sq_head]
    if op == OP_NAK:
        if h.aux == NAK_RNR:
            return on_rnr(qp, h.flags)
        sq_complete(qp, w, _NAK_STATUS.get(h.aux, WC_REM_OP_ERR), 0)
        sq_pop(qp)
        return to_error(qp, None)
    if op == OP_ATOMIC_RESP:
        _put64(le, h.compare_add)
        if w.nsegs:
            memcpy(w.segs[0].ptr, le, 8)
        sq_complete(qp, w, WC_SUCCESS, 8)
        sq_pop(qp)
        if qp._sq_nsent < qp._sq_count:
            pump(qp)
        return 0
    # READ response
    if h.length != w.length:
        sq_complete(qp, w, WC_BAD_RESP_ERR, 0)
        sq_pop(qp)
        to_error(qp, None)
        sink_discard(conn, payload_len(h))
        return 0
    if h.flags & FLAG_CMA:  # the responder wrote the data in place (cma)
        sq_complete(qp, w, WC_SUCCESS, h.length)
        sq_pop(qp)
        if qp._sq_nsent < qp._sq_count:
            pump(qp)
        return 0
    sink_set(conn, w.segs, w.nsegs, h.length, D_READ_RESP)
    conn._d_qp = qp
    conn._d_gen = qp._gen
    conn._d_psn = h.psn
    conn._d_length = h.length
    return 0


cdef int read_resp_done(SoftQP qp, Conn conn) except -1:
    """A READ response's payload is in the READ's local memory."""
    cdef swqe_t *w
    if qp._gen != conn._d_gen or not qp._sq_nsent:
        return 0
    w = &qp._sq[qp._sq_head]
    if w.psn != conn._d_psn or w.op != OP_READ:
        return 0
    qp._progress = monotonic()
    sq_complete(qp, w, WC_SUCCESS, conn._d_length)
    sq_pop(qp)
    if qp._sq_nsent < qp._sq_count:
        pump(qp)
    return 0


cdef int on_rnr(SoftQP qp, int timer_code) except -1:
    cdef swqe_t *w = &qp._sq[qp._sq_head]
    if w.rnr_left < 0:
        w.rnr_left = qp._rnr_retry
    if qp._rnr_retry != 7:
        if w.rnr_left == 0:
            sq_complete(qp, w, WC_RNR_RETRY_EXC_ERR, 0)
            sq_pop(qp)
            return to_error(qp, None)
        w.rnr_left -= 1
    # go back N: everything from the NAK'd WR on is transmitted again after the delay
    qp._sq_nsent = 0
    qp._rnr_wait = True
    delay = wire.RNR_TIMER_S[timer_code & 31]
    qp._engine.call_at(monotonic() + delay, functools.partial(qp._rnr_resume, qp._gen))
    return 0
