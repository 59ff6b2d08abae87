"""The responder half of a soft RC QP: execute incoming requests in PSN order.

Runs on the NIC thread with the device lock held. SEND/WRITE payloads are received by
the connection straight into the receive buffer / the target MR (a ``Sink``); READ
responses are sent from slices of the MR; atomics execute here, under the device lock
on the single NIC thread, so they are atomic across every QP of the device.
Successful SEND/WRITE requests are acknowledged once per batch of input (coalesced ACK).
A WRITE or READ with FLAG_CMA (wire, ``cma``) is validated the same way; then the data
moves by one cross-memory copy between the MR and the requester's process, run by the
connection with the device lock released (the sink's ``job``), and the request
completes as its socket form would. A READ into the requester's shared memory
(FLAG_SHM) is copied with ``memmove`` into this process's mapping of it instead, where
that mapping can be made (else by CMA as above). A failed copy (the requester's memory
is gone) is answered with a remote operational error NAK.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Final

from ..enums import Access, EventType, QPState, WCOpcode, WCStatus
from . import cma, wire
from .conn import CLOSING, Conn
from .qpcore import scatter
from .requester import Requester
from .sink import Sink, discard

# Enum members and library functions the per-packet path uses, as module constants:
# compiled, each is a C static, where ``QPState.RTS`` or ``time.monotonic`` is an
# attribute lookup per use.
_EV_QP_ACCESS_ERR: Final = EventType.QP_ACCESS_ERR
_EV_QP_REQ_ERR: Final = EventType.QP_REQ_ERR
_QP_RTR: Final = QPState.RTR
_QP_RTS: Final = QPState.RTS
_WCOP_RECV: Final = WCOpcode.RECV
_WCOP_RECV_RDMA_WITH_IMM: Final = WCOpcode.RECV_RDMA_WITH_IMM
_WC_LOC_LEN_ERR: Final = WCStatus.LOC_LEN_ERR
_WC_LOC_PROT_ERR: Final = WCStatus.LOC_PROT_ERR
_WC_SUCCESS: Final = WCStatus.SUCCESS

_M64: Final = 0xFFFFFFFFFFFFFFFF



#: the QP access flag each remote operation needs (checked before any MR)
_REMOTE_WRITE: Final = int(Access.REMOTE_WRITE)
_REMOTE_READ: Final = int(Access.REMOTE_READ)
_REMOTE_ATOMIC: Final = int(Access.REMOTE_ATOMIC)
_QP_RIGHT: Final = {
    wire.OP_WRITE: _REMOTE_WRITE,
    wire.OP_WRITE_IMM: _REMOTE_WRITE,
    wire.OP_READ: _REMOTE_READ,
    wire.OP_CMP_SWP: _REMOTE_ATOMIC,
    wire.OP_FETCH_ADD: _REMOTE_ATOMIC,
}

class Responder(Requester):
    def _bind_resp(self, conn: Conn, src_qpn: int) -> bool:
        """Accept ``conn`` as this QP's responder connection if it comes from our peer QP."""
        if src_qpn != self._dest_qpn or self._state not in (_QP_RTR, _QP_RTS):
            conn.shutdown(graceful=False)
            return False
        old = self._resp_conn
        if old is not None and old is not conn and old is not self._req_conn:
            old.shutdown(graceful=False)
        conn.owner = self
        self._resp_conn = conn
        ch = self.recv_cq.channel
        conn.set_driver(ch if ch is not None and ch.manual else None)
        req = self._req_conn
        if req is None or req.state >= CLOSING:
            self._req_conn = conn  # our requests travel on the peer's connection
            conn.cma_start()
            if self._unsent and not self._conn_wait:
                self._pump()
        elif req is not conn and not req.requests_sent and self._peer_connects():
            # Both QPs opened a connection (ours before the peer's arrived) and ours
            # carried nothing yet: the one opened by the smaller (port, QPN) serves both
            # directions; drop ours (the peer sees it close before any request).
            self._req_conn = conn
            conn.cma_start()
            req.shutdown(graceful=False)
        return True

    def _resp_batch_end(self, conn: Conn) -> None:
        if self._ack_pending >= 0:
            ch = conn.driver
            if ch is not None and ch.defer_ack(self):
                return  # the loop answers soon: the ACK rides on that, or is flushed
            conn.send([wire.pack(wire.OP_ACK, self._ack_pending)])
            self._ack_pending = -1

    def _flush_ack(self) -> None:
        """Send the coalesced ACK now, unless something already carried it (lock held)."""
        conn = self._resp_conn
        if self._ack_pending >= 0 and conn is not None:
            conn.send([wire.pack(wire.OP_ACK, self._ack_pending)])
            self._ack_pending = -1

    def _respond(self, conn: Conn, bufs: list[bytes | memoryview]) -> None:
        self._ack_pending = -1  # any response acknowledges everything before it
        conn.send(bufs)

    def _nak_error(self, conn: Conn, psn: int, syndrome: int, event: EventType | None) -> None:
        self._respond(conn, [wire.pack(wire.OP_NAK, psn, aux=syndrome)])
        self._to_error(event)

    def _rkey_view(self, rkey: int, raddr: int, length: int, right: int) -> memoryview | None:
        mr = self._keys.get(rkey)
        if mr is None or mr.pd is not self.pd:
            return None
        if not (mr.acc & right) or not (self._acc & right):
            return None
        off = raddr - mr.addr
        if off < 0 or off + length > mr.length:
            return None
        return mr.view[off:off + length]

    def _cma_read(self, conn: Conn, psn: int, src: memoryview, plen: int,
                  shm: tuple[int, int, int] | None) -> Sink:
        """A READ with FLAG_CMA: write ``src`` into the requester's SGEs, then answer.
        ``shm`` (FLAG_SHM): ``(fd, inode, offset)`` of the destination's shared buffer."""
        gen = self._gen
        copy = _CMACopy(conn, [src], plen, write=True, shm=shm)

        def read_done() -> None:
            if self._gen != gen or self._state not in (_QP_RTR, _QP_RTS):
                return
            if copy.err:
                self._nak_error(conn, psn, wire.NAK_REM_OP, None)
                return
            self._epsn = wire.psn_add(psn)
            self._respond(conn, [wire.pack(wire.OP_READ_RESP, psn, len(src),
                                           flags=wire.FLAG_CMA)])

        return copy.sink(read_done)

    def _on_request(self, conn: Conn, h: tuple[int, ...]) -> Sink | None:
        op, flags, aux, psn, length, imm, rkey, _pad, raddr, compare_add, swap = h
        plen = wire.payload_len(h)
        if (self._state not in (_QP_RTR, _QP_RTS) or psn != self._epsn
                or not wire.is_request(op)):
            # out of sequence (e.g. behind an RNR NAK'd request): drop, the requester resends
            return discard(plen)
        rq = self._rq
        if op in (wire.OP_SEND, wire.OP_SEND_IMM, wire.OP_WRITE_IMM) and not rq:
            self._respond(conn, [wire.pack(wire.OP_NAK, psn, aux=wire.NAK_RNR,
                                           flags=self._min_rnr_timer & 31)])
            return discard(plen)
        right = _QP_RIGHT.get(op)
        if right is not None and not (self._acc & right):
            # The QP itself does not allow this operation: an invalid request (rxe:
            # REM_INV_REQ_ERR at the requester, no async event), not an access error.
            self._nak_error(conn, psn, wire.NAK_INV_REQ, None)
            return discard(plen)
        gen = self._gen
        if op == wire.OP_SEND or op == wire.OP_SEND_IMM:
            r = rq[0]
            if length > r.length:
                rq.popleft()
                self._rq_complete(r, _WC_LOC_LEN_ERR)
                # rxe answers a too-long SEND with a remote operational error NAK
                self._nak_error(conn, psn, wire.NAK_REM_OP, _EV_QP_REQ_ERR)
                return discard(length)
            views = self._resolve(r.sg_list, need_write=True)
            if views is None:
                rq.popleft()
                self._rq_complete(r, _WC_LOC_PROT_ERR)
                self._nak_error(conn, psn, wire.NAK_REM_OP, None)
                return discard(length)
            with_imm = imm if op == wire.OP_SEND_IMM else None
            solicited = bool(flags & wire.FLAG_SOLICITED)

            def send_done() -> None:
                if self._gen != gen or not self._rq or self._rq[0] is not r:
                    return
                self._rq.popleft()
                self._epsn = wire.psn_add(psn)
                self._ack_pending = psn
                self._rq_complete(r, _WC_SUCCESS, _WCOP_RECV, length, with_imm, solicited)

            return Sink(scatter(views, length), length, send_done)

        if op == wire.OP_WRITE or op == wire.OP_WRITE_IMM:
            if length:
                target = self._rkey_view(rkey, raddr, length, _REMOTE_WRITE)
                if target is None:
                    self._nak_error(conn, psn, wire.NAK_REM_ACCESS, _EV_QP_ACCESS_ERR)
                    return discard(plen)
                segs = [target]
            else:
                segs = []
            r0 = rq[0] if op == wire.OP_WRITE_IMM else None
            solicited = bool(flags & wire.FLAG_SOLICITED)
            cma_copy = _CMACopy(conn, segs, plen, write=False) if flags & wire.FLAG_CMA else None

            def write_done() -> None:
                if self._gen != gen or self._state not in (_QP_RTR, _QP_RTS):
                    return
                if cma_copy is not None and cma_copy.err:
                    self._nak_error(conn, psn, wire.NAK_REM_OP, None)
                    return
                if r0 is not None:
                    if not self._rq or self._rq[0] is not r0:
                        return
                    self._rq.popleft()
                    self._rq_complete(r0, _WC_SUCCESS, _WCOP_RECV_RDMA_WITH_IMM, length,
                                      imm, solicited)
                self._epsn = wire.psn_add(psn)
                self._ack_pending = psn

            if cma_copy is not None:
                return cma_copy.sink(write_done)
            return Sink(segs, length, write_done)

        if op == wire.OP_READ:
            if length:
                src = self._rkey_view(rkey, raddr, length, _REMOTE_READ)
                if src is None:
                    self._nak_error(conn, psn, wire.NAK_REM_ACCESS, _EV_QP_ACCESS_ERR)
                    return discard(plen)
                if flags & wire.FLAG_CMA:
                    shm = (imm, swap, compare_add) if flags & wire.FLAG_SHM else None
                    return self._cma_read(conn, psn, src, plen, shm)
                bufs: list[bytes | memoryview] = [wire.pack(wire.OP_READ_RESP, psn, length), src]
            else:
                bufs = [wire.pack(wire.OP_READ_RESP, psn, 0)]
            self._epsn = wire.psn_add(psn)
            self._respond(conn, bufs)
            return discard(plen)  # a zero-length READ never uses CMA: normally None

        # atomics
        target = self._rkey_view(rkey, raddr, 8, _REMOTE_ATOMIC)
        if target is None:
            self._nak_error(conn, psn, wire.NAK_REM_ACCESS, _EV_QP_ACCESS_ERR)
            return None
        if raddr % 8:
            self._nak_error(conn, psn, wire.NAK_INV_REQ, _EV_QP_REQ_ERR)
            return None
        old = int.from_bytes(target, "little")
        if op == wire.OP_FETCH_ADD:
            target[:] = ((old + compare_add) & _M64).to_bytes(8, "little")
        elif old == compare_add:
            target[:] = (swap & _M64).to_bytes(8, "little")
        self._epsn = wire.psn_add(psn)
        self._respond(conn, [wire.pack(wire.OP_ATOMIC_RESP, psn, compare_add=old)])
        return None


