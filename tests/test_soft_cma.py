"""The soft device's same-host cross-memory attach (``aiordma.verbs.soft.cma``): large
RDMA WRITE/READ copied once between the two processes, with the verbs semantics of the
socket path (validation, error statuses, ordering) and a permanent fallback to the
socket when the probe fails."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

import pytest
import test_verbs_provider
from test_verbs_provider import (
    ACC_ALL,
    WAIT_S,
    Child,
    Pair,
    Resources,
    poll_n,
    send,
    sge,
    statuses,
    wait_state,
)

from aiordma.verbs import CQ, PD, QP, Context, QPCap, QPState, RecvWR, WROpcode
from aiordma.verbs import WCStatus as S
from aiordma.verbs.soft import cma
from aiordma.verbs.soft._core import CMA_OFF, CMA_ON

pytestmark = pytest.mark.skipif(
    os.environ.get("AIORDMA_PROVIDER", "soft") != "soft" or not cma.enabled(),
    reason="the soft provider's CMA (Linux)")

MiB = 1 << 20
res = test_verbs_provider.res  # the fixture


@pytest.fixture(autouse=True)
def _cma_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_SOFT_CMA", "1")
    monkeypatch.delenv("AIORDMA_SOFT_CMA_MIN", raising=False)
    monkeypatch.delenv("AIORDMA_SOFT_UNIX", raising=False)


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(256)) * (n // 256)


def _roundtrip(p: Pair, size: int = MiB) -> None:
    """A WRITE then a READ of ``size`` bytes a -> b -> a, checked."""
    ma, ba = p.mr("a", 2 * size)
    mb, bb = p.mr("b", size)
    ba[:size] = _pattern(size, 1)
    p.a.post_send([
        send(1, [sge(ma, 0, size)], WROpcode.RDMA_WRITE, remote_addr=mb.addr, rkey=mb.rkey),
        send(2, [sge(ma, size, size)], WROpcode.RDMA_READ, remote_addr=mb.addr, rkey=mb.rkey),
    ])
    assert statuses(poll_n(p.cq_a, 2)) == [S.SUCCESS, S.SUCCESS]
    assert bb == ba[:size] == ba[size:]


def _cma_state(qp: object) -> int:
    conn = qp._req_conn  # type: ignore[attr-defined]
    assert conn is not None
    return int(conn.cma)


def test_in_process_write_read_use_cma(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    _roundtrip(p)  # the first request probes; later ones use CMA
    before = cma.copies
    _roundtrip(p, 4 * MiB)
    assert _cma_state(p.a) == CMA_ON
    assert cma.copies - before == 2


def test_cma_scatter_gather_and_ordering(ctx: Context, res: Resources) -> None:
    """Several SGEs; a SEND after a WRITE finds the data in place; READ/WRITE complete
    in order."""
    p = Pair(ctx, res, cap=QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=4,
                                 max_recv_sge=4))
    _roundtrip(p)
    ma, ba = p.mr("a", 3 * MiB)
    mb, bb = p.mr("b", 3 * MiB)
    ba[:] = _pattern(3 * MiB, 5)
    seen: list[bytes] = []
    p.b.post_recv([RecvWR(7, [sge(mb, 0, 64)])])
    p.a.post_send([
        send(1, [sge(ma, 2 * MiB, MiB), sge(ma, 0, 2 * MiB)], WROpcode.RDMA_WRITE,
             remote_addr=mb.addr, rkey=mb.rkey),
        send(2, [sge(ma, 0, 8)]),  # lands over the first 8 bytes after the WRITE
        send(3, [sge(ma, MiB, MiB), sge(ma, 0, MiB)], WROpcode.RDMA_READ,
             remote_addr=mb.addr + MiB, rkey=mb.rkey),
    ])
    wcs = poll_n(p.cq_a, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, S.SUCCESS), (2, S.SUCCESS), (3, S.SUCCESS)]
    (wb,) = poll_n(p.cq_b, 1)
    seen.append(bytes(bb[:8]))
    assert wb.status == S.SUCCESS and seen == [bytes(ba[:8])]
    assert bb[8:MiB] == ba[2 * MiB + 8:3 * MiB] and bb[MiB:] == ba[:2 * MiB]
    assert _cma_state(p.a) == CMA_ON


@pytest.mark.parametrize("case", ["bad_rkey", "outside_mr", "no_remote_rights"])
@pytest.mark.parametrize("op", [WROpcode.RDMA_WRITE, WROpcode.RDMA_READ])
def test_cma_remote_access_errors(ctx: Context, res: Resources, case: str,
                                  op: WROpcode) -> None:
    p = Pair(ctx, res)
    _roundtrip(p)
    assert _cma_state(p.a) == CMA_ON
    ma, _ = p.mr("a", MiB)
    mb, _ = p.mr("b", MiB)
    raddr, rkey = mb.addr, mb.rkey
    if case == "bad_rkey":
        rkey ^= 0x777700
    elif case == "outside_mr":
        raddr += 4096
    else:
        from aiordma.verbs import Access

        m, _ = p.mr("b", MiB, Access.LOCAL_WRITE)
        raddr, rkey = m.addr, m.rkey
    before = cma.copies
    p.a.post_send([send(1, [sge(ma)], op, remote_addr=raddr, rkey=rkey),
                   send(2, [sge(ma, 0, 16)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                        rkey=mb.rkey)])
    assert statuses(poll_n(p.cq_a, 2)) == [S.REM_ACCESS_ERR, S.WR_FLUSH_ERR]
    wait_state(p.a, QPState.ERR)
    wait_state(p.b, QPState.ERR)
    assert cma.copies == before  # refused before any copy


def test_probe_refused_falls_back_for_good(ctx: Context, res: Resources,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma, "probe", lambda pid, addr, cookie: False)
    p = Pair(ctx, res)
    before = cma.copies
    for _ in range(3):
        _roundtrip(p)
    assert _cma_state(p.a) == CMA_OFF
    assert cma.copies == before


def test_disabled_by_env(ctx: Context, res: Resources, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_SOFT_CMA", "0")
    p = Pair(ctx, res)
    before = cma.copies
    _roundtrip(p)
    _roundtrip(p)
    assert _cma_state(p.a) == CMA_OFF and cma.copies == before


@pytest.mark.parametrize("op", [WROpcode.RDMA_WRITE, WROpcode.RDMA_READ])
def test_failed_copy_is_a_remote_operation_error(ctx: Context, res: Resources,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 op: WROpcode) -> None:
    """The requester's memory vanished under the copy (EFAULT): a remote operational
    error, the connection fails as after any error, nothing crashes."""
    p = Pair(ctx, res)
    _roundtrip(p)
    monkeypatch.setattr(cma, "copy", lambda *a, **k: errno.EFAULT)
    ma, _ = p.mr("a", MiB)
    mb, _ = p.mr("b", MiB)
    p.a.post_send([send(1, [sge(ma)], op, remote_addr=mb.addr, rkey=mb.rkey),
                   send(2, [sge(ma, 0, 16)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                        rkey=mb.rkey)])
    assert statuses(poll_n(p.cq_a, 2)) == [S.REM_OP_ERR, S.WR_FLUSH_ERR]
    wait_state(p.a, QPState.ERR)


def test_min_size_threshold(ctx: Context, res: Resources, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_SOFT_CMA_MIN", str(2 * MiB))
    p = Pair(ctx, res)
    _roundtrip(p)
    before = cma.copies
    _roundtrip(p)  # 1 MiB: below the threshold
    assert cma.copies == before
    _roundtrip(p, 2 * MiB)
    assert cma.copies == before + 2


@contextlib.contextmanager
def child_qp(ctx: Context, res: Resources, monkeypatch: pytest.MonkeyPatch,
             peer_mr: int) -> Iterator[tuple[Child, PD, CQ, QP]]:
    """A QP of this process connected to one of a child process (``verbs_peer.py``)
    that exposes a ``peer_mr``-byte MR (``child.info["addr"]``/``["rkey"]``); the child
    is killed at the end."""
    monkeypatch.setenv("AIORDMA_TEST_PEER_MR", str(peer_mr))
    child = Child("soft")
    try:
        pd = res.add(ctx.alloc_pd())
        cq = res.add(ctx.create_cq(64))
        qp = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
        child.connect(ctx, qp, timeout=14, retry_cnt=7)
        yield child, pd, cq, qp
    finally:
        child.kill()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_multiprocess_write_read_several_mib(ctx: Context, res: Resources,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    size = 8 * MiB
    with child_qp(ctx, res, monkeypatch, size) as (child, pd, cq, qp):
        buf = bytearray(2 * size)
        m = res.add(pd.reg_mr(buf, ACC_ALL))
        raddr, rkey = child.info["addr"], child.info["rkey"]
        for seed in range(3):
            buf[:size] = _pattern(size, seed)
            qp.post_send([
                send(1, [sge(m, 0, size)], WROpcode.RDMA_WRITE, remote_addr=raddr, rkey=rkey),
                send(2, [sge(m, size, size)], WROpcode.RDMA_READ, remote_addr=raddr,
                     rkey=rkey),
            ])
            assert statuses(poll_n(cq, 2, WAIT_S * 3)) == [S.SUCCESS, S.SUCCESS]
            assert buf[size:] == buf[:size]
        assert _cma_state(qp) == CMA_ON
        # the child's MR ends at raddr + size: one byte more is refused, as ever
        qp.post_send([send(3, [sge(m, 0, MiB)], WROpcode.RDMA_READ,
                           remote_addr=raddr + size - MiB + 1, rkey=rkey)])
        assert statuses(poll_n(cq, 1)) == [S.REM_ACCESS_ERR]
