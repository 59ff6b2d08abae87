"""Protection domains, memory regions and the device's key table."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from ...errors import RDMAError, RegistrationError
from ..api import CQ, MR, PD, QPCap
from ..buffers import PinnedBuffer
from ..contract import check_mr_access
from ..enums import Access
from .keys import KeyStream

if TYPE_CHECKING:
    from .context import SoftContext
    from .qp import SoftQP


class KeyTable:
    """The device's live lkeys/rkeys (one key serves as both), each drawn from its
    PD's ``KeyStream`` (keys.py: unpredictable, never repeated within the PD)."""

    def __init__(self) -> None:
        self._by_key: dict[int, SoftMR] = {}

    def add(self, mr: SoftMR) -> int:
        stream = mr.pd._keys
        while True:
            key = stream.next()
            if key and key not in self._by_key:  # 0 is no key; another PD's live one
                self._by_key[key] = mr
                return key

    def remove(self, key: int) -> None:
        self._by_key.pop(key, None)

    def get(self, key: int) -> SoftMR | None:
        return self._by_key.get(key)


class SoftMR(MR):
    # (declared again here, so that compiled they are this class's own attributes: the
    # device reads them for every work request; the interface's are looked up by name)
    pd: SoftPD
    addr: int
    length: int
    view: memoryview

    def __init__(self, pd: SoftPD, buffer: Any, access: Access) -> None:
        self.pd = pd
        self._pinned = PinnedBuffer(buffer)
        self.view = self._pinned.view
        self.addr = self._pinned.addr
        self.length = self._pinned.length
        self.access = Access(access)
        self.acc = int(self.access)  # plain int: the hot path tests bits without enum ops
        self._closed = False
        engine = pd.context._engine
        with engine.lock:
            self.lkey = self.rkey = engine.keys.add(self)

    def close(self) -> None:
        pd = self.pd
        engine = pd.context._engine
        with engine.lock:
            if self._closed:
                return
            self._closed = True
            engine.keys.remove(self.lkey)
            pd._mrs.discard(self)
        self._pinned.release()

    def __repr__(self) -> str:
        return (f"<SoftMR addr={self.addr:#x} length={self.length} lkey={self.lkey:#x} "
                f"access={self.access!r}>")


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
        from .cq import SoftCQ
        from .qp import SoftQP

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
