# The send side's completions (included by engine.pyx, after engine_sender.pxi): what
# each send completion finishes. A completion retires every op posted before it (one
# send queue, in order; unsignaled WRs complete with the next signaled one): their eager
# buffers go back to the pool and their waiters are resolved, or failed with the error
# the completion means (engine_sender.pxi's signaling rules say which WRs are signaled).
# Module-level C functions of the Sender, called directly (no method lookup): the C
# path's poll (engine_cpath.pxi) calls ``sent_wc_c``, the reactor the Sender's ``on_wc``.


cdef int sent_wc_c(Sender tx, const c_wc_t *wc) except -1:
    """``sent_wc`` for a completion as a C struct (the C path's poll; a failed one goes
    through ``sent_wc`` as a ``WC``). Returns 0."""
    cdef SendQueue sq = tx.sq
    cdef int k, i
    cdef uint64_t entry_id
    cdef MessageEngine e = tx.e
    cdef Op op
    if wc.status != WC_SUCCESS_:
        sent_wc(tx, make_wc(wc))
        return 0
    k = sq.count_to(wc.wr_id)
    if not k:
        tx.in_tick = False
        return 0
    if k == 1:
        op = sq.pop_c(&entry_id)
        tx.in_tick = op.kind == K_BATCH
        sent_finish(tx, op, None, None)
    else:
        entries = []
        for i in range(k):
            entries.append(sq.pop_c(&entry_id))
        tx.in_tick = True
        for op in entries:
            sent_finish(tx, op, None, None)
    return sent_after(tx, e)


cdef int sent_wc(Sender tx, object wc) except -1:
    """A send completion (the provider's ``WC``; ``Sender.on_wc``, the reactor's handler
    of every send work request): it retires every op of the send queue up to its wr_id
    (those before it were unsignaled and completed with it), finishing each in order,
    then lets the sender post what waits, or tells the port a failed connection's
    queue may be drained. Returns 0."""
    cdef SendQueue sq = tx.sq
    cdef int k = sq.count_to(wc.wr_id), i
    cdef uint64_t entry_id
    cdef MessageEngine e = tx.e
    cdef Op op
    if not k:
        tx.in_tick = False
        return 0
    # One finished send (a round trip): the next one may go at once. Several (a
    # window of senders wakes up): what they send next is batched at the end of
    # the iteration instead of the first going alone.
    port = e.port
    if k == 1:
        op = sq.pop_c(&entry_id)
        tx.in_tick = op.kind == K_BATCH
        sent_finish(tx, op, wc, None)
    else:
        # (taken off first: finishing one may post, or fail and drain the queue)
        entries = []
        for i in range(k):
            op = sq.pop_c(&entry_id)
            entries.append((entry_id, op))
        tx.in_tick = True
        for i in range(k - 1):
            entry_id, op = entries[i]
            port.drop_send_id(entry_id)
            sent_finish(tx, op, None, None)
        sent_finish(tx, entries[k - 1][1], wc, None)
    return sent_after(tx, e)


cdef inline int sent_after(Sender tx, MessageEngine e) except -1:
    """What follows the ops a completion finished: a failed connection's port learns
    its send queue may be drained, else the sender posts what waits; then the port's
    close watch looks. Returns 0."""
    port = e.port
    if e.state.failed:
        port.check_drained()
    elif tx.sendq.n or tx.oneq.n or tx.ctrlq.n:
        tx.pump_c()
    if e.close_watch:
        port.maybe_closed()
    return 0


cdef int sent_finish(Sender tx, Op op, object wc, object exc) except -1:
    """Complete ``op`` (``Sender.finish``): its eager buffer goes back to the pool (an
    atomic's old value read out of it first); ``wc`` None means an unsignaled success,
    a failed ``wc`` fails the connection (``sent_error``), ``exc`` is a local error.
    Then its waiter is resolved or failed: every message of a BATCH frame; an RNDV's
    only on failure (its sender waits for RNDV_DONE), with its source released.
    Returns 0."""
    cdef Slots spool = tx.spool
    cdef Op m
    cdef int slot
    cdef bint ok = wc is None or wc.status == WC_SUCCESS_
    old = 0
    if op.slot is not None:
        slot = op.slot
        if op.kind == K_ATOMIC and exc is None and ok:
            old = _get64(spool.ptr(slot))
        spool.release_c(slot)
        op.slot = None
    if exc is None and not ok:
        exc = sent_error(tx, wc)
    fut = op.fut
    if op.kind == K_BATCH:
        for m in op.payload:
            if m.fut is None:
                continue
            if exc is None:
                resolve_c(m.fut, None)
            elif not m.fut.done():
                m.fut.set_exception(exc)
        return 0
    if op.kind == K_RNDV:
        if exc is not None:
            tx.rndv_out.pop(op.msg_id, None)
            tx.e.port.release_source(op.payload)
            if fut is not None and not fut.done():
                fut.set_exception(exc)
        return 0  # success: the user's waiter completes on RNDV_DONE
    if fut is None:
        if exc is not None:
            op.error = exc  # (a waiter made after the post: ``send_now``)
        return 0
    if exc is None:
        resolve_c(fut, old if op.kind == K_ATOMIC else None)
    elif not fut.done():
        fut.set_exception(exc)
    return 0


cdef object sent_error(Sender tx, object wc):
    """The exception for an op whose completion ``wc`` failed, having failed the
    connection: the completion's own error for the first failure, the connection's
    closed error for a flushed op, a retry exhaustion or any later failure."""
    e = tx.e
    err = completion_error(wc.status, vendor_err=wc.vendor_err, wr_id=wc.wr_id,
                           opcode=wc.opcode)
    if wc.status == WC_FLUSHED_:
        if not e.state.failed:
            e.fail(err)
        return e.closed_error()
    first = e.first_error is None
    e.fail(err)
    if int(wc.status) in (WC_RETRY_EXC_, WC_RNR_RETRY_EXC_) or not first:
        return e.closed_error()
    return err
