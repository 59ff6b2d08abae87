# One connection of the soft device: its socket, its output and its life (included by
# _core.pyx).
#
# Threading: a connection has a *driver*: the NIC thread (``driver is None``: the socket
# is in the engine's selector) or a completion channel in manual-progress mode (the
# socket is in the channel's epoll set and the thread that polls the channel -- the
# event loop -- reads it; see ``SoftCompChannel.progress``). Input is processed by one
# thread at a time (``_busy``); only the NIC thread closes the socket. Output may come
# from any thread with the device lock held: when nothing is queued the caller writes
# straight to the socket (``writev`` from C: the latency fast path); whatever the
# kernel does not take is queued as Python objects (``out``: bytes, or slices of the
# MR it came from) and the driver is asked to finish it.
#
# Input is read and parsed by core_input.pxi (staging) into the sink (core_sink.pxi).
# Bytes of a payload that arrived together with its header are copied from staging; the
# rest of a large payload is received straight into its destination with the device
# lock released. A sink's job (a same-host CMA copy, ``cma``) runs once its bytes are
# in, with the device lock released, before its done action; the connection reads
# nothing else meanwhile, so requests still execute one after the other, in order.
#
# CMA state (``cma``, requester side): UNKNOWN until the first request on an open Unix
# connection sends the probe (PROBING); the answer sets ON or OFF for the connection's
# life. TCP connections, ``AIORDMA_SOFT_CMA=0`` and an unknown peer pid mean OFF.

import functools
from itertools import islice

cdef enum:
    IOV_CHUNK = 64

CONNECTING = 0
OPEN = 1
CLOSING = 2
CLOSED = 3
CMA_UNKNOWN = 0
CMA_PROBING = 1
CMA_ON = 2
CMA_OFF = 3
cdef enum:
    C_CONNECTING = 0
    C_OPEN = 1
    C_CLOSING = 2
    C_CLOSED = 3
    C_CMA_UNKNOWN = 0
    C_CMA_PROBING = 1
    C_CMA_ON = 2
    C_CMA_OFF = 3

CLOSE_LINGER_S = 2.0

