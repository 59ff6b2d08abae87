"""The verbs contract's argument checks, shared by every provider.

What rdma-core refuses before a work request reaches the device (``ibv_post_send`` /
``ibv_post_recv`` return EINVAL), what ``ibv_reg_mr`` refuses, and what makes
``ibv_destroy_cq`` fail with EBUSY. Each provider calls these first, so both refuse the
same input with the same error type and message; what a provider checks beyond them
(its own limits) stays in the provider.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

from ..errors import PostError, RDMAError, RegistrationError
from ..native import mypyc_attr
from .api import QPCap
from .enums import Access, SendFlags, WROpcode
from .wr import RecvWR, SendWR

__all__ = ["InvalidWorkRequest", "ATOMIC_OPS", "RD_ATOMIC_OPS", "check_send_wr",
           "check_recv_wrs", "check_mr_access", "check_cq_close"]

ATOMIC_OPS = frozenset({WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.ATOMIC_FETCH_AND_ADD})
RD_ATOMIC_OPS = ATOMIC_OPS | {WROpcode.RDMA_READ}
_INLINE = int(SendFlags.INLINE)
_OPCODES = {int(m): m for m in WROpcode}  # a dict look-up: cheaper than WROpcode(x)


@mypyc_attr(native_class=False)  # two builtin bases (OSError, ValueError)
class InvalidWorkRequest(PostError, ValueError):
    """A malformed work request (unknown opcode, too many SGEs, a negative length, a
    bad atomic operand, inline data where it is not allowed or too long). errno EINVAL;
    nothing of the post it was in was posted."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EINVAL, msg)


def check_send_wr(wr: SendWR, cap: QPCap) -> tuple[WROpcode, int]:
    """Check one send WR against the verbs rules and the QP's ``cap``. Returns
    ``(opcode, total SGE length)``; raises InvalidWorkRequest."""
    try:
        op = _OPCODES.get(wr.opcode)
    except TypeError:  # unhashable
        op = None
    if op is None:
        raise InvalidWorkRequest(f"unknown send opcode {wr.opcode!r}")
    sg = wr.sg_list
    if len(sg) > cap.max_send_sge:
        raise InvalidWorkRequest(f"{len(sg)} SGEs, the QP allows max_send_sge={cap.max_send_sge}")
    length = 0
    for s in sg:
        if s.length < 0:
            raise InvalidWorkRequest("negative SGE length")
        length += s.length
    if op in ATOMIC_OPS:
        if len(sg) != 1 or sg[0].length != 8:
            raise InvalidWorkRequest("an atomic WR needs exactly one 8-byte SGE")
        if wr.remote_addr % 8:
            # rdma-core (44 and 65) refuses this in ibv_post_send with EINVAL
            raise InvalidWorkRequest(
                f"atomic remote address {wr.remote_addr:#x} is not 8-byte aligned")
    if int(wr.send_flags) & _INLINE:
        if op in RD_ATOMIC_OPS:
            raise InvalidWorkRequest("INLINE is only valid for SEND and RDMA_WRITE")
        if length > cap.max_inline_data:
            raise InvalidWorkRequest(
                f"inline data of {length} bytes, the QP allows {cap.max_inline_data}")
    return op, length


def check_recv_wrs(wrs: Iterable[RecvWR], cap: QPCap) -> bool:
    """Check receive WRs: SGE count within ``cap.max_recv_sge``, no negative length.
    Raises InvalidWorkRequest. Returns whether every WR has exactly one SGE (what
    providers post through a cheaper path)."""
    limit = cap.max_recv_sge
    single = True
    for wr in wrs:
        sg = wr.sg_list
        n = len(sg)
        if n > limit:
            raise InvalidWorkRequest(f"{n} SGEs, the QP allows max_recv_sge={limit}")
        if n != 1:
            single = False
        for s in sg:
            if s.length < 0:
                raise InvalidWorkRequest("negative SGE length")
    return single


def check_mr_access(access: Access) -> Access:
    """The access flags of a registration, as ``Access``. Raises RegistrationError
    (EINVAL) for remote write or atomic rights without LOCAL_WRITE, as ibv_reg_mr does."""
    access = Access(access)
    if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
        raise RegistrationError(
            errno.EINVAL, "REMOTE_WRITE and REMOTE_ATOMIC require LOCAL_WRITE (ibv_reg_mr EINVAL)")
    return access


def check_cq_close(qps: int, events_got: int, events_acked: int) -> None:
    """Raise RDMAError EBUSY if a CQ cannot be destroyed: ``qps`` QPs still use it, or
    completion events were read and not acknowledged (ibv_destroy_cq would block)."""
    if qps:
        raise RDMAError(errno.EBUSY, f"CQ still used by {qps} QP(s)")
    if events_acked < events_got:
        raise RDMAError(
            errno.EBUSY,
            f"CQ has {events_got - events_acked} unacknowledged completion event(s); "
            "ack_events() them first (ibv_destroy_cq would block)")
