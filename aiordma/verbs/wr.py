"""Work requests and work completions: plain slotted records, provider-neutral.

These are built on the hot path, so they are simple classes with ``__slots__`` and
positional-friendly constructors, not dataclasses with validation.
"""

from __future__ import annotations

from .enums import SendFlags, WCOpcode, WCStatus, WROpcode


class SGE:
    """A scatter/gather element: ``length`` bytes at ``addr`` inside the MR of ``lkey``."""

    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr = addr
        self.length = length
        self.lkey = lkey

    def __repr__(self) -> str:
        return f"SGE(addr={self.addr:#x}, length={self.length}, lkey={self.lkey:#x})"


class SendWR:
    """A send-queue work request (ibv_send_wr without the ``next`` link: chains are lists).

    ``remote_addr``/``rkey`` serve RDMA_WRITE*, RDMA_READ and atomics; ``compare_add`` is
    the compare value (CMP_AND_SWP) or the addend (FETCH_AND_ADD); ``swap`` the new value.
    For atomics the single SGE is the 8-byte local buffer that receives the old value.
    """

    __slots__ = (
        "wr_id",
        "opcode",
        "sg_list",
        "send_flags",
        "imm_data",
        "remote_addr",
        "rkey",
        "compare_add",
        "swap",
    )

    def __init__(
        self,
        wr_id: int,
        opcode: WROpcode,
        sg_list: list[SGE],
        send_flags: int = SendFlags.SIGNALED,
        *,
        imm_data: int = 0,
        remote_addr: int = 0,
        rkey: int = 0,
        compare_add: int = 0,
        swap: int = 0,
    ) -> None:
        self.wr_id = wr_id
        self.opcode = opcode
        self.sg_list = sg_list
        self.send_flags = send_flags
        self.imm_data = imm_data
        self.remote_addr = remote_addr
        self.rkey = rkey
        self.compare_add = compare_add
        self.swap = swap

    @property
    def length(self) -> int:
        return sum(s.length for s in self.sg_list)

    def __repr__(self) -> str:
        return (
            f"SendWR(wr_id={self.wr_id}, opcode={self.opcode!s}, len={self.length}, "
            f"flags={int(self.send_flags):#x})"
        )


class RecvWR:
    """A receive-queue work request."""

    __slots__ = ("wr_id", "sg_list")

    def __init__(self, wr_id: int, sg_list: list[SGE]) -> None:
        self.wr_id = wr_id
        self.sg_list = sg_list

    def __repr__(self) -> str:
        return f"RecvWR(wr_id={self.wr_id}, len={sum(s.length for s in self.sg_list)})"


class WC:
    """A work completion (ibv_wc). ``imm_data`` is valid when ``wc_flags & WITH_IMM``.

    For an error status only ``wr_id``, ``status``, ``vendor_err`` and ``qp_num`` are
    meaningful (as on real devices, ``opcode`` is undefined for errors; providers set
    their best knowledge).
    """

    __slots__ = ("wr_id", "status", "opcode", "vendor_err", "byte_len", "imm_data", "qp_num",
                 "src_qp", "wc_flags")

    def __init__(
        self,
        wr_id: int,
        status: WCStatus,
        opcode: WCOpcode,
        byte_len: int = 0,
        vendor_err: int = 0,
        imm_data: int = 0,
        qp_num: int = 0,
        src_qp: int = 0,
        wc_flags: int = 0,
    ) -> None:
        self.wr_id = wr_id
        self.status = status
        self.opcode = opcode
        self.byte_len = byte_len
        self.vendor_err = vendor_err
        self.imm_data = imm_data
        self.qp_num = qp_num
        self.src_qp = src_qp
        self.wc_flags = wc_flags

    def __repr__(self) -> str:
        return (
            f"WC(wr_id={self.wr_id}, status={self.status!s}, opcode={self.opcode!s}, "
            f"byte_len={self.byte_len}, qp_num={self.qp_num})"
        )
