"""Limits the soft device reports (realistic values, as a ConnectX/rxe would)."""

from __future__ import annotations

from ..api import DeviceAttr
from . import wire

DEVICE_ATTR = DeviceAttr(
    max_qp_wr=16384,
    max_sge=32,
    max_cqe=65536,
    max_mr_size=2**40,
    max_qp_rd_atom=16,
    max_qp_init_rd_atom=16,
    max_inline_data=256,
    atomic_cap=1,
    vendor="aiordma",
    fw_ver="soft-1",
)

MAX_MSG_SIZE = wire.MAX_MSG
