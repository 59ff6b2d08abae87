"""Protection domains (the soft device's memory regions and key table are in
``_core``: the data path resolves keys per request)."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from ...errors import RDMAError, RegistrationError
from ..api import CQ, PD, QPCap
from ..contract import check_mr_access
from ..enums import Access
from ._core import SoftCQ, SoftMR, SoftQP
from .keys import KeyStream

if TYPE_CHECKING:
    from .context import SoftContext


class SoftPD(PD):
    context: SoftContext

    def __init__(self, ctx: SoftContext) -> None:
        self.context = ctx
        self._mrs: set[SoftMR] = set()
        self._qps: set[SoftQP] = set()
        self._keys = KeyStream()
        self._closed = False

    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> SoftMR:
        if self._closed:
            raise RegistrationError(errno.EINVAL, "protection domain is closed")
        access = check_mr_access(access)
        mr = SoftMR(self, buffer, access)
        with self.context._engine.lock:
            self._mrs.add(mr)
        return mr

    def create_qp(self, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> SoftQP:
        if self._closed:
            raise RDMAError(errno.EINVAL, "protection domain is closed")
        if not isinstance(send_cq, SoftCQ) or not isinstance(recv_cq, SoftCQ):
            raise TypeError("CQs of the soft provider are required")
        return SoftQP(self, send_cq, recv_cq, cap)

    def close(self) -> None:
        with self.context._engine.lock:
            if self._closed:
                return
            if self._mrs or self._qps:
                raise RDMAError(errno.EBUSY,
                                f"PD still has {len(self._mrs)} MR(s) and {len(self._qps)} QP(s)")
            self._closed = True
        self.context._children_changed(self, alive=False)

    def __repr__(self) -> str:
        return f"<SoftPD mrs={len(self._mrs)} qps={len(self._qps)}>"
