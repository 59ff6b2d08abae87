# The message engine's core (included by engine.pyx): what it asks of its driver, and
# one connection's state, credits and single failure path.
#
# It owns everything an endpoint decides per message: the connection's state
# (``ConnectionState``, engine_state.pxi, the one record of it), receive credits (engine_credits.pxi), the send
# queues, posting and signaling (engine_sender.pxi), the receive buffers, received
# messages and rendezvous reads (engine_receiver.pxi), and the single failure path. Events come in
# as calls -- a user's request (queued ops), a work completion (``on_send_completion``,
# ``on_recv_completion``), the peer's credits (in frames) -- and actions go out through
# its ``port``: work requests to post, buffers to re-post, hints to the completion
# reactor, the endpoint's lifecycle hooks; waiters (``Waiter``) are resolved with
# their results. ``Endpoint`` is the asyncio face that turns them into futures.
#
# The port (``EnginePort``) is all the engine knows of the outside; the sans-IO tests
# drive the engine through a recording fake of it.

COPY_AT_SEND = 1024
"""``send_eager`` copies a payload up to this size (not bytes) when it is queued."""
SMALL_PAYLOAD = C_SMALL_PAYLOAD
"""...into the op itself up to this size (no object made for the copy)."""
cdef enum:
    C_COPY_AT_SEND = 1024


def unexpected(exc):
    """True for a failure worth a warning: a failed operation or a protocol violation,
    not a close, an abort, a flush or the peer gone (retries exhausted)."""
    return isinstance(exc, CompletionError | RemoteProtocolError) and not isinstance(
        exc, RetryExceededError | RNRRetryExceededError | FlushedError)


cdef class EnginePort:
    """What the engine asks of its driver: a driver subclasses it and implements every
    method (each raises NotImplementedError here). Every method runs synchronously;
    none may call back into the engine except where noted. (A base class rather than a
    Protocol: compiled, the engine's calls to a compiled driver are C calls, where a
    call through a Protocol is a method lookup by name.)"""

    # ``destroyed``: True once the endpoint's resources are destroyed (nothing may be
    # posted)

    def new_send_id(self):
        """A wr_id for a send WR, larger than every earlier one of this QP."""
        raise NotImplementedError

    def drop_send_id(self, wr_id):
        """``wr_id`` will never complete (not posted, or retired by a later one)."""
        raise NotImplementedError

    def post_send(self, wrs):
        """Post a chain of send WRs. Raises RDMAError (nothing of it was posted)."""
        raise NotImplementedError

    def post_marker(self, wr_id):
        """Post a signaled zero-length SEND (the flush marker). Raises RDMAError."""
        raise NotImplementedError

    def post_recv(self, slots):
        """Post the receive buffers ``slots``. Raises RDMAError (none was posted)."""
        raise NotImplementedError

    def posted(self):
        """Work was posted (the completion reactor may poll)."""
        raise NotImplementedError

    def expedite(self):
        """A frame arrived whose sender waits for its acknowledgement (a burst)."""
        raise NotImplementedError

    def later(self, fn):
        """Call ``fn`` at the end of this loop iteration (may call into the engine)."""
        raise NotImplementedError

    def new_waiter(self, *, quiet=False):
        """A fresh waiter (``quiet``: its failure is not reported when nobody awaits it)."""
        raise NotImplementedError

    def when_done(self, waiter, fn):
        """Call ``fn(succeeded)`` once ``waiter`` is done (may call into the engine)."""
        raise NotImplementedError

    def set_atomic_target(self, wr, addr, lkey):
        """Point atomic ``wr``'s result at the 8 bytes at ``addr``."""
        raise NotImplementedError

    def rndv_source(self, src):
        """``(addr, rkey, length)`` of a rendezvous send's registered source."""
        raise NotImplementedError

    def release_source(self, src):
        """A rendezvous send's source is no longer needed."""
        raise NotImplementedError

    def lease_staging(self, n):
        """A staging buffer of ``n`` bytes for a READ (has ``view`` and ``release()``)."""
        raise NotImplementedError

    def staging_span(self, staging, n):
        """The local span (addr, length, lkey) of ``staging``'s first ``n`` bytes."""
        raise NotImplementedError

    def read_wrs(self, span, length, addr, rkey):
        """The RDMA READ work requests that move ``length`` bytes into ``span``."""
        raise NotImplementedError

    def qp_to_error(self):
        """Move the QP to ERR (ignore a failure to)."""
        raise NotImplementedError

    def on_failed(self, exc, unexpected):
        """The connection just failed with ``exc`` (after every waiter was failed);
        ``unexpected``: a failed operation or a protocol violation (worth a warning), not
        a close, an abort or the peer gone."""
        raise NotImplementedError

    def check_drained(self):
        """A completion arrived after the failure (the teardown waits for the last)."""
        raise NotImplementedError

    def maybe_closed(self):
        """Work finished: a ``close()`` waiting for the pending work may proceed
        (called only while the engine's ``close_watch`` is set)."""
        raise NotImplementedError


