"""``IbvQP``: an RC queue pair: its state changes (``ibv_modify_qp``) and posts, with the
queue accounting (``compat.WorkQueues``) that refuses what the device would refuse.

Posts go through the compiled data path (``fastpath.QPPoster``: WRs built in C and posted
with ``ibv_post_send``/``ibv_post_recv`` on the QP's ``struct ibv_qp *``) where it is
built and the pointer was found (package docstring, "The compiled data path"), else as
pyverbs objects (``pyverbs_wrs``); ``AIORDMA_VERBS_POST=pyverbs`` chooses the latter.
Either way a chain the device refuses at ``bad_wr`` leaves the WRs before it posted
(and accounted for), and the WRs are checked (contract.py) before anything is posted.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref
from typing import TYPE_CHECKING, Any

from ...errors import PostError, RDMAError
from ..api import QP, AHAttr, QPAttr, QPCap
from ..contract import InvalidWorkRequest, check_recv_wrs, check_send_wr
from ..enums import WC_OPCODE_FOR_WR, LinkLayer, QPState, SendFlags
from ..wr import RecvWR, SendWR
from . import clib, compat, loader, probe
from .pyverbs_wrs import PyverbsWRs
from .queues import WorkQueues

if TYPE_CHECKING:
    from .cq import IbvCQ
    from .fastpath import QPPoster
    from .pd import IbvPD

log = logging.getLogger("aiordma.verbs")

_M64 = 0xFFFFFFFFFFFFFFFF
_NO_SEND_STATES = frozenset({QPState.RESET, QPState.INIT, QPState.RTR})
# plain ints: IntFlag arithmetic runs Python-level enum code on every post
_F_SIGNALED = int(SendFlags.SIGNALED)


def _gid_str(gid: bytes) -> str:
    h = bytes(gid).hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def _post_error(call: str, rc: int) -> PostError:
    return PostError(rc, f"{call}: {os.strerror(rc)}")


class IbvQP(QP):
    def __init__(self, pd: IbvPD, send_cq: IbvCQ, recv_cq: IbvCQ, cap: QPCap, pqp: Any) -> None:
        self.pd: IbvPD = pd
        self.send_cq: IbvCQ = send_cq
        self.recv_cq: IbvCQ = recv_cq
        self.cap = cap
        self._qp = pqp
        self._pv = pd._pv
        self._ctx = pd.context
        self.qp_num = int(pqp.qp_num)
        self._queues = WorkQueues(cap.max_send_wr, cap.max_recv_wr)
        self._wrs = PyverbsWRs(self._pv, cap.max_recv_wr)
        self._fast: QPPoster | None = self._fast_poster()
        self._state = QPState.RESET
        self._closed = False
        self._ctx._qps[self.qp_num] = self
        pd._qps.add(self)
        for cq in (send_cq, recv_cq):
            cq._qps[self] = cq._qps.get(self, 0) + 1
        send_cq._track(self)
        if recv_cq is not send_cq:
            recv_cq._track(self)

    def _fast_poster(self) -> QPPoster | None:
        """The compiled poster of this QP, or None (not built, not wanted, or its
        ``struct ibv_qp`` not found: then pyverbs posts)."""
        fp = loader.fastpath()
        ctx = self._ctx
        if fp is None or not ctx._ctx_ptr or os.environ.get("AIORDMA_VERBS_POST") == "pyverbs":
            return None
        try:
            words = probe.object_words(self._qp)
        except Exception:  # pragma: no cover - non-CPython
            return None
        ptr = probe.find_qp_pointer(words, ctx._ctx_ptr, self.qp_num, self.send_cq._cq_ptr,
                                     self.recv_cq._cq_ptr, ctx._mem.read)
        if not ptr:
            log.debug("aiordma: struct ibv_qp of %r not found; posting through pyverbs", self)
            return None
        cap = self.cap
        poster = fp.QPPoster(ptr, cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge,
                             cap.max_recv_sge)
        poster.attach(self._queues, weakref.ref(self))
        return poster

    @property
    def _state(self) -> QPState:
        """The QP's last known state (the compiled poster's copy follows it)."""
        return self._st

    @_state.setter
    def _state(self, st: QPState) -> None:
        self._st = st
        if self._fast is not None:
            self._fast.set_state(int(st))

    def c_ops(self) -> Any:
        """The C-level posts (``api.QP.c_ops``) where this QP posts through the
        compiled data path: ``fastpath.qp_ops()`` on its ``QPPoster``."""
        fast = self._fast
        if fast is None:
            return None
        fp = loader.fastpath()
        assert fp is not None
        return fp.qp_ops(), fast

    @property
    def data_path(self) -> str:
        """How this QP posts: ``"compiled"`` (fastpath) or ``"pyverbs"``."""
        return "compiled" if self._fast is not None else "pyverbs"

    def __repr__(self) -> str:
        return (f"<IbvQP qpn={self.qp_num:#x} state={self._state.name} "
                f"posts={self.data_path}>")

    @property
    def state(self) -> QPState:
        if self._closed:
            return self._state
        try:
            attr, _ = self._qp.query(self._pv.e["IBV_QP_STATE"])
            st = QPState(int(attr.qp_state))
        except (self._pv.Error, ValueError):
            return self._state
        self._state = st
        return st

    # --- modify --------------------------------------------------------------------------
    def _route(self, ah: AHAttr, port: Any) -> tuple[bytes, bool, int]:
        """``(dgid, is_global, dlid)`` of the address vector towards ``ah`` from
        ``port``: RoCE packets all carry a GRH (IP header) and no LID; InfiniBand
        addresses by LID, with a GRH only without a LID or towards another subnet."""
        ib = int(port.link_layer) == int(LinkLayer.INFINIBAND)
        dgid = bytes(ah.dgid)
        if len(dgid) != 16:
            raise RDMAError(errno.EINVAL, "ah_attr.dgid must be 16 bytes")
        if not ib:
            return dgid, True, 0
        need_grh = ah.dlid == 0
        if not need_grh and ah.is_global and dgid != compat.ZERO_GID:
            try:
                local = self._ctx.query_gid(ah.port_num or 1, ah.sgid_index)
            except RDMAError:
                local = dgid
            need_grh = local[:8] != dgid[:8]
        return dgid, need_grh, ah.dlid

    def _ah_attr(self, ah: AHAttr, port: Any) -> Any:
        pv = self._pv
        dgid, is_global, dlid = self._route(ah, port)
        if is_global:
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(_gid_str(dgid)),
                                     sgid_index=ah.sgid_index, hop_limit=ah.hop_limit or 64)
            return pv.addr.AHAttr(dlid=dlid, sl=ah.sl, is_global=1,
                                  port_num=ah.port_num or 1, gr=gr)
        return pv.addr.AHAttr(dlid=dlid, sl=ah.sl, is_global=0, port_num=ah.port_num or 1)

    @property
    def modify_releases_gil(self) -> bool:
        """True when INIT -> RTR runs in C with the GIL released (the compiled path and
        libibverbs' ``ibv_modify_qp`` were found): that transition may wait seconds for
        the kernel's address resolution, and an event loop can run it in a thread."""
        return self._fast is not None and clib.modify_qp_address() != 0

    def _modify_rtr_compiled(self, attr: QPAttr, ah: AHAttr, port: Any, path_mtu: int,
                             max_dest_rd_atomic: int) -> None:
        """INIT -> RTR through ``fastpath.QPPoster.modify_rtr`` (GIL released)."""
        assert self._fast is not None
        dgid, is_global, dlid = self._route(ah, port)
        rc = self._fast.modify_rtr(
            clib.modify_qp_address(), path_mtu, attr.dest_qp_num & 0xFFFFFF,
            attr.rq_psn & 0xFFFFFF, max_dest_rd_atomic, attr.min_rnr_timer, dgid,
            int(is_global), dlid, ah.sl, ah.sgid_index, ah.hop_limit or 64, ah.port_num or 1)
        if rc:
            raise RDMAError(rc, f"ibv_modify_qp INIT->RTR: {os.strerror(rc)}")

    def modify(self, attr: QPAttr) -> None:
        if self._closed:
            raise RDMAError(errno.EINVAL, "QP is closed")
        pv = self._pv
        e = pv.e
        cur = self._state
        new = QPState(attr.qp_state)
        pa = pv.qp.QPAttr(qp_state=int(new))
        mask = e["IBV_QP_STATE"]
        try:
            if new == QPState.INIT and cur in (QPState.RESET, QPState.INIT):
                pa.pkey_index = attr.pkey_index
                pa.port_num = attr.port_num
                pa.qp_access_flags = int(attr.qp_access_flags)
                mask |= e["IBV_QP_PKEY_INDEX"] | e["IBV_QP_PORT"] | e["IBV_QP_ACCESS_FLAGS"]
            elif new == QPState.RTR and cur == QPState.INIT:
                ah = attr.ah_attr
                if ah is None:
                    raise RDMAError(errno.EINVAL, "INIT->RTR needs ah_attr")
                port = self._ctx._port_attr(ah.port_num or attr.port_num or 1)
                dattr = self._ctx.query_device()
                path_mtu = min(int(attr.path_mtu), int(port.active_mtu))
                rd_atomic = max(0, min(attr.max_dest_rd_atomic, dattr.max_qp_rd_atom))
                if self.modify_releases_gil:
                    self._modify_rtr_compiled(attr, ah, port, path_mtu, rd_atomic)
                    self._state = new
                    return
                pa.path_mtu = path_mtu
                pa.dest_qp_num = attr.dest_qp_num & 0xFFFFFF
                pa.rq_psn = attr.rq_psn & 0xFFFFFF
                pa.max_dest_rd_atomic = rd_atomic
                pa.min_rnr_timer = attr.min_rnr_timer
                pa.ah_attr = self._ah_attr(ah, port)
                mask |= (e["IBV_QP_AV"] | e["IBV_QP_PATH_MTU"] | e["IBV_QP_DEST_QPN"]
                         | e["IBV_QP_RQ_PSN"] | e["IBV_QP_MAX_DEST_RD_ATOMIC"]
                         | e["IBV_QP_MIN_RNR_TIMER"])
            elif new == QPState.RTS and cur == QPState.RTR:
                dattr = self._ctx.query_device()
                pa.timeout = attr.timeout
                pa.retry_cnt = attr.retry_cnt
                pa.rnr_retry = attr.rnr_retry
                pa.sq_psn = attr.sq_psn & 0xFFFFFF
                pa.max_rd_atomic = max(0, min(attr.max_rd_atomic, dattr.max_qp_init_rd_atom))
                mask |= (e["IBV_QP_TIMEOUT"] | e["IBV_QP_RETRY_CNT"] | e["IBV_QP_RNR_RETRY"]
                         | e["IBV_QP_SQ_PSN"] | e["IBV_QP_MAX_QP_RD_ATOMIC"])
            self._qp.modify(pa, mask)
        except pv.Error as exc:
            raise RDMAError(compat.errno_of(exc),
                            f"ibv_modify_qp {cur.name}->{new.name}: {exc}") from None
        except OverflowError as exc:  # a value that does not fit its C field
            raise RDMAError(errno.EINVAL, f"ibv_modify_qp {cur.name}->{new.name}: {exc}") from None
        self._state = new
        if new == QPState.RESET:
            self._queues.reset()

    def _to_error(self) -> None:
        """Move to ERR (any state may); errors are ignored (the QP may be gone)."""
        if self._closed:
            return
        try:
            self._qp.modify(self._pv.qp.QPAttr(qp_state=int(QPState.ERR)),
                            self._pv.e["IBV_QP_STATE"])
        except self._pv.Error as exc:
            log.debug("aiordma: moving QP %#x to ERR failed: %s", self.qp_num, exc)
            return
        self._state = QPState.ERR

    def _flush_posted(self) -> None:
        """WRs posted to a QP in ERR must complete with WR_FLUSH_ERR. rxe's user-space
        provider writes receive WQEs straight into the shared queue and the kernel only
        flushes when it next looks at the QP: modifying ERR -> ERR (legal, a no-op on
        hardware) makes it look now."""
        self._to_error()


    # --- posting -------------------------------------------------------------------------
    def post_send(self, wrs: list[SendWR]) -> None:
        st = self._state
        if self._closed or st in _NO_SEND_STATES:
            raise PostError(errno.EINVAL, f"post_send on a QP in {st.name}")
        n = len(wrs)
        if not n:
            return
        q = self._queues
        if n > q.send_room():
            used = q.max_send - q.send_room()
            raise PostError(errno.ENOMEM, f"send queue full ({used} of {q.max_send} in "
                            f"use, {n} more posted)")
        cap = self.cap
        fast = self._fast
        if n == 1:
            # one WR (every frame of an endpoint): inlined, as this runs for every message
            wr = wrs[0]
            op = check_send_wr(wr, cap)[0]
            if fast is not None:
                try:
                    rc, posted = fast.post_send(wrs, [op])
                except OverflowError as exc:
                    raise InvalidWorkRequest(
                        f"a work request field is out of range: {exc}") from None
                if rc:
                    raise _post_error("ibv_post_send", rc)
            elif len(wr.sg_list) == 1:
                self._wrs.post_send_one(self._qp, wr, op)
            else:
                self._wrs.post_send_chain(self._qp, wrs, [op])
            q.posted_send(((wr.wr_id & _M64, int(wr.send_flags) & _F_SIGNALED != 0,
                            WC_OPCODE_FOR_WR[op]),))
        else:
            ops = [check_send_wr(wr, cap)[0] for wr in wrs]
            if fast is not None:
                try:
                    rc, posted = fast.post_send(wrs, ops)
                except OverflowError as exc:
                    raise InvalidWorkRequest(
                        f"a work request field is out of range: {exc}") from None
            else:
                self._wrs.post_send_chain(self._qp, wrs, ops)
                rc, posted = 0, n
            q.posted_send((wr.wr_id & _M64, int(wr.send_flags) & _F_SIGNALED != 0,
                           WC_OPCODE_FOR_WR[op])
                          for wr, op in zip(wrs[:posted], ops[:posted], strict=True))
            if rc:
                raise _post_error("ibv_post_send", rc)
        if st == QPState.ERR:
            self._flush_posted()

    def post_recv(self, wrs: list[RecvWR]) -> None:
        st = self._state
        if self._closed or st == QPState.RESET:
            raise PostError(errno.EINVAL, f"post_recv on a QP in {st.name}")
        n = len(wrs)
        if not n:
            return
        q = self._queues
        if n > q.recv_room():
            raise PostError(errno.ENOMEM, f"receive queue full ({q.max_recv - q.recv_room()} "
                            f"of {q.max_recv} in use, {n} more posted)")
        single = check_recv_wrs(wrs, self.cap)
        fast = self._fast
        if fast is not None:
            try:
                rc, posted = fast.post_recv(wrs)
            except OverflowError as exc:
                raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
            q.posted_recv([wr.wr_id & _M64 for wr in wrs[:posted]])
            if rc:
                raise _post_error("ibv_post_recv", rc)
        elif single:
            # This runs for every re-posted buffer: the wr_ids are recorded once per call.
            posted_ids: list[int] = []
            try:
                self._wrs.post_recv_cached(self._qp, wrs, posted_ids)
            finally:
                q.posted_recv(posted_ids)
        else:
            self._wrs.post_recv_chain(self._qp, wrs)
            q.posted_recv(wr.wr_id & _M64 for wr in wrs)
        if st == QPState.ERR:
            self._flush_posted()

    def close(self) -> None:
        if self._closed:
            return
        ctx = self._ctx
        # ibv_destroy_qp waits for the acks of the async events *read* for the QP: they
        # are acked as they are read, and unread ones are dropped by the kernel.
        try:
            self._qp.close()
        except self._pv.Error as exc:
            raise ctx._error(exc, "ibv_destroy_qp") from None
        if self._fast is not None:
            self._fast.close()  # its struct ibv_qp is gone: it posts nothing from now on
        self._closed = True
        self._queues.reset()
        self._wrs.close()
        if ctx._qps.get(self.qp_num) is self:
            del ctx._qps[self.qp_num]
        self.pd._qps.discard(self)
        for cq in (self.send_cq, self.recv_cq):
            k = cq._qps.get(self, 0) - 1
            if k <= 0:
                cq._qps.pop(self, None)
                cq._untrack(self)
            else:
                cq._qps[self] = k
