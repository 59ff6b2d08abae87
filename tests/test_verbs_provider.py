"""Provider conformance: verbs semantics every provider must have (soft, and rdma-core).

Written only against the provider-neutral API (``aiordma.verbs``), so the same file runs
on the ``soft`` provider and on the ``verbs`` provider over Soft-RoCE. Two QPs of the
same device are connected to each other (loopback) at the address ``AIORDMA_TEST_IP``
(default 127.0.0.1). Every wait is bounded in time.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiordma.errors import CQOverrunError, DeviceError, PostError, RDMAError, RegistrationError
from aiordma.options import DEFAULT_ACK_TIMEOUT
from aiordma.verbs import (
    MTU,
    SGE,
    WC,
    Access,
    AHAttr,
    AsyncEvent,
    CompChannel,
    Context,
    EventType,
    PortState,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
    get_provider,
)
from aiordma.verbs.api import CQ, MR, PD, QP

pytestmark = pytest.mark.usefixtures("soft_cma")  # soft: with and without CMA
S = WCStatus
ACC_ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
WAIT_S = 10.0
# a peer process's start: importing aiordma and pyverbs took 7-10 s in the TCG guest
CHILD_START_S = 60.0
PSN = 0x1234


def local_ip() -> str:
    return os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
class Resources:
    """Closes what a test created, children first, acknowledging channel events."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.objs: list[object] = []
        self.events: dict[int, int] = {}  # id(cq) -> events obtained, not yet acked

    def add(self, obj):  # type: ignore[no-untyped-def]
        self.objs.append(obj)
        return obj

    def get_event(self, ch: CompChannel) -> CQ | None:
        cq = ch.get_event()
        if cq is not None:
            self.events[id(cq)] = self.events.get(id(cq), 0) + 1
        return cq

    def ack(self, cq: CQ) -> None:
        n = self.events.pop(id(cq), 0)
        if n:
            cq.ack_events(n)

    def close(self) -> None:
        order = (QP, MR, CQ, CompChannel, PD)
        for kind in order:
            for obj in reversed(self.objs):
                if isinstance(obj, kind):
                    if isinstance(obj, CQ):
                        self.ack(obj)
                    try:
                        obj.close()
                    except Exception as exc:  # pragma: no cover - report, keep closing
                        print(f"cleanup: closing {obj!r} failed: {exc!r}")
        self.objs.clear()


@pytest.fixture
def res(ctx: Context) -> Iterator[Resources]:
    r = Resources(ctx)
    yield r
    r.close()


def poll_n(cq: CQ, n: int, timeout: float = WAIT_S) -> list[WC]:
    """Exactly ``n`` completions, or fail after ``timeout`` seconds."""
    out: list[WC] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        got = cq.poll(n - len(out))
        out.extend(got)
        if len(out) >= n:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"only {len(out)} of {n} completions after {timeout}s: {out}")
        if not got:
            time.sleep(0.0002)
    return out


def expect_quiet(cq: CQ, seconds: float = 0.2) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = cq.poll(16)
        assert not got, f"unexpected completions: {got}"
        time.sleep(0.005)


def wait_state(qp: QP, state: QPState, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while qp.state != state:
        if time.monotonic() > deadline:
            pytest.fail(f"QP {qp.qp_num:#x} in {qp.state!s}, expected {state!s} within {timeout}s")
        time.sleep(0.002)


def readable(fd: int, timeout: float = 0.0) -> bool:
    r, _, _ = select.select([fd], [], [], timeout)
    return bool(r)


def local_addr(ctx: Context) -> tuple[bytes, int, int]:
    gi = ctx.gid_index_for(local_ip())
    return ctx.query_gid(1, gi), ctx.query_port(1).lid, gi


def bring_up(ctx: Context, qp: QP, peer_qpn: int, *, access: Access = ACC_ALL,
             psn: int = PSN, peer_psn: int = PSN, timeout: int | None = None, retry_cnt: int = 7,
             rnr_retry: int = 7, min_rnr_timer: int = 1,
             remote: tuple[bytes, int] | None = None, stop_at: QPState = QPState.RTS,
             auth_key: bytes | None = None) -> None:
    gid, lid, gi = local_addr(ctx)
    if remote is not None:
        gid, lid = remote
    qp.modify(QPAttr(QPState.INIT, qp_access_flags=access, auth_key=auth_key))
    if stop_at == QPState.INIT:
        return
    qp.modify(QPAttr(QPState.RTR, dest_qp_num=peer_qpn, rq_psn=peer_psn, path_mtu=MTU.MTU_1024,
                     max_dest_rd_atomic=16, min_rnr_timer=min_rnr_timer,
                     ah_attr=AHAttr(dgid=gid, dlid=lid, sgid_index=gi)))
    if stop_at == QPState.RTR:
        return
    if timeout is None:  # the endpoints' default: soft 18 (8 tries of 1.07 s: a loaded
        #                   machine's stalls are not lost packets), verbs 14
        timeout = DEFAULT_ACK_TIMEOUT[ctx.provider]
    qp.modify(QPAttr(QPState.RTS, sq_psn=psn, timeout=timeout, retry_cnt=retry_cnt,
                     rnr_retry=rnr_retry, max_rd_atomic=16))


class Pair:
    """Two RC QPs of one device connected to each other, each with its own PD and CQ.

    ``a`` is normally the requester, ``b`` the responder.
    """

    def __init__(self, ctx: Context, res: Resources, *, cap: QPCap | None = None,
                 cqe: int = 256, channel: bool = True, connect: bool = True,
                 access_a: Access = ACC_ALL, access_b: Access = ACC_ALL, **attrs: Any) -> None:
        self.ctx = ctx
        self.res = res
        cap = cap or QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=4, max_recv_sge=4,
                           max_inline_data=64)
        self.pd_a: PD = res.add(ctx.alloc_pd())
        self.pd_b: PD = res.add(ctx.alloc_pd())
        self.ch: CompChannel | None = res.add(ctx.create_comp_channel()) if channel else None
        self.cq_a: CQ = res.add(ctx.create_cq(cqe, self.ch))
        self.cq_b: CQ = res.add(ctx.create_cq(cqe, self.ch))
        self.a: QP = res.add(self.pd_a.create_qp(self.cq_a, self.cq_a, cap))
        self.b: QP = res.add(self.pd_b.create_qp(self.cq_b, self.cq_b, cap))
        if connect:
            bring_up(ctx, self.a, self.b.qp_num, access=access_a, **attrs)
            bring_up(ctx, self.b, self.a.qp_num, access=access_b, **attrs)

    def mr(self, side: str, size: int, access: Access = ACC_ALL) -> tuple[MR, bytearray]:
        buf = bytearray(size)
        pd = self.pd_a if side == "a" else self.pd_b
        return self.res.add(pd.reg_mr(buf, access)), buf


def sge(mr: MR, offset: int = 0, length: int | None = None) -> SGE:
    if length is None:
        length = mr.length - offset
    return SGE(mr.addr + offset, length, mr.lkey)


def send(wr_id: int, sges: list[SGE], op: WROpcode = WROpcode.SEND,
         flags: int = SendFlags.SIGNALED, **kw: int) -> SendWR:
    return SendWR(wr_id, op, sges, flags, **kw)


def statuses(wcs: list[WC]) -> list[WCStatus]:
    return [wc.status for wc in wcs]


# --------------------------------------------------------------------------------------
# device, addressing, limits
# --------------------------------------------------------------------------------------
def test_list_devices_and_ports(ctx: Context, provider_name: str) -> None:
    devs = get_provider(provider_name).list_devices()
    names = [d.name for d in devs]
    assert ctx.name in names
    dev = devs[names.index(ctx.name)]
    assert dev.provider == provider_name and dev.active
    assert dev.ports[0].port_num == 1 and dev.ports[0].state == PortState.ACTIVE
    port = ctx.query_port(1)
    assert port.state == PortState.ACTIVE and port.max_msg_sz >= 1 << 23  # rxe on 6.1: 8 MiB
    if provider_name == "soft":
        assert dev.name == "soft0" and dev.ports[0].lid == port.lid > 0


