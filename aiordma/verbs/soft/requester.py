"""The requester half of a soft RC QP: transmit send WRs, handle responses, RNR back-off
(go-back-N), the local ACK timer and its retries, and the requester connection's life.

Retries (the QP's ``timeout`` and ``retry_cnt``, with their hardware meaning): one try
of the local ACK timer lasts ``4.096 us * 2**timeout`` (``timeout`` 0: wait forever).
A try that ends without any progress -- no response, and no byte of ours taken by or
of the peer's read from the connection -- uses one retry; the next progress restores
all ``retry_cnt`` of them. The try after the last retry ends the oldest outstanding WR
with RETRY_EXC_ERR (so ``(retry_cnt + 1) * 4.096 us * 2**timeout`` without progress).
Nothing is sent again on a retry: the stream underneath (TCP, or a Unix socket)
retransmits lost segments itself, and a request resent on it would run twice. A
connection that breaks (the peer's device closed it, or was killed) fails the QP's
outstanding WRs at once with RETRY_EXC_ERR, as a NIC's retries into a dead port end.

Methods run with the device lock held, on the caller's thread (``post_send``: the
fast path writes straight to the socket) or on the NIC thread.
"""

from __future__ import annotations

import struct
import time
from typing import Final

from ...errors import RDMAError
from ..buffers import SharedMemory
from ..enums import QPState, WCStatus
from . import cma, dial, wire
from .conn import CLOSING, CONNECTING, OPEN, Conn
from .qpcore import SWQE, QPCore, scatter
from .sink import Sink, discard

# Enum members and library functions the per-packet path uses, as module constants:
# compiled, each is a C static, where ``QPState.RTS`` or ``time.monotonic`` is an
# attribute lookup per use.
_QP_RTS: Final = QPState.RTS
_WC_BAD_RESP_ERR: Final = WCStatus.BAD_RESP_ERR
_WC_REM_ACCESS_ERR: Final = WCStatus.REM_ACCESS_ERR
_WC_REM_INV_REQ_ERR: Final = WCStatus.REM_INV_REQ_ERR
_WC_REM_OP_ERR: Final = WCStatus.REM_OP_ERR
_WC_RETRY_EXC_ERR: Final = WCStatus.RETRY_EXC_ERR
_WC_RNR_RETRY_EXC_ERR: Final = WCStatus.RNR_RETRY_EXC_ERR
_WC_SUCCESS: Final = WCStatus.SUCCESS
_monotonic: Final = time.monotonic

#: smallest ``timeout`` code a try honours (134 ms): the soft responder is a thread of
#: the peer's process, which can stall (GIL, GC, a loaded machine) for tens of
#: milliseconds where a NIC answers in microseconds; a smaller code acts as this one
MIN_TIMEOUT_CODE: Final = 15
#: how long requests wait for the connection the peer QP opens (wire: Connections)
#: before this QP opens one itself
PEER_CONNECT_WAIT_S: Final = 0.05

_U32: Final = struct.Struct("<I")
_U64X2: Final = struct.Struct("<QQ")

_NAK_STATUS: Final = {
    wire.NAK_INV_REQ: _WC_REM_INV_REQ_ERR,
    wire.NAK_REM_ACCESS: _WC_REM_ACCESS_ERR,
    wire.NAK_REM_OP: _WC_REM_OP_ERR,
}


