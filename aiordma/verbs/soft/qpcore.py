"""State shared by the requester and responder halves of a soft RC QP.

Work queue entries, completion generation (with the send-queue slot accounting of
unsignaled WRs), local SGE resolution and the transition to ERR with its flush.
Every method here runs with the device lock held.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from ..api import QP, AHAttr, AsyncEvent, QPCap
from ..enums import Access, EventType, QPState, WCFlags, WCOpcode, WCStatus
from ..wr import SGE, WC
from . import wire

# Enum members and library functions the per-packet path uses, as module constants:
# compiled, each is a C static, where ``QPState.RTS`` or ``time.monotonic`` is an
# attribute lookup per use.
_QP_ERR: Final = QPState.ERR
_QP_RESET: Final = QPState.RESET
_WCOP_RECV: Final = WCOpcode.RECV
_WC_SUCCESS: Final = WCStatus.SUCCESS
_WC_WR_FLUSH_ERR: Final = WCStatus.WR_FLUSH_ERR

_LOCAL_WRITE: Final = int(Access.LOCAL_WRITE)
#: connections a QP admits in its life (each direction may reconnect a few times)
MAX_HELLOS: Final = 16

if TYPE_CHECKING:
    from .conn import Conn
    from .context import SoftContext
    from .cq import SoftCQ
    from .engine import Engine
    from .mr import SoftPD
    from .sink import Sink


class SWQE:
    """A send work queue entry (payload already resolved to memoryview slices)."""

    __slots__ = ("wr_id", "op", "wc_opcode", "segs", "length", "signaled", "hdr", "psn",
                 "error", "fence", "rd_atomic", "rnr_left")

    def __init__(self, wr_id: int, op: int, wc_opcode: WCOpcode, segs: list[memoryview],
                 length: int, signaled: bool, error: WCStatus | None, fence: bool,
                 rd_atomic: bool) -> None:
        self.wr_id = wr_id
        self.op = op
        self.wc_opcode = wc_opcode
        self.segs = segs
        self.length = length
        self.signaled = signaled
        self.error = error
        self.fence = fence
        self.rd_atomic = rd_atomic
        self.rnr_left = -1
        self.psn = 0
        self.hdr = b""


class RWQE:
    """A receive work queue entry."""

    __slots__ = ("wr_id", "sg_list", "length")

    def __init__(self, wr_id: int, sg_list: list[SGE]) -> None:
        self.wr_id = wr_id
        self.sg_list = sg_list
        self.length = sum(s.length for s in sg_list)


def scatter(views: list[memoryview], length: int) -> list[memoryview]:
    """The first ``length`` bytes of the concatenation of ``views``, as slices."""
    out: list[memoryview] = []
    left = length
    for v in views:
        if left <= 0:
            break
        n = len(v)
        if n > left:
            out.append(v[:left])
            left = 0
        else:
            out.append(v)
            left -= n
    return out


class QPCore(QP):
    """Base of the soft QP (abstract: see ``qp.SoftQP``)."""

    qp_num: int
    cap: QPCap
    pd: SoftPD
    send_cq: SoftCQ
    recv_cq: SoftCQ

    def _init_core(self, pd: SoftPD, send_cq: SoftCQ, recv_cq: SoftCQ, cap: QPCap,
                   qpn: int) -> None:
        self._engine: Engine = pd.context._engine
        self._ctx: SoftContext = pd.context
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        # read per post: the QP's queue sizes (fixed at creation, as a device's), the
        # device lock and its memory keys, as attributes of this compiled class
        self._max_send_wr = cap.max_send_wr
        self._max_recv_wr = cap.max_recv_wr
        self._lock = self._engine.lock
        self._keys = self._engine.keys
        self.qp_num = qpn
        self._state = _QP_RESET
        self._closed = False
        self._gen = 0
        self._sq_used = 0
        self._unsig = 0
        self._inflight: deque[SWQE] = deque()
        self._unsent: deque[SWQE] = deque()
        self._rq: deque[RWQE] = deque()
        # attributes
        self._access = Access(0)
        self._acc = 0  # int(self._access)
        self._dest_qpn = 0
        self._ah: AHAttr | None = None
        self._epsn = 0
        self._next_psn = 0
        self._min_rnr_timer = 12
        self._timeout = 14
        self._retry_cnt = 7
        self._rnr_retry = 7
        # connections: the key a peer device must prove (QPAttr.auth_key), the HELLO
        # nonces already admitted (a replayed HELLO is refused)
        self._auth_key: bytes | None = None
        self._hello_nonces: set[bytes] = set()
        self._req_conn: Conn | None = None
        self._resp_conn: Conn | None = None
        # requester / responder progress state
        self._rnr_wait = False
        self._ack_armed = False
        self._progress = 0.0
        # local ACK timer (requester.py, Retries): when the current try began, retries
        # left, and how many tries ended without progress in the QP's life
        self._try_start = 0.0
        self._retries_left = 7
        self.local_ack_timeouts = 0
        self._ack_pending = -1
        self._conn_wait = False  # requests wait for the peer's connection (requester)

    # --- connection owner (qp.SoftQP; a Conn calls them with the device lock held) -------
    def conn_header(self, conn: Conn, h: tuple[int, ...]) -> Sink | None:
        """``conn`` parsed the header ``h`` (an unpacked ``wire.HDR``): where its payload
        goes (None: it has none, or the connection was failed)."""
        raise NotImplementedError

    def conn_batch_end(self, conn: Conn) -> None:
        """``conn`` parsed what one read brought (the coalesced ACK's moment)."""
        raise NotImplementedError

    def conn_closed(self, conn: Conn) -> None:
        """``conn`` is closed (after it left the owner's connections)."""
        raise NotImplementedError

    # --- connections -------------------------------------------------------------------
    def _admit_nonce(self, nonce: bytes) -> bool:
        """True the first time a HELLO with ``nonce`` is admitted to this QP; False for a
        replay, or once ``MAX_HELLOS`` were admitted (a pair needs two or three)."""
        seen = self._hello_nonces
        if nonce in seen or len(seen) >= MAX_HELLOS:
            return False
        seen.add(nonce)
        return True

    def _peer_connects(self) -> bool:
        """Of a QP pair, the QP with the smaller (device port, QPN) opens the connection
        both use; the other one waits for it (wire: Connections)."""
        ah = self._ah
        assert ah is not None
        return (ah.dlid, self._dest_qpn) < (self._engine.port, self.qp_num)

    # --- completions -------------------------------------------------------------------
    def _sq_complete(self, w: SWQE, status: WCStatus, byte_len: int = 0) -> None:
        if status == _WC_SUCCESS and not w.signaled:
            self._unsig += 1
            return
        release = 1 + self._unsig
        self._unsig = 0
        self.send_cq.push(WC(w.wr_id, status, w.wc_opcode, byte_len, qp_num=self.qp_num),
                          self, self._gen, release)

    def _rq_complete(self, r: RWQE, status: WCStatus, opcode: WCOpcode = _WCOP_RECV,
                     byte_len: int = 0, imm: int | None = None, solicited: bool = False) -> None:
        wc = WC(r.wr_id, status, opcode, byte_len, qp_num=self.qp_num, src_qp=self._dest_qpn,
                imm_data=imm or 0, wc_flags=WCFlags.WITH_IMM if imm is not None else 0)
        self.recv_cq.push(wc, self, self._gen, 0, solicited)

    # --- local memory ------------------------------------------------------------------
    def _resolve(self, sg_list: list[SGE], need_write: bool) -> list[memoryview] | None:
        """SGEs -> slices of their MRs; None on a protection error (LOC_PROT_ERR)."""
        keys = self._keys
        out: list[memoryview] = []
        for s in sg_list:
            if s.length == 0:
                continue
            mr = keys.get(s.lkey)
            if mr is None or mr.pd is not self.pd:
                return None
            if need_write and not mr.acc & _LOCAL_WRITE:
                return None
            off = s.addr - mr.addr
            if off < 0 or s.length < 0 or off + s.length > mr.length:
                return None
            out.append(mr.view[off:off + s.length])
        return out

    # --- errors ------------------------------------------------------------------------
    def _fail_send(self, status: WCStatus) -> None:
        """The oldest outstanding send WR fails with ``status``; the QP goes to ERR."""
        q = self._inflight if self._inflight else self._unsent
        if q:
            self._sq_complete(q.popleft(), status)
        self._to_error(None)

    def _to_error(self, event: EventType | None) -> None:
        if self._closed or self._state == _QP_ERR:
            return
        self._state = _QP_ERR
        self._rnr_wait = False
        for q in (self._inflight, self._unsent):
            while q:
                self._sq_complete(q.popleft(), _WC_WR_FLUSH_ERR)
        rq = self._rq
        while rq:
            self._rq_complete(rq.popleft(), _WC_WR_FLUSH_ERR)
        self._drop_conns(graceful=True)
        if event is not None:
            self._ctx._post_async(AsyncEvent(event, qp_num=self.qp_num))

    def _drop_conns(self, graceful: bool) -> None:
        req, self._req_conn = self._req_conn, None
        resp, self._resp_conn = self._resp_conn, None
        if graceful and resp is not None and self._ack_pending >= 0:
            # Requests executed (and maybe already consumed by the application) but not
            # acknowledged yet, because the thread that ran them has not reached the end
            # of its input batch: acknowledge them before the connection goes.
            resp.send([wire.pack(wire.OP_ACK, self._ack_pending)])
            self._ack_pending = -1
        if req is not None and req is not resp:
            req.shutdown(graceful=False)
        if resp is not None:
            resp.shutdown(graceful=graceful)
        self._engine.drop_held(self.qp_num)