def test_soft_listing_is_lazy(provider_name: str) -> None:
    if provider_name != "soft":
        pytest.skip("soft provider only")
    from aiordma.verbs.soft import engine

    if engine.current() is not None:
        pytest.skip("a soft context is open in this process")
    before = {t.name for t in threading.enumerate()}
    get_provider("soft").list_devices()
    assert engine.current() is None
    assert {t.name for t in threading.enumerate()} == before


def test_soft_nic_thread_stops_with_last_context(provider_name: str) -> None:
    if provider_name != "soft":
        pytest.skip("soft provider only")
    from aiordma.verbs import open_context
    from aiordma.verbs.soft import engine

    if engine.current() is not None:
        pytest.skip("a soft context is open in this process")
    c1 = open_context(provider="soft")
    c2 = open_context(provider="soft")
    e = engine.current()
    assert e is not None and e._thread.is_alive() and e._thread.daemon
    c1.close()
    assert e._thread.is_alive()
    c2.close()
    assert not e._thread.is_alive() and engine.current() is None
    c2.close()  # idempotent


def test_soft_wildcard_gid_table(provider_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if provider_name != "soft":
        pytest.skip("soft provider only")
    from aiordma.verbs import open_context
    from aiordma.verbs.soft import engine

    if engine.current() is not None:
        pytest.skip("a soft context is open in this process")
    monkeypatch.setenv("AIORDMA_SOFT_ADDR", "0.0.0.0")
    c = open_context(provider="soft")
    try:
        i = c.gid_index_for("127.0.0.1")
        assert c.query_gid(1, i) == b"\0" * 10 + b"\xff\xff\x7f\0\0\1"
        assert c.query_gid(1, c.query_port(1).gid_tbl_len - 1) == b"\0" * 16
    finally:
        c.close()


def test_query_device_limits(ctx: Context, provider_name: str) -> None:
    a = ctx.query_device()
    assert a.max_qp_wr >= 1024 and a.max_sge >= 1 and a.max_cqe >= 1024
    assert a.max_mr_size >= 1 << 32 and a.max_qp_rd_atom >= 1 and a.atomic_cap >= 1
    if provider_name == "soft":
        assert (a.max_qp_wr, a.max_sge, a.max_cqe, a.max_mr_size, a.max_qp_rd_atom,
                a.max_inline_data, a.atomic_cap) == (16384, 32, 65536, 2**40, 16, 256, 1)


def test_gid_index_for(ctx: Context) -> None:
    i = ctx.gid_index_for(local_ip())
    gid = ctx.query_gid(1, i)
    if ":" not in local_ip():
        assert gid == b"\0" * 10 + b"\xff\xff" + bytes(int(x) for x in local_ip().split("."))
    with pytest.raises(DeviceError, match="203.0.113.77"):
        ctx.gid_index_for("203.0.113.77")


# --------------------------------------------------------------------------------------
# data path
# --------------------------------------------------------------------------------------
def test_send_recv(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 4096)
    mb, bb = p.mr("b", 4096)
    ba[:11] = b"hello world"
    p.b.post_recv([RecvWR(7, [sge(mb, 100, 200)])])
    p.a.post_send([send(8, [sge(ma, 0, 11)])])
    (wa,) = poll_n(p.cq_a, 1)
    (wb,) = poll_n(p.cq_b, 1)
    assert (wa.wr_id, wa.status, wa.opcode, wa.qp_num) == (8, S.SUCCESS, WCOpcode.SEND, p.a.qp_num)
    assert (wb.wr_id, wb.status, wb.opcode, wb.byte_len) == (7, S.SUCCESS, WCOpcode.RECV, 11)
    assert wb.qp_num == p.b.qp_num and not wb.wc_flags & WCFlags.WITH_IMM
    assert bytes(bb[100:111]) == b"hello world"


def test_zero_byte_send(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    mb, _ = p.mr("b", 64)
    p.b.post_recv([RecvWR(1, [sge(mb)])])
    p.a.post_send([send(2, [])])
    assert statuses(poll_n(p.cq_a, 1)) == [S.SUCCESS]
    (wb,) = poll_n(p.cq_b, 1)
    assert (wb.status, wb.byte_len, wb.opcode) == (S.SUCCESS, 0, WCOpcode.RECV)


def test_send_with_imm(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 64)
    mb, bb = p.mr("b", 64)
    ba[:3] = b"abc"
    p.b.post_recv([RecvWR(1, [sge(mb)])])
    p.a.post_send([send(2, [sge(ma, 0, 3)], WROpcode.SEND_WITH_IMM, imm_data=0xDEADBEEF)])
    poll_n(p.cq_a, 1)
    (wb,) = poll_n(p.cq_b, 1)
    assert (wb.status, wb.opcode, wb.byte_len) == (S.SUCCESS, WCOpcode.RECV, 3)
    assert wb.wc_flags & WCFlags.WITH_IMM and wb.imm_data == 0xDEADBEEF
    assert bytes(bb[:3]) == b"abc"


def test_scatter_gather(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 64)
    mb, bb = p.mr("b", 64)
    ba[:10] = b"0123456789"
    p.b.post_recv([RecvWR(1, [sge(mb, 0, 4), sge(mb, 32, 16)])])
    p.a.post_send([send(2, [sge(ma, 8, 2), sge(ma, 0, 8)])])
    poll_n(p.cq_a, 1)
    (wb,) = poll_n(p.cq_b, 1)
    assert wb.byte_len == 10
    assert bytes(bb[:4]) == b"8901" and bytes(bb[32:38]) == b"234567"


def test_write_and_read(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 4096)
    mb, bb = p.mr("b", 4096)
    ba[:5] = b"write"
    bb[1000:1004] = b"read"
    p.a.post_send([
        send(1, [sge(ma, 0, 5)], WROpcode.RDMA_WRITE, remote_addr=mb.addr + 10, rkey=mb.rkey),
        send(2, [sge(ma, 2000, 4)], WROpcode.RDMA_READ, remote_addr=mb.addr + 1000, rkey=mb.rkey),
    ])
    w1, w2 = poll_n(p.cq_a, 2)
    assert (w1.wr_id, w1.status, w1.opcode) == (1, S.SUCCESS, WCOpcode.RDMA_WRITE)
    assert (w2.wr_id, w2.status, w2.opcode, w2.byte_len) == (2, S.SUCCESS, WCOpcode.RDMA_READ, 4)
    assert bytes(bb[10:15]) == b"write" and bytes(ba[2000:2004]) == b"read"
    expect_quiet(p.cq_b, 0.05)  # one-sided: nothing at the target


def test_same_buffer_reposted_with_other_fields(ctx: Context, res: Resources) -> None:
    """One-WR posts of the same SGE (the verbs provider re-uses its pyverbs WR for
    them) keep every other field of each WR: wr_id, opcode, flags, immediate data,
    remote address and key."""
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 4096)
    mb, bb = p.mr("b", 4096)
    ba[:8] = b"abcdefgh"
    src = sge(ma, 0, 8)
    for i in range(3):
        p.b.post_recv([RecvWR(100 + i, [sge(mb, 0, 64)])])
        p.a.post_send([send(10 + i, [src])])
        (wa,) = poll_n(p.cq_a, 1)
        (wb,) = poll_n(p.cq_b, 1)
        assert (wa.wr_id, wa.opcode, wa.status) == (10 + i, WCOpcode.SEND, S.SUCCESS)
        assert (wb.wr_id, wb.byte_len, wb.status) == (100 + i, 8, S.SUCCESS)
        assert not wb.wc_flags & WCFlags.WITH_IMM
    p.b.post_recv([RecvWR(200, [sge(mb, 0, 64)])])
    p.a.post_send([send(20, [src], WROpcode.SEND_WITH_IMM, imm_data=0x01020304)])
    (wa,) = poll_n(p.cq_a, 1)
    (wb,) = poll_n(p.cq_b, 1)
    assert wa.wr_id == 20 and wb.wr_id == 200 and wb.imm_data == 0x01020304
    for i, off in enumerate((512, 1024)):
        p.a.post_send([send(30 + i, [src], WROpcode.RDMA_WRITE, remote_addr=mb.addr + off,
                            rkey=mb.rkey)])
        (wa,) = poll_n(p.cq_a, 1)
        assert (wa.wr_id, wa.opcode, wa.status) == (30 + i, WCOpcode.RDMA_WRITE, S.SUCCESS)
        assert bytes(bb[off:off + 8]) == b"abcdefgh"
    p.b.post_recv([RecvWR(300, [sge(mb, 0, 64)])])
    p.b.post_recv([RecvWR(301, [sge(mb, 0, 64)])])
    p.a.post_send([send(40, [src], WROpcode.SEND, SendFlags(0))])  # unsignaled
    p.a.post_send([send(41, [src])])
    assert [w.wr_id for w in poll_n(p.cq_a, 1)] == [41]
    assert [w.wr_id for w in poll_n(p.cq_b, 2)] == [300, 301]
    expect_quiet(p.cq_a, 0.05)


def test_write_read_64mib(ctx: Context, res: Resources) -> None:
    size = 64 << 20
    p = Pair(ctx, res)
    ma, ba = p.mr("a", size)
    mb, bb = p.mr("b", size)
    pattern = bytes(range(256)) * 4096
    for off in range(0, size, len(pattern)):
        ba[off:off + len(pattern)] = pattern
    ba[-7:] = b"the end"
    p.a.post_send([send(1, [sge(ma)], WROpcode.RDMA_WRITE, remote_addr=mb.addr, rkey=mb.rkey)])
    assert statuses(poll_n(p.cq_a, 1, 30)) == [S.SUCCESS]
    assert bb == ba
    ba[:] = bytes(size)
    bb[:5] = b"start"
    p.a.post_send([send(2, [sge(ma)], WROpcode.RDMA_READ, remote_addr=mb.addr, rkey=mb.rkey)])
    (wc,) = poll_n(p.cq_a, 1, 30)
    assert wc.status == S.SUCCESS and wc.byte_len == size
    assert ba == bb


def test_write_with_imm(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 64)
    mb, bb = p.mr("b", 64)
    ba[:6] = b"imm-wr"
    p.b.post_recv([RecvWR(5, [])])
    p.a.post_send([send(1, [sge(ma, 0, 6)], WROpcode.RDMA_WRITE_WITH_IMM,
                        remote_addr=mb.addr + 8, rkey=mb.rkey, imm_data=0x01020304)])
    (wa,) = poll_n(p.cq_a, 1)
    assert (wa.status, wa.opcode) == (S.SUCCESS, WCOpcode.RDMA_WRITE)
    (wb,) = poll_n(p.cq_b, 1)
    assert (wb.wr_id, wb.status, wb.opcode, wb.byte_len) == (
        5, S.SUCCESS, WCOpcode.RECV_RDMA_WITH_IMM, 6)
    assert wb.wc_flags & WCFlags.WITH_IMM and wb.imm_data == 0x01020304
    assert bytes(bb[8:14]) == b"imm-wr"


def test_inline_send_copies_at_post(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    if p.a.cap.max_inline_data < 16:
        pytest.skip("no inline support")
    mb, bb = p.mr("b", 64)
    raw = (ctypes.c_char * 16).from_buffer(bytearray(b"inline-payload!!"))
    p.b.post_recv([RecvWR(1, [sge(mb)])])
    p.a.post_send([send(2, [SGE(ctypes.addressof(raw), 16, 0)],
                        flags=SendFlags.SIGNALED | SendFlags.INLINE)])
    ctypes.memset(ctypes.addressof(raw), ord("x"), 16)  # reuse at once
    assert statuses(poll_n(p.cq_a, 1)) == [S.SUCCESS]
    (wb,) = poll_n(p.cq_b, 1)
    assert wb.byte_len == 16 and bytes(bb[:16]) == b"inline-payload!!"


def test_completion_order_per_qp(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 1 << 20)
    mb, _ = p.mr("b", 1 << 20)
    p.b.post_recv([RecvWR(i, [sge(mb, 0, 4096)]) for i in range(3)])
    ops = [
        send(0, [sge(ma, 0, 100)]),
        send(1, [sge(ma, 4096, 1 << 19)], WROpcode.RDMA_READ, remote_addr=mb.addr, rkey=mb.rkey),
        send(2, [sge(ma, 0, 1 << 19)], WROpcode.RDMA_WRITE, remote_addr=mb.addr, rkey=mb.rkey),
        send(3, [sge(ma, 0, 10)]),
        send(4, [sge(ma, 8, 8)], WROpcode.ATOMIC_FETCH_AND_ADD, remote_addr=mb.addr,
             rkey=mb.rkey, compare_add=1),
        send(5, [sge(ma, 0, 1)]),
    ]
    p.a.post_send(ops)
    wcs = poll_n(p.cq_a, 6)
    assert [w.wr_id for w in wcs] == list(range(6)) and statuses(wcs) == [S.SUCCESS] * 6
    assert [w.wr_id for w in poll_n(p.cq_b, 3)] == [0, 1, 2]


def test_unsignaled_sends(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    w = [send(i, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, flags=0, remote_addr=mb.addr,
              rkey=mb.rkey) for i in range(3)]
    w.append(send(3, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, remote_addr=mb.addr, rkey=mb.rkey))
    p.a.post_send(w)
    (wc,) = poll_n(p.cq_a, 1)
    assert wc.wr_id == 3  # only the signaled one
    expect_quiet(p.cq_a, 0.05)
    # its poll released all four slots
    p.a.post_send([send(10 + i, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                        rkey=mb.rkey) for i in range(4)])
    assert [x.wr_id for x in poll_n(p.cq_a, 4)] == [10, 11, 12, 13]


def test_unsignaled_slots_freed_only_when_polled(ctx: Context, res: Resources,
                                                 provider_name: str) -> None:
    if provider_name != "soft":
        pytest.skip("when hardware frees send-queue slots differs (mlx5: on poll; rxe: earlier)")
    p = Pair(ctx, res, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)

    def wr(i: int, flags: int = SendFlags.SIGNALED) -> SendWR:
        return send(i, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, flags=flags, remote_addr=mb.addr,
                    rkey=mb.rkey)

    p.a.post_send([wr(0, 0), wr(1, 0), wr(2, 0), wr(3)])
    time.sleep(0.2)  # all four done on the wire, nothing polled yet
    with pytest.raises(PostError) as ei:
        p.a.post_send([wr(4)])
    assert ei.value.errno == errno.ENOMEM
    assert [x.wr_id for x in poll_n(p.cq_a, 1)] == [3]
    p.a.post_send([wr(5), wr(6), wr(7), wr(8)])
    assert [x.wr_id for x in poll_n(p.cq_a, 4)] == [5, 6, 7, 8]


# --------------------------------------------------------------------------------------
# atomics
# --------------------------------------------------------------------------------------
def test_atomics(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, ba = p.mr("a", 64)
    mb, bb = p.mr("b", 64)
    bb[8:16] = (0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    p.a.post_send([send(1, [sge(ma, 0, 8)], WROpcode.ATOMIC_FETCH_AND_ADD,
                        remote_addr=mb.addr + 8, rkey=mb.rkey, compare_add=2)])
    (wc,) = poll_n(p.cq_a, 1)
    assert (wc.status, wc.opcode) == (S.SUCCESS, WCOpcode.FETCH_ADD)
    assert int.from_bytes(ba[0:8], "little") == 0xFFFFFFFFFFFFFFFF
    assert int.from_bytes(bb[8:16], "little") == 1  # wrapped modulo 2**64
    # compare-and-swap: failing compare leaves memory, returns old value
    p.a.post_send([send(2, [sge(ma, 16, 8)], WROpcode.ATOMIC_CMP_AND_SWP,
                        remote_addr=mb.addr + 8, rkey=mb.rkey, compare_add=5, swap=77)])
    (wc,) = poll_n(p.cq_a, 1)
    assert (wc.status, wc.opcode) == (S.SUCCESS, WCOpcode.COMP_SWAP)
    assert int.from_bytes(ba[16:24], "little") == 1 and int.from_bytes(bb[8:16], "little") == 1
    p.a.post_send([send(3, [sge(ma, 24, 8)], WROpcode.ATOMIC_CMP_AND_SWP,
                        remote_addr=mb.addr + 8, rkey=mb.rkey, compare_add=1, swap=77)])
    poll_n(p.cq_a, 1)
    assert int.from_bytes(ba[24:32], "little") == 1 and int.from_bytes(bb[8:16], "little") == 77


def test_atomic_contention_two_qps(ctx: Context, res: Resources) -> None:
    n = 500
    p1 = Pair(ctx, res, cqe=2 * n, cap=QPCap(max_send_wr=n, max_recv_wr=4))
    p2 = Pair(ctx, res, cqe=2 * n, cap=QPCap(max_send_wr=n, max_recv_wr=4))
    counter = bytearray(8)
    target = res.add(p1.pd_b.reg_mr(counter, ACC_ALL))
    target2 = res.add(p2.pd_b.reg_mr(counter, ACC_ALL))  # same memory, second PD
    olds = []
    for p, t in ((p1, target), (p2, target2)):
        m, buf = p.mr("a", 8 * n)
        olds.append(buf)
        p.a.post_send([send(i, [sge(m, 8 * i, 8)], WROpcode.ATOMIC_FETCH_AND_ADD,
                            remote_addr=t.addr, rkey=t.rkey, compare_add=1) for i in range(n)])
    for p in (p1, p2):
        assert statuses(poll_n(p.cq_a, n)) == [S.SUCCESS] * n
    assert int.from_bytes(counter, "little") == 2 * n
    seen = sorted(int.from_bytes(b[8 * i:8 * i + 8], "little") for b in olds for i in range(n))
    assert seen == list(range(2 * n))  # every fetch saw a distinct value: truly atomic


def test_atomic_misaligned(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    with pytest.raises(PostError) as ei:  # refused before posting, as rdma-core does
        p.a.post_send([send(1, [sge(ma, 0, 8)], WROpcode.ATOMIC_FETCH_AND_ADD,
                            remote_addr=mb.addr + 4, rkey=mb.rkey, compare_add=1)])
    assert isinstance(ei.value, ValueError)
    assert p.a.state == QPState.RTS  # nothing was posted; the QP is unharmed


# --------------------------------------------------------------------------------------
# protection
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["bad_lkey", "outside_mr", "other_pd", "read_into_readonly_mr"])
def test_local_protection_error(ctx: Context, res: Resources, case: str,
                                provider_name: str) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 4096)
    mb, _ = p.mr("b", 4096)
    p.b.post_recv([RecvWR(i, [sge(mb)]) for i in range(3)])
    op = WROpcode.SEND
    if case == "bad_lkey":
        bad = SGE(ma.addr, 16, ma.lkey ^ 0x5A5A00)
    elif case == "outside_mr":
        bad = SGE(ma.addr + 4090, 16, ma.lkey)
    elif case == "other_pd":
        mo = res.add(p.pd_b.reg_mr(bytearray(64), ACC_ALL))
        bad = sge(mo, 0, 16)
    else:
        mro = res.add(p.pd_a.reg_mr(bytearray(64), Access.REMOTE_READ))
        bad = sge(mro, 0, 16)
        op = WROpcode.RDMA_READ
    p.a.post_send([
        send(1, [sge(ma, 0, 16)]),
        send(2, [bad], op, remote_addr=mb.addr, rkey=mb.rkey),
        send(3, [sge(ma, 0, 16)]),
    ])
    wcs = poll_n(p.cq_a, 3)
    assert [w.wr_id for w in wcs] == [1, 2, 3]
    if provider_name == "soft" or case == "read_into_readonly_mr":
        assert statuses(wcs) == [S.SUCCESS, S.LOC_PROT_ERR, S.WR_FLUSH_ERR]
    else:
        # rxe: kernel 6.1 reports LOC_QP_OP_ERR for a bad SEND SGE; 7.2 loses the error
        # and flushes the faulty WR (and even the delivered one before it)
        assert wcs[0].status in (S.SUCCESS, S.WR_FLUSH_ERR)
        assert wcs[1].status in (S.LOC_PROT_ERR, S.LOC_QP_OP_ERR, S.WR_FLUSH_ERR)
        assert wcs[2].status == S.WR_FLUSH_ERR
    assert p.a.state == QPState.ERR


REMOTE_CASES = ["bad_rkey", "outside_mr", "no_remote_write", "no_remote_read",
                "no_remote_atomic", "qp_access_flags", "mr_of_other_pd", "revoked_mr"]


def remote_case(ctx: Context, res: Resources, case: str
                ) -> tuple[Pair, MR, MR, WROpcode, int, int, int]:
    """The set-up of a ``REMOTE_CASES`` case (tests/rxe/verbs_statuses.py runs them too):
    a pair (for ``qp_access_flags``, a responder QP without remote write), a 4 KiB MR on
    each side, and the request's opcode, length, remote address and rkey."""
    access_b = ACC_ALL
    if case == "qp_access_flags":
        access_b = Access.LOCAL_WRITE | Access.REMOTE_READ
    p = Pair(ctx, res, access_b=access_b)
    ma, _ = p.mr("a", 4096)
    mb, _ = p.mr("b", 4096)
    op, length, raddr, rkey = WROpcode.RDMA_WRITE, 16, mb.addr, mb.rkey
    if case == "bad_rkey":
        rkey = mb.rkey ^ 0x777700
    elif case == "outside_mr":
        raddr = mb.addr + 4090
    elif case == "no_remote_write":
        m, _ = p.mr("b", 64, Access.LOCAL_WRITE | Access.REMOTE_READ)
        raddr, rkey = m.addr, m.rkey
    elif case == "no_remote_read":
        m, _ = p.mr("b", 64, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        raddr, rkey, op = m.addr, m.rkey, WROpcode.RDMA_READ
    elif case == "no_remote_atomic":
        m, _ = p.mr("b", 64, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
        raddr, rkey, op, length = m.addr, m.rkey, WROpcode.ATOMIC_FETCH_AND_ADD, 8
    elif case == "mr_of_other_pd":
        m, _ = p.mr("a", 64)  # registered in the requester's PD, not the responder QP's
        raddr, rkey = m.addr, m.rkey
    elif case == "revoked_mr":
        m, _ = p.mr("b", 64)
        raddr, rkey = m.addr, m.rkey
        m.close()
    return p, ma, mb, op, length, raddr, rkey


@pytest.mark.parametrize("case", REMOTE_CASES)
def test_remote_access_error(ctx: Context, res: Resources, case: str) -> None:
    p, ma, mb, op, length, raddr, rkey = remote_case(ctx, res, case)
    p.b.post_recv([RecvWR(9, [sge(mb)])])
    p.a.post_send([send(1, [sge(ma, 0, length)], op, remote_addr=raddr, rkey=rkey,
                        compare_add=1),
                   send(2, [sge(ma, 0, 16)])])
    wcs = poll_n(p.cq_a, 2)
    # a QP without the remote right makes it an invalid request (as rxe reports it)
    first = S.REM_INV_REQ_ERR if case == "qp_access_flags" else S.REM_ACCESS_ERR
    assert statuses(wcs) == [first, S.WR_FLUSH_ERR]
    assert wcs[0].wr_id == 1
    wait_state(p.a, QPState.ERR)
    wait_state(p.b, QPState.ERR)  # the responder QP fails too
    (wb,) = poll_n(p.cq_b, 1)
    assert (wb.wr_id, wb.status) == (9, S.WR_FLUSH_ERR)


def test_responder_async_event(ctx: Context, res: Resources, provider_name: str) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    ctx.get_async_events()
    p.a.post_send([send(1, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, remote_addr=0x1000,
                        rkey=0x12345678)])
    assert statuses(poll_n(p.cq_a, 1)) == [S.REM_ACCESS_ERR]
    wait_state(p.b, QPState.ERR)
    if provider_name != "soft":
        return  # rxe reports it on kernel 7.2 but not on 6.1
    assert readable(ctx.async_fd, WAIT_S)
    evs = ctx.get_async_events()
    assert [(e.event_type, e.qp_num) for e in evs] == [(EventType.QP_ACCESS_ERR, p.b.qp_num)]
    assert not readable(ctx.async_fd) and ctx.get_async_events() == []


def test_recv_buffer_too_small(ctx: Context, res: Resources, provider_name: str) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.b.post_recv([RecvWR(1, [sge(mb, 0, 8)]), RecvWR(2, [sge(mb)])])
    p.a.post_send([send(3, [sge(ma, 0, 16)]), send(4, [sge(ma, 0, 4)])])
    wa = poll_n(p.cq_a, 2)
    assert statuses(wa) == [S.REM_OP_ERR, S.WR_FLUSH_ERR]  # what rxe reports
    wb = poll_n(p.cq_b, 2)
    # the receiver: LOC_LEN_ERR on hardware and soft; rxe says LOC_QP_OP_ERR
    allowed = {S.LOC_LEN_ERR} if provider_name == "soft" else {S.LOC_LEN_ERR, S.LOC_QP_OP_ERR}
    assert wb[0].wr_id == 1 and wb[0].status in allowed
    assert (wb[1].wr_id, wb[1].status) == (2, S.WR_FLUSH_ERR)
    wait_state(p.a, QPState.ERR)
    wait_state(p.b, QPState.ERR)


# --------------------------------------------------------------------------------------
# memory registration, PD
# --------------------------------------------------------------------------------------
def test_reg_mr(ctx: Context, res: Resources) -> None:
    pd = res.add(ctx.alloc_pd())
    buf = bytearray(4096)
    mr = res.add(pd.reg_mr(buf, ACC_ALL))
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    assert mr.addr == addr and mr.length == 4096 and 0 < mr.lkey < 2**32 and 0 < mr.rkey < 2**32
    mr.view[:3] = b"abc"
    assert bytes(buf[:3]) == b"abc"
    for bad in (Access.REMOTE_WRITE, Access.REMOTE_ATOMIC, Access.REMOTE_READ | Access.REMOTE_WRITE):
        with pytest.raises(RegistrationError):
            pd.reg_mr(bytearray(64), bad)
    with pytest.raises(TypeError):
        pd.reg_mr(b"read-only bytes", Access.LOCAL_WRITE)
    ro = res.add(pd.reg_mr(bytearray(64), Access.REMOTE_READ))  # no LOCAL_WRITE needed
    assert ro.access == Access.REMOTE_READ


def test_rkey_changes_on_reregistration(ctx: Context, res: Resources) -> None:
    pd = res.add(ctx.alloc_pd())
    buf = bytearray(64)
    seen = set()
    for _ in range(4):
        mr = pd.reg_mr(buf, ACC_ALL)
        assert mr.rkey not in seen
        seen.add(mr.rkey)
        mr.close()
        mr.close()  # idempotent


def test_pd_close_busy(ctx: Context, res: Resources) -> None:
    pd = ctx.alloc_pd()
    cq = res.add(ctx.create_cq(8))
    mr = pd.reg_mr(bytearray(64))
    with pytest.raises(RDMAError) as ei:
        pd.close()
    assert ei.value.errno == errno.EBUSY
    mr.close()
    qp = pd.create_qp(cq, cq, QPCap())
    with pytest.raises(RDMAError) as ei:
        pd.close()
    assert ei.value.errno == errno.EBUSY
    with pytest.raises(RDMAError):
        cq.close()  # the QP still uses it
    qp.close()
    qp.close()
    pd.close()
    pd.close()


# --------------------------------------------------------------------------------------
# QP state machine and posting rules
# --------------------------------------------------------------------------------------
def test_post_in_wrong_state(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, connect=False)
    ma, _ = p.mr("a", 64)
    wr = send(1, [sge(ma, 0, 8)])
    rwr = RecvWR(2, [sge(ma, 0, 8)])
    with pytest.raises(PostError) as ei:
        p.a.post_recv([rwr])
    assert ei.value.errno == errno.EINVAL
    for stop in (QPState.RESET, QPState.INIT, QPState.RTR):
        if stop != QPState.RESET:
            bring_up(ctx, p.a, p.b.qp_num, stop_at=stop)
        assert p.a.state == stop
        with pytest.raises(PostError) as ei:
            p.a.post_send([wr])
        assert ei.value.errno == errno.EINVAL
        if stop != QPState.RESET:
            p.a.post_recv([rwr])  # fine from INIT on
        p.a.modify(QPAttr(QPState.RESET))
    expect_quiet(p.cq_a, 0.05)


def test_post_in_err_completes_with_flush(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    p.a.modify(QPAttr(QPState.ERR))
    assert p.a.state == QPState.ERR
    p.a.post_send([send(1, [sge(ma, 0, 8)]), send(2, [sge(ma, 0, 8)], flags=0)])
    p.a.post_recv([RecvWR(3, [sge(ma)])])
    wcs = poll_n(p.cq_a, 3)
    assert sorted((w.wr_id, w.status) for w in wcs) == [
        (1, S.WR_FLUSH_ERR), (2, S.WR_FLUSH_ERR), (3, S.WR_FLUSH_ERR)]


def test_modify_transitions(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, connect=False, cap=QPCap(max_send_wr=4, max_recv_wr=4))
    gid, lid, gi = local_addr(ctx)
    rtr = QPAttr(QPState.RTR, dest_qp_num=p.b.qp_num, rq_psn=PSN,
                 ah_attr=AHAttr(dgid=gid, dlid=lid, sgid_index=gi))
    rts = QPAttr(QPState.RTS, sq_psn=PSN)
    for attr in (rtr, rts):  # RESET -> RTR / RTS
        with pytest.raises(RDMAError) as ei:
            p.a.modify(attr)
        assert ei.value.errno == errno.EINVAL
    p.a.modify(QPAttr(QPState.INIT, qp_access_flags=ACC_ALL))
    with pytest.raises(RDMAError):
        p.a.modify(rts)  # INIT -> RTS
    p.a.modify(rtr)
    with pytest.raises(RDMAError):
        p.a.modify(QPAttr(QPState.INIT, qp_access_flags=ACC_ALL))  # RTR -> INIT
    p.a.modify(rts)
    with pytest.raises(RDMAError):
        p.a.modify(rtr)  # RTS -> RTR
    p.a.modify(QPAttr(QPState.ERR))
    with pytest.raises(RDMAError):
        p.a.modify(rts)  # ERR -> RTS
    assert p.a.state == QPState.ERR
    # RESET clears both queues: a full receive queue is empty again afterwards
    p.a.modify(QPAttr(QPState.RESET))
    p.a.modify(QPAttr(QPState.INIT, qp_access_flags=ACC_ALL))
    ma, _ = p.mr("a", 64)
    p.a.post_recv([RecvWR(i, [sge(ma)]) for i in range(p.a.cap.max_recv_wr)])
    p.a.modify(QPAttr(QPState.RESET))
    p.a.modify(QPAttr(QPState.INIT, qp_access_flags=ACC_ALL))
    p.a.post_recv([RecvWR(i, [sge(ma)]) for i in range(p.a.cap.max_recv_wr)])
    expect_quiet(p.cq_a, 0.05)


def test_too_many_sges_is_valueerror(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, cap=QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1))
    ma, _ = p.mr("a", 64)
    sges = [sge(ma, 0, 8), sge(ma, 8, 8)]
    with pytest.raises(ValueError):
        p.a.post_send([send(1, sges)])
    with pytest.raises(ValueError):
        p.a.post_recv([RecvWR(1, sges)])
    expect_quiet(p.cq_a, 0.05)


def test_malformed_wrs_are_the_one_invalidworkrequest_of_the_verbs_layer(
        ctx: Context, res: Resources) -> None:
    """Every provider refuses malformed WRs through the shared verbs-contract checks:
    the same type (aiordma.verbs.InvalidWorkRequest, EINVAL) and the same message."""
    from aiordma.verbs import InvalidWorkRequest

    p = Pair(ctx, res, cap=QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=2, max_recv_sge=2))
    ma, _ = p.mr("a", 64)
    bad_sends = [
        (send(1, [sge(ma, 0, 8)] * 3), "3 SGEs, the QP allows max_send_sge="),
        (SendWR(1, WROpcode.ATOMIC_FETCH_AND_ADD, [sge(ma, 0, 4)]), "exactly one 8-byte SGE"),
        (SendWR(1, WROpcode.ATOMIC_FETCH_AND_ADD, [sge(ma, 0, 8)], remote_addr=0x1004),
         "0x1004 is not 8-byte aligned"),
        (SendWR(1, WROpcode.RDMA_READ, [sge(ma, 0, 8)], send_flags=SendFlags.INLINE),
         "INLINE is only valid"),
        (SendWR(1, 99, [sge(ma, 0, 8)]), "unknown send opcode 99"),  # type: ignore[arg-type]
    ]
    for wr, match in bad_sends:
        with pytest.raises(InvalidWorkRequest, match=match) as ei:
            p.a.post_send([wr])
        assert ei.value.errno == errno.EINVAL
    with pytest.raises(InvalidWorkRequest, match="negative SGE length"):
        p.a.post_recv([RecvWR(1, [SGE(ma.addr, -1, ma.lkey)])])
    with pytest.raises(InvalidWorkRequest, match="3 SGEs, the QP allows max_recv_sge="):
        p.a.post_recv([RecvWR(1, [sge(ma, 0, 8)] * 3)])
    expect_quiet(p.cq_a, 0.05)


def test_send_queue_full(ctx: Context, res: Resources) -> None:
    # no receive posted at b and rnr_retry=7: sends stay outstanding until b posts
    p = Pair(ctx, res, cap=QPCap(max_send_wr=4, max_recv_wr=8))
    depth = p.a.cap.max_send_wr
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    with pytest.raises(PostError) as ei:
        p.a.post_send([send(i, [sge(ma, 0, 1)]) for i in range(depth + 1)])
    assert ei.value.errno == errno.ENOMEM
    p.a.post_send([send(i, [sge(ma, 0, 1)]) for i in range(depth - 1)])
    with pytest.raises(PostError) as ei:  # whole chain refused
        p.a.post_send([send(100, [sge(ma, 0, 1)]), send(101, [sge(ma, 0, 1)])])
    assert ei.value.errno == errno.ENOMEM
    p.a.post_send([send(depth - 1, [sge(ma, 0, 1)])])
    with pytest.raises(PostError):
        p.a.post_send([send(102, [sge(ma, 0, 1)])])
    p.b.post_recv([RecvWR(i, [sge(mb)]) for i in range(depth)])
    assert [w.wr_id for w in poll_n(p.cq_a, depth)] == list(range(depth))
    assert [w.wr_id for w in poll_n(p.cq_b, depth)] == list(range(depth))
    expect_quiet(p.cq_a, 0.05)  # nothing of the refused chains was posted


def test_recv_queue_full(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, cap=QPCap(max_send_wr=8, max_recv_wr=4))
    depth = p.b.cap.max_recv_wr
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.b.post_recv([RecvWR(i, [sge(mb)]) for i in range(depth - 1)])
    with pytest.raises(PostError) as ei:
        p.b.post_recv([RecvWR(100, [sge(mb)]), RecvWR(101, [sge(mb)])])
    assert ei.value.errno == errno.ENOMEM
    p.b.post_recv([RecvWR(depth - 1, [sge(mb)])])
    with pytest.raises(PostError):
        p.b.post_recv([RecvWR(102, [sge(mb)])])
    p.a.post_send([send(i, [sge(ma, 0, 1)]) for i in range(depth)])
    assert [w.wr_id for w in poll_n(p.cq_b, depth)] == list(range(depth))
    poll_n(p.cq_a, depth)


def test_modify_to_err_flushes_in_order(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.b.post_recv([RecvWR(50, [sge(mb)])])
    p.a.post_recv([RecvWR(20 + i, [sge(ma)]) for i in range(3)])
    # the first SEND completes; the next ones stay in RNR retry (no receive left at b)
    p.a.post_send([send(i, [sge(ma, 0, 4)]) for i in range(4)])
    (first,) = poll_n(p.cq_a, 1)
    assert (first.wr_id, first.status) == (0, S.SUCCESS)
    time.sleep(0.05)
    p.a.modify(QPAttr(QPState.ERR))
    wcs = poll_n(p.cq_a, 6)
    sq = [(w.wr_id, w.status) for w in wcs if w.wr_id < 20]
    rq = [(w.wr_id, w.status) for w in wcs if w.wr_id >= 20]
    assert sq == [(1, S.WR_FLUSH_ERR), (2, S.WR_FLUSH_ERR), (3, S.WR_FLUSH_ERR)]
    assert rq == [(20, S.WR_FLUSH_ERR), (21, S.WR_FLUSH_ERR), (22, S.WR_FLUSH_ERR)]
    expect_quiet(p.cq_a, 0.05)


def test_peer_not_ready_yet(ctx: Context, res: Resources) -> None:
    """A request that reaches a QP still in INIT is served once it reaches RTR."""
    p = Pair(ctx, res, connect=False)
    ma, ba = p.mr("a", 64)
    mb, bb = p.mr("b", 64)
    bring_up(ctx, p.a, p.b.qp_num)
    bring_up(ctx, p.b, p.a.qp_num, stop_at=QPState.INIT)
    p.b.post_recv([RecvWR(1, [sge(mb)])])
    ba[:4] = b"late"
    p.a.post_send([send(2, [sge(ma, 0, 4)])])
    time.sleep(0.05)
    gid, lid, gi = local_addr(ctx)
    p.b.modify(QPAttr(QPState.RTR, dest_qp_num=p.a.qp_num, rq_psn=PSN, min_rnr_timer=1,
                      max_dest_rd_atomic=16, ah_attr=AHAttr(dgid=gid, dlid=lid, sgid_index=gi)))
    assert statuses(poll_n(p.cq_a, 1)) == [S.SUCCESS]
    (wb,) = poll_n(p.cq_b, 1)
    assert wb.status == S.SUCCESS and bytes(bb[:4]) == b"late"


# --------------------------------------------------------------------------------------
# RNR
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [WROpcode.SEND, WROpcode.RDMA_WRITE_WITH_IMM])
def test_rnr_retry_exceeded(ctx: Context, res: Resources, op: WROpcode) -> None:
    p = Pair(ctx, res, rnr_retry=2, min_rnr_timer=1)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    t0 = time.monotonic()
    p.a.post_send([send(1, [sge(ma, 0, 8)], op, remote_addr=mb.addr, rkey=mb.rkey),
                   send(2, [sge(ma, 0, 8)])])
    wcs = poll_n(p.cq_a, 2)
    assert statuses(wcs) == [S.RNR_RETRY_EXC_ERR, S.WR_FLUSH_ERR]
    assert time.monotonic() - t0 < 5
    wait_state(p.a, QPState.ERR)


def test_rnr_go_back_n_recovers(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, rnr_retry=7, min_rnr_timer=1)
    ma, ba = p.mr("a", 64)
    mb, bb = p.mr("b", 64)
    ba[:6] = b"ABCDEF"
    p.a.post_send([
        send(0, [sge(ma, 0, 2)]),
        send(1, [sge(ma, 4, 2)], WROpcode.RDMA_WRITE, remote_addr=mb.addr + 40, rkey=mb.rkey),
        send(2, [sge(ma, 2, 2)]),
        send(3, [sge(ma, 4, 2)]),
    ])
    time.sleep(0.1)
    expect_quiet(p.cq_a, 0.05)
    p.b.post_recv([RecvWR(10 + i, [sge(mb, 8 * i, 8)]) for i in range(3)])
    assert [(w.wr_id, w.status) for w in poll_n(p.cq_a, 4)] == [(i, S.SUCCESS) for i in range(4)]
    wb = poll_n(p.cq_b, 3)
    assert [(w.wr_id, w.byte_len) for w in wb] == [(10, 2), (11, 2), (12, 2)]
    assert bytes(bb[0:2]) == b"AB" and bytes(bb[8:10]) == b"CD" and bytes(bb[16:18]) == b"EF"
    assert bytes(bb[40:42]) == b"EF"
    expect_quiet(p.cq_b, 0.05)  # nothing delivered twice


# --------------------------------------------------------------------------------------
# peer failure
# --------------------------------------------------------------------------------------
def test_peer_in_err_fails_outstanding_send(ctx: Context, res: Resources,
                                            provider_name: str) -> None:
    p = Pair(ctx, res, timeout=12, retry_cnt=3)
    ma, _ = p.mr("a", 64)
    p.a.post_send([send(1, [sge(ma, 0, 8)])])  # RNR-retried forever: nothing posted at b
    time.sleep(0.05)
    t0 = time.monotonic()
    p.b.modify(QPAttr(QPState.ERR))
    (wc,) = poll_n(p.cq_a, 1)
    assert wc.status == S.RETRY_EXC_ERR
    # soft: the peer closing its connection is noticed at once, not by the ACK timeout
    assert time.monotonic() - t0 < (0.5 if provider_name == "soft" else WAIT_S)
    wait_state(p.a, QPState.ERR)


def test_send_to_peer_in_err(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, timeout=12, retry_cnt=3)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.b.modify(QPAttr(QPState.ERR))
    time.sleep(0.05)
    p.a.post_send([send(1, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                        rkey=mb.rkey), send(2, [sge(ma, 0, 8)])])
    assert statuses(poll_n(p.cq_a, 2)) == [S.RETRY_EXC_ERR, S.WR_FLUSH_ERR]


# --------------------------------------------------------------------------------------
# CQ overrun
# --------------------------------------------------------------------------------------
def test_cq_overrun(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res, cqe=4, cap=QPCap(max_send_wr=128, max_recv_wr=4))
    n = p.cq_a.cqe + 2
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    ctx.get_async_events()
    p.a.post_send([send(i, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                        rkey=mb.rkey) for i in range(n)])
    deadline = time.monotonic() + WAIT_S
    events: list[AsyncEvent] = []
    while not any(e.event_type == EventType.CQ_ERR for e in events):
        assert time.monotonic() < deadline, "no CQ_ERR async event"
        readable(ctx.async_fd, 0.1)
        events += ctx.get_async_events()
    ev = next(e for e in events if e.event_type == EventType.CQ_ERR)
    assert ev.cq is p.cq_a
    for _ in range(2):
        with pytest.raises(CQOverrunError):
            p.cq_a.poll(16)
    wait_state(p.a, QPState.ERR)


# --------------------------------------------------------------------------------------
# completion channel
# --------------------------------------------------------------------------------------
def test_channel_event_only_after_arming(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    assert p.ch is not None
    ch = p.ch
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)

    def write(i: int) -> None:
        p.a.post_send([send(i, [sge(ma, 0, 8)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                            rkey=mb.rkey)])

    # verbs: the CQ's C struct was found at creation and is polled through ctypes;
    # the channel event names the same struct
    probed = getattr(p.cq_a, "_cq_ptr", None)
    if ctx.provider == "verbs" and os.environ.get("AIORDMA_VERBS_POLL") != "pyverbs":
        assert probed and getattr(p.cq_a, "_poller", None) is not None
    write(1)
    poll_n(p.cq_a, 1)
    time.sleep(0.05)
    assert not readable(ch.fd) and res.get_event(ch) is None  # not armed: no event
    p.cq_a.req_notify()
    assert not readable(ch.fd, 0.05)  # armed, but no new completion yet
    write(2)
    assert readable(ch.fd, WAIT_S)
    assert res.get_event(ch) is p.cq_a
    assert getattr(p.cq_a, "_cq_ptr", None) == probed
    assert not readable(ch.fd) and res.get_event(ch) is None
    poll_n(p.cq_a, 1)
    write(3)  # one-shot: not re-armed, so no event
    poll_n(p.cq_a, 1)
    time.sleep(0.05)
    assert not readable(ch.fd) and res.get_event(ch) is None
    # an event needs a completion *after* arming: one queued before arming does not count
    write(4)
    time.sleep(0.1)
    p.cq_a.req_notify()
    time.sleep(0.05)
    assert not readable(ch.fd)
    poll_n(p.cq_a, 1)
    # fd is non-blocking
    with pytest.raises(BlockingIOError):
        os.read(ch.fd, 1)
    res.ack(p.cq_a)


def test_channel_ack_before_close(ctx: Context) -> None:
    ch = ctx.create_comp_channel()
    cq = ctx.create_cq(16, ch)
    pd = ctx.alloc_pd()
    qp = pd.create_qp(cq, cq, QPCap(max_send_wr=4, max_recv_wr=4))
    try:
        with pytest.raises(RDMAError) as ei:
            ch.close()  # a CQ uses it
        assert ei.value.errno == errno.EBUSY
        cq.req_notify()
        bring_up(ctx, qp, 1, stop_at=QPState.INIT)
        qp.modify(QPAttr(QPState.ERR))
        qp.post_recv([RecvWR(1, [])])  # flushed at once: a completion, hence an event
        assert readable(ch.fd, WAIT_S)
        assert ch.get_event() is cq
        poll_n(cq, 1)
        qp.close()
        with pytest.raises(RDMAError) as ei:
            cq.close()  # event not acknowledged
        assert ei.value.errno == errno.EBUSY
        cq.ack_events(1)
        cq.close()
        ch.close()
        ch.close()
    finally:
        qp.close()
        pd.close()


# --------------------------------------------------------------------------------------
# multi-process: asynchronous target progress, peer death
# --------------------------------------------------------------------------------------
class Child:
    def __init__(self, provider_name: str) -> None:
        env = dict(os.environ, AIORDMA_PROVIDER=provider_name)
        script = os.path.join(os.path.dirname(__file__), "verbs_peer.py")
        self.proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        self.info = self._line(CHILD_START_S)

    def _line(self, timeout: float = WAIT_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert r, "peer process did not answer"
        line = self.proc.stdout.readline()
        assert line, f"peer process exited ({self.proc.poll()})"
        info: dict[str, Any] = json.loads(line)
        return info

    def connect(self, ctx: Context, qp: QP, **attrs: Any) -> None:
        gid, lid, _ = local_addr(ctx)
        assert self.proc.stdin is not None
        key = os.urandom(16)  # soft: the secret both QPs prove (QPAttr.auth_key)
        self.proc.stdin.write(json.dumps({"qpn": qp.qp_num, "gid": gid.hex(), "lid": lid,
                                          "psn": PSN, "key": key.hex()}) + "\n")
        self.proc.stdin.flush()
        bring_up(ctx, qp, self.info["qpn"], peer_psn=self.info["psn"],
                 remote=(bytes.fromhex(self.info["gid"]), self.info["lid"]), auth_key=key,
                 **attrs)
        assert self._line() == {"ready": True}

    def stop(self) -> None:
        """SIGSTOP the peer and wait until all its threads are stopped (alive but silent)."""
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                states = []
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # no procfs: give the signal time to land
                time.sleep(0.2)
                return
            if states and all(s in "Tt" for s in states):
                return
            assert time.monotonic() < deadline, f"peer not stopped: {states}"
            time.sleep(0.005)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _child(provider_name: str) -> Iterator[Child]:
    c = Child(provider_name)
    yield c
    if c.proc.poll() is None:
        os.kill(c.proc.pid, signal.SIGCONT)
    c.kill()


@pytest.fixture
def child(provider_name: str) -> Iterator[Child]:
    yield from _child(provider_name)


@pytest.fixture
def soft_child(provider_name: str) -> Iterator[Child]:
    """``child`` for the tests of soft's ACK timer, skipped on other providers before
    the peer process starts (rxe's kernel keeps answering for a stopped process)."""
    if provider_name != "soft":
        pytest.skip("soft's ACK timer: rxe's kernel keeps answering for a stopped process")
    yield from _child(provider_name)


def _one_sided_roundtrip(p_cq: CQ, qp: QP, m: MR, buf: bytearray, info: dict[str, Any]) -> None:
    buf[:12] = b"from-parent!"
    qp.post_send([
        send(1, [sge(m, 0, 12)], WROpcode.RDMA_WRITE, remote_addr=info["addr"] + 100,
             rkey=info["rkey"]),
        send(2, [sge(m, 64, 12)], WROpcode.RDMA_READ, remote_addr=info["addr"] + 100,
             rkey=info["rkey"]),
        send(3, [sge(m, 128, 8)], WROpcode.ATOMIC_FETCH_AND_ADD, remote_addr=info["addr"],
             rkey=info["rkey"], compare_add=5),
        send(4, [sge(m, 136, 8)], WROpcode.ATOMIC_FETCH_AND_ADD, remote_addr=info["addr"],
             rkey=info["rkey"], compare_add=5),
    ])
    assert statuses(poll_n(p_cq, 4)) == [S.SUCCESS] * 4
    assert bytes(buf[64:76]) == b"from-parent!"
    assert int.from_bytes(buf[128:136], "little") == 0
    assert int.from_bytes(buf[136:144], "little") == 5


@pytest.mark.multiprocess
def test_multiprocess_one_sided_and_peer_killed(ctx: Context, res: Resources, child: Child,
                                                provider_name: str) -> None:
    pd = res.add(ctx.alloc_pd())
    cq = res.add(ctx.create_cq(64))
    qp = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
    buf = bytearray(4096)
    m = res.add(pd.reg_mr(buf, ACC_ALL))
    child.connect(ctx, qp, timeout=10, retry_cnt=2)  # rxe: RETRY_EXC within ~0.1 s
    _one_sided_roundtrip(cq, qp, m, buf, child.info)  # the child only sleeps meanwhile
    if provider_name == "soft":
        # freeze the peer so the next WRITE stays outstanding, then kill it
        child.stop()
    else:
        # rxe's kernel keeps answering for a stopped process: kill it first
        child.kill()
    qp.post_send([send(5, [sge(m, 0, 64)], WROpcode.RDMA_WRITE, remote_addr=child.info["addr"],
                       rkey=child.info["rkey"]),
                  send(6, [sge(m, 0, 64)], WROpcode.RDMA_WRITE, remote_addr=child.info["addr"],
                       rkey=child.info["rkey"])])
    t0 = time.monotonic()
    child.kill()
    wcs = poll_n(cq, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(5, S.RETRY_EXC_ERR), (6, S.WR_FLUSH_ERR)]
    # soft notices the closed connection at once (its ACK timer alone: 3 tries of 134 ms)
    assert time.monotonic() - t0 < (0.5 if provider_name == "soft" else 10)
    assert qp.state == QPState.ERR


def _soft_pair_with_a_child(ctx: Context, res: Resources, child: Child,
                            *, timeout: int, retry_cnt: int) -> tuple[CQ, QP, MR]:
    """A QP connected to the child's with this ACK ``timeout`` and ``retry_cnt``, proven
    by one READ/WRITE round trip; returns its CQ, the QP and a 4 KiB MR of ours."""
    pd = res.add(ctx.alloc_pd())
    cq = res.add(ctx.create_cq(64))
    qp = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
    buf = bytearray(4096)
    m = res.add(pd.reg_mr(buf, ACC_ALL))
    child.connect(ctx, qp, timeout=timeout, retry_cnt=retry_cnt)
    _one_sided_roundtrip(cq, qp, m, buf, child.info)
    return cq, qp, m


@pytest.mark.multiprocess
def test_multiprocess_silent_peer_ack_timeout(ctx: Context, res: Resources,
                                              soft_child: Child) -> None:
    child = soft_child
    cq, qp, m = _soft_pair_with_a_child(ctx, res, child, timeout=10,
                                        retry_cnt=2)  # 4.2 ms * 3 (soft: 134 ms a try)
    child.stop()  # alive (its sockets stay open) but silent
    t0 = time.monotonic()
    qp.post_send([send(7, [sge(m, 0, 64)], WROpcode.RDMA_READ, remote_addr=child.info["addr"],
                       rkey=child.info["rkey"])])
    (wc,) = poll_n(cq, 1)
    assert (wc.wr_id, wc.status) == (7, S.RETRY_EXC_ERR)
    assert time.monotonic() - t0 < 10


@pytest.mark.multiprocess
def test_multiprocess_soft_retries_outlast_a_short_pause(ctx: Context, res: Resources,
                                                         soft_child: Child) -> None:
    """soft: tries of the local ACK timer that end while the peer is paused use retries
    (``local_ack_timeouts``), and the WR completes once it answers again."""
    child = soft_child
    cq, qp, m = _soft_pair_with_a_child(ctx, res, child, timeout=15, retry_cnt=7)  # 134 ms a try, 8 tries
    assert qp.local_ack_timeouts == 0
    child.stop()
    qp.post_send([send(7, [sge(m, 0, 64)], WROpcode.RDMA_READ, remote_addr=child.info["addr"],
                       rkey=child.info["rkey"])])
    time.sleep(0.45)  # 3 tries end without an answer: 3 retries of 7 used
    os.kill(child.proc.pid, signal.SIGCONT)
    (wc,) = poll_n(cq, 1)
    assert (wc.wr_id, wc.status) == (7, S.SUCCESS)
    assert qp.local_ack_timeouts >= 1
    assert qp.state == QPState.RTS


@pytest.mark.multiprocess
def test_multiprocess_soft_retry_exc_only_after_the_last_retry(
        ctx: Context, res: Resources, soft_child: Child) -> None:
    """soft: RETRY_EXC_ERR comes on the try after the last of ``retry_cnt`` retries."""
    child = soft_child
    cq, qp, m = _soft_pair_with_a_child(ctx, res, child, timeout=15, retry_cnt=3)
    child.stop()
    qp.post_send([send(8, [sge(m, 0, 64)], WROpcode.RDMA_WRITE, remote_addr=child.info["addr"],
                       rkey=child.info["rkey"])])
    (wc,) = poll_n(cq, 1)
    assert (wc.wr_id, wc.status) == (8, S.RETRY_EXC_ERR)
    assert qp.local_ack_timeouts == 3


def test_soft_fork_child_starts_fresh(ctx: Context, provider_name: str) -> None:
    """A forked child does not inherit the parent's soft device (sockets, NIC thread)."""
    if provider_name != "soft" or not hasattr(os, "fork"):
        pytest.skip("soft provider on POSIX only")
    port = ctx.query_port(1).lid
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            from aiordma.verbs import open_context

            c = open_context(provider="soft")
            code = 0 if c.query_port(1).lid != port else 2
            c.close()
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    try:
        assert readable(r, WAIT_S)
        assert os.read(r, 1) == b"\0"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
