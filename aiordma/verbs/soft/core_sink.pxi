# Where a payload goes: the connection's sink (included by _core.pyx).
#
# A header with a payload (a SEND, a WRITE, a READ response, a CMA request's iovec
# records) sets its connection's sink: up to 33 C segments of registered memory (each
# MR pinned while the sink holds it), or nowhere (``discard``). The parser copies staged
# bytes into it (``sink_feed``), or receives the rest of a large payload straight into its
# current segment; once all ``_sink_remaining`` bytes are in, the sink's job runs (a
# CMA copy, device lock released) and then its done action (``sink_finish``): one of
# the responder's or requester's completions, named by ``_done`` with its parameters in
# the ``_d_*`` fields (no closure object per packet).

cdef enum:
    STAGE_SIZE = 256 * 1024
    DIRECT_MIN = 64 * 1024
    MAX_SINK_SEGS = 33
    # done actions
    D_NONE = 0
    D_SEND = 1        # responder: a SEND's payload is in the receive WQE
    D_WRITE = 2       # responder: a WRITE(_IMM)'s payload is in the target MR
    D_READ_RESP = 3   # requester: a READ response is in the READ's local memory
    D_PY = 4          # a Python callable (_d_call): the CMA requests


cdef class _Scratch:
    """Where discarded payloads go (one buffer for the process)."""
    cdef unsigned char *buf

    def __cinit__(self):
        self.buf = <unsigned char *>malloc(STAGE_SIZE)
        if self.buf == NULL:
            raise MemoryError()


cdef _Scratch _scratch = _Scratch()


cdef inline int sink_set(Conn conn, seg_t *segs, int nsegs, Py_ssize_t length,
                         int done) except -1:
    """Point ``conn``'s sink at ``segs`` (pinning their MRs) for ``length`` bytes, ending
    with the done action ``done`` (its ``_d_*`` parameters are set by the caller)."""
    cdef int i
    if nsegs > MAX_SINK_SEGS:
        raise ValueError("too many segments for a sink")
    for i in range(nsegs):
        conn._sink_segs[i] = segs[i]
        if segs[i].mr != NULL:
            (<SoftMR>segs[i].mr).pin()
    conn._sink_nsegs = nsegs
    conn._sink_idx = 0
    conn._sink_off = 0
    conn._sink_remaining = length
    conn._sink_discard = False
    conn._done = done
    conn._sinking = True
    return 0


cdef inline void sink_discard(Conn conn, Py_ssize_t length) noexcept:
    """Receive ``length`` payload bytes into nowhere (nothing to do for 0)."""
    if length:
        conn._sink_nsegs = 0
        conn._sink_idx = 0
        conn._sink_off = 0
        conn._sink_remaining = length
        conn._sink_discard = True
        conn._done = D_NONE
        conn._sinking = True


cdef inline bint sink_target(Conn conn, char **ptr, Py_ssize_t *n) noexcept:
    """Where the next bytes go (at most ``_sink_remaining``); False when nowhere is left."""
    cdef seg_t *seg
    if conn._sink_discard:
        ptr[0] = <char *>_scratch.buf
        n[0] = conn._sink_remaining if conn._sink_remaining < STAGE_SIZE else STAGE_SIZE
        return True
    while conn._sink_idx < conn._sink_nsegs:
        seg = &conn._sink_segs[conn._sink_idx]
        if conn._sink_off < seg.len:
            ptr[0] = seg.ptr + conn._sink_off
            n[0] = seg.len - conn._sink_off
            if n[0] > conn._sink_remaining:
                n[0] = conn._sink_remaining
            return True
        conn._sink_idx += 1
        conn._sink_off = 0
    return False


cdef inline void sink_advance(Conn conn, Py_ssize_t n) noexcept:
    conn._sink_remaining -= n
    if not conn._sink_discard:
        conn._sink_off += n


cdef Py_ssize_t sink_feed(Conn conn, Py_ssize_t start, Py_ssize_t end) noexcept:
    """Copy staged bytes ``[start, end)`` into the sink; returns how many it took (at
    most ``_sink_remaining``)."""
    cdef Py_ssize_t used = start, k
    cdef char *ptr
    cdef Py_ssize_t room
    while end > used and conn._sink_remaining:
        if not sink_target(conn, &ptr, &room):
            conn._sink_discard = True
            continue
        k = end - used
        if k > room:
            k = room
        if not conn._sink_discard:
            memcpy(ptr, conn._stage + used, k)
        sink_advance(conn, k)
        used += k
    return used - start


cdef void sink_clear(Conn conn):
    """Forget the sink (unpinning its memory) and its done action."""
    cdef int i
    for i in range(conn._sink_nsegs):
        if conn._sink_segs[i].mr != NULL:
            (<SoftMR>conn._sink_segs[i].mr).unpin()
    conn._sink_nsegs = 0
    conn._sinking = False
    conn._done = D_NONE
    conn._d_job = None
    conn._d_call = None
    conn._d_keep = None
    conn._d_qp = None


cdef int sink_finish(Conn conn) except -1:
    """All of the sink's bytes are in: its job (lock released), then, the sink cleared,
    its done action (lock held; its parameters stay in the ``_d_*`` C fields). Raises
    what the job or the action raises. Returns 0."""
    cdef DeviceLock lock
    cdef int done = conn._done
    qp, job, call, keep = conn._d_qp, conn._d_job, conn._d_call, conn._d_keep
    if job is not None:
        lock = conn._lock
        lock.release_c()
        try:
            job()
        finally:
            lock.acquire_c()
    sink_clear(conn)
    if done == D_SEND:
        send_done(<SoftQP>qp, conn)
    elif done == D_WRITE:
        write_done(<SoftQP>qp, conn)
    elif done == D_READ_RESP:
        read_resp_done(<SoftQP>qp, conn)
    elif done == D_PY:
        call()
    return 0
