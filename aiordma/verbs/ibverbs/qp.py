"""``IbvQP``: an RC queue pair: its state changes (``ibv_modify_qp``) and posts, with the
queue accounting (``compat.WorkQueues``) that refuses what the device would refuse."""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any

from ...errors import PostError, RDMAError
from ..api import QP, AHAttr, QPAttr, QPCap
from ..contract import ATOMIC_OPS as _ATOMIC_OPS
from ..contract import InvalidWorkRequest, check_recv_wrs, check_send_wr
from ..enums import WC_OPCODE_FOR_WR, LinkLayer, QPState, SendFlags, WROpcode
from ..wr import RecvWR, SendWR
from . import compat

if TYPE_CHECKING:
    from .cq import IbvCQ
    from .pd import IbvPD

log = logging.getLogger("aiordma.verbs")

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_IMM_OPS = frozenset({WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM})
_RDMA_OPS = frozenset({WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.RDMA_READ})
# what a post sets besides wr_id, opcode, flags and SGEs, per opcode: one look-up
_K_IMM, _K_RDMA, _K_ATOMIC = 1, 2, 4
_OP_KIND = {op: ((_K_IMM if op in _IMM_OPS else 0) | (_K_RDMA if op in _RDMA_OPS else 0)
                 | (_K_ATOMIC if op in _ATOMIC_OPS else 0)) for op in WROpcode}
_NO_SEND_STATES = frozenset({QPState.RESET, QPState.INIT, QPState.RTR})
# plain ints: IntFlag arithmetic runs Python-level enum code on every post
_F_INLINE = int(SendFlags.INLINE)
_F_SIGNALED = int(SendFlags.SIGNALED)
# pyverbs work requests of single-WR, single-SGE posts kept per QP for reuse (IbvQP)
_WR_CACHE = 64


def _set_op_fields(p: Any, wr: SendWR, kind: int) -> None:
    """Set on the pyverbs SendWR ``p`` the fields that ``wr``'s opcode reads besides
    wr_id, opcode, flags and SGEs (``kind`` = ``_OP_KIND[opcode]``): immediate data,
    the RDMA or the atomic part. Single posts and chains both build WRs through it."""
    if kind & _K_IMM:
        p.imm_data = compat.imm_to_wire(wr.imm_data)
    if kind & _K_RDMA:
        p.set_wr_rdma(wr.rkey & _M32, wr.remote_addr & _M64)
    elif kind & _K_ATOMIC:
        p.set_wr_atomic(wr.rkey & _M32, wr.remote_addr & _M64,
                        wr.compare_add & _M64, wr.swap & _M64)


