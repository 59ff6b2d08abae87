"""The compiled data path of the ``verbs`` provider (``verbs/ibverbs/fastpath.pyx``), on
the host: the provider's QPs and CQs over a fake pyverbs whose C structs are real memory
(``FakeVerbsABI``: a ``struct ibv_context`` whose ``ops.post_send``/``post_recv``/
``poll_cq`` are C callbacks that decode what they are given). The same objects on a real
device run in the Soft-RoCE VM (tests/rxe/), where the tier requires this path.

Skipped where the extension is not built (``make test-native`` builds it, and fails if
it cannot: ``AIORDMA_EXPECT_BUILD``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from _fake_pyverbs import (
    V4GID,
    FakePyverbsError,
    FakeVerbsABI,
    _pwc,
    _qp_setup,
    _to_rts,
    install_abi,
    install_fake,
)

from aiordma.errors import CQOverrunError, PostError, RDMAError
from aiordma.verbs import SGE, QPCap, QPState, RecvWR, SendFlags, SendWR, WCOpcode, WROpcode
from aiordma.verbs.contract import InvalidWorkRequest
from aiordma.verbs.ibverbs import clib, compat, loader

fastpath = loader.fastpath()
pytestmark = pytest.mark.skipif(
    fastpath is None, reason=f"the compiled data path is not built ({loader.fastpath_error()})")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from install_fake(monkeypatch)


@pytest.fixture
def abi(fake: Any, monkeypatch: pytest.MonkeyPatch) -> FakeVerbsABI:
    monkeypatch.delenv("AIORDMA_VERBS_POST", raising=False)
    monkeypatch.delenv("AIORDMA_VERBS_POLL", raising=False)
    return install_abi(fake, monkeypatch, qps=True)


def _rts_qp(fake: Any, cap: QPCap | None = None) -> Any:
    qp = _qp_setup(fake, cap)[-1]
    assert qp.data_path == "compiled" and "posts=compiled" in repr(qp)
    _to_rts(qp)
    return qp


def test_the_abi_the_ctypes_code_and_the_fakes_assume_is_the_headers() -> None:
    """compat's struct offsets (the ctypes paths, the pointer probes) and the layouts
    FakeVerbsABI decodes are those of the verbs.h the extension was compiled against."""
    assert fastpath is not None
    a = fastpath.abi()
    assert a["ibv_context.ops.poll_cq"] == compat.CTX_OPS_POLL_CQ_OFFSET
    assert a["ibv_context.ops.req_notify_cq"] == compat.CTX_OPS_REQ_NOTIFY_CQ_OFFSET
    assert a["ibv_context.ops.post_send"] == compat.CTX_OPS_POST_SEND_OFFSET
    assert a["ibv_context.ops.post_recv"] == compat.CTX_OPS_POST_RECV_OFFSET
    assert a["ibv_context.cmd_fd"] == compat.CTX_CMD_FD_OFFSET
    assert a["ibv_context.async_fd"] == compat.CTX_ASYNC_FD_OFFSET
    assert (a["ibv_qp.context"], a["ibv_qp.send_cq"], a["ibv_qp.recv_cq"], a["ibv_qp.qp_num"]) \
        == (0, compat.QP_SEND_CQ_OFFSET, compat.QP_RECV_CQ_OFFSET, compat.QP_QP_NUM_OFFSET)
    assert (a["ibv_cq.context"], a["ibv_cq.cq_context"]) == (0, compat.CQ_CQ_CONTEXT_OFFSET)
    assert a["sizeof ibv_wc"] == compat.IBV_WC.size and a["sizeof ibv_sge"] == 16
    # FakeVerbsABI._post_send / _post_recv
    assert [a[f"ibv_send_wr.{f}"] for f in ("wr_id", "next", "sg_list", "num_sge", "opcode",
                                            "send_flags", "imm_data")] == [0, 8, 16, 24, 28, 32, 36]
    assert (a["ibv_send_wr.wr.rdma.remote_addr"], a["ibv_send_wr.wr.rdma.rkey"]) == (40, 48)
    assert [a[f"ibv_send_wr.wr.atomic.{f}"] for f in ("remote_addr", "compare_add", "swap",
                                                      "rkey")] == [40, 48, 56, 64]
    assert [a[f"ibv_recv_wr.{f}"] for f in ("wr_id", "next", "sg_list", "num_sge")] \
        == [0, 8, 16, 24]


def test_a_chain_is_built_in_c_and_posted_once(abi: FakeVerbsABI, fake: Any) -> None:
    qp = _rts_qp(fake)
    wrs = [
        SendWR(1, WROpcode.SEND_WITH_IMM, [SGE(0x1000, 8, 5), SGE(0x2000, 4, 6)],
               imm_data=0x01020304, send_flags=0),
        SendWR(2, WROpcode.RDMA_WRITE, [], rkey=0x77, remote_addr=0x9000),
        SendWR(3, WROpcode.ATOMIC_FETCH_AND_ADD, [SGE(0x4000, 8, 5)], rkey=0x78,
               remote_addr=0xA008, compare_add=-1),
    ]
    qp.post_send(wrs)
    (w1, w2, w3), = abi.sends
    assert qp._qp.sends == []  # pyverbs never saw it
    assert [w["qp"] for w in (w1, w2, w3)] == [abi.qps[qp.qp_num]] * 3
    assert [w["wr_id"] for w in (w1, w2, w3)] == [1, 2, 3] and w3["next"] == 0
    assert w1["opcode"] == 3 and w1["send_flags"] == 0
    assert w1["sg"] == [(0x1000, 8, 5), (0x2000, 4, 6)]
    assert w1["imm_data"] == socket.htonl(0x01020304)  # the wire order, as pyverbs'
    assert w2["num_sge"] == 0 and w2["rdma"] == (0x9000, 0x77)
    assert w2["send_flags"] == int(SendFlags.SIGNALED)
    assert w3["atomic"] == (0x78, 0xA008, 0xFFFFFFFFFFFFFFFF, 0) and w3["sg"] == [(0x4000, 8, 5)]
    assert list(qp._queues.sq) == [(1, False, WCOpcode.SEND), (2, True, WCOpcode.RDMA_WRITE),
                                   (3, True, WCOpcode.FETCH_ADD)]


def test_single_posts_of_every_kind(abi: FakeVerbsABI, fake: Any) -> None:
    """One WR per post (every endpoint frame): the fields its opcode reads are set, even
    where the array slot held another opcode before."""
    qp = _rts_qp(fake)
    sge = SGE(0x1000, 8, 5)
    qp.post_send([SendWR(1, WROpcode.RDMA_WRITE_WITH_IMM, [sge], rkey=0x79,
                         remote_addr=0xB000, imm_data=7)])
    qp.post_send([SendWR(2, WROpcode.ATOMIC_CMP_AND_SWP, [sge], rkey=0x78,
                         remote_addr=0xA008, compare_add=5, swap=6)])
    qp.post_send([SendWR(3, WROpcode.SEND, [SGE(0x2000, 4, 5)], send_flags=SendFlags.INLINE)])
    qp._queues.reset()  # (their completions)
    qp.post_send([SendWR(4, WROpcode.RDMA_READ, [sge], rkey=0x7A, remote_addr=0xC000)])
    (a,), (b,), (c,), (d,) = abi.sends
    assert (a["opcode"], a["imm_data"], a["rdma"]) == (1, socket.htonl(7), (0xB000, 0x79))
    assert (b["opcode"], b["atomic"]) == (5, (0x78, 0xA008, 5, 6))
    assert (c["opcode"], c["send_flags"], c["sg"]) == (2, int(SendFlags.INLINE), [(0x2000, 4, 5)])
    assert (d["opcode"], d["rdma"], d["num_sge"]) == (4, (0xC000, 0x7A), 1)
    assert list(qp._queues.sq) == [(4, True, WCOpcode.RDMA_READ)]


def test_receives_and_a_refusal_at_bad_wr(abi: FakeVerbsABI, fake: Any) -> None:
    """A chain the device refuses at WR k: the k before it are posted and accounted for,
    the error is a PostError with the device's errno."""
    qp = _rts_qp(fake, QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=2, max_recv_sge=2,
                             max_inline_data=64))
    qp.post_recv([RecvWR(50, [SGE(0x3000, 64, 5)]), RecvWR(51, []),
                  RecvWR(52, [SGE(0x3040, 32, 5), SGE(0x3080, 32, 6)])])
    (r1, r2, r3), = abi.recvs
    assert [(r["wr_id"], r["num_sge"]) for r in (r1, r2, r3)] == [(50, 1), (51, 0), (52, 2)]
    assert r3["sg"] == [(0x3040, 32, 5), (0x3080, 32, 6)] and qp._qp.recvs == []
    assert list(qp._queues.rq) == [50, 51, 52]
    abi.fail_at, abi.fail_errno = 1, errno.ENOMEM
    with pytest.raises(PostError) as ei:
        qp.post_recv([RecvWR(60, [SGE(0x3000, 64, 5)]), RecvWR(61, [SGE(0x3000, 64, 5)])])
    assert ei.value.errno == errno.ENOMEM and list(qp._queues.rq) == [50, 51, 52, 60]
    ok = [SendWR(i, WROpcode.SEND, [SGE(0x1000, 8, 5)]) for i in (1, 2, 3)]
    abi.fail_at = 2
    with pytest.raises(PostError) as ei:
        qp.post_send(ok)
    assert ei.value.errno == errno.ENOMEM and [e[0] for e in qp._queues.sq] == [1, 2]
    abi.fail_at, abi.fail_errno = 0, errno.EINVAL
    with pytest.raises(PostError) as ei:
        qp.post_send(ok[:1])
    assert ei.value.errno == errno.EINVAL and len(qp._queues.sq) == 2


