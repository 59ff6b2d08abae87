"""``IbvPD``: a protection domain, the factory of MRs and QPs."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from ...errors import RDMAError, RegistrationError
from ..api import CQ, PD, QPCap
from ..buffers import PinnedBuffer
from ..contract import check_mr_access
from ..enums import Access
from . import compat
from .cq import IbvCQ
from .mr import IbvMR
from .qp import IbvQP

if TYPE_CHECKING:
    from .context import IbvContext


class IbvPD(PD):
    def __init__(self, ctx: IbvContext) -> None:
        self.context: IbvContext = ctx
        self._pv = ctx._pv
        try:
            self._pd: Any = self._pv.pd.PD(ctx._ctx)
        except self._pv.Error as exc:
            raise ctx._error(exc, "ibv_alloc_pd") from None
        self._mrs: set[IbvMR] = set()
        self._qps: set[IbvQP] = set()
        self._closed = False
        ctx._children.add(self)

    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> IbvMR:
        if self._closed:
            raise RegistrationError(errno.EINVAL, "protection domain is closed")
        access = check_mr_access(access)
        pinned = PinnedBuffer(buffer)
        if pinned.length == 0:
            pinned.release()
            raise RegistrationError(errno.EINVAL, "cannot register an empty buffer")
        try:
            pmr = self._pv.mr.MR(self._pd, pinned.length, int(access), address=pinned.addr)
        except self._pv.Error as exc:
            pinned.release()
            code = compat.errno_of(exc)
            hint = " (raise the locked-memory limit: ulimit -l)" if code in (
                errno.ENOMEM, errno.EPERM, errno.EAGAIN) else ""
            raise RegistrationError(code, f"ibv_reg_mr of {pinned.length} bytes failed: "
                                    f"{exc}{hint}") from None
        mr = IbvMR(self, pmr, pinned, access)
        self._mrs.add(mr)
        return mr

    def create_qp(self, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> IbvQP:
        if not isinstance(send_cq, IbvCQ) or not isinstance(recv_cq, IbvCQ):
            raise TypeError("CQs of the verbs provider are required")
        if self._closed:
            raise RDMAError(errno.EINVAL, "protection domain is closed")
        ctx = self.context
        if send_cq.context is not ctx or recv_cq.context is not ctx:
            raise RDMAError(errno.EINVAL, "CQs of another device context")
        if send_cq._closed or recv_cq._closed:
            raise RDMAError(errno.EINVAL, "CQ is closed")
        cap = QPCap(cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
                    cap.max_inline_data)
        for field in ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge",
                      "max_inline_data"):
            if getattr(cap, field) < 0:
                raise RDMAError(errno.EINVAL, f"QP {field} is negative")
        if cap.max_send_wr < 1:
            raise RDMAError(errno.EINVAL, "a QP needs max_send_wr >= 1")
        pv = self._pv
        try:
            pcap = pv.qp.QPCap(max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr,
                               max_send_sge=cap.max_send_sge, max_recv_sge=cap.max_recv_sge,
                               max_inline_data=cap.max_inline_data)
            init = pv.qp.QPInitAttr(qp_type=pv.e["IBV_QPT_RC"], scq=send_cq._cq,
                                    rcq=recv_cq._cq, cap=pcap, sq_sig_all=0)
            pqp = pv.qp.QP(self._pd, init)
        except pv.Error as exc:
            raise ctx._error(exc, f"ibv_create_qp({cap})") from None
        return IbvQP(self, send_cq, recv_cq, cap, pqp)

    def close(self) -> None:
        if self._closed:
            return
        if self._mrs or self._qps:
            raise RDMAError(errno.EBUSY,
                            f"PD still has {len(self._mrs)} MR(s) and {len(self._qps)} QP(s)")
        try:
            self._pd.close()
        except self._pv.Error as exc:
            raise self.context._error(exc, "ibv_dealloc_pd") from None
        self._closed = True
        self.context._children.discard(self)

    def __repr__(self) -> str:
        return f"<IbvPD mrs={len(self._mrs)} qps={len(self._qps)}>"