def _gid_str(gid: bytes) -> str:
    h = bytes(gid).hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


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
        self._state = QPState.RESET
        self._queues = compat.WorkQueues(cap.max_send_wr, cap.max_recv_wr)
        # (addr, length, lkey) -> pyverbs SendWR / RecvWR, see _new_send_wr
        self._send_wrs: dict[tuple[int, int, int], Any] = {}
        self._recv_wrs: dict[tuple[int, int, int], Any] = {}
        self._closed = False
        self._ctx._qps[self.qp_num] = self
        pd._qps.add(self)
        for cq in (send_cq, recv_cq):
            cq._qps[self] = cq._qps.get(self, 0) + 1

    def __repr__(self) -> str:
        return f"<IbvQP qpn={self.qp_num:#x} state={self._state.name}>"

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
    def _ah_attr(self, ah: AHAttr, port: Any) -> Any:
        pv = self._pv
        ib = int(port.link_layer) == int(LinkLayer.INFINIBAND)
        dgid = bytes(ah.dgid)
        if len(dgid) != 16:
            raise RDMAError(errno.EINVAL, "ah_attr.dgid must be 16 bytes")
        if ib:
            # LID addressing; a GRH only without a LID or towards another subnet.
            need_grh = ah.dlid == 0
            if not need_grh and ah.is_global and dgid != compat.ZERO_GID:
                try:
                    local = self._ctx.query_gid(ah.port_num or 1, ah.sgid_index)
                except RDMAError:
                    local = dgid
                need_grh = local[:8] != dgid[:8]
        else:
            need_grh = True  # RoCE: every packet carries a GRH (IP header)
        if need_grh:
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(_gid_str(dgid)),
                                     sgid_index=ah.sgid_index, hop_limit=ah.hop_limit or 64)
            return pv.addr.AHAttr(dlid=ah.dlid if ib else 0, sl=ah.sl, is_global=1,
                                  port_num=ah.port_num or 1, gr=gr)
        return pv.addr.AHAttr(dlid=ah.dlid, sl=ah.sl, is_global=0, port_num=ah.port_num or 1)

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
                pa.path_mtu = min(int(attr.path_mtu), int(port.active_mtu))
                pa.dest_qp_num = attr.dest_qp_num & 0xFFFFFF
                pa.rq_psn = attr.rq_psn & 0xFFFFFF
                pa.max_dest_rd_atomic = max(0, min(attr.max_dest_rd_atomic, dattr.max_qp_rd_atom))
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
        sq = q.sq
        if n > q.max_send - len(sq):
            raise PostError(errno.ENOMEM, f"send queue full ({len(sq)} of {q.max_send} in "
                            f"use, {n} more posted)")
        if n == 1 and len(wrs[0].sg_list) == 1:
            # One WR with one SGE (every frame of an endpoint): through the cached pyverbs
            # WR of its SGE (_new_send_wr), no chain to build or free; inlined, as this
            # runs for every message.
            wr = wrs[0]
            op = check_send_wr(wr, self.cap)[0]
            s = wr.sg_list[0]
            key = (s.addr, s.length, s.lkey)
            wr_id = wr.wr_id & _M64
            flags = int(wr.send_flags)
            try:
                p = self._send_wrs.get(key)
                if p is None:
                    p = self._new_send_wr(key)
                p.wr_id = wr_id
                p.opcode = op
                p.send_flags = flags
                kind = _OP_KIND[op]
                if kind:  # (a plain SEND uses none of the other fields: no call)
                    _set_op_fields(p, wr, kind)
                self._qp.post_send(p)
            except self._pv.Error as exc:
                raise PostError(compat.errno_of(exc), f"ibv_post_send: {exc}") from None
            except OverflowError as exc:
                raise InvalidWorkRequest(
                    f"a work request field is out of range: {exc}") from None
            sq.append((wr_id, flags & _F_SIGNALED != 0, WC_OPCODE_FOR_WR[op]))
            if st == QPState.ERR:
                self._flush_posted()
            return
        ops = [check_send_wr(wr, self.cap)[0] for wr in wrs]
        pvwr = self._pv.wr
        sges: list[Any] = []
        built: list[Any] = []
        head: Any = None
        try:
            for wr, op in zip(reversed(wrs), reversed(ops), strict=True):
                sg = [pvwr.SGE(s.addr, s.length, s.lkey) for s in wr.sg_list]
                if not sg:
                    sg = [pvwr.SGE(0, 0, 0)]
                sges.extend(sg)
                kw: dict[str, Any] = {
                    "wr_id": wr.wr_id & _M64, "opcode": int(op), "num_sge": len(sg), "sg": sg,
                    "send_flags": int(wr.send_flags),
                }
                if head is not None:
                    kw["next_wr"] = head
                p = pvwr.SendWR(**kw)
                built.append(p)
                if not wr.sg_list:
                    p.num_sge = 0
                kind = _OP_KIND[op]
                if kind:
                    _set_op_fields(p, wr, kind)
                head = p
            self._qp.post_send(head)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_send: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            for obj in built:  # ibv_post_send copied them; free the C memory now
                obj.close()
            for s in sges:
                s.close()
        q.posted_send((wr.wr_id & _M64, bool(int(wr.send_flags) & _F_SIGNALED),
                       WC_OPCODE_FOR_WR[op]) for wr, op in zip(wrs, ops, strict=True))
        if st == QPState.ERR:
            self._flush_posted()

    @staticmethod
    def _cache_put(cache: dict[tuple[int, int, int], Any], key: tuple[int, int, int],
                   p: Any, limit: int = _WR_CACHE) -> None:
        if len(cache) >= limit:
            cache.pop(next(iter(cache))).close()  # the oldest
        cache[key] = p

    def _new_send_wr(self, key: tuple[int, int, int]) -> Any:
        """A new pyverbs SendWR for single-WR posts with the one SGE ``key`` = (addr,
        length, lkey), cached for re-use: building one costs two pyverbs objects (each a
        logger look-up and a malloc) and their ``close``; the device copies a WR when it
        is posted, so the object is free again as soon as ``post_send`` returns. The
        caller sets ``wr_id``, ``opcode``, ``send_flags`` and what its opcode uses (a
        cached WR keeps the values of its last post: a plain SEND reads none of the
        others). A cached WR is never chained (its ``next`` stays NULL). Posting happens
        on one thread (the event loop's)."""
        pvwr = self._pv.wr
        sge = pvwr.SGE(*key)
        try:
            p = pvwr.SendWR(wr_id=0, opcode=int(WROpcode.SEND), num_sge=1, sg=[sge],
                            send_flags=0)
        finally:
            sge.close()  # SendWR copied it
        self._cache_put(self._send_wrs, key, p)
        return p

    def _new_recv_wr(self, key: tuple[int, int, int]) -> Any:
        """A new pyverbs RecvWR for the one-SGE receive ``key`` = (addr, length, lkey),
        cached for re-use like ``_new_send_wr``'s (one per receive buffer: the cache holds
        as many as the receive queue); the caller sets its ``wr_id``."""
        pvwr = self._pv.wr
        sge = pvwr.SGE(*key)
        try:
            p = pvwr.RecvWR(wr_id=0, num_sge=1, sg=[sge])
        finally:
            sge.close()
        self._cache_put(self._recv_wrs, key, p, max(_WR_CACHE, self._queues.max_recv))
        return p

    def _post_recv_cached(self, wrs: list[RecvWR]) -> None:
        """Post one-SGE receives through their cached pyverbs WRs, one ibv_post_recv
        each (cheaper than building a chain of new objects). Like a chained post that
        fails at ``bad_wr``, the WRs before a failing one stay posted (and are recorded).
        This runs for every re-posted buffer: the wr_ids are recorded once per call."""
        post = self._qp.post_recv
        cache = self._recv_wrs
        posted: list[int] = []
        try:
            for wr in wrs:
                s = wr.sg_list[0]
                key = (s.addr, s.length, s.lkey)
                p = cache.get(key)
                if p is None:
                    p = self._new_recv_wr(key)
                wr_id = wr.wr_id & _M64
                p.wr_id = wr_id
                post(p)
                posted.append(wr_id)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_recv: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            self._queues.posted_recv(posted)

    def post_recv(self, wrs: list[RecvWR]) -> None:
        st = self._state
        if self._closed or st == QPState.RESET:
            raise PostError(errno.EINVAL, f"post_recv on a QP in {st.name}")
        n = len(wrs)
        if not n:
            return
        q = self._queues
        if n > q.recv_room():
            raise PostError(errno.ENOMEM, f"receive queue full ({len(q.rq)} of {q.max_recv} "
                            f"in use, {n} more posted)")
        if check_recv_wrs(wrs, self.cap):
            self._post_recv_cached(wrs)
        else:
            self._post_recv_chain(wrs)
        if st == QPState.ERR:
            self._flush_posted()

    def _post_recv_chain(self, wrs: list[RecvWR]) -> None:
        """Post receives with any number of SGEs as one chain of new pyverbs WRs (freed
        after the post; an empty SGE list is posted as num_sge 0)."""
        pvwr = self._pv.wr
        sges: list[Any] = []
        built: list[Any] = []
        head: Any = None
        try:
            for wr in reversed(wrs):
                sg = [pvwr.SGE(s.addr, s.length, s.lkey) for s in wr.sg_list]
                if not sg:
                    sg = [pvwr.SGE(0, 0, 0)]
                sges.extend(sg)
                if head is None:
                    p = pvwr.RecvWR(wr_id=wr.wr_id & _M64, num_sge=len(sg), sg=sg)
                else:
                    p = pvwr.RecvWR(wr_id=wr.wr_id & _M64, num_sge=len(sg), sg=sg, next_wr=head)
                built.append(p)
                if not wr.sg_list:
                    p.num_sge = 0
                head = p
            self._qp.post_recv(head)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_recv: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            for obj in built:
                obj.close()
            for s in sges:
                s.close()
        self._queues.posted_recv(wr.wr_id & _M64 for wr in wrs)

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
        self._closed = True
        self._queues.reset()
        for cache in (self._send_wrs, self._recv_wrs):
            for p in cache.values():
                p.close()
            cache.clear()
        if ctx._qps.get(self.qp_num) is self:
            del ctx._qps[self.qp_num]
        self.pd._qps.discard(self)
        for cq in (self.send_cq, self.recv_cq):
            k = cq._qps.get(self, 0) - 1
            if k <= 0:
                cq._qps.pop(self, None)
            else:
                cq._qps[self] = k
