# The C-level operations of the verbs provider (verbs/cverbs.pxd), included by
# fastpath.pyx: a compiled caller (the message engine) posts C work requests and polls C
# completions of an IbvQP/IbvCQ through these, on the QPPoster/CQPoller that
# ``IbvQP.c_ops()``/``IbvCQ.c_ops()`` name as the operations' first argument. They do
# what ``IbvQP.post_send``/``post_recv`` and ``IbvCQ.poll`` do, in C: the QP's state
# checked, the queue accounting (queues.WorkQueues) updated, a QP in ERR flushed after a
# post, the opcode of an error completion (undefined in verbs) taken from the
# accounting, the QP moved to ERR by one. Python runs only on those slow paths.

# ibv_wr_opcode -> the ibv_wc_opcode of its completion (enums.WC_OPCODE_FOR_WR)
cdef enum:
    _N_WR_OPCODES = 16
cdef int _WC_OP_FOR_WR[_N_WR_OPCODES]
for _wr, _wc in WC_OPCODE_FOR_WR.items():
    _WC_OP_FOR_WR[int(_wr)] = int(_wc)
del _wr, _wc

# ibv_qp_state: no send before RTS, no receive in RESET; ERR flushes what is posted
cdef enum:
    _QPS_RESET = 0
    _QPS_RTS = 3
    _QPS_ERR = 6


cdef inline int _check_post(QPPoster p, int n, bint send) except -1:
    """Refuse a post as ``IbvQP.post_send``/``post_recv`` do (PostError)."""
    cdef WorkQueues q = p.queues
    what = "post_send" if send else "post_recv"
    if p.qp == NULL or q is None:
        raise PostError(EINVAL, f"{what} on a closed QP")
    if (p.state < _QPS_RTS) if send else (p.state == _QPS_RESET):
        raise PostError(EINVAL, f"{what} on a QP in {QPState(p.state).name}")
    if send and n > q.max_send - q.sq_len:
        raise PostError(ENOMEM, f"send queue full ({q.sq_len} of {q.max_send} in use, "
                        f"{n} more posted)")
    if not send and n > q.max_recv - q.rq_len:
        raise PostError(ENOMEM, f"receive queue full ({q.rq_len} of {q.max_recv} in use, "
                        f"{n} more posted)")
    return 0


cdef int _after_post(QPPoster p, int rc, bint send) except -1:
    """The slow end of a post: the device's refusal raised, a QP in ERR flushed."""
    if rc:
        call = "ibv_post_send" if send else "ibv_post_recv"
        raise PostError(rc, f"{call}: {os.strerror(rc)}")
    if p.state == _QPS_ERR:
        qp = p.owner() if p.owner is not None else None
        if qp is not None:
            qp._flush_posted()
    return 0


cdef int _c_post_send(object o, c_send_wr_t *wrs, int n) except -1:
    cdef QPPoster p = <QPPoster>o
    cdef ibv_send_wr *arr
    cdef ibv_send_wr *w
    cdef c_send_wr_t *c
    cdef int i, op, rc
    cdef int posted = 0
    if n <= 0:
        return 0
    _check_post(p, n, True)
    arr = p.send_array(n)
    for i in range(n):
        c = &wrs[i]
        w = &arr[i]
        op = c.opcode
        if op < 0 or op >= _N_WR_OPCODES:
            raise ValueError(f"work request opcode {op}")
        w.wr_id = c.wr_id
        w.opcode = op
        w.send_flags = c.send_flags
        if c.length:
            w.sg_list[0].addr = c.addr
            w.sg_list[0].length = c.length
            w.sg_list[0].lkey = c.lkey
            w.num_sge = 1
        else:
            w.num_sge = 0
        if op == IBV_WR_SEND_WITH_IMM or op == IBV_WR_RDMA_WRITE_WITH_IMM:
            w.imm_data = htonl(c.imm_data)
        if op == IBV_WR_RDMA_WRITE or op == IBV_WR_RDMA_WRITE_WITH_IMM \
                or op == IBV_WR_RDMA_READ:
            w.wr.rdma.remote_addr = c.remote_addr
            w.wr.rdma.rkey = c.rkey
        elif op == IBV_WR_ATOMIC_CMP_AND_SWP or op == IBV_WR_ATOMIC_FETCH_AND_ADD:
            w.wr.atomic.remote_addr = c.remote_addr
            w.wr.atomic.compare_add = c.compare_add
            w.wr.atomic.swap = c.swap
            w.wr.atomic.rkey = c.rkey
    rc = p.post_send_array(n, &posted)
    for i in range(posted):
        c = &wrs[i]
        p.queues.push_send(c.wr_id, (c.send_flags & IBV_SEND_SIGNALED) != 0,
                           _WC_OP_FOR_WR[c.opcode])
    return _after_post(p, rc, True)