def test_the_arrays_grow_for_long_chains(abi: FakeVerbsABI, fake: Any) -> None:
    """Chains longer than the first allocation (16 WRs) grow both arrays up to the
    queue depth; every WR keeps its own SGE slots."""
    qp = _rts_qp(fake, QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=2,
                             max_recv_sge=2, max_inline_data=64))
    qp.post_send([SendWR(1, WROpcode.SEND, [SGE(0x100, 8, 5)])])
    sends = [SendWR(10 + i, WROpcode.SEND, [SGE(0x1000 + 64 * i, 8, 5),
                                             SGE(0x8000 + 64 * i, 4, 6)]) for i in range(40)]
    qp.post_send(sends)
    recvs = [RecvWR(100 + i, [SGE(0x20000 + 64 * i, 64, 7)]) for i in range(63)]
    qp.post_recv(recvs)
    assert [len(c) for c in abi.sends] == [1, 40] and [len(c) for c in abi.recvs] == [63]
    assert [w["wr_id"] for w in abi.sends[1]] == [10 + i for i in range(40)]
    assert [w["sg"] for w in abi.sends[1]] == [
        [(0x1000 + 64 * i, 8, 5), (0x8000 + 64 * i, 4, 6)] for i in range(40)]
    assert [(r["wr_id"], r["sg"]) for r in abi.recvs[0]] == [
        (100 + i, [(0x20000 + 64 * i, 64, 7)]) for i in range(63)]


