"""The soft RC QP: public verbs (modify, post_send, post_recv, close) and the state machine.

The requester and responder halves live in ``requester.py`` and ``responder.py``.
"""

from __future__ import annotations

import ctypes
import errno
from typing import TYPE_CHECKING, Final

from ...errors import PostError, RDMAError
from ..api import QPAttr, QPCap
from ..contract import check_recv_wrs, check_send_wr
from ..enums import WC_OPCODE_FOR_WR, QPState, SendFlags, WCStatus, WROpcode
from ..wr import SGE, RecvWR, SendWR
from . import limits, wire
from .conn import Conn
from .qpcore import RWQE, SWQE
from .responder import Responder
from .sink import Sink, discard

# Enum members and library functions the per-packet path uses, as module constants:
# compiled, each is a C static, where ``QPState.RTS`` or ``time.monotonic`` is an
# attribute lookup per use.
_QP_ERR: Final = QPState.ERR
_QP_INIT: Final = QPState.INIT
_QP_RESET: Final = QPState.RESET
_QP_RTR: Final = QPState.RTR
_QP_RTS: Final = QPState.RTS
_WC_LOC_LEN_ERR: Final = WCStatus.LOC_LEN_ERR
_WC_LOC_PROT_ERR: Final = WCStatus.LOC_PROT_ERR
_WC_WR_FLUSH_ERR: Final = WCStatus.WR_FLUSH_ERR
_string_at: Final = ctypes.string_at

if TYPE_CHECKING:
    from .cq import SoftCQ
    from .mr import SoftPD


_WIRE_OP: Final = {
    WROpcode.SEND: wire.OP_SEND,
    WROpcode.SEND_WITH_IMM: wire.OP_SEND_IMM,
    WROpcode.RDMA_WRITE: wire.OP_WRITE,
    WROpcode.RDMA_WRITE_WITH_IMM: wire.OP_WRITE_IMM,
    WROpcode.RDMA_READ: wire.OP_READ,
    WROpcode.ATOMIC_CMP_AND_SWP: wire.OP_CMP_SWP,
    WROpcode.ATOMIC_FETCH_AND_ADD: wire.OP_FETCH_ADD,
}
# hot path: plain ints (flag-enum arithmetic builds a new enum object per operation)
_INLINE: Final = int(SendFlags.INLINE)
_SIGNALED: Final = int(SendFlags.SIGNALED)
_FENCE: Final = int(SendFlags.FENCE)
_SOLICITED: Final = int(SendFlags.SOLICITED)
_FLAG_SOLICITED: Final = wire.FLAG_SOLICITED
_HDR_PACK: Final = wire.HDR.pack
_PSN_MASK: Final = wire.PSN_MASK
_M64: Final = 0xFFFFFFFFFFFFFFFF

_LEGAL: Final = {
    (_QP_RESET, _QP_INIT),
    (_QP_INIT, _QP_INIT),
    (_QP_INIT, _QP_RTR),
    (_QP_RTR, _QP_RTS),
    (_QP_RTS, _QP_RTS),
}


