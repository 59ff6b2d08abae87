"""Verbs constants with the rdma-core (ibv_*) values and names, provider-neutral."""

from __future__ import annotations

import enum

_PREFIX = {
    "WCStatus": "IBV_WC_",
    "WROpcode": "IBV_WR_",
    "WCOpcode": "IBV_WC_",
    "QPState": "IBV_QPS_",
    "MTU": "IBV_",
    "PortState": "IBV_PORT_",
    "LinkLayer": "IBV_LINK_LAYER_",
    "EventType": "IBV_EVENT_",
}


class _IbvEnum(enum.IntEnum):
    """An IntEnum whose ``str()`` is the rdma-core C name."""

    def __str__(self) -> str:
        return f"{_PREFIX.get(type(self).__name__, '')}{self.name}"


class WCStatus(_IbvEnum):
    """ibv_wc_status. ``str(s)`` is the C name, e.g. ``IBV_WC_REM_ACCESS_ERR``."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21


class WROpcode(_IbvEnum):
    """ibv_wr_opcode (what a send work request does)."""

    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4
    ATOMIC_CMP_AND_SWP = 5
    ATOMIC_FETCH_AND_ADD = 6


class WCOpcode(_IbvEnum):
    """ibv_wc_opcode (what a work completion reports)."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    BIND_MW = 5
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


#: The completion opcode a send-queue work request reports.
WC_OPCODE_FOR_WR = {
    WROpcode.RDMA_WRITE: WCOpcode.RDMA_WRITE,
    WROpcode.RDMA_WRITE_WITH_IMM: WCOpcode.RDMA_WRITE,
    WROpcode.SEND: WCOpcode.SEND,
    WROpcode.SEND_WITH_IMM: WCOpcode.SEND,
    WROpcode.RDMA_READ: WCOpcode.RDMA_READ,
    WROpcode.ATOMIC_CMP_AND_SWP: WCOpcode.COMP_SWAP,
    WROpcode.ATOMIC_FETCH_AND_ADD: WCOpcode.FETCH_ADD,
}


class WCFlags(enum.IntFlag):
    """ibv_wc_flags."""

    GRH = 1
    WITH_IMM = 2


class QPState(_IbvEnum):
    """ibv_qp_state."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class Access(enum.IntFlag):
    """ibv_access_flags."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    MW_BIND = 16


class SendFlags(enum.IntFlag):
    """ibv_send_flags."""

    FENCE = 1
    SIGNALED = 2
    SOLICITED = 4
    INLINE = 8


class MTU(_IbvEnum):
    """ibv_mtu."""

    MTU_256 = 1
    MTU_512 = 2
    MTU_1024 = 3
    MTU_2048 = 4
    MTU_4096 = 5

    @property
    def bytes(self) -> int:
        return 128 << int(self)


class PortState(_IbvEnum):
    """ibv_port_state."""

    NOP = 0
    DOWN = 1
    INIT = 2
    ARMED = 3
    ACTIVE = 4
    ACTIVE_DEFER = 5


class LinkLayer(_IbvEnum):
    """IBV_LINK_LAYER_*."""

    UNSPECIFIED = 0
    INFINIBAND = 1
    ETHERNET = 2


class EventType(_IbvEnum):
    """ibv_event_type (device async events)."""

    CQ_ERR = 0
    QP_FATAL = 1
    QP_REQ_ERR = 2
    QP_ACCESS_ERR = 3
    COMM_EST = 4
    SQ_DRAINED = 5
    PATH_MIG = 6
    PATH_MIG_ERR = 7
    DEVICE_FATAL = 8
    PORT_ACTIVE = 9
    PORT_ERR = 10
    LID_CHANGE = 11
    PKEY_CHANGE = 12
    SM_CHANGE = 13
    SRQ_ERR = 14
    SRQ_LIMIT_REACHED = 15
    QP_LAST_WQE_REACHED = 16
    CLIENT_REREGISTER = 17
    GID_CHANGE = 18
