# A connection's input: the staging buffers it reads into and the read loop that parses
# them (included by _core.pyx, after core_conn.pxi).
#
# Bytes are read into a staging buffer and parsed there. The buffer is borrowed from
# the process's small pool while bytes are staged and given back when all are parsed,
# so an idle or closed connection holds none. A header goes to its QP (``conn_header``)
# or, when the connection has no owner, its payload is discarded; a payload goes to the
# sink (core_sink.pxi). Every function here runs with the device lock held, on the one
# thread that processes the connection's input (``Conn._busy``).

cdef enum:
    #: bytes one read batch takes before it lets the driver serve other connections
    READ_BUDGET = 8 * 1024 * 1024
    #: staging buffers the process keeps for its connections to borrow
    STAGE_POOL = 4

cdef unsigned char *_stage_pool[STAGE_POOL]
cdef int _stage_free = 0


def staging_pooled():
    """How many staging buffers the process's pool keeps for connections to borrow."""
    return _stage_free


cdef int conn_read_input(Conn c) except -1:
    """Read and dispatch one batch (at most READ_BUDGET bytes) of ``c``'s input. The
    lock is held for the whole batch (one acquisition, not one per message), but
    released while a large payload is received straight into its destination. Ends at
    EAGAIN, a short read, the budget, or when the connection stops reading; EOF or a
    socket error fails the connection (``Conn.fail``). Returns 0."""
    cdef DeviceLock lock = c._lock
    cdef Py_ssize_t budget = READ_BUDGET, n, want
    cdef char *ptr
    cdef hdr_t h
    cdef int fd = c.fd
    cdef SoftQP owner
    if c.sock is None or fd < 0:
        return 0
    c._short = False  # a short read drained the socket: stop rather than hit EAGAIN
    while c.reading and c.state == C_OPEN:
        if c._sinking:
            if c._rpos < c._wpos:
                c._rpos += sink_feed(c, c._rpos, c._wpos)
            elif c._sink_remaining >= DIRECT_MIN:
                if budget <= 0 or c._short:
                    break
                if not sink_target(c, &ptr, &want):
                    c._sink_discard = True
                    continue
                lock.release_c()
                with nogil:
                    n = recv(fd, ptr, want, MSG_DONTWAIT)
                lock.acquire_c()
                if n == 0:
                    c.fail()
                    return 0
                if n < 0:
                    if errno == EAGAIN or errno == EINTR:
                        break
                    c.fail()
                    return 0
                c._short = n < want
                sink_advance(c, n)
                budget -= n
            else:
                if budget <= 0 or c._short or not stage_fill(c):
                    break
                budget -= STAGE_SIZE
                continue
            if c._sink_remaining == 0:
                sink_finish(c)
            continue
        if c._wpos - c._rpos >= HDR_SIZE:
            hdr_decode(c._stage + c._rpos, &h)
            c._rpos += HDR_SIZE
            if h.op >= OP_CMA_PROBE:
                c._cma_control(&h)
                continue
            owner = c.owner
            if owner is not None and c.state == C_OPEN:
                conn_header(owner, c, &h)
            else:
                sink_discard(c, payload_len(&h))
            if c._sinking and c._sink_remaining == 0:
                sink_finish(c)
            continue
        if budget <= 0 or c._short or not stage_fill(c):
            break
        budget -= STAGE_SIZE
    if budget != READ_BUDGET:  # bytes came in (the ACK timer's progress)
        c.last_rx = monotonic()
    owner = c.owner
    if owner is not None and c.state == C_OPEN:
        conn_batch_end(owner, c)
    return 0


cdef void stage_take(Conn c) except *:
    """Borrow a staging buffer for ``c`` from the process's pool (or allocate one when
    the pool is empty; MemoryError when that fails)."""
    global _stage_free
    if _stage_free:
        _stage_free -= 1
        c._stage = _stage_pool[_stage_free]
    else:
        c._stage = <unsigned char *>malloc(STAGE_SIZE)
        if c._stage == NULL:
            raise MemoryError()
    c._rpos = c._wpos = 0


cdef void stage_give(Conn c) noexcept:
    """Return ``c``'s staging buffer (nothing staged, or closed) to the pool, or free it
    when the pool is full: an idle or closed connection holds none. Nothing to do when
    it holds none."""
    global _stage_free
    if c._stage == NULL:
        return
    if _stage_free < STAGE_POOL:
        _stage_pool[_stage_free] = c._stage
        _stage_free += 1
    else:
        free(c._stage)
    c._stage = NULL
    c._rpos = c._wpos = 0


cdef bint stage_fill(Conn c) except -1:
    """Read more of ``c``'s socket into staging (borrowing a buffer if it holds none;
    what is staged and unparsed moves to the front when the room left is short).
    Returns True when bytes came, False on EAGAIN, EOF or an error (the last two fail
    the connection)."""
    cdef Py_ssize_t n, room
    if c._stage == NULL:
        stage_take(c)
    if c._rpos == c._wpos:
        c._rpos = c._wpos = 0
    elif STAGE_SIZE - c._wpos < DIRECT_MIN:
        n = c._wpos - c._rpos
        memmove(c._stage, c._stage + c._rpos, n)
        c._rpos, c._wpos = 0, n
    room = STAGE_SIZE - c._wpos
    n = recv(c.fd, c._stage + c._wpos, room, MSG_DONTWAIT)
    if n < 0:
        if errno == EAGAIN or errno == EINTR:
            return False
        c.fail()
        return False
    if n == 0:
        c.fail()  # input ended
        return False
    c._short = n < room
    c._wpos += n
    return True