cdef class Conn:
    """A TCP (or Unix) connection carrying soft-device messages (see ``wire``)."""

    def __init__(self, engine, sock, SoftQP owner, *, int state):
        self.engine = engine
        self._lock = engine.lock
        self.sock = sock
        self.fd = sock.fileno() if sock is not None else -1
        self.owner = owner
        self.state = state
        self.out = collections.deque()
        self.reading = state == C_OPEN
        self.want_write = False
        self._write_requested = False
        self._sel_events = 0
        self.last_tx = monotonic()
        self.last_rx = self.last_tx
        self.hello = None
        self.peer = None
        self._stage = NULL
        self._rpos = self._wpos = 0
        self._short = False
        self._busy = False  # a thread is processing input (device lock protects the flag)
        self.requests_sent = False  # a requester sent requests on it (no longer swappable)
        self.driver = None
        self._write_broken = False  # the peer closed: output is dropped, input read to EOF
        self.cma = C_CMA_UNKNOWN
        self.cma_min = 0
        self._pid = -1
        self._maps = None
        self._sinking = False
        self._done = D_NONE
        engine.conns.add(self)

    def __dealloc__(self):
        cdef int i
        for i in range(self._sink_nsegs):
            if self._sink_segs[i].mr != NULL:
                (<SoftMR>self._sink_segs[i].mr).unpin()
        stage_give(self)

    def __repr__(self):
        return f"<Conn state={self.state} fd={self.fd} peer={self.peer}>"

    def set_socket(self, sock):
        """The socket ``dial`` made for this connection (NIC thread, lock held)."""
        self.sock = sock
        self.fd = sock.fileno()

    @property
    def staged(self):
        """Bytes of staging this connection holds (0 when it has no staging buffer)."""
        return STAGE_SIZE if self._stage != NULL else 0

    # --- same-host cross-memory attach (lock held) ---------------------------------------
    def peer_pid(self):
        """The peer process's pid (``SO_PEERCRED``), 0 if unknown or not a Unix socket."""
        if self._pid < 0:
            if self.sock is None:
                return 0
            self._pid = cma.peer_pid(self.sock)
        return self._pid

    def peer_maps(self):
        """Responder: the peer's shared buffers mapped here (cma ``PeerMaps``; created on
        first use, dropped when the connection closes). Used only by the thread
        processing this connection's input."""
        if self._maps is None:
            self._maps = cma.PeerMaps(self.peer_pid())
        return self._maps

    def cma_ready(self):
        """Requester: True when requests on this connection may use CMA (probing first
        if nobody did yet)."""
        return self.cma_ready_c()

    cdef bint cma_ready_c(self) except -1:
        if self.cma == C_CMA_UNKNOWN:
            self.cma_start()
        return self.cma == C_CMA_ON

    def cma_start(self, after_hello=False):
        """Requester: probe once, as soon as the connection is open (``after_hello``:
        the hello is still queued; the probe goes right after it, before requests)."""
        if self.cma != C_CMA_UNKNOWN or self.state != C_OPEN or self.sock is None:
            return
        if not cma.enabled() or self.sock.family != socket.AF_UNIX:
            self.cma = C_CMA_OFF
            return
        self.cma = C_CMA_PROBING
        self.cma_min = cma.min_size()
        msg = wire.pack(wire.OP_CMA_PROBE, 0, remote_addr=cma.PROBE_ADDR,
                        compare_add=cma.PROBE_COOKIE)
        if after_hello and self.out:
            self.out.insert(1, msg)
        else:
            self.send_c([msg])

    cdef void _cma_control(self, const hdr_t *h) except *:
        if h.op == OP_CMA_PROBE:
            ok = cma.probe(self.peer_pid(), h.raddr, h.compare_add)
            self.send_c([wire.pack(wire.OP_CMA_ACK, 0, aux=int(ok))])
        elif h.op == OP_CMA_ACK and self.cma == C_CMA_PROBING:
            self.cma = C_CMA_ON if h.aux else C_CMA_OFF

    # --- output (device lock held, any thread) -------------------------------------------
    def send(self, bufs):
        """Queue or write ``bufs`` (bytes-like objects), in order."""
        self.send_c(list(bufs))

    cdef int send_c(self, list bufs) except -1:
        cdef Py_ssize_t n, total
        if self.state >= C_CLOSING or self._write_broken:
            return 0
        out = self.out
        if out or self.want_write or self.state != C_OPEN or len(bufs) > IOV_CHUNK:
            out.extend(bufs)
            if self.state == C_OPEN and not self.want_write:
                self._flush_c()
            return 0
        # nothing queued: written straight from the caller's list, the rest queued
        n = self._write(bufs)
        if n < 0:
            return 0
        total = 0
        for b in bufs:
            total += len(b)
        if n < total:  # the kernel took part: queue the rest
            out.extend(bufs)
            self._drop_sent(n)
            self._need_write()
        return 0

    cdef int send_segs(self, seg_t *segs, int nsegs, Py_ssize_t total) except -1:
        """Write ``segs`` (``total`` bytes in all: headers and payloads) with one
        ``writev`` when nothing is queued (as ``send_c`` does with a list); what the
        kernel does not take is queued as bytes, or as slices of the MR a large segment
        lies in."""
        cdef iovec iov[IOV_CHUNK]
        cdef int i, k = 0
        cdef Py_ssize_t n = 0
        cdef bint direct
        if self.state >= C_CLOSING or self._write_broken:
            return 0
        direct = (not self.out and not self.want_write and self.state == C_OPEN
                  and nsegs <= IOV_CHUNK and self.fd >= 0)
        if direct:
            for i in range(nsegs):
                if segs[i].len:
                    iov[k].iov_base = segs[i].ptr
                    iov[k].iov_len = segs[i].len
                    k += 1
            n = writev(self.fd, iov, k)
            if n < 0:
                if errno != EAGAIN and errno != EINTR:
                    self._broken()
                    return 0
                n = 0
            else:
                self.last_tx = monotonic()
                if n == total:
                    return 0
        self._queue_rest(segs, nsegs, n)
        if direct:
            self._need_write()  # the kernel took part of it: the driver finishes it
        elif self.state == C_OPEN and not self.want_write:
            self._flush_c()
        return 0

    cdef void _queue_rest(self, seg_t *segs, int nsegs, Py_ssize_t skip):
        """Queue ``segs`` but their first ``skip`` bytes (Python objects: the slow path)."""
        cdef int i
        cdef Py_ssize_t take, off
        cdef seg_t *s
        cdef SoftMR mr
        out = self.out
        for i in range(nsegs):
            s = &segs[i]
            if skip >= s.len:
                skip -= s.len
                continue
            take = s.len - skip
            if s.mr != NULL and take > 4096:  # a slice keeps the MR's memory exported
                mr = <SoftMR>s.mr
                off = (s.ptr - mr.base) + skip
                out.append(mr.view[off:off + take])
            else:
                out.append(PyBytes_FromStringAndSize(s.ptr + skip, take))
            skip = 0

    cdef Py_ssize_t _write(self, list bufs) except -2:
        """One ``sendmsg`` of ``bufs``: bytes taken (0 when the kernel takes none now),
        or -1 when the connection broke (handled: see ``_broken``)."""
        try:
            n = self.sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._broken()
            return -1
        self.last_tx = monotonic()
        return n

    cdef void _broken(self):
        """Writing failed: drop the output. The peer closed (EPIPE) while we still
        read: what it sent before closing (e.g. the NAK that made it close) is still to
        be read, and the EOF then fails us; else fail now."""
        self.out.clear()
        if self.reading and self.state == C_OPEN and self.sock is not None:
            self._write_broken = True
            return
        self.fail()

    def _flush(self):
        self._flush_c()

    cdef void _flush_c(self):
        cdef Py_ssize_t n
        out = self.out
        while out:
            n = self._write(list(islice(out, IOV_CHUNK)) if len(out) > 1 else [out[0]])
            if n <= 0:
                if n == 0:
                    break
                return
            self._drop_sent(n)
        if out:
            self._need_write()

    cdef void _drop_sent(self, Py_ssize_t n):
        """Remove the first ``n`` bytes, which the kernel took, from the output queue."""
        cdef Py_ssize_t size
        out = self.out
        while n:
            first = out[0]
            size = len(first)
            if n >= size:
                out.popleft()
                n -= size
            else:
                out[0] = memoryview(first)[n:]
                n = 0

    cdef void _need_write(self):
        if self.want_write:
            return
        self.want_write = True
        if self.driver is not None or self.engine.in_nic_thread():
            self.update_sel()
        elif not self._write_requested:
            self._write_requested = True
            self.engine.call_soon(self._arm_write)

    def _arm_write(self):
        self._write_requested = False
        self.update_sel()

    # --- lifecycle (device lock held) ----------------------------------------------------
    def fail(self):
        """The connection broke (EOF, reset): close it and tell the owner."""
        if self.state == C_CLOSED:
            return
        self.state = C_CLOSING
        self.reading = False
        self.out.clear()
        if self.driver is not None:
            self.update_sel()  # an EOF'd socket stays readable: stop polling it now
        self.engine.call_soon(self._close_now)

    def shutdown(self, graceful=True):
        """Close on our side without telling the owner (detach first).

        ``graceful``: queued output (e.g. a NAK) is sent first, for at most a few seconds.
        """
        if self.state >= C_CLOSING:
            return
        self.owner = None
        self.reading = False
        if graceful and self.out and self.state == C_OPEN:
            self.state = C_CLOSING
            self.want_write = False
            self._need_write()
            self.engine.call_at(monotonic() + CLOSE_LINGER_S, self._close_now)
        else:
            self.state = C_CLOSING
            self.out.clear()
            self.engine.call_soon(self._close_now)

    def _close_now(self):
        """NIC thread: unregister and close the socket, then notify the owner."""
        if self.state == C_CLOSED:
            return
        self.state = C_CLOSED
        self.reading = False
        self.out.clear()
        self._maps = None  # unmapped once no copy uses them
        if not self._busy:  # (else the reading thread, which may be receiving into the
            sink_clear(self)  # sink's memory with the lock released, does it)
            stage_give(self)
        self.engine.conns.discard(self)
        if self._sel_events:
            if self.driver is not None:
                self.driver.set_interest(self, 0)
            else:
                self.engine.selector_unregister(self)
            self._sel_events = 0
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:  # pragma: no cover
                pass
        self.fd = -1
        owner, self.owner = self.owner, None
        if owner is not None:
            conn_closed(<SoftQP>owner, self)

    def _update_sel(self):
        self.update_sel()

    cdef void update_sel(self):
        """Make the registration match ``reading``/``want_write``: in the driver channel's
        epoll set (any thread, lock held) or the NIC selector (NIC thread only)."""
        cdef int ev = 0
        if self.state == C_CLOSED or self.sock is None:
            return
        if self.reading and self.state == C_OPEN:
            ev |= 1  # selectors.EVENT_READ
        if self.want_write or self.state == C_CONNECTING:
            ev |= 2  # selectors.EVENT_WRITE
        if ev != self._sel_events:
            if self.driver is not None:
                self.driver.set_interest(self, ev)
            else:
                self.engine.selector_set(self, self._sel_events, ev)
            self._sel_events = ev

    def set_driver(self, SoftCompChannel channel):
        """Hand the socket to ``channel`` (manual progress) or to the NIC thread. NIC
        thread (or before the socket is registered anywhere), lock held."""
        if channel is self.driver:
            return
        if self._sel_events and self.sock is not None and self.state != C_CLOSED:
            if self.driver is not None:
                self.driver.set_interest(self, 0)
            else:
                self.engine.selector_unregister(self)
            self._sel_events = 0
        self.driver = channel
        self.update_sel()

    def pause_reading(self):
        self.reading = False
        if self.driver is not None or self.engine.in_nic_thread():
            self.update_sel()

    def resume_reading(self):
        """NIC thread: read again (staged bytes are processed right away)."""
        if self.state != C_OPEN:
            return
        self.reading = True
        self.update_sel()
        self.engine.call_soon(self.on_readable_locked)

    # --- NIC thread events ---------------------------------------------------------------
    def on_event(self, int mask):
        cdef DeviceLock lock
        if mask & 2:  # selectors.EVENT_WRITE
            lock = self._lock
            lock.acquire_c()
            try:
                self._on_writable()
            finally:
                lock.release_c()
        if mask & 1 and self.reading:
            self.on_readable_c()

    def _on_writable(self):
        if self.state == C_CONNECTING:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.fail()
                return
            self.state = C_OPEN
            self.reading = True
            self.last_tx = monotonic()
        if self.state != C_OPEN and self.state != C_CLOSING:
            return
        self.want_write = False
        self._flush_c()
        if self.state == C_CLOSING and not self.out:
            self._close_now()
            return
        self.update_sel()

    def on_readable_locked(self):
        """Called via call_soon (lock held): process staged input."""
        cdef DeviceLock lock = self._lock
        lock.release_c()
        try:
            self.on_readable_c()
        finally:
            lock.acquire_c()

    def on_readable(self):
        """The driver's thread, device lock NOT held: read and dispatch as much as the
        budget allows. One thread at a time: a second caller returns at once (the
        socket stays readable, so its driver comes back for what is left)."""
        self.on_readable_c()

    cdef int on_readable_c(self) except -1:
        cdef DeviceLock lock = self._lock
        lock.acquire_c()
        try:
            if self._busy:
                return 0
            self._busy = True
            try:
                conn_read_input(self)
            finally:
                self._busy = False
                if self.state == C_CLOSED:
                    sink_clear(self)
                if self._rpos == self._wpos or self.state == C_CLOSED:
                    stage_give(self)  # an idle connection holds no staging buffer
        finally:
            lock.release_c()
        return 0

def start_connect(engine, Conn conn, sock, sa, int err):
    """NIC thread: adopt the socket ``dial.open_socket`` made for ``conn``."""
    engine.limit_logged = False
    if conn.state != C_CONNECTING:
        sock.close()
        return
    dial.tune(sock)
    conn.set_socket(sock)
    conn.peer = sa
    if err == -1 or err == 0:
        conn.state = C_OPEN
        conn.reading = True
        if err == -1:
            conn.cma_start(after_hello=True)
        conn.update_sel()
        if conn.out:
            conn._flush_c()
    elif err in (_errno.EINPROGRESS, _errno.EWOULDBLOCK, _errno.EAGAIN, _errno.EINTR):
        conn.update_sel()
    else:
        conn.fail()