def test_out_of_range_fields_post_nothing(abi: FakeVerbsABI, fake: Any) -> None:
    qp = _rts_qp(fake)
    bad = [SendWR(1, WROpcode.SEND, [SGE(0x1000, 8, 5)]),
           SendWR(2, WROpcode.SEND, [SGE(0x1000, 8, 1 << 32)])]
    for chain in (bad, bad[1:]):
        with pytest.raises(InvalidWorkRequest, match="out of range"):
            qp.post_send(chain)
    with pytest.raises(InvalidWorkRequest, match="out of range"):
        qp.post_recv([RecvWR(1, [SGE(-1, 8, 5)])])
    assert abi.sends == [] and abi.recvs == [] and not qp._queues.sq and not qp._queues.rq


def test_the_poster_refuses_what_would_overrun_its_arrays(abi: FakeVerbsABI, fake: Any) -> None:
    """Its own bounds, whatever the caller checked: no chain beyond the queue depth, no
    WR beyond the QP's SGEs; a closed poster posts nothing."""
    assert fastpath is not None
    qp = _rts_qp(fake)
    p = fastpath.QPPoster(abi.qps[qp.qp_num], 2, 2, 1, 1)
    one = SendWR(1, WROpcode.SEND, [SGE(0x1000, 8, 5)])
    with pytest.raises(ValueError, match="queue depth 2"):
        p.post_send([one] * 3, [WROpcode.SEND] * 3)
    with pytest.raises(ValueError, match="the QP takes 1"):
        p.post_send([SendWR(1, WROpcode.SEND, [SGE(0, 1, 1)] * 2)], [WROpcode.SEND])
    assert p.post_send([one, one], [WROpcode.SEND] * 2) == (0, 2)
    assert p.post_send_again(2) == (0, 2) and p.post_recv_again(1) == (errno.EINVAL, 0)
    p.close()
    assert p.closed and p.post_send([one], [WROpcode.SEND]) == (errno.EBADF, 0)
    assert [len(c) for c in abi.sends] == [2, 2]
    with pytest.raises(ValueError):
        fastpath.QPPoster(0, 1, 1, 1, 1)


