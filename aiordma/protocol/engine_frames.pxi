# The frames a pump posts (included by engine.pyx): each builder takes a send buffer
# of the sender's pool, writes its frame there (engine_framing.pxi's layouts) and
# sets the op's work request (``frame_wr``: the slot's reusable SEND, or None on the
# C path, which builds it from ``op.nbytes``). Called by ``Sender``'s pump and its
# fast path (engine_sender.pxi) once the op has its credit.


cdef object frame_wr(Sender s, Op op, int nbytes):
    """The SEND of the frame in ``op``'s slot (that slot's WR; ``_post`` sets wr_id
    and the signaled flag); None on the C path, which builds it from ``nbytes``."""
    op.nbytes = nbytes
    if s.e._qp_ops != NULL:
        return None
    wr = s.frame_wrs[<int>op.slot]
    wr.sg_list[0].length = nbytes
    wr.send_flags = F_INLINE if nbytes <= s.e.inline_cap else 0
    return wr

cdef int build_data(Sender s, Op op) except -1:
    """The DATA frame of ``op``: its payload copied into a send buffer (the caller's
    buffer is free after), the piggybacked credits taken."""
    cdef CreditState credits = s.e.credits
    cdef Slots spool = s.spool
    cdef int slot = spool.acquire_c()
    cdef unsigned char *p
    cdef Py_ssize_t n
    if slot < 0:
        raise RuntimeError("no send buffer (the pump checks)")
    op.slot = slot
    p = spool.ptr(slot)
    n = op_payload_copy(op, p + C_HEADER_SIZE, spool.slot_size - C_HEADER_SIZE)
    if n < 0:
        spool.release_c(slot)
        op.slot = None
        raise LocalProtocolError(f"a {op_payload_len(op)}-byte message does not "
                                 f"fit a {spool.slot_size}-byte send buffer")
    frame_write(p, T_DATA, 0, credits.take_piggyback_c(), <uint32_t>n)
    op.payload = None  # copied: the caller's buffer is free
    op.wr = frame_wr(s, op, C_HEADER_SIZE + n)
    return 0

cdef Op build_batch(Sender s, Op first):
    """Pack ``first`` and the DATA ops after it on the send queue that fit into one
    BATCH frame; returns the op to post (``first`` itself when only it fits)."""
    cdef Op op
    cdef Op carrier
    cdef Slots spool = s.spool
    cdef list members
    cdef Py_ssize_t room, n, off
    cdef int slot
    cdef unsigned char *p
    cdef Fifo sendq = s.sendq
    room = s.e.eager - C_HEADER_SIZE - C_BATCH_RECORD - op_payload_len(first)
    members = [first]
    while sendq.n:
        op = sendq.head_c()
        if op.kind != K_DATA:
            break
        room -= C_BATCH_RECORD + op_payload_len(op)
        if room < 0:
            break
        members.append(sendq.pop_c())
    if len(members) == 1:
        build_data(s, first)
        return first
    slot = spool.acquire_c()
    if slot < 0:
        raise RuntimeError("no send buffer (the pump checks)")
    carrier = new_op(K_BATCH, None, members)
    carrier.slot = slot
    p = spool.ptr(slot)
    off = C_HEADER_SIZE
    for op in members:
        n = op_payload_copy(op, p + off + C_BATCH_RECORD,
                            spool.slot_size - off - C_BATCH_RECORD)
        if n < 0:
            spool.release_c(slot)
            carrier.slot = None
            raise LocalProtocolError(
                f"a BATCH of {len(members)} messages does not fit a "
                f"{spool.slot_size}-byte send buffer")
        _le32(p + off, <uint32_t>n)
        off += C_BATCH_RECORD + n
    frame_write(p, T_BATCH, 0, s.e.credits.take_piggyback_c(), <uint32_t>len(members))
    s.messages_batched += len(members)
    for op in members:
        op.payload = None  # copied: the caller's buffer is free
    carrier.wr = frame_wr(s, carrier, <int>off)
    return carrier

cdef int build_rndv(Sender s, Op op) except -1:
    """The RNDV frame announcing ``op``'s registered source (the receiver READs it)."""
    credits = s.e.credits
    op.slot = s.spool.acquire()
    addr, rkey, length = s.e.port.rndv_source(op.payload)
    buf = s.spool.slot(op.slot)
    n = write_rndv(buf, credits.take_piggyback(), op.msg_id, length, addr, rkey)
    s.rndv_out[op.msg_id] = op
    op.wr = frame_wr(s, op, n)
    return 0

cdef int build_ctrl(Sender s, Op op) except -1:
    """The control frame of ``op`` (RNDV_DONE, CLOSE or CREDIT)."""
    credits = s.e.credits
    op.slot = s.spool.acquire()
    ftype, arg = op.payload
    buf = s.spool.slot(op.slot)
    piggyback = credits.take_piggyback()
    if ftype == T_RNDV_DONE:
        n = write_rndv_done(buf, piggyback, arg, True)
    elif ftype == T_CLOSE:
        n = write_close(buf, piggyback)
    else:
        n = write_credit(buf, piggyback)
    op.wr = frame_wr(s, op, n)
    return 0
