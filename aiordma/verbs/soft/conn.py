"""One TCP connection of the soft device: an output queue and an input parser.

Threading: a connection has a *driver*: the NIC thread (``driver is None``: the socket
is in the engine's selector) or a completion channel in manual-progress mode (the
socket is in the channel's epoll set and the thread that polls the channel -- the
event loop -- reads it; see ``cq.SoftCompChannel.progress``). Input is processed by
one thread at a time (``_busy``); only the NIC thread closes the socket. Output
(``send``) may come from any thread with the device lock held: when nothing is queued
the caller writes straight to the socket (the latency fast path); whatever the kernel
does not take is queued and the driver is asked to finish it.

Input: bytes are read into a staging buffer and parsed there (the buffer is borrowed
from the device's small pool while bytes are staged and given back when all are
parsed, so an idle or closed connection holds none); a payload goes to its
``Sink`` (a list of memoryview slices of registered memory). Bytes of a payload that
arrived together with its header are copied from staging; the rest of a large payload
is received with ``recv_into`` straight into the destination. A sink's ``job`` (a
same-host CMA copy, ``cma``) runs once its bytes are in, with the device lock
released, before its ``on_done``; the connection reads nothing else meanwhile, so
requests still execute one after the other, in order.

CMA state (``cma``, requester side): UNKNOWN until the first request on an open Unix
connection sends the probe (PROBING); the answer sets ON or OFF for the connection's
life. TCP connections, ``AIORDMA_SOFT_CMA=0`` and an unknown peer pid mean OFF.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Final

from . import cma, wire
from .sink import STAGE_SIZE, Sink, discard

# Enum members and library functions the per-packet path uses, as module constants:
# compiled, each is a C static, where ``QPState.RTS`` or ``time.monotonic`` is an
# attribute lookup per use.
_monotonic: Final = time.monotonic

if TYPE_CHECKING:
    from .cq import SoftCompChannel
    from .engine import Engine
    from .qpcore import QPCore

DIRECT_MIN: Final = 64 * 1024
READ_BUDGET: Final = 8 * 1024 * 1024
IOV_CHUNK: Final = 64
CLOSE_LINGER_S: Final = 2.0

CONNECTING: Final = 0
OPEN: Final = 1
CLOSING: Final = 2
CLOSED: Final = 3
CMA_UNKNOWN: Final = 0
CMA_PROBING: Final = 1
CMA_ON: Final = 2
CMA_OFF: Final = 3

_NO_STAGE: Final = bytearray()
_NO_SMV: Final = memoryview(_NO_STAGE)
#: staging buffers a device keeps for its connections to borrow (one per parsing thread)
STAGE_POOL: Final = 4
_HDR_UNPACK: Final = wire.HDR.unpack_from
_HDR_SIZE: Final = wire.HDR.size


class Conn:
    """A TCP connection carrying soft-device messages (see ``wire``)."""

    def __init__(self, engine: Engine, sock: socket.socket | None, owner: QPCore | None,
                 *, state: int) -> None:
        self.engine = engine
        self.sock = sock
        self.owner = owner
        self.state = state
        self.out: deque[bytes | memoryview] = deque()
        self.reading = state == OPEN
        self.want_write = False
        self._write_requested = False
        self._sel_events = 0
        self.last_tx = _monotonic()
        self.last_rx = self.last_tx
        self.hello: tuple[int, ...] | None = None
        self.peer: tuple[str, int] | None = None
        # input staging, lent from the device's pool while staged bytes wait (_take_stage)
        self._stage = _NO_STAGE
        self._smv = _NO_SMV
        self._rpos = 0
        self._wpos = 0
        self._sink: Sink | None = None
        self._short = False
        self._busy = False  # a thread is processing input (device lock protects the flag)
        self.requests_sent = False  # a requester sent requests on it (no longer swappable)
        self.driver: SoftCompChannel | None = None
        self._write_broken = False  # the peer closed: output is dropped, input read to EOF
        self.cma = CMA_UNKNOWN
        self.cma_min = 0
        self._pid = -1
        self._maps: cma.PeerMaps | None = None
        engine.conns.add(self)

    def __repr__(self) -> str:
        return f"<Conn state={self.state} fd={self.sock.fileno() if self.sock else -1} peer={self.peer}>"

    # --- same-host cross-memory attach (lock held) -----------------------------------------
    def peer_pid(self) -> int:
        """The peer process's pid (``SO_PEERCRED``), 0 if unknown or not a Unix socket."""
        if self._pid < 0:
            if self.sock is None:
                return 0
            self._pid = cma.peer_pid(self.sock)
        return self._pid

    def peer_maps(self) -> cma.PeerMaps:
        """Responder: the peer's shared buffers mapped here (cma ``PeerMaps``; created
        on first use, dropped when the connection closes). Used only by the thread
        processing this connection's input."""
        maps = self._maps
        if maps is None:
            maps = self._maps = cma.PeerMaps(self.peer_pid())
        return maps

    def cma_ready(self) -> bool:
        """Requester: True when requests on this connection may use CMA (probing first
        if nobody did yet)."""
        if self.cma == CMA_UNKNOWN:
            self.cma_start()
        return self.cma == CMA_ON

    def cma_start(self, after_hello: bool = False) -> None:
        """Requester: probe once, as soon as the connection is open (``after_hello``:
        the hello is still queued; the probe goes right after it, before requests)."""
        if self.cma != CMA_UNKNOWN or self.state != OPEN or self.sock is None:
            return
        if not cma.enabled() or self.sock.family != socket.AF_UNIX:
            self.cma = CMA_OFF
            return
        self.cma = CMA_PROBING
        self.cma_min = cma.min_size()
        msg = wire.pack(wire.OP_CMA_PROBE, 0, remote_addr=cma.PROBE_ADDR,
                        compare_add=cma.PROBE_COOKIE)
        if after_hello and self.out:
            self.out.insert(1, msg)
        else:
            self.send([msg])

    def _cma_control(self, h: tuple[int, ...]) -> None:
        if h[0] == wire.OP_CMA_PROBE:
            ok = cma.probe(self.peer_pid(), h[8], h[9])
            self.send([wire.pack(wire.OP_CMA_ACK, 0, aux=int(ok))])
        elif h[0] == wire.OP_CMA_ACK and self.cma == CMA_PROBING:
            self.cma = CMA_ON if h[2] else CMA_OFF

    # --- output (device lock held, any thread) ----------------------------------------------
    def send(self, bufs: list[bytes | memoryview]) -> None:
        if self.state >= CLOSING or self._write_broken:
            return
        out = self.out
        if out or self.want_write or self.state != OPEN or len(bufs) > IOV_CHUNK:
            out.extend(bufs)
            if self.state == OPEN and not self.want_write:
                self._flush()
            return
        # nothing queued: written straight from the caller's list, the rest queued
        n = self._write(bufs)
        if n < 0:
            return
        if n < sum(len(b) for b in bufs):  # the kernel took part: queue the rest
            out.extend(bufs)
            self._drop_sent(n)
            self._need_write()

    def _write(self, bufs: list[bytes | memoryview]) -> int:
        """One ``sendmsg`` of ``bufs``: bytes taken (0 when the kernel takes none now),
        or -1 when the connection broke (handled: see ``_broken``)."""
        sock = self.sock
        assert sock is not None
        try:
            n = sock.sendmsg(bufs)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            self._broken()
            return -1
        self.last_tx = _monotonic()
        return n

    def _broken(self) -> None:
        """Writing failed: drop the output. The peer closed (EPIPE) while we still
        read: what it sent before closing (e.g. the NAK that made it close) is still to
        be read, and the EOF then fails us; else fail now."""
        self.out.clear()
        if self.reading and self.state == OPEN and self.sock is not None:
            self._write_broken = True
            return
        self.fail()

    def _flush(self) -> None:
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

    def _drop_sent(self, n: int) -> None:
        """Remove the first ``n`` bytes, which the kernel took, from the output queue."""
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

    def _need_write(self) -> None:
        if self.want_write:
            return
        self.want_write = True
        if self.driver is not None or self.engine.in_nic_thread():
            self._update_sel()
        elif not self._write_requested:
            self._write_requested = True
            self.engine.call_soon(self._arm_write)

    def _arm_write(self) -> None:
        self._write_requested = False
        self._update_sel()

    # --- lifecycle (device lock held) -------------------------------------------------------
    def fail(self) -> None:
        """The connection broke (EOF, reset): close it and tell the owner."""
        if self.state == CLOSED:
            return
        self.state = CLOSING
        self.reading = False
        self.out.clear()
        if self.driver is not None:
            self._update_sel()  # an EOF'd socket stays readable: stop polling it now
        self.engine.call_soon(self._close_now)

    def shutdown(self, graceful: bool = True) -> None:
        """Close on our side without telling the owner (detach first).

        ``graceful``: queued output (e.g. a NAK) is sent first, for at most a few seconds.
        """
        if self.state >= CLOSING:
            return
        self.owner = None
        self.reading = False
        if graceful and self.out and self.state == OPEN:
            self.state = CLOSING
            self.want_write = False
            self._need_write()
            self.engine.call_at(_monotonic() + CLOSE_LINGER_S, self._close_now)
        else:
            self.state = CLOSING
            self.out.clear()
            self.engine.call_soon(self._close_now)

    def _close_now(self) -> None:
        """NIC thread: unregister and close the socket, then notify the owner."""
        if self.state == CLOSED:
            return
        self.state = CLOSED
        self.reading = False
        self.out.clear()
        self._sink = None
        self._maps = None  # unmapped once no copy uses them
        if not self._busy:
            self._give_stage()
        self.engine.conns.discard(self)
        if self._sel_events:
            if self.driver is not None:
                self.driver._set_interest(self, 0)
            else:
                self.engine.selector_unregister(self)
            self._sel_events = 0
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:  # pragma: no cover
                pass
        owner, self.owner = self.owner, None
        if owner is not None:
            owner.conn_closed(self)

    def _update_sel(self) -> None:
        """Make the registration match ``reading``/``want_write``: in the driver channel's
        epoll set (any thread, lock held) or the NIC selector (NIC thread only)."""
        if self.state == CLOSED or self.sock is None:
            return
        ev = 0
        if self.reading and self.state == OPEN:
            ev |= selectors.EVENT_READ
        if self.want_write or self.state == CONNECTING:
            ev |= selectors.EVENT_WRITE
        if ev != self._sel_events:
            if self.driver is not None:
                self.driver._set_interest(self, ev)
            else:
                self.engine.selector_set(self, self._sel_events, ev)
            self._sel_events = ev

    def set_driver(self, channel: SoftCompChannel | None) -> None:
        """Hand the socket to ``channel`` (manual progress) or to the NIC thread. NIC
        thread (or before the socket is registered anywhere), lock held."""
        if channel is self.driver:
            return
        if self._sel_events and self.sock is not None and self.state != CLOSED:
            if self.driver is not None:
                self.driver._set_interest(self, 0)
            else:
                self.engine.selector_unregister(self)
            self._sel_events = 0
        self.driver = channel
        self._update_sel()

    def pause_reading(self) -> None:
        self.reading = False
        if self.driver is not None or self.engine.in_nic_thread():
            self._update_sel()

    def resume_reading(self) -> None:
        """NIC thread: read again (staged bytes are processed right away)."""
        if self.state != OPEN:
            return
        self.reading = True
        self._update_sel()
        self.engine.call_soon(self.on_readable_locked)

    # --- NIC thread events ------------------------------------------------------------------
    def on_event(self, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            with self.engine.lock:
                self._on_writable()
        if mask & selectors.EVENT_READ and self.reading:
            self.on_readable()

    def _on_writable(self) -> None:
        if self.state == CONNECTING:
            assert self.sock is not None
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.fail()
                return
            self.state = OPEN
            self.reading = True
            self.last_tx = _monotonic()
        if self.state not in (OPEN, CLOSING):
            return
        self.want_write = False
        self._flush()
        if self.state == CLOSING and not self.out:
            self._close_now()
            return
        self._update_sel()

    def on_readable_locked(self) -> None:
        """Called via call_soon (lock held): process staged input."""
        lock = self.engine.lock
        lock.release()
        try:
            self.on_readable()
        finally:
            lock.acquire()

    def on_readable(self) -> None:
        """The driver's thread, device lock NOT held: read and dispatch as much as the
        budget allows. One thread at a time: a second caller returns at once (the
        socket stays readable, so its driver comes back for what is left)."""
        lock = self.engine.lock
        with lock:
            if self._busy:
                return
            self._busy = True
            try:
                self._read_input(lock)
            finally:
                self._busy = False
                if self._rpos == self._wpos or self.state == CLOSED:
                    self._give_stage()  # an idle connection holds no staging buffer

    def _read_input(self, lock: threading.Lock) -> None:
        """Lock held for the whole batch (one acquisition, not one per message), but
        released while a large payload is received straight into its destination."""
        sock = self.sock
        if sock is None:
            return
        budget = READ_BUDGET
        self._short = False  # a short read drained the socket: stop rather than hit EAGAIN
        try:
            while self.reading and self.state == OPEN:
                sink = self._sink
                if sink is not None:
                    if self._rpos < self._wpos:
                        self._rpos += sink.feed(self._stage, self._smv, self._rpos, self._wpos)
                    elif sink.remaining >= DIRECT_MIN:
                        if budget <= 0 or self._short:
                            break
                        t = sink.target()[: sink.remaining]
                        lock.release()
                        try:
                            n = sock.recv_into(t)
                        finally:
                            lock.acquire()
                        if n == 0:
                            self._eof()
                            return
                        self._short = n < len(t)
                        sink.advance(n)
                        budget -= n
                    else:
                        if budget <= 0 or self._short or not self._fill(sock):
                            break
                        budget -= STAGE_SIZE
                        continue
                    if sink.remaining == 0:
                        self._sink = None
                        self._finish(sink, lock)
                    continue
                if self._wpos - self._rpos >= _HDR_SIZE:
                    h = _HDR_UNPACK(self._stage, self._rpos)
                    self._rpos += _HDR_SIZE
                    owner = self.owner
                    if h[0] >= wire.OP_CMA_PROBE:
                        self._cma_control(h)
                        continue
                    if owner is not None and self.state == OPEN:
                        s = owner.conn_header(self, h)
                    else:
                        s = discard(wire.payload_len(h))
                    if s is not None:
                        if s.remaining:
                            self._sink = s
                        else:
                            self._finish(s, lock)
                    continue
                if budget <= 0 or self._short or not self._fill(sock):
                    break
                budget -= STAGE_SIZE
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.fail()
            return
        if budget != READ_BUDGET:  # bytes came in (the ACK timer's progress)
            self.last_rx = _monotonic()
        owner = self.owner
        if owner is not None and self.state == OPEN:
            owner.conn_batch_end(self)

    @staticmethod
    def _finish(sink: Sink, lock: threading.Lock) -> None:
        """All of ``sink``'s bytes are in: its job (lock released), then on_done."""
        if sink.job is not None:
            lock.release()
            try:
                sink.job()
            finally:
                lock.acquire()
        if sink.on_done is not None:
            sink.on_done()

    def _take_stage(self) -> None:
        """Borrow a staging buffer, and its memoryview, from the device's pool (lock
        held)."""
        pool = self.engine.stage_pool
        if pool:
            self._stage, self._smv = pool.pop()
        else:
            self._stage = bytearray(STAGE_SIZE)
            self._smv = memoryview(self._stage)
        self._rpos = self._wpos = 0

    def _give_stage(self) -> None:
        """Return the staging buffer (nothing staged, or closed; lock held): an idle or
        closed connection holds none."""
        stage = self._stage
        if stage is _NO_STAGE:
            return
        pool = self.engine.stage_pool
        if len(pool) < STAGE_POOL:
            pool.append((stage, self._smv))
        self._stage = _NO_STAGE
        self._smv = _NO_SMV
        self._rpos = self._wpos = 0

    def _fill(self, sock: socket.socket) -> bool:
        """Read more into staging (lock held); False on EAGAIN. Raises OSError; handles
        EOF."""
        if self._stage is _NO_STAGE:
            self._take_stage()
        if self._rpos == self._wpos:
            self._rpos = self._wpos = 0
        elif STAGE_SIZE - self._wpos < DIRECT_MIN:
            n = self._wpos - self._rpos
            self._stage[:n] = self._stage[self._rpos:self._wpos]
            self._rpos, self._wpos = 0, n
        room = STAGE_SIZE - self._wpos
        try:
            n = sock.recv_into(self._smv[self._wpos:] if self._wpos else self._smv)
        except (BlockingIOError, InterruptedError):
            return False
        if n == 0:
            self._eof()
            return False
        self._short = n < room
        self._wpos += n
        return True

    def _eof(self) -> None:
        """Input ended (lock held)."""
        self.fail()