def test_closing_a_qp_closes_its_poster(abi: FakeVerbsABI, fake: Any) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    poster = qp._fast
    assert poster is not None and not poster.closed
    qp.close()
    assert poster.closed and qp._qp.closed
    poller = cq._poller
    assert cq.data_path == "compiled"
    cq.close()
    assert poller.poll(4) == (0, ())  # closed: polls nothing


# -- the C-level operations (verbs/cverbs.pxd), what the message engine posts through ----
_SIG = int(SendFlags.SIGNALED)


def _cwr(wr_id: int, op: WROpcode, flags: int = _SIG, sge: tuple[int, int, int] = (0, 0, 0),
         imm: int = 0, rkey: int = 0, raddr: int = 0, add: int = 0, swap: int = 0) -> tuple:
    return (wr_id, int(op), flags, sge[0], sge[1], sge[2], imm, rkey, raddr, add, swap)


def test_the_c_level_posts_build_the_same_wrs_and_account_for_them(
        abi: FakeVerbsABI, fake: Any) -> None:
    """``IbvQP.c_ops()``: a capsule of C functions and the QP's poster, their first
    argument. A C work request becomes the ``struct ibv_send_wr`` the Python post makes
    (immediate data in wire order, the RDMA or atomic part its opcode reads, no SGE for
    a zero length), posted as one chain and recorded in the QP's queues."""
    assert fastpath is not None
    qp = _rts_qp(fake, QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=2, max_recv_sge=2,
                             max_inline_data=64))
    capsule, target = qp.c_ops()
    assert target is qp._fast and "qp_ops" in repr(capsule)
    fastpath._post_send_c(target, [
        _cwr(1 << 63 | 1, WROpcode.SEND_WITH_IMM, 0, (0x1000, 8, 5), imm=0x01020304),
        _cwr(2, WROpcode.RDMA_WRITE, rkey=0x77, raddr=0x9000),
        _cwr(3, WROpcode.ATOMIC_FETCH_AND_ADD, sge=(0x4000, 8, 5), rkey=0x78, raddr=0xA008,
             add=5)])
    (w1, w2, w3), = abi.sends
    assert qp._qp.sends == [] and [w["wr_id"] for w in (w1, w2, w3)] == [1 << 63 | 1, 2, 3]
    assert (w1["opcode"], w1["send_flags"], w1["sg"]) == (3, 0, [(0x1000, 8, 5)])
    assert w1["imm_data"] == socket.htonl(0x01020304)
    assert (w2["num_sge"], w2["rdma"], w2["send_flags"]) == (0, (0x9000, 0x77), _SIG)
    assert w3["atomic"] == (0x78, 0xA008, 5, 0)
    assert qp._queues.sq == ((1 << 63 | 1, False, WCOpcode.SEND),
                             (2, True, WCOpcode.RDMA_WRITE), (3, True, WCOpcode.FETCH_ADD))
    fastpath._post_recv_c(target, [(1 << 63 | 1 << 62 | 7, 0x3000, 64, 9)])
    (r,), = abi.recvs
    assert (r["wr_id"], r["sg"], r["num_sge"]) == (1 << 63 | 1 << 62 | 7, [(0x3000, 64, 9)], 1)
    assert qp._queues.rq == (1 << 63 | 1 << 62 | 7,)


def test_the_c_level_posts_refuse_as_the_python_ones(abi: FakeVerbsABI, fake: Any) -> None:
    """A QP not ready to send, a full queue, the device's refusal at ``bad_wr`` (those
    before it stay posted and accounted for), a closed QP: PostError with the errno
    the Python posts raise, nothing recorded that was not posted."""
    assert fastpath is not None
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    capsule, target = qp.c_ops()
    one = _cwr(1, WROpcode.SEND, sge=(0x1000, 8, 5))
    with pytest.raises(PostError, match="RESET") as ei:
        fastpath._post_send_c(target, [one])
    assert ei.value.errno == errno.EINVAL
    with pytest.raises(PostError, match="RESET"):
        fastpath._post_recv_c(target, [(1, 0x3000, 64, 9)])
    _to_rts(qp)
    with pytest.raises(PostError, match="send queue full") as ei:
        fastpath._post_send_c(target, [one] * 5)  # max_send_wr is 4
    assert ei.value.errno == errno.ENOMEM and abi.sends == []
    abi.fail_at, abi.fail_errno = 2, errno.ENOMEM
    with pytest.raises(PostError, match="ibv_post_send") as ei:
        fastpath._post_send_c(target, [_cwr(i, WROpcode.SEND) for i in (1, 2, 3)])
    assert ei.value.errno == errno.ENOMEM and [e[0] for e in qp._queues.sq] == [1, 2]
    abi.fail_at = None
    with pytest.raises(PostError, match="receive queue full"):
        fastpath._post_recv_c(target, [(i, 0x3000, 64, 9) for i in range(5)])
    qp.close()
    with pytest.raises(PostError, match="closed"):
        fastpath._post_send_c(target, [one])


