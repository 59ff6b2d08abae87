"""The verbs contract's shared argument checks (aiordma.verbs.contract), no provider."""

from __future__ import annotations

import errno

import pytest

from aiordma.errors import PostError, RDMAError, RegistrationError
from aiordma.verbs import (
    SGE,
    Access,
    InvalidWorkRequest,
    QPCap,
    RecvWR,
    SendFlags,
    SendWR,
    WROpcode,
)
from aiordma.verbs.contract import check_cq_close, check_mr_access, check_recv_wrs, check_send_wr

CAP = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=2, max_recv_sge=1, max_inline_data=16)


def test_a_good_send_returns_its_opcode_and_length() -> None:
    wr = SendWR(1, 2, [SGE(0x1000, 8, 1), SGE(0x2000, 4, 1)], SendFlags.INLINE)
    op, length = check_send_wr(wr, CAP)
    assert op is WROpcode.SEND and length == 12
    assert check_send_wr(SendWR(1, WROpcode.RDMA_WRITE, []), CAP) == (WROpcode.RDMA_WRITE, 0)


@pytest.mark.parametrize(("wr", "match"), [
    (SendWR(1, 7, []), "unknown send opcode 7"),
    (SendWR(1, "SEND", []), "unknown send opcode 'SEND'"),
    (SendWR(1, WROpcode.SEND, [SGE(0, 1, 1)] * 3), "3 SGEs, the QP allows max_send_sge=2"),
    (SendWR(1, WROpcode.SEND, [SGE(0, -1, 1)]), "negative SGE length"),
    (SendWR(1, WROpcode.ATOMIC_CMP_AND_SWP, [SGE(0, 4, 1)]), "exactly one 8-byte SGE"),
    (SendWR(1, WROpcode.ATOMIC_FETCH_AND_ADD, [SGE(0, 8, 1)], remote_addr=12),
     "0xc is not 8-byte aligned"),
    (SendWR(1, WROpcode.RDMA_READ, [SGE(0, 8, 1)], SendFlags.INLINE), "INLINE is only valid"),
    (SendWR(1, WROpcode.SEND, [SGE(0, 17, 1)], SendFlags.INLINE),
     "inline data of 17 bytes, the QP allows 16"),
])
def test_malformed_sends(wr: SendWR, match: str) -> None:
    with pytest.raises(InvalidWorkRequest, match=match) as ei:
        check_send_wr(wr, CAP)
    assert isinstance(ei.value, PostError) and isinstance(ei.value, ValueError)
    assert ei.value.errno == errno.EINVAL


def test_receives() -> None:
    # returns whether every WR has exactly one SGE
    assert check_recv_wrs([RecvWR(1, [SGE(0, 8, 1)]), RecvWR(2, [SGE(8, 8, 1)])], CAP)
    assert not check_recv_wrs([RecvWR(1, [SGE(0, 8, 1)]), RecvWR(2, [])], CAP)
    assert check_recv_wrs([], CAP)
    with pytest.raises(InvalidWorkRequest, match="2 SGEs, the QP allows max_recv_sge=1"):
        check_recv_wrs([RecvWR(1, [SGE(0, 8, 1)] * 2)], CAP)
    with pytest.raises(InvalidWorkRequest, match="negative SGE length"):
        check_recv_wrs([RecvWR(1, []), RecvWR(2, [SGE(0, -8, 1)])], CAP)


def test_mr_access() -> None:
    assert check_mr_access(Access.LOCAL_WRITE | Access.REMOTE_WRITE) == (
        Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    assert check_mr_access(Access.REMOTE_READ) is Access.REMOTE_READ
    for bad in (Access.REMOTE_WRITE, Access.REMOTE_ATOMIC):
        with pytest.raises(RegistrationError, match="require LOCAL_WRITE") as ei:
            check_mr_access(bad)
        assert ei.value.errno == errno.EINVAL


def test_cq_close() -> None:
    check_cq_close(0, 5, 5)
    with pytest.raises(RDMAError, match="CQ still used by 2 QP") as ei:
        check_cq_close(2, 0, 0)
    assert ei.value.errno == errno.EBUSY
    with pytest.raises(RDMAError, match="3 unacknowledged completion event") as ei:
        check_cq_close(0, 5, 2)
    assert ei.value.errno == errno.EBUSY