class _CMACopy:
    """One CMA request's data movement: collect the requester's iovec records (the
    request's payload), then copy between them and ``local`` (MR slices, kept alive
    here) with the device lock released. ``err``: 0, or the errno of a failed copy
    (also EINVAL when the records do not add up to the local length)."""

    __slots__ = ("pid", "local", "write", "iov", "err", "conn", "shm")

    def __init__(self, conn: Conn, local: list[memoryview], plen: int, write: bool,
                 shm: tuple[int, int, int] | None = None) -> None:
        self.pid = conn.peer_pid()
        self.local = local
        self.write = write
        self.iov = bytearray(plen)
        self.err = 0
        self.conn = conn
        self.shm = shm  # READ into a shared buffer: (fd, inode, offset), wire FLAG_SHM

    def sink(self, on_done: Callable[[], None]) -> Sink:
        return Sink([memoryview(self.iov)], len(self.iov), on_done, self.run)

    def run(self) -> None:
        local = [(cma.address_of(v), len(v)) for v in self.local if len(v)]
        remote = cma.unpack_iov(self.iov)
        shm = self.shm
        if shm is not None and len(local) == 1 and self.pid > 0:
            addr, n = local[0]
            if sum(k for _, k in remote) == n:  # the records agree on the length
                hit = self.conn.peer_maps().target(shm[0], shm[1], shm[2], n)
                if hit is not None:
                    cma.memmove(hit[1], addr, n)
                    return
        self.err = cma.copy(self.pid, local, remote, self.write) if self.pid > 0 else errno.EPERM