def test_the_c_level_poll_accounts_and_names_what_failed(abi: FakeVerbsABI, fake: Any) -> None:
    """``IbvCQ.c_ops()``: completions polled into C structs, immediate data in host
    order, receive and send slots released in the QP's queues; an error completion gets
    the opcode of the WR it completes (verbs leaves it undefined) and moves the QP to
    ERR; an overrun fails the CQ, and its QPs, for good."""
    assert fastpath is not None
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    _to_rts(qp)
    capsule, target = cq.c_ops()
    assert target is cq._poller and "cq_ops" in repr(capsule)
    qpt = qp.c_ops()[1]
    fastpath._post_send_c(qpt, [_cwr(3, WROpcode.RDMA_READ, sge=(0x1000, 8, 5))])
    fastpath._post_recv_c(qpt, [(9, 0x3000, 64, 9)])
    pcq = cq._cq
    pcq.wcs.extend([_pwc(wr_id=3, opcode=2, byte_len=8, qp_num=qp.qp_num),
                    _pwc(wr_id=9, opcode=129, wc_flags=2, imm_data=socket.htonl(42),
                         byte_len=0, qp_num=qp.qp_num)])
    assert fastpath._poll_c(target, 8) == [(3, 0, 2, 8, 0, qp.qp_num, 0),
                                           (9, 0, 129, 0, 42, qp.qp_num, 2)]
    assert qp._queues.send_room() == 4 and qp._queues.recv_room() == 4
    fastpath._post_send_c(qpt, [_cwr(4, WROpcode.RDMA_READ, 0, (0x1000, 8, 5)),
                                _cwr(5, WROpcode.SEND)])
    pcq.wcs.extend([_pwc(wr_id=4, status=10, opcode=0, qp_num=qp.qp_num),
                    _pwc(wr_id=5, status=5, opcode=0, qp_num=qp.qp_num),
                    _pwc(wr_id=77, qp_num=0x999)])  # a QP not on this CQ: as is
    got = fastpath._poll_c(target, 8)
    assert [(w[0], w[1], w[2]) for w in got] == [
        (4, 10, int(WCOpcode.RDMA_READ)), (5, 5, int(WCOpcode.SEND)), (77, 0, 128)]
    assert qp._state is QPState.ERR and qp._queues.send_room() == 4
    assert fastpath._poll_c(target, 8) == []
    pcq.fail = FakePyverbsError("Failed to poll CQ", errno.EOVERFLOW)
    with pytest.raises(CQOverrunError):
        fastpath._poll_c(target, 8)
    pcq.fail = None
    with pytest.raises(CQOverrunError):  # forever, in Python too
        fastpath._poll_c(target, 8)
    with pytest.raises(CQOverrunError):
        cq.poll()
    qp.close()
    assert qp.qp_num not in target.tracked_qps()