class SoftQP(Responder):
    def __init__(self, pd: SoftPD, send_cq: SoftCQ, recv_cq: SoftCQ, cap: QPCap) -> None:
        lim = limits.DEVICE_ATTR
        for name, value, top in (
            ("max_send_wr", cap.max_send_wr, lim.max_qp_wr),
            ("max_recv_wr", cap.max_recv_wr, lim.max_qp_wr),
            ("max_send_sge", cap.max_send_sge, lim.max_sge),
            ("max_recv_sge", cap.max_recv_sge, lim.max_sge),
            ("max_inline_data", cap.max_inline_data, lim.max_inline_data),
        ):
            if not 0 <= value <= top:
                raise RDMAError(errno.EINVAL, f"QP {name}={value} outside 0..{top}")
        if cap.max_send_wr < 1 or cap.max_recv_wr < 0:
            raise RDMAError(errno.EINVAL, "a QP needs max_send_wr >= 1")
        engine = pd.context._engine
        if send_cq._ctx._engine is not engine or recv_cq._ctx._engine is not engine:
            raise RDMAError(errno.EINVAL, "CQs of another device")
        cap = QPCap(cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
                    cap.max_inline_data)
        with engine.lock:
            if send_cq._closed or recv_cq._closed:
                raise RDMAError(errno.EINVAL, "CQ is closed")
            qpn = engine.alloc_qpn()
            self._init_core(pd, send_cq, recv_cq, cap, qpn)
            engine.qps[qpn] = self
            pd._qps.add(self)
            send_cq._attach(self)
            recv_cq._attach(self)

    def __repr__(self) -> str:
        return f"<SoftQP qpn={self.qp_num:#x} state={self._state.name}>"

    # --- connection owner ------------------------------------------------------------
    def conn_header(self, conn: Conn, h: tuple[int, ...]) -> Sink | None:
        # One connection may carry both directions (see wire: the peer adopted ours):
        # requests go to the responder half, responses to the requester half.
        op: int = h[0]
        if wire.is_request(op):
            if conn is not self._resp_conn:
                if conn is self._req_conn:
                    # the peer sends its requests on our connection (it dropped its own)
                    if self._resp_conn is not None:
                        self._flush_ack()
                    self._resp_conn = conn
                else:
                    conn.fail()  # not our protocol: drop the connection
                    return None
            return self._on_request(conn, h)
        if wire.is_response(op) and conn is self._req_conn:
            return self._on_response(conn, h)
        if conn is self._req_conn or conn is self._resp_conn:
            conn.fail()
            return None
        return discard(wire.payload_len(h))

    def conn_batch_end(self, conn: Conn) -> None:
        if conn is self._resp_conn:
            self._resp_batch_end(conn)

    def conn_closed(self, conn: Conn) -> None:
        if conn is self._resp_conn:
            self._resp_conn = None
        if conn is self._req_conn:
            self._req_conn_closed(conn)

    # --- verbs ---------------------------------------------------------------------------
    @property
    def state(self) -> QPState:
        return self._state

    def modify(self, attr: QPAttr) -> None:
        engine = self._engine
        with engine.lock:
            if self._closed:
                raise RDMAError(errno.EINVAL, "QP is closed")
            cur, new = self._state, QPState(attr.qp_state)
            if new == _QP_RESET:
                self._reset()
                return
            if new == _QP_ERR:
                self._to_error(None)
                return
            if (cur, new) not in _LEGAL:
                raise RDMAError(errno.EINVAL, f"illegal QP state transition {cur.name} -> {new.name}")
            if new == _QP_INIT:
                if attr.port_num != 1:
                    raise RDMAError(errno.EINVAL, f"no port {attr.port_num} (soft0 has port 1)")
                key = attr.auth_key
                if key is not None and (not isinstance(key, bytes) or len(key) < 16):
                    raise RDMAError(errno.EINVAL, "auth_key must be bytes, at least 16")
                if cur == _QP_RESET or key is not None:
                    self._auth_key = key if key is not None else engine.secret
                    if self.qp_num in engine.admission.unkeyed:
                        qpn = self.qp_num  # HELLOs that came first are judged now
                        engine.call_soon(lambda: engine.admission.keyed(qpn))
                self._access = attr.qp_access_flags
                self._acc = int(attr.qp_access_flags)
                self._state = _QP_INIT
            elif new == _QP_RTR:
                ah = attr.ah_attr
                if ah is None or len(bytes(ah.dgid)) != 16 or not 0 < ah.dlid <= 0xFFFF:
                    raise RDMAError(errno.EINVAL,
                                    "INIT->RTR needs ah_attr with a 16-byte dgid and dlid (TCP port)")
                if not 0 <= attr.min_rnr_timer <= 31:
                    raise RDMAError(errno.EINVAL, "min_rnr_timer must be 0..31")
                self._ah = ah
                self._dest_qpn = attr.dest_qp_num & 0xFFFFFF
                self._epsn = attr.rq_psn & wire.PSN_MASK
                self._min_rnr_timer = attr.min_rnr_timer
                self._state = _QP_RTR
                try:
                    self._connect(lazy=True, at_rtr=True)
                except RDMAError:
                    self._state = cur  # a failed transition changes nothing
                    raise
                qpn = self.qp_num
                engine.call_soon(lambda: engine.release_held(qpn))
            else:  # RTS
                if not 0 <= attr.timeout <= 31 or not 0 <= attr.retry_cnt <= 7 \
                        or not 0 <= attr.rnr_retry <= 7:
                    raise RDMAError(errno.EINVAL, "timeout 0..31, retry_cnt and rnr_retry 0..7")
                if cur == _QP_RTR:
                    self._next_psn = attr.sq_psn & wire.PSN_MASK
                self._timeout = attr.timeout
                self._retry_cnt = attr.retry_cnt
                self._retries_left = attr.retry_cnt
                self._rnr_retry = attr.rnr_retry
                self._state = _QP_RTS
                self._pump()

    def _reset(self) -> None:
        self._drop_conns(graceful=False)
        self._inflight.clear()
        self._unsent.clear()
        self._rq.clear()
        self._gen += 1
        self._sq_used = 0
        self._unsig = 0
        self._rnr_wait = False
        self._ack_armed = False
        self._try_start = 0.0
        self._ack_pending = -1
        self._conn_wait = False
        self._auth_key = None
        self._hello_nonces.clear()
        self._state = _QP_RESET

    def post_send(self, wrs: list[SendWR]) -> None:
        with self._lock:
            st = self._state
            if self._closed or st in (_QP_RESET, _QP_INIT, _QP_RTR):
                raise PostError(errno.EINVAL, f"post_send on a QP in {st.name}")
            if self._sq_used + len(wrs) > self._max_send_wr:
                raise PostError(errno.ENOMEM,
                                f"send queue full ({self._sq_used} of {self._max_send_wr} "
                                f"in use, {len(wrs)} more posted)")
            built = [self._build(wr) for wr in wrs]
            self._sq_used += len(built)
            if st == _QP_ERR:
                for w, _ in built:
                    self._sq_complete(w, _WC_WR_FLUSH_ERR)
                return
            psn = self._next_psn
            pack = _HDR_PACK
            unsent = self._unsent
            for w, wr in built:
                w.psn = psn
                w.hdr = pack(w.op, _FLAG_SOLICITED if int(wr.send_flags) & _SOLICITED else 0, 0,
                             psn, w.length, wr.imm_data & 0xFFFFFFFF, wr.rkey & 0xFFFFFFFF, 0,
                             wr.remote_addr & _M64, wr.compare_add & _M64, wr.swap & _M64)
                psn = (psn + 1) & _PSN_MASK
                unsent.append(w)
            self._next_psn = psn
            self._pump()

    def _build(self, wr: SendWR) -> tuple[SWQE, SendWR]:
        wrop, length = check_send_wr(wr, self.cap)
        op: int = _WIRE_OP[wrop]
        rd_atomic = wire.is_rd_atomic(op)
        sg = wr.sg_list
        flags = int(wr.send_flags)
        inline = flags & _INLINE
        error: WCStatus | None = None
        if inline:
            segs = [memoryview(self._copy_inline(sg))] if length else []
        else:
            views = self._resolve(sg, need_write=rd_atomic)
            if views is None:
                error = _WC_LOC_PROT_ERR
                segs = []
            else:
                segs = views
        if length > wire.MAX_MSG:
            error = _WC_LOC_LEN_ERR
        w = SWQE(wr.wr_id, op, WC_OPCODE_FOR_WR[wr.opcode], segs, length,
                 flags & _SIGNALED != 0, error, flags & _FENCE != 0, rd_atomic)
        return w, wr

    def _copy_inline(self, sg: list[SGE]) -> bytes:
        keys = self._keys
        parts: list[bytes] = []
        for s in sg:
            if not s.length:
                continue
            mr = keys.get(s.lkey)
            off = s.addr - mr.addr if mr is not None else -1
            if mr is not None and 0 <= off and off + s.length <= mr.length:
                part = bytes(mr.view[off:off + s.length])
            else:  # inline data needs no registration: read the caller's memory
                part = _string_at(s.addr, s.length)
            if len(sg) == 1:
                return part
            parts.append(part)
        return b"".join(parts)

    def post_recv(self, wrs: list[RecvWR]) -> None:
        with self._lock:
            st = self._state
            if self._closed or st == _QP_RESET:
                raise PostError(errno.EINVAL, f"post_recv on a QP in {st.name}")
            if len(self._rq) + len(wrs) > self._max_recv_wr:
                raise PostError(errno.ENOMEM,
                                f"receive queue full ({len(self._rq)} of {self._max_recv_wr} "
                                f"in use, {len(wrs)} more posted)")
            check_recv_wrs(wrs, self.cap)
            rwqes = [RWQE(wr.wr_id, list(wr.sg_list)) for wr in wrs]
            if st == _QP_ERR:
                for r in rwqes:
                    self._rq_complete(r, _WC_WR_FLUSH_ERR)
                return
            self._rq.extend(rwqes)

    def close(self) -> None:
        engine = self._engine
        with engine.lock:
            if self._closed:
                return
            self._drop_conns(graceful=False)
            self._closed = True
            self._inflight.clear()
            self._unsent.clear()
            self._rq.clear()
            self._gen += 1
            engine.qps.pop(self.qp_num, None)
            self.send_cq._detach(self)
            self.recv_cq._detach(self)
            self.pd._qps.discard(self)
