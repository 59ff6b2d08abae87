"""``IbvMR``: a registered memory region (``ibv_reg_mr`` of a pinned buffer)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import RDMAError
from ..api import MR
from ..buffers import PinnedBuffer
from ..enums import Access
from . import compat

if TYPE_CHECKING:
    from .pd import IbvPD


class IbvMR(MR):
    def __init__(self, pd: IbvPD, pmr: Any, pinned: PinnedBuffer, access: Access) -> None:
        self.pd: IbvPD = pd
        self._mr = pmr
        self._pinned = pinned
        self.view = pinned.view
        self.addr = pinned.addr
        self.length = pinned.length
        self.lkey = int(pmr.lkey)
        self.rkey = int(pmr.rkey)
        self.access = access
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._mr.close()
        except self.pd._pv.Error as exc:
            raise RDMAError(compat.errno_of(exc), f"ibv_dereg_mr: {exc}") from None
        self._closed = True
        self.pd._mrs.discard(self)
        self._pinned.release()

    def __repr__(self) -> str:
        return (f"<IbvMR addr={self.addr:#x} length={self.length} lkey={self.lkey:#x} "
                f"rkey={self.rkey:#x} access={self.access!r}>")