class Requester(QPCore):
    # --- connection ------------------------------------------------------------------------
    def _connect(self, lazy: bool = False, *, at_rtr: bool = False) -> Conn | None:
        """The requester connection to the peer QP: the peer's own connection to us when
        it has one (one TCP stream then carries both directions), else a new one (its
        socket made and its non-blocking connect started here, registered on the NIC
        thread). ``lazy``: None when the peer is the one to connect -- the first request
        connects anyway if it has not.

        ``at_rtr`` (``modify`` to RTR): a socket that cannot be made raises
        ``ResourceLimitError`` (out of descriptors) or ``RDMAError``, and when the peer
        is to connect, one descriptor is probed for (its connection will need one), so
        that a QP that could not connect fails its transition rather than its first
        request. Otherwise such a connection fails at once: the QP's requests complete
        with RETRY_EXC_ERR.
        """
        ah = self._ah
        assert ah is not None
        engine = self._engine
        dest = self._dest_qpn
        resp = self._resp_conn
        cands = ([resp] if resp is not None else []) + engine._held.get(self.qp_num, [])
        for c in cands:
            if c.state == OPEN and c.hello is not None and c.hello[0] == dest:
                c.owner = self  # bound as our responder connection too (release_held)
                self._req_conn = c
                c.cma_start()
                return c
        if lazy and self._peer_connects():
            if at_rtr:
                dial.probe_descriptor(engine)
            return None
        gids = engine.gids
        sgid = gids[ah.sgid_index] if 0 <= ah.sgid_index < len(gids) else gids[0]
        conn = Conn(engine, None, self, state=CONNECTING)
        ch = self.send_cq.channel
        if ch is not None and ch.manual:
            conn.driver = ch  # responses complete on the send CQ: its poller reads them
        conn.send([wire.pack_hello(engine.port, self.qp_num, self._dest_qpn, sgid,
                                   self._auth_key or engine.secret)])
        try:
            opened = dial.open_socket(engine, bytes(ah.dgid), ah.dlid)
        except RDMAError:
            conn.fail()
            if at_rtr:
                raise
            self._req_conn = conn
            return conn
        engine.call_soon(lambda: dial.start_connect(engine, conn, *opened))
        self._req_conn = conn
        return conn

    def _await_peer_conn(self) -> None:
        """Requests are queued and the peer is the one to connect: give its connection a
        moment to arrive (the NIC thread accepts it and binds it), then connect."""
        if self._conn_wait:
            return
        self._conn_wait = True
        gen = self._gen
        deadline = _monotonic() + PEER_CONNECT_WAIT_S

        def check() -> None:
            if gen != self._gen or self._state != _QP_RTS:
                self._conn_wait = False
                return
            conn = self._req_conn
            if conn is None or conn.state >= CLOSING:
                conn = self._connect(lazy=_monotonic() < deadline)
                if conn is None:
                    self._engine.call_at(min(_monotonic() + 0.002, deadline), check)
                    return
            self._conn_wait = False
            self._pump()

        self._engine.call_soon(check)

    def _req_conn_closed(self, conn: Conn) -> None:
        self._req_conn = None
        if self._state == _QP_RTS and (self._inflight or self._unsent):
            # the peer is gone (killed, reset, refused, or its QP went to ERR)
            self._fail_send(_WC_RETRY_EXC_ERR)

    # --- transmit -----------------------------------------------------------------------
    def _pump(self) -> None:
        """Transmit queued WRs in order, as far as RNR wait, fences and errors allow."""
        if self._state != _QP_RTS or self._rnr_wait or not self._unsent:
            return
        conn = self._req_conn
        if conn is None or conn.state >= CLOSING:
            conn = self._connect(lazy=True)
            if conn is None:
                self._await_peer_conn()
                return
        unsent = self._unsent
        inflight = self._inflight
        bufs: list[bytes | memoryview] = []
        cma_min = conn.cma_min if conn.cma_ready() else -1
        if not inflight:
            self._progress = _monotonic()
        while unsent:
            w = unsent[0]
            if w.error is not None:
                if inflight:
                    break  # completes after everything before it
                unsent.popleft()
                if bufs:  # pragma: no cover - bufs implies inflight
                    conn.send(bufs)
                self._sq_complete(w, w.error)
                self._to_error(None)
                return
            if w.fence and any(x.rd_atomic for x in inflight):
                break
            unsent.popleft()
            inflight.append(w)
            if cma_min >= 0 and wire.is_cma_op(w.op) and (
                    (cma_min <= w.length and _cma_request(w, bufs, False))
                    or (w.op == wire.OP_READ and cma.SHM_MIN <= w.length < cma_min
                        and _cma_request(w, bufs, True))):
                continue
            bufs.append(w.hdr)
            if wire.has_payload(w.op):
                bufs.extend(w.segs)
        if bufs:
            conn.requests_sent = True
            if self._ack_pending >= 0 and conn is self._resp_conn:
                bufs.insert(0, wire.pack(wire.OP_ACK, self._ack_pending))  # piggyback
                self._ack_pending = -1
                if conn.driver is not None:
                    conn.driver.ack_sent(self)  # nothing left for its flush()
            conn.send(bufs)
        self._arm_ack_timer()

    # --- local ACK timer (module docstring: Retries) ---------------------------------------
    def _ack_timeout_s(self) -> float | None:
        """One try of the local ACK timer, seconds; None: wait forever (timeout 0)."""
        return local_ack_timeout_s(self._timeout)

    def _last_progress(self) -> float:
        conn = self._req_conn
        if conn is None:
            return self._progress
        return max(max(self._progress, conn.last_tx), conn.last_rx)  # (2-arg max: C)

    def _arm_ack_timer(self) -> None:
        if self._ack_armed or not (self._inflight or self._unsent):
            return
        t = self._ack_timeout_s()
        if t is None:
            return
        self._ack_armed = True
        gen = self._gen
        start = max(self._last_progress(), self._try_start)
        self._engine.call_at(start + t, lambda: self._ack_check(gen))

    def _ack_check(self, gen: int) -> None:
        if gen != self._gen:
            return  # a timer of the QP's life before a RESET
        self._ack_armed = False
        if self._state != _QP_RTS:
            return
        if not (self._inflight or self._unsent):
            return
        t = self._ack_timeout_s()
        if t is None:
            return
        now = _monotonic()
        if self._rnr_wait:
            self._progress = now
        last = self._last_progress()
        if last > self._try_start:  # progress since the last try began: all retries back
            self._retries_left = self._retry_cnt
        start = max(last, self._try_start)
        if now < start + t:
            self._ack_armed = True
            self._engine.call_at(start + t, lambda: self._ack_check(gen))
            return
        if self._retries_left <= 0:
            self._fail_send(_WC_RETRY_EXC_ERR)
            return
        self._retries_left -= 1  # a try without progress: the next one begins now
        self.local_ack_timeouts += 1
        self._try_start = now
        self._ack_armed = True
        self._engine.call_at(now + t, lambda: self._ack_check(gen))

    # --- responses -----------------------------------------------------------------------
    def _on_response(self, conn: Conn, h: tuple[int, ...]) -> Sink | None:
        op, flags, aux, psn, length, _imm, _rkey, _pad, _raddr, value, _swap = h
        if self._state != _QP_RTS or not wire.is_response(op):
            return discard(wire.payload_len(h))
        self._progress = _monotonic()
        inflight = self._inflight
        # implicit acknowledgement of everything before psn (and psn itself for an ACK)
        while inflight:
            w = inflight[0]
            if wire.psn_before(w.psn, psn) or (op == wire.OP_ACK and w.psn == psn):
                if w.rd_atomic:  # pragma: no cover - its response cannot be skipped
                    break
                inflight.popleft()
                w.segs = []
                self._sq_complete(w, _WC_SUCCESS, w.length)
            else:
                break
        if op == wire.OP_ACK:
            if self._unsent:
                self._pump()
            return None
        if not inflight or inflight[0].psn != psn:  # stale (cannot happen on one TCP stream)
            return discard(wire.payload_len(h))
        w = inflight[0]
        if op == wire.OP_NAK:
            if aux == wire.NAK_RNR:
                self._on_rnr(flags)
                return None
            inflight.popleft()
            self._sq_complete(w, _NAK_STATUS.get(aux, _WC_REM_OP_ERR))
            self._to_error(None)
            return None
        if op == wire.OP_ATOMIC_RESP:
            inflight.popleft()
            w.segs[0][:8] = (value & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
            self._sq_complete(w, _WC_SUCCESS, 8)
            if self._unsent:
                self._pump()
            return None
        # READ response
        if length != w.length:
            inflight.popleft()
            self._sq_complete(w, _WC_BAD_RESP_ERR)
            self._to_error(None)
            return discard(wire.payload_len(h))
        if flags & wire.FLAG_CMA:  # the responder wrote the data in place (cma)
            inflight.popleft()
            self._sq_complete(w, _WC_SUCCESS, length)
            if self._unsent:
                self._pump()
            return None
        gen = self._gen

        def done() -> None:
            if self._gen == gen and self._inflight and self._inflight[0] is w:
                self._inflight.popleft()
                self._progress = _monotonic()
                self._sq_complete(w, _WC_SUCCESS, length)
                if self._unsent:
                    self._pump()

        return Sink(scatter(w.segs, length), length, done)

    def _on_rnr(self, timer_code: int) -> None:
        inflight = self._inflight
        w = inflight[0]
        if w.rnr_left < 0:
            w.rnr_left = self._rnr_retry
        if self._rnr_retry != 7:
            if w.rnr_left == 0:
                inflight.popleft()
                self._sq_complete(w, _WC_RNR_RETRY_EXC_ERR)
                self._to_error(None)
                return
            w.rnr_left -= 1
        # go back N: everything from the NAK'd WR on is transmitted again after the delay
        unsent = self._unsent
        while inflight:
            unsent.appendleft(inflight.pop())
        self._rnr_wait = True
        gen = self._gen
        delay = wire.RNR_TIMER_S[timer_code & 31]
        self._engine.call_at(_monotonic() + delay, lambda: self._rnr_resume(gen))

    def _rnr_resume(self, gen: int) -> None:
        if gen != self._gen or self._state != _QP_RTS or not self._rnr_wait:
            return
        self._rnr_wait = False
        self._progress = _monotonic()
        self._pump()


def local_ack_timeout_s(timeout: int) -> float | None:
    """Seconds of one try of the local ACK timer for the QP attribute ``timeout``
    (IBTA: 4.096 us * 2**timeout; codes below ``MIN_TIMEOUT_CODE`` act as it); None for
    0 (wait forever)."""
    if timeout == 0:
        return None
    return 4.096e-6 * (1 << max(timeout, MIN_TIMEOUT_CODE))


def _cma_request(w: SWQE, bufs: list[bytes | memoryview], shm_only: bool) -> bool:
    """Append ``w``'s request in its CMA form (header with FLAG_CMA, the addresses of its
    local SGEs as payload; wire: cross-memory attach) to ``bufs``; False when ``w``
    cannot use it (too many SGEs, a read-only inline copy) -- or, with ``shm_only``
    (a READ below the CMA threshold), when its destination is not shared memory."""
    segs = w.segs
    if len(segs) > cma.IOV_MAX or any(v.readonly for v in segs):
        return False
    pairs = [(cma.address_of(v), len(v)) for v in segs]
    h = w.hdr
    aux = len(segs).to_bytes(2, "little")
    shared = (SharedMemory.backing(pairs[0][0], pairs[0][1])
              if w.op == wire.OP_READ and len(pairs) == 1 else None)
    if shared is None and shm_only:
        return False
    if shared is not None:  # wire: FLAG_SHM (fd, offset, inode in imm/compare_add/swap)
        sm, off = shared
        bufs.append(bytes((h[0], h[1] | wire.FLAG_CMA | wire.FLAG_SHM)) + aux + h[4:12]
                    + _U32.pack(sm.fd) + h[16:32] + _U64X2.pack(off, sm.ino))
    else:
        bufs.append(bytes((h[0], h[1] | wire.FLAG_CMA)) + aux + h[4:])
    bufs.append(cma.pack_iov(pairs))
    return True