def test_pyverbs_posts_where_asked(abi: FakeVerbsABI, fake: Any,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_VERBS_POST", "pyverbs")
    qp = _qp_setup(fake)[-1]
    assert qp._fast is None and qp.data_path == "pyverbs"
    _to_rts(qp)
    qp.post_send([SendWR(1, WROpcode.SEND, [SGE(0x1000, 8, 5)])])
    assert abi.sends == [] and len(qp._qp.sends) == 1


def test_arming_a_cq_is_one_c_call(abi: FakeVerbsABI, fake: Any) -> None:
    """``req_notify`` of a compiled CQ is ``ibv_req_notify_cq`` through the context's ops
    (pyverbs' CQ is never asked); the device's errno is raised; a closed CQ refuses."""
    cq = _qp_setup(fake)[3]
    assert cq.data_path == "compiled"
    cq.req_notify()
    cq.req_notify(solicited_only=True)
    assert abi.arms == [(cq._cq_ptr, 0), (cq._cq_ptr, 1)] and cq._cq.armed == 0
    abi.arm_errno = errno.EINVAL
    with pytest.raises(RDMAError) as ei:
        cq.req_notify()
    assert ei.value.errno == errno.EINVAL
    abi.arm_errno = 0
    cq._poller.close()  # (as IbvCQ.close does once its struct is gone)
    with pytest.raises(RDMAError) as ei:
        cq.req_notify()
    assert ei.value.errno == errno.EBADF and len(abi.arms) == 3


class _CLibEvents:
    """C functions standing in for libibverbs' ``ibv_get_cq_event``/``ibv_ack_cq_events``
    (ctypes callbacks, addressable as a CDLL's functions are): ``events`` are served in
    order, then ``errno`` ``fail``."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.acked: list[tuple[int, int]] = []
        self.fail = errno.EAGAIN
        self.channels: list[int] = []
        get_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, use_errno=True)
        ack_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint)
        self.ibv_get_cq_event = get_t(self._get)
        self.ibv_ack_cq_events = ack_t(self._ack)

    def _get(self, channel: int, cq_out: int, ctx_out: int) -> int:
        self.channels.append(channel)
        if not self.events:
            ctypes.set_errno(self.fail)
            return -1
        cq, ctx = self.events.pop(0)
        ctypes.c_void_p.from_address(cq_out).value = cq
        ctypes.c_void_p.from_address(ctx_out).value = ctx
        return 0

    def _ack(self, cq: int, n: int) -> None:
        self.acked.append((cq, n))


def test_channel_events_are_read_and_acked_in_c() -> None:
    assert fastpath is not None
    lib = _CLibEvents()
    get_fn = clib.function_address(lib, "ibv_get_cq_event")
    ack_fn = clib.function_address(lib, "ibv_ack_cq_events")
    assert get_fn and ack_fn
    r = fastpath.ChannelEvents(0x500, get_fn, ack_fn)
    lib.events = [(0x1000, 0xAA), (0x2000, 0xBB)]
    assert r.get() == (0x1000, 0xAA) and r.get() == (0x2000, 0xBB) and r.get() is None
    assert lib.channels == [0x500] * 3
    r.ack(0x1000, 2)
    assert lib.acked == [(0x1000, 2)]
    lib.fail = errno.EBADF
    with pytest.raises(OSError) as ei:
        r.get()
    assert ei.value.errno == errno.EBADF and "EBADF" in str(ei.value)
    with pytest.raises(ValueError):
        fastpath.ChannelEvents(0, get_fn, ack_fn)
    with pytest.raises(ValueError):
        r.ack(0, 1)


def test_a_channel_reads_its_events_in_c(monkeypatch: pytest.MonkeyPatch, fake: Any) -> None:
    """With libibverbs' functions addressable, a located channel reads through
    ``fastpath.ChannelEvents`` (``AIORDMA_VERBS_POLL=ctypes``: through ctypes), and its
    CQs' events are acknowledged there."""
    from aiordma.verbs.ibverbs import channel as ibv_channel

    lib = _CLibEvents()
    monkeypatch.setattr(clib, "libibverbs", lambda: lib)
    orig_locate = ibv_channel.IbvCompChannel._locate
    monkeypatch.setattr(ibv_channel.IbvCompChannel, "_locate",
                        lambda self, before: (orig_locate(self, before)[0], 0x7000))
    ctx = _qp_setup(fake)[0]
    ch = ctx.create_comp_channel()
    assert isinstance(ch._reader, fastpath.ChannelEvents)
    cq = ctx.create_cq(8, ch)
    lib.events = [(0x100, id(cq._token))]
    assert ch.get_event() is cq and ch.get_event() is None
    cq.ack_events(1)
    assert lib.acked == [(0x100, 1)] and lib.channels == [0x7000] * 2
    monkeypatch.setenv("AIORDMA_VERBS_POLL", "ctypes")
    assert isinstance(ctx.create_comp_channel()._reader, clib.ChannelReader)


def test_a_channel_s_event_reader_is_compiled(monkeypatch: pytest.MonkeyPatch,
                                              fake: Any) -> None:
    """``event_reader()`` of a channel read through ``fastpath.ChannelEvents`` is its
    ``next_cq``: get_event's contract in C (the CQ's event counted, an unknown CQ's
    event acknowledged and skipped, errors as RDMAError, nothing once closed); through
    ctypes it is the method itself."""
    from aiordma.verbs.ibverbs import channel as ibv_channel

    lib = _CLibEvents()
    monkeypatch.setattr(clib, "libibverbs", lambda: lib)
    orig_locate = ibv_channel.IbvCompChannel._locate
    monkeypatch.setattr(ibv_channel.IbvCompChannel, "_locate",
                        lambda self, before: (orig_locate(self, before)[0], 0x7000))
    ctx = _qp_setup(fake)[0]
    ch = ctx.create_comp_channel()
    read = ch.event_reader()
    assert read == ch._reader.next_cq
    cq = ctx.create_cq(8, ch)
    lib.events = [(0x300, 0xDEAD), (0x100, id(cq._token))]
    assert read() is cq and cq._events.got == 1 and cq._events.cq_ptr == 0x100
    assert isinstance(cq._events, fastpath.CQEvents)
    assert lib.acked == [(0x300, 1)]  # not one of ours: acknowledged, skipped
    assert read() is None
    cq.ack_events(1)
    lib.fail = errno.EBADF
    with pytest.raises(RDMAError) as ei:
        read()
    assert ei.value.errno == errno.EBADF
    lib.fail = errno.EAGAIN
    cq.close()
    real_close = ch._cc.close

    def refused() -> None:
        raise ctx._pv.Error("ibv_destroy_comp_channel refused")

    ch._cc.close = refused
    with pytest.raises(RDMAError):
        ch.close()
    calls = len(lib.channels)
    assert read() is None and len(lib.channels) == calls + 1  # not destroyed: still read
    ch._cc.close = real_close
    ch.close()
    calls = len(lib.channels)
    assert read() is None and len(lib.channels) == calls  # closed: libibverbs not called
    assert ch._reader.get() is None and len(lib.channels) == calls
    monkeypatch.setenv("AIORDMA_VERBS_POLL", "ctypes")
    other = ctx.create_comp_channel()
    assert other.event_reader() == other.get_event


def test_a_cq_s_notifier_is_compiled(abi: FakeVerbsABI, fake: Any) -> None:
    """``notifier()`` of a compiled CQ is its poller's ``notify``: req_notify() in C,
    the device's errno raised as RDMAError, EBADF once closed."""
    cq = _qp_setup(fake)[3]
    assert cq.data_path == "compiled"
    arm = cq.notifier()
    assert arm == cq._poller.notify
    arm()
    assert abi.arms == [(cq._cq_ptr, 0)]
    abi.arm_errno = errno.EINVAL
    with pytest.raises(RDMAError) as ei:
        arm()
    assert ei.value.errno == errno.EINVAL
    abi.arm_errno = 0
    cq._poller.close()
    with pytest.raises(RDMAError) as ei:
        arm()
    assert ei.value.errno == errno.EBADF


def test_no_struct_found_means_pyverbs(fake: Any) -> None:
    """The pointer probe finds nothing (here: no context struct): pyverbs posts."""
    qp = _qp_setup(fake)[-1]
    assert qp._fast is None and qp.data_path == "pyverbs"


def test_a_device_s_objects_use_the_compiled_path(provider_name: str) -> None:
    """On a real device (the Soft-RoCE VM), the pointer probes find the ``struct
    ibv_qp``/``ibv_cq`` of pyverbs' objects: where the run requires the compiled verbs
    path (``AIORDMA_EXPECT_BUILD``, as the VM tier does), every QP and CQ uses it."""
    if provider_name != "verbs":
        pytest.skip("needs the verbs provider on a device")
    if "verbs" not in os.environ.get("AIORDMA_EXPECT_BUILD", "").split(","):
        pytest.skip("this run does not require the compiled verbs path")
    from aiordma.verbs import open_context

    ctx: Any = open_context(provider="verbs")
    try:
        pd = ctx.alloc_pd()
        scq, rcq = ctx.create_cq(16), ctx.create_cq(16, ctx.create_comp_channel())
        qp = pd.create_qp(scq, rcq, QPCap(max_send_wr=4, max_recv_wr=4))
        assert (qp.data_path, scq.data_path, rcq.data_path) == ("compiled",) * 3, (
            qp, scq, rcq)
        assert qp._fast.qp_ptr != 0
        # the message engine's C path: both offer their C-level operations
        assert qp.c_ops()[1] is qp._fast and rcq.c_ops()[1] is rcq._poller
        # the wake-up path too: events read and acknowledged, the CQ armed, in C
        assert isinstance(rcq.channel._reader, fastpath.ChannelEvents), rcq.channel._reader
        assert rcq._arm is not None
        rcq.req_notify()
        assert rcq.channel.get_event() is None  # nothing completed: no event
        # ... and the reactor's calls of every wake-up are the compiled ones
        rcq.notifier()()
        assert rcq.channel.event_reader()() is None
        assert rcq.notifier() == rcq._poller.notify
        qp.close()
        for obj in (scq, rcq, rcq.channel, pd):
            obj.close()
    finally:
        ctx.close()


# -- INIT -> RTR in C ----------------------------------------------------------------------
# enum ibv_qp_attr_mask (verbs.h): STATE, AV, PATH_MTU, RQ_PSN, MIN_RNR_TIMER,
# MAX_DEST_RD_ATOMIC, DEST_QPN
_RTR_MASK = 1 << 0 | 1 << 7 | 1 << 8 | 1 << 12 | 1 << 15 | 1 << 17 | 1 << 20


def test_init_to_rtr_is_one_ibv_modify_qp_call_made_in_c(abi: FakeVerbsABI, fake: Any) -> None:
    """The compiled path moves a QP to RTR with one ibv_modify_qp of its own (the struct
    filled in C at the headers' offsets, the attributes clamped as the pyverbs path
    clamps them); pyverbs' modify is not called for it."""
    qp = _rts_qp(fake)
    assert qp.modify_releases_gil
    (m,) = abi.modifies
    assert (m["qp_state"], m["path_mtu"], m["dest_qp_num"], m["rq_psn"]) == (2, 3, 0x22, 7)
    assert m["max_dest_rd_atomic"] == 8  # the device's max_qp_rd_atom
    assert (m["ah_attr.is_global"], m["ah_attr.grh.sgid_index"], m["ah_attr.grh.hop_limit"],
            m["ah_attr.port_num"], m["ah_attr.dlid"]) == (1, 1, 64, 1, 0)
    assert m["ah_attr.grh.dgid"] == compat.gid_from_str(V4GID)
    assert m["mask"] == _RTR_MASK and m["qp"] == qp._fast.qp_ptr
    assert [a.qp_state for a, _ in qp._qp.modified] == [1, 3]  # INIT, RTS through pyverbs


def test_a_failed_rtr_raises_its_errno_and_leaves_the_qp_in_init(abi: FakeVerbsABI,
                                                                  fake: Any) -> None:
    from aiordma.errors import RDMAError
    from aiordma.verbs import MTU, Access, AHAttr, QPAttr, QPState
    qp = _qp_setup(fake)[-1]
    qp.modify(QPAttr(QPState.INIT, qp_access_flags=Access.LOCAL_WRITE))
    abi.modify_errno = errno.ETIMEDOUT  # no ARP answer for the destination
    with pytest.raises(RDMAError) as info:
        qp.modify(QPAttr(QPState.RTR, path_mtu=MTU.MTU_1024, dest_qp_num=5,
                         ah_attr=AHAttr(dgid=compat.gid_from_str(V4GID), sgid_index=1)))
    assert info.value.errno == errno.ETIMEDOUT and "INIT->RTR" in str(info.value)
    assert qp.state == QPState.INIT


def test_modify_rtr_releases_the_gil_for_the_call() -> None:
    """``modify_rtr`` calls the function it is given with the GIL released: here libc's
    ``usleep``, which takes the "QP pointer" (its first argument) as microseconds. A
    thread holding the GIL for the call would keep this one from running until it ended,
    and then set ``done`` before giving the GIL up."""
    import ctypes
    import threading
    import time
    assert fastpath is not None
    usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
    assert usleep
    poster = fastpath.QPPoster(900_000, 1, 1, 1, 1)  # 0.9 s
    entered, done = threading.Event(), threading.Event()
    rcs: list[int] = []

    def call() -> None:
        entered.set()
        rcs.append(poster.modify_rtr(usleep, 3, 1, 0, 0, 0, bytes(16), 1, 0, 0, 0, 64, 1))
        done.set()
    t = threading.Thread(target=call)
    t.start()
    assert entered.wait(10)
    time.sleep(0.1)  # returns while the call runs only if the GIL was released
    ran_meanwhile = not done.is_set()
    t.join(10)
    assert ran_meanwhile and rcs == [0]
    with pytest.raises(ValueError):
        poster.modify_rtr(usleep, 3, 1, 0, 0, 0, bytes(15), 1, 0, 0, 0, 64, 1)
    with pytest.raises(ValueError):
        poster.modify_rtr(0, 3, 1, 0, 0, 0, bytes(16), 1, 0, 0, 0, 64, 1)
    poster.close()
    assert poster.modify_rtr(usleep, 3, 1, 0, 0, 0, bytes(16), 1, 0, 0, 0, 64, 1) == errno.EBADF