cdef int _c_post_recv(object o, c_recv_wr_t *wrs, int n) except -1:
    cdef QPPoster p = <QPPoster>o
    cdef ibv_recv_wr *arr
    cdef int i, rc
    cdef int posted = 0
    if n <= 0:
        return 0
    _check_post(p, n, False)
    arr = p.recv_array(n)
    for i in range(n):
        arr[i].wr_id = wrs[i].wr_id
        arr[i].sg_list[0].addr = wrs[i].addr
        arr[i].sg_list[0].length = wrs[i].length
        arr[i].sg_list[0].lkey = wrs[i].lkey
        arr[i].num_sge = 1
    rc = p.post_recv_array(n, &posted)
    for i in range(posted):
        p.queues.push_recv(wrs[i].wr_id)
    return _after_post(p, rc, False)


cdef int _c_poll(object o, c_wc_t *out, int n) except -1:
    cdef CQPoller p = <CQPoller>o
    cdef int rc, i, hint
    cdef ibv_wc *w
    cdef c_wc_t *c
    cdef _Tracked t
    if p.overrun:
        raise CQOverrunError()
    rc = p.poll_array(n)  # (0 once closed)
    if rc < 0:
        p.overrun = True
        cq = p.owner() if p.owner is not None else None
        if cq is not None:
            cq._overrun_detected()
        raise CQOverrunError(f"completion queue overrun (ibv_poll_cq returned {rc})")
    for i in range(rc):
        w = &p.wcs[i]
        c = &out[i]
        c.wr_id = w.wr_id
        c.status = w.status
        c.opcode = w.opcode
        c.byte_len = w.byte_len
        c.vendor_err = <int>w.vendor_err
        c.imm_data = ntohl(w.imm_data) if w.wc_flags & IBV_WC_WITH_IMM else 0
        c.qp_num = w.qp_num
        c.src_qp = w.src_qp
        c.wc_flags = <int>w.wc_flags
        t = p.last
        if t is None or t.qp_num != w.qp_num:
            t = p.tracked.get(w.qp_num)
            if t is None:
                continue
            p.last = t
        if w.status == 0 and w.opcode & _WC_RECV_BIT and t.recv_side:
            t.queues.recv_done()  # the most frequent completion: its receive slot is free
            continue
        hint = t.queues.complete(w.wr_id, w.status == 0, w.opcode, t.send_side, t.recv_side)
        if w.status != 0:
            if hint >= 0:
                c.opcode = hint
            qp = t.qp()
            if qp is not None:  # an error completion means the QP is in ERR now
                qp._state = QPState.ERR
    return rc


cdef c_qp_ops_t _QP_OPS
_QP_OPS.post_send = _c_post_send
_QP_OPS.post_recv = _c_post_recv
cdef c_cq_ops_t _CQ_OPS
_CQ_OPS.poll = _c_poll


def qp_ops():
    """The C-level posts (cverbs.pxd) of a ``QPPoster``, in a PyCapsule named
    ``CQP_OPS`` (``IbvQP.c_ops``)."""
    return PyCapsule_New(&_QP_OPS, CQP_OPS, NULL)


def cq_ops():
    """The C-level poll (cverbs.pxd) of a ``CQPoller``, in a PyCapsule named
    ``CCQ_OPS`` (``IbvCQ.c_ops``)."""
    return PyCapsule_New(&_CQ_OPS, CCQ_OPS, NULL)


def _post_send_c(poster, list wrs):
    """Post ``wrs`` -- ``(wr_id, opcode, send_flags, addr, length, lkey, imm_data, rkey,
    remote_addr, compare_add, swap)`` tuples -- through the C-level ``post_send``, as a
    compiled caller does (for tests)."""
    cdef c_send_wr_t cw[8]
    cdef int i
    if len(wrs) > 8:
        raise ValueError("at most 8 work requests")
    for i, t in enumerate(wrs):
        (cw[i].wr_id, cw[i].opcode, cw[i].send_flags, cw[i].addr, cw[i].length,
         cw[i].lkey, cw[i].imm_data, cw[i].rkey, cw[i].remote_addr, cw[i].compare_add,
         cw[i].swap) = t
    _c_post_send(poster, cw, len(wrs))


def _post_recv_c(poster, list wrs):
    """Post ``wrs`` -- ``(wr_id, addr, length, lkey)`` tuples -- through the C-level
    ``post_recv`` (for tests)."""
    cdef c_recv_wr_t cw[8]
    cdef int i
    if len(wrs) > 8:
        raise ValueError("at most 8 work requests")
    for i, t in enumerate(wrs):
        cw[i].wr_id, cw[i].addr, cw[i].length, cw[i].lkey = t
    _c_post_recv(poster, cw, len(wrs))


def _poll_c(poller, int n):
    """Poll up to ``n`` (at most 8) completions through the C-level ``poll`` (for
    tests): ``(wr_id, status, opcode, byte_len, imm_data, qp_num, wc_flags)`` each."""
    cdef c_wc_t cw[8]
    cdef int i, k
    k = _c_poll(poller, cw, n if n < 8 else 8)
    return [(cw[i].wr_id, cw[i].status, cw[i].opcode, cw[i].byte_len, cw[i].imm_data,
             cw[i].qp_num, cw[i].wc_flags) for i in range(k)]