cdef class MessageEngine:
    """One connection's data path (module doc). ``connect()`` before sending."""

    def __init__(self, EnginePort port, *, Slots spool, Slots rpool, list frame_wrs,
                 int eager, max_message_size, int inline_cap, int send_depth,
                 int signal_interval, signal_bytes, int repost_batch, rndv_prefetch,
                 busy_ahead, direct_ahead=None):
        self.port = port
        self.state = ConnectionState()
        self.credits = None
        self.first_error = None
        self.eager = eager
        self.eager_payload = eager - 8
        self.max_message_size = max_message_size
        self.inline_cap = inline_cap
        self.batching = False  # the peer accepts BATCH frames (handshake flag)
        self.poke_posts = True
        self._repost_batch_asked = repost_batch
        self.tx = Sender(self, spool, frame_wrs,
                         SendQueue(send_depth, signal_interval, signal_bytes))
        self.rx = Receiver(self, rpool, 1, rndv_prefetch, busy_ahead,
                           busy_ahead if direct_ahead is None else direct_ahead)

    def connect(self, peer_credits, local_slots, peer_eager, peer_max_message, batching):
        """The handshake is done: the peer's limits. Raises ValueError (credits)."""
        if peer_eager != self.eager:  # frames must fit the peer's receive buffers
            self.eager = min(self.eager, peer_eager)
            self.eager_payload = self.eager - 8
        self.max_message_size = min(self.max_message_size, peer_max_message)
        self.batching = batching
        self.credits = CreditState(peer_credits, local_slots,
                                   repost_batch=self._repost_batch_asked)
        self.rx.repost_batch = self.credits.repost_batch

    @property
    def c_path(self):
        """True when the engine posts through C-level operations (``use_qp``)."""
        return self._qp_ops != NULL

    def set_waiter_maker(self, kwargs, make):
        """How ``send_now`` makes its waiters: ``WAITER_TYPE(**kwargs)`` (the type of
        ``register_waiter_type``; ``kwargs`` a dict kept as it is), or ``make()`` where
        ``kwargs`` is None. Raises TypeError for a dict without a registered waiter
        type, or neither a dict nor a callable."""
        if kwargs is not None:
            if WAITER_TYPE is None:
                raise TypeError("no waiter type is registered (register_waiter_type)")
            kwargs = <dict?>kwargs
        elif not callable(make):
            raise TypeError("set_waiter_maker needs a kwargs dict or a callable")
        self._waiter_kw = kwargs
        self._waiter_make = make

    def send_now(self, data):
        """``send_eager`` whose waiter the engine makes (``set_waiter_maker``) once the
        message is posted: nothing but the post runs before the work request reaches the
        device. Returns the op, its ``fut`` the new waiter, or None (nothing queued, no
        waiter made) where ``send_eager`` would. A post that failed in this call fails
        the waiter with its error (the connection's error once it failed)."""
        if self._waiter_kw is None and self._waiter_make is None:
            raise TypeError("send_now before set_waiter_maker")
        cdef Op op = self._send_eager_c(None, data)
        if op is None:
            return None
        if self._waiter_kw is not None:
            fut = PyObject_Call(WAITER_TYPE, (), self._waiter_kw)
        else:
            fut = self._waiter_make()
        op.fut = fut
        if self.state.failed:  # the post failed: nothing can complete it now
            exc, op.error = op.error, None
            fut.set_exception(exc if exc is not None else self.closed_error())
        return op

    def send_eager(self, fut, data):
        """Queue ``data`` as a DATA message and post what can go, where it may go eagerly
        now: ``data`` a bytes, bytearray or memoryview object (those exact types),
        connected, open for sending, at most ``eager_payload`` bytes, and (a memoryview)
        one flat run of unsigned bytes (format ``B``, contiguous). A payload of at most
        ``COPY_AT_SEND`` bytes that is not bytes is copied now (a small copy costs less
        than a view held on the caller's buffer until it is posted): up to
        ``SMALL_PAYLOAD`` bytes into the op itself, else into a bytes object; a larger
        one is held through a view of our own. Returns its op (as
        ``Sender.queue_data``), or None with nothing queued: the caller finds the
        precise error, casts the view, or sends it by rendezvous. Raises ValueError for
        a released memoryview."""
        return self._send_eager_c(fut, data)

    cdef Op _send_eager_c(self, object fut, object data):
        cdef Py_ssize_t n
        cdef Py_buffer view
        cdef Op op
        cdef bint flat
        t = type(data)
        if self.credits is None or not self.state.can_send_c():
            return None
        if t is bytes:  # immutable: held as it is
            n = PyBytes_GET_SIZE(data)
            if n > self.eager_payload or n > self.max_message_size:
                return None
            return self.tx.queue_data_c(fut, data)
        if t is not bytearray and t is not memoryview:
            return None
        PyObject_GetBuffer(data, &view, PyBUF_FULL_RO)
        n = view.len
        flat = view.ndim == 1 and view.itemsize == 1 and (
            view.strides == NULL or view.strides[0] == 1) and (
            view.format == NULL or (view.format[0] == b'B' and view.format[1] == 0))
        if not flat or n > self.eager_payload or n > self.max_message_size:
            PyBuffer_Release(&view)
            return None
        if n <= C_SMALL_PAYLOAD:  # into the op itself: no object for the copy
            op = new_op(K_DATA, fut, None)
            memcpy(op.c_small, view.buf, n)
            PyBuffer_Release(&view)
            op.c_small_len = <int>n
            op.c_inline = True
            return self.tx.queue_op_c(op)
        if n <= C_COPY_AT_SEND:
            try:
                payload = PyBytes_FromStringAndSize(<char *>view.buf, n)
            finally:
                PyBuffer_Release(&view)
        else:
            PyBuffer_Release(&view)
            # A bytearray or a memoryview is held through a view of our own on its
            # buffer: the buffer cannot be resized until it is copied, whatever the
            # caller does with its own view (releasing it leaves ours).
            payload = PyMemoryView_FromObject(data)
        return self.tx.queue_data_c(fut, payload)

    def use_qp(self, qp, ops):
        """Post through the C-level operations ``ops`` (the capsule of a QP's
        ``c_ops()``), ``qp`` (its target) their first argument, from now on: the C path (engine_cpath.pxi). Call before anything is
        posted; its completions then come through ``poll_dispatch`` (or
        ``on_completion``)."""
        cdef c_qp_ops_t *o = <c_qp_ops_t *>PyCapsule_GetPointer(ops, CQP_OPS)
        self._qp = qp
        self._qp_ops = o

    def on_completion(self, wc):
        """A completion (a ``WC``) of one of the engine's own wr_ids (its C path)."""
        if wc.wr_id & WR_ENGINE and wc.wr_id & (1 << 62):
            self.rx.on_wc(wc, wc.wr_id & 0xFFFFFFFF)
        else:
            self.tx.on_wc(wc)

    # ---------------------------------------------------------------- events
    def on_send_completion(self, wc):
        self.tx.on_wc(wc)

    def on_recv_completion(self, wc, slot):
        self.rx.on_wc(wc, slot)

    def shut_wr(self):
        """No more data from us (``send_eof``/``close`` began); our CLOSE follows."""
        if not self.state.failed:
            self.state.handle(Event.SHUT_WR)

    def queue_close(self, waiter, *, final):
        """Queue our CLOSE frame once (it completes ``waiter``); ``final``: nothing is
        sent after it. False when it cannot go (failed, the peer gone): ``waiter`` was
        failed instead."""
        cdef ConnectionState st = self.state
        if not st.failed and final:
            st.handle(Event.CLOSE)
        if st.local is LOCAL_CLOSE_SENT and not st.failed:
            return True
        if st.failed or st.remote is REMOTE_GONE:
            waiter.set_exception(self.closed_error() if st.failed
                                 else ConnectionClosed("the peer closed the connection"))
            return False
        st.handle(Event.SEND_CLOSE)
        self.tx.queue_ctrl(FrameType.CLOSE, 0, waiter)
        return True

    def peer_gone(self):
        """The peer sent CLOSE and then tore its endpoint down. What we received stays
        readable, but nothing can be sent: fail what waits to be posted (sends short of
        credits, one-sided work) or for RNDV_DONE (it would wait forever); nothing more
        is posted (a frame to the dead QP would fail the connection and lose what is left
        to read)."""
        if self.state.failed:
            return
        self.state.handle(Event.PEER_GONE)

        def gone():
            return ConnectionClosed("the peer closed the connection")

        tx = self.tx
        tx.fail_queued(gone)
        in_sq = {id(op) for _w, op in tx.sq.entries()}
        for msg_id, op in list(tx.rndv_out.items()):
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(gone())
            if id(op) not in in_sq:  # else its completion (or teardown) releases it
                del tx.rndv_out[msg_id]
                self.port.release_source(op.payload)

    def fail_unacknowledged(self):
        """After the peer's CLOSE and teardown, the sends it never acknowledged: their
        waiters fail with ConnectionClosed (their buffers stay pinned until teardown)."""
        if self.state.failed:
            return
        for op in self.tx.posted_ops():
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(ConnectionClosed("the peer closed the connection"))

    # ---------------------------------------------------------------- queries
    def ops_pending(self):
        """Work somebody waits for: posted and awaited, queued, or rendezvous sends
        waiting for RNDV_DONE."""
        tx = self.tx
        return bool(tx.sq.awaited or tx.sendq.n or tx.oneq.n or tx.ctrlq.n or tx.rndv_out)

    def closed_error(self):
        """The ConnectionClosed for an operation refused or failed now (``__cause__``:
        the first error)."""
        first = self.first_error
        if first is not None:
            if isinstance(first, ConnectionClosed):
                exc = ConnectionClosed(first.strerror or "connection closed")
                exc.__cause__ = first.__cause__
                return exc
            why = first.strerror if isinstance(first, OSError) and first.strerror else first
            exc = ConnectionClosed(f"connection failed: {why}")
            exc.__cause__ = first
            return exc
        return ConnectionClosed("endpoint is closed")

    # ---------------------------------------------------------------- failure
    def fail(self, exc):
        """The single failure path: record the first error, QP to ERR, fail every waiter.
        Runs once. Posted WRs complete later with WR_FLUSH_ERR; their buffers stay
        pinned until then."""
        if self.first_error is not None:
            return
        self.first_error = exc
        self.state.handle(Event.FAIL)
        port = self.port
        port.qp_to_error()
        tx, rx = self.tx, self.rx
        tx.post_flush_marker()
        err = self.closed_error()
        tx.fail_queued(lambda: err)
        for op in tx.posted_ops():
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(self.closed_error())
        for op in tx.rndv_out.values():
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(self.closed_error())
        for m in rx.rx:
            if m.read is not None and not m.read.done():
                m.read.set_exception(self.closed_error())
        wake(rx.rx_waiters)
        wake(rx.imm_waiters)
        port.on_failed(exc, unexpected(exc))

    def drain_for_teardown(self):
        """The QP is destroyed (or about to be): drop every posted entry and release what
        rendezvous held (staging of received messages, our sources)."""
        port = self.port
        for wr_id, op in self.tx.sq.drain():
            port.drop_send_id(wr_id)
            if op.kind == RNDV:
                port.release_source(op.payload)
        for op in self.tx.rndv_out.values():
            port.release_source(op.payload)
        self.tx.rndv_out.clear()
        for m in self.rx.rx:
            if m.staging is not None:
                m.staging.release()
        self.rx.rx.clear()
